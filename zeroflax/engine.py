"""`initialize` -> `Engine`: the jitted, ZeRO-partitioned train step, wired from its parts.

The step is a pure function `(TrainState, batch) -> (TrainState, metrics)`, jitted once per phase with
the shardings of the `ShardingPlan` and the state donated. `Engine` builds its parts from `Config`
(`step/build.py`) and wires them (`_train_step`, top to bottom; the protocols: `step/parts.py`):

  1. inside a `shard_map` manual over `data` (and `pipe`; other axes stay automatic, so tensor slicing
     composes): the gradient source runs the user's loss (`step/loss_trace.py`: ZeRO-3 parameters are
     gathered just in time, per module, per layer or where used) over this device's micro-batches, by
     plain accumulation or the pipeline schedule; the gradient sync reduces them over `data` (ZeRO's
     all-reduce or reduce-scatter; 1-bit Adam's compressed exchange); the loss scaler unscales them;
  2. in the global view, the update: on each device's shard (stages 1-3), or offloaded to the host
     (ZeRO-Offload, possibly delayed by a step), after which the parameters return to their at-rest
     sharding.

A part with several programs (1-bit Adam's warm-up, the delayed update's start) declares its phases;
the engine picks each step's program on the host (`step/phases.py`).
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from zeroflax.adapters import unbox
from zeroflax.batch import BatchLayout, batch_layout, batch_share
from zeroflax.config import Config, ConfigError
from zeroflax.pipeline.executor import tables
from zeroflax.platform import check_precision
from zeroflax.remat_choice import settle_remat
from zeroflax.sharding.context import GatherUsage
from zeroflax.sharding.mesh import DATA_AXIS, build_mesh, zero_size
from zeroflax.sharding.padding import fit, to_true
from zeroflax.sharding.policy import ShardingPlan, make_plan
from zeroflax.sharding.scopes import UPDATE_SCOPE
from zeroflax.step.build import abstract_state, build_parts, state_shardings
from zeroflax.step.loss_trace import LossTrace, floats_to
from zeroflax.step.pipelined import LayerOrder
from zeroflax.step.state import TrainState


def _abstract(tree):
    """ShapeDtypeStructs (with shardings where known) for a tree of arrays or of abstract values."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None)),
                        tree)


class Engine:
    """Holds the mesh, the sharding plan, the step's parts and the compiled step; see `initialize`."""

    def __init__(self, loss_fn: Callable, optimizer: optax.GradientTransformation, config: Config,
                 plan: ShardingPlan, abstract_params, train_batch_size: int, abstract_model_state=None):
        self.optimizer, self.config, self.plan, self.mesh = optimizer, config, plan, plan.mesh
        self.data_size = self.mesh.shape[DATA_AXIS]
        # Devices whose losses the step averages: data x sequence (a sequence group's devices each take the
        # mean over their own tokens of the same examples).
        self.zero_size = zero_size(self.mesh)
        self.train_batch_size = train_batch_size
        self.abstract_params, self.abstract_model_state = abstract_params, abstract_model_state
        self.parts = build_parts(config, plan, optimizer, abstract_params, abstract_model_state is not None)
        self.source, self.sync, self.update, self.scaler = (self.parts.source, self.parts.sync, self.parts.update,
                                                            self.parts.scaler)
        self.schedule = self.source.schedule  # the pipeline schedule, or None
        self.layer_order = self.source.layer_order  # storage row -> model layer of the stacked layers, or None
        self.layers = LayerOrder(self.layer_order, plan.placements, optimizer)
        self.trace = LossTrace(loss_fn, config, plan, self.source.manual_axes, abstract_model_state is not None)
        self.clock = self.parts.clock
        self.state_shardings = state_shardings(self.parts, plan, abstract_model_state)
        self._jit_steps: dict = {}  # phase -> the jitted step
        self._compiled: dict = {}
        self._jit_eval = None
        self._jit_true_params = None
        self._remat_settled = False

    # ------------------------------------------------------------------------------- the step
    def _train_step(self, state: TrainState, batch, phase: str):
        """One step of program `phase` (static; picked on the host by `step`)."""
        sync_phase = self.clock.of(self.sync, phase)
        rng = jax.random.fold_in(state.rng, state.step)
        grads, loss, aux, model_state, sync_out = self._sharded_grads(
            self.update.loss_params(state), batch, rng, state.loss_scale.scale, state.model_state,
            *self.sync.inputs(state, sync_phase), sync_phase)
        synced = self.sync.synced(jax.lax.with_sharding_constraint(grads, self.plan.grads), sync_out,
                                  state.sync_state, sync_phase)
        with jax.named_scope(UPDATE_SCOPE):  # the step's last part, named for the memory explainer
            new = self.update(state, synced, self.clock.of(self.update, phase))
        # nonfinite: the gradient was NaN or inf; skipped: so its update was not applied (fp16, 'skip').
        skipped = ~new.finite if self.update.skips_nonfinite else jnp.zeros((), bool)
        # A skipped step changes none of the optimizer's state, the sync's (1-bit Adam's and LAMB's error buffers) included.
        sync_state = jax.tree.map(lambda new_, old: jnp.where(skipped, old, new_), synced.state, state.sync_state)
        new_state = state.replace(step=state.step + 1, params=new.params, opt_state=new.opt_state,
                                  loss_scale=self.scaler.next(state.loss_scale, new.finite), model_state=model_state,
                                  sync_state=sync_state, **new.fields)
        metrics = {"loss": loss, "grad_norm": new.grad_norm, "loss_scale": state.loss_scale.scale,
                   "skipped": skipped, "nonfinite": ~new.finite}
        if aux is not None:
            metrics["aux"] = aux
        return new_state, metrics

    def _sharded_grads(self, params, batch, rng, scale, model_state, sync_in, sync_specs, sync_phase: str):
        """(gradients, loss, aux, model state, the sync's outputs), each device on its share of `batch`."""
        self.trace.probe(params, batch, model_state)
        plan, source, accum = self.plan, self.source, self.config.grad_accum_steps

        def local(params, batch, rng, scale, model_state, sync_in):
            params = self.sync.local_params(params, sync_in, sync_phase)
            params, sources = self.trace.gradient_sinks(params)
            micro = jax.tree.map(lambda x: x.reshape((accum, x.shape[0] // accum) + x.shape[1:]), batch)
            device_rng = jax.random.fold_in(rng, jax.lax.axis_index(DATA_AXIS))
            weight = 1.0 / (self.zero_size * accum)  # the step's loss: the mean over all devices' micro-batches
            grads, loss, aux, model_state = source(self.trace, params, micro, device_rng, scale * weight, model_state,
                                                   sources, functools.partial(self.sync.per_microbatch, phase=sync_phase))
            grads, sync_out = self.sync.final(grads, sync_in, sync_phase, scale)  # reduced and unscaled
            return source.after_sync(grads), loss, aux, model_state, sync_out

        in_specs = (plan.data_specs("params"), jax.tree.map(lambda _: P(DATA_AXIS), batch), P(), P(), P(), sync_specs)
        out_specs = (plan.data_specs("grads"), P(), P(), P(), self.sync.output_specs(sync_phase))
        return jax.shard_map(local, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names=set(source.manual_axes), check_vma=False)(
            params, batch, rng, scale, model_state, sync_in)

    @property
    def phases(self) -> tuple[str, ...]:
        """The step's programs, the steady state last (declared by the one phased part, if any)."""
        return self.clock.phases

    def step_function(self, batch, phase: str | None = None):
        """The jitted step of `phase` (default: the steady state), for batches laid out like `batch`."""
        phase = phase or self.phases[-1]
        if phase not in self.phases:
            raise ValueError(f"phase {phase!r} is not one of this engine's {self.phases}")
        if phase not in self._jit_steps:
            self._jit_steps[phase] = jax.jit(
                functools.partial(self._train_step, phase=phase),
                in_shardings=(self.state_shardings, self.plan.batch(batch)),
                out_shardings=(self.state_shardings, self.plan.replicated), donate_argnums=(0,),
                # The state is donated whole, a field the step only writes too (the NVMe update's pending
                # gradients): pruned as unused, its old buffer would stay alive beside the new one.
                keep_unused=True)
        return self._jit_steps[phase]

    def step(self, state: TrainState, batch) -> tuple[TrainState, dict]:
        """One optimizer step over `batch` (train_batch_size examples). `state` is donated."""
        batch = self.put_batch(batch)
        self._settle_remat(state, batch)
        phase = self.clock.phase(state)
        new_state, metrics = self.step_function(batch, phase)(state, batch)
        new_state = self.update.finish(new_state, metrics)  # the NVMe update streams its file here
        self.clock.advance(new_state, phase)
        return new_state, metrics

    def evaluate(self, state: TrainState, batch) -> jax.Array:
        """The mean loss on `batch` with the current parameters (forward only, compute dtype).

        The loss gets rng None (its cue for inference mode) and, with model state, the current state,
        whose update it returns is discarded: evaluation uses the statistics, never changes them."""
        batch = self.put_batch(batch)
        if self._jit_eval is None:
            def eval_loss(state, batch, model_state):
                params = to_true(self.layers.to_model_in_step(self.update.readable(state)), self.abstract_params)
                dtype = self.config.compute_dtype
                loss, _, _ = self.trace.call(floats_to(params, dtype), floats_to(batch, dtype), None, model_state)
                return loss.astype(jnp.float32)
            self._jit_eval = jax.jit(eval_loss, out_shardings=self.plan.replicated)
        # Only what the update reads of the state (under offload the optimizer state stays where it is).
        view = state.replace(opt_state=None, pending_grads=None, sync_state=None)
        return self._jit_eval(view, batch, state.model_state)

    # ---------------------------------------------------------------- what the loss does (probe)
    @property
    def remat(self) -> str:
        """The remat policy the step runs: Config.remat, or 'none' where it was measured to save nothing."""
        return self.trace.remat

    def set_remat(self, remat: str) -> None:
        """Run the step with this remat policy (remat_choice.py); drops what was compiled with another."""
        self.trace.remat = remat
        self._jit_steps.clear()
        self._compiled.clear()
        self._jit_eval = None

    def _settle_remat(self, state, batch) -> None:
        if not self._remat_settled:
            self._remat_settled = True
            self.trace.remat = settle_remat(self, state, batch)

    def probe(self, state, batch) -> GatherUsage:
        """What the loss does with its parameters (the probe's abstract trace), traced now if the step
        has not been yet. The loss takes `state.params` as they are (abstract ones too)."""
        return self.trace.probe(state.params, batch, state.model_state)

    @property
    def probe_usage(self) -> GatherUsage | None:
        """What the probe found (groups and their sizes, leaves gathered where used); None before."""
        return self.trace.probe_usage

    @property
    def gather_usage(self) -> GatherUsage | None:
        """What the last trace of the step did (its groups and regions)."""
        return self.trace.gather_usage

    def gathered_on_entry(self) -> list[str]:
        """Paths of the ZeRO-3 partitioned leaves that are gathered on entry, once the step has been
        traced (`gathered_on_entry_reasons` says why for each)."""
        return list(self.trace.gathered_on_entry_reasons())

    def gathered_on_entry_reasons(self) -> dict[str, str]:
        """Path -> why of each ZeRO-3 partitioned leaf gathered on entry rather than where it is used."""
        return self.trace.gathered_on_entry_reasons()

    # ---------------------------------------------------------------- state: order and abstract
    def model_order(self, state: TrainState) -> TrainState:
        """The state as checkpoints hold it, so that they restore on any mesh: stacked layers in model
        order (the interleaved schedule stores them in pipeline order), without what the update
        remakes from the master weights (`Update.stored`)."""
        return self.layers.convert("state", self.update.stored(state), True, self.state_shardings)

    def storage_order(self, state: TrainState) -> TrainState:
        """The inverse of `model_order`: a model-order state (fresh, or restored) as this engine holds it,
        with the update's derived fields remade where it has none."""
        return self.update.restored(self.layers.convert("state", state, False, self.state_shardings))

    def model_params(self, state: TrainState):
        """`state.params` as the model declares them: stacked layers in model order (layer i of the stack is
        the model's layer i), true shapes (a leaf stored padded comes back whole over `data`)."""
        params = self.layers.convert("params", self.update.master(state), True, self.plan.params)
        if all(np.shape(x) == a.shape for x, a in zip(jax.tree.leaves(params), jax.tree.leaves(self.abstract_params))):
            return params  # nothing stored padded (stages 1-2 pad only the optimizer state)
        if self._jit_true_params is None:
            self._jit_true_params = jax.jit(lambda p: to_true(p, self.abstract_params),
                                            out_shardings=self.plan.true_params_shardings())
        return self._jit_true_params(params)

    @property
    def state_files(self):
        """The files that hold the master weights and optimizer state with NVMe offload (`disk/store.py`:
        what a checkpoint snapshots, `Checkpointer.save(files=...)`); None when they are arrays of the state."""
        return self.update.store

    def with_compute_copy(self, state: TrainState) -> TrainState:
        """`state` with the update's derived fields (offload's compute copy) remade from its master
        weights (after a restore, or a change to `state.params`); `state` itself otherwise."""
        return self.update.refreshed(state)

    def abstract_state(self, stored: bool = True) -> TrainState:
        """The initial TrainState as ShapeDtypeStructs with their shardings: what `compile` needs to
        compile the step without creating a state (zeroflax plan compiles configurations it never runs).
        Stored shapes (padded where partitioned unevenly, `sharding.padding`), or with `stored` False the
        true ones (what checkpoints record)."""
        return abstract_state(self.parts, self.config, self.optimizer, self.abstract_params,
                              self.abstract_model_state, self.state_shardings, stored)

    # ---------------------------------------------------------------------------------- batches
    def batch_share(self) -> tuple[int, int]:
        """(index, count) of the block of the global batch's rows this process feeds (`batch.py`)."""
        return batch_share(self.mesh)

    @functools.cached_property
    def batch_layout(self) -> BatchLayout:
        """How the step takes its batch (`zeroflax/batch.py`: the forms a batch may come in)."""
        return batch_layout(self.mesh, self.train_batch_size)

    def check_batch(self, batch) -> None:
        """Global arrays must hold train_batch_size rows; host data (and arrays this process holds whole)
        this process's share of them."""
        self.batch_layout.check(batch)

    def put_batch(self, batch):
        """The batch as global arrays split over `data` (any form `zeroflax/batch.py` lists)."""
        return self.batch_layout.place(batch)

    # ------------------------------------------------------------------ compile-only (reports)
    def compile(self, state, batch, phase: str | None = None):
        """The compiled step (of `phase`; default the steady state) for these (abstract or concrete)
        arguments; no step is run. In a run of several processes every process must call it (as with a
        step): with jax 0.12 a step compiled by one process alone never completes its first collective
        (docs/reliability.md, "Every process compiles the same programs")."""
        phase = phase or self.phases[-1]
        state_abs, batch_abs = self.abstract_args(state, batch)
        self._settle_remat(state_abs, batch_abs)  # global shapes: a process's numpy rows are its share only
        key = phase, jax.tree.structure((state_abs, batch_abs)), tuple(
            (s.shape, str(s.dtype), s.sharding) for s in jax.tree.leaves((state_abs, batch_abs)))
        if key not in self._compiled:
            self._compiled[key] = self.step_function(batch_abs, phase).lower(state_abs, batch_abs).compile()
        return self._compiled[key]

    def abstract_args(self, state, batch):
        """(state, batch) as the step compiles them: shapes, dtypes and shardings (memory kinds included;
        the plan's where a state leaf has none; the step's own for the batch, as `step` reshards it).
        Either may be concrete or abstract; no data moves."""
        state_abs = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(
            x, "sharding", None) or s), state, self.state_shardings)
        return state_abs, self.batch_layout.abstract(batch)

    @property
    def pipeline_activation(self):
        """One micro-batch's stage input (the comm report's unit), once the pipelined step is traced."""
        return getattr(self.source, "activation", None)

    def pipeline_tables(self):
        """The schedule as the arrays the step executes (pipeline.executor.Tables); None without one."""
        return tables(self.schedule) if self.schedule is not None else None

    def pipeline_schedule(self) -> list | None:
        """For each pipeline stage, what it runs at each tick of the compiled step: ('F', micro_batch),
        ('B', micro_batch) (with the chunk, ('F', m, v), for the interleaved schedule) or None (idle).
        The same table the step executes; None without a pipeline."""
        if self.schedule is None:
            return None
        return [self.schedule.stage_ops(s) for s in range(self.schedule.stages)]


def _split_variables(tree, collections: tuple):
    """(params, model state) of a Flax variables dict; (tree, None) without model-state collections."""
    if not collections:
        return tree, None
    if not hasattr(tree, "keys") or "params" not in tree:
        raise ConfigError("model_state", f"names collections {collections}, so params (or the init function's "
                          "result) must be a Flax variables dict with a 'params' entry",
                          "pass model.init(...) whole, not model.init(...)['params']")
    missing = [c for c in collections if c not in tree]
    if missing:
        raise ConfigError("model_state", f"collections {missing} are not among the variables {list(tree.keys())}",
                          "name only collections the model creates, e.g. ('batch_stats',)")
    return tree["params"], {c: tree[c] for c in collections}


def _is_init_function(params) -> bool:
    """Whether `params` is an init function rather than the parameters: a callable that is no pytree of
    arrays (an Equinox module, or its arrays from `eqx.partition`, is callable and a pytree: parameters)."""
    leaves = jax.tree.leaves(params)
    return callable(params) and len(leaves) == 1 and leaves[0] is params


def initialize(loss_fn: Callable, params, optimizer: optax.GradientTransformation, config: Config, *,
               sample_batch=None, logical_axes=None, devices=None, rng=None,
               model_state: tuple[str, ...] = (), abstract: bool = False) -> tuple[Engine, TrainState]:
    """Build the engine and the initial, already partitioned, train state.

    loss_fn(params, batch, rng) -> loss or (loss, aux): mean loss over `batch` (one micro-batch).
        With `model_state`: loss_fn(params, batch, rng, state) -> (loss or (loss, aux), new_state),
        where state is {collection: tree} (Flax: `model.apply({'params': params, **state}, ...,
        mutable=list(state))` returns exactly that pair). rng is None in `Engine.evaluate`.
    params: a pytree of arrays (Flax partitioning boxes allowed), or an init function
        `init(rng, sample_batch)` (or `init(rng)` without `sample_batch`) that is run under jit with
        the plan's output shardings, so parameters are created partitioned, never whole on one device.
    optimizer: any optax GradientTransformation; its state's sharding follows the params'.
    logical_axes: optional tree (params structure) of per-leaf logical axis names, for plain pytrees.
    model_state: names of Flax collections besides 'params' that the loss reads and updates (e.g.
        ('batch_stats',)); `params` is then the whole variables dict. The state is replicated, averaged
        over the data axis after every step, checkpointed with the rest, and kept in TrainState.model_state.
    abstract: return the state as ShapeDtypeStructs (`Engine.abstract_state`); nothing is initialised
        or allocated, and `engine.compile(state, batch)` compiles the step (compile-only planning).
    """
    if not isinstance(config, Config):
        raise ConfigError("config", f"expected zeroflax.Config, got {type(config).__name__}")
    if isinstance(model_state, str):
        model_state = (model_state,)
    collections = tuple(model_state)
    mesh = build_mesh(config.mesh, devices)
    check_precision(config.precision, mesh.devices.flat)  # fp16 on a CPU that cannot convert it: the key, not XLA
    train_batch_size = config.resolve_train_batch(mesh.shape[DATA_AXIS])
    base_rng = jax.random.PRNGKey(config.seed) if rng is None else rng
    init_rng, step_rng = jax.random.split(base_rng)

    if _is_init_function(params):
        init_args = (init_rng,) if sample_batch is None else (init_rng, sample_batch)
        init_fn = params
        abstract_tree, abstract_state = _split_variables(jax.eval_shape(init_fn, *init_args), collections)
        abstract_params, names = unbox(abstract_tree)
    else:
        params, state_tree = _split_variables(params, collections)
        params, names = unbox(params)
        abstract_params, abstract_state = _abstract(params), _abstract(state_tree)
    if logical_axes is not None:
        names = logical_axes
    plan = make_plan(optimizer, abstract_params, names, mesh, config)
    engine = Engine(loss_fn, optimizer, config, plan, abstract_params, train_batch_size,
                    abstract_model_state=unbox(abstract_state)[0] if collections else None)
    if abstract:
        return engine, engine.abstract_state()

    state_sharding = engine.state_shardings.model_state
    stored = lambda tree: fit(tree, plan.abstract_params, plan.params)  # padded where partitioned unevenly
    if _is_init_function(params):
        def init_all(*args):
            tree, state_tree = _split_variables(init_fn(*args), collections)
            return stored(unbox(tree)[0]), (unbox(state_tree)[0] if collections else None)
        init_params, init_state = jax.jit(init_all, out_shardings=(plan.params, state_sharding))(*init_args)
    else:
        # A fresh copy: the step donates its state, and the caller keeps their arrays.
        init_params, init_state = jax.jit(lambda tree, st: (stored(tree), st), out_shardings=(plan.params, state_sharding))(
            params, unbox(state_tree)[0] if collections else None)
    # The optimizer starts from the true shapes (a factored statistic's shape is the true one's).
    opt_init = lambda p: fit(optimizer.init(to_true(p, plan.abstract_params)), plan.abstract_opt_state, plan.opt_state)
    init_params, opt_state = engine.update.initial(init_params, opt_init)
    sync_state = jax.jit(engine.sync.init_state, out_shardings=engine.state_shardings.sync_state)()
    state = TrainState(step=jnp.asarray(0, jnp.int32), params=init_params, opt_state=opt_state,
                       loss_scale=engine.scaler.init(), rng=step_rng, model_state=init_state, sync_state=sync_state,
                       **engine.update.init_fields(abstract_params))
    del init_params, opt_state  # held by the state alone: the NVMe update's `refreshed` lets them go
    state = engine.update.refreshed(state)
    state = engine.storage_order(jax.device_put(state, engine.state_shardings))
    return engine, state
