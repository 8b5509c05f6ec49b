"""Padding: how a leaf that no mesh axis divides is still partitioned over it.

A `jax.Array` must split evenly over the devices of each mesh axis that partitions it, so a 4096 x 11008
matrix cannot be split six ways as it is. ZeRO partitions it anyway (`sharding.policy`): the leaf is
*stored* with its ZeRO dimension zero-padded up to a multiple of the data size (4096 -> 4098 rows on 6
devices, at most N-1 rows: 0.05% here), and every part of the step that reads it sees its *true* shape:

  - inside the step's shard_map, a gathered leaf is cut back to its true size after the all-gather, and
    a gradient is padded before its reduce-scatter (`sharding.collectives`, `step/zero_sync.py`);
  - in the global view, the update cuts every state to its true shape, runs the optimizer, and pads the
    results again (`fit`): XLA's partitioner keeps uneven shards as this very padded layout
    (ceil(4096 / 6) = 683 rows each), so the cut and the pad are local, no data moves;
  - checkpoints hold the stored arrays with the padding's zeros and restore into any other padding
    (`checkpoint.py`); what users read (`Engine.model_params`, evaluation, the export) is the true shape.

The padded elements are zero at rest and never reach the model, the optimizer or a norm. The stored
shape is a pure function of the true shape and the sharding, so no table of paddings is kept: each dimension
rounded up to the number of shards along it (only ZeRO's `data` dimension can need it: a tensor-sliced
dimension must divide, `policy.logical_to_mesh_axes`).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding


def shards_per_dim(sharding, ndim: int) -> tuple[int, ...]:
    """How many pieces `sharding` (a NamedSharding; anything else: unsplit) cuts each dimension into."""
    if not isinstance(sharding, NamedSharding):
        return (1,) * ndim
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    sizes = []
    for axes in spec[:ndim]:
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        sizes.append(math.prod(sharding.mesh.shape[a] for a in axes))
    return tuple(sizes)


def stored_shape(shape, sharding) -> tuple[int, ...]:
    """The shape a leaf of true `shape` is stored with under `sharding`: each dimension rounded up to a
    multiple of its number of shards."""
    shape = tuple(shape)
    return tuple(-(-n // k) * k for n, k in zip(shape, shards_per_dim(sharding, len(shape))))


def stored_abstract(abstract_tree, shardings):
    """ShapeDtypeStructs of `abstract_tree` (true shapes) as stored under `shardings` (with them)."""
    def one(x, sharding):
        if not hasattr(x, "shape"):
            return x
        return jax.ShapeDtypeStruct(stored_shape(x.shape, sharding), x.dtype, sharding=sharding)
    return jax.tree.map(one, abstract_tree, shardings)


def cut(x, shape):
    """x cut to `shape` (its leading part along each dimension); x itself when it has that shape."""
    shape = tuple(shape)
    if tuple(x.shape) == shape:
        return x
    return jax.lax.slice(x, (0,) * len(shape), shape)


def pad_to(x, shape):
    """x zero-padded at the end of each dimension to `shape`; x itself when it has that shape."""
    shape = tuple(shape)
    if tuple(x.shape) == shape:
        return x
    return jnp.pad(x, [(0, n - m) for m, n in zip(x.shape, shape)])


def to_true(tree, abstract_true):
    """Every leaf of `tree` (stored) cut to its true shape (`abstract_true`: the same structure)."""
    return jax.tree.map(lambda x, a: x if x is None or not hasattr(a, "shape") else cut(x, a.shape), tree,
                        abstract_true, is_leaf=lambda x: x is None)


def fit(tree, abstract_true, shardings):
    """Every leaf of `tree` (stored under any sharding, or true) as stored under `shardings`: cut to its true
    shape, padded to the stored one, and constrained there (inside jit). A leaf whose sharding is None is
    left out (None)."""
    def one(x, a, sharding):
        if sharding is None or x is None:
            return None
        if not hasattr(a, "shape"):
            return x
        y = pad_to(cut(x, a.shape), stored_shape(a.shape, sharding))
        return jax.lax.with_sharding_constraint(y, sharding)
    return jax.tree.map(one, tree, abstract_true, shardings, is_leaf=lambda x: x is None)


def constrain_true(tree, abstract_true, shardings):
    """Every leaf cut to its true shape and constrained to `shardings` (uneven shards inside jit: XLA's
    partitioner pads them itself, in the same layout as the stored padding)."""
    def one(x, a, sharding):
        if x is None or not hasattr(a, "shape"):
            return x
        return jax.lax.with_sharding_constraint(cut(x, a.shape), sharding)
    return jax.tree.map(one, tree, abstract_true, shardings, is_leaf=lambda x: x is None)
