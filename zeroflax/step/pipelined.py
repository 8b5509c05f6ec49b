"""Gradients from the pipeline schedule: each device runs its stage's chunks of the stacked layers for
the schedule's micro-batches (`pipeline/executor.py`); the leaves every stage holds are summed over
`pipe` after the sync."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zeroflax.config import ConfigError
from zeroflax.pipeline.executor import run_schedule, stage_hook
from zeroflax.pipeline.layout import take_layers
from zeroflax.pipeline.schedule import Schedule
from zeroflax.sharding.manual import psum_on_slices
from zeroflax.sharding.mesh import DATA_AXIS, PIPE_AXIS, axis_names
from zeroflax.sharding.policy import is_placement


class Pipelined:
    def __init__(self, schedule: Schedule, layers_per_chunk: int, accum: int, placements, layer_order=None,
                 zero_axis=DATA_AXIS):
        # Manual over `data` and `pipe`, and `sequence` with a sequence axis (ZeRO's axes are then both).
        self.zero_axis = zero_axis
        self.manual_axes = frozenset({PIPE_AXIS, *axis_names(zero_axis)})
        self.schedule = schedule
        self.layers_per_chunk = layers_per_chunk
        self.accum = accum
        self.placements = placements
        # Storage row -> model layer of the stacked layers (the interleaved schedule), else None.
        self.layer_order = layer_order
        self.activation = None  # one micro-batch's stage input, set when the step is traced (the comm report's unit)

    def __call__(self, trace, params, micro, rng, seed, model_state, sources, per_microbatch):
        """Per device (manual over `data` and `pipe`): the schedule's micro-batches through this stage."""
        ctx, point_of_use = trace.start()
        chunk = self.layers_per_chunk

        def piece(p, micro_batch, micro_rng, x, start, role):
            with stage_hook(x, start, chunk) as stage:
                loss, aux, _ = trace.traced(ctx, point_of_use, p, micro_batch, micro_rng, None)
            if stage.calls != 1:
                raise ConfigError(f"MeshConfig.axes['{PIPE_AXIS}']", "the loss never calls zeroflax.scan_layers, so "
                                  "there is no stack of layers to split into pipeline stages",
                                  "run the layers with zeroflax.scan_layers, or set the pipe axis to 1")
            return (loss.astype(jnp.float32), aux) if role == "last" else stage.output

        first = jax.tree.map(lambda x: x[0], micro)
        activation = jax.eval_shape(lambda p: piece(p, first, rng, None, 0, "first"), params)
        self.activation = activation
        aux_shape = jax.eval_shape(lambda p, x: piece(p, first, rng, x, 0, "last")[1], params, activation)
        grads, loss, aux = run_schedule(self.schedule, piece, params, micro, rng, seed, activation,
                                        per_microbatch, chunk, aux_shape)
        # Only the last stage computed losses: the sum over `pipe` is theirs.
        loss = jax.lax.psum(loss, PIPE_AXIS) / self.accum
        aux = jax.tree.map(lambda a: jax.lax.psum(a, PIPE_AXIS) / self.accum, aux)
        mean = lambda x: jax.lax.pmean(x, self.zero_axis)
        return grads, mean(loss), jax.tree.map(mean, aux), None

    def after_sync(self, grads):
        """Leaves every stage holds (embeddings, the head, tied ones too) got a gradient from the stages
        that use them: their sum over `pipe` (after ZeRO's reduction: on shards when sharded)."""
        shared = lambda p, g: g if p.base[:1] == (PIPE_AXIS,) else psum_on_slices(g, PIPE_AXIS, p.auto_spec())
        return jax.tree.map(shared, self.placements, grads, is_leaf=is_placement)


class LayerOrder:
    """How the stacked layers are stored: `order` (storage row -> model layer; None, the identity) and the
    conversions at the engine's edges (checkpoints, evaluation, `Engine.model_params`)."""

    def __init__(self, order, placements, optimizer):
        self.order, self.placements, self.optimizer = order, placements, optimizer
        self._jits: dict = {}

    def to_model_in_step(self, params):
        """Inside a jitted function: `params` with their stacked layers in model order."""
        if self.order is None:
            return params
        return take_layers(np.argsort(self.order), self.placements, self.optimizer)[0](params)

    def convert(self, what: str, tree, to_model: bool, shardings):
        """`tree` ('params' or a whole 'state') to model order (or back), placed by `shardings`."""
        if self.order is None:
            return tree
        if (what, to_model) not in self._jits:
            index = np.argsort(self.order) if to_model else self.order
            params_fn, state_fn = take_layers(index, self.placements, self.optimizer)
            self._jits[what, to_model] = jax.jit(params_fn if what == "params" else state_fn, out_shardings=shardings)
        return self._jits[what, to_model](tree)
