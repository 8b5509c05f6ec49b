"""Every DeepSpeed config key zeroflax knows, and what becomes of it: the table behind `from_deepspeed`.

Each key (a JSON path) is one of
  * mapped: it becomes a zeroflax setting (deepspeed_config.py reads it; `MAPPED` says into what);
  * moot: accepted with a note, because it tunes something XLA (or zeroflax's runner) already decides:
    bucket sizes, stream overlap, memory defragmentation, logging hooks;
  * refused: a `ConfigError` whose fix says what to write instead, unless its value is one of the
    values listed as harmless (DeepSpeed's default, or a block with "enabled": false).
A key in none of them is unknown: an error naming the nearest known key, except at the top level, where
DeepSpeed ignores what it does not know and so does zeroflax, with a note, unless the key looks like a typo
of a known one (`check_block`, at the end, holds a block to the table; `check_params` a type-dependent block
to its key set; `as_int` and friends read values, each error keyed by the JSON path). docs/from_deepspeed.md shows
these tables (rendered by `render_markdown`; a test keeps the two equal). DeepSpeed's own key names and
defaults: deepspeed/runtime/constants.py, runtime/config.py, runtime/zero/config.py, zero/offload_config.py,
runtime/precision_config.py, runtime/activation_checkpointing/config.py, runtime/lr_schedules.py.
"""
from __future__ import annotations

import difflib
import math
from typing import Mapping

from zeroflax.config import ConfigError

DISABLED = "a block with enabled: false"  # accepted value of a refused block: it is switched off

_BATCH = "see 'Batch sizes' below"
_NO_PARAM_STREAM = "parameters are not streamed from NVMe (offload_param 'nvme' is read as 'none' beside offload_optimizer 'nvme')"
_LIBAIO = "libaio tuning: zeroflax's I/O threads use pread/pwrite with O_DIRECT (aio.thread_count sets how many)"
MAPPED: dict[str, str] = {
    "train_batch_size": "Config.train_batch_size (" + _BATCH + ")",
    "train_micro_batch_size_per_gpu": "Config.micro_batch_size (" + _BATCH + ")",
    "gradient_accumulation_steps": "Config.grad_accum_steps (" + _BATCH + ")",
    "gradient_clipping": "Config.grad_clip (DeepSpeed's default when absent: 1.0)",
    "fp16": "block: Config.precision = 'fp16' when enabled",
    "fp16.enabled": "Config.precision = 'fp16'",
    "fp16.loss_scale": "LossScaleConfig.loss_scale (0: dynamic)",
    "fp16.initial_scale_power": "LossScaleConfig.initial_scale_power",
    "fp16.loss_scale_window": "LossScaleConfig.loss_scale_window",
    "fp16.hysteresis": "LossScaleConfig.hysteresis",
    "fp16.consecutive_hysteresis": "LossScaleConfig.consecutive_hysteresis",
    "fp16.min_loss_scale": "LossScaleConfig.min_loss_scale",
    "bf16": "block: Config.precision = 'bf16' when enabled",
    "bf16.enabled": "Config.precision = 'bf16'",
    "bfloat16": "DeepSpeed's old name of the bf16 block",
    "bfloat16.enabled": "Config.precision = 'bf16'",
    "zero_optimization": "block (a bare true/false is DeepSpeed's old form: stage 1 / 0)",
    "zero_optimization.stage": "Config.zero_stage",
    "zero_optimization.stage3_param_persistence_threshold": "Config.persistence_threshold",
    "zero_optimization.param_persistence_threshold": "Config.persistence_threshold (field name of the key above)",
    "zero_optimization.stage3_prefetch_bucket_size": "Config.prefetch_bucket_size (ZeRO-3 gather groups)",
    "zero_optimization.prefetch_bucket_size": "Config.prefetch_bucket_size (field name of the key above)",
    "zero_optimization.stage3_max_live_parameters": "Config.max_live_parameters (prefetch only if both groups fit)",
    "zero_optimization.max_live_parameters": "Config.max_live_parameters (field name of the key above)",
    "zero_optimization.stage3_max_reuse_distance": "Config.max_reuse_distance (a shared parameter gathered once)",
    "zero_optimization.max_reuse_distance": "Config.max_reuse_distance (field name of the key above)",
    "zero_optimization.zero_quantized_weights": "Config.quantized_weights (ZeRO++ qwZ, int8 blocks)",
    "zero_optimization.offload_optimizer": "block: Config.offload_optimizer",
    "zero_optimization.offload_optimizer.device": "OffloadOptimizerConfig.device ('none', 'cpu', 'nvme')",
    "zero_optimization.offload_optimizer.nvme_path": "OffloadOptimizerConfig.nvme_path (device 'nvme')",
    "zero_optimization.offload_optimizer.buffer_count": "OffloadOptimizerConfig.buffer_count (device 'nvme')",
    "zero_optimization.sub_group_size": "OffloadOptimizerConfig.buffer_size with offload_optimizer 'nvme' (elements "
                                        "per streamed chunk); else moot: the offloaded update is one XLA program",
    "aio": "block: NVMe I/O (with offload_optimizer 'nvme')",
    "aio.thread_count": "OffloadOptimizerConfig.io_threads",
    "zero_optimization.offload_optimizer.pin_memory": "OffloadOptimizerConfig.pin_memory",
    "zero_optimization.offload_param": "block: Config.offload_param",
    "zero_optimization.offload_param.device": "OffloadParamConfig.device ('none', 'cpu'; 'nvme' is read as 'none' "
                                              "beside offload_optimizer 'nvme', else refused)",
    "zero_optimization.offload_param.pin_memory": "OffloadParamConfig.pin_memory",
    "zero_optimization.cpu_offload": "deprecated: true = offload_optimizer.device 'cpu'",
    "zero_optimization.cpu_offload_param": "deprecated: true = offload_param.device 'cpu'",
    "optimizer": "block: the returned optax optimizer (table 'Optimizers')",
    "optimizer.type": "Adam, AdamW -> optax Adam(W) with DeepSpeed's rules; Lamb -> zeroflax.optim.deepspeed_lamb; "
                      "OneBitAdam -> zeroflax.optim.onebit_adam",
    "optimizer.params": "the optimizer's hyper-parameters (table 'Optimizers')",
    "scheduler": "block: the returned schedule (table 'Schedulers')",
    "scheduler.type": "WarmupLR, WarmupDecayLR, WarmupCosineLR, LRRangeTest -> zeroflax.optim.schedules",
    "scheduler.params": "the schedule's parameters (table 'Schedulers')",
    "activation_checkpointing": "block present: Config.remat = 'full' (each layer recomputed in the backward pass)",
    "activation_checkpointing.cpu_checkpointing": "true: Config.remat = 'offload_full' (the layers' inputs kept in "
                                                  "pinned host memory until the backward pass)",
    "sparse_attention": "block: a zeroflax SparsityConfig for GPTConfig.sparsity (table 'Sparse attention')",
    "tensor_parallel": "block",
    "torch_autocast": "block: forward under torch.autocast with fp32 weights",
    "torch_autocast.enabled": "Config.precision = the dtype's, when true",
    "torch_autocast.dtype": "'bfloat16' -> 'bf16', 'float16' -> 'fp16' (absent: refused, torch's default is fp16 "
                            "without loss scaling)",
    "data_types": "block",
    "data_types.grad_accum_dtype": "noted: zeroflax accumulates gradients in fp32",
    "data_types.param_dtype": "checked against Config.precision, as DeepSpeed asserts",
    "tensor_parallel.autotp_size": "MeshConfig.axes['tensor'] (0 or 1: no tensor slicing)",
    "sequence_parallel_size": "MeshConfig.axes['sequence'] (DeepSpeed-Ulysses: Config.sequence_attention 'ulysses' "
                              "unless bound otherwise; 1: no sequence axis)",
}

_XLA_COMM = "XLA schedules and fuses the collectives itself"
MOOT: dict[str, str] = {
    # top level
    "steps_per_print": "progress is printed every TrainConfig.log_every steps",
    "wall_clock_breakdown": "no per-phase timers: time the step, or use zeroflax.comm_report / memory_report",
    "memory_breakdown": "zeroflax.memory_report gives the per-device bytes from the compiled step",
    "dump_state": "nothing to dump: print the Config",
    "disable_allgather": _XLA_COMM,
    "prescale_gradients": "gradients are averaged in fp32, so dividing before or after the reduction gives the same mean",
    "gradient_predivide_factor": "gradients are averaged in fp32, so the pre-division changes nothing",
    "communication_data_type": "gradients are reduced in fp32 (ZeRO-3 gathers use the compute dtype)",
    "seq_parallel_communication_data_type": "sequence-parallel collectives move the compute dtype",
    "sparse_gradients": "JAX gradients are dense arrays; an embedding's gradient is reduced like any other",
    "zero_allow_untested_optimizer": "every optax optimizer works with every ZeRO stage",
    "zero_force_ds_cpu_optimizer": "the offloaded update is the optax optimizer itself, run on the host",
    "graph_harvesting": "the whole step is one compiled XLA program",
    "compile": "the whole step is already compiled by XLA (DeepCompile's passes have no equivalent to switch)",
    "tensorboard": "zeroflax train writes TensorBoard events itself (TrainConfig.tensorboard)",
    "wandb": "not wired: metrics go to metrics.jsonl and TensorBoard",
    "csv_monitor": "metrics go to metrics.jsonl",
    "comet": "not wired: metrics go to metrics.jsonl and TensorBoard",
    "comms_logger": "zeroflax.comm_report lists every collective of the compiled step",
    "flops_profiler": "no FLOP profiler hook; use jax.jit(...).lower().cost_analysis()",
    "checkpoint": "orbax checkpoints; they restore at any stage or device count",
    "nebula": "orbax checkpoints (asynchronous with TrainConfig.async_checkpointing)",
    "datastates_ckpt": "orbax checkpoints (asynchronous with TrainConfig.async_checkpointing)",
    "dataloader_drop_last": "zeroflax's TokenLoader always yields full batches",
    "log_level": "zeroflax prints a few lines; JAX's logging is configured by JAX",
    "timers": "no throughput timers: zeroflax train prints tokens/s",
    "vocabulary_size": "only a tensor-core alignment warning in DeepSpeed",
    "use_data_before_expert_parallelism": "no expert parallelism",
    "allgather_size": "DeepSpeed's old zero_optimization: true form's bucket size; " + _XLA_COMM,
    "pipeline": "zeroflax's pipeline is the mesh's 'pipe' axis and Config.pipeline_schedule, set outside the JSON",
    # fp16 / bf16
    "fp16.auto_cast": "the engine casts parameters (hence activations) to the compute dtype itself",
    "bf16.immediate_grad_update": "the update runs once per step on the accumulated gradient",
    "bfloat16.immediate_grad_update": "the update runs once per step on the accumulated gradient",
    "bf16.check_grad_overflow": "only fp16 steps are skipped on a non-finite gradient; bf16 steps are always applied",
    "bfloat16.check_grad_overflow": "only fp16 steps are skipped on a non-finite gradient; bf16 steps are always applied",
    # zero_optimization
    "zero_optimization.contiguous_gradients": "XLA's buffer assignment lays out the gradients",
    "zero_optimization.reduce_scatter": "stages 1-3 reduce-scatter the gradient; stage 0 all-reduces",
    "zero_optimization.reduce_bucket_size": _XLA_COMM,
    "zero_optimization.use_multi_rank_bucket_allreduce": _XLA_COMM,
    "zero_optimization.allgather_partitions": "the updated shards are all-gathered in one collective per leaf",
    "zero_optimization.allgather_bucket_size": _XLA_COMM,
    "zero_optimization.overlap_comm": _XLA_COMM,
    "zero_optimization.load_from_fp32_weights": "checkpoints hold the fp32 master weights",
    "zero_optimization.elastic_checkpoint": "checkpoints restore at any stage or device count",
    "zero_optimization.cpu_offload_use_pin_memory": "deprecated; DeepSpeed ignores it too (use offload_*.pin_memory)",
    "zero_optimization.stage3_model_persistence_threshold": "only stage3_param_persistence_threshold is applied",
    "zero_optimization.model_persistence_threshold": "only stage3_param_persistence_threshold is applied",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "checkpoints can be restored whole on any layout",
    "zero_optimization.gather_16bit_weights_on_model_save": "checkpoints can be restored whole on any layout",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": "checkpoints can be restored whole on any layout",
    "zero_optimization.stage3_module_granularity_threshold": "gather groups follow stage3_prefetch_bucket_size",
    "zero_optimization.module_granularity_threshold": "gather groups follow stage3_prefetch_bucket_size",
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": "ZeRO-3 gathers are all-gathers",
    "zero_optimization.use_all_reduce_for_fetch_params": "ZeRO-3 gathers are all-gathers",
    "zero_optimization.stage3_allgather_sequential": _XLA_COMM,
    "zero_optimization.allgather_sequential": _XLA_COMM,
    "zero_optimization.ignore_unused_parameters": "an unused parameter simply gets a zero gradient",
    "zero_optimization.legacy_stage1": "one stage-1 implementation",
    "zero_optimization.round_robin_gradients": "the offloaded gradients move as one transfer per leaf",
    "zero_optimization.memory_efficient_linear": "remat (Config.remat) decides what the backward pass keeps",
    "zero_optimization.pipeline_loading_checkpoint": "checkpoints restore at any layout",
    "zero_optimization.override_module_apply": "no module hooks: parameters are created partitioned under jit",
    "zero_optimization.log_trace_cache_warnings": "no trace cache: the step is compiled once",
    "zero_optimization.enable_sanity_checks": "shapes and shardings are checked when the step is compiled",
    "zero_optimization.save_muon_momentum_buffer_in_memory": "no Muon optimizer",
    "zero_optimization.leaf_module": "gather groups follow stage3_prefetch_bucket_size",
    "zero_optimization.mics_hierarchical_params_gather": "no MiCS (refused when mics_shard_size is set)",
    "zero_optimization.offload_optimizer.pipeline_read": "the NVMe update always reads the next chunks ahead",
    "zero_optimization.offload_optimizer.pipeline_write": "the NVMe update always writes chunks behind",
    "zero_optimization.offload_optimizer.fast_init": "the NVMe file is preallocated and written once, chunk by chunk",
    "zero_optimization.offload_optimizer.super_offload": "the host update is one XLA program; no Superchip-specific path",
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": "XLA's host backend picks its threads",
    "zero_optimization.offload_param.nvme_path": _NO_PARAM_STREAM,
    "zero_optimization.offload_param.buffer_count": _NO_PARAM_STREAM,
    "zero_optimization.offload_param.buffer_size": _NO_PARAM_STREAM,
    "zero_optimization.offload_param.max_in_cpu": _NO_PARAM_STREAM,
    "aio.block_size": _LIBAIO, "aio.queue_depth": _LIBAIO, "aio.single_submit": _LIBAIO, "aio.overlap_events": _LIBAIO,
    "aio.intra_op_parallelism": _LIBAIO, "aio.use_gds": "no GPUDirect Storage: the chunks are updated on the host",
    # activation checkpointing
    "activation_checkpointing.partition_activations": "kept layer inputs are split over the tensor axis only "
                                                      "with Config.sequence_parallel",
    "activation_checkpointing.contiguous_memory_optimization": "XLA's buffer assignment places the kept activations",
    "activation_checkpointing.number_checkpoints": "sizes DeepSpeed's contiguous buffer; XLA's buffer assignment",
    "activation_checkpointing.synchronize_checkpoint_boundary": "no CUDA streams to synchronise",
    "activation_checkpointing.profile": "no per-checkpoint timers",
    "optimizer.legacy_fusion": "the update is one fused XLA program",
    "torch_autocast.lower_precision_safe_modules": "gradients are reduced in fp32",
    "data_types.buffer_dtype": "model_state collections keep the dtype the model gives them",
    # tensor parallel
    "tensor_parallel.tp_overlap_comm": _XLA_COMM,
    "tensor_parallel.dtype": "the compute dtype is Config.precision (fp16 / bf16 blocks)",
    "tensor_parallel.tp": "autotp_size sets the tensor axis",
    "tensor_parallel.tensor_parallel": "autotp_size sets the tensor axis",
    "tensor_parallel.partition_config": "what is sliced is Config.logical_rules (zeroflax.tensor_parallel in the model)",
    "tensor_parallel.preset_model": "what is sliced is Config.logical_rules (zeroflax.tensor_parallel in the model)",
    "tensor_parallel.injection_policy_tuple": "what is sliced is Config.logical_rules",
    "tensor_parallel.keep_module_on_host": "parameters are created partitioned under jit",
    "tensor_parallel.replace_with_kernel_inject": "inference kernels: not used in training",
    "tensor_parallel.kernel_inject": "inference kernels: not used in training",
}

REFUSED: dict[str, tuple[str, str, tuple]] = {
    # top level
    "managed_gradient_accumulation": ("the engine always accumulates grad_accum_steps micro-batches per step",
                                      "remove it (true is the default)", (True,)),
    "gradient_allreduce_op": ("gradients are averaged over the data axis", "use 'mean'", ("mean", "MEAN", "Mean")),
    "amp": ("NVIDIA Apex AMP has no JAX counterpart", "use the fp16 or bf16 block", (DISABLED,)),
    "autotuning": ("no autotuner", "remove the block; zeroflax.memory_report shows the memory of a configuration",
                   (DISABLED,)),
    "eigenvalue": ("no eigenvalue estimation", "remove the block", (DISABLED,)),
    "progressive_layer_drop": ("progressive layer drop is not built", "remove the block", (DISABLED,)),
    "curriculum_learning": ("curriculum learning is not built", "remove the block", (DISABLED,)),
    "data_efficiency": ("DeepSpeed's data efficiency library is not built", "remove the block", (DISABLED,)),
    "compression_training": ("compression training (quantization-aware, pruning) is not built", "remove the block", ()),
    "quantize_training": ("MoQ quantize-aware training is not built", "remove the block", (DISABLED,)),
    "weight_quantization": ("inference weight quantization; zeroflax trains", "remove the block", ()),
    "hybrid_engine": ("DeepSpeed-Chat's hybrid engine is not built", "remove the block", (DISABLED,)),
    "elasticity": ("elastic batch sizes are not built", "write the batch keys instead", (DISABLED,)),
    "expert_parallel": ("no mixture-of-experts parallelism", "remove the block", ()),
    "data_parallel_size": ("the data-parallel size is the mesh's data axis (from_deepspeed's world_size)",
                           "remove it", ()),
    # fp16 / bf16
    "fp16.fp16_master_weights_and_grads": ("master weights and gradients stay fp32", "set it false", (False,)),
    "bf16.bf16_master_weights_and_grads": ("master weights and gradients stay fp32", "set it false", (False,)),
    "bf16.bf16_optimizer_states": ("the optimizer state stays fp32", "set it false", (False,)),
    "bfloat16.bf16_master_weights_and_grads": ("master weights and gradients stay fp32", "set it false", (False,)),
    "bfloat16.bf16_optimizer_states": ("the optimizer state stays fp32", "set it false", (False,)),
    # zero_optimization
    "zero_optimization.zero_quantized_gradients": ("ZeRO++ qgZ (int8 gradient reduce-scatter) is not built",
                                                   "set it false", (False,)),
    "zero_optimization.zero_quantized_nontrainable_weights": ("all parameters are trained", "set it false", (False,)),
    "zero_optimization.zeropp_loco_param": ("LoCo belongs to qgZ, which is not built", "remove it", (None,)),
    "zero_optimization.zero_hpz_partition_size": ("ZeRO++ hpZ (a secondary intra-node partition) is not built",
                                                  "use 1", (1,)),
    "zero_optimization.mics_shard_size": ("MiCS is not built: ZeRO shards over the whole data axis",
                                          "remove it (-1)", (-1,)),
    "zero_optimization.zenflow": ("ZenFlow is not built", "remove the block; delayed updates are "
                                  "OffloadOptimizerConfig.delayed_update", (None,)),
    "zero_optimization.offload_optimizer.ratio": ("partial offload is not built: all of the optimizer state or none "
                                                  "of it", "use 1.0", (1, 1.0)),
}

# The keys DeepSpeed's readers take for each optimizer, scheduler and sparse-attention mode, with DeepSpeed's
# defaults (None: required, or "the optimizer's lr"); deepspeed_config.py maps them.
ADAM_PARAMS = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "bias_correction": True,
               "adam_w_mode": True, "torch_adam": False, "amsgrad": False}
ADAM_MOOT = {"set_grad_none": "optax keeps no gradient buffers",
             "fp32_optimizer_states": "the optimizer state is fp32 (false is refused)",
             "foreach": "torch kernel choice", "fused": "torch kernel choice", "capturable": "torch CUDA graphs",
             "differentiable": "torch autograd through the step", "maximize": "false only (true is refused)"}
ONEBIT_PARAMS = {"lr": 1e-3, "freeze_step": 100000, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                 "amsgrad": False}
ONEBIT_MOOT = {"bias_correction": "DeepSpeed's 1-bit Adam never applies bias correction, whatever this says",
               "eps_inside_sqrt": "DeepSpeed's 1-bit Adam ignores it: eps is added outside the square root",
               "cuda_aware": "collectives are XLA's", "comm_backend_name": "collectives are XLA's"}
ONEBIT_LAMB_PARAMS = {"lr": 1e-3, "freeze_step": 100000, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0,
                      "max_coeff": 10.0, "min_coeff": 0.01, "coeff_beta": 0.9, "factor_max": 4.0, "factor_min": 0.5,
                      "factor_threshold": 0.1, "amsgrad": False}
ONEBIT_LAMB_MOOT = {"bias_correction": "DeepSpeed's 1-bit LAMB never applies bias correction, whatever this says",
                    "eps_inside_sqrt": "DeepSpeed's 1-bit LAMB ignores it: eps is added outside the square root",
                    "cuda_aware": "collectives are XLA's", "comm_backend_name": "collectives are XLA's"}
ZERO_ONE_PARAMS = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "var_freeze_step": 100000,
                   "var_update_scaler": 16, "local_step_scaler": 32678, "local_step_clipper": 16, "amsgrad": False}
ZERO_ONE_MOOT = {"bias_correction": "DeepSpeed's 0/1 Adam never applies bias correction, whatever this says",
                 "eps_inside_sqrt": "DeepSpeed's 0/1 Adam ignores it: eps is added outside the square root",
                 "cuda_aware": "collectives are XLA's", "comm_backend_name": "collectives are XLA's"}
LAMB_PARAMS = {"lr": 1e-3, "bias_correction": True, "betas": [0.9, 0.999], "eps": 1e-8, "eps_inside_sqrt": False,
               "weight_decay": 0.0, "max_coeff": 10.0, "min_coeff": 0.01, "amsgrad": False}
SCHEDULER_PARAMS = {
    "WarmupLR": {"warmup_min_lr": 0.0, "warmup_max_lr": None, "warmup_num_steps": 1000, "warmup_type": "log",
                 "last_batch_iteration": -1},
    "WarmupDecayLR": {"total_num_steps": None, "warmup_min_lr": 0.0, "warmup_max_lr": 0.001,
                      "warmup_num_steps": 1000, "warmup_type": "log", "last_batch_iteration": -1},
    "WarmupCosineLR": {"total_num_steps": None, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log", "last_batch_iteration": -1},
    "LRRangeTest": {"lr_range_test_min_lr": 1e-3, "lr_range_test_step_size": 2000, "lr_range_test_step_rate": 1.0,
                    "lr_range_test_staircase": False, "last_batch_iteration": -1},
    "OneCycle": {"cycle_min_lr": None, "cycle_max_lr": None, "decay_lr_rate": 0.0, "cycle_first_step_size": 2000,
                 "cycle_second_step_size": None, "cycle_first_stair_count": 0, "cycle_second_stair_count": None,
                 "decay_step_size": 0, "cycle_momentum": True, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
                 "decay_mom_rate": 0.0, "last_batch_iteration": -1},
}
# DeepSpeed's config reader (runtime/config.py get_sparse_*_config) reads these keys per mode, with these
# defaults; note BigBird's num_random_blocks default 0 (the class's own default is 1). 'attention' for bigbird
# and bslongformer is zeroflax's addition: DeepSpeed's reader does not read it (its class default is
# bidirectional).
_ATT = {"attention": "bidirectional"}
SPARSE_MODES = {
    "dense": ("DenseSparsityConfig", {"block": 16}),
    "fixed": ("FixedSparsityConfig", {"block": 16, "different_layout_per_head": False, "num_local_blocks": 4,
                                      "num_global_blocks": 1, **_ATT, "horizontal_global_attention": False,
                                      "num_different_global_patterns": 1}),
    "variable": ("VariableSparsityConfig", {"block": 16, "different_layout_per_head": False, "num_random_blocks": 0,
                                            "local_window_blocks": [4], "global_block_indices": [0],
                                            "global_block_end_indices": None, **_ATT,
                                            "horizontal_global_attention": False}),
    "bigbird": ("BigBirdSparsityConfig", {"block": 16, "different_layout_per_head": False, "num_random_blocks": 0,
                                          "num_sliding_window_blocks": 3, "num_global_blocks": 1, **_ATT}),
    "bslongformer": ("BSLongformerSparsityConfig", {"block": 16, "different_layout_per_head": False,
                                                    "num_sliding_window_blocks": 3, "global_block_indices": [0],
                                                    "global_block_end_indices": None, **_ATT}),
}
OPTIMIZERS_REFUSED = {
    "adagrad": "torch's Adagrad adds eps outside the square root and starts its accumulator at 0; not built",
    "lion": "not mapped (optax.lion is DeepSpeed's Lion: pass it as your own optimizer)",
    "muadam": "muP optimizers are not built", "muadamw": "muP optimizers are not built",
    "musgd": "muP optimizers are not built", "muon": "Muon is not built",
}
SCHEDULERS_REFUSED: dict[str, str] = {}  # none at present; render_markdown and read_scheduler read it


def siblings(prefix: str) -> list[str]:
    """The known key names directly under `prefix` ('' for the top level)."""
    depth = prefix.count(".") + 1 if prefix else 0
    names = set()
    for table in (MAPPED, MOOT, REFUSED):
        for path in table:
            parts = path.split(".")
            if len(parts) == depth + 1 and ".".join(parts[:depth]) == prefix:
                names.add(parts[depth])
    return sorted(names)


def _rows(table: dict, render) -> list[str]:
    return [render(path, value) for path, value in table.items()]


def render_markdown() -> str:
    """The key tables of docs/from_deepspeed.md."""
    out = ["### Mapped keys", "", "| DeepSpeed key | zeroflax |", "|---|---|"]
    out += _rows(MAPPED, lambda p, v: f"| `{p}` | {v} |")
    out += ["", "### Accepted, not needed under XLA (each one adds a note to the result)", "",
            "| DeepSpeed key | why nothing needs doing |", "|---|---|"]
    out += _rows(MOOT, lambda p, v: f"| `{p}` | {v} |")
    out += ["", "### Refused (a ConfigError), unless set to a harmless value", "",
            "| DeepSpeed key | why | accepted values |", "|---|---|---|"]
    out += _rows(REFUSED, lambda p, v: f"| `{p}` | {v[0]}; {v[1]} | "
                 + (", ".join(f"`{a!r}`" if a is not DISABLED else a for a in v[2]) or "none") + " |")
    out += ["", "### Optimizers", "", "| `optimizer.type` | zeroflax | params (DeepSpeed's defaults) |",
            "|---|---|---|",
            "| `Adam`, `AdamW` (any case) | optax Adam, decoupled weight decay (AdamW) unless `adam_w_mode` is "
            "false for `Adam`; no bias correction if `bias_correction` is false | "
            + ", ".join(f"`{k}` {v!r}" for k, v in ADAM_PARAMS.items()) + "; moot: "
            + ", ".join(f"`{k}`" for k in ADAM_MOOT) + " |",
            "| `Lamb` | `zeroflax.optim.deepspeed_lamb`: FusedLamb's arithmetic (trust ratio of the uncorrected "
            "direction per leaf, clipped to [min_coeff, max_coeff]; bias correction as one scalar on the step) | "
            + ", ".join(f"`{k}` {v!r}" for k, v in LAMB_PARAMS.items()) + " |",
            "| `OneBitAdam`, `OnebitAdam` | `zeroflax.optim.onebit_adam` | "
            + ", ".join(f"`{k}` {v!r}" for k, v in ONEBIT_PARAMS.items()) + "; moot: "
            + ", ".join(f"`{k}`" for k in ONEBIT_MOOT) + " |",
            "| `OneBitLamb`, `OnebitLamb` | `zeroflax.optim.onebit_lamb` | "
            + ", ".join(f"`{k}` {v!r}" for k, v in ONEBIT_LAMB_PARAMS.items()) + "; moot: "
            + ", ".join(f"`{k}`" for k in ONEBIT_LAMB_MOOT) + " |",
            "| `ZeroOneAdam` | `zeroflax.optim.zero_one_adam` | "
            + ", ".join(f"`{k}` {v!r}" for k, v in ZERO_ONE_PARAMS.items()) + "; moot: "
            + ", ".join(f"`{k}`" for k in ZERO_ONE_MOOT) + " |"]
    out += [f"| `{k}` | refused: {v} | |" for k, v in OPTIMIZERS_REFUSED.items()]
    out += ["", "### Schedulers", "", "| `scheduler.type` | zeroflax.optim.schedules | params (DeepSpeed's defaults; "
            "None: required, or the optimizer's lr for warmup_max_lr) |", "|---|---|---|"]
    out += [f"| `{k}` | `{_SCHEDULE_FUNCTIONS[k]}` | " + ", ".join(f"`{p}` {d!r}" for p, d in v.items()) + " |"
            for k, v in SCHEDULER_PARAMS.items()]
    out += [f"| `{k}` | refused: {v} | |" for k, v in SCHEDULERS_REFUSED.items()]
    out += ["", "### Sparse attention", "", "| `sparse_attention.mode` | zeroflax.kernels class | keys (DeepSpeed's "
            "reader defaults) |", "|---|---|---|"]
    out += [f"| `{mode}` | `{cls}` | " + ", ".join(f"`{k}` {v!r}" for k, v in keys.items()) + " |"
            for mode, (cls, keys) in SPARSE_MODES.items()]
    return "\n".join(out) + "\n"


_SCHEDULE_FUNCTIONS = {"WarmupLR": "warmup_lr", "WarmupDecayLR": "warmup_decay_lr",
                       "WarmupCosineLR": "warmup_cosine_lr", "LRRangeTest": "lr_range_test", "OneCycle": "one_cycle"}


# ------------------------------------------------------------------------- checking keys and reading values
def join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def as_int(v, path: str, minimum: int = 0, integral_float: bool = False) -> int:
    # DeepSpeed's pydantic blocks take 5e7 (a JSON float) for an int; its plain keys do not.
    if integral_float and isinstance(v, float) and v.is_integer():
        v = int(v)
    if not is_int(v) or v < minimum:
        raise ConfigError(path, f"must be an integer >= {minimum}, got {v!r}")
    return v


def as_number(v, path: str, minimum: float | None = 0.0) -> float:
    if not is_number(v) or (minimum is not None and v < minimum):
        bound = "" if minimum is None else f" >= {minimum:g}"
        raise ConfigError(path, f"must be a finite number{bound}, got {v!r}")
    return float(v)


def as_bool(v, path: str) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(path, f"must be true or false, got {v!r}")
    return v


def as_block(v, path: str) -> dict:
    if not isinstance(v, dict):
        raise ConfigError(path, f"must be a JSON object, got {v!r}")
    return v


# How alike (difflib's ratio) an unknown key and a known one must be for the error to name the known one as
# the likely typo. Misspellings in real configs score above 0.8 (persitence/persistence 0.98, reduce_bucket
# 0.84); an unrelated key's nearest match scores below 0.6 (Apex's fp16.opt_level against loss_scale: 0.42),
# and naming that one would send the user to the wrong setting.
TYPO_RATIO = 0.7


def _unknown(path: str, known: list[str]):
    prefix, _, key = path.rpartition(".")
    nearest = difflib.get_close_matches(key, known, n=1, cutoff=TYPO_RATIO)
    if nearest:
        fix = f"the nearest known key is {join(prefix, nearest[0])}"
    elif len(known) <= 12:
        fix = f"remove it; {prefix} takes {', '.join(sorted(known))}"
    else:
        fix = f"remove it; docs/from_deepspeed.md lists the keys of {prefix}"
    raise ConfigError(path, "unknown DeepSpeed key", fix)


def _unknown_top_level(key: str, known: list[str], notes: list) -> None:
    """DeepSpeed ignores a top-level key it does not know (runtime/config.py reads the keys it knows), so it
    becomes a note; one that looks like a typo of a known key (difflib ratio >= 0.8, e.g. gradient_clip) stays
    an error, since DeepSpeed would silently drop the setting the user meant."""
    nearest = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
    if nearest and not key.startswith("_"):
        raise ConfigError(key, "unknown DeepSpeed key", f"the nearest known key is {nearest[0]}: DeepSpeed would "
                          "ignore this one silently")
    notes.append(f"{key}: not a DeepSpeed key; ignored, as DeepSpeed ignores unknown top-level keys")


def _harmless(value, accepted) -> bool:
    for ok in accepted:
        if ok is DISABLED:
            if isinstance(value, dict) and value.get("enabled", False) is False:
                return True
        elif isinstance(ok, bool) or ok is None or isinstance(value, bool):
            if value is ok:
                return True
        elif value == ok and type(value) in (int, float, str) and type(ok) in (int, float, str):
            return True
    return False


def check_block(tree: dict, prefix: str, notes: list) -> None:
    """Every key of `tree` (the block at `prefix`) is known: moot keys add a note, refused keys raise unless
    harmless, unknown keys raise naming the nearest known one. Mapped keys are read by the caller."""
    known = siblings(prefix)
    for key, value in tree.items():
        path = join(prefix, key)
        if path in MOOT:
            notes.append(f"{path}: accepted, nothing to do under XLA: {MOOT[path]}")
        elif path in REFUSED:
            why, fix, accepted = REFUSED[path]
            if not _harmless(value, accepted):
                raise ConfigError(path, f"refused: {why}", fix)
        elif path not in MAPPED:
            if prefix:
                _unknown(path, known)
            else:
                _unknown_top_level(key, known, notes)


def check_params(params: dict, prefix: str, takes: Mapping, moot: Mapping, notes: list, what: str) -> None:
    """A type-dependent block (optimizer.params, scheduler.params, sparse_attention): only `takes` and
    `moot` keys."""
    known = sorted(set(takes) | set(moot))
    for key in params:
        path = join(prefix, key)
        if key in moot:
            notes.append(f"{path}: accepted, nothing to do: {moot[key]}")
        elif key not in takes:
            nearest = difflib.get_close_matches(key, known, n=1, cutoff=TYPO_RATIO)
            fix = (f"the nearest key {what} takes is {join(prefix, nearest[0])}" if nearest else
                   f"remove it; {what} takes {', '.join(known)}")
            raise ConfigError(path, f"unknown key for {what}", fix)
