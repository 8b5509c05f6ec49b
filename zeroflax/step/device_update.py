"""The update on the device: the optimizer runs on each device's shard of the parameters (ZeRO stages
1-3; at stages 1-2 a free slice of the replicated parameters), which then go back to their at-rest
sharding (stages 1-2: an all-gather of the updated shards).

It runs on the true shapes: the stored states are cut to them first and padded again after
(`sharding.padding`), so the optimizer, the gradient norm and clipping never see the padding."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from zeroflax.optim.apply import apply_optimizer
from zeroflax.sharding.padding import constrain_true, fit
from zeroflax.sharding.policy import ShardingPlan
from zeroflax.step.parts import Synced, Updated
from zeroflax.step.phases import STEADY


@dataclasses.dataclass(frozen=True)
class DeviceUpdate:
    plan: ShardingPlan
    optimizer: optax.GradientTransformation
    grad_clip: float
    skips_nonfinite: bool
    phases: tuple = (STEADY,)
    store = None  # the files of a state kept on disk (step/streamed_update.py); none here

    def field_shardings(self) -> dict:
        return {}

    def abstract_fields(self, abstract_params) -> dict:
        return {}

    def init_fields(self, params) -> dict:
        return {}

    def loss_params(self, state):
        return state.params

    def readable(self, state):
        return state.params

    def master(self, state):
        return state.params

    def initial(self, params, opt_init):
        return params, jax.jit(opt_init, out_shardings=self.plan.opt_state)(params)

    def refreshed(self, state):
        return state

    restored = stored = refreshed

    def finish(self, state, metrics):
        return state

    def __call__(self, state, synced: Synced, phase: str) -> Updated:
        plan = self.plan
        true_params = plan.abstract_params
        params_view = constrain_true(state.params, true_params, plan.grads)
        grads = constrain_true(synced.grads, true_params, plan.grads)
        opt_view = constrain_true(state.opt_state, plan.abstract_opt_state, plan.opt_state)
        extra = {k: constrain_true(v, true_params, plan.grads) for k, v in synced.extra.items()}
        extra.update(synced.options)
        params, opt_state, grad_norm, finite = apply_optimizer(
            self.optimizer, params_view, opt_view, grads, grad_clip=self.grad_clip,
            skips_nonfinite=self.skips_nonfinite, norm=synced.norm, extra=extra)
        if not synced.moves_params:  # the old ones, as stored: no all-gather of an unchanged copy
            params = state.params
        else:  # on shards first: else XLA gathers the select's operands and the updated parameters apart
            params = jax.lax.with_sharding_constraint(params, plan.grads)
            params = fit(params, true_params, plan.params)
        opt_state = fit(opt_state, plan.abstract_opt_state, plan.opt_state)
        return Updated(params, opt_state, grad_norm, jnp.asarray(finite))
