"""`initialize` -> `Engine`: the jitted, ZeRO-partitioned train step.

The step is a pure function `(TrainState, batch) -> (TrainState, metrics)`, jitted once with the
shardings of the `ShardingPlan` and the state donated. Its parts:

  1. local gradients: a `shard_map` that is manual over the `data` axis (other axes stay automatic,
     so tensor slicing composes). Each device runs the loss on its micro-batches; ZeRO-3 parameters
     are gathered just in time (`sharding.layers`); gradients are synchronised by `ZeroGradSync`.
  2. the update, in the global view: unscale (fp16), skip on overflow, clip, `optimizer.update` on
     each device's shard (stages 1-3), then the parameters go back to their at-rest sharding
     (stages 1-2: an all-gather of the updated shards).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import NamedSharding, PartitionSpec as P

from zeroflax.adapters import unbox
from zeroflax.config import Config, ConfigError
from zeroflax.optim.loss_scale import LossScaleState, init_loss_scale, update_loss_scale
from zeroflax.sharding.grad_sync import ZeroGradSync
from zeroflax.sharding.layers import LayerContext, ShardedLeaf, gather_for_compute, layer_context
from zeroflax.sharding.mesh import DATA_AXIS, build_mesh
from zeroflax.sharding.policy import LeafPlacement, ShardingPlan, make_plan


@struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps attempted (skipped ones included)
    params: Any  # fp32 master parameters, at-rest sharding of the ZeRO stage
    opt_state: Any
    loss_scale: LossScaleState
    rng: jax.Array  # uint32[2] base key; step and device are folded in


def _is_placement(x) -> bool:
    return isinstance(x, LeafPlacement)


def _abstract(tree):
    """ShapeDtypeStructs (with shardings where known) for a tree of arrays or of abstract values."""

    def leaf(x):
        sharding = getattr(x, "sharding", None)
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)

    return jax.tree.map(leaf, tree)


def _floats_to(tree, dtype):
    """Floating-point leaves cast to `dtype` (the compute dtype); integer leaves (tokens, labels) kept."""
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def _split_loss_output(out):
    if isinstance(out, tuple) and len(out) == 2:
        return out
    return out, None


class Engine:
    """Holds the mesh, the sharding plan and the compiled step; see `initialize`."""

    def __init__(self, loss_fn: Callable, optimizer: optax.GradientTransformation, config: Config,
                 plan: ShardingPlan, abstract_params, train_batch_size: int):
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.config = config
        self.plan = plan
        self.mesh = plan.mesh
        self.data_size = self.mesh.shape[DATA_AXIS]
        self.train_batch_size = train_batch_size
        self.abstract_params = abstract_params
        self.grad_sync = ZeroGradSync(config.zero_stage, plan.placements)
        self.state_shardings = TrainState(
            step=plan.replicated, params=plan.params, opt_state=plan.opt_state,
            loss_scale=jax.tree.map(lambda _: plan.replicated, init_loss_scale(config.loss_scale, False)),
            rng=plan.replicated)
        self._jit_step = None
        self._jit_eval = None
        self._compiled: dict = {}

    # ----------------------------------------------------------------------------- local gradients
    def _params_for_compute(self, params):
        """Inside shard_map: turn at-rest parameters into what the loss sees (compute dtype)."""
        dtype = self.config.compute_dtype
        stage3 = self.config.zero_stage == 3

        def prepare(placement: LeafPlacement, leaf):
            if not jnp.issubdtype(leaf.dtype, jnp.floating):
                return leaf
            if stage3 and placement.zero_dim is not None:
                if placement.stacked:  # gathered layer by layer inside scan_layers
                    return ShardedLeaf(leaf, placement.zero_dim - 1, DATA_AXIS, dtype)
                return gather_for_compute(leaf, placement.zero_dim, DATA_AXIS, dtype)
            return leaf.astype(dtype)

        return jax.tree.map(prepare, self.plan.placements, params, is_leaf=_is_placement)

    def _cast_batch(self, batch):
        return _floats_to(batch, self.config.compute_dtype)

    def _local_grads(self, params, batch, rng, scale):
        """Per device (manual over `data`): loss and synchronised gradients of its micro-batches."""
        config = self.config
        accum = config.grad_accum_steps
        micro = jax.tree.map(lambda x: x.reshape((accum, x.shape[0] // accum) + x.shape[1:]), batch)
        device_rng = jax.random.fold_in(rng, jax.lax.axis_index(DATA_AXIS))
        # The loss of the whole step is the mean over all data-parallel micro-batches.
        weight = 1.0 / (self.data_size * accum)
        ctx = LayerContext(remat=config.remat)

        def micro_grads(micro_batch, micro_rng):
            def scaled_loss(p):
                with layer_context(ctx):
                    loss, aux = _split_loss_output(
                        self.loss_fn(self._params_for_compute(p), self._cast_batch(micro_batch), micro_rng))
                loss = loss.astype(jnp.float32)
                return loss * (scale * weight), (loss, aux)

            grads, (loss, aux) = jax.grad(scaled_loss, has_aux=True)(params)
            return self.grad_sync.per_microbatch(grads), loss, aux

        if accum == 1:
            grads, loss, aux = micro_grads(jax.tree.map(lambda x: x[0], micro), device_rng)
        else:
            shapes = jax.eval_shape(micro_grads, jax.tree.map(lambda x: x[0], micro), device_rng)

            def body(carry, inputs):
                grad_acc, loss_acc, aux_acc = carry
                micro_batch, index = inputs
                grads, loss, aux = micro_grads(micro_batch, jax.random.fold_in(device_rng, index))
                add = lambda a, b: jax.tree.map(jnp.add, a, b)
                return (add(grad_acc, grads), loss_acc + loss, add(aux_acc, aux)), None

            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            (grads, loss, aux), _ = jax.lax.scan(body, zeros, (micro, jnp.arange(accum)))
            loss = loss / accum
            aux = jax.tree.map(lambda a: a / accum, aux)
        grads = self.grad_sync.final(grads)
        grads = jax.tree.map(lambda g: g / scale, grads)
        loss = jax.lax.pmean(loss, DATA_AXIS)
        aux = jax.tree.map(lambda a: jax.lax.pmean(a, DATA_AXIS), aux)
        return grads, loss, aux

    def _sharded_grads(self, params, batch, rng, scale):
        plan = self.plan
        in_specs = (plan.data_specs("params"), jax.tree.map(lambda _: P(DATA_AXIS), batch), P(), P())
        out_specs = (plan.data_specs("grads"), P(), P())
        fn = jax.shard_map(self._local_grads, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                           axis_names={DATA_AXIS}, check_vma=False)
        return fn(params, batch, rng, scale)

    # ------------------------------------------------------------------------------- train step
    def _train_step(self, state: TrainState, batch):
        config, plan = self.config, self.plan
        fp16 = config.precision == "fp16"
        dynamic_scaling = fp16 and config.loss_scale.loss_scale == 0
        rng = jax.random.fold_in(state.rng, state.step)
        scale = state.loss_scale.scale
        grads, loss, aux = self._sharded_grads(state.params, batch, rng, scale)
        grads = jax.lax.with_sharding_constraint(grads, plan.grads)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(grad_norm) if fp16 else jnp.asarray(True)
        if config.grad_clip > 0:
            # optax.clip_by_global_norm's rule, so a clipped step equals optax's chain.
            factor = jnp.where(grad_norm < config.grad_clip, 1.0, config.grad_clip / grad_norm)
            grads = jax.tree.map(lambda g: (g * factor).astype(g.dtype), grads)
        # Stages 1-2: the update runs on this device's shard of replicated parameters (a free slice).
        params_view = jax.lax.with_sharding_constraint(state.params, plan.grads)
        updates, opt_state = self.optimizer.update(grads, state.opt_state, params_view)
        params = optax.apply_updates(params_view, updates)
        params = jax.lax.with_sharding_constraint(params, plan.params)
        opt_state = jax.lax.with_sharding_constraint(opt_state, plan.opt_state)
        if fp16:
            keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
            params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
        loss_scale = update_loss_scale(state.loss_scale, ~finite, config.loss_scale, dynamic_scaling)
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                               loss_scale=loss_scale, rng=state.rng)
        metrics = {"loss": loss, "grad_norm": grad_norm, "loss_scale": scale, "skipped": ~finite}
        if aux is not None:
            metrics["aux"] = aux
        return new_state, metrics

    def _step_fn(self, batch):
        if self._jit_step is None:
            self._jit_step = jax.jit(
                self._train_step,
                in_shardings=(self.state_shardings, self.plan.batch(batch)),
                out_shardings=(self.state_shardings, self.plan.replicated),
                donate_argnums=(0,))
        return self._jit_step

    def check_batch(self, batch) -> None:
        """Global arrays must hold train_batch_size rows; host (numpy) data this process's share of them."""
        local = self.train_batch_size // jax.process_count()
        for x in jax.tree.leaves(batch):
            expected = self.train_batch_size if isinstance(x, jax.Array) else local
            if np.ndim(x) == 0 or np.shape(x)[0] != expected:
                raise ConfigError(
                    "Config.train_batch_size",
                    f"a batch leaf has shape {np.shape(x)}, expected {expected} rows (train_batch_size "
                    f"{self.train_batch_size} = micro_batch_size x grad_accum_steps x data-parallel size "
                    f"{self.data_size}, split over {jax.process_count()} process(es))",
                    "feed batches of train_batch_size examples")

    def put_batch(self, batch):
        """The batch as global arrays split over `data`; host data is this process's rows of it."""
        self.check_batch(batch)
        sharding = NamedSharding(self.mesh, P(DATA_AXIS))
        return jax.tree.map(lambda x: x if isinstance(x, jax.Array)
                            else jax.make_array_from_process_local_data(sharding, np.asarray(x)), batch)

    def step(self, state: TrainState, batch) -> tuple[TrainState, dict]:
        """One optimizer step over `batch` (train_batch_size examples). `state` is donated."""
        batch = self.put_batch(batch)
        return self._step_fn(batch)(state, batch)

    def evaluate(self, state: TrainState, batch) -> jax.Array:
        """The mean loss on `batch` with the current parameters (forward only, compute dtype)."""
        batch = self.put_batch(batch)
        if self._jit_eval is None:
            def eval_loss(params, batch):
                dtype = self.config.compute_dtype
                loss, _ = _split_loss_output(self.loss_fn(_floats_to(params, dtype), _floats_to(batch, dtype), None))
                return loss.astype(jnp.float32)
            self._jit_eval = jax.jit(eval_loss, out_shardings=self.plan.replicated)
        return self._jit_eval(state.params, batch)

    # ----------------------------------------------------------------------------- compile-only
    def compile(self, state, batch):
        """The compiled step for these (abstract or concrete) arguments; no step is run."""
        batch = self.put_batch(batch)
        state_abs = _abstract(state)
        batch_abs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), batch)
        key = jax.tree.structure((state_abs, batch_abs)), tuple(
            (s.shape, str(s.dtype)) for s in jax.tree.leaves((state_abs, batch_abs)))
        if key not in self._compiled:
            self._compiled[key] = self._step_fn(batch).lower(state_abs, batch_abs).compile()
        return self._compiled[key]

    def memory_report(self, state, batch):
        from zeroflax.memory import memory_report
        return memory_report(self, state, batch)

    def comm_report(self, state, batch):
        from zeroflax.comm import comm_report
        return comm_report(self, state, batch)


def initialize(loss_fn: Callable, params, optimizer: optax.GradientTransformation, config: Config, *,
               sample_batch=None, logical_axes=None, devices=None, rng=None) -> tuple[Engine, TrainState]:
    """Build the engine and the initial, already partitioned, train state.

    loss_fn(params, batch, rng) -> loss or (loss, aux): mean loss over `batch` (one micro-batch).
    params: a pytree of arrays (Flax partitioning boxes allowed), or an init function
        `init(rng, sample_batch)` (or `init(rng)` without `sample_batch`) that is run under jit with
        the plan's output shardings, so parameters are created partitioned, never whole on one device.
    optimizer: any optax GradientTransformation; its state's sharding follows the params'.
    logical_axes: optional tree (params structure) of per-leaf logical axis names, for plain pytrees.
    """
    if not isinstance(config, Config):
        raise ConfigError("config", f"expected zeroflax.Config, got {type(config).__name__}")
    mesh = build_mesh(config.mesh, devices)
    train_batch_size = config.resolve_train_batch(mesh.shape[DATA_AXIS])
    base_rng = jax.random.PRNGKey(config.seed) if rng is None else rng
    init_rng, step_rng = jax.random.split(base_rng)

    if callable(params):
        init_args = (init_rng,) if sample_batch is None else (init_rng, sample_batch)
        init_fn = params
        abstract_params, names = unbox(jax.eval_shape(init_fn, *init_args))
    else:
        params, names = unbox(params)
        abstract_params = _abstract(params)
    if logical_axes is not None:
        names = logical_axes
    plan = make_plan(optimizer, abstract_params, names, mesh, config)
    engine = Engine(loss_fn, optimizer, config, plan, abstract_params, train_batch_size)

    if callable(params):
        init_params = jax.jit(lambda *args: unbox(init_fn(*args))[0], out_shardings=plan.params)(*init_args)
    else:
        # A fresh copy: the step donates its state, and the caller keeps their arrays.
        init_params = jax.jit(lambda tree: tree, out_shardings=plan.params)(params)
    opt_state = jax.jit(optimizer.init, out_shardings=plan.opt_state)(init_params)
    state = TrainState(
        step=jnp.asarray(0, jnp.int32),
        params=init_params,
        opt_state=opt_state,
        loss_scale=init_loss_scale(config.loss_scale, config.precision == "fp16"),
        rng=step_rng,
    )
    state = jax.device_put(state, engine.state_shardings)
    return engine, state
