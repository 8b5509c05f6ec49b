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
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from zeroflax.compat import on_host
from zeroflax.config import Config, ConfigError
from zeroflax.optim.apply import apply_optimizer
from zeroflax.optim.clipping import clip_to, global_norm
from zeroflax.sharding.collectives import all_gather_exact, cut_padding
from zeroflax.sharding.manual import on_slices
from zeroflax.sharding.mesh import PIPE_AXIS, TENSOR_AXIS, zero_size
from zeroflax.sharding.padding import constrain_true, fit, stored_abstract, stored_shape
from zeroflax.sharding.policy import LeafPlacement, ShardingPlan, is_none, is_placement
from zeroflax.step.parts import Updated
from zeroflax.step.phases import STEADY


def on_device(shardings):
    """The same shardings in device memory."""
    return jax.tree.map(lambda s: s.with_memory_kind("device"), shardings)


def linearized_update(optimizer: optax.GradientTransformation, params, opt_state, probe, probe_norm,
                      grad_clip: float):
    """The optimizer's next update as an affine function of the next gradient g, for the 'linear'
    prediction: (center, slope) with U(g) ~ center + slope g, the secant through U(+probe) and
    U(-probe), per element (exact for an elementwise optimizer at g = +-probe; `probe` is the gradient
    just applied, so of the next one's size, and `probe_norm` its norm, which the update has computed).
    Where probe is 0 the slope is 0. A secant, not jax.jvp: the jvp of a division makes constants in
    device memory, which jax 0.10 refuses to mix with the host's arrays."""
    if grad_clip > 0:
        probe = clip_to(probe, probe_norm, grad_clip)
    up = optimizer.update(probe, opt_state, params)[0]
    down = optimizer.update(jax.tree.map(lambda h: -h, probe), opt_state, params)[0]
    center = jax.tree.map(lambda a, b: (a + b) * 0.5, up, down)
    # (h == 0) keeps the division finite where the select drops it; h * 0 is a zero in host memory
    slope = jax.tree.map(lambda a, b, h: jnp.where(h != 0, (a - b) / (h + h + (h == 0)), h * 0), up, down, probe)
    return center, slope


EXACT = "exact"  # the delayed update's phase before delayed_update_start (STEADY after it)


@dataclasses.dataclass(frozen=True)
class OffloadedUpdate:
    """The step's update part under offload (`zeroflax.step.parts.Update`); its TrainState fields are
    `compute_params` and, with the delayed update, `pending_grads`."""

    plan: ShardingPlan
    config: Config
    manual_axes: frozenset  # the engine's manual mesh axes (data, and pipe with a pipeline)
    optimizer: optax.GradientTransformation
    skips_nonfinite: bool  # fp16, or Config.nonfinite 'skip': a step with a non-finite gradient is skipped
    store = None  # the files of a state kept on disk (step/streamed_update.py); in host memory here

    # ------------------------------------------------------------------ phases (the delayed update)
    @property
    def phases(self) -> tuple[str, ...]:
        return (EXACT, STEADY) if self.config.offload_optimizer.delayed_update else (STEADY,)

    def host_view(self, state):
        return None

    def pick(self, step: int, view) -> str:
        return STEADY if step >= self.config.offload_optimizer.delayed_update_start else EXACT

    def after(self, step: int, phase: str, view):
        return view

    # ---------------------------------------------------------------------- its theory, for the reports
    def at_rest_theory(self, abstract_params) -> tuple[float, float]:
        """(device, host) bytes of model states at rest per device (docs/offload.md): the compute copy
        on the device (stage 3: its shard; with offload_param only the persistent leaves), the master
        weights and optimizer state on the host, partitioned over `data`. A partitioned leaf counts with its
        stored (padded) shape (`sharding.padding`): its 1/N is of the padded leaf."""
        config, plan, mesh = self.config, self.plan, self.plan.mesh
        itemsize = lambda x: np.dtype(x.dtype).itemsize
        leaves = jax.tree.leaves(abstract_params)
        placements = jax.tree.leaves(plan.placements, is_leaf=is_placement)
        num_params = sum(math.prod(x.shape) for x in leaves)
        stored = [math.prod(p.stored_shape) for p in placements]  # elements as partitioned over `data`
        master = sum(n * itemsize(x) for n, x in zip(stored, leaves))
        abstract_opt = jax.eval_shape(self.optimizer.init, abstract_params)
        opt = sum(math.prod(stored_shape(x.shape, s)) * itemsize(x)
                  for x, s in zip(jax.tree.leaves(abstract_opt), jax.tree.leaves(plan.opt_state)))
        compute = np.dtype(config.compute_dtype).itemsize
        data_size = zero_size(mesh)
        if config.offload_param.enabled:  # only the persistent (never partitioned) leaves stay
            device = compute * sum(math.prod(p.shape) for p in placements if p.zero_dim is None)
        else:
            device = compute * (sum(stored) / data_size if config.zero_stage == 3 else num_params)
        pipe, tensor = mesh.shape.get(PIPE_AXIS, 1), mesh.shape.get(TENSOR_AXIS, 1)
        return device / (pipe * tensor), (master + opt) / data_size / (pipe * tensor)

    def host_traffic_theory(self, abstract_params, phase: str = STEADY) -> tuple[float, float]:
        """(host->device, device->host) bytes per device per step (docs/offload.md): the gradient shards go
        to the host, the compute copy comes back (with offload_param the streamed shards twice per
        micro-batch); a delayed step under the 'linear' prediction also brings the slope (bf16); the
        update on the device brings the master weights and optimizer state over and back. Every shard moves
        with its padding (`sharding.padding`)."""
        plan, config = self.plan, self.config
        leaves = jax.tree.leaves(abstract_params)
        itemsize = lambda x: np.dtype(x.dtype).itemsize
        # One device's shard of a leaf as stored (padded where partitioned unevenly: sharding.padding).
        shard = lambda x, s: math.prod(s.shard_shape(stored_shape(x.shape, s))) * itemsize(x)
        master = [shard(x, s) for x, s in zip(leaves, jax.tree.leaves(plan.params))]
        if config.offload_optimizer.update == "device":
            abstract_opt = jax.eval_shape(self.optimizer.init, abstract_params)
            opt = sum(shard(x, s) for x, s in zip(jax.tree.leaves(abstract_opt), jax.tree.leaves(plan.opt_state)))
            return sum(master) + opt, sum(master) + opt
        grads = sum(shard(x, s) for x, s in zip(leaves, jax.tree.leaves(plan.host_grads)))
        compute = np.dtype(config.compute_dtype).itemsize
        streamed = plan.streamed()
        copy = sum(m // itemsize(x) * compute for m, x, st in zip(master, leaves, streamed) if not st)
        stream = sum(m for m, st in zip(master, streamed) if st) * 2 * config.grad_accum_steps
        offload = config.offload_optimizer
        if offload.predicts and offload.delayed_update_prediction == "linear" and phase != EXACT:
            copy += sum(m // itemsize(x) * 2 for m, x, st in zip(master, leaves, streamed) if not st)
        return copy + stream, grads

    # ------------------------------------------------------------------------ its TrainState fields
    def field_shardings(self) -> dict:
        delayed = self.config.offload_optimizer.delayed_update
        return {"compute_params": self.plan.compute, "pending_grads": self.plan.host_grads if delayed else None}

    def abstract_fields(self, abstract_params) -> dict:
        delayed = self.config.offload_optimizer.delayed_update
        return {"compute_params": jax.eval_shape(self.compute_copy, abstract_params),
                "pending_grads": abstract_params if delayed else None}  # true shapes (abstract_state stores them)

    def init_fields(self, params) -> dict:
        """The delayed update's pending gradients start as zeros (the compute copy: `refreshed`)."""
        if not self.config.offload_optimizer.delayed_update:
            return {}
        stored = stored_abstract(params, self.plan.host_grads)
        zeros = lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), stored)
        return {"pending_grads": jax.jit(zeros, out_shardings=self.plan.host_grads)()}

    @functools.cached_property
    def _jit_compute_copy(self):
        return jax.jit(self.compute_copy_of, out_shardings=self.plan.compute)

    def refreshed(self, state):
        """`state` with the device's compute copy made from its master weights (after a restore, or a
        change to `state.params`)."""
        return state.replace(compute_params=self._jit_compute_copy(state.params))

    def restored(self, state):
        """A restored (or fresh) state, with its compute copy remade if it has none."""
        return self.refreshed(state) if state.compute_params is None else state

    def readable(self, state):
        """The master weights where the device computes with them (evaluation)."""
        return jax.device_put(state.params, on_device(self.plan.params))

    def master(self, state):
        """The master weights (`Engine.model_params`)."""
        return state.params

    def initial(self, params, opt_init):
        """(master weights, optimizer state) of a fresh state, from the initial master weights."""
        return params, jax.jit(opt_init, out_shardings=self.plan.opt_state)(params)

    def finish(self, state, metrics):
        """Nothing is left to do after the compiled step."""
        return state

    def stored(self, state):
        """The compute copy is dropped from what a checkpoint holds (it is remade from the master
        weights) unless the delayed update's prediction made it: that one cannot be remade."""
        return state if self.config.offload_optimizer.predicts else state.replace(compute_params=None)

    def compute_copy(self, params):
        """The compute-dtype copy of the master weights that the device keeps (None for streamed leaves)."""
        dtype = self.config.compute_dtype
        cast = lambda c, p: None if c is None else (p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p)
        return jax.tree.map(cast, self.plan.compute, params, is_leaf=is_none)

    def compute_copy_of(self, params):
        """The compute copy of host master weights (stored), made on the device (after a restore)."""
        copy = self.compute_copy(jax.device_put(params, on_device(self.plan.params)))
        return fit(copy, self.plan.abstract_params, self.plan.compute)

    def loss_params(self, state):
        """What the loss differentiates: the compute copy upcast to the master dtype and, for leaves
        streamed from the host, the host master shards."""
        return jax.tree.map(lambda c, p: p if c is None else c.astype(p.dtype), state.compute_params, state.params,
                            is_leaf=is_none)

    def __call__(self, state, synced, phase: str):
        """The update of `synced.grads` (reduced, on the device), as `zeroflax.step.parts.Updated`."""
        plan, offload = self.plan, self.config.offload_optimizer
        if synced.norm is not None or synced.extra:  # a sync that measures and clips, or feeds the optimizer
            raise ValueError("the offloaded update takes plain reduced gradients; a sync that measures the norm "
                             "or passes optimizer.update arguments (1-bit Adam) is not built with offload")
        grads, delayed = synced.grads, phase != EXACT
        # device -> host: the reduced gradient shards (the device update keeps them where they are)
        host_grads = jax.device_put(grads, plan.host_grads) if offload.update == "host" else grads
        apply, pending = None, state.pending_grads
        if offload.delayed_update and delayed:
            # Apply the previous step's gradients (none yet at the first delayed step); keep this step's.
            host_grads, pending, apply = state.pending_grads, host_grads, state.step > offload.delayed_update_start

        prediction = offload.delayed_update_prediction if offload.predicts and delayed else "none"

        true_params, true_opt = plan.abstract_params, plan.abstract_opt_state

        def update(params, opt_state, grads, apply, params_layout=plan.params, opt_layout=plan.opt_state):
            # On the true shapes, stored again after (sharding.padding); the gradients are laid out as
            # the master weights here (both partitioned over `data` at every stage).
            params = constrain_true(params, true_params, params_layout)
            opt_state = constrain_true(opt_state, true_opt, opt_layout)
            grads = constrain_true(grads, true_params, params_layout)
            stored = lambda tree: fit(tree, true_params, params_layout)
            before = params
            params, opt_state, grad_norm, finite = apply_optimizer(
                self.optimizer, params, opt_state, grads, grad_clip=self.config.grad_clip,
                skips_nonfinite=self.skips_nonfinite, apply=apply)
            # Pinned to the master's layout: the compute copy's all-gather (stages 1-2) happens later, on
            # the device; unpinned, XLA gathers the delayed update's select on the host instead.
            params = jax.lax.with_sharding_constraint(params, params_layout)
            compute = self.compute_copy(stored(params))
            if prediction == "extrapolate":  # the next update guessed to be this one again
                guess = jax.tree.map(lambda new, old: new + (new - old), params, before)
                compute = self.compute_copy(stored(guess))
            elif prediction == "linear":  # the next update, affine in the next gradient (slope in bf16)
                center, slope = linearized_update(self.optimizer, params, opt_state, grads, grad_norm,
                                                  self.config.grad_clip)
                guess = jax.tree.map(lambda p, u: p + u, params, center)
                compute = (self.compute_copy(stored(guess)), self.slope_copy(stored(slope)))
            return stored(params), fit(opt_state, true_opt, opt_layout), compute, grad_norm, finite

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
                on_device(plan.params), on_device(plan.opt_state))
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
        fields = {"compute_params": compute, "pending_grads": pending}
        return Updated(params, opt_state, grad_norm, finite, fields)

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
            whole = lambda s: cut_padding(all_gather_exact(s, placement.zero_dim, placement.zero_axis), placement.zero_dim,
                                          placement.pad)
            return on_slices(whole, shard, placement.auto_spec())

        local = lambda tree: jax.tree.map(gather, placements, tree, is_leaf=is_placement)
        specs = lambda spec: jax.tree.map(spec, placements, is_leaf=is_placement)
        fn = jax.shard_map(local, mesh=self.plan.mesh, in_specs=(specs(LeafPlacement.data_spec),),
                           out_specs=specs(LeafPlacement.pipe_spec), axis_names=set(self.manual_axes),
                           check_vma=False)
        return jax.lax.with_sharding_constraint(fn(shards), self.plan.compute)
