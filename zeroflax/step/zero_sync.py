"""ZeRO's gradient synchronisation across the data axis: the step's `GradSync` part (`step/parts.py`).

Runs inside the engine's `shard_map` (manual over `data`), on each device's local gradients.
`per_microbatch` is applied to every micro-batch's gradients before they are accumulated, `final`
to the accumulated gradients. The ZeRO stages differ only in when a partitioned leaf is reduce-scattered:

    stage 0   never: everything is all-reduced at the end
    stage 1   at the end (local accumulation in full, then one reduce-scatter)
    stage 2   per micro-batch (the accumulator is a shard)
    stage 3   in the backward pass itself (the transpose of the ZeRO-3 gather is a reduce-scatter)

A leaf stored padded (`sharding.padding`) is padded with zeros before its reduce-scatter. Leaves that
stay replicated over `data` (below the persistence threshold) are all-reduced at the end. Every
reduction runs on the leaf's tensor slices (`sharding.manual.on_slices`), never on the whole leaf.
A compressed scheme (1-bit Adam, `step/onebit_sync.py`) is another object with the same protocol.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from zeroflax.optim.clipping import clip_to
from zeroflax.sharding.collectives import add_padding
from zeroflax.sharding.manual import on_slices, psum_on_slices
from zeroflax.sharding.mesh import DATA_AXIS
from zeroflax.sharding.ordered import ordered_global_norm, sum_scatter
from zeroflax.sharding.policy import LeafPlacement, is_placement
from zeroflax.sharding.scopes import GRAD_SYNC_SCOPE
from zeroflax.step.parts import Synced
from zeroflax.step.phases import STEADY

SCATTER_WHEN = {0: None, 1: "final", 2: "microbatch", 3: "backward"}


def unscale(grads, scale):
    """The gradients divided by the loss scale (1 without fp16)."""
    return jax.tree.map(lambda g: g / scale, grads)


@dataclasses.dataclass(frozen=True)
class ZeroGradSync:
    stage: int
    placements: Any  # tree of LeafPlacement, params structure
    axis: str = DATA_AXIS
    ordered: bool = False  # Config.deterministic_reductions: sums in device order (sharding/ordered.py)
    grad_clip: float = 0.0  # Config.grad_clip; used here only when `ordered` (the sync then measures the norm)
    phases = (STEADY,)

    # No state of its own, and nothing but the gradients to exchange.
    def init_state(self):
        return None

    def shardings(self, mesh):
        return None

    def state_bytes(self) -> int:
        return 0

    def data_axis_bytes(self, zero_bytes: float, stage: int, grad_bytes: int, phase: str = STEADY) -> float:
        """Its theory for the communication report: ZeRO's volume over `data` (`comm.theory_bytes`)."""
        return zero_bytes

    def inputs(self, state, phase: str = STEADY):
        return None, P()

    def local_params(self, params, inputs, phase: str = STEADY):
        return params

    def output_specs(self, phase: str = STEADY):
        return P()

    def synced(self, grads, outputs, state, phase: str = STEADY) -> Synced:
        return Synced(grads, state, outputs)  # outputs: the norm, when `ordered` measured it

    def _map(self, fn, grads):
        return jax.tree.map(lambda p, g: fn(p, g), self.placements, grads, is_leaf=is_placement)

    def _scatter(self, placement: LeafPlacement, grad):
        # The true gradient, padded like the stored leaf, then scattered into this device's stored shard.
        scatter = lambda g: sum_scatter(add_padding(g, placement.zero_dim, placement.pad), self.axis,
                                        placement.zero_dim, self.ordered)
        return on_slices(scatter, grad, placement.auto_spec())

    def per_microbatch(self, grads, phase: str = STEADY):
        if SCATTER_WHEN[self.stage] != "microbatch":
            return grads
        with jax.named_scope(GRAD_SYNC_SCOPE):
            return self._map(lambda p, g: g if p.zero_dim is None else self._scatter(p, g), grads)

    def final(self, grads, inputs=None, phase: str = STEADY, scale=1.0):
        """(the reduced gradients over the loss scale, no outputs); when `ordered`, (the reduced gradients
        clipped to grad_clip, their norm): the update's own norm would sum the shards' parts in the collective
        library's order. The loss scale is divided out after the reduction, on the shards (1/N of the elements at
        stages 1-2)."""
        reduced = unscale(self.reduced(grads), scale)
        if not self.ordered:
            return reduced, None
        split = jax.tree.leaves(self._map(lambda p, g: SCATTER_WHEN[self.stage] is not None and p.zero_dim is not None,
                                          reduced))
        leaves = jax.tree.leaves(reduced)
        norm = ordered_global_norm([g for s, g in zip(split, leaves) if s], [g for s, g in zip(split, leaves) if not s],
                                   self.axis)
        return (clip_to(reduced, norm, self.grad_clip) if self.grad_clip > 0 else reduced), norm

    def reduced(self, grads):
        when = SCATTER_WHEN[self.stage]

        def reduce(p, g):
            if when is None or p.zero_dim is None:
                return psum_on_slices(g, self.axis, p.auto_spec(), self.ordered)
            if when == "final":
                return self._scatter(p, g)
            return g  # already scattered per micro-batch or in the backward pass

        with jax.named_scope(GRAD_SYNC_SCOPE):
            return self._map(reduce, grads)
