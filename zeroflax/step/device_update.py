"""The update on the device: the optimizer runs on each device's shard of the parameters (ZeRO stages
1-3; at stages 1-2 a free slice of the replicated parameters), which then go back to their at-rest
sharding (stages 1-2: an all-gather of the updated shards)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from zeroflax.optim.apply import apply_optimizer
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

    def field_shardings(self) -> dict:
        return {}

    def abstract_fields(self, abstract_params) -> dict:
        return {}

    def init_fields(self, params) -> dict:
        return {}

    def loss_params(self, state):
        return state.params

    def readable(self, params):
        return params

    def refreshed(self, state):
        return state

    restored = stored = refreshed

    def __call__(self, state, synced: Synced, phase: str) -> Updated:
        plan = self.plan
        params_view = jax.lax.with_sharding_constraint(state.params, plan.grads)
        params, opt_state, grad_norm, finite = apply_optimizer(
            self.optimizer, params_view, state.opt_state, synced.grads, grad_clip=self.grad_clip,
            skips_nonfinite=self.skips_nonfinite, norm=synced.norm, extra=synced.extra)
        # On shards first: else XLA gathers the select's operands and the updated parameters apart.
        params = jax.lax.with_sharding_constraint(params, plan.grads)
        params = jax.lax.with_sharding_constraint(params, plan.params)
        opt_state = jax.lax.with_sharding_constraint(opt_state, plan.opt_state)
        return Updated(params, opt_state, grad_norm, jnp.asarray(finite))
