"""Long sequences split over the `sequence` mesh axis: DeepSpeed-Ulysses and ring attention.

With a `sequence` axis of S devices, every device of a sequence group holds the same examples and works on
1/S of their tokens from the embedding to the loss: the residual stream, the layer norms, the MLPs and
what remat keeps are 1/S of a whole sequence's. Only attention needs the other tokens. A model takes part
with two calls, both plain outside the engine or without a sequence axis:

    tokens = sequence_slice(tokens)               # this device's tokens (and positions, targets) only
    out = sequence_attention(attention)(q, k, v)  # q, k, v: this device's [batch, tokens, heads, head_dim]

`Config.sequence_attention` chooses how attention sees the whole sequence:

- 'ulysses' (DeepSpeed-Ulysses): an all-to-all turns the split over tokens into a split over heads, any
  attention function (dense, cuDNN, block-sparse) runs on every token for H/S heads, and an all-to-all
  turns the output back. Per layer: 4 all-to-alls of a [batch, T/S, heads, head_dim] activation forward
  (q, k, v, out) and 4 backward; the heads (per tensor slice) must be divisible by S.
- 'ring' (ring attention): keys and values travel around the ring of S devices (`ppermute`) while each
  device's queries stay; a blockwise online softmax (`sharding/ring_attention.py`) needs no head
  divisibility. Causal attention is load-balanced by the zigzag layout: the sequence is cut into 2S chunks
  and device i holds chunks i and 2S-1-i, so every device skips the same number of masked blocks.
  `sequence_slice` lays out tokens, positions and targets in that order, so elementwise work and a mean
  over tokens are unaffected by it.

The loss each device returns is the mean over its own tokens; the engine averages the devices' losses and
sums their gradients over data x sequence, which gives the whole batch's mean when the slices are equal,
as `sequence_slice` makes them. ZeRO partitions the model states over data x sequence
(`sharding.mesh.zero_axes`). A model that never calls `sequence_slice` still trains correctly (each
device of a group computes the whole sequence, and the mean of equal losses is that loss), but saves
nothing: the engine warns.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zeroflax.config import ConfigError
from zeroflax.sharding.context import current_context
from zeroflax.sharding.manual import manual_over
from zeroflax.sharding.mesh import SEQUENCE_AXIS, TENSOR_AXIS

SIZE_KEY = f"MeshConfig.axes['{SEQUENCE_AXIS}']"


def _split_context():
    """The engine's layer context when the sequence is split (a sequence axis larger than 1), else None."""
    ctx = current_context()
    return ctx if ctx is not None and ctx.sequence_size > 1 else None


def _check_divides(length: int, pieces: int, ctx, what: str) -> None:
    if length % pieces:
        raise ConfigError(SIZE_KEY, f"{what} of {length} positions does not split into {pieces} equal pieces "
                          f"({ctx.sequence_size} devices{', two chunks each for ring attention' if pieces != ctx.sequence_size else ''})",
                          f"use a sequence length divisible by {pieces}, or another sequence axis size")


def sequence_slice(x, axis: int = 1):
    """This device's part of `x` along `axis` (the sequence: tokens [batch, seq], positions [seq, d],
    targets): a contiguous 1/S for Ulysses, chunks i and 2S-1-i of 2S for ring attention. `x` unchanged
    outside the engine or without a sequence axis.

    The backward pass needs nothing special: a sliced input is the same on every device of the group, and
    the engine sums the devices' gradients over the sequence axis, which puts every slice's cotangent back."""
    ctx = _split_context()
    if ctx is None:
        return x
    if ctx.usage is not None:
        ctx.usage.sequence_slices += 1
    size, index = ctx.sequence_size, jax.lax.axis_index(SEQUENCE_AXIS)
    length = x.shape[axis]
    if ctx.sequence_attention == "ring":
        _check_divides(length, 2 * size, ctx, "a sequence")
        chunk = length // (2 * size)
        first = jax.lax.dynamic_slice_in_dim(x, index * chunk, chunk, axis)
        second = jax.lax.dynamic_slice_in_dim(x, (2 * size - 1 - index) * chunk, chunk, axis)
        return jnp.concatenate([first, second], axis=axis)
    _check_divides(length, size, ctx, "a sequence")
    part = length // size
    return jax.lax.dynamic_slice_in_dim(x, index * part, part, axis)


def sequence_attention(attention: Callable, causal: bool = True, softmax: bool = True) -> Callable:
    """attention(q, k, v) on [batch, seq, heads, head_dim], made to run on this device's tokens of a split
    sequence: `sequence_attention(attention)(q, k, v)` with q, k, v of this device's tokens (as
    `sequence_slice` laid them out) returns this device's rows of the attention over the whole sequence.

    Ulysses calls `attention` itself, on all tokens and H/S heads. Ring attention computes softmax attention
    of its own (blockwise; causal if `causal`) and uses `attention` only where the sequence is not split, so
    a model whose attention is something else (block-sparse layouts) says `softmax=False`, and ring attention
    is then refused. Outside the engine or without a sequence axis this is `attention`."""
    def run(q, k, v):
        ctx = _split_context()
        if ctx is None:
            return attention(q, k, v)
        if ctx.usage is not None:  # the communication report's unit (comm.sequence_axis_bytes)
            ctx.usage.sequence_attentions += 1
            ctx.usage.attention_bytes = (q.size * q.dtype.itemsize, k.size * k.dtype.itemsize, k.size)
        if ctx.sequence_attention == "ring":
            if not softmax:
                raise ConfigError("Config.sequence_attention", "'ring' computes dense softmax attention blockwise, "
                                  "but this model's attention is another function (block-sparse)",
                                  "use 'ulysses', which runs the model's own attention on a split over heads")
            from zeroflax.sharding.ring_attention import ring_attention
            return ring_attention(q, k, v, SEQUENCE_AXIS, causal=causal)
        return _ulysses(attention, q, k, v, ctx)

    return run


def _ulysses(attention: Callable, q, k, v, ctx):
    """Ulysses on this device's tensor slice of the heads (when `heads` maps to a tensor axis larger than 1):
    the all-to-alls then move each slice's own heads, and the heads stay where tensor slicing put them."""
    size, heads = ctx.sequence_size, q.shape[2]
    sliced = ctx.tensor_size > 1 and dict(ctx.logical_rules).get("heads") == TENSOR_AXIS
    slices = ctx.tensor_size if sliced else 1
    local = heads // slices
    if local % size:
        raise ConfigError("Config.sequence_attention", f"'ulysses' splits the heads over the {size} devices of the "
                          f"sequence axis, but there are {local} heads"
                          + (f" per tensor slice ({heads} over {slices})" if sliced else ""),
                          "use 'ring' (no head divisibility), or a sequence axis size that divides the heads")
    per_device = local // size
    pick = getattr(attention, "for_heads", None)  # an attention that differs by head (block-sparse layouts)

    def on_slice(q, k, v):
        # tokens split -> heads split: head group j goes to device j, which gets every device's tokens of it
        to_heads = lambda x: jax.lax.all_to_all(x, SEQUENCE_AXIS, split_axis=2, concat_axis=1, tiled=True)
        q, k, v = to_heads(q), to_heads(k), to_heads(v)
        if pick is None:
            out = attention(q, k, v)
        else:  # the heads this device now holds: tensor slice t's group j
            group = jax.lax.axis_index(SEQUENCE_AXIS) + (jax.lax.axis_index(TENSOR_AXIS) * size if sliced else 0)
            branches = [pick(g * per_device, per_device) for g in range(slices * size)]
            out = (branches[0](q, k, v) if all(b == branches[0] for b in branches)
                   else jax.lax.switch(group, branches, q, k, v))
        return jax.lax.all_to_all(out, SEQUENCE_AXIS, split_axis=1, concat_axis=2, tiled=True)

    if not sliced:
        return on_slice(q, k, v)
    spec = P(None, None, TENSOR_AXIS, None)
    return manual_over(on_slice, {TENSOR_AXIS}, (spec, spec, spec), spec)(q, k, v)
