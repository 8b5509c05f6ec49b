"""`initialize` -> `Engine`: the jitted, ZeRO-partitioned train step.

The step is a pure function `(TrainState, batch) -> (TrainState, metrics)`, jitted once with the
shardings of the `ShardingPlan` and the state donated. Its parts:

  1. local gradients: a `shard_map` that is manual over the `data` axis (other axes stay automatic,
     so tensor slicing composes). Each device runs the loss on its micro-batches; ZeRO-3 parameters
     are gathered just in time: per module (`sharding.groups`: Flax modules, `zeroflax.group` blocks),
     per layer (`scan_layers`, `nn.scan`) or at the point of use (`zeroflax.gather`); a leaf the loss
     uses as a plain array is gathered on entry (found by a probe trace: `Engine.probe_usage`,
     `Engine.gathered_on_entry()`).
     Model state (Flax collections besides `params`, e.g. BatchNorm statistics) is threaded through
     the micro-batches and averaged over `data`. Gradients are synchronised by `ZeroGradSync`.
  2. the update, in the global view: unscale (fp16), skip on overflow, clip, `optimizer.update` on
     each device's shard (stages 1-3), then the parameters go back to their at-rest sharding
     (stages 1-2: an all-gather of the updated shards).

With offload (`Config.offload_optimizer`), the master weights and optimizer state are on the host: the
loss runs on the device's compute-dtype copy, the reduced gradient shards go to the host, the update
runs there (`compute_on('device_host')`, or on the device with the state brought over and back), and
the new compute copy comes back; with `delayed_update` the update applies the previous step's
gradients, so it does not wait for this step's backward pass. With `Config.offload_param` the ZeRO-3
gathers stream their master shards from the host (`sharding.layers.gather_from_host`).

With `zeroflax.optim.onebit_adam` as the optimizer, its sync (`optim/onebit.py`) replaces ZeRO's after the
warm-up: each device's momentum is exchanged as sign bits, and the update receives it. The step then has
several programs (`Engine.phases`), picked on the host from the step number.
"""
from __future__ import annotations

import functools
import re
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import PartitionSpec as P

from zeroflax.adapters import unbox
from zeroflax.batch import BatchLayout
from zeroflax.config import Config, ConfigError
from zeroflax.optim.loss_scale import LossScaleState, init_loss_scale, update_loss_scale
from zeroflax.optim.offload import OffloadedUpdate, on_device
from zeroflax.optim import onebit
from zeroflax.optim.clipping import clip_to, global_norm
from zeroflax.sharding.grad_sync import ZeroGradSync
from zeroflax.sharding.linen_groups import loss_scope
from zeroflax.sharding.scopes import UPDATE_SCOPE
from zeroflax.sharding.manual import psum_on_slices
from zeroflax.sharding.layers import GatherUsage, LayerContext, ShardedLeaf, loss_remat_policy, reused_leaves
from zeroflax.pipeline.executor import active_stage, run_schedule, stage_hook, tables
from zeroflax.pipeline.layout import check_pipeline, interleaved_layer_order, take_layers
from zeroflax.pipeline.schedule import build_schedule
from zeroflax.remat_choice import settle_remat
from zeroflax.sharding.mesh import DATA_AXIS, PIPE_AXIS, TENSOR_AXIS, build_mesh, pipe_size
from zeroflax.sharding.policy import LeafPlacement, ShardingPlan, make_plan


@struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps attempted (skipped ones included)
    params: Any  # fp32 master parameters, at-rest sharding of the ZeRO stage
    opt_state: Any
    loss_scale: LossScaleState
    rng: jax.Array  # uint32[2] base key; step and device are folded in
    model_state: Any = None  # Flax collections besides params (e.g. batch_stats): replicated, or None
    # Offload: the device's compute-dtype copy of the parameters (a leaf streamed from the host: None).
    compute_params: Any = None
    # Offload's delayed update: the previous step's reduced gradients (host), applied by this step.
    pending_grads: Any = None
    # The gradient sync's own state: 1-bit Adam's error buffers and last exchanged momentum (else None).
    sync_state: Any = None


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


def _all_leaves(tree) -> set:
    return set(range(len(jax.tree.leaves(tree))))




class Engine:
    """Holds the mesh, the sharding plan and the compiled step; see `initialize`."""

    def __init__(self, loss_fn: Callable, optimizer: optax.GradientTransformation, config: Config,
                 plan: ShardingPlan, abstract_params, train_batch_size: int, abstract_model_state=None):
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.config = config
        self.plan = plan
        self.mesh = plan.mesh
        self.data_size = self.mesh.shape[DATA_AXIS]
        self.train_batch_size = train_batch_size
        self.abstract_params = abstract_params
        self.has_model_state = abstract_model_state is not None
        self.abstract_model_state = abstract_model_state
        # Filled in when the step is first traced: what the probe found (which ZeRO-3 leaves the loss
        # gathers itself) and what the real trace did (groups, regions); see `gather_usage`.
        self._probe_usage: GatherUsage | None = None
        self.gather_usage: GatherUsage | None = None
        self.grad_sync = ZeroGradSync(config.zero_stage, plan.placements)
        # 1-bit Adam replaces the gradient sync (optim/onebit.py); None otherwise.
        self.onebit = self._onebit_sync(optimizer, plan, abstract_params)
        if config.sequence_parallel and self.mesh.shape.get(TENSOR_AXIS, 1) == 1:
            raise ConfigError("Config.sequence_parallel", "splits activations over the tensor axis, but the mesh's "
                              f"tensor axis has 1 device ({dict(self.mesh.shape)})",
                              "give MeshConfig.axes['tensor'] 2 or more devices, or set sequence_parallel False")
        stages = pipe_size(self.mesh)
        self.manual_axes = {DATA_AXIS, PIPE_AXIS} if stages > 1 else {DATA_AXIS}
        self.schedule = None
        self.pipeline_activation = None  # set when the pipelined step is traced
        self.layer_order = None  # storage row -> model layer of the stacked layers, when not the identity
        self._reorder_jits: dict = {}
        if stages > 1:
            layers = check_pipeline(config, plan.placements, stages, abstract_model_state is not None)
            self.layers_per_chunk = layers // (stages * config.pipeline_virtual_stages)
            self.schedule = build_schedule(config.pipeline_schedule, stages, config.grad_accum_steps,
                                           config.pipeline_virtual_stages)
            if self.schedule.virtual > 1:
                # Interleaved: device s runs virtual stages s, S + s, ...; a contiguous split of the
                # layer axis over `pipe` gives it model layers in one block, so the engine stores the
                # stacked layers in pipeline order (storage row -> model layer) and converts at the
                # edges: checkpoints, evaluation, `model_params`.
                self.layer_order = interleaved_layer_order(layers, stages, config.pipeline_virtual_stages)
        if plan.offload and (self.layer_order is not None or abstract_model_state is not None):
            raise ConfigError("OffloadOptimizerConfig.device", "offload with " + (
                "the interleaved pipeline schedule" if self.layer_order is not None else "model state (Flax "
                "collections such as batch_stats)") + " is not built", "set OffloadOptimizerConfig.device='none'")
        delayed = config.offload_optimizer.delayed_update
        self.state_shardings = TrainState(
            step=plan.replicated, params=plan.params, opt_state=plan.opt_state,
            loss_scale=jax.tree.map(lambda _: plan.replicated, init_loss_scale(config.loss_scale, False)),
            rng=plan.replicated, model_state=jax.tree.map(lambda _: plan.replicated, abstract_model_state),
            compute_params=plan.compute, pending_grads=plan.host_grads if delayed else None,
            sync_state=self.onebit.shardings(self.mesh) if self.onebit is not None else None)
        # ZeRO-Offload's update (optim/offload.py), or None without offload.
        self.offload = (OffloadedUpdate(plan, config, frozenset(self.manual_axes), self._update, self._linearized_update)
                        if plan.offload else None)
        self._jit_compute_copy = None
        self._jit_steps: dict = {}  # phase -> the jitted step
        # Phased steps (the delayed update's start, 1-bit Adam's warm-up) pick their program on the host:
        self._step_count: int | None = None  # the step number of the state `step` last returned
        self._exchanged_at: int = -1  # ... the step of its last 1-bit exchange
        self._last_step = None  # ... and that state's step array, to recognise it
        self._jit_eval = None
        self._compiled: dict = {}
        # The remat policy the step runs: Config.remat, or 'none' where it was measured to save nothing
        # (remat_choice.py; settled before the first step or report).
        self.remat = config.remat
        self._remat_settled = False

    def _onebit_sync(self, optimizer, plan: ShardingPlan, abstract_params):
        """The 1-bit sync when `optimizer` is `zeroflax.optim.onebit_adam`, after checking what it composes
        with; None for any other optimizer."""
        if onebit.find_onebit(optimizer, abstract_params):
            raise ConfigError("optimizer", "1-bit Adam is wrapped (an optax chain or wrapper): the engine must "
                              "exchange its momentum, so it has to be the optimizer itself",
                              "pass zeroflax.optim.onebit_adam(...) directly (Config.grad_clip clips)")
        if not isinstance(optimizer, onebit.OneBitAdam):
            return None
        config = self.config
        refusals = [
            (config.zero_stage == 3, "Config.zero_stage", "stage 3 reduce-scatters each layer's gradient inside "
             "the backward pass, so no device ever holds the local gradient whose momentum 1-bit Adam "
             "compresses", "use zero_stage 0, 1 or 2"),
            (config.precision == "fp16", "Config.precision", "a step skipped on an fp16 overflow would have to "
             "roll back every device's error buffers, which is not built", "use 'bf16' or 'fp32'"),
            (config.nonfinite == "skip", "Config.nonfinite", "a skipped step would have to roll back every "
             "device's error buffers, which is not built", "use 'error'"),
            (plan.offload, "OffloadOptimizerConfig.device", "1-bit Adam with offload is not built",
             "set OffloadOptimizerConfig.device='none'"),
            (pipe_size(self.mesh) > 1, f"MeshConfig.axes['{PIPE_AXIS}']", "1-bit Adam under a pipeline is not built",
             "set the pipe axis to 1"),
            (self.mesh.shape.get(TENSOR_AXIS, 1) > 1, f"MeshConfig.axes['{TENSOR_AXIS}']", "1-bit Adam with tensor "
             "slicing is not built (each slice would be its own compressed buffer)", "set the tensor axis to 1"),
        ]
        for refused, key, why, fix in refusals:
            if refused:
                raise ConfigError(key, f"refused with zeroflax.optim.onebit_adam: {why}", fix)
        return onebit.make_sync(optimizer, plan.placements, self.data_size, self.grad_sync, config.grad_clip)

    # ----------------------------------------------------------------------------- local gradients
    def _params_for_compute(self, params, point_of_use: set, sources=None):
        """Inside shard_map: turn at-rest parameters into what the loss sees (compute dtype).

        At ZeRO-3 a partitioned leaf reaches the loss as a `ShardedLeaf` handle when it is gathered
        where it is used (`point_of_use`: leaf indices, and every stack of layers); any other leaf is
        gathered here, on entry. `sources` (offload_param; flattened, None where not streamed) are the
        host shards that the gathers stream, `params` holding their device gradient sinks.
        """
        config = self.config
        dtype = config.compute_dtype
        stage3 = config.zero_stage == 3
        block = config.quantization_block if config.quantized_weights else 0
        placements = jax.tree.leaves(self.plan.placements, is_leaf=_is_placement)
        leaves, treedef = jax.tree.flatten(params)
        sources = sources or [None] * len(leaves)

        def prepare(index, placement: LeafPlacement, leaf):
            if not jnp.issubdtype(leaf.dtype, jnp.floating):
                return leaf
            if stage3 and placement.zero_dim is not None:
                first = 1 if placement.stacked else 0  # a stack's handle describes one layer
                dim, sliced = placement.zero_dim - first, placement.auto_spec()[first:]
                handle = ShardedLeaf(leaf, dim, DATA_AXIS, dtype, tuple(placement.shape[first:]), index, block,
                                     sliced, sources[index])
                return handle if placement.stacked or index in point_of_use else handle._gathered()
            return leaf.astype(dtype)

        return jax.tree.unflatten(treedef, [prepare(i, p, x) for i, (p, x) in enumerate(zip(placements, leaves))])

    def _cast_batch(self, batch):
        return _floats_to(batch, self.config.compute_dtype)

    def _context(self, usage: GatherUsage, scan_owners: frozenset | None = None) -> LayerContext:
        """The context the loss is traced in; `scan_owners` defaults to what the probe found."""
        config = self.config
        probed = self._probe_usage.scan_owners if self._probe_usage is not None else ()
        owners = frozenset(probed) if scan_owners is None else scan_owners
        return LayerContext(remat=self.remat, bucket=config.prefetch_bucket_size,
                            max_live=config.max_live_parameters, usage=usage,
                            sequence_parallel=config.sequence_parallel, tensor_size=self.mesh.shape.get(TENSOR_AXIS, 1),
                            logical_rules=config.logical_rules, data_axis_aliases=config.data_axis_aliases,
                            data_axis=DATA_AXIS, scan_owners=owners)

    def _call_loss(self, params, batch, rng, model_state):
        """(loss, aux, new model state) of the user's loss on one micro-batch."""
        if self.has_model_state:
            out, new_state = self.loss_fn(params, batch, rng, model_state)
        else:
            out, new_state = self.loss_fn(params, batch, rng), None
        loss, aux = _split_loss_output(out)
        return loss, aux, new_state

    def _traced_loss(self, ctx: LayerContext, point_of_use: set, params, batch, rng, model_state, sources=None):
        """The user's loss as the engine traces it (inside shard_map): under the loss scope (context,
        Linen groups), on compute-dtype parameters (handles for `point_of_use`) and batch."""
        def loss(params, batch, rng, model_state):
            with loss_scope(ctx):
                return self._call_loss(self._params_for_compute(params, point_of_use, sources),
                                       self._cast_batch(batch), rng, model_state)

        policy = loss_remat_policy(ctx.remat)
        probe = self._probe_usage
        # Under a pipeline a stage's backward recomputes the stage anyway (and its output leaves the
        # loss through the stage hook, which a checkpoint would not let it do).
        if (policy is None or ctx.usage.probe or probe is None or not probe.remat_regions
                or active_stage() is not None):
            return loss(params, batch, rng, model_state)
        # Config.remat reaches the code between the checkpointed blocks too (a stem, pooling, the head
        # and the loss): only the blocks' boundaries are kept from it. prevent_cse: without the barrier
        # XLA merges that recomputation with the forward pass (ResNet-18 at 224^2, 8 per device, stage 0,
        # remat 'full': 235.6 MiB of temporaries without the barrier, 214.2 MiB with it; 384.9 MiB
        # with remat 'none').
        return jax.checkpoint(loss, policy=policy, prevent_cse=True)(params, batch, rng, model_state)

    def _point_of_use(self) -> set:
        usage = self._probe_usage
        if usage is None or usage.failed:
            return set()
        return usage.gathered - usage.raw - set(reused_leaves(usage.group_calls, self.config.max_reuse_distance))

    @property
    def probe_usage(self) -> GatherUsage | None:
        """What the probe trace found (groups and their sizes, leaves gathered where used); None
        before the step is first traced."""
        return self._probe_usage

    def gathered_on_entry(self) -> list[str]:
        """Paths of the ZeRO-3 partitioned leaves that are gathered on entry, once the step has been
        traced (`gathered_on_entry_reasons` says why for each)."""
        return list(self.gathered_on_entry_reasons())

    def gathered_on_entry_reasons(self) -> dict[str, str]:
        """Path -> why of each ZeRO-3 partitioned leaf gathered on entry rather than where it is used."""
        usage, point_of_use = self._probe_usage, self._point_of_use()
        reused = reused_leaves(usage.group_calls, self.config.max_reuse_distance) if usage else {}
        paths = jax.tree_util.tree_flatten_with_path(self.plan.placements, is_leaf=_is_placement)[0]
        reasons = {}
        for index, (path, placement) in enumerate(paths):
            if placement.zero_dim is None or placement.stacked or index in point_of_use:
                continue
            if usage is None or usage.failed:
                why = f"the loss cannot run on handles ({usage.failed if usage else 'not traced yet'})"
            elif index in usage.raw:
                why = "used as a plain array outside any module, group or zeroflax.gather"
            elif index in reused:
                why = f"shared by {reused[index]} group calls within Config.max_reuse_distance: gathered once"
            else:
                why = "not used by any group, scan or zeroflax.gather"
            reasons[jax.tree_util.keystr(path)] = why
        return reasons

    def _probe(self, params, batch, model_state):
        """Trace the loss once (abstractly) with every ZeRO-3 leaf as a handle, to learn which leaves it
        gathers itself (Flax modules, groups, scans, zeroflax.gather) and whether Config.remat applies
        anywhere. Leaves it uses as plain arrays are then gathered on entry, as are all of them if the
        loss cannot run on handles at all."""
        abstract = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)
        first = jax.tree.map(lambda x: jax.ShapeDtypeStruct((x.shape[0] // self.config.grad_accum_steps,) + x.shape[1:],
                                                            x.dtype), batch)  # one micro-batch

        def trace(usage, owners=frozenset()):  # a new function each time: eval_shape caches traces
            def local(params, batch, model_state):
                params, sources = self._gradient_sinks(params)
                loss, _, _ = self._traced_loss(self._context(usage, owners), _all_leaves(params), params, batch,
                                               jax.random.PRNGKey(0), model_state, sources)
                return loss

            fn = jax.shard_map(local, mesh=self.mesh, in_specs=(self.plan.data_specs("params"), P(DATA_AXIS), P()),
                               out_specs=P(), axis_names=self.manual_axes, check_vma=False)
            jax.eval_shape(fn, abstract(params), abstract(first), abstract(model_state))
            return usage

        usage = GatherUsage(probe=True)
        try:
            trace(usage)
            if usage.scan_owners:  # again, with those modules as groups: the groups the step will have
                owners = frozenset(usage.scan_owners)
                usage = trace(GatherUsage(probe=True, scan_owners=set(owners)), owners)
        except Exception as error:  # the real trace, with entry gathers, reports genuine errors
            unbound = re.search(r"unbound axis name: (\S+?)\.?(\s|$)", str(error))
            if isinstance(error, NameError) and unbound:  # not a handle's fault: it fails however gathered
                raise ConfigError("Config.data_axis_aliases", f"the model reduces over the axis name "
                                  f"{unbound.group(1)!r}, which is no mesh axis ({', '.join(self.mesh.axis_names)})",
                                  "add it to Config.data_axis_aliases if it means the data-parallel devices "
                                  "(code written for pmap, e.g. sync BatchNorm)") from error
            usage.failed = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            if self.config.zero_stage == 3:
                hint = (" A stack of layers run by nn.scan needs the logical name 'layers' on its stacked dimension "
                        "of every leaf above Config.persistence_threshold." if "stack of layers" in str(error) else "")
                warnings.warn(f"zeroflax: the loss cannot run on ZeRO-3 parameter handles ({usage.failed}); every "
                              f"parameter is gathered on entry instead of where it is used.{hint}", stacklevel=4)
        if self.config.remat != "none" and usage.remat_regions == 0 and not usage.failed:
            warnings.warn(
                f"Config.remat={self.config.remat!r} applies to nothing in this loss: it has no Flax module, "
                "zeroflax.group block or scanned layers to checkpoint, so all activations are kept (set "
                "Config.remat='none' to say so, or mark blocks with zeroflax.group)", stacklevel=3)
        if self.config.sequence_parallel and usage.sequence_splits == 0 and not usage.failed:
            warnings.warn(
                "Config.sequence_parallel=True applies to nothing in this loss: it marks no activation with "
                "zeroflax.sequence_split, so activations stay whole on every tensor device (mark the residual "
                "stream, as zeroflax.models.gpt does, or set sequence_parallel False)", stacklevel=3)
        return usage

    def _gradient_sinks(self, params):
        """(params, sources): with offload_param, each streamed leaf (a host shard) is replaced by a
        device array of its shape that receives its gradient, and listed in `sources` (flattened, None
        elsewhere); without it, (params, None)."""
        streamed = self.plan.streamed()
        if not any(streamed):
            return params, None
        leaves, treedef = jax.tree.flatten(params)
        sinks = [jnp.zeros(x.shape, x.dtype) if s else x for x, s in zip(leaves, streamed)]
        return treedef.unflatten(sinks), [x if s else None for x, s in zip(leaves, streamed)]

    def _local_grads(self, params, batch, rng, scale, model_state, sync=None, phase: str = "steady"):
        """Per device (manual over `data`): loss and synchronised gradients of its micro-batches. Under
        1-bit Adam's compressed phases, `sync` is (the last momentum where passed whole, the sync state, the
        step) and the gradients returned are the exchanged momentum, with (the new sync state, the gradient
        norm) last."""
        config = self.config
        compressed = self.onebit is not None and phase != onebit.WARMUP
        per_microbatch = (functools.partial(self.onebit.per_microbatch, phase=phase) if self.onebit is not None
                          else self.grad_sync.per_microbatch)
        params, sources = self._gradient_sinks(params)
        accum = config.grad_accum_steps
        micro = jax.tree.map(lambda x: x.reshape((accum, x.shape[0] // accum) + x.shape[1:]), batch)
        device_rng = jax.random.fold_in(rng, jax.lax.axis_index(DATA_AXIS))
        # The loss of the whole step is the mean over all data-parallel micro-batches.
        weight = 1.0 / (self.data_size * accum)
        usage = GatherUsage()
        self.gather_usage = usage
        ctx = self._context(usage)
        point_of_use = self._point_of_use()

        if self.schedule is not None:
            grads, loss, aux = self._pipeline_grads(params, micro, device_rng, scale * weight, ctx, point_of_use)
            grads = self.grad_sync.final(grads)
            # Leaves every stage holds (embeddings, the head, tied ones too) got a gradient from the
            # stages that use them: their sum over `pipe` (after ZeRO's reduction: on shards when sharded).
            shared = lambda p, g: g if p.base[:1] == (PIPE_AXIS,) else psum_on_slices(g, PIPE_AXIS, p.auto_spec())
            grads = jax.tree.map(shared, self.plan.placements, grads, is_leaf=_is_placement)
            grads = jax.tree.map(lambda g: g / scale, grads)
            return (grads, jax.lax.pmean(loss, DATA_AXIS), jax.tree.map(lambda a: jax.lax.pmean(a, DATA_AXIS), aux),
                    None, None)

        def micro_grads(micro_batch, micro_rng, state):
            def scaled_loss(p):
                loss, aux, new_state = self._traced_loss(ctx, point_of_use, p, micro_batch, micro_rng, state, sources)
                loss = loss.astype(jnp.float32)
                return loss * (scale * weight), (loss, aux, new_state)

            grads, (loss, aux, new_state) = jax.grad(scaled_loss, has_aux=True)(params)
            return per_microbatch(grads), loss, aux, new_state

        if accum == 1:
            grads, loss, aux, model_state = micro_grads(jax.tree.map(lambda x: x[0], micro), device_rng, model_state)
        else:
            shapes = jax.eval_shape(micro_grads, jax.tree.map(lambda x: x[0], micro), device_rng, model_state)

            def body(carry, inputs):
                grad_acc, loss_acc, aux_acc, state = carry
                micro_batch, index = inputs
                grads, loss, aux, state = micro_grads(micro_batch, jax.random.fold_in(device_rng, index), state)
                add = lambda a, b: jax.tree.map(jnp.add, a, b)
                return (add(grad_acc, grads), loss_acc + loss, add(aux_acc, aux), state), None

            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes[:3])
            (grads, loss, aux, model_state), _ = jax.lax.scan(
                body, (*zeros, model_state), (micro, jnp.arange(accum)))
            loss = loss / accum
            aux = jax.tree.map(lambda a: a / accum, aux)
        sync_out = None
        if compressed:  # fp16 is refused with 1-bit Adam: scale is 1
            mu_prev, sync_state, step = sync
            grads, sync_state, norm = self.onebit.final(grads, mu_prev, sync_state, step)
            sync_out = (sync_state, norm)
        else:
            grads = self.grad_sync.final(grads)
            grads = jax.tree.map(lambda g: g / scale, grads)
        loss = jax.lax.pmean(loss, DATA_AXIS)
        aux = jax.tree.map(lambda a: jax.lax.pmean(a, DATA_AXIS), aux)
        # Every device (and so every checkpoint) holds the same model state: the mean over `data`.
        model_state = jax.tree.map(
            lambda x: jax.lax.pmean(x, DATA_AXIS) if jnp.issubdtype(x.dtype, jnp.inexact) else x, model_state)
        return grads, loss, aux, model_state, sync_out

    def _pipeline_grads(self, params, micro, rng, seed, ctx, point_of_use):
        """Per device (manual over `data` and `pipe`): the schedule's micro-batches through this stage.
        Returns (this stage's gradients, mean loss, mean aux); the caller sums the gradients of leaves
        every stage holds over `pipe`, so every stage updates them alike."""
        chunk = self.layers_per_chunk
        accum = self.config.grad_accum_steps

        def piece(p, micro_batch, micro_rng, x, start, role):
            with stage_hook(x, start, chunk) as stage:
                loss, aux, _ = self._traced_loss(ctx, point_of_use, p, micro_batch, micro_rng, None)
            if stage.calls != 1:
                raise ConfigError(f"MeshConfig.axes['{PIPE_AXIS}']", "the loss never calls zeroflax.scan_layers, so "
                                  "there is no stack of layers to split into pipeline stages",
                                  "run the layers with zeroflax.scan_layers, or set the pipe axis to 1")
            return (loss.astype(jnp.float32), aux) if role == "last" else stage.output

        first = jax.tree.map(lambda x: x[0], micro)
        activation = jax.eval_shape(lambda p: piece(p, first, rng, None, 0, "first"), params)
        self.pipeline_activation = activation  # one micro-batch's stage input (the comm report's unit)
        aux_shape = jax.eval_shape(lambda p, x: piece(p, first, rng, x, 0, "last")[1], params, activation)
        grads, loss, aux = run_schedule(self.schedule, piece, params, micro, rng, seed, activation,
                                        self.grad_sync.per_microbatch, chunk, aux_shape)
        # Only the last stage computed losses: the sum over `pipe` is theirs.
        loss = jax.lax.psum(loss, PIPE_AXIS) / accum
        aux = jax.tree.map(lambda a: jax.lax.psum(a, PIPE_AXIS) / accum, aux)
        return grads, loss, aux

    # ------------------------------------------------------------------------- layer storage order
    def _reordered(self, what: str, tree, to_model: bool):
        if self.layer_order is None:
            return tree
        key = (what, to_model)
        if key not in self._reorder_jits:
            index = np.argsort(self.layer_order) if to_model else self.layer_order
            params_fn, state_fn = take_layers(index, self.plan.placements, self.optimizer)
            fn, out = (params_fn, self.plan.params) if what == "params" else (state_fn, self.state_shardings)
            self._reorder_jits[key] = jax.jit(fn, out_shardings=out)
        return self._reorder_jits[key](tree)

    def model_order(self, state: TrainState) -> TrainState:
        """The state with its stacked layers in model order: what checkpoints hold, so they restore on
        any mesh. The identity except under the interleaved schedule, which stores them in pipeline
        order (see `layer_order`). The offload compute copy is dropped (it is remade from the master
        weights) unless the delayed update's prediction made it: that one cannot be remade."""
        if self.offload is not None and not self.config.offload_optimizer.predicts:
            state = state.replace(compute_params=None)
        return self._reordered("state", state, True)

    def storage_order(self, state: TrainState) -> TrainState:
        """The inverse of `model_order`: a model-order state (fresh, or restored) as this engine holds it,
        with its offload compute copy made from its master weights where it has none."""
        state = self._reordered("state", state, False)
        return self.with_compute_copy(state) if state.compute_params is None else state

    def abstract_state(self) -> TrainState:
        """The initial TrainState as ShapeDtypeStructs with their shardings: what `compile` needs to
        compile the step without creating a state (zeroflax plan compiles configurations it never runs)."""
        config = self.config
        params = self.abstract_params
        state = TrainState(
            step=jax.ShapeDtypeStruct((), jnp.int32), params=params,
            opt_state=jax.eval_shape(self.optimizer.init, params),
            loss_scale=jax.eval_shape(lambda: init_loss_scale(config.loss_scale, config.precision == "fp16")),
            rng=jax.eval_shape(lambda: jax.random.split(jax.random.PRNGKey(config.seed))[1]),
            model_state=self.abstract_model_state,
            compute_params=jax.eval_shape(self.offload.compute_copy, params) if self.offload is not None else None,
            pending_grads=params if config.offload_optimizer.delayed_update else None,
            sync_state=jax.eval_shape(self.onebit.init_state) if self.onebit is not None else None)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), state,
                            self.state_shardings)

    def with_compute_copy(self, state: TrainState) -> TrainState:
        """Under offload, `state` with the device's compute copy made from its master weights (after a
        restore, or a change to `state.params`); `state` itself otherwise."""
        if self.offload is None:
            return state
        if self._jit_compute_copy is None:
            self._jit_compute_copy = jax.jit(self.offload.compute_copy_of, out_shardings=self.plan.compute)
        return state.replace(compute_params=self._jit_compute_copy(state.params))

    def model_params(self, state: TrainState):
        """`state.params` in model order (layer i of the stack is the model's layer i)."""
        return self._reordered("params", state.params, True)

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

    def _sharded_grads(self, params, batch, rng, scale, model_state, sync=None, phase: str = "steady"):
        plan = self.plan
        if self._probe_usage is None:
            self._probe_usage = self._probe(params, batch, model_state)
        in_specs = (plan.data_specs("params"), jax.tree.map(lambda _: P(DATA_AXIS), batch), P(), P(), P())
        out_specs = (plan.data_specs("grads"), P(), P(), P())
        if sync is None:
            fn = lambda *args: self._local_grads(*args, phase=phase)[:4]
            return (*jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs,
                                   axis_names=self.manual_axes, check_vma=False)(params, batch, rng, scale, model_state),
                    None)
        # 1-bit Adam's compressed phases: the last momentum (whole, where it is passed), the sync state, the step.
        mu_specs = jax.tree.map(lambda p, m: None if m is None else p.pipe_spec(), plan.placements, sync[0],
                                is_leaf=_is_placement)
        sync_specs = (mu_specs, self.onebit.specs(), P())
        fn = functools.partial(self._local_grads, phase=phase)
        return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs + (sync_specs,),
                             out_specs=out_specs + ((self.onebit.specs(), P()),),
                             axis_names=self.manual_axes, check_vma=False)(params, batch, rng, scale, model_state, sync)

    # ------------------------------------------------------------------------------- train step
    def _update(self, params, opt_state, grads, apply=None, momentum=None):
        """(params, opt_state, grad_norm, finite): clip, `optimizer.update` and apply, on shards. The step
        is skipped (the old values kept) when `apply` is False, and when its gradient is not finite under
        fp16 or Config.nonfinite = 'skip' (`skips_nonfinite`).
        1-bit Adam's compressed phases pass `momentum` = (the exchanged momentum, the gradient norm)."""
        config = self.config
        if momentum is not None:
            momentum, grad_norm = momentum
            updates, new_opt_state = self.optimizer.update(momentum, opt_state, params, momentum=momentum)
        else:
            grad_norm = global_norm(grads)
            if config.grad_clip > 0:
                grads = clip_to(grads, grad_norm, config.grad_clip)  # so a clipped step equals optax's chain
            updates, new_opt_state = self.optimizer.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        finite = jnp.isfinite(grad_norm)
        if not self.skips_nonfinite and apply is None:
            return new_params, new_opt_state, grad_norm, finite
        # The step is applied only if its gradient is finite (and `apply`). Selecting between the old and
        # the new state keeps both alive through the update (XLA cannot update in place): fp16's loss
        # scaling and Config.nonfinite = 'skip' pay that; 'error' stops the run instead (train.py).
        take = finite if apply is None else apply & finite
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(take, a, b), new, old)
        return keep(new_params, params), keep(new_opt_state, opt_state), grad_norm, finite

    def _linearized_update(self, params, opt_state, probe, probe_norm):
        """The optimizer's next update as an affine function of the next gradient g, for offload's 'linear'
        prediction: (center, slope) with U(g) ~ center + slope g, the secant through U(+probe) and
        U(-probe), per element (exact for an elementwise optimizer at g = +-probe; `probe` is the gradient
        just applied, so of the next one's size, and `probe_norm` its norm, which the update has computed).
        Where probe is 0 the slope is 0. A secant, not jax.jvp:
        the jvp of a division makes constants in device memory, which jax 0.10 refuses to mix with the
        host's arrays."""
        if self.config.grad_clip > 0:
            probe = clip_to(probe, probe_norm, self.config.grad_clip)
        up = self.optimizer.update(probe, opt_state, params)[0]
        down = self.optimizer.update(jax.tree.map(lambda h: -h, probe), opt_state, params)[0]
        center = jax.tree.map(lambda a, b: (a + b) * 0.5, up, down)
        # (h == 0) keeps the division finite where the select drops it; h * 0 is a zero in host memory
        slope = jax.tree.map(lambda a, b, h: jnp.where(h != 0, (a - b) / (h + h + (h == 0)), h * 0), up, down, probe)
        return center, slope

    def _train_step(self, state: TrainState, batch, phase: str = "steady"):
        """One step. `phase` (static; picked on the host by `step`): 'steady'; with offload's delayed
        update 'exact' before it starts; under 1-bit Adam 'warmup', 'first' or 'compressed'."""
        config, plan = self.config, self.plan
        fp16 = config.precision == "fp16"
        dynamic_scaling = fp16 and config.loss_scale.loss_scale == 0
        rng = jax.random.fold_in(state.rng, state.step)
        scale = state.loss_scale.scale
        loss_params = self.offload.loss_params(state) if self.offload is not None else state.params
        sync = sync_state = None
        if self.onebit is not None and phase != onebit.WARMUP:
            mu = self.onebit.previous_momentum(state.opt_state.mu, phase)
            sync = (mu, state.sync_state, state.step)
        grads, loss, aux, model_state, sync_out = self._sharded_grads(loss_params, batch, rng, scale,
                                                                      state.model_state, sync, phase)
        grads = jax.lax.with_sharding_constraint(grads, plan.grads)
        compute = pending = None
        with jax.named_scope(UPDATE_SCOPE):  # the step's last part, named for the memory explainer
            if self.offload is not None:
                params, opt_state, compute, pending, grad_norm, finite = self.offload(state, grads, phase != "exact")
            else:
                # Stages 1-2: the update runs on this device's shard of replicated parameters (a free slice).
                params_view = jax.lax.with_sharding_constraint(state.params, plan.grads)
                momentum = None
                if sync_out is not None:
                    sync_state, norm = sync_out
                    momentum = (grads, norm)
                params, opt_state, grad_norm, finite = self._update(params_view, state.opt_state, grads,
                                                                    momentum=momentum)
                finite = jnp.asarray(finite)
                # On shards first: else XLA gathers the select's operands and the updated parameters apart.
                params = jax.lax.with_sharding_constraint(params, plan.grads)
                params = jax.lax.with_sharding_constraint(params, plan.params)
                opt_state = jax.lax.with_sharding_constraint(opt_state, plan.opt_state)
        loss_scale = update_loss_scale(state.loss_scale, ~finite, config.loss_scale, dynamic_scaling)
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state,
                               loss_scale=loss_scale, rng=state.rng, model_state=model_state,
                               compute_params=compute, pending_grads=pending,
                               sync_state=sync_state if sync_state is not None else state.sync_state)
        # nonfinite: the gradient was NaN or inf; skipped: so its update was not applied (fp16, 'skip').
        skipped = ~finite if self.skips_nonfinite else jnp.zeros((), bool)
        metrics = {"loss": loss, "grad_norm": grad_norm, "loss_scale": scale, "skipped": skipped, "nonfinite": ~finite}
        if aux is not None:
            metrics["aux"] = aux
        return new_state, metrics

    @property
    def skips_nonfinite(self) -> bool:
        """Whether a step with a non-finite gradient is skipped in the step itself (fp16; nonfinite 'skip')."""
        return self.config.precision == "fp16" or self.config.nonfinite == "skip"

    @property
    def phases(self) -> tuple[str, ...]:
        """The step's programs, the steady state last (see `_train_step`)."""
        if self.onebit is not None:
            return (onebit.WARMUP, onebit.FIRST, onebit.COMPRESSED) if self.onebit.partitioned else (
                onebit.WARMUP, onebit.COMPRESSED)
        return ("exact", "steady") if self.config.offload_optimizer.delayed_update else ("steady",)

    def _phase(self, step: int) -> str:
        if self.onebit is not None:
            return self.onebit.phase(step, self._exchanged_at)
        if self.config.offload_optimizer.delayed_update:
            return "steady" if step >= self.config.offload_optimizer.delayed_update_start else "exact"
        return "steady"

    def _step_fn(self, batch, phase: str | None = None):
        """The jitted step of `phase` (default: the steady state)."""
        phase = phase or self.phases[-1]
        if phase not in self.phases:
            raise ValueError(f"phase {phase!r} is not one of this engine's {self.phases}")
        if phase not in self._jit_steps:
            self._jit_steps[phase] = jax.jit(
                functools.partial(self._train_step, phase=phase),
                in_shardings=(self.state_shardings, self.plan.batch(batch)),
                out_shardings=(self.state_shardings, self.plan.replicated),
                donate_argnums=(0,))
        return self._jit_steps[phase]

    def batch_share(self) -> tuple[int, int]:
        """(index, count): this process feeds block `index` of the global batch's rows cut into `count`
        equal blocks, the rows of the data-axis shards its devices hold. count is the process count
        when processes split `data`; 1 when they split only other axes (a pipe axis across hosts): then
        every process feeds the whole batch."""
        data_dim = self.mesh.axis_names.index(DATA_AXIS)
        owners = np.vectorize(lambda d: d.process_index)(self.mesh.devices)
        mine = sorted({int(c[data_dim]) for c in np.argwhere(owners == jax.process_index())})
        per = len(mine)
        if mine != list(range(mine[0], mine[0] + per)) or self.data_size % per:
            raise ConfigError("MeshConfig.axes", f"this process's devices hold data shards {mine}, not one "
                              "contiguous block", "order the mesh axes so each process holds whole data blocks")
        return mine[0] // per, self.data_size // per

    @functools.cached_property
    def batch_layout(self) -> BatchLayout:
        """How the step takes its batch (`zeroflax/batch.py`: the forms a batch may come in)."""
        return BatchLayout(self.mesh, self.train_batch_size, self.batch_share()[1], self.data_size)

    def check_batch(self, batch) -> None:
        """Global arrays must hold train_batch_size rows; host data (and arrays this process holds whole)
        this process's share of them."""
        self.batch_layout.check(batch)

    def put_batch(self, batch):
        """The batch as global arrays split over `data` (any form `zeroflax/batch.py` lists)."""
        return self.batch_layout.place(batch)

    def set_remat(self, remat: str) -> None:
        """Run the step with this remat policy (remat_choice.py); drops what was compiled with another."""
        self.remat = remat
        self._jit_steps.clear()
        self._compiled.clear()
        self._jit_eval = None

    def probe(self, state, batch) -> GatherUsage:
        """What the loss does with its parameters (the probe's abstract trace), traced now if the step
        has not been yet. Without offload: the loss then takes `state.params` as they are."""
        if self._probe_usage is None:
            self._probe_usage = self._probe(state.params, batch, state.model_state)
        return self._probe_usage

    def _settle_remat(self, state, batch) -> None:
        if not self._remat_settled:
            self._remat_settled = True
            self.remat = settle_remat(self, state, batch)

    def step(self, state: TrainState, batch) -> tuple[TrainState, dict]:
        """One optimizer step over `batch` (train_batch_size examples). `state` is donated."""
        batch = self.put_batch(batch)
        self._settle_remat(state, batch)
        phased = len(self.phases) > 1
        phase = self.phases[-1]
        if phased:  # the step number (and last exchange) on the host, read once per state not made here
            if state.step is not self._last_step:
                self._step_count = int(state.step)
                if state.sync_state is not None:
                    self._exchanged_at = int(state.sync_state.exchanged_at)
            phase = self._phase(self._step_count)
        new_state, metrics = self._step_fn(batch, phase)(state, batch)
        if phased:
            if self.onebit is not None and phase != onebit.WARMUP:
                self._exchanged_at = self._step_count
            self._last_step, self._step_count = new_state.step, self._step_count + 1
        return new_state, metrics

    def evaluate(self, state: TrainState, batch) -> jax.Array:
        """The mean loss on `batch` with the current parameters (forward only, compute dtype).

        The loss gets rng None (its cue for inference mode) and, with model state, the current state,
        whose update it returns is discarded: evaluation uses the statistics, never changes them."""
        batch = self.put_batch(batch)
        if self._jit_eval is None:
            model_order = (take_layers(np.argsort(self.layer_order), self.plan.placements, self.optimizer)[0]
                           if self.layer_order is not None else None)

            def eval_loss(params, batch, model_state):
                dtype = self.config.compute_dtype
                if self.offload is not None:  # the master weights, from the host
                    params = jax.device_put(params, on_device(self.plan.params))
                if model_order is not None:
                    params = model_order(params)
                loss, _, _ = self._call_loss(_floats_to(params, dtype), _floats_to(batch, dtype), None, model_state)
                return loss.astype(jnp.float32)
            self._jit_eval = jax.jit(eval_loss, out_shardings=self.plan.replicated)
        return self._jit_eval(state.params, batch, state.model_state)

    # ----------------------------------------------------------------------------- compile-only
    def compile(self, state, batch, phase: str | None = None):
        """The compiled step (of `phase`; default the steady state) for these (abstract or concrete)
        arguments; no step is run."""
        phase = phase or self.phases[-1]
        state_abs, batch_abs = self.abstract_args(state, batch)
        self._settle_remat(state_abs, batch_abs)  # global shapes: a process's numpy rows are its share only
        key = phase, jax.tree.structure((state_abs, batch_abs)), tuple(
            (s.shape, str(s.dtype), s.sharding) for s in jax.tree.leaves((state_abs, batch_abs)))
        if key not in self._compiled:
            self._compiled[key] = self._step_fn(batch_abs, phase).lower(state_abs, batch_abs).compile()
        return self._compiled[key]

    def abstract_args(self, state, batch):
        """(state, batch) as the step compiles them: shapes, dtypes and shardings (memory kinds included;
        the plan's where a state leaf has none; the step's own for the batch, as `step` reshards it).
        Either may be concrete or abstract; no data moves."""
        state_abs = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(
            x, "sharding", None) or s), state, self.state_shardings)
        return state_abs, self.batch_layout.abstract(batch)

    def memory_report(self, state, batch, by: str = "category"):
        """Per-device memory of the compiled step: by category beside ZeRO's theory (`memory.py`), or
        `by="layer"`: every byte XLA reserves charged to a layer and a category (`explain.py`)."""
        if by == "layer":
            from zeroflax.explain import layer_report
            return layer_report(self, state, batch)
        if by != "category":
            raise ValueError(f"memory_report(by={by!r}): 'category' or 'layer'")
        from zeroflax.memory import memory_report
        return memory_report(self, state, batch)

    def comm_report(self, state, batch, phase: str | None = None):
        """Collective bytes of the step of `phase` (default: the steady state; `phases` lists them)."""
        from zeroflax.comm import comm_report
        return comm_report(self, state, batch, phase)


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
    train_batch_size = config.resolve_train_batch(mesh.shape[DATA_AXIS])
    base_rng = jax.random.PRNGKey(config.seed) if rng is None else rng
    init_rng, step_rng = jax.random.split(base_rng)

    if callable(params):
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
    if callable(params):
        def init_all(*args):
            tree, state_tree = _split_variables(init_fn(*args), collections)
            return unbox(tree)[0], (unbox(state_tree)[0] if collections else None)
        init_params, init_state = jax.jit(init_all, out_shardings=(plan.params, state_sharding))(*init_args)
    else:
        # A fresh copy: the step donates its state, and the caller keeps their arrays.
        init_params, init_state = jax.jit(lambda tree, st: (tree, st), out_shardings=(plan.params, state_sharding))(
            params, unbox(state_tree)[0] if collections else None)
    opt_state = jax.jit(optimizer.init, out_shardings=plan.opt_state)(init_params)
    pending = sync_state = None
    if engine.onebit is not None:
        sync_state = jax.jit(engine.onebit.init_state, out_shardings=engine.state_shardings.sync_state)()
    if config.offload_optimizer.delayed_update:
        zeros = lambda: jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), abstract_params)
        pending = jax.jit(zeros, out_shardings=plan.host_grads)()
    state = TrainState(
        step=jnp.asarray(0, jnp.int32),
        params=init_params,
        opt_state=opt_state,
        loss_scale=init_loss_scale(config.loss_scale, config.precision == "fp16"),
        rng=step_rng,
        model_state=init_state,
        pending_grads=pending,
        sync_state=sync_state,
    )
    state = engine.with_compute_copy(state)
    state = engine.storage_order(jax.device_put(state, engine.state_shardings))
    return engine, state
