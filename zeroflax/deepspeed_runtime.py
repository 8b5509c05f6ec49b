"""DeepSpeed's top-level training keys (those its runtime/config.py reads itself) -> Config fields.

The batch sizes (train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps, by
DeepSpeed's batch rule over the data-parallel size), gradient_clipping, the activation_checkpointing block
(Config.remat) and tensor_parallel.autotp_size (the mesh's tensor axis).
"""
from __future__ import annotations

from zeroflax.axes import SEQUENCE_AXIS, TENSOR_AXIS
from zeroflax.config import ConfigError
from zeroflax.deepspeed_keys import as_block, as_bool, as_int, as_number, check_block
from zeroflax.deepspeed_settings import Settings


def read_batch(ds: dict, settings: Settings, data_size: int, notes: list) -> None:
    """DeepSpeed's rule (runtime/config.py, _set_batch_related_parameters): any two of train_batch_size,
    train_micro_batch_size_per_gpu, gradient_accumulation_steps give the third; train_batch_size alone means
    no accumulation; micro alone means train = micro x world; then train == micro x accumulation x world.
    "auto" and a JSON without batch sizes were resolved before (deepspeed_auto.py); a key the JSON leaves
    out takes gin's binding, if any, before the rule derives it."""
    names = {"train_batch_size": "Config.train_batch_size", "train_micro_batch_size_per_gpu": "Config.micro_batch_size",
             "gradient_accumulation_steps": "Config.grad_accum_steps"}
    given: dict[str, int | None] = {}
    written: dict[str, bool] = {}
    for key, name in names.items():
        value = ds.get(key)
        written[key] = value is not None
        if value is None:
            value = settings.bound.get(name)
            if value is not None:
                notes.append(f"{key}: absent, {value} from gin's {name}")
        else:
            value = as_int(value, key, 1)
        given[key] = value
    train, micro, accum = (given[k] for k in names)
    n = data_size
    if train is not None and micro is not None and accum is not None:
        pass  # all three given: their product is checked below
    elif train is not None and micro is not None:
        accum = train // micro // n
    elif train is not None and accum is not None:
        micro = train // n // accum
    elif micro is not None and accum is not None:
        train = micro * accum * n
    elif train is not None:
        accum, micro = 1, train // n
    elif micro is not None:
        train, accum = micro * n, 1
    else:  # unreachable from from_deepspeed, which fills the micro-batch when both are absent
        raise ConfigError("train_batch_size", "neither train_batch_size nor train_micro_batch_size_per_gpu is given",
                          "write train_micro_batch_size_per_gpu")
    if micro < 1 or accum < 1:
        shown = " x ".join(f"{k} {given[k]}" for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
                           if written[k])
        raise ConfigError("train_batch_size", f"{train} is less than {n} data-parallel devices"
                          + (f" x {shown}" if shown else "") + ": each device would get less than one example",
                          f"pass world_size= (the number of GPUs the JSON was written for, at most {train}), "
                          "or write train_micro_batch_size_per_gpu")
    if train != micro * accum * n:
        raise ConfigError("train_batch_size", f"{train} != train_micro_batch_size_per_gpu {micro} x "
                          f"gradient_accumulation_steps {accum} x {n} data-parallel devices",
                          "change one of them, or pass world_size= (the world size the JSON was written for)")
    for key, value in zip(names, (train, micro, accum)):
        settings.set(names[key], value, key, written[key])


def read_clipping(ds: dict, settings: Settings, notes: list) -> None:
    value = ds.get("gradient_clipping", None)
    if value is None:  # DeepSpeed clips at 1.0 unless told otherwise (GRADIENT_CLIPPING_DEFAULT)
        clip = settings.set("Config.grad_clip", 1.0, "gradient_clipping", written=False)
        if "Config.grad_clip" not in settings.bound:
            notes.append("gradient_clipping: absent, so 1.0, DeepSpeed's default since 0.19.3 (before, no clipping: "
                         "write 0 for that)")
        return clip
    settings.set("Config.grad_clip", as_number(value, "gradient_clipping"), "gradient_clipping")


def read_remat(ds: dict, settings: Settings, notes: list) -> str | None:
    """An activation_checkpointing block: DeepSpeed checkpoints each layer and recomputes it in the backward
    pass; Config.remat 'full' does that for each scanned layer and gather group. With cpu_checkpointing
    DeepSpeed keeps each checkpointed layer's inputs in host memory: 'offload_full'. Without the block the
    model decides in DeepSpeed (Megatron's --checkpoint-activations), so Config.remat stays as it is."""
    if "activation_checkpointing" not in ds:
        return None
    block = as_block(ds["activation_checkpointing"], "activation_checkpointing")
    check_block(block, "activation_checkpointing", notes)
    key = "activation_checkpointing.cpu_checkpointing"
    on_host = as_bool(block.get("cpu_checkpointing", False), key)
    return settings.set("Config.remat", "offload_full" if on_host else "full", key if on_host else "activation_checkpointing")


def read_sequence_parallel(ds: dict, settings: Settings, axes: dict, notes: list) -> dict:
    """DeepSpeed-Ulysses' `sequence_parallel_size`: the mesh's sequence axis. DeepSpeed's batch rule then divides
    by the data-parallel size alone (world / sequence), which is the mesh's data axis here too."""
    if "sequence_parallel_size" not in ds:
        return axes
    size = as_int(ds["sequence_parallel_size"], "sequence_parallel_size", 1)
    bound = settings.bound.get("MeshConfig.axes", {}).get(SEQUENCE_AXIS)
    if bound is not None and bound != size:
        raise ConfigError("sequence_parallel_size", f"gives a sequence axis of {size} but MeshConfig.axes is bound "
                          f"with sequence {bound} elsewhere (gin)", "remove one of the two, or make them agree")
    if size > 1:
        notes.append(f"sequence_parallel_size {size}: MeshConfig.axes['{SEQUENCE_AXIS}'] = {size}; attention by "
                     "Config.sequence_attention (DeepSpeed's is 'ulysses', the default)")
    return {**axes, SEQUENCE_AXIS: size} if size > 1 else {k: v for k, v in axes.items() if k != SEQUENCE_AXIS}


def read_tensor_parallel(ds: dict, settings: Settings, axes: dict, notes: list) -> dict:
    block = as_block(ds.get("tensor_parallel", {}), "tensor_parallel")
    check_block(block, "tensor_parallel", notes)
    if "autotp_size" in block:
        size = max(1, as_int(block["autotp_size"], "tensor_parallel.autotp_size", 0))
        bound = settings.bound.get("MeshConfig.axes", {}).get(TENSOR_AXIS)
        if bound is not None and bound != size:
            raise ConfigError("tensor_parallel.autotp_size", f"gives a tensor axis of {size} but MeshConfig.axes is "
                              f"bound with tensor {bound} elsewhere (gin)", "remove one of the two, or make them agree")
        axes = {**axes, TENSOR_AXIS: size}
    return axes
