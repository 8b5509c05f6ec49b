"""Typed, validated, gin-configurable configuration.

Every field is checked when the object is built; every failure raises `ConfigError` whose message
names the key (as it would be written in a gin file, e.g. `Config.zero_stage`) and what would fix it.
Checks that need the machine (device count) or the data (batch size) run in `initialize`.

Config and its sections live here, except ZeRO-Offload's two (config_offload.py); ConfigError, gin's
`configurable` and the field checks are in config_checks.py. Import all public names from here.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from zeroflax.axes import DATA_AXIS, PIPE_AXIS, SEQUENCE_AXIS, TENSOR_AXIS
from zeroflax.config_checks import ConfigError, configurable, is_int, require
from zeroflax.config_offload import OffloadOptimizerConfig, OffloadParamConfig

PRECISIONS = ("fp32", "bf16", "fp16")
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch", "offload_dots_no_batch", "offload_full")
# The policies that recompute each checkpointed block whole in the backward pass (the reports and the
# planner count that recomputation).
RECOMPUTE_WHOLE = ("full", "offload_full")
PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved")
SEQUENCE_ATTENTIONS = ("ulysses", "ring")  # zeroflax/sharding/sequence.py

# Logical axis name -> mesh axis (or None = not partitioned). A tensor-parallel layout is a change of
# this table, not of the model. The ZeRO data axis is added on top by the sharding policy.
DEFAULT_LOGICAL_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", None),
    ("layers", None),
    ("embed", None),
    ("vocab", TENSOR_AXIS),
    ("mlp", TENSOR_AXIS),
    ("heads", TENSOR_AXIS),
    ("kv", None),
    ("length", None),
    ("conv_in", None),
    ("conv_out", TENSOR_AXIS),
)


@configurable
@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Named mesh axes and their sizes, in mesh order. `-1` means "all remaining devices".

    `data` is the ZeRO (data-parallel) axis, `tensor` the tensor-slicing axis, an optional `pipe`
    axis (an explicit size) splits the stacked layers into pipeline stages, and an optional `sequence`
    axis splits each example's tokens (ZeRO then partitions over data x sequence; Config.sequence_attention).
    """

    axes: Mapping[str, int] = dataclasses.field(default_factory=lambda: {DATA_AXIS: -1, TENSOR_AXIS: 1})

    def __post_init__(self):
        axes = dict(self.axes)
        object.__setattr__(self, "axes", axes)
        require(DATA_AXIS in axes and TENSOR_AXIS in axes, "MeshConfig.axes",
                f"must name at least the axes '{DATA_AXIS}' and '{TENSOR_AXIS}', got {list(axes)}",
                f"e.g. {{'{DATA_AXIS}': -1, '{TENSOR_AXIS}': 1}}")
        for name, size in axes.items():
            require(isinstance(name, str) and name.isidentifier(), "MeshConfig.axes",
                    f"axis name {name!r} is not an identifier")
            require(is_int(size) and (size == -1 or size >= 1), f"MeshConfig.axes['{name}']",
                    f"size must be a positive integer or -1 (all remaining devices), got {size!r}")
        require(sum(size == -1 for size in axes.values()) <= 1, "MeshConfig.axes",
                "at most one axis may be -1 (all remaining devices)")

    def resolve(self, num_devices: int) -> dict[str, int]:
        """Axis sizes with `-1` filled in, checked against the number of devices."""
        fixed = math.prod(size for size in self.axes.values() if size != -1)
        if fixed > num_devices or num_devices % fixed:
            raise ConfigError("MeshConfig.axes",
                              f"the mesh {self.axes} needs {fixed} devices (or a multiple) but "
                              f"{num_devices} exist", "shrink an axis or set one axis to -1")
        sizes = {name: (num_devices // fixed if size == -1 else size) for name, size in self.axes.items()}
        if math.prod(sizes.values()) != num_devices:
            raise ConfigError("MeshConfig.axes",
                              f"the mesh {sizes} uses {math.prod(sizes.values())} of {num_devices} devices",
                              "make the sizes multiply to the device count or set one axis to -1")
        return sizes


@configurable
@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    """fp16 loss scaling: DeepSpeed's `fp16` block, key for key, run by DeepSpeed's `DynamicLossScaler` rule
    (the one its ZeRO optimizers use; zeroflax/optim/loss_scale.py, checked against traces of DeepSpeed's class).

    loss_scale: 0 for dynamic scaling, or a fixed scale that never changes.
    initial_scale_power: the dynamic scale starts at 2**initial_scale_power.
    loss_scale_window: W. On a good step, with `stable` = the good steps before it since the last overflow
        (or since the start), the scale doubles when stable > 0 and stable % W == 0: the step after W good
        ones, so with no overflow at steps W, 2W, ... (0-based), and after an overflow at step k at steps
        k + 1 + W, k + 1 + 2W, ...
    hysteresis: H, the overflow budget (it starts full). An overflow with more than 1 left uses one up;
        one with 1 left halves the scale (never below `min_loss_scale`). The budget refills to H when the
        scale doubles. (DeepSpeed accepts H < 1, which never halves; here it is refused.)
    consecutive_hysteresis: also refill the budget on every good step.
    min_loss_scale: the scale never drops below this; DeepSpeed's key is an integer (1.0 is accepted as 1).
        An overflow that finds the scale at this minimum with a budget of 1 stops a DeepSpeed run (an
        exception); a jitted step cannot raise, so zeroflax skips the step, keeps the scale, and counts it in
        `TrainState.loss_scale.min_scale_overflows`.
    """

    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0

    def __post_init__(self):
        k = "LossScaleConfig."
        number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        require(number(self.loss_scale) and self.loss_scale >= 0, k + "loss_scale",
                f"must be 0 (dynamic) or a positive fixed scale, got {self.loss_scale!r}")
        require(is_int(self.initial_scale_power) and 0 <= self.initial_scale_power <= 64,
                k + "initial_scale_power", f"must be an integer in [0, 64], got {self.initial_scale_power!r}")
        require(is_int(self.loss_scale_window) and self.loss_scale_window >= 1, k + "loss_scale_window",
                f"must be a positive integer, got {self.loss_scale_window!r}")
        require(is_int(self.hysteresis) and self.hysteresis >= 1, k + "hysteresis",
                f"must be a positive integer, got {self.hysteresis!r}")
        require(isinstance(self.consecutive_hysteresis, bool), k + "consecutive_hysteresis",
                f"must be True or False, got {self.consecutive_hysteresis!r}")
        require(number(self.min_loss_scale) and self.min_loss_scale > 0, k + "min_loss_scale",
                f"must be a number > 0, got {self.min_loss_scale!r}")
        require(float(self.min_loss_scale).is_integer(), k + "min_loss_scale",
                f"must be a whole number, got {self.min_loss_scale!r}",
                "DeepSpeed's fp16.min_loss_scale is an integer")


@configurable
@dataclasses.dataclass(frozen=True)
class Config:
    """Everything the engine needs besides the model, the loss and the optimizer.

    mesh: device mesh axes (see MeshConfig).
    zero_stage: 0 (plain data parallel), 1 (optimizer state sharded), 2 (+ gradients), 3 (+ parameters).
    precision: 'fp32', 'bf16' or 'fp16' compute; master parameters, gradients and optimizer state
        stay fp32. 'fp16' uses dynamic loss scaling (see `loss_scale`).
    micro_batch_size: examples per device per forward/backward pass.
    grad_accum_steps: micro-batches accumulated per optimizer step.
    train_batch_size: global examples per step; None derives it as
        micro_batch_size * grad_accum_steps * data-parallel size, otherwise it must equal that product.
    grad_clip: clip gradients to this global L2 norm; 0 disables clipping.
    persistence_threshold: leaves (per layer, for stacked layers) with fewer elements stay replicated
        (DeepSpeed's stage3_param_persistence_threshold).
    remat: activation checkpointing of each scanned layer: 'none', 'full' (save nothing),
        'dots' (save matmul outputs), 'dots_no_batch' (save matmul outputs without batch dims),
        'offload_dots_no_batch' (those outputs go to pinned host memory instead of staying on the device),
        'offload_full' ('full', with the blocks' inputs, which 'full' keeps on the device between the forward
        and the backward pass, in pinned host memory: DeepSpeed's cpu_checkpointing).
        With zero_stage 3, 'none' is refused: it would keep every layer's gathered weights.
    prefetch_bucket_size: ZeRO-3 gather groups (DeepSpeed's stage3_prefetch_bucket_size, in parameter
        elements): a module whose parameters number at most this is gathered as one group, its
        submodules with it; bigger modules are split into their submodules. Uses the placement pass
        finds outside modules (a tied head, a plain function's matmuls) join one group in program order
        while their parameters fit in this (docs/zero3.md); 0 makes each use a group.
    max_live_parameters: the most parameter elements gathered at once (DeepSpeed's
        stage3_max_live_parameters): the next group's gather is issued while the current group computes
        (prefetch) only if both fit in it; 0 never prefetches.
    max_reuse_distance: a ZeRO-3 parameter that several groups use (a shared embedding, a module called
        from several places) is gathered once, at its first use, and kept for the later ones and the
        backward pass, instead of at every use, when fewer than this many parameter elements are gathered
        by other groups between any two of its uses (DeepSpeed's stage3_max_reuse_distance); 0 never
        keeps one.
    quantized_weights: ZeRO++ qwZ: ZeRO-3 gathers move int8 blocks with one scale each, dequantized on
        arrival to the compute dtype; master weights and gradients stay fp32.
    quantization_block: elements per int8 block (and per scale) for quantized_weights.
    pipeline_schedule: with a `pipe` mesh axis larger than 1, how the micro-batches (grad_accum_steps
        of them) flow through the stages: 'gpipe' (all forwards, then all backwards), '1f1b'
        (DeepSpeed's TrainSchedule; at most S micro-batches in flight) or 'interleaved' (Megatron's
        interleaved 1F1B over pipeline_virtual_stages chunks per device). See docs/parallelism.md.
    pipeline_virtual_stages: chunks of layers per device for 'interleaved' (at least 2); 1 otherwise.
    sequence_parallel: Megatron's sequence parallelism: activations the model marks with
        `zeroflax.sequence_split` (a transformer's residual stream: norms, residual adds) are split along
        the sequence over the `tensor` axis; row-parallel outputs are reduce-scattered into them and
        all-gathered before the next column-parallel matmul. Needs a tensor axis larger than 1.
    sequence_attention: with a `sequence` mesh axis (each example's tokens split over its devices), how
        attention sees the whole sequence: 'ulysses' (DeepSpeed-Ulysses: all-to-all to a split over heads
        and back; any attention function; the heads must divide over the axis) or 'ring' (keys and values
        passed around the axis, blockwise softmax; no head divisibility). See zeroflax/sharding/sequence.py.
    offload_optimizer: ZeRO-Offload (see OffloadOptimizerConfig): master weights and optimizer state
        in host memory, the update on the host.
    offload_param: ZeRO-3 parameter offload (see OffloadParamConfig).
    logical_rules: logical axis name -> mesh axis name (or None), for leaves that carry logical names.
    data_axis_aliases: axis names a model written for `pmap` reduces over (`lax.pmean(x, 'batch')`, Flax's
        `BatchNorm(axis_name='batch')`, any Flax module's `axis_name` field): under the engine they mean
        the data axis, so sync BatchNorm averages its statistics over the data-parallel devices, unchanged.
    seed: seeds the per-step rng handed to the loss function.
    nonfinite: with 'fp32' or 'bf16' (fp16 has its loss scaler), what a step with a non-finite gradient
        (NaN, inf: bad data, a diverged loss) does; the engine reports it as metrics['nonfinite'].
        'error' (default): `zeroflax train` stops at its next log or checkpoint, naming the step, and
        writes nothing after it: its newest checkpoint is untouched. 'skip': the step keeps the old
        parameters and optimizer state (metrics['skipped']) and training goes on, counting such steps
        (`skipped_steps`); like fp16's loss scaling, it keeps the old and the new model states alive
        together during the update. Neither ever writes non-finite parameters into a checkpoint.
    deterministic_reductions: the gradient sync's sums over the data axis (ZeRO's reduce-scatters and
        all-reduces, 1-bit Adam's means of norms) add the devices' values in the order of their indices
        (`zeroflax.sharding.ordered`) instead of the collective library's order, so that a run gives the
        same bits on 1 process x 8 devices as on 2 x 4. Same bytes moved; the sums cannot overlap the
        transfers. The gradient norm is then measured (and the gradient clipped) in the sync, and the loss
        and model state's means over `data` are ordered too. Refused with ZeRO stage 3 (its reduce-scatter
        is inside the backward pass), fp16, offload, and any mesh axis but `data` larger than 1.
    """

    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    zero_stage: int = 0
    precision: str = "fp32"
    micro_batch_size: int = 1
    grad_accum_steps: int = 1
    train_batch_size: int | None = None
    grad_clip: float = 0.0
    persistence_threshold: int = 100_000
    remat: str = "full"
    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    quantized_weights: bool = False
    quantization_block: int = 64
    loss_scale: LossScaleConfig = dataclasses.field(default_factory=LossScaleConfig)
    pipeline_schedule: str = "1f1b"
    pipeline_virtual_stages: int = 1
    sequence_parallel: bool = False
    sequence_attention: str = "ulysses"
    offload_optimizer: OffloadOptimizerConfig = dataclasses.field(default_factory=OffloadOptimizerConfig)
    offload_param: OffloadParamConfig = dataclasses.field(default_factory=OffloadParamConfig)
    logical_rules: tuple = DEFAULT_LOGICAL_RULES
    data_axis_aliases: tuple = ("batch",)
    seed: int = 0
    nonfinite: str = "error"
    deterministic_reductions: bool = False

    def __post_init__(self):
        require(isinstance(self.mesh, MeshConfig), "Config.mesh",
                f"must be a MeshConfig, got {type(self.mesh).__name__}")
        require(isinstance(self.loss_scale, LossScaleConfig), "Config.loss_scale",
                f"must be a LossScaleConfig, got {type(self.loss_scale).__name__}")
        require(is_int(self.zero_stage) and self.zero_stage in (0, 1, 2, 3), "Config.zero_stage",
                f"must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        require(self.precision in PRECISIONS, "Config.precision",
                f"unknown precision {self.precision!r}", f"use one of {', '.join(PRECISIONS)}")
        require(self.nonfinite in ("error", "skip"), "Config.nonfinite",
                f"must be 'error' or 'skip', got {self.nonfinite!r}")
        require(isinstance(self.deterministic_reductions, bool), "Config.deterministic_reductions",
                f"must be True or False, got {self.deterministic_reductions!r}")
        require(not (self.deterministic_reductions and self.zero_stage == 3), "Config.deterministic_reductions",
                "orders the gradient sync's sums, but zero_stage 3 reduce-scatters inside the backward pass, "
                "where they are the collective library's", "use zero_stage 0, 1 or 2")
        require(not (self.deterministic_reductions and self.precision == "fp16"), "Config.deterministic_reductions",
                "measures the gradient norm in the sync, before fp16's loss scale is divided out, which is not built",
                "use 'bf16' or 'fp32'")
        others = [name for name, size in self.mesh.axes.items() if name != DATA_AXIS and size != 1]
        require(not (self.deterministic_reductions and others), "Config.deterministic_reductions",
                f"orders the sums over '{DATA_AXIS}' only, but the mesh axis {others[0] if others else ''!r} is "
                "not of size 1: its reductions (XLA's, the pipeline's) keep the collective library's order",
                "give every mesh axis but 'data' size 1, or set deterministic_reductions False")
        require(is_int(self.micro_batch_size) and self.micro_batch_size >= 1, "Config.micro_batch_size",
                f"must be a positive integer, got {self.micro_batch_size!r}")
        require(is_int(self.grad_accum_steps) and self.grad_accum_steps >= 1, "Config.grad_accum_steps",
                f"must be a positive integer, got {self.grad_accum_steps!r}", "use 1 for no accumulation")
        require(self.train_batch_size is None or (is_int(self.train_batch_size) and self.train_batch_size >= 1),
                "Config.train_batch_size", f"must be None or a positive integer, got {self.train_batch_size!r}")
        require(isinstance(self.grad_clip, (int, float)) and not isinstance(self.grad_clip, bool)
                and math.isfinite(self.grad_clip) and self.grad_clip >= 0, "Config.grad_clip",
                f"must be a finite number >= 0 (0 disables clipping), got {self.grad_clip!r}")
        require(is_int(self.persistence_threshold) and self.persistence_threshold >= 0,
                "Config.persistence_threshold", f"must be an integer >= 0, got {self.persistence_threshold!r}")
        require(self.remat in REMAT_POLICIES, "Config.remat", f"unknown remat policy {self.remat!r}",
                f"use one of {', '.join(REMAT_POLICIES)}")
        require(not (self.zero_stage == 3 and self.remat == "none"), "Config.remat",
                "'none' with zero_stage 3 would keep every layer's gathered weights until the backward pass",
                "use 'dots' (saves all matmul outputs, the closest to no remat) or 'full'")
        require(not (self.remat == "offload_full" and self.mesh.axes.get(PIPE_AXIS, 1) > 1), "Config.remat",
                "'offload_full' offloads the inputs of the layers the loss keeps, but a pipeline stage recomputes "
                "its layers from the stage's input and keeps none", "use 'full' with a pipe axis")
        require(is_int(self.prefetch_bucket_size) and self.prefetch_bucket_size >= 0, "Config.prefetch_bucket_size",
                f"must be an integer >= 0 (parameter elements per gather group), got {self.prefetch_bucket_size!r}")
        require(is_int(self.max_live_parameters) and self.max_live_parameters >= 0, "Config.max_live_parameters",
                f"must be an integer >= 0 (0: never prefetch), got {self.max_live_parameters!r}")
        require(is_int(self.max_reuse_distance) and self.max_reuse_distance >= 0, "Config.max_reuse_distance",
                f"must be an integer >= 0 (0: gather a shared parameter at every use), got {self.max_reuse_distance!r}")
        require(isinstance(self.quantized_weights, bool), "Config.quantized_weights",
                f"must be True or False, got {self.quantized_weights!r}")
        require(not (self.quantized_weights and self.zero_stage != 3), "Config.quantized_weights",
                f"quantizes ZeRO-3's parameter gathers, but zero_stage is {self.zero_stage}", "set zero_stage = 3")
        require(is_int(self.quantization_block) and 16 <= self.quantization_block <= 65536,
                "Config.quantization_block", f"must be an integer in [16, 65536], got {self.quantization_block!r}")
        require(is_int(self.seed), "Config.seed", f"must be an integer, got {self.seed!r}")
        require(self.pipeline_schedule in PIPELINE_SCHEDULES, "Config.pipeline_schedule",
                f"unknown pipeline schedule {self.pipeline_schedule!r}", f"use one of {', '.join(PIPELINE_SCHEDULES)}")
        require(is_int(self.pipeline_virtual_stages) and self.pipeline_virtual_stages >= 1,
                "Config.pipeline_virtual_stages", f"must be a positive integer, got {self.pipeline_virtual_stages!r}")
        interleaved = self.pipeline_schedule == "interleaved"
        require(interleaved == (self.pipeline_virtual_stages > 1), "Config.pipeline_virtual_stages",
                f"{self.pipeline_virtual_stages} virtual stages with the {self.pipeline_schedule!r} schedule: "
                "only 'interleaved' runs several chunks per device, and it needs at least 2",
                "set pipeline_schedule='interleaved' with pipeline_virtual_stages >= 2, or virtual stages 1")
        require(PIPE_AXIS not in self.mesh.axes or self.mesh.axes[PIPE_AXIS] != -1, f"MeshConfig.axes['{PIPE_AXIS}']",
                "the pipe axis needs an explicit size (the schedule depends on it)", f"e.g. {{'{PIPE_AXIS}': 2}}")
        stages = self.mesh.axes.get(PIPE_AXIS, 1)
        if stages > 1:
            M = self.grad_accum_steps
            require(not (self.pipeline_schedule == "1f1b" and M < stages), "Config.grad_accum_steps",
                    f"1f1b with {stages} stages needs at least {stages} micro-batches, got {M}",
                    f"set grad_accum_steps >= {stages} (more micro-batches shrink the bubble too), or use gpipe")
            require(not (interleaved and M % stages), "Config.grad_accum_steps",
                    f"the interleaved schedule needs micro-batches divisible by the {stages} stages, got {M}",
                    f"use a multiple of {stages}")
        require(isinstance(self.sequence_parallel, bool), "Config.sequence_parallel",
                f"must be True or False, got {self.sequence_parallel!r}")
        require(self.sequence_attention in SEQUENCE_ATTENTIONS, "Config.sequence_attention",
                f"unknown sequence attention {self.sequence_attention!r}", f"use one of {', '.join(SEQUENCE_ATTENTIONS)}")
        sequence = self.mesh.axes.get(SEQUENCE_AXIS, 1)
        require(not (self.sequence_parallel and sequence != 1), "Config.sequence_parallel",
                f"Megatron's sequence parallelism (over '{TENSOR_AXIS}') with a '{SEQUENCE_AXIS}' axis is not built",
                f"the '{SEQUENCE_AXIS}' axis splits the whole layer's activations already: set sequence_parallel False")
        require(isinstance(self.offload_optimizer, OffloadOptimizerConfig), "Config.offload_optimizer",
                f"must be an OffloadOptimizerConfig, got {type(self.offload_optimizer).__name__}")
        require(isinstance(self.offload_param, OffloadParamConfig), "Config.offload_param",
                f"must be an OffloadParamConfig, got {type(self.offload_param).__name__}")
        require(not (self.offload_optimizer.enabled and self.zero_stage == 0), "OffloadOptimizerConfig.device",
                "offloads the partitioned optimizer state, but zero_stage is 0", "set zero_stage to 1, 2 or 3")
        require(not (self.offload_param.enabled and self.zero_stage != 3), "OffloadParamConfig.device",
                f"offloads ZeRO-3's partitioned parameters, but zero_stage is {self.zero_stage}", "set zero_stage = 3")
        require(not (self.offload_param.enabled and self.offload_optimizer.on_disk), "OffloadParamConfig.device",
                "streams the fp32 master weights from host memory, but offload_optimizer keeps them on disk",
                "set offload_param 'none' (the device keeps a compute-dtype shard), or offload_optimizer 'cpu'")
        require(not (self.offload_param.enabled and not self.offload_optimizer.enabled), "OffloadParamConfig.device",
                "streams the fp32 master weights from the host, where only offload_optimizer keeps them",
                "set OffloadOptimizerConfig.device = 'cpu' too")
        require(not (self.offload_param.enabled and self.offload_param.pin_memory != self.offload_optimizer.pin_memory),
                "OffloadParamConfig.pin_memory", "the streamed parameters are the optimizer's master weights, which "
                f"use OffloadOptimizerConfig.pin_memory={self.offload_optimizer.pin_memory}", "set both alike")
        require(not (self.offload_param.enabled and self.offload_optimizer.predicts),
                "OffloadOptimizerConfig.delayed_update_prediction", "predicts the device's compute copy of the "
                "parameters, but offload_param streams them from the host's master weights, which are not predicted",
                "set delayed_update_prediction = 'none' (DeepSpeed's DPU), or offload_param 'none'")
        require(not (self.offload_param.enabled and stages > 1), "OffloadParamConfig.device",
                "streaming parameters into pipeline stages is not built", "use a pipe axis of 1, or offload_param 'none'")
        require(not (self.deterministic_reductions and self.offload_optimizer.enabled), "Config.deterministic_reductions",
                "measures the gradient norm in the sync, but the offloaded update measures its own",
                "set OffloadOptimizerConfig.device = 'none', or deterministic_reductions False")
        rules = tuple(tuple(rule) for rule in self.logical_rules)
        for rule in rules:
            require(len(rule) == 2 and isinstance(rule[0], str) and (rule[1] is None or isinstance(rule[1], str)),
                    "Config.logical_rules", f"each rule must be (logical_name, mesh_axis_or_None), got {rule!r}")
            require(rule[1] is None or rule[1] in self.mesh.axes, "Config.logical_rules",
                    f"rule {rule!r} maps to mesh axis {rule[1]!r}, which MeshConfig.axes does not define")
            require(rule[1] not in (DATA_AXIS, SEQUENCE_AXIS), "Config.logical_rules",
                    f"rule {rule!r} maps to '{rule[1]}'; the data and sequence axes are reserved for ZeRO partitioning")
        object.__setattr__(self, "logical_rules", rules)
        aliases = (self.data_axis_aliases,) if isinstance(self.data_axis_aliases, str) else self.data_axis_aliases
        require(isinstance(aliases, (tuple, list)) and all(isinstance(a, str) and a for a in aliases),
                "Config.data_axis_aliases", f"must be a tuple of axis names, got {self.data_axis_aliases!r}")
        clash = [a for a in aliases if a in self.mesh.axes]
        require(not clash, "Config.data_axis_aliases", f"{clash[0] if clash else ''!r} is a mesh axis already",
                "list only names the model uses that the mesh does not define")
        object.__setattr__(self, "data_axis_aliases", tuple(aliases))

    @property
    def host_memory_kind(self) -> str:
        """The memory kind of offloaded state."""
        return "pinned_host" if self.offload_optimizer.pin_memory else "unpinned_host"

    @property
    def compute_dtype(self):
        import jax.numpy as jnp
        return {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}[self.precision]

    def resolve_train_batch(self, data_parallel_size: int) -> int:
        """The global batch per optimizer step; checks it against micro-batch x accumulation x DP."""
        expected = self.micro_batch_size * self.grad_accum_steps * data_parallel_size
        if self.train_batch_size is not None and self.train_batch_size != expected:
            raise ConfigError(
                "Config.train_batch_size",
                f"{self.train_batch_size} != micro_batch_size ({self.micro_batch_size}) x grad_accum_steps "
                f"({self.grad_accum_steps}) x data-parallel size ({data_parallel_size}) = {expected}",
                "set train_batch_size to None to derive it, or change one of the factors")
        return expected

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
