"""Device mesh construction from `MeshConfig`."""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from zeroflax.axes import DATA_AXIS, PIPE_AXIS, SEQUENCE_AXIS, TENSOR_AXIS  # noqa: F401 (the names the package imports from here)
from zeroflax.config import MeshConfig


def build_mesh(mesh_config: MeshConfig, devices=None) -> Mesh:
    """A mesh over `devices` (default: all of them) with the configured named axes.

    Axes are `Auto` so XLA's SPMD partitioner propagates shardings; the engine makes the collectives
    it cares about explicit with `shard_map` (manual over the data axis only).
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_config.resolve(len(devices))
    names = tuple(sizes)
    shape = tuple(sizes.values())
    device_array = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(device_array, names, axis_types=(AxisType.Auto,) * len(names))


def data_size(mesh: Mesh) -> int:
    return mesh.shape[DATA_AXIS]


def pipe_size(mesh: Mesh) -> int:
    return mesh.shape.get(PIPE_AXIS, 1)


def sequence_size(mesh: Mesh) -> int:
    return mesh.shape.get(SEQUENCE_AXIS, 1)


def zero_axes(mesh: Mesh):
    """The mesh axes ZeRO partitions and reduces over: `data`, or (`data`, `sequence`) with a sequence axis.

    The devices of a sequence group hold different tokens of the same examples, so their gradients are
    summed like data-parallel devices' and nothing needs a whole copy of the model states per group: they
    are partitioned over data x sequence, as DeepSpeed-Ulysses partitions over its data and sequence
    groups together. A tuple of axis names is one axis to jax's collectives and to a PartitionSpec entry."""
    return (DATA_AXIS, SEQUENCE_AXIS) if sequence_size(mesh) > 1 else DATA_AXIS


def axis_names(axes) -> tuple:
    """The axis names of `axes` (one name, or a tuple of them as `zero_axes` gives)."""
    return (axes,) if isinstance(axes, str) else tuple(axes)


def zero_size(mesh: Mesh) -> int:
    """The devices ZeRO partitions over: data x sequence."""
    return mesh.shape[DATA_AXIS] * sequence_size(mesh)
