"""DeepSpeed's `zero_optimization` block -> the ZeRO settings of Config and its offload sections.

stage -> Config.zero_stage; ZeRO-3's sizes (stage3_param_persistence_threshold, stage3_prefetch_bucket_size,
stage3_max_live_parameters, stage3_max_reuse_distance, or their names without stage3_) -> the Config fields
of those names ("auto" was resolved before, deepspeed_auto.py); zero_quantized_weights (ZeRO++ qwZ) -> Config.quantized_weights; offload_optimizer and
offload_param (and the old cpu_offload, cpu_offload_param) -> OffloadOptimizerConfig and OffloadParamConfig;
with device 'nvme', nvme_path, buffer_count, sub_group_size and aio.thread_count -> OffloadOptimizerConfig's
NVMe keys.
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
        if kind == "offload_param" and device == "nvme":
            # The parameters are not streamed from disk into the forward pass (OffloadParamConfig.device); beside
            # offload_optimizer 'nvme' their fp32 master shards are on disk already, and the device keeps its
            # compute-dtype shard, which DeepSpeed would have moved to NVMe as well.
            if settings.values.get("OffloadOptimizerConfig.device") != "nvme":
                raise ConfigError(f"{prefix}.device", "'nvme' streams the parameters from disk into the forward pass, "
                                  "which is not built; zeroflax keeps the master weights on disk only through "
                                  "offload_optimizer", "set zero_optimization.offload_optimizer.device 'nvme' (the "
                                  "device then keeps a compute-dtype 1/N shard), or offload_param.device 'cpu'")
            notes.append(f"{prefix}: 'nvme' read as 'none' beside offload_optimizer 'nvme': the fp32 master weights and "
                         "optimizer state are on disk; the device keeps its compute-dtype shard of the parameters "
                         "(2 bytes per parameter / N, which DeepSpeed would move to NVMe too)")
            settings.set(f"{cls.__name__}.device", "none", f"{prefix}.device", False)
            continue
        if device not in ("none", "cpu", "nvme"):
            raise ConfigError(f"{prefix}.device", f"unknown device {device!r}", "use 'none', 'cpu' or 'nvme'")
        short = cls.__name__
        written = "device" in block or legacy in zero
        settings.set(f"{short}.device", device, f"{prefix}.device", written)
        settings.set(f"{short}.pin_memory", as_bool(block.get("pin_memory", True), f"{prefix}.pin_memory"),
                     f"{prefix}.pin_memory", "pin_memory" in block)
        if device == "nvme":
            _read_nvme(ds, zero, block, prefix, settings, notes)
    if settings.values.get("OffloadOptimizerConfig.device") != "nvme":
        for path, present in (("zero_optimization.sub_group_size", "sub_group_size" in zero), ("aio", "aio" in ds)):
            if present:
                notes.append(f"{path}: accepted, nothing to do: it sizes DeepSpeed's NVMe swapping, and "
                             "offload_optimizer.device is not 'nvme'")
    return stage


def _read_nvme(ds: dict, zero: dict, block: dict, prefix: str, settings: Settings, notes: list) -> None:
    """offload_optimizer 'nvme': its path and buffers, sub_group_size (the elements DeepSpeed's optimizer swaps
    at once: our chunk) and the top-level aio block's thread count."""
    path = block.get("nvme_path")
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{prefix}.nvme_path", f"device 'nvme' needs a directory, got {path!r}",
                          "give the path of a directory on a local NVMe disk")
    settings.set("OffloadOptimizerConfig.nvme_path", path, f"{prefix}.nvme_path")
    count = as_int(block.get("buffer_count", 4), f"{prefix}.buffer_count", 2, integral_float=True)
    settings.set("OffloadOptimizerConfig.buffer_count", count, f"{prefix}.buffer_count", "buffer_count" in block)
    if "sub_group_size" in zero:
        size = as_int(zero["sub_group_size"], "zero_optimization.sub_group_size", 1, integral_float=True)
        settings.set("OffloadOptimizerConfig.buffer_size", size, "zero_optimization.sub_group_size")
        notes.append(f"zero_optimization.sub_group_size: {size:,} elements per streamed chunk, so the NVMe update's "
                     f"buffers take about {count} x {size:,} x 12 bytes = {count * size * 12 / 2**30:.1f} GiB of host "
                     "memory with Adam (OffloadOptimizerConfig.buffer_size)")
    aio = as_block(ds.get("aio", {}), "aio")
    check_block(aio, "aio", notes)
    if "thread_count" in aio:
        settings.set("OffloadOptimizerConfig.io_threads", as_int(aio["thread_count"], "aio.thread_count", 1,
                                                                 integral_float=True), "aio.thread_count")
