"""Gradients from plain accumulation: each device runs the loss on its micro-batches one after another
(a `lax.scan` when there are several) and sums their gradients."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from zeroflax.sharding.mesh import DATA_AXIS
from zeroflax.sharding.ordered import mean_all


@dataclasses.dataclass(frozen=True)
class Accumulation:
    accum: int  # micro-batches per device and step (Config.grad_accum_steps)
    ordered: bool = False  # Config.deterministic_reductions: the means below in device order
    manual_axes: frozenset = frozenset({DATA_AXIS})  # with a sequence axis, `sequence` too
    zero_axis: object = DATA_AXIS  # the axes the loss is averaged over: `data`, or (`data`, `sequence`)
    schedule = None
    layer_order = None

    def __call__(self, trace, params, micro, rng, seed, model_state, sources, per_microbatch):
        ctx, point_of_use = trace.start()

        def micro_grads(micro_batch, micro_rng, state):
            def scaled_loss(p):
                loss, aux, new_state = trace.traced(ctx, point_of_use, p, micro_batch, micro_rng, state, sources)
                loss = loss.astype(jnp.float32)
                return loss * seed, (loss, aux, new_state)

            grads, (loss, aux, new_state) = jax.grad(scaled_loss, has_aux=True)(params)
            return per_microbatch(grads), loss, aux, new_state

        if self.accum == 1:
            grads, loss, aux, model_state = micro_grads(jax.tree.map(lambda x: x[0], micro), rng, model_state)
        else:
            shapes = jax.eval_shape(micro_grads, jax.tree.map(lambda x: x[0], micro), rng, model_state)

            def body(carry, inputs):
                grad_acc, loss_acc, aux_acc, state = carry
                micro_batch, index = inputs
                grads, loss, aux, state = micro_grads(micro_batch, jax.random.fold_in(rng, index), state)
                add = lambda a, b: jax.tree.map(jnp.add, a, b)
                return (add(grad_acc, grads), loss_acc + loss, add(aux_acc, aux), state), None

            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[:3])
            (grads, loss, aux, model_state), _ = jax.lax.scan(
                body, (*zeros, model_state), (micro, jnp.arange(self.accum)))
            loss = loss / self.accum
            aux = jax.tree.map(lambda a: a / self.accum, aux)
        mean = lambda x: mean_all(x, self.zero_axis, self.ordered)
        loss = mean(loss)
        aux = jax.tree.map(mean, aux)
        # Every device (and so every checkpoint) holds the same model state: the mean over `data` (and `sequence`).
        model_state = jax.tree.map(
            lambda x: mean(x) if jnp.issubdtype(x.dtype, jnp.inexact) else x, model_state)
        return grads, loss, aux, model_state

    def after_sync(self, grads):
        return grads
