"""1-bit Adam (DeepSpeed's OnebitAdam): Adam for `freeze_step` steps, then a frozen variance and the
momentum exchanged as sign bits with error feedback (docs/onebit_adam.md).

Two pieces, one per part of the step (design.md section 8):

  * `onebit_adam(...)`: the update, an optax `GradientTransformationExtraArgs`. DeepSpeed's rules: no bias
    correction, eps outside the square root, weight decay added to the update (decoupled, scaled by the
    learning rate). From step `freeze_step` on the variance is frozen. Called by itself (one worker) the
    momentum follows the gradient as in Adam: DeepSpeed does not compress with one worker either.
  * `OneBitSync`: the engine's gradient sync for it. During warm-up it is ZeRO's (the mean gradient);
    after it each device updates the momentum with its *local* gradient and the momentum goes through the
    compressed all-reduce (`exchange`); the update then receives the exchanged momentum (`momentum=`).
    Clipping then scales every local gradient by one factor, from the mean gradient's norm as estimated
    by an all-reduced count sketch (`norm_sketch`); `local_clip=True` is DeepSpeed's per-device rule.

The compressed all-reduce works on each parameter leaf as N rows of C columns (`Layout`): row i is the
chunk device i serves. A worker adds its error to the rows of its momentum, compresses them to signs with
one scale ||x||_2 / sqrt(N C) and keeps what that lost as its new error; an all-to-all gives each server
its row from every worker; the server averages sign x scale / N, adds its own error, compresses again with
one scale for its row, and an all-gather of the packed bits and scales gives every device the same result.
The layout is DeepSpeed's (the leaf flattened and zero-padded to a multiple of N lcm(N, 8)) for a leaf
that ZeRO keeps whole on every device, and the ZeRO shard (each flattened, padded to a multiple of 8) for a
partitioned one, so that a server's row is the shard whose optimizer state it holds.

With ZeRO stages 1-2 a device holds only its shard of the momentum, but the next step's worker momentum
needs all of it: the all-gathered bits and scales (1/32 of the fp32 momentum) are kept in the sync state and
decompressed. The first compressed step has no such bits (the warm-up's momentum is fp32): it all-gathers the
momentum once (phase 'first').
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from zeroflax.kernels.onebit_pack import pack_signs, unpack_signs
from zeroflax.optim.clipping import clip_to, global_norm
from zeroflax.sharding.mesh import DATA_AXIS
from zeroflax.sharding.policy import ZERO_PARTITIONED, is_placement

WARMUP, FIRST, COMPRESSED = "warmup", "first", "compressed"


# ------------------------------------------------------------------------------------------ the update
class OneBitAdamState(NamedTuple):
    count: jax.Array  # int32: steps taken
    mu: Any  # momentum (exp_avg)
    nu: Any  # variance (exp_avg_sq), frozen from step freeze_step on


@dataclasses.dataclass(frozen=True)
class OneBitSettings:
    learning_rate: Any  # float or optax schedule of the step count
    b1: float
    b2: float
    eps: float
    weight_decay: float
    freeze_step: int
    local_clip: bool = False  # DeepSpeed's clipping in the compressed phase (see onebit_adam)


class OneBitAdam(optax.GradientTransformationExtraArgs):
    """What `onebit_adam` returns: an optax transformation the engine recognises (`settings`)."""

    __slots__ = ()

    @property
    def settings(self) -> OneBitSettings:
        return self.update.settings


@dataclasses.dataclass(frozen=True)
class _Update:
    settings: OneBitSettings

    def __call__(self, grads, state: OneBitAdamState, params=None, *, momentum=None, **_):
        """`momentum`: the momentum already exchanged by the engine's compressed all-reduce; `grads` are
        then ignored. Without it (warm-up, or one worker) the momentum follows `grads`."""
        s = self.settings
        frozen = state.count >= s.freeze_step
        if momentum is None:
            mu = jax.tree.map(lambda m, g: s.b1 * m + (1 - s.b1) * g, state.mu, grads)
            nu = jax.tree.map(lambda v, g: jnp.where(frozen, v, s.b2 * v + (1 - s.b2) * g * g), state.nu, grads)
        else:
            mu, nu = momentum, state.nu
        lr = s.learning_rate(state.count) if callable(s.learning_rate) else s.learning_rate
        if s.weight_decay and params is None:
            raise ValueError("onebit_adam with weight_decay needs params in update(grads, state, params)")

        def step(m, v, p):
            update = m / (jnp.sqrt(v) + s.eps)
            if s.weight_decay:
                update = update + s.weight_decay * p
            return (-lr * update).astype(m.dtype)

        updates = jax.tree.map(step, mu, nu, params if params is not None else mu)
        return updates, OneBitAdamState(state.count + 1, mu, nu)


def onebit_adam(learning_rate: float | Callable = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                weight_decay: float = 0.0, freeze_step: int = 100000, local_clip: bool = False) -> OneBitAdam:
    """DeepSpeed's 1-bit Adam (defaults: DeepSpeed's). `freeze_step`: the number of warm-up steps of plain
    Adam (on the mean gradient) before the variance freezes and the momentum is exchanged compressed.
    Unlike DeepSpeed's fp32 engine, the first step's gradient is used, not discarded: the warm-up is
    `freeze_step` real steps. Pass the result to `zeroflax.initialize` as the optimizer.

    `local_clip`: how `Config.grad_clip` acts in the compressed phase, where no device holds the mean
    gradient. False (default): every device scales its local gradient by the same factor, from the mean
    gradient's norm estimated by a count sketch that is all-reduced (`norm_sketch`: 4 KiB per step), so the
    exchanged momentum follows the clipped mean gradient as in the warm-up. True: DeepSpeed's rule, each
    device clips its local gradient by its own norm; local gradients are noisier and larger than their mean,
    so this clips far more often (docs/onebit_adam.md measures the difference)."""
    for name, value in (("b1", b1), ("b2", b2)):
        if not 0 <= value < 1:
            raise ValueError(f"onebit_adam: {name} must be in [0, 1), got {value!r}")
    if not (isinstance(freeze_step, int) and freeze_step >= 0):
        raise ValueError(f"onebit_adam: freeze_step must be an integer >= 0, got {freeze_step!r}")
    if eps < 0 or weight_decay < 0:
        raise ValueError(f"onebit_adam: eps and weight_decay must be >= 0, got {eps!r}, {weight_decay!r}")
    settings = OneBitSettings(learning_rate, b1, b2, eps, weight_decay, freeze_step, bool(local_clip))

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return OneBitAdamState(jnp.zeros((), jnp.int32), zeros, jax.tree.map(jnp.zeros_like, params))

    return OneBitAdam(init, _Update(settings))


def find_onebit(optimizer, abstract_params) -> bool:
    """Whether a 1-bit Adam state hides inside `optimizer` (a chain, a wrapper) without being it."""
    if isinstance(optimizer, OneBitAdam):
        return False
    state = jax.eval_shape(optimizer.init, abstract_params)
    return any(isinstance(x, OneBitAdamState) for x in jax.tree.leaves(
        state, is_leaf=lambda x: isinstance(x, OneBitAdamState)))


# ------------------------------------------------------------------------------------------ the layout
@dataclasses.dataclass(frozen=True)
class Layout:
    """A leaf of `shape` as `rows` x `cols` (row i: the chunk device i serves). `zero_dim` None: DeepSpeed's
    layout (flattened, zero-padded to a multiple of N lcm(N, 8)); else the N ZeRO shards along it."""

    shape: tuple[int, ...]
    rows: int
    zero_dim: int | None

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def cols(self) -> int:
        n = self.rows
        if self.zero_dim is None:
            multiple = n * (n * 8 // math.gcd(n, 8))
            return -(-self.size // multiple) * multiple // n
        return -(-self.size // n // 8) * 8

    @property
    def shard_shape(self) -> tuple[int, ...]:
        d = self.zero_dim
        return self.shape[:d] + (self.shape[d] // self.rows,) + self.shape[d + 1:]

    def to_rows(self, x):
        """The whole leaf -> (rows, cols), zero-padded."""
        n, c = self.rows, self.cols
        if self.zero_dim is None:
            return jnp.pad(x.reshape(-1), (0, n * c - self.size)).reshape(n, c)
        d = self.zero_dim
        split = x.reshape(self.shape[:d] + (n, self.shape[d] // n) + self.shape[d + 1:])
        flat = jnp.moveaxis(split, d, 0).reshape(n, -1)
        return jnp.pad(flat, ((0, 0), (0, c - flat.shape[1])))

    def from_rows(self, rows):
        """(rows, cols) -> the whole leaf (padding dropped)."""
        if self.zero_dim is None:
            return rows.reshape(-1)[: self.size].reshape(self.shape)
        d, shard = self.zero_dim, self.shard_shape
        pieces = rows[:, : math.prod(shard)].reshape((self.rows,) + shard)
        moved = jnp.moveaxis(pieces, 0, d)  # (..., n, shape[d] / n, ...)
        return moved.reshape(self.shape)

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
    exchanged_at: jax.Array  # int32: the step whose exchange wrote `bits` (-1: none, the next needs 'first')


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
    """The compressed all-reduce of one leaf's local momentum (inside a shard_map manual over `axis`).

    worker_error (N, C), server_error (C,): this device's. Returns (the result's rows as every device has
    them: bits (N, C/8) and scales (N,); this server's row of them, decompressed (C,); new worker error;
    new server error)."""
    n, c = layout.rows, layout.cols
    x = layout.to_rows(momentum.astype(jnp.float32))
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
def _is_layout(x) -> bool:
    return isinstance(x, Layout)


@dataclasses.dataclass(frozen=True)
class OneBitSync:
    """The engine's gradient sync under 1-bit Adam; `zero` is ZeRO's sync, used during warm-up."""

    settings: OneBitSettings
    layouts: Any  # params structure: Layout per leaf
    zero: Any  # ZeroGradSync
    grad_clip: float = 0.0  # Config.grad_clip: in the compressed phase each device clips its local gradient
    axis: str = DATA_AXIS
    impl: str = "auto"

    @property
    def data_size(self) -> int:
        return jax.tree.leaves(self.layouts, is_leaf=_is_layout)[0].rows

    @property
    def partitioned(self) -> bool:
        return any(l.zero_dim is not None for l in jax.tree.leaves(self.layouts, is_leaf=_is_layout))

    def phase(self, step: int, exchanged_at: int) -> str:
        if step < self.settings.freeze_step:
            return WARMUP
        if self.partitioned and exchanged_at != step - 1:
            return FIRST
        return COMPRESSED

    # state and its placement
    def init_state(self) -> SyncState:
        def leaf(l: Layout):
            n, c = l.rows, l.cols
            packed = l.zero_dim is not None
            return LeafSync(jnp.zeros((n, n, c), jnp.float32), jnp.zeros((n, c), jnp.float32),
                            jnp.zeros((n, c // 8), jnp.uint8) if packed else None,
                            jnp.zeros((n,), jnp.float32) if packed else None)

        return SyncState(jax.tree.map(leaf, self.layouts, is_leaf=_is_layout), jnp.asarray(-1, jnp.int32))

    def specs(self) -> SyncState:
        """shard_map specs (and, on the mesh, the at-rest placement) of the sync state: the errors are each
        device's own (split over `data`), the exchanged bits the same on every device."""
        def leaf(l: Layout):
            packed = l.zero_dim is not None
            return LeafSync(P(self.axis), P(self.axis), P() if packed else None, P() if packed else None)

        return SyncState(jax.tree.map(leaf, self.layouts, is_leaf=_is_layout), P())

    def shardings(self, mesh) -> SyncState:
        return jax.tree.map(lambda spec: NamedSharding(mesh, spec), self.specs(),
                            is_leaf=lambda x: isinstance(x, P))

    def state_bytes(self) -> int:
        """The sync state's bytes per device, by the layouts: per leaf the worker error (4 N C), the server
        error (4 C) and, for a partitioned leaf, the last exchange's bits and scales (N C / 8 + 4 N); and the
        step of that exchange."""
        return sum(4 * l.rows * l.cols + 4 * l.cols + (l.rows * (l.cols // 8 + 4) if l.zero_dim is not None else 0)
                   for l in jax.tree.leaves(self.layouts, is_leaf=_is_layout)) + 4

    # inside the engine's shard_map
    def per_microbatch(self, grads, phase: str):
        return self.zero.per_microbatch(grads) if phase == WARMUP else grads

    def previous_momentum(self, mu, phase: str):
        """Per leaf, the whole momentum of the last step, as the engine passes it into the shard_map: the
        at-rest momentum where it is whole (or gathered: 'first'), else None (decompressed from the bits)."""
        def leaf(l: Layout, m):
            return m if l.zero_dim is None or phase == FIRST else None
        return jax.tree.map(leaf, self.layouts, mu, is_leaf=_is_layout)

    def final(self, grads, mu_prev, sync: SyncState, step):
        """Compressed phase, per device: grads are this device's local gradients (its share 1/N of the
        mean, as the engine weights the loss). Returns (momentum: this device's shard at rest, or the
        whole leaf where it is replicated; new sync state; the gradient norm: with `grad_clip` and no
        `local_clip` the mean gradient's, estimated by the sketch, else the mean over devices of the local
        gradients' norms)."""
        s = self.settings
        n = self.data_size
        local = jax.tree.map(lambda g: g.astype(jnp.float32) * n, grads)
        if self.grad_clip > 0 and not s.local_clip:  # one factor on every device: the exchanged momentum
            # follows the clipped mean gradient, whose norm the all-reduced sketch estimates
            norm = jnp.sqrt(jnp.sum(jnp.square(jax.lax.pmean(norm_sketch(local), self.axis))))
            local = clip_to(local, norm, self.grad_clip)
        else:
            local_norm = global_norm(local)
            norm = jax.lax.pmean(local_norm, self.axis)
            if self.grad_clip > 0:  # DeepSpeed's fp32 engine clips the local gradient its optimizer sees
                local = clip_to(local, local_norm, self.grad_clip)

        def leaf(l: Layout, g, m_prev, state: LeafSync):
            if m_prev is None:  # the last exchange's result, from its bits
                m_prev = l.from_rows(unpack_signs(state.bits, state.scales, average=False, impl=self.impl))
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

        leaves = jax.tree.leaves(self.layouts, is_leaf=_is_layout)
        treedef = jax.tree.structure(self.layouts, is_leaf=_is_layout)
        prev = treedef.flatten_up_to(mu_prev)
        states = treedef.flatten_up_to(sync.leaves)
        out = [leaf(l, g, p, st) for l, g, p, st in zip(leaves, jax.tree.leaves(local), prev, states)]
        momentum = treedef.unflatten([o[0] for o in out])
        new_sync = SyncState(treedef.unflatten([o[1] for o in out]), jnp.asarray(step, jnp.int32))
        return momentum, new_sync, norm


def make_sync(optimizer: OneBitAdam, placements, data_size: int, zero_sync, grad_clip: float = 0.0,
              impl: str = "auto") -> OneBitSync:
    """The 1-bit sync for parameters placed by `placements` (LeafPlacement tree) over `data_size` devices;
    a leaf whose optimizer state ZeRO partitions (stages 1-2) is served shard by shard."""
    partitioned = ZERO_PARTITIONED[zero_sync.stage]["opt_state"]
    layouts = jax.tree.map(lambda p: Layout(tuple(p.shape), data_size, p.zero_dim if partitioned else None),
                           placements, is_leaf=is_placement)
    return OneBitSync(optimizer.settings, layouts, zero_sync, grad_clip, impl=impl)
