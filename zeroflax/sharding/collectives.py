"""ZeRO-3's gather: "store one way, compute another".

Inside the engine's loss (a `shard_map` that is manual over the `data` axis), a ZeRO-3 parameter is
its local shard; where it is used it is gathered (`gather_for_compute`; a handle does it,
`sharding.handles`):

  forward   cast the fp32 shard to the compute dtype, then all-gather (2 bytes/element in bf16), or
            with qwZ all-gather int8 blocks and their scales and dequantize on arrival
  backward  reduce-scatter the weight's cotangent in the gradient dtype (fp32)

A leaf that the data size does not divide is stored padded (`sharding.padding`): the gather cuts the
padding off, and the backward pass pads the cotangent with zeros before the reduce-scatter, so the model
sees the true shape and the padding gets a zero gradient.

It is a `custom_vjp`, so the reduction is a reduce-scatter by construction, not whatever the
partitioner infers, and it keeps no residual. No remat policy (`sharding.remat`) saves the gathered
weights (they are not matmul outputs): the backward pass gathers again, as ZeRO-3 does, instead of
holding all layers' weights until the backward pass. (That is why `Config` refuses remat 'none' with
ZeRO-3: without rematerialisation every layer's gathered weights would be kept.) Inside a scan the
forward and backward loops are separate computations, so XLA cannot merge the two gathers; for
unscanned groups `sharding.groups` explains the ties that keep them apart.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from zeroflax.sharding.manual import on_slices


def all_gather_exact(x, dim: int, axis: str):
    """A tiled all-gather of x along `dim` over mesh axis `axis` that moves x's own bytes.

    16-bit floats travel as uint16: bit-exact, and the CPU backend would otherwise widen bf16/fp16
    collectives to fp32 (doubling the bytes); GPUs carry them as they are."""
    if jnp.dtype(x.dtype).itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating):
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16)
        gathered = jax.lax.all_gather(bits, axis, axis=dim, tiled=True)
        return jax.lax.bitcast_convert_type(gathered, x.dtype)
    return jax.lax.all_gather(x, axis, axis=dim, tiled=True)


def quantize_blocks(x, block: int):
    """int8 blocks of `block` consecutive elements of x (flattened), one scale (max |x| / 127) per block.

    Returns (q int8 [blocks, block], scale float32 [blocks]); the last block is zero-padded.
    """
    flat = x.astype(jnp.float32).ravel()
    pad = (-flat.size) % block
    blocks = jnp.pad(flat, (0, pad)).reshape(-1, block)
    amax = jnp.max(jnp.abs(blocks), axis=1)
    scale = jnp.where(amax > 0, amax / 127.0, 1.0)
    q = jnp.clip(jnp.round(blocks / scale[:, None]), -127, 127).astype(jnp.int8)
    return q, scale


def dequantize_blocks(q, scale, shape, dtype):
    """The inverse of `quantize_blocks` (up to rounding): an array of `shape` in `dtype`."""
    flat = (q.astype(jnp.float32) * scale[..., None]).reshape(q.shape[:-2] + (-1,))
    size = math.prod(shape)
    return flat[..., :size].reshape(q.shape[:-2] + tuple(shape)).astype(dtype)


def _quantized_all_gather(shard, dim: int, axis: str, compute_dtype, block: int):
    """ZeRO++ qwZ: all-gather int8 blocks and their scales, dequantize on arrival to `compute_dtype`.

    The scales travel in the compute dtype's width when it is 16-bit (as uint16 bits), so a block of
    256 costs 258 bytes instead of 512 in bf16. A shard smaller than a block is one block of its size."""
    q, scale = quantize_blocks(shard, max(1, min(block, shard.size)))
    if jnp.dtype(compute_dtype).itemsize == 2:
        scale = scale.astype(compute_dtype)
    q_all = jax.lax.all_gather(q, axis, axis=0, tiled=False)  # [N, blocks, block]
    scale_all = all_gather_exact(scale[None], 0, axis)  # [N, blocks]
    parts = dequantize_blocks(q_all, scale_all.astype(jnp.float32), shard.shape, compute_dtype)  # [N, *shard]
    # The N shards side by side along `dim`, as a tiled all-gather would have put them.
    parts = jnp.moveaxis(parts, 0, dim)
    shape = list(shard.shape)
    shape[dim] *= parts.shape[dim]
    return parts.reshape(shape)


def cut_padding(x, dim: int, pad: int):
    """x without the last `pad` entries along `dim` (the padding of a stored leaf)."""
    if not pad:
        return x
    return jax.lax.slice_in_dim(x, 0, x.shape[dim] - pad, axis=dim)


def add_padding(x, dim: int, pad: int):
    """x with `pad` zeros appended along `dim` (the stored leaf's padding)."""
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[dim] = (0, pad)
    return jnp.pad(x, widths)


def padded_scatter(x, dim: int, axis: str, pad: int = 0):
    """The reduce-scatter of x (true shape) over `axis` along `dim` into this device's shard of the stored
    (padded) leaf."""
    return jax.lax.psum_scatter(add_padding(x, dim, pad), axis, scatter_dimension=dim, tiled=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5, 6))
def gather_for_compute(shard, dim: int, axis: str, compute_dtype, quant_block: int = 0, sliced: tuple = (),
                       pad: int = 0):
    """All-gather a ZeRO-3 shard along `dim` over mesh axis `axis`, in `compute_dtype`.

    quant_block > 0: ZeRO++'s quantized weights (qwZ): int8 blocks of that many elements travel
    instead of the compute dtype; the gradient is the reduce-scatter of the cotangent either way.
    sliced: the automatic mesh axis (tensor) slicing each dimension, or None: the gather and its
    reduce-scatter move this device's tensor slice only (`sharding.manual`).
    pad: the stored leaf's padding along `dim`, cut off after the gather (`sharding.padding`).
    """
    return on_slices(lambda s: cut_padding(_gather_shard(s, dim, axis, compute_dtype, quant_block), dim, pad),
                     shard, sliced)


def _gather_shard(shard, dim: int, axis: str, compute_dtype, quant_block: int):
    if quant_block:
        return _quantized_all_gather(shard, dim, axis, compute_dtype, quant_block)
    return all_gather_exact(shard.astype(compute_dtype), dim, axis)


def _gather_fwd(shard, dim, axis, compute_dtype, quant_block, sliced, pad):
    # The only residual is a zero-size array carrying the master dtype for the backward cast.
    return (gather_for_compute(shard, dim, axis, compute_dtype, quant_block, sliced, pad),
            jnp.zeros((0,), shard.dtype))


def _gather_bwd(dim, axis, compute_dtype, quant_block, sliced, pad, dtype_carrier, cotangent):
    scatter = lambda c: padded_scatter(c.astype(dtype_carrier.dtype), dim, axis, pad)
    return (on_slices(scatter, cotangent, sliced),)


gather_for_compute.defvjp(_gather_fwd, _gather_bwd)


def in_host_memory(x) -> bool:
    """Whether x (an array or tracer) is typed as living in host memory."""
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7))
def gather_from_host(sink, source, dim: int, axis: str, compute_dtype, quant_block: int = 0, sliced: tuple = (),
                     pad: int = 0):
    """`gather_for_compute` of a shard held in host memory (ZeRO-3 with `offload_param`).

    `source`, this device's shard of the master weights on the host, comes to the device and is
    gathered there. Its gradient (the reduce-scatter) is `sink`'s: a device array of the shard's shape
    that the forward pass never reads, so gradients stay on the device, like every other leaf's, and
    reach the host once per step with them rather than once per layer and micro-batch.
    """
    del sink
    # Per tensor slice: each device streams only its own slice of the shard.
    stream = lambda s: cut_padding(_gather_shard(jax.device_put(s, jax.memory.Space.Device), dim, axis,
                                                 compute_dtype, quant_block), dim, pad)
    return on_slices(stream, source, sliced)


def _from_host_fwd(sink, source, dim, axis, compute_dtype, quant_block, sliced, pad):
    out = gather_from_host(sink, source, dim, axis, compute_dtype, quant_block, sliced, pad)
    return out, jnp.zeros((0,), sink.dtype)


def _from_host_bwd(dim, axis, compute_dtype, quant_block, sliced, pad, dtype_carrier, cotangent):
    (grad,) = _gather_bwd(dim, axis, compute_dtype, quant_block, sliced, pad, dtype_carrier, cotangent)
    return grad, None


gather_from_host.defvjp(_from_host_fwd, _from_host_bwd)
