"""Scanned layers: `scan_layers`, a model's stack of layers, one layer gathered per loop iteration.

Models call `scan_layers` for their stack of layers; outside the engine it is a plain (optionally
rematerialised) scan, so the same model code runs anywhere. Under the engine each iteration gathers its
layer's ZeRO-3 slices (`sharding.handles`, `sharding.collectives`) and is checkpointed with
`Config.remat`'s policy (`sharding.remat`); a pipeline stage hands the loop to its own runner
(`layer_runner`, installed by `pipeline.executor.stage_hook`), which runs only its chunk of the layers.

This module held the gather, its handle and the engine's context before they got modules of their
own; their names are importable from here as before.
"""
from __future__ import annotations

from typing import Callable

import jax

# Names defined here before the split, importable from here as before (the engine, zeroflax and the benchmarks import some).
from zeroflax.sharding.collectives import (  # noqa: F401
    all_gather_exact, dequantize_blocks, gather_for_compute, gather_from_host, in_host_memory, quantize_blocks)
from zeroflax.sharding.context import (  # noqa: F401
    GatherUsage, LayerContext, current_context, current_usage, layer_context, reused_leaves)
from zeroflax.sharding.handles import (  # noqa: F401
    GlobalShapeView, ShardedLeaf, gather, gather_layer, global_shape_view, is_handle)
from zeroflax.sharding.remat import BOUNDARY, loss_remat_policy, mark_boundary, remat_policy  # noqa: F401
from zeroflax.sharding.scopes import LAYERS_SCOPE, SCOPE_END, ThreadStack


def _stack_length(stacked_params) -> int:
    """The number of layers in a stack: the leading dimension of its leaves (handles included)."""
    for leaf in jax.tree.leaves(stacked_params, is_leaf=is_handle):
        shape = getattr(leaf.shard if is_handle(leaf) else leaf, "shape", None)  # a handle's shape is one slice's
        if shape:
            return int(shape[0])
    return 0


_layer_runners = ThreadStack()  # of runners: see layer_runner


def layer_runner(runner: Callable):
    """A context manager: while it is active (in this thread), `scan_layers` hands its loop to
    `runner(run, carry, stacked_params, xs)` instead of calling `run(carry, stacked_params, xs)`, where
    `run` is the (rematerialised) scan over the layers it is given. The pipeline's stage hook
    (`pipeline.executor.stage_hook`) installs one that runs only its stage's chunk of the layers."""
    return _layer_runners.push(runner)


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
        checkpointed = jax.checkpoint(step, policy=policy, prevent_cse=False)
        # The per-layer carries are the scan's residuals: named, the loss's own policy keeps them too.
        step = lambda carry, inputs: checkpointed(mark_boundary(carry), inputs)
        if ctx is not None and ctx.usage is not None:
            ctx.usage.remat_regions += 1

    def run(carry, stacked_params, xs):
        # The scope marks the scan in the HLO's metadata, where the memory explainer finds the layers.
        with jax.named_scope(f"{LAYERS_SCOPE}{_stack_length(stacked_params)}{SCOPE_END}"):
            return jax.lax.scan(step, carry, (stacked_params, xs), unroll=unroll)[0]

    if ctx is not None and ctx.usage is not None:
        ctx.usage.layer_carry_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(carry))

    runner = _layer_runners.top()  # under a pipeline: only this stage's chunk of the layers, on its input
    if runner is not None:
        return mark_boundary(runner(run, carry, stacked_params, xs))
    return mark_boundary(run(carry, stacked_params, xs))
