"""1-bit LAMB's gradient sync (`zeroflax/optim/onebit_lamb.py`): 1-bit Adam's (`step/onebit_sync.py`), with
DeepSpeed's one buffer for all leaves instead of one per leaf.

DeepSpeed's OnebitLamb flattens every momentum into one buffer, so each worker compresses all of them with
one scale. Leaves whose momenta differ by orders of magnitude would then lose the small ones to the sign
noise of the large: DeepSpeed multiplies each leaf's momentum by `scaling_coeff` (the mean over leaves of
the momentum RMS, over this leaf's), measured once on the warm-up's last momentum, before the exchange and
divides it out after. This sync does the same, in phase 'first' (the first compressed step, which also
all-gathers the warm-up's momentum at stages 1-2), and keeps the coefficients in its state.

The buffer (`UnitedLayout`): row i is what device i serves. Leaves kept whole on every device are
flattened, concatenated in leaf order and zero-padded at the end to a multiple of N lcm(N, 8), as
DeepSpeed's buffer (at stage 0 it is exactly DeepSpeed's); each leaf whose optimizer state ZeRO partitions
(stages 1-2) adds its shard rows after them, so that a server's row holds the shards whose state it keeps.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from zeroflax.kernels.onebit_pack import unpack_signs
from zeroflax.sharding.collectives import cut_padding
from zeroflax.step.onebit_sync import (COMPRESSED, FIRST, WARMUP, Layout, LeafSync, OneBitSync, is_layout,
                                       exchange_rows)
from zeroflax.step.zero_sync import unscale


@dataclasses.dataclass(frozen=True)
class UnitedLayout:
    """All leaves (`layouts`, in leaf order) as one buffer of `rows` x `cols`."""

    layouts: tuple[Layout, ...]

    @property
    def rows(self) -> int:
        return self.layouts[0].rows

    @property
    def whole(self) -> list[int]:
        return [i for i, l in enumerate(self.layouts) if l.zero_dim is None]

    @property
    def whole_cols(self) -> int:
        """C0: the columns of the whole leaves' segment (0 when there is none)."""
        n = self.rows
        size = sum(self.layouts[i].size for i in self.whole)
        multiple = n * (n * 8 // math.gcd(n, 8))
        return -(-size // multiple) * multiple // n

    @property
    def spans(self) -> list[tuple[int, int]]:
        """Per leaf, its columns [start, stop) in the buffer (a whole leaf: the whole segment's)."""
        spans, start = [], self.whole_cols
        for l in self.layouts:
            if l.zero_dim is None:
                spans.append((0, self.whole_cols))
            else:
                spans.append((start, start + l.cols))
                start += l.cols
        return spans

    @property
    def cols(self) -> int:
        return self.whole_cols + sum(l.cols for l in self.layouts if l.zero_dim is not None)

    @property
    def partitioned(self) -> bool:
        return len(self.whole) < len(self.layouts)

    def to_rows(self, leaves):
        n = self.rows
        parts = []
        if self.whole:
            flat = jnp.concatenate([leaves[i].reshape(-1) for i in self.whole])
            parts.append(jnp.pad(flat, (0, n * self.whole_cols - flat.shape[0])).reshape(n, self.whole_cols))
        parts += [l.to_rows(x) for l, x in zip(self.layouts, leaves) if l.zero_dim is not None]
        return jnp.concatenate(parts, axis=1)

    def whole_leaves(self, segment):
        """The whole leaves (true shapes; None for the partitioned) from the whole segment's rows."""
        flat = segment.reshape(-1)
        out, offset = [None] * len(self.layouts), 0
        for i in self.whole:
            l = self.layouts[i]
            out[i] = flat[offset:offset + l.size].reshape(l.shape)
            offset += l.size
        return out


class LambSyncState(NamedTuple):
    buffer: LeafSync  # the united buffer's errors (and, with partitioned leaves, the last exchange's bits)
    scaling: Any  # params structure: each leaf's scaling_coeff (float32; 0 until phase 'first' measures it)
    exchanged_at: jax.Array  # int32: as SyncState's


@dataclasses.dataclass(frozen=True)
class OneBitLambSync(OneBitSync):
    """The engine's gradient sync under 1-bit LAMB (fields: OneBitSync's)."""

    @property
    def united(self) -> UnitedLayout:
        return UnitedLayout(tuple(jax.tree.leaves(self.layouts, is_leaf=is_layout)))

    @property
    def phases(self) -> tuple[str, ...]:
        return (WARMUP, FIRST, COMPRESSED)  # 'first' measures the scaling coefficients, at every stage

    def pick(self, step: int, view: tuple[int, int]) -> str:
        applied, exchanged_at = view
        if applied < self.settings.freeze_step:
            return WARMUP
        if exchanged_at < 0 or (self.partitioned and exchanged_at != applied - 1):
            return FIRST
        return COMPRESSED

    def buffer_cols(self) -> list[int]:
        return [self.united.cols]

    def init_state(self) -> LambSyncState:
        n, c = self.data_size, self.united.cols
        packed = self.united.partitioned
        buffer = LeafSync(jnp.zeros((n, n, c), jnp.float32), jnp.zeros((n, c), jnp.float32),
                          jnp.zeros((n, c // 8), jnp.uint8) if packed else None,
                          jnp.zeros((n,), jnp.float32) if packed else None)
        scaling = jax.tree.map(lambda _: jnp.zeros((), jnp.float32), self.layouts, is_leaf=is_layout)
        return LambSyncState(buffer, scaling, jnp.asarray(-1, jnp.int32))

    def specs(self) -> LambSyncState:
        packed = self.united.partitioned
        buffer = LeafSync(P(self.axis), P(self.axis), P() if packed else None, P() if packed else None)
        return LambSyncState(buffer, jax.tree.map(lambda _: P(), self.layouts, is_leaf=is_layout), P())

    def state_bytes(self) -> int:
        n, c = self.data_size, self.united.cols
        bits = n * (c // 8 + 4) if self.united.partitioned else 0
        return 4 * n * c + 4 * c + bits + 4 * len(self.united.layouts) + 4

    def final(self, grads, inputs, phase: str, scale=1.0):
        """As OneBitSync.final; the scaling coefficients are measured in phase 'first' only."""
        if phase == WARMUP:
            return self.zero.final(grads, scale=scale)
        momentum, sync_state, norm = self.exchanged(unscale(grads, scale), *inputs, measure=phase == FIRST)
        return momentum, (sync_state, norm)

    def exchanged(self, grads, mu_prev, sync: LambSyncState, step, measure: bool = False):
        """Compressed phases, per device: as OneBitSync.exchanged, through one buffer scaled per leaf;
        `measure`: take the scaling coefficients that are not yet set (0) from the last momentum."""
        s = self.settings
        united = self.united
        local, norm = self.local_gradients(grads)
        treedef = jax.tree.structure(self.layouts, is_leaf=is_layout)
        layouts = united.layouts
        prev = treedef.flatten_up_to(mu_prev)
        scaling = treedef.flatten_up_to(sync.scaling)
        buffer = sync.buffer
        if any(m is None for m in prev):  # the last exchange's result (scaled), from its bits
            rows = unpack_signs(buffer.bits, buffer.scales, average=False, impl=self.impl)
            prev = [m if m is not None else l.from_rows(rows[:, a:b]) / c
                    for l, m, (a, b), c in zip(layouts, prev, united.spans, scaling)]
        prev = [cut_padding(m, l.zero_dim, l.pad) if l.zero_dim is not None and m.shape != l.shape else m
                for l, m in zip(layouts, prev)]
        if measure:
            scaling = [jnp.where(c > 0, c, m) for c, m in zip(scaling, _scaling_coeffs(prev))]
        local_momentum = [(s.b1 * m + (1 - s.b1) * g) * c for m, g, c in zip(prev, jax.tree.leaves(local), scaling)]
        if self.data_size == 1:  # DeepSpeed does not compress with one worker
            momentum = [m / c for m, c in zip(local_momentum, scaling)]
            new_buffer = buffer
        else:
            all_bits, all_scales, mine, worker_error, server_error = exchange_rows(
                united.to_rows(local_momentum), buffer.worker_error[0], buffer.server_error[0], self.axis, self.impl)
            whole = united.whole_leaves(unpack_signs(all_bits[:, :united.whole_cols // 8], all_scales,
                                                     average=False, impl=self.impl)) if united.whole else None
            momentum = []
            for i, (l, (a, b), c) in enumerate(zip(layouts, united.spans, scaling)):
                result = whole[i] if l.zero_dim is None else l.shard_of_row(mine[a:b])
                momentum.append(result / c)
            new_buffer = LeafSync(worker_error[None], server_error[None],
                                  all_bits if buffer.bits is not None else None,
                                  all_scales if buffer.scales is not None else None)
        new_sync = LambSyncState(new_buffer, treedef.unflatten(scaling), jnp.asarray(step, jnp.int32))
        return treedef.unflatten(momentum), new_sync, norm


def _scaling_coeffs(momenta) -> list:
    """DeepSpeed's scaling_coeff per leaf: the mean over leaves of RMS(m) over this leaf's RMS(m); 1 for a leaf
    whose momentum is all zeros (DeepSpeed would divide by zero)."""
    rms = [jnp.sqrt(jnp.sum(jnp.square(m))) / np.float32(math.sqrt(max(m.size, 1))) for m in momenta]
    mean = sum(rms[1:], rms[0]) / np.float32(len(rms))
    return [jnp.where(r > 0, mean / jnp.where(r > 0, r, 1), jnp.float32(1)) for r in rms]
