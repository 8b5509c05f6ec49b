"""ZeRO-Offload's update: the last part of the step when the master weights and optimizer state live in
host memory (`Config.offload_optimizer`; placement in `sharding/policy.py`, docs/offload.md).

  1. the loss differentiates the device's compute-dtype copy, upcast to the master dtype so that the
     gradients are reduced in fp32 as without offload (a leaf streamed from the host by `offload_param`
     enters as its host shard; `sharding/collectives.py: gather_from_host`);
  2. the reduced gradient shards go to the host;
  3. the engine's update (clip, `optimizer.update`, apply) runs on the host under
     `compute_on('device_host')` (`update='host'`), or on the device with the state brought over and
     sent back (`update='device'`);
  4. the new compute copy comes back as shards and, at stages 1-2, is all-gathered on the device in the
     compute dtype.
With `delayed_update`, from `delayed_update_start` on, step t applies step t-1's gradients (held on the
host in `TrainState.pending_grads`) and keeps its own, so the update does not wait for the backward pass.
The next gradient is applied one update later, so with `delayed_update_prediction` it is taken where
that update will have moved the parameters: 'extrapolate' sends back P + (P - P_before); 'linear' sends
P + c and s, where c + s g is the optimizer's next update as an affine function of the next gradient (the
secant through the gradient just applied and its negative), and the device adds s times the gradient it
has just computed (`predicted_copy`): the next update itself, for an elementwise optimizer, to the extent
the gradients' sizes agree, with the host still off the step's critical path.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from zeroflax.compat import on_host
from zeroflax.config import Config, ConfigError
from zeroflax.optim.clipping import clip_to, global_norm
from zeroflax.sharding.collectives import all_gather_exact
from zeroflax.sharding.manual import on_slices
from zeroflax.sharding.mesh import DATA_AXIS
from zeroflax.sharding.policy import LeafPlacement, ShardingPlan, is_none, is_placement


def on_device(shardings):
    """The same shardings in device memory."""
    return jax.tree.map(lambda s: s.with_memory_kind("device"), shardings)


@dataclasses.dataclass(frozen=True)
class OffloadedUpdate:
    plan: ShardingPlan
    config: Config
    manual_axes: frozenset  # the engine's manual mesh axes (data, and pipe with a pipeline)
    # The engine's update on shards: (params, opt_state, grads, apply) -> (params, opt_state, grad_norm, finite).
    update_fn: Callable
    # The optimizer's next update, affine in the next gradient: (params, opt_state, probe, its norm) -> (center, slope).
    linearize_fn: Callable | None = None

    def compute_copy(self, params):
        """The compute-dtype copy of the master weights that the device keeps (None for streamed leaves)."""
        dtype = self.config.compute_dtype
        cast = lambda c, p: None if c is None else (p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p)
        return jax.tree.map(cast, self.plan.compute, params, is_leaf=is_none)

    def compute_copy_of(self, params):
        """The compute copy of host master weights, made on the device (after a restore)."""
        return self.compute_copy(jax.device_put(params, on_device(self.plan.params)))

    def loss_params(self, state):
        """What the loss differentiates: the compute copy upcast to the master dtype and, for leaves
        streamed from the host, the host master shards."""
        return jax.tree.map(lambda c, p: p if c is None else c.astype(p.dtype), state.compute_params, state.params,
                            is_leaf=is_none)

    def __call__(self, state, grads, delayed: bool):
        """(params, opt_state, compute_params, pending_grads, grad_norm, finite) after the update of
        `grads` (reduced, on the device); `delayed`: the delayed update's steady state."""
        plan, offload = self.plan, self.config.offload_optimizer
        # device -> host: the reduced gradient shards (the device update keeps them where they are)
        host_grads = jax.device_put(grads, plan.host_grads) if offload.update == "host" else grads
        apply, pending = None, state.pending_grads
        if offload.delayed_update and delayed:
            # Apply the previous step's gradients (none yet at the first delayed step); keep this step's.
            host_grads, pending, apply = state.pending_grads, host_grads, state.step > offload.delayed_update_start

        prediction = offload.delayed_update_prediction if offload.predicts and delayed else "none"

        def update(params, opt_state, grads, apply, params_layout=plan.params):
            before = params
            params, opt_state, grad_norm, finite = self.update_fn(params, opt_state, grads, apply)
            # Pinned to the master's layout: the compute copy's all-gather (stages 1-2) happens later, on
            # the device; unpinned, XLA gathers the delayed update's select on the host instead.
            params = jax.lax.with_sharding_constraint(params, params_layout)
            if prediction == "extrapolate":  # the next update guessed to be this one again
                guess = jax.tree.map(lambda new, old: new + (new - old), params, before)
                return params, opt_state, self.compute_copy(guess), grad_norm, finite
            if prediction == "linear":  # the next update, affine in the next gradient (slope in bf16)
                center, slope = self.linearize_fn(params, opt_state, grads, grad_norm)
                guess = jax.tree.map(lambda p, u: p + u, params, center)
                return params, opt_state, (self.compute_copy(guess), self.slope_copy(slope)), grad_norm, finite
            return params, opt_state, self.compute_copy(params), grad_norm, finite

        if offload.update == "host":
            if apply is not None:
                apply = jax.device_put(apply, NamedSharding(plan.mesh, P(), memory_kind=self.config.host_memory_kind))
            try:
                params, opt_state, compute, grad_norm, finite = on_host(update)(
                    state.params, state.opt_state, host_grads, apply)
            except ValueError as error:
                if "memory_space" not in str(error):
                    raise
                raise ConfigError("OffloadOptimizerConfig.update", "this optimizer cannot run on host memory: it "
                                  f"makes device constants in its update ({str(error).splitlines()[0]}); with jax "
                                  f"{jax.__version__} adam, adamw, sgd and lion can", "use update='device', or "
                                  "Config.grad_clip instead of optax.clip_by_global_norm") from error
            grad_norm, finite = jax.device_put((grad_norm, jnp.asarray(finite)), plan.replicated)
        else:  # on the device: the state comes over and goes back
            to_device = lambda tree, shardings: jax.device_put(tree, on_device(shardings))
            params, opt_state, compute, grad_norm, finite = update(
                to_device(state.params, plan.params), to_device(state.opt_state, plan.opt_state), grads, apply,
                on_device(plan.params))
            finite = jnp.asarray(finite)
            params, opt_state = jax.device_put((params, opt_state), (plan.params, plan.opt_state))
        # The compute copy comes to the device as the master is laid out (a shard per device), and
        # takes its own layout there (stages 1-2: whole, by an all-gather on the device).
        shard_layout = jax.tree.map(lambda c, s: None if c is None else s, plan.compute, on_device(plan.params),
                                    is_leaf=is_none)
        if prediction == "linear":
            guess, slope = jax.device_put(compute, (shard_layout, shard_layout))
            compute = jax.lax.with_sharding_constraint(self.predicted_copy(guess, slope, grads), shard_layout)
        compute = self.gather_compute_copy(jax.device_put(compute, shard_layout))
        return params, opt_state, compute, pending, grad_norm, finite

    def slope_copy(self, slope):
        """The slope dU/dg as it travels to the device: bf16 (it scales a correction, 3 digits are plenty)."""
        return jax.tree.map(lambda c, d: None if c is None else d.astype(jnp.bfloat16), self.plan.compute, slope,
                            is_leaf=is_none)

    def predicted_copy(self, guess, slope, grads):
        """On the device, the 'linear' prediction: guess (P + center) plus slope times this step's gradient,
        clipped as the host will clip it when it applies it; a non-finite gradient adds nothing (the host
        will skip it, or the run stops)."""
        norm = global_norm(grads)
        if self.config.grad_clip > 0:
            grads = clip_to(grads, norm, self.config.grad_clip)
        finite = jnp.isfinite(norm)

        def leaf(c, d, g):
            if c is None:
                return None
            return jnp.where(finite, c.astype(jnp.float32) + d.astype(jnp.float32) * g, c).astype(c.dtype)

        return jax.tree.map(leaf, guess, slope, grads, is_leaf=is_none)

    def gather_compute_copy(self, shards):
        """Stages 1-2: the compute copy's shards all-gathered over `data` on the device, in the compute
        dtype (`all_gather_exact`: bf16 travels as bf16 on every backend); stage 3 keeps them."""
        if self.config.zero_stage == 3:
            return shards
        placements = self.plan.placements

        def gather(placement: LeafPlacement, shard):
            if placement.zero_dim is None:
                return shard
            return on_slices(lambda s: all_gather_exact(s, placement.zero_dim, DATA_AXIS), shard, placement.auto_spec())

        local = lambda tree: jax.tree.map(gather, placements, tree, is_leaf=is_placement)
        specs = lambda spec: jax.tree.map(spec, placements, is_leaf=is_placement)
        fn = jax.shard_map(local, mesh=self.plan.mesh, in_specs=(specs(LeafPlacement.data_spec),),
                           out_specs=specs(LeafPlacement.pipe_spec), axis_names=set(self.manual_axes),
                           check_vma=False)
        return jax.lax.with_sharding_constraint(fn(shards), self.plan.compute)
