"""DeepSpeed's `fp16` and `bf16` (or `bfloat16`) blocks -> Config.precision and, for fp16, LossScaleConfig.

"auto" was resolved before (deepspeed_auto.py); the fp16 block's loss-scaler keys are LossScaleConfig's
fields, whose defaults are DeepSpeed's.
"""
from __future__ import annotations

from zeroflax.config import ConfigError, LossScaleConfig
from zeroflax.deepspeed_keys import as_block, as_bool, as_int, as_number, check_block
from zeroflax.deepspeed_settings import Settings


def read_precision(ds: dict, settings: Settings, notes: list) -> str:
    fp16 = as_block(ds.get("fp16", {}), "fp16")
    if "bf16" in ds and "bfloat16" in ds:
        raise ConfigError("bfloat16", "given together with bf16 (its new name)", "keep bf16")
    bf16_key = "bfloat16" if "bfloat16" in ds else "bf16"
    bf16 = as_block(ds.get(bf16_key, {}), bf16_key)
    check_block(fp16, "fp16", notes)
    check_block(bf16, bf16_key, notes)

    def enabled(block, name, path):
        return as_bool(block.get("enabled", False), path)

    use_fp16, use_bf16 = enabled(fp16, "fp16", "fp16.enabled"), enabled(bf16, "bf16", f"{bf16_key}.enabled")
    if use_fp16 and use_bf16:
        raise ConfigError(f"{bf16_key}.enabled", "fp16 and bf16 are both enabled", "enable one of them")
    precision = "fp16" if use_fp16 else "bf16" if use_bf16 else "fp32"
    # Written: the JSON enables one explicitly (a bare "enabled": false leaves the precision to gin or fp32).
    written = (use_fp16 and fp16.get("enabled") is True) or (use_bf16 and bf16.get("enabled") is True)
    path = f"{bf16_key}.enabled" if use_bf16 else "fp16.enabled"
    precision = settings.set("Config.precision", precision, path, written=written)
    if precision == "fp16":
        fields = {"loss_scale": (lambda v, p: as_number(v, p, 0.0)),
                  "initial_scale_power": (lambda v, p: as_int(v, p, 0)),
                  "loss_scale_window": (lambda v, p: as_int(v, p, 1)),
                  "hysteresis": (lambda v, p: as_int(v, p, 1)),
                  "consecutive_hysteresis": as_bool,
                  "min_loss_scale": (lambda v, p: as_number(v, p, 0.0))}
        for field, read in fields.items():
            path, default = f"fp16.{field}", getattr(LossScaleConfig(), field)  # DeepSpeed's defaults are these
            value = fp16.get(field)
            written = field in fp16
            settings.set(f"LossScaleConfig.{field}", read(value, path) if written else default, path, written)
    return precision


# DeepSpeed's dtype names (its DtypeEnum) -> zeroflax's precision names.
DTYPES = {**dict.fromkeys(("fp32", "float32", "float", "torch.float32"), "fp32"),
          **dict.fromkeys(("fp16", "float16", "half", "torch.float16"), "fp16"),
          **dict.fromkeys(("bf16", "bfloat16", "torch.bfloat16"), "bf16")}


def _dtype(value, path: str) -> str:
    if value not in DTYPES:
        raise ConfigError(path, f"unknown dtype {value!r}", "use 'fp32', 'bf16' or 'fp16'")
    return DTYPES[value]


def read_autocast(ds: dict, settings: Settings, notes: list) -> str:
    """The torch_autocast block: DeepSpeed runs the forward pass under torch.autocast(dtype), the weights
    staying fp32: zeroflax's bf16 or fp16 compute with fp32 master weights. Returns the precision."""
    precision = settings.values["Config.precision"]
    block = as_block(ds.get("torch_autocast", {}), "torch_autocast")
    check_block(block, "torch_autocast", notes)
    if not as_bool(block.get("enabled", False), "torch_autocast.enabled"):
        return precision
    if block.get("dtype") is None:
        raise ConfigError("torch_autocast.dtype", "absent: torch then autocasts to its device's default (float16 on "
                          "CUDA) and DeepSpeed scales no loss", "write \"bfloat16\" (or \"float16\")")
    wanted = _dtype(block["dtype"], "torch_autocast.dtype")
    if wanted == "fp32":
        return precision
    if precision not in ("fp32", wanted):
        raise ConfigError("torch_autocast.dtype", f"{block['dtype']} with the {precision} block enabled",
                          "make them agree, or keep one")
    notes.append(f"torch_autocast: {block['dtype']} compute with fp32 weights is Config.precision {wanted!r} (master "
                 "weights, gradients and optimizer state fp32" + (", DeepSpeed's dynamic loss scaling with the fp16 "
                                                                   "block's defaults" if wanted == "fp16" else "") + ")")
    return settings.set("Config.precision", wanted, "torch_autocast.dtype")


def read_data_types(ds: dict, precision: str, notes: list) -> None:
    """The data_types block: the dtypes DeepSpeed accumulates gradients in and checks the parameters against.
    zeroflax accumulates in fp32 whatever the precision (at most twice a 16-bit buffer's bytes, never less
    exact), and its parameters' compute dtype is the precision."""
    block = as_block(ds.get("data_types", {}), "data_types")
    check_block(block, "data_types", notes)
    if "grad_accum_dtype" in block and block["grad_accum_dtype"] is not None:
        dtype = _dtype(block["grad_accum_dtype"], "data_types.grad_accum_dtype")
        notes.append(f"data_types.grad_accum_dtype: {block['grad_accum_dtype']}: "
                     + ("what zeroflax does" if dtype == "fp32" else
                        f"zeroflax accumulates in fp32 instead of {dtype} (twice the gradient buffer's bytes)"))
    if block.get("param_dtype") is not None:
        dtype = _dtype(block["param_dtype"], "data_types.param_dtype")
        if dtype != precision:  # DeepSpeed asserts the same (_assert_valid_mixed_precision_config)
            raise ConfigError("data_types.param_dtype", f"{block['param_dtype']}, but the precision is {precision} "
                              "(fp16 / bf16 blocks)", "make them agree, or remove it")
