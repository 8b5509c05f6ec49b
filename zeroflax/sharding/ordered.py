"""Sums over a manual mesh axis whose result does not depend on how the devices are spread over processes.

Why: `psum` and `psum_scatter` leave the order of the floating-point additions to the collective's
implementation. XLA's in-process CPU collectives, gloo across processes and NCCL's rings and trees each add
the N devices' values in their own order (and gloo's order changes with the number of processes), so the
same job on 1 process x 8 devices and on 2 x 4 sums to results that differ in the last bits. Adam-like
optimizers mostly forgive that; 1-bit Adam does not: its variance is frozen after the warm-up, and an
element whose mean warm-up gradient nearly cancels over the devices has a tiny variance, a huge step
(lr x scale / sqrt(v)) and a relative rounding error of its gradient up to 1e-3 (docs/onebit_adam.md,
"Multi-process", measures it).

How: the sums here move data only with collectives that add nothing (`all_to_all`, `all_gather`) and add
on the device, in the fixed order of the devices' indices along the axis (((x_0 + x_1) + x_2) + ...):

    reduce-scatter   all_to_all, so that device i holds every device's piece i; then the local sum
    all-reduce       the reduce-scatter of the flattened (zero-padded) array, then an all_gather

Given the same inputs on the same device indices, every layout therefore computes the same bits. The mesh
must give a device the same index in every layout (zeroflax's meshes are process-major, so it does).

The cost: a device sends and receives the same bytes as a ring reduce-scatter ((N-1)/N of the array) and
a ring all-reduce (2 (N-1)/N), but it receives all N pieces of its chunk before it adds them, so it holds
N times its chunk at once (the array's size, transiently) where a ring holds two chunks, and the additions
cannot overlap the transfers as a ring's do. An all-reduce of fewer elements than N is padded to N.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def _sum_in_order(pieces):
    """pieces (N, ...) -> pieces[0] + pieces[1] + ... + pieces[N-1], added left to right. Written as a chain
    of adds, not `sum(axis=0)`, whose order XLA's reduction emitter may choose (vectorised, tree-shaped)."""
    total = pieces[0]
    for k in range(1, pieces.shape[0]):
        total = total + pieces[k]
    return total


def ordered_psum_scatter(x, axis: str, scatter_dimension: int = 0):
    """`jax.lax.psum_scatter(x, axis, scatter_dimension=..., tiled=True)`, with the devices' values added
    in the order of their indices along `axis`. x.shape[scatter_dimension] must be a multiple of the
    axis size N; device i gets the sum's i-th of N blocks along that dimension."""
    n = jax.lax.axis_size(axis)
    d = scatter_dimension
    if x.shape[d] % n:
        raise ValueError(f"ordered_psum_scatter: dimension {d} of shape {x.shape} is not a multiple of {n}")
    if n == 1:
        return x
    blocks = jnp.moveaxis(x.reshape(x.shape[:d] + (n, x.shape[d] // n) + x.shape[d + 1:]), d, 0)
    # received[k]: device k's block i, on device i (all_to_all sends block j to device j, and stacks what
    # arrives by the sender's index)
    received = jax.lax.all_to_all(blocks, axis, 0, 0, tiled=False)
    return _sum_in_order(received)


def ordered_psum(x, axis: str):
    """`jax.lax.psum(x, axis)` (one array), with the devices' values added in the order of their indices."""
    n, size = jax.lax.axis_size(axis), math.prod(x.shape)
    if n == 1 or size == 0:
        return x
    flat = jnp.pad(x.reshape(-1), (0, -size % n))
    mine = ordered_psum_scatter(flat, axis, 0)
    whole = jax.lax.all_gather(mine, axis, tiled=True)
    return whole[:size].reshape(x.shape)


def ordered_pmean(x, axis: str):
    """`jax.lax.pmean(x, axis)` with the sum of `ordered_psum`."""
    return ordered_psum(x, axis) / jax.lax.axis_size(axis)


def sum_scatter(x, axis: str, dimension: int, ordered: bool):
    """The tiled reduce-scatter of x along `dimension`: `ordered_psum_scatter` if `ordered`, else psum_scatter."""
    if ordered:
        return ordered_psum_scatter(x, axis, dimension)
    return jax.lax.psum_scatter(x, axis, scatter_dimension=dimension, tiled=True)


def sum_all(x, axis: str, ordered: bool):
    """The all-reduce of x: `ordered_psum` if `ordered`, else psum."""
    return ordered_psum(x, axis) if ordered else jax.lax.psum(x, axis)


def mean_all(x, axis: str, ordered: bool):
    """The mean over `axis`: `ordered_pmean` if `ordered`, else pmean."""
    return ordered_pmean(x, axis) if ordered else jax.lax.pmean(x, axis)


def ordered_global_norm(sharded, whole, axis: str):
    """The L2 norm of a gradient whose leaves `sharded` are split over `axis` (each device holds its part)
    and whose leaves `whole` every device holds entirely: the parts' squared sums added in device order
    (`ordered_psum`), the whole leaves' once. Inside a region manual over `axis`; the same bits in any
    layout, unlike the norm of the global arrays, whose all-reduce XLA emits in the library's order."""
    square = lambda leaves: sum((jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves), jnp.float32(0))
    return jnp.sqrt(ordered_psum(square(sharded), axis) + square(whole))
