"""ZeRO placement policy: pure functions from (abstract pytree, mesh, config) to shardings.

Two layers compose per leaf:
  1. its own partitioning, from logical axis names through `Config.logical_rules` (tensor slicing);
  2. with a `pipe` axis, the stacked-layer dimension over it (each pipeline stage holds its layers);
  3. ZeRO's partitioning over the `data` axis, on any data size: of the dimensions not already
     partitioned, one the data size divides (the largest; ties go to the last), else the one whose
     padding to a multiple of the data size adds the fewest elements (`sharding.padding`: the leaf is
     stored padded, every reader sees its true shape). Leaves smaller than `Config.persistence_threshold`
     (per layer, for stacked layers) stay replicated, as do leaves whose every dimension is already
     partitioned. The stacked-layer dimension itself (logical name 'layers' in front) is never
     ZeRO-partitioned, so that a scan over layers gathers one layer at a time.

Which states carry the data axis is the one table ZeRO is about:

    stage   params   grads   optimizer state
    0       -        -       -
    1       -        data    data      (gradients are reduce-scattered, the update runs on a shard)
    2       -        data    data      (and accumulated sharded across micro-batches)
    3       data     data    data

Offload (ZeRO-Offload) adds memory kinds, decided here too: with `Config.offload_optimizer` the fp32
master weights and the optimizer state are in host memory, partitioned over `data` at every stage
(12 bytes per parameter / N), and the device keeps a compute-dtype copy of the parameters, laid out as
the loss receives them (whole at stages 1-2, a shard at stage 3). With `Config.offload_param` the device
keeps no copy of a ZeRO-partitioned leaf: the gather streams its master shard from the host.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zeroflax.config import Config, ConfigError
from zeroflax.sharding.mesh import DATA_AXIS, PIPE_AXIS, SEQUENCE_AXIS, TENSOR_AXIS, pipe_size, zero_axes, zero_size
from zeroflax.sharding.padding import stored_abstract, stored_shape

LAYERS_AXIS = "layers"

# stage -> which of (params, grads, optimizer state) are partitioned over the data axis.
ZERO_PARTITIONED = {
    0: dict(params=False, grads=False, opt_state=False),
    1: dict(params=False, grads=True, opt_state=True),
    2: dict(params=False, grads=True, opt_state=True),
    3: dict(params=True, grads=True, opt_state=True),
}


@dataclasses.dataclass(frozen=True)
class LeafPlacement:
    """Where one parameter leaf lives: its own mesh axes per dim, plus the ZeRO dimension."""

    shape: tuple[int, ...]
    base: tuple[Any, ...]  # mesh axis name (or None) for each dimension, without the data axis
    zero_dim: int | None  # the dimension partitioned over `data`, or None (replicated over data)
    stacked: bool  # leading dimension is a stack of layers
    pad: int = 0  # zeros appended to `zero_dim` where the leaf is partitioned (sharding.padding)
    zero_axis: Any = DATA_AXIS  # the mesh axes ZeRO partitions over: `data`, or (`data`, `sequence`)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape of the leaf where it is partitioned over `data` (padded along `zero_dim`)."""
        if not self.pad:
            return self.shape
        return tuple(n + self.pad if d == self.zero_dim else n for d, n in enumerate(self.shape))

    def spec(self, with_data: bool) -> P:
        axes = list(self.base)
        if with_data and self.zero_dim is not None:
            axes[self.zero_dim] = self.zero_axis
        return P(*axes)

    def pipe_spec(self) -> P:
        """The spec naming only the `pipe` axis (the stacked layers of a pipeline; empty without one)."""
        return P(*[axis if axis == PIPE_AXIS else None for axis in self.base])

    def auto_spec(self) -> tuple:
        """Per dimension, the automatic mesh axis (`tensor`) slicing it, or None: the spec of this
        device's view inside the engine's shard_map, which is manual over `data` and `pipe`."""
        return tuple(None if axis == PIPE_AXIS else axis for axis in self.base)

    def data_spec(self) -> P:
        """The spec naming only the manual axes, `data` and `pipe`: shard_map's in/out spec."""
        axes = list(self.pipe_spec()) + [None] * (len(self.shape) - len(self.pipe_spec()))
        if self.zero_dim is not None:
            axes[self.zero_dim] = self.zero_axis
        return P(*axes)


def is_placement(x) -> bool:
    """`is_leaf` for a tree of placements (a `ShardingPlan.placements`): a LeafPlacement is one leaf."""
    return isinstance(x, LeafPlacement)


def is_none(x) -> bool:
    """`is_leaf` for a tree with None leaves (a `ShardingPlan.compute`: None for a leaf streamed from the
    host), so that jax's tree functions keep them as leaves rather than empty subtrees."""
    return x is None


def choose_zero_dim(shape, base, data_size: int, threshold: int, stacked: bool) -> int | None:
    """The dimension ZeRO partitions over the data axis, or None to keep the leaf replicated."""
    return zero_placement(shape, base, data_size, threshold, stacked)[0]


def zero_placement(shape, base, data_size: int, threshold: int, stacked: bool) -> tuple[int | None, int]:
    """(the dimension ZeRO partitions over the data axis or None, the zeros it is padded with).

    A dimension the data size divides costs no padding and is taken first (the largest; ties go to the
    last dimension); else the dimension whose padding adds the fewest elements (ties: the larger)."""
    if data_size == 1 or len(shape) == 0:
        return None, 0
    first = 1 if stacked else 0
    per_layer = math.prod(shape[first:])
    if per_layer < max(threshold, 1):
        return None, 0
    candidates = [d for d in range(first, len(shape)) if base[d] is None]
    if not candidates:
        return None, 0
    pad = lambda d: -shape[d] % data_size
    added = lambda d: pad(d) * math.prod(n for i, n in enumerate(shape) if i != d)
    dim = min(candidates, key=lambda d: (added(d), -shape[d], -d))
    return dim, pad(dim)


def logical_to_mesh_axes(names, rules, mesh: Mesh, path: str, shape) -> tuple:
    """Map a leaf's logical axis names to mesh axes through the rule table; check divisibility."""
    # Mesh axis names (from nn.with_partitioning) map to themselves; 'data' and 'sequence' are ZeRO's alone.
    table = {axis: axis for axis in mesh.axis_names if axis not in (DATA_AXIS, SEQUENCE_AXIS)}
    table.update(rules)
    axes = []
    for dim, name in enumerate(names):
        if name is None:
            axes.append(None)
            continue
        if name in (DATA_AXIS, SEQUENCE_AXIS):
            raise ConfigError("logical_axes", f"parameter {path} names the '{name}' axis",
                              "the data and sequence axes are reserved for ZeRO partitioning; name another axis")
        if name not in table:
            raise ConfigError("Config.logical_rules", f"no rule for logical axis {name!r} of parameter {path}",
                              f"add ({name!r}, None) or ({name!r}, {TENSOR_AXIS!r}) to the rules")
        axis = table[name]
        if axis is not None and mesh.shape.get(axis, 1) > 1:
            if shape[dim] % mesh.shape[axis]:
                raise ConfigError(f"MeshConfig.axes['{axis}']",
                                  f"parameter {path} dimension {dim} ({name}, size {shape[dim]}) is not "
                                  f"divisible by the {axis} axis size {mesh.shape[axis]}",
                                  f"choose a {axis} size that divides {shape[dim]}, or map {name!r} to None")
            axes.append(axis)
        else:
            axes.append(None)
    return tuple(axes)


def place_params(abstract_params, logical_axes, mesh: Mesh, config: Config):
    """A tree of LeafPlacement, one per parameter leaf.

    `logical_axes` is None or a tree with the params' structure whose leaves are tuples of logical
    names (one per dimension; None entries for unnamed dimensions) or None for an unnamed leaf.
    """
    data_size, axis = zero_size(mesh), zero_axes(mesh)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract_params)
    if logical_axes is None:
        names_list = [None] * len(leaves)
    else:
        names_list = treedef.flatten_up_to(logical_axes)
    placements = []
    for (path, leaf), names in zip(leaves, names_list):
        shape = tuple(leaf.shape)
        path_str = jax.tree_util.keystr(path)
        if names is None:
            base = (None,) * len(shape)
            stacked = False
        else:
            names = tuple(names)
            if len(names) > len(shape):
                raise ConfigError("logical_axes", f"parameter {path_str} has shape {shape} but "
                                  f"{len(names)} logical names {names}", "give at most one name (or None) per dimension")
            # Fewer names than dimensions leave the trailing ones unnamed, as a PartitionSpec does (and so
            # Flax's own boxes: lm1b's attention kernels have 3 dimensions and 2 names).
            names = names + (None,) * (len(shape) - len(names))
            base = logical_to_mesh_axes(names, config.logical_rules, mesh, path_str, shape)
            stacked = len(names) > 0 and names[0] == LAYERS_AXIS
            if stacked and pipe_size(mesh) > 1:  # pipeline: each stage holds its own layers
                base = (PIPE_AXIS,) + base[1:]
        zero_dim, pad = zero_placement(shape, base, data_size, config.persistence_threshold, stacked)
        placements.append(LeafPlacement(shape, base, zero_dim, stacked, pad, axis))
    return jax.tree_util.tree_unflatten(treedef, placements)


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """The shardings of every state the engine holds, for one ZeRO stage."""

    mesh: Mesh
    stage: int
    placements: Any  # tree of LeafPlacement (params structure)
    params: Any  # tree of NamedSharding: (master) parameters at rest
    grads: Any  # tree of NamedSharding: reduced gradients (on the device)
    opt_state: Any  # tree of NamedSharding: optimizer state at rest
    # Offload only (else None): the device's compute-dtype copy of the parameters (None for a leaf
    # streamed from the host), and the reduced gradients' place on the host.
    compute: Any = None
    host_grads: Any = None
    # The true shapes (ShapeDtypeStructs) of the parameters and the optimizer state: the states are
    # stored padded where a partitioned dimension is not a multiple of its shards (sharding.padding).
    abstract_params: Any = None
    abstract_opt_state: Any = None

    def stored(self, what: str):
        """ShapeDtypeStructs (with shardings) of 'params', 'grads' or 'opt_state' as stored."""
        abstract = self.abstract_opt_state if what == "opt_state" else self.abstract_params
        return stored_abstract(abstract, getattr(self, what))

    @property
    def padded(self) -> bool:
        """Whether a state is stored padded: a leaf partitioned over `data` (its optimizer state from stage 1
        on, its master weights at stage 3 or under offload) whose dimensions the data size divides none of."""
        partitions = self.stage >= 1 or self.offload
        return partitions and any(p.pad for p in jax.tree.leaves(self.placements, is_leaf=is_placement))

    @property
    def offload(self) -> bool:
        return self.compute is not None

    def streamed(self) -> list[bool]:
        """Per parameter leaf (flattened): is it streamed from the host where it is gathered?"""
        if self.compute is None:
            return [False] * len(jax.tree.leaves(self.placements, is_leaf=is_placement))
        return [c is None for c in jax.tree.leaves(self.compute, is_leaf=is_none)]

    def true_params_shardings(self):
        """Where the parameters go in their true shapes (`Engine.model_params`): as at rest, except that a
        leaf stored padded is whole over `data` (a jax.Array cannot split it unevenly)."""
        def one(p: LeafPlacement, at_rest: NamedSharding):
            return at_rest if not p.pad else NamedSharding(self.mesh, p.spec(False), memory_kind=at_rest.memory_kind)
        return jax.tree.map(one, self.placements, self.params, is_leaf=is_placement)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def batch(self, batch_tree):
        """Batch leaves are split over the data axis along their leading dimension."""
        return jax.tree.map(lambda _: NamedSharding(self.mesh, P(DATA_AXIS)), batch_tree)

    def data_specs(self, state: str):
        """shard_map specs (manual over `data`, and `pipe` when there is one) of 'params' as they enter
        the loss, or of 'grads'."""
        partitioned = ZERO_PARTITIONED[self.stage][state]
        return jax.tree.map(lambda p: p.data_spec() if partitioned else p.pipe_spec(), self.placements,
                            is_leaf=is_placement)


def _sharding_tree(mesh, placements, with_data: bool, memory_kind: str | None = None):
    return jax.tree.map(lambda p: NamedSharding(mesh, p.spec(with_data), memory_kind=memory_kind), placements,
                        is_leaf=is_placement)


def opt_state_shardings(optimizer: optax.GradientTransformation, abstract_opt_state, placements, mesh: Mesh,
                        config: Config, with_data: bool, memory_kind: str | None = None):
    """Shardings of the optimizer state, derived from its abstract shape.

    Parameter-shaped parts (found with `optax.tree_map_params`, i.e. by position in the params
    structure, not by shape) follow their parameter's placement; a state leaf whose shape differs
    from its parameter's (e.g. a factored second moment) gets the shape rule on its own; everything
    else (step counts, scalars) is replicated.
    """
    data_size, axis = zero_size(mesh), zero_axes(mesh)

    def for_param_slot(state_leaf, placement):
        if not hasattr(state_leaf, "shape"):
            return state_leaf
        if tuple(state_leaf.shape) == placement.shape:
            return NamedSharding(mesh, placement.spec(with_data), memory_kind=memory_kind)
        shape = tuple(state_leaf.shape)
        base = (None,) * len(shape)
        zero_dim, pad = zero_placement(shape, base, data_size, config.persistence_threshold, False)
        return NamedSharding(mesh, LeafPlacement(shape, base, zero_dim, False, pad, axis).spec(with_data),
                             memory_kind=memory_kind)

    def for_other(state_leaf):
        return NamedSharding(mesh, P(), memory_kind=memory_kind) if hasattr(state_leaf, "shape") else state_leaf

    return optax.tree_map_params(optimizer, for_param_slot, abstract_opt_state, placements,
                                 transform_non_params=for_other, is_leaf=is_placement)


def make_plan(optimizer, abstract_params, logical_axes, mesh: Mesh, config: Config) -> ShardingPlan:
    stage = config.zero_stage
    which = ZERO_PARTITIONED[stage]
    placements = place_params(abstract_params, logical_axes, mesh, config)
    abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
    offload = config.offload_optimizer.enabled
    host = config.host_memory_kind if offload else None
    compute = host_grads = None
    if offload:
        stream = config.offload_param.enabled
        compute = jax.tree.map(lambda p: None if stream and p.zero_dim is not None
                               else NamedSharding(mesh, p.spec(which["params"])), placements, is_leaf=is_placement)
        host_grads = _sharding_tree(mesh, placements, which["grads"], host)
    return ShardingPlan(
        mesh=mesh,
        stage=stage,
        placements=placements,
        # Offloaded master weights are partitioned like the optimizer state they are updated with.
        params=_sharding_tree(mesh, placements, which["params"] or offload, host),
        grads=_sharding_tree(mesh, placements, which["grads"]),
        opt_state=opt_state_shardings(optimizer, abstract_opt, placements, mesh, config, which["opt_state"], host),
        compute=compute,
        host_grads=host_grads,
        abstract_params=jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract_params),
        abstract_opt_state=jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract_opt),
    )


def shard_bytes(abstract_tree, sharding_tree) -> int:
    """Bytes one device holds of a tree of arrays under the given shardings (padding included: the leaves
    may have their true or their stored shapes)."""
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(sharding_tree)):
        shard_shape = sharding.shard_shape(stored_shape(leaf.shape, sharding))
        total += math.prod(shard_shape) * np.dtype(leaf.dtype).itemsize
    return total
