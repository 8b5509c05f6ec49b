"""The step's parts chosen from `Config`: the only place that knows which scheme each part runs, and
which combinations are refused (with the Config key at fault)."""
from __future__ import annotations

import dataclasses
import functools


import jax
import optax

from zeroflax.config import Config, ConfigError
from zeroflax.optim import onebit
from zeroflax.optim.chunked import check_elementwise
from zeroflax.optim.onebit_lamb import OneBitLamb, OneBitLambState
from zeroflax.optim.zero_one_adam import ZeroOneAdam, ZeroOneAdamState
from zeroflax.pipeline.layout import check_pipeline, interleaved_layer_order
from zeroflax.pipeline.schedule import build_schedule
from zeroflax.sharding.mesh import DATA_AXIS, PIPE_AXIS, SEQUENCE_AXIS, TENSOR_AXIS, axis_names, pipe_size, zero_axes
from zeroflax.sharding.padding import stored_abstract
from zeroflax.sharding.policy import ShardingPlan
from zeroflax.step.accumulate import Accumulation
from zeroflax.step.device_update import DeviceUpdate
from zeroflax.step.offloaded_update import OffloadedUpdate
from zeroflax.step.onebit_lamb_sync import OneBitLambSync
from zeroflax.step.onebit_sync import OneBitSync, make_sync
from zeroflax.step.parts import GradSource, GradSync, Update
from zeroflax.step.phases import PhaseClock
from zeroflax.step.pipelined import Pipelined
from zeroflax.step.zero_one_sync import ZeroOneSync
from zeroflax.step.scaler import LossScaler
from zeroflax.step.streamed_update import StreamedUpdate
from zeroflax.step.state import TrainState
from zeroflax.step.zero_sync import ZeroGradSync


@dataclasses.dataclass(frozen=True)
class Parts:
    source: GradSource
    sync: GradSync
    update: Update
    scaler: LossScaler

    @property
    def plain(self) -> bool:
        """Accumulated gradients, ZeRO's sync and the update on the device: no pipeline, no offload,
        no compressed sync."""
        return (isinstance(self.source, Accumulation) and isinstance(self.sync, ZeroGradSync)
                and isinstance(self.update, DeviceUpdate))

    @functools.cached_property
    def clock(self) -> PhaseClock:
        """The step's phase clock (one per engine: it follows the step number on the host)."""
        return PhaseClock((self.source, self.sync, self.update))


def skips_nonfinite(config: Config) -> bool:
    """Whether a step with a non-finite gradient is skipped in the step itself (fp16; nonfinite 'skip')."""
    return config.precision == "fp16" or config.nonfinite == "skip"


def build_parts(config: Config, plan: ShardingPlan, optimizer: optax.GradientTransformation, abstract_params,
                has_model_state: bool) -> Parts:
    mesh = plan.mesh
    if config.sequence_parallel and mesh.shape.get(TENSOR_AXIS, 1) == 1:
        raise ConfigError("Config.sequence_parallel", "splits activations over the tensor axis, but the mesh's "
                          f"tensor axis has 1 device ({dict(mesh.shape)})",
                          "give MeshConfig.axes['tensor'] 2 or more devices, or set sequence_parallel False")
    if zero_axes(mesh) != DATA_AXIS and pipe_size(mesh) > 1 and config.sequence_attention == "ring":
        # Each pipeline stage runs its tick in a branch of its own, and XLA:CPU meets a collective-permute with
        # every device its source-target pairs name (the whole mesh's rings): another stage's branch either
        # never comes (a deadlock) or runs a permute of its own that meets this one (wrong values, measured).
        raise ConfigError("Config.sequence_attention", "'ring' under a pipeline is not built: its key/value "
                          "sends would meet the other stages' sends", "use 'ulysses', or a pipe axis of 1")
    source = _source(config, plan, has_model_state)
    if plan.offload and (source.layer_order is not None or has_model_state):
        raise ConfigError("OffloadOptimizerConfig.device", "offload with " + (
            "the interleaved pipeline schedule" if source.layer_order is not None else "model state (Flax "
            "collections such as batch_stats)") + " is not built", "set OffloadOptimizerConfig.device='none'")
    zero = ZeroGradSync(config.zero_stage, plan.placements, axis=zero_axes(mesh), ordered=config.deterministic_reductions,
                        grad_clip=config.grad_clip)
    sync = _onebit_sync(config, plan, optimizer, abstract_params, zero) or zero
    skips = skips_nonfinite(config)
    update = _update(config, plan, source, optimizer, abstract_params, skips)
    return Parts(source, sync, update, LossScaler(config.loss_scale, config.precision == "fp16"))


def _update(config: Config, plan: ShardingPlan, source, optimizer, abstract_params, skips: bool) -> Update:
    if config.offload_optimizer.on_disk:
        abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
        check_elementwise(optimizer, abstract_params, abstract_opt, config.grad_clip)
        return StreamedUpdate(plan, config, source.manual_axes, optimizer, skips)
    if plan.offload:
        return OffloadedUpdate(plan, config, source.manual_axes, optimizer, skips)
    return DeviceUpdate(plan, optimizer, config.grad_clip, skips)


def _source(config: Config, plan: ShardingPlan, has_model_state: bool) -> GradSource:
    stages = pipe_size(plan.mesh)
    if stages == 1:
        zero = zero_axes(plan.mesh)
        return Accumulation(config.grad_accum_steps, ordered=config.deterministic_reductions,
                            manual_axes=frozenset(axis_names(zero)), zero_axis=zero)
    layers = check_pipeline(config, plan.placements, stages, has_model_state)
    virtual = config.pipeline_virtual_stages
    schedule = build_schedule(config.pipeline_schedule, stages, config.grad_accum_steps, virtual)
    # Interleaved: device s runs virtual stages s, S + s, ...; a contiguous split of the layer axis over
    # `pipe` gives it model layers in one block, so the engine stores the stacked layers in pipeline
    # order (storage row -> model layer) and converts at the edges: checkpoints, evaluation, `model_params`.
    order = interleaved_layer_order(layers, stages, virtual) if schedule.virtual > 1 else None
    return Pipelined(schedule, layers // (stages * virtual), config.grad_accum_steps, plan.placements, order,
                     zero_axis=zero_axes(plan.mesh))


# The compressed optimizers and their syncs (their update takes the exchanged momentum: optim/onebit.py).
COMPRESSED_SYNCS = {onebit.OneBitAdam: ("1-bit Adam", "onebit_adam", OneBitSync),
                    OneBitLamb: ("1-bit LAMB", "onebit_lamb", OneBitLambSync),
                    ZeroOneAdam: ("0/1 Adam", "zero_one_adam", ZeroOneSync)}


def _wrapped_compressed(optimizer, abstract_params) -> bool:
    """Whether a compressed optimizer's state hides inside `optimizer` (a chain, a wrapper) without being it."""
    if isinstance(optimizer, onebit.CompressedMomentum):
        return False
    kinds = (onebit.OneBitAdamState, OneBitLambState, ZeroOneAdamState)
    state = jax.eval_shape(optimizer.init, abstract_params)
    return any(isinstance(x, kinds) for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, kinds)))


def _onebit_sync(config: Config, plan: ShardingPlan, optimizer, abstract_params, zero: ZeroGradSync):
    """The compressed sync when `optimizer` is `zeroflax.optim.onebit_adam`, `onebit_lamb` or `zero_one_adam`, after checking
    what it composes with; None for any other optimizer."""
    if _wrapped_compressed(optimizer, abstract_params):
        raise ConfigError("optimizer", "1-bit Adam, 1-bit LAMB or 0/1 Adam is wrapped (an optax chain or wrapper): the "
                          "engine must exchange its momentum, so it has to be the optimizer itself",
                          "pass zeroflax.optim.onebit_adam(...), onebit_lamb(...) or zero_one_adam(...) directly "
                          "(Config.grad_clip clips)")
    if type(optimizer) not in COMPRESSED_SYNCS:
        return None
    name, function, kind = COMPRESSED_SYNCS[type(optimizer)]
    mesh = plan.mesh
    refusals = [
        (config.zero_stage == 3, "Config.zero_stage", "stage 3 reduce-scatters each layer's gradient inside "
         f"the backward pass, so no device ever holds the local gradient whose momentum {name} "
         "compresses", "use zero_stage 0, 1 or 2"),
        (plan.offload, "OffloadOptimizerConfig.device", f"{name} with offload is not built",
         "set OffloadOptimizerConfig.device='none'"),
        (pipe_size(mesh) > 1, f"MeshConfig.axes['{PIPE_AXIS}']", f"{name} under a pipeline is not built",
         "set the pipe axis to 1"),
        (mesh.shape.get(TENSOR_AXIS, 1) > 1, f"MeshConfig.axes['{TENSOR_AXIS}']", f"{name} with tensor "
         "slicing is not built (each slice would be its own compressed buffer)", "set the tensor axis to 1"),
        (zero_axes(mesh) != DATA_AXIS, f"MeshConfig.axes['{SEQUENCE_AXIS}']", f"{name} with a sequence axis is not "
         "built (its exchange runs over `data` alone)", "set the sequence axis to 1"),
    ]
    for refused, key, why, fix in refusals:
        if refused:
            raise ConfigError(key, f"refused with zeroflax.optim.{function}: {why}", fix)
    return make_sync(optimizer, plan.placements, mesh.shape[DATA_AXIS], zero, config.grad_clip,
                     skips=skips_nonfinite(config), kind=kind)


def state_shardings(parts: Parts, plan: ShardingPlan, abstract_model_state) -> TrainState:
    """Where each field of the TrainState lives: the plan's for parameters and optimizer state, each
    part's for its own fields."""
    replicated = plan.replicated
    fields = dict(
        step=replicated, params=plan.params, opt_state=plan.opt_state,
        loss_scale=jax.tree.map(lambda _: replicated, parts.scaler.init()),
        rng=replicated, model_state=jax.tree.map(lambda _: replicated, abstract_model_state),
        sync_state=parts.sync.shardings(plan.mesh))
    return TrainState(**{**fields, **parts.update.field_shardings()})  # the update may keep params elsewhere


def abstract_state(parts: Parts, config: Config, optimizer, abstract_params, abstract_model_state,
                   shardings: TrainState, stored: bool = True) -> TrainState:
    """The initial TrainState as ShapeDtypeStructs with their shardings, in their stored shapes (padded where
    a partitioned dimension is not a multiple of its shards: `sharding.padding`), or (`stored` False) their
    true shapes, without shardings."""
    fields = dict(
        step=jax.ShapeDtypeStruct((), jax.numpy.int32), params=abstract_params,
        opt_state=jax.eval_shape(optimizer.init, abstract_params),
        loss_scale=jax.eval_shape(parts.scaler.init),
        rng=jax.eval_shape(lambda: jax.random.split(jax.random.PRNGKey(config.seed))[1]),
        model_state=abstract_model_state,
        sync_state=jax.eval_shape(parts.sync.init_state))
    state = TrainState(**{**fields, **parts.update.abstract_fields(abstract_params)})
    return stored_abstract(state, shardings) if stored else state

