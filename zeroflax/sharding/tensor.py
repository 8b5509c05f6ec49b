"""Tensor slicing (Megatron-LM) and its sequence parallelism (Korthikanti et al. 2022).

Parameters are sliced over the `tensor` axis by their logical names (`Config.logical_rules`: heads,
mlp and vocab by default), and XLA's partitioner, left automatic over `tensor` inside the engine's
step, runs a transformer with Megatron's communication: per layer, an all-reduce of the activation
after the row-parallel attention-out and MLP-out matmuls in the forward pass and two in the backward
(measured for the GPT: `benchmarks/pipeline.py`, docs/perf.md).

Sequence parallelism (`Config.sequence_parallel`) splits the activations between those matmuls (layer
norms, residual adds, what remat keeps) along the sequence over `tensor`: the row-parallel output is
reduce-scattered into sequence slices instead of all-reduced, and the slices are all-gathered before
the next column-parallel matmul; the same bytes, 1/T of the activations. XLA's partitioner does not do
that on its own: told to (sharding constraints), it all-reduces and slices, and all-gathers besides
(GPT 4 layers d 64, data 4 x tensor 2: 1.96x Megatron's bytes over `tensor`). So the model marks each
column-then-row-parallel pair with `tensor_parallel`, which under sequence parallelism runs it on this
device's slices with the all-gather and reduce-scatter explicit, and marks where its residual stream
starts with `sequence_split`. Without sequence parallelism both are plain calls, and outside the engine.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

from zeroflax.config import ConfigError
from zeroflax.sharding.collectives import all_gather_exact
from zeroflax.sharding.context import current_context
from zeroflax.sharding.manual import manual_over
from zeroflax.sharding.mesh import TENSOR_AXIS


def _sequence_parallel():
    """The engine's layer context when sequence parallelism is on (and the tensor axis > 1), else None."""
    ctx = current_context()
    return ctx if ctx is not None and ctx.tensor_size > 1 and ctx.sequence_parallel else None


def _split_spec(ctx, x, axis: int) -> P:
    if x.shape[axis] % ctx.tensor_size:
        raise ConfigError("Config.sequence_parallel", f"a sequence of {x.shape[axis]} positions does not split over "
                          f"the {ctx.tensor_size} devices of the tensor axis",
                          "use a sequence length divisible by the tensor size, or sequence_parallel False")
    return P(*[TENSOR_AXIS if d == axis else None for d in range(x.ndim)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _split(x, axis: int, split: P):
    """Whole on every tensor device -> this device's sequence slice; the backward all-gathers."""
    def take(x):
        size = x.shape[axis] // jax.lax.axis_size(TENSOR_AXIS)
        return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(TENSOR_AXIS) * size, size, axis)
    return manual_over(take, {TENSOR_AXIS}, P(), split)(x)


def _split_fwd(x, axis, split):
    return _split(x, axis, split), None


def _split_bwd(axis, split, _, cotangent):
    return (manual_over(lambda c: all_gather_exact(c, axis, TENSOR_AXIS), {TENSOR_AXIS}, split, P())(cotangent),)


_split.defvjp(_split_fwd, _split_bwd)


def sequence_split(x, axis: int = 1):
    """Where the residual stream starts (e.g. the embedding's output [batch, seq, d_model], whole on every
    tensor device): under `Config.sequence_parallel` each tensor device keeps its slice of dimension
    `axis` (the sequence) from here on, the layers' `tensor_parallel` pairs keep it split, and the
    backward pass all-gathers the slices' cotangents. Otherwise `x` unchanged.

    The split is explicit (a slice by tensor index), not a sharding constraint: a constraint would let
    XLA's partitioner split the tokens the embedding reads too, and a shifted slice of split tokens
    (inputs and targets) costs a halo exchange (collective-permute), which a pipeline stage's branch,
    run by some devices only, cannot complete."""
    ctx = _sequence_parallel()
    if ctx is None:
        return x
    if ctx.usage is not None:
        ctx.usage.sequence_splits += 1
    return _split(x, axis, _split_spec(ctx, x, axis))


def tensor_parallel(fn: Callable, *weight_names: tuple, axis: int = 1) -> Callable:
    """Megatron's column-parallel then row-parallel pair as one call: `tensor_parallel(fn, *names)(x, *weights)`.

    fn(x, *weights) -> y: x whole (e.g. a layer norm's output [batch, seq, d_model]), y of x's shape
    (before the residual add and the row-parallel bias). weight_names[i] are the logical axis names of
    weights[i], as the model's parameters name them (e.g. ('embed', 'mlp')). fn must be written for any
    size of the sliced dimensions (einsums over whatever heads or hidden units it gets).

    With `Config.sequence_parallel` fn runs on this device's tensor slices of the weights: x arrives
    split along `axis` and is all-gathered, fn's partial result is reduce-scattered back into sequence
    slices. Otherwise this is fn(x, *weights), sliced by XLA's partitioner.
    """
    def run(x, *weights):
        ctx = _sequence_parallel()
        if ctx is None:
            return fn(x, *weights)
        rules = dict(ctx.logical_rules)
        weight_specs = [P(*[TENSOR_AXIS if rules.get(name) == TENSOR_AXIS else None for name in names])
                        for names in weight_names]
        split = _split_spec(ctx, x, axis)

        def local(x, *weights):
            partial = fn(all_gather_exact(x, axis, TENSOR_AXIS), *weights)
            return jax.lax.psum_scatter(partial, TENSOR_AXIS, scatter_dimension=axis, tiled=True)

        return manual_over(local, {TENSOR_AXIS}, (split, *weight_specs), split)(x, *weights)

    return run
