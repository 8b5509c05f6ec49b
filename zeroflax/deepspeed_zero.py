"""DeepSpeed's `zero_optimization` block -> the ZeRO settings of Config and its offload sections.

stage -> Config.zero_stage; ZeRO-3's sizes (stage3_param_persistence_threshold, stage3_prefetch_bucket_size,
stage3_max_live_parameters, stage3_max_reuse_distance, or their names without stage3_) -> the Config fields
of those names ("auto" was resolved before, deepspeed_auto.py); zero_quantized_weights (ZeRO++ qwZ) -> Config.quantized_weights; offload_optimizer and
offload_param (and the old cpu_offload, cpu_offload_param) -> OffloadOptimizerConfig and OffloadParamConfig.
"""
from __future__ import annotations

from zeroflax.config import ConfigError, OffloadOptimizerConfig, OffloadParamConfig
from zeroflax.deepspeed_keys import as_block, as_bool, as_int, check_block
from zeroflax.deepspeed_settings import Settings


def read_zero(ds: dict, settings: Settings, notes: list) -> int:
    zero = ds.get("zero_optimization", {})
    if isinstance(zero, bool):  # DeepSpeed's old form
        notes.append("zero_optimization: true/false is DeepSpeed's old form of stage 1/0")
        zero = {"stage": int(zero)}
    zero = as_block(zero, "zero_optimization")
    check_block(zero, "zero_optimization", notes)

    read_int = lambda v, p: as_int(v, p, 0, integral_float=True)
    stage = read_int(zero.get("stage", 0), "zero_optimization.stage")
    if stage > 3:
        raise ConfigError("zero_optimization.stage", f"must be 0, 1, 2 or 3, got {stage}")
    stage = settings.set("Config.zero_stage", stage, "zero_optimization.stage", "stage" in zero)

    # ZeRO-3's sizes: stage3_ names (DeepSpeed's aliases) or the field names.
    sizes = [("param_persistence_threshold", "Config.persistence_threshold", 100_000),
             ("prefetch_bucket_size", "Config.prefetch_bucket_size", 50_000_000),
             ("max_live_parameters", "Config.max_live_parameters", 1_000_000_000),
             ("max_reuse_distance", "Config.max_reuse_distance", 1_000_000_000)]
    for field, name, default in sizes:
        given = [k for k in (f"stage3_{field}", field) if k in zero]
        if len(given) == 2:
            raise ConfigError(f"zero_optimization.{field}", f"given twice, also as stage3_{field}", "keep one")
        path = f"zero_optimization.{given[0] if given else 'stage3_' + field}"
        value = read_int(zero[given[0]], path) if given else default
        settings.set(name, value, path, bool(given))

    quantized = zero.get("zero_quantized_weights", False)
    settings.set("Config.quantized_weights", as_bool(quantized, "zero_optimization.zero_quantized_weights"),
                 "zero_optimization.zero_quantized_weights", "zero_quantized_weights" in zero)

    for kind, legacy, cls in (("offload_optimizer", "cpu_offload", OffloadOptimizerConfig),
                              ("offload_param", "cpu_offload_param", OffloadParamConfig)):
        prefix = f"zero_optimization.{kind}"
        block = zero.get(kind)
        if legacy in zero:
            if as_bool(zero[legacy], f"zero_optimization.{legacy}") and block is not None:
                raise ConfigError(f"zero_optimization.{legacy}", f"given together with {kind}, which replaces it",
                                  f"keep {kind}")
            if zero[legacy]:
                notes.append(f"zero_optimization.{legacy}: deprecated, read as {kind}.device 'cpu'")
                block = {"device": "cpu"}
        block = as_block(block if block is not None else {}, prefix)
        check_block(block, prefix, notes)
        device = block.get("device", "none")
        if kind == "offload_param" and stage < 3 and device != "none":
            # DeepSpeed hands offload_param to its stage-3 objects only; below stage 3 it does nothing.
            notes.append(f"{prefix}: ignored at stage {stage}, as DeepSpeed ignores it below stage 3 (the "
                         "parameters stay on the device)")
            settings.set(f"{cls.__name__}.device", "none", f"{prefix}.device", False)
            continue
        if kind == "offload_param" and device == "cpu" and settings.values["OffloadOptimizerConfig.device"] == "none":
            # Without offload_optimizer, DeepSpeed's stage 3 keeps the fp32 master shards and the optimizer state
            # on the GPU and moves only its 16-bit copy of the shards to the host (zero/stage3.py). zeroflax keeps
            # no 16-bit copy: its gathers cast the master shard on the fly. The device holds the same bytes.
            notes.append(f"{prefix}: 'cpu' without offload_optimizer: DeepSpeed moves only its 16-bit copy of the "
                         "parameter shards to the host (master weights and optimizer state stay on the GPU); "
                         "zeroflax keeps no such copy (the gathers cast the master shard), so nothing moves and each "
                         "device holds what DeepSpeed's does: master shard + optimizer state")
            settings.set(f"{cls.__name__}.device", "none", f"{prefix}.device", False)
            continue
        if device == "nvme":
            raise ConfigError(f"{prefix}.device", "'nvme' (ZeRO-Infinity) is refused: JAX has no NVMe memory kind",
                              "use 'cpu'")
        if device not in ("none", "cpu"):
            raise ConfigError(f"{prefix}.device", f"unknown device {device!r}", "use 'none' or 'cpu'")
        short = cls.__name__
        written = "device" in block or legacy in zero
        settings.set(f"{short}.device", device, f"{prefix}.device", written)
        settings.set(f"{short}.pin_memory", as_bool(block.get("pin_memory", True), f"{prefix}.pin_memory"),
                     f"{prefix}.pin_memory", "pin_memory" in block)
    return stage
