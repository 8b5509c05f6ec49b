"""0/1 Adam's gradient sync (`zeroflax/optim/zero_one_adam.py`): the step's `GradSync` part, built on 1-bit
Adam's (`step/onebit_sync.py`: the layouts, the compressed all-reduce, the clipping of local gradients).

Its phases follow the optimizer's schedule (`optim/zero_one_adam.py`'s `step_kinds`, by updates applied):
  'full'          ZeRO's sync (the mean gradient; the update refreshes the variance);
  'onebit_grad'   each device's local gradient through the compressed all-reduce, per leaf;
  'local'         no exchange: each device updates its own momentum with its local gradient and adds its own
                  step to its accumulator; its loss is taken at the parameters at rest plus that accumulator
                  (`local_params`), so the devices' parameters differ until the next sync;
  'sync'          a local step, then the accumulators (scaled by sqrt(v) + eps) through the compressed
                  all-reduce: the update moves the parameters at rest by the result and resets the momentum;
  'freeze_local', 'freeze_sync'  the first frozen step (or the first after a restore that reset this state):
                  the momentum (and, where ZeRO partitions it, the frozen variance) are all-gathered once into
                  each device's copy, and the error buffers, which held the gradients' errors, restart at zero.

The parameters at rest are the last sync's, the same on every device, so checkpoints, evaluation and
`model_params` see them; a device's own parameters are those plus its accumulator (TrainState.sync_state).
Local steps clip each device's gradient by its own norm (DeepSpeed's rule): a device that steps alone
follows its own gradient, and an all-reduced sketch would cost the round the local step saves. The steps
that communicate anyway (1-bit gradient, sync) clip as 1-bit Adam's compressed phase does (`local_clip`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zeroflax.kernels.onebit_pack import unpack_signs
from zeroflax.optim.zero_one_adam import FULL, LOCAL, ONEBIT_GRAD, SYNC, Schedule, advance, kind_of
from zeroflax.sharding.collectives import cut_padding
from zeroflax.sharding.policy import is_placement
from zeroflax.step.onebit_sync import SKETCH_BUCKETS, Layout, OneBitSync, is_layout, exchange
from zeroflax.step.parts import Synced
from zeroflax.step.zero_sync import unscale

FREEZE_LOCAL, FREEZE_SYNC = "freeze_local", "freeze_sync"
_KIND = {ONEBIT_GRAD: ONEBIT_GRAD, LOCAL: LOCAL, FREEZE_LOCAL: LOCAL, SYNC: SYNC, FREEZE_SYNC: SYNC}


class ZeroOneLeaf(NamedTuple):
    """One leaf's part of the sync state (global arrays; a leading dimension N is over `data`)."""

    worker_error: jax.Array  # (N, N, C)
    server_error: jax.Array  # (N, C)
    momentum: jax.Array  # (N, *shape): each device's own momentum during local steps
    accumulated: jax.Array  # (N, *shape): each device's steps since the last sync (DeepSpeed's momentum_accumulator)
    variance: Any  # (*shape) the frozen variance, whole, where ZeRO partitions it at rest; else None


class ZeroOneSyncState(NamedTuple):
    leaves: Any  # params structure, ZeroOneLeaf per leaf
    lrs: jax.Array  # float32: the learning rates summed since the last sync
    frozen: jax.Array  # int32: 1 once the momentum and variance copies are taken (else the next step takes them)


_SCHEDULES: dict = {}  # the schedule's settings -> [Schedule after 0, 1, 2, ... steps], grown on demand


def schedule_after(settings, applied: int) -> Schedule:
    """The schedule after `applied` steps (remembered, so that a clock reading every state pays once)."""
    key = (settings.var_freeze_step, settings.var_update_scaler, settings.local_step_scaler,
           settings.local_step_clipper)
    known = _SCHEDULES.setdefault(key, [Schedule()])
    while len(known) <= applied:
        known.append(advance(settings, len(known), known[-1]))
    return known[applied]


@dataclasses.dataclass(frozen=True)
class ZeroOneSync(OneBitSync):
    """The engine's gradient sync under 0/1 Adam (fields: OneBitSync's; `settings`: ZeroOneSettings)."""

    @property
    def phases(self) -> tuple[str, ...]:
        return (FULL, ONEBIT_GRAD, FREEZE_LOCAL, FREEZE_SYNC, LOCAL, SYNC)

    def host_view(self, state):
        applied = int(state.opt_state.count)
        return applied, schedule_after(self.settings, applied), bool(int(state.sync_state.frozen))

    def pick(self, step: int, view) -> str:
        applied, at, frozen = view
        kind = kind_of(self.settings, applied + 1, at)
        if kind in (LOCAL, SYNC) and not frozen:
            return FREEZE_LOCAL if kind == LOCAL else FREEZE_SYNC
        return kind

    def after(self, step: int, phase: str, view):
        applied, at, frozen = view
        return applied + 1, advance(self.settings, applied + 1, at), frozen or phase in (FREEZE_LOCAL, FREEZE_SYNC)

    # ------------------------------------------------------------------------------- state, placement
    def _leaves(self):
        return jax.tree.leaves(self.layouts, is_leaf=is_layout)

    def init_state(self) -> ZeroOneSyncState:
        def leaf(l: Layout):
            n, c = l.rows, l.cols
            return ZeroOneLeaf(jnp.zeros((n, n, c), jnp.float32), jnp.zeros((n, c), jnp.float32),
                               jnp.zeros((n,) + l.shape, jnp.float32), jnp.zeros((n,) + l.shape, jnp.float32),
                               jnp.zeros(l.shape, jnp.float32) if l.zero_dim is not None else None)

        return ZeroOneSyncState(jax.tree.map(leaf, self.layouts, is_leaf=is_layout), jnp.zeros((), jnp.float32),
                                jnp.zeros((), jnp.int32))

    def specs(self) -> ZeroOneSyncState:
        def leaf(l: Layout):
            mine = P(self.axis)
            return ZeroOneLeaf(mine, mine, mine, mine, P() if l.zero_dim is not None else None)

        return ZeroOneSyncState(jax.tree.map(leaf, self.layouts, is_leaf=is_layout), P(), P())

    def state_bytes(self) -> int:
        """Per device and leaf: the worker and server errors (4 N C + 4 C), its own momentum and accumulator
        (4 size each) and, where ZeRO partitions the leaf, the whole frozen variance (4 size); lrs and the flag."""
        return sum(4 * l.rows * l.cols + 4 * l.cols + 8 * l.size + (4 * l.size if l.zero_dim is not None else 0)
                   for l in self._leaves()) + 8

    def data_axis_bytes(self, zero_bytes: float, stage: int, grad_bytes: int, phase: str) -> float:
        """Its theory for the communication report, per device over `data`: ZeRO's volume in a 'full' step;
        in 'onebit_grad' and the sync steps the compressed all-reduce of every leaf: the all-to-all of the
        workers' signs and the all-gather of their scales ((N-1) (C/8 + 4)), and the all-gather of the servers'
        ((N-1) (C/8 + 4) again) where every device needs the whole result (a sync step; a leaf ZeRO keeps
        whole), and, at stages 1-2, the all-gather of the updated parameters; with clipping by the sketched mean
        norm, its all-reduce (not in local steps, which clip locally); the first frozen step's
        all-gathers of the momentum and variance where ZeRO partitions them; and every step's all-reduce of the
        loss and the gradient norm (8 bytes)."""
        if phase == FULL:
            return zero_bytes
        n = self.data_size
        share = (n - 1) / n
        total = 2 * 8 * share
        partitioned = sum(l.size for l in self._leaves() if l.zero_dim is not None)
        if phase in (ONEBIT_GRAD, SYNC, FREEZE_SYNC):
            whole = phase != ONEBIT_GRAD
            total += sum((n - 1) * (l.cols / 8 + 4) * (2 if whole or l.zero_dim is None else 1)
                         for l in self._leaves())
            total += grad_bytes * partitioned * share if stage in (1, 2) else 0.0
        if phase in (ONEBIT_GRAD, SYNC, FREEZE_SYNC) and self.grad_clip > 0 and not self.settings.local_clip:
            total += 2 * 4 * SKETCH_BUCKETS * share
        if phase in (FREEZE_LOCAL, FREEZE_SYNC):
            total += 2 * 4 * partitioned * share
        return total

    # ------------------------------------------------------------------------------------ in the step
    def inputs(self, state, phase: str):
        """Besides the gradients: the parameters (whole at stages 0-2), the variance where it is whole or
        taken now, the momentum when taken now, the sync state and the update count."""
        if phase == FULL:
            return None, P()
        if phase == ONEBIT_GRAD:
            return (None, None, None, state.sync_state, state.opt_state.count), (None, None, None, self.specs(), P())
        freeze = phase in (FREEZE_LOCAL, FREEZE_SYNC)
        nu = jax.tree.map(lambda l, v: v if l.zero_dim is None or freeze else None, self.layouts,
                          state.opt_state.nu, is_leaf=is_layout)
        mu = state.opt_state.mu if freeze else None
        whole = lambda tree: None if tree is None else jax.tree.map(
            lambda p, x: None if x is None else p.pipe_spec(), self.zero.placements, tree, is_leaf=is_placement)
        return ((state.params, nu, mu, state.sync_state, state.opt_state.count),
                (whole(state.params), whole(nu), whole(mu), self.specs(), P()))

    def output_specs(self, phase: str):
        return P() if phase == FULL else (self.specs(), P(), P())

    def per_microbatch(self, grads, phase: str):
        return self.zero.per_microbatch(grads) if phase == FULL else grads

    def local_params(self, params, inputs, phase: str):
        """A device's own parameters in a local or sync step: those at rest plus its accumulator."""
        if phase not in (LOCAL, SYNC):
            return params
        sync = inputs[3]
        return jax.tree.map(lambda p, leaf: p + leaf.accumulated[0].astype(p.dtype), params, sync.leaves,
                            is_leaf=lambda x: isinstance(x, ZeroOneLeaf))

    def final(self, grads, inputs, phase: str, scale=1.0):
        """'full': ZeRO's reduction. Otherwise (what the update takes as its gradient: the exchanged mean
        gradient, the exchanged accumulators, or zeros in a local step; (new sync state, gradient norm, lrs))."""
        if phase == FULL:
            return self.zero.final(grads, scale=scale)
        grads = unscale(grads, scale)
        if phase == ONEBIT_GRAD:
            local, norm = self.local_gradients(grads)
            return self._exchange_gradients(local, inputs[3], norm)
        # A local step clips each device's gradient by its own norm (it steps alone and saves the round a
        # sketch would cost); a sync step communicates anyway, so it clips as the 1-bit gradient steps do.
        local, norm = self.local_gradients(grads, local_clip=True if phase in (LOCAL, FREEZE_LOCAL) else None)
        return self._local_step(local, *inputs, phase, norm)

    def synced(self, grads, outputs, state, phase: str) -> Synced:
        if phase == FULL:
            return self.zero.synced(grads, outputs, state)
        sync_state, norm, lrs = outputs
        kind = _KIND[phase]
        return Synced(grads, sync_state, norm, options={"kind": kind, **({"lrs": lrs} if kind == SYNC else {})},
                      moves_params=kind != LOCAL)

    # --------------------------------------------------------------------------------------- helpers
    def _tree(self):
        return jax.tree.structure(self.layouts, is_leaf=is_layout)

    def _compress(self, l: Layout, x, leaf: ZeroOneLeaf):
        """(the result of the compressed all-reduce of x: whole and, for a partitioned leaf, this device's
        shard; the new errors). With one device, x itself (DeepSpeed does not compress then)."""
        if self.data_size == 1:
            return x, x, leaf.worker_error, leaf.server_error
        all_bits, all_scales, mine, worker_error, server_error = exchange(
            l, x, leaf.worker_error[0], leaf.server_error[0], self.axis, self.impl)
        whole = l.from_rows(unpack_signs(all_bits, all_scales, average=False, impl=self.impl))
        shard = whole if l.zero_dim is None else l.shard_of_row(mine)
        return whole, shard, worker_error[None], server_error[None]

    def _exchange_gradients(self, local, sync: ZeroOneSyncState, norm):
        treedef = self._tree()
        out, leaves = [], []
        for l, g, leaf in zip(self._leaves(), jax.tree.leaves(local), treedef.flatten_up_to(sync.leaves)):
            _, shard, worker_error, server_error = self._compress(l, g, leaf)
            out.append(shard)
            leaves.append(leaf._replace(worker_error=worker_error, server_error=server_error))
        new = sync._replace(leaves=treedef.unflatten(leaves))
        return treedef.unflatten(out), (new, norm, sync.lrs)

    def _local_step(self, local, params, nu, mu, sync: ZeroOneSyncState, count, phase: str, norm):
        s = self.settings
        freeze = phase in (FREEZE_LOCAL, FREEZE_SYNC)
        syncs = phase in (SYNC, FREEZE_SYNC)
        lr = s.learning_rate(count) if callable(s.learning_rate) else s.learning_rate
        lrs = (jnp.float32(0) if freeze else sync.lrs) + lr
        treedef = self._tree()
        cut = lambda l, x: cut_padding(x, l.zero_dim, l.pad) if l.zero_dim is not None and x.shape != l.shape else x
        flat = lambda tree: [None] * treedef.num_leaves if tree is None else treedef.flatten_up_to(tree)
        out, leaves = [], []
        for l, g, p, v, m0, leaf in zip(self._leaves(), jax.tree.leaves(local), treedef.flatten_up_to(params),
                                        flat(nu), flat(mu), treedef.flatten_up_to(sync.leaves)):
            if freeze:  # the gradients' error buffers restart (DeepSpeed's reinitial_error_buffer)
                leaf = leaf._replace(worker_error=jnp.zeros_like(leaf.worker_error),
                                     server_error=jnp.zeros_like(leaf.server_error))
            v = cut(l, v) if v is not None else leaf.variance
            m = cut(l, m0) if freeze else leaf.momentum[0]
            acc = jnp.zeros(l.shape, jnp.float32) if freeze else leaf.accumulated[0]
            p_k = cut(l, p).astype(jnp.float32) + acc
            m = s.b1 * m + (1 - s.b1) * g
            denom = jnp.sqrt(v) + s.eps
            u = m / denom
            if s.weight_decay:
                u = u + s.weight_decay * p_k
            acc = acc + (-lr * u)
            variance = v if l.zero_dim is not None else None
            if syncs:
                whole, shard, worker_error, server_error = self._compress(l, acc * denom, leaf)
                leaves.append(ZeroOneLeaf(worker_error, server_error, (-(whole / lrs))[None],
                                          jnp.zeros_like(acc)[None], variance))
                out.append(shard)
            else:
                leaves.append(leaf._replace(momentum=m[None], accumulated=acc[None], variance=variance))
                out.append(jnp.zeros(l.shard_shape if l.zero_dim is not None else l.shape, jnp.float32))
        new = ZeroOneSyncState(treedef.unflatten(leaves), jnp.float32(0) if syncs else lrs, jnp.ones((), jnp.int32))
        return treedef.unflatten(out), (new, norm, lrs)
