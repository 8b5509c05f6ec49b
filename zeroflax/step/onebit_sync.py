"""1-bit Adam's gradient sync: the step's `GradSync` part (`zeroflax/step/parts.py`) when the optimizer is
`zeroflax.optim.onebit_adam` (the update itself and the algorithm: `zeroflax/optim/onebit.py`).

Its phases: 'warmup' (ZeRO's sync: the mean gradient), then 'compressed': each device updates the
momentum with its local gradient and exchanges it compressed (`exchange`); at stages 1-2 the first
compressed step is 'first', which all-gathers the warm-up's fp32 momentum once. The update receives the
exchanged momentum (`Synced.extra`: `momentum=`) and the gradient norm the sync measured.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zeroflax.kernels.onebit_pack import pack_signs, unpack_signs
from zeroflax.optim.clipping import clip_to, global_norm
from zeroflax.optim.onebit import OneBitAdam, OneBitSettings
from zeroflax.sharding.collectives import add_padding, cut_padding
from zeroflax.sharding.mesh import DATA_AXIS
from zeroflax.sharding.ordered import mean_all
from zeroflax.sharding.policy import ZERO_PARTITIONED, is_placement
from zeroflax.step.parts import Synced
from zeroflax.step.zero_sync import unscale

WARMUP, FIRST, COMPRESSED = "warmup", "first", "compressed"


# ------------------------------------------------------------------------------------------ the layout
@dataclasses.dataclass(frozen=True)
class Layout:
    """A leaf of `shape` as `rows` x `cols` (row i: the chunk device i serves). `zero_dim` None: DeepSpeed's
    layout (flattened, zero-padded to a multiple of N lcm(N, 8)); else the N ZeRO shards along it, of the
    leaf as stored (`pad` zeros appended along `zero_dim`: sharding.padding)."""

    shape: tuple[int, ...]
    rows: int
    zero_dim: int | None
    pad: int = 0

    @property
    def stored_shape(self) -> tuple[int, ...]:
        d = self.zero_dim
        return self.shape if not self.pad else self.shape[:d] + (self.shape[d] + self.pad,) + self.shape[d + 1:]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def cols(self) -> int:
        n = self.rows
        if self.zero_dim is None:
            multiple = n * (n * 8 // math.gcd(n, 8))
            return -(-self.size // multiple) * multiple // n
        return -(-math.prod(self.stored_shape) // n // 8) * 8

    @property
    def shard_shape(self) -> tuple[int, ...]:
        d, stored = self.zero_dim, self.stored_shape
        return stored[:d] + (stored[d] // self.rows,) + stored[d + 1:]

    def to_rows(self, x):
        """The whole leaf (true shape) -> (rows, cols), zero-padded."""
        n, c = self.rows, self.cols
        if self.zero_dim is None:
            return jnp.pad(x.reshape(-1), (0, n * c - self.size)).reshape(n, c)
        d, stored = self.zero_dim, self.stored_shape
        x = add_padding(x, d, self.pad)
        split = x.reshape(stored[:d] + (n, stored[d] // n) + stored[d + 1:])
        flat = jnp.moveaxis(split, d, 0).reshape(n, -1)
        return jnp.pad(flat, ((0, 0), (0, c - flat.shape[1])))

    def from_rows(self, rows):
        """(rows, cols) -> the whole leaf (true shape: padding dropped)."""
        if self.zero_dim is None:
            return rows.reshape(-1)[: self.size].reshape(self.shape)
        d, shard = self.zero_dim, self.shard_shape
        pieces = rows[:, : math.prod(shard)].reshape((self.rows,) + shard)
        moved = jnp.moveaxis(pieces, 0, d)  # (..., n, stored[d] / n, ...)
        return cut_padding(moved.reshape(self.stored_shape), d, self.pad)

    def shard_of_row(self, row):
        """A server's row -> its ZeRO shard (partitioned layout only)."""
        return row[: math.prod(self.shard_shape)].reshape(self.shard_shape)


class LeafSync(NamedTuple):
    """One leaf's part of the sync state (global arrays; the leading dimension is over `data`)."""

    worker_error: jax.Array  # (N, N, C): device k's error, as N rows
    server_error: jax.Array  # (N, C): server i's error for its row
    bits: Any  # (N, C / 8) uint8: the last exchanged momentum, packed (partitioned layout; else None)
    scales: Any  # (N,) its per-row scales (partitioned layout; else None)


class SyncState(NamedTuple):
    leaves: Any  # params structure, LeafSync per leaf
    exchanged_at: jax.Array  # int32: the update count whose exchange wrote `bits` (-1: none, the next needs 'first')


# ------------------------------------------------------------------------- the mean gradient's norm
SKETCH_BUCKETS = 1024  # relative standard deviation of the squared-norm estimate: about sqrt(2 / 1024) = 4.4%


def _hash_signs(index):
    """+1 or -1 for each uint32 `index`: the top bit of a multiply, xor-shift, multiply hash (the first
    rounds of murmur3's finaliser; a further xor-shift would not change the top bit)."""
    h = index * np.uint32(0x9E3779B1)
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    return np.float32(1) - np.float32(2) * (h >> np.uint32(31)).astype(jnp.float32)


def norm_sketch(tree, buckets: int = SKETCH_BUCKETS):
    """A count sketch of `tree`'s elements: element g (its index over all leaves, flattened in leaf order)
    is added with sign s(g) into bucket g mod `buckets`. It is linear, so the mean of the devices' sketches
    of their local gradients is the sketch of the mean gradient, and its squared norm estimates the mean
    gradient's squared norm without bias (the signs' cross terms vanish on average), with a relative
    standard deviation of about sqrt(2 / buckets) when no few buckets hold most of the energy."""
    total = jnp.zeros((buckets,), jnp.float32)
    offset = 0
    for leaf in jax.tree.leaves(tree):
        flat = leaf.reshape(-1).astype(jnp.float32)
        size = flat.shape[0]
        index = jnp.arange(size, dtype=jnp.uint32) + np.uint32(offset % 2**32)
        front = offset % buckets
        signed = jnp.pad(flat * _hash_signs(index), (front, -(front + size) % buckets))
        total = total + signed.reshape(-1, buckets).sum(0)
        offset += size
    return total


# ----------------------------------------------------------------------------- the compressed all-reduce
def _rms(x, count: int):
    return jnp.sqrt(jnp.sum(x * x)) / np.float32(math.sqrt(count))


def exchange(layout: Layout, momentum, worker_error, server_error, axis: str = DATA_AXIS, impl: str = "auto"):
    """The compressed all-reduce of one leaf's local momentum (inside a shard_map manual over `axis`):
    `exchange_rows` of its rows."""
    return exchange_rows(layout.to_rows(momentum.astype(jnp.float32)), worker_error, server_error, axis, impl)


def exchange_rows(x, worker_error, server_error, axis: str = DATA_AXIS, impl: str = "auto"):
    """The compressed all-reduce of one buffer laid out as N rows x (C, a multiple of 8) columns, row i the
    chunk device i serves (inside a shard_map manual over `axis`).

    worker_error (N, C), server_error (C,): this device's. Returns (the result's rows as every device has
    them: bits (N, C/8) and scales (N,); this server's row of them, decompressed (C,); new worker error;
    new server error)."""
    n, c = x.shape
    scale = _rms(x + worker_error, n * c)
    bits, worker_error = pack_signs(x, worker_error, jnp.full((n,), scale), impl=impl)
    received = jax.lax.all_to_all(bits, axis, 0, 0, tiled=True)  # row k: worker k's signs of my row
    scales = jax.lax.all_gather(scale, axis)
    average = unpack_signs(received, scales, average=True, impl=impl)
    server_scale = _rms(average + server_error, c)
    my_bits, server_error = pack_signs(average[None], server_error[None], server_scale[None], impl=impl)
    all_bits = jax.lax.all_gather(my_bits[0], axis)
    all_scales = jax.lax.all_gather(server_scale, axis)
    mine = unpack_signs(my_bits, server_scale[None], average=False, impl=impl)[0]
    return all_bits, all_scales, mine, worker_error, server_error[0]


# ----------------------------------------------------------------------------------------- the sync
def is_layout(x) -> bool:
    return isinstance(x, Layout)


@dataclasses.dataclass(frozen=True)
class OneBitSync:
    """The engine's gradient sync under 1-bit Adam; `zero` is ZeRO's sync, used during warm-up."""

    settings: OneBitSettings
    layouts: Any  # params structure: Layout per leaf
    zero: Any  # ZeroGradSync
    grad_clip: float = 0.0  # Config.grad_clip: in the compressed phase each device clips its local gradient
    skips: bool = False  # a step may be skipped (fp16's overflow, Config.nonfinite 'skip'): see `rereads`
    axis: str = DATA_AXIS
    impl: str = "auto"

    @property
    def data_size(self) -> int:
        return jax.tree.leaves(self.layouts, is_leaf=is_layout)[0].rows

    @property
    def partitioned(self) -> bool:
        return any(l.zero_dim is not None for l in jax.tree.leaves(self.layouts, is_leaf=is_layout))

    # ------------------------------------------------------------------------------------ phases
    @property
    def phases(self) -> tuple[str, ...]:
        return (WARMUP, FIRST, COMPRESSED) if self.partitioned else (WARMUP, COMPRESSED)

    @property
    def rereads(self) -> bool:
        """With fp16 (or Config.nonfinite 'skip') a step may be skipped on the device, leaving the update count
        and the sync state as they were: the clock reads them from every state (a wait for the step before,
        as DeepSpeed's fp16 wrapper waits for its overflow check)."""
        return self.skips

    def host_view(self, state) -> tuple[int, int]:
        """(updates applied, the update count at the state's last compressed exchange; -1: none)."""
        return int(state.opt_state.count), int(state.sync_state.exchanged_at)

    def pick(self, step: int, view: tuple[int, int]) -> str:
        # By updates applied, not steps: a skipped step does not count towards freeze_step (nor in DeepSpeed).
        applied, exchanged_at = view
        if applied < self.settings.freeze_step:
            return WARMUP
        if self.partitioned and exchanged_at != applied - 1:
            return FIRST
        return COMPRESSED

    def after(self, step: int, phase: str, view: tuple[int, int]) -> tuple[int, int]:
        applied, exchanged_at = view  # the step was applied (else `rereads` reads the view anew)
        return applied + 1, exchanged_at if phase == WARMUP else applied

    # state and its placement
    def init_state(self) -> SyncState:
        def leaf(l: Layout):
            n, c = l.rows, l.cols
            packed = l.zero_dim is not None
            return LeafSync(jnp.zeros((n, n, c), jnp.float32), jnp.zeros((n, c), jnp.float32),
                            jnp.zeros((n, c // 8), jnp.uint8) if packed else None,
                            jnp.zeros((n,), jnp.float32) if packed else None)

        return SyncState(jax.tree.map(leaf, self.layouts, is_leaf=is_layout), jnp.asarray(-1, jnp.int32))

    def specs(self) -> SyncState:
        """shard_map specs (and, on the mesh, the at-rest placement) of the sync state: the errors are each
        device's own (split over `data`), the exchanged bits the same on every device."""
        def leaf(l: Layout):
            packed = l.zero_dim is not None
            return LeafSync(P(self.axis), P(self.axis), P() if packed else None, P() if packed else None)

        return SyncState(jax.tree.map(leaf, self.layouts, is_leaf=is_layout), P())

    def shardings(self, mesh) -> SyncState:
        return jax.tree.map(lambda spec: NamedSharding(mesh, spec), self.specs(),
                            is_leaf=lambda x: isinstance(x, P))

    def buffer_cols(self) -> list[int]:
        """The columns C of each buffer the compressed all-reduce exchanges (one per leaf)."""
        return [l.cols for l in jax.tree.leaves(self.layouts, is_leaf=is_layout)]

    def state_bytes(self) -> int:
        """The sync state's bytes per device, by the layouts: per leaf the worker error (4 N C), the server
        error (4 C) and, for a partitioned leaf, the last exchange's bits and scales (N C / 8 + 4 N); and the
        step of that exchange."""
        return sum(4 * l.rows * l.cols + 4 * l.cols + (l.rows * (l.cols // 8 + 4) if l.zero_dim is not None else 0)
                   for l in jax.tree.leaves(self.layouts, is_leaf=is_layout)) + 4

    def data_axis_bytes(self, zero_bytes: float, stage: int, grad_bytes: int, phase: str) -> float:
        """Its theory for the communication report: ZeRO's volume (`zero_bytes`) during warm-up; in a
        compressed step, per device over `data`: per leaf of C columns per row, an all-to-all of the
        worker's packed signs and an all-gather of the servers' ((N-1) C / 8 bytes each) and of both
        scales (4 (N-1) each); at stages 1-2 the all-gather of the updated parameters (the variance is
        partitioned, so the update is too); in the first compressed step, the all-gather of the warm-up's
        partitioned momentum (fp32); with clipping by the mean gradient's norm, the all-reduce of its
        sketch (fp32, SKETCH_BUCKETS)."""
        if phase == WARMUP:
            return zero_bytes
        layouts = jax.tree.leaves(self.layouts, is_leaf=is_layout)
        n = self.data_size
        share = (n - 1) / n
        exchange = sum((n - 1) * (cols / 4 + 8) for cols in self.buffer_cols())
        if self.grad_clip > 0 and not self.settings.local_clip:
            exchange += 2 * 4 * SKETCH_BUCKETS * share
        partitioned = sum(math.prod(l.stored_shape) for l in layouts if l.zero_dim is not None)
        gather = grad_bytes * partitioned * share if stage in (1, 2) else 0.0
        first = 4 * partitioned * share if phase == FIRST else 0.0
        return exchange + gather + first

    # ------------------------------------------------------------------------------- in the step
    def inputs(self, state, phase: str):
        """What the compressed phases exchange besides the gradients, and its shard_map specs: the last
        momentum (whole, where it is passed), the sync state and the update count."""
        if phase == WARMUP:
            return None, P()
        mu = self.previous_momentum(state.opt_state.mu, phase)
        mu_specs = jax.tree.map(lambda p, m: None if m is None else p.pipe_spec(), self.zero.placements, mu,
                                is_leaf=is_placement)
        return (mu, state.sync_state, state.opt_state.count), (mu_specs, self.specs(), P())

    def output_specs(self, phase: str):
        return P() if phase == WARMUP else (self.specs(), P())

    def local_params(self, params, inputs, phase: str):
        return params

    def per_microbatch(self, grads, phase: str):
        return self.zero.per_microbatch(grads) if phase == WARMUP else grads

    def final(self, grads, inputs, phase: str, scale=1.0):
        """Warm-up: ZeRO's reduction. Compressed phases: (the exchanged momentum, (the new sync state, the
        gradient norm)), from the local gradient unscaled first, as DeepSpeed's fp16 wrapper unscales it
        before OnebitAdam exchanges."""
        if phase == WARMUP:
            return self.zero.final(grads, scale=scale)
        momentum, sync_state, norm = self.exchanged(unscale(grads, scale), *inputs)
        return momentum, (sync_state, norm)

    def synced(self, grads, outputs, state, phase: str) -> Synced:
        if phase == WARMUP:
            return self.zero.synced(grads, outputs, state)
        sync_state, norm = outputs
        return Synced(grads, sync_state, norm, {"momentum": grads})

    def previous_momentum(self, mu, phase: str):
        """Per leaf, the whole momentum of the last step, as the engine passes it into the shard_map: the
        at-rest momentum where it is whole (or gathered: 'first'), else None (decompressed from the bits)."""
        def leaf(l: Layout, m):
            return m if l.zero_dim is None or phase == FIRST else None
        return jax.tree.map(leaf, self.layouts, mu, is_leaf=is_layout)

    def local_gradients(self, grads, local_clip: bool | None = None):
        """(this device's local gradient, clipped as `grad_clip` and `local_clip` (default: the settings') say;
        the gradient norm: with `grad_clip` and no `local_clip` the mean gradient's, estimated by the sketch,
        else the mean over devices of the local gradients' norms). `grads` are this device's share 1/N of the
        mean, as the engine weights the loss."""
        local_clip = self.settings.local_clip if local_clip is None else local_clip
        local = jax.tree.map(lambda g: g.astype(jnp.float32) * self.data_size, grads)
        if self.grad_clip > 0 and not local_clip:  # one factor on every device: the exchanged
            # momentum follows the clipped mean gradient, whose norm the all-reduced sketch estimates
            norm = jnp.sqrt(jnp.sum(jnp.square(mean_all(norm_sketch(local), self.axis, self.zero.ordered))))
            return clip_to(local, norm, self.grad_clip), norm
        local_norm = global_norm(local)
        norm = mean_all(local_norm, self.axis, self.zero.ordered)
        if self.grad_clip > 0:  # DeepSpeed's fp32 engine clips the local gradient its optimizer sees
            local = clip_to(local, local_norm, self.grad_clip)
        return local, norm

    def exchanged(self, grads, mu_prev, sync: SyncState, step):
        """Compressed phase, per device: grads are this device's local gradients (its share 1/N of the
        mean, as the engine weights the loss). Returns (momentum: this device's shard at rest, or the
        whole leaf where it is replicated; new sync state; the gradient norm: with `grad_clip` and no
        `local_clip` the mean gradient's, estimated by the sketch, else the mean over devices of the local
        gradients' norms)."""
        s = self.settings
        n = self.data_size
        local, norm = self.local_gradients(grads)

        def leaf(l: Layout, g, m_prev, state: LeafSync):
            if m_prev is None:  # the last exchange's result, from its bits
                m_prev = l.from_rows(unpack_signs(state.bits, state.scales, average=False, impl=self.impl))
            elif l.zero_dim is not None:  # the warm-up's momentum, gathered whole as stored
                m_prev = cut_padding(m_prev, l.zero_dim, l.pad)
            m = s.b1 * m_prev + (1 - s.b1) * g
            if n == 1:  # DeepSpeed does not compress with one worker
                return m, state
            all_bits, all_scales, mine, worker_error, server_error = exchange(
                l, m, state.worker_error[0], state.server_error[0], self.axis, self.impl)
            new = LeafSync(worker_error[None], server_error[None], all_bits if state.bits is not None else None,
                           all_scales if state.scales is not None else None)
            if l.zero_dim is None:
                return l.from_rows(unpack_signs(all_bits, all_scales, average=False, impl=self.impl)), new
            return l.shard_of_row(mine), new

        leaves = jax.tree.leaves(self.layouts, is_leaf=is_layout)
        treedef = jax.tree.structure(self.layouts, is_leaf=is_layout)
        prev = treedef.flatten_up_to(mu_prev)
        states = treedef.flatten_up_to(sync.leaves)
        out = [leaf(l, g, p, st) for l, g, p, st in zip(leaves, jax.tree.leaves(local), prev, states)]
        momentum = treedef.unflatten([o[0] for o in out])
        new_sync = SyncState(treedef.unflatten([o[1] for o in out]), jnp.asarray(step, jnp.int32))
        return momentum, new_sync, norm


def make_sync(optimizer: OneBitAdam, placements, data_size: int, zero_sync, grad_clip: float = 0.0,
              impl: str = "auto", skips: bool = False, kind: type = None) -> OneBitSync:
    """The 1-bit sync (`kind`: OneBitSync or a subclass) for parameters placed by `placements` (LeafPlacement
    tree) over `data_size` devices; a leaf whose optimizer state ZeRO partitions (stages 1-2) is served shard
    by shard."""
    kind = kind or OneBitSync
    partitioned = ZERO_PARTITIONED[zero_sync.stage]["opt_state"]
    layouts = jax.tree.map(lambda p: Layout(tuple(p.shape), data_size, p.zero_dim if partitioned else None,
                                            p.pad if partitioned else 0),
                           placements, is_leaf=is_placement)
    return kind(optimizer.settings, layouts, zero_sync, grad_clip, skips=skips, impl=impl)
