"""Where a pipeline puts the stacked layers: the checks that a model can be split, and the storage order
the interleaved schedule needs (and the conversion between it and model order).

The `pipe` axis splits the stacked-layer dimension into contiguous blocks, stage s holding rows
[s·L/S, (s+1)·L/S). That is model order for gpipe and 1f1b. The interleaved schedule runs virtual stage
v·S + s on device s, so device s must hold model blocks s, S + s, ...: the engine then stores the layers
in pipeline order (`interleaved_layer_order`) and moves them back to model order at its edges
(checkpoints, evaluation, `Engine.model_params`) with `take_layers`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zeroflax.config import Config, ConfigError
from zeroflax.sharding.mesh import PIPE_AXIS
from zeroflax.sharding.policy import LAYERS_AXIS, is_placement


def check_pipeline(config: Config, placements, stages: int, has_model_state: bool) -> int:
    """The number of stacked layers a pipeline of `stages` splits; ConfigError when it cannot."""
    key = f"MeshConfig.axes['{PIPE_AXIS}']"
    if has_model_state:
        raise ConfigError(key, f"a pipeline ({stages} stages) with model state (initialize(model_state=...)) is "
                          "not supported: each stage would hold its own statistics", "set the pipe axis to 1")
    stacked = [p for p in jax.tree.leaves(placements, is_leaf=is_placement) if p.stacked]
    if not stacked:
        raise ConfigError(key, f"{stages} pipeline stages, but the model has no stacked layers (no leaf whose first "
                          f"logical axis is {LAYERS_AXIS!r}) to split over them",
                          "stack the layers and run them with zeroflax.scan_layers, or set the pipe axis to 1")
    depths = {p.shape[0] for p in stacked}
    if len(depths) > 1:
        raise ConfigError(key, f"the stacked leaves disagree on the number of layers: {sorted(depths)}",
                          f"give every leaf of the layer stack the same leading {LAYERS_AXIS!r} dimension")
    layers = depths.pop()
    parts = stages * config.pipeline_virtual_stages
    if layers % parts:
        which = "Config.pipeline_virtual_stages" if config.pipeline_virtual_stages > 1 else key
        raise ConfigError(which, f"{layers} layers do not split into {stages} stages x "
                          f"{config.pipeline_virtual_stages} virtual stages", f"use a layer count divisible by {parts}")
    return layers


def interleaved_layer_order(layers: int, stages: int, virtual: int):
    """Storage row -> model layer for the interleaved schedule. Device s holds rows [s·V·c, (s+1)·V·c)
    (a contiguous split over `pipe`, c = L/(S·V)); its chunk v (rows s·V·c + v·c + i) must be virtual stage
    v·S + s, i.e. model layer (v·S + s)·c + i."""
    c = layers // (stages * virtual)
    order = np.empty(layers, np.int32)
    for s in range(stages):
        for v in range(virtual):
            for i in range(c):
                order[s * virtual * c + v * c + i] = (v * stages + s) * c + i
    return order


def take_layers(index, placements, optimizer: optax.GradientTransformation):
    """(params_fn, state_fn): move the stacked layers of the parameters (and of the optimizer state's
    parameter-shaped leaves) to rows `index` of the layer axis; everything else passes through."""
    index = jnp.asarray(index)

    def take(leaf, placement):
        if hasattr(leaf, "shape") and placement.stacked and tuple(leaf.shape) == placement.shape:
            return jnp.take(leaf, index, axis=0)
        return leaf

    def params(tree):
        return jax.tree.map(take, tree, placements)

    def state(st):
        opt_state = optax.tree_map_params(optimizer, take, st.opt_state, placements,
                                          transform_non_params=lambda x: x, is_leaf=is_placement)
        return st.replace(params=params(st.params), opt_state=opt_state)

    return params, state
