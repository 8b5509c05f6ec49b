"""ZeRO-3 "store one way, compute another": parameters gathered just in time, one layer at a time.

Inside the engine's loss (a `shard_map` that is manual over the `data` axis), a ZeRO-3 parameter is
its local shard. Leaves that are not stacked layers are gathered once on entry. Stacked-layer leaves
reach the model as `ShardedLeaf` handles; `scan_layers` slices them per layer and gathers each slice
inside the loop body, so only the current layer's weights are ever whole on a device. The gather:

  forward   cast the fp32 shard to the compute dtype, then all-gather (2 bytes/element in bf16)
  backward  reduce-scatter the weight's cotangent in the gradient dtype (fp32)

It is a `custom_vjp`, so the reduction is a reduce-scatter by construction, not whatever the
partitioner infers, and it keeps no residual. No remat policy below saves the gathered weights
(they are not matmul outputs): the backward pass gathers again, as ZeRO-3 does, instead of holding
all layers' weights until the backward pass. (That is why `Config` refuses remat 'none' with
ZeRO-3: without rematerialisation every layer's gathered weights would be kept.)

Models call `scan_layers` for their stack of layers; outside the engine it is a plain (optionally
rematerialised) scan, so the same model code runs anywhere.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LayerContext:
    """What the engine tells model code while it traces the loss."""

    remat: str  # one of config.REMAT_POLICIES


_contexts: list[LayerContext] = []


@contextlib.contextmanager
def layer_context(ctx: LayerContext):
    _contexts.append(ctx)
    try:
        yield ctx
    finally:
        _contexts.pop()


def current_context() -> LayerContext | None:
    return _contexts[-1] if _contexts else None


def _all_gather(x, dim: int, axis: str):
    # 16-bit floats travel as uint16: bit-exact, and the CPU backend would otherwise widen bf16/fp16
    # collectives to fp32 (doubling the bytes); GPUs carry them as they are.
    if jnp.dtype(x.dtype).itemsize == 2 and jnp.issubdtype(x.dtype, jnp.floating):
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16)
        gathered = jax.lax.all_gather(bits, axis, axis=dim, tiled=True)
        return jax.lax.bitcast_convert_type(gathered, x.dtype)
    return jax.lax.all_gather(x, axis, axis=dim, tiled=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gather_for_compute(shard, dim: int, axis: str, compute_dtype):
    """All-gather a ZeRO-3 shard along `dim` over mesh axis `axis`, in `compute_dtype`."""
    return _all_gather(shard.astype(compute_dtype), dim, axis)


def _gather_fwd(shard, dim, axis, compute_dtype):
    # The only residual is a zero-size array carrying the master dtype for the backward cast.
    return gather_for_compute(shard, dim, axis, compute_dtype), jnp.zeros((0,), shard.dtype)


def _gather_bwd(dim, axis, compute_dtype, dtype_carrier, cotangent):
    grad = jax.lax.psum_scatter(cotangent.astype(dtype_carrier.dtype), axis, scatter_dimension=dim, tiled=True)
    return (grad,)


gather_for_compute.defvjp(_gather_fwd, _gather_bwd)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass
class ShardedLeaf:
    """A ZeRO-3 parameter still in its at-rest form: this device's shard of a stacked-layer leaf.

    `dim` is the partitioned dimension of one layer's slice (the stacked leaf's dimension minus one).
    Slicing it (as `lax.scan` does) keeps the handle; `gather_layer` turns a slice into a full array.
    """

    shard: Any
    dim: int
    axis: str
    compute_dtype: Any

    def tree_flatten(self):
        return (self.shard,), (self.dim, self.axis, self.compute_dtype)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)

    def __jax_array__(self):
        raise TypeError(
            "this parameter is a stack of layers held ZeRO-3 sharded; iterate over its layers with "
            "zeroflax.scan_layers (or call zeroflax.gather_layer on one layer's slice) before using it")


def gather_layer(layer_params):
    """Make one layer's parameters whole on this device (identity for leaves that already are)."""

    def gather(leaf):
        if isinstance(leaf, ShardedLeaf):
            return gather_for_compute(leaf.shard, leaf.dim, leaf.axis, leaf.compute_dtype)
        return leaf

    return jax.tree.map(gather, layer_params, is_leaf=lambda x: isinstance(x, ShardedLeaf))


def remat_policy(name: str):
    """The jax.checkpoint policy for a named remat setting; None means no checkpointing.

    None of them saves ZeRO-3's gathered weights (they are not matmul outputs), so the backward pass
    gathers them again. ('none' under ZeRO-3 is refused by Config: saving everything would keep them.)
    """
    policies = jax.checkpoint_policies
    if name == "none":
        return None
    return {
        "full": policies.nothing_saveable,
        "dots": policies.dots_saveable,
        "dots_no_batch": policies.dots_with_no_batch_dims_saveable,
    }[name]


def scan_layers(body: Callable, carry, stacked_params, xs=None, *, remat: str | None = None, unroll: int = 1):
    """Run `body` over a stack of layers: `carry = body(carry, layer_params[, x])` for each layer.

    `stacked_params` is a pytree whose leaves have the layers as leading dimension. Under the engine,
    ZeRO-3 layers are gathered one at a time inside the loop and the body is rematerialised with the
    configured policy (`Config.remat`); `remat` overrides the policy (use it outside the engine).
    Returns the final carry.
    """
    ctx = current_context()
    name = remat if remat is not None else (ctx.remat if ctx is not None else "none")
    policy = remat_policy(name)

    def step(carry, inputs):
        layer, x = inputs
        layer = gather_layer(layer)
        out = body(carry, layer) if xs is None else body(carry, layer, x)
        return out, None

    if policy is not None:
        step = jax.checkpoint(step, policy=policy, prevent_cse=False)
    carry, _ = jax.lax.scan(step, carry, (stacked_params, xs), unroll=unroll)
    return carry
