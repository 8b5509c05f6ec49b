"""What the engine tells the code it traces, and what that code tells it back.

While the engine traces the loss, a `LayerContext` is the current one (`layer_context`, a dynamic
scope per thread: `sharding.scopes.ThreadStack`): model code under it (gather groups, `scan_layers`,
the tensor-parallel pairs) reads the remat policy, the group sizes and the mesh's axes from it, and
fills in its `GatherUsage` (what was gathered where), which the engine's probe and reports read.
"""
from __future__ import annotations

import dataclasses

from zeroflax.sharding.mesh import DATA_AXIS
from zeroflax.sharding.scopes import ThreadStack


@dataclasses.dataclass
class GatherUsage:
    """What tracing the loss did with the ZeRO-3 handles: filled in while the engine traces it.

    gathered: leaf indices gathered at the point of use (groups, scans, `zeroflax.gather`).
    raw: leaf indices used as plain arrays without a gather (noted only by the engine's probe).
    groups: gather group name -> elements of its parameters (gathered together, dropped after use).
    remat_regions: how many checkpointed regions (groups, scanned layers) the loss has.
    failed: why the probe could not run the loss on handles (then every leaf is gathered on entry).
    layer_carry_bytes: bytes of the activation one scanned layer takes and returns, for one micro-batch
        on one device (the unit of the tensor axis's theory in the communication report); 0 if none.
    sequence_splits: how many activations the loss marks with `sequence_split` (sequence parallelism).
    sequence_slices, sequence_attentions: calls of `sequence_slice` and `sequence_attention` (a sequence axis).
    scan_owners: Flax modules found running a lifted transform over shared (unstacked) parameters.
    group_calls: every group call in the order traced, with the handles (leaf indices) it gathers.
    placed: leaf index -> how many gather groups the placement pass (`sharding.relocate`) made for it: one
        per use, or one for a scanned stack; `lookups`: how many of those read it at integer positions only.
    loss_traces: how many times the step traced the loss (twice with gradient accumulation: once for the
        shapes, once in the scan), by which `placed_by_leaf` divides.
    """

    probe: bool = False
    gathered: set = dataclasses.field(default_factory=set)
    raw: set = dataclasses.field(default_factory=set)
    groups: dict = dataclasses.field(default_factory=dict)
    remat_regions: int = 0
    failed: str | None = None
    layer_carry_bytes: int = 0
    sequence_splits: int = 0
    sequence_slices: int = 0
    sequence_attentions: int = 0
    attention_bytes: tuple = (0, 0, 0)  # the last sequence_attention call's (q bytes, k bytes, k elements)
    scan_owners: set = dataclasses.field(default_factory=set)  # Flax module paths: see LayerContext
    group_calls: list = dataclasses.field(default_factory=list)  # (group name, elements, leaf indices) in order
    lifted_in_groups: int = 0  # Flax modules met inside a group but bound to another scope tree (nn.scan, nn.RNN)
    loss_traces: int = 0
    placed: dict = dataclasses.field(default_factory=dict)
    lookups: dict = dataclasses.field(default_factory=dict)

    def placed_by_leaf(self) -> dict[int, tuple[int, int]]:
        """Leaf index -> (groups, lookups among them) the placement pass made for it in one trace of the
        loss. More than one group: a leaf gathered at each of several uses (a tied embedding at the lookup
        and at the head); a lookup's backward pass needs no parameters, so it gathers only forward. Counted
        from the pass itself, not from `group_calls`, where a module a lifted transform traces twice (an
        nn.scan body) would count twice."""
        traces = max(self.loss_traces, 1)
        return {index: (count // traces, self.lookups.get(index, 0) // traces) for index, count in self.placed.items()}


@dataclasses.dataclass(frozen=True)
class LayerContext:
    """What the engine tells model code while it traces the loss."""

    remat: str  # one of config.REMAT_POLICIES
    bucket: int = 0  # Config.prefetch_bucket_size: a module with at most this many parameters is one group
    max_live: int = 0  # Config.max_live_parameters: 0 = no limit; else the next group is gathered early
    #                    (prefetched) only while this group and the next fit in it together
    usage: GatherUsage | None = None
    sequence_parallel: bool = False  # Config.sequence_parallel: see sharding.tensor
    tensor_size: int = 1  # the tensor axis's size
    sequence_size: int = 1  # the sequence axis's size: see sharding.sequence
    sequence_attention: str = "ulysses"  # Config.sequence_attention
    logical_rules: tuple = ()  # Config.logical_rules: logical axis name -> mesh axis
    data_axis_aliases: tuple = ()  # Config.data_axis_aliases: a model's pmap-era axis names for the data axis
    data_axis: str = DATA_AXIS
    # Paths of Flax modules that run a lifted transform (nn.scan, nn.RNN) over modules sharing their
    # parameters at every step (a recurrent cell): found by the probe, each is one gather group whatever
    # its size, so the cell is gathered once per pass rather than once per step.
    scan_owners: frozenset = frozenset()


_contexts = ThreadStack()  # of LayerContext: the engine's, while it traces the loss


def layer_context(ctx: LayerContext):
    """A context manager: model code traced inside it (in this thread) sees `ctx` as `current_context()`."""
    return _contexts.push(ctx)


def current_context() -> LayerContext | None:
    return _contexts.top()


def current_usage() -> GatherUsage | None:
    ctx = current_context()
    return ctx.usage if ctx is not None else None


def reused_leaves(group_calls, max_reuse_distance: int) -> dict:
    """Leaves gathered by more than one group call that stay within reuse distance: leaf index -> how
    many calls use it. A leaf qualifies when fewer than `max_reuse_distance` parameter elements are
    gathered by the other calls between any two of its uses (DeepSpeed's stage3_max_reuse_distance)."""
    uses: dict = {}
    for position, (_, _, leaves) in enumerate(group_calls):
        for index in leaves:
            uses.setdefault(index, []).append(position)
    kept = {}
    for index, positions in uses.items():
        if len(positions) < 2:
            continue
        gaps = [sum(size for _, size, _ in group_calls[a + 1:b]) for a, b in zip(positions, positions[1:])]
        if max(gaps) < max_reuse_distance:
            kept[index] = len(positions)
    return kept
