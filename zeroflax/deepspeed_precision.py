"""DeepSpeed's `fp16` and `bf16` (or `bfloat16`) blocks -> Config.precision and, for fp16, LossScaleConfig.

"enabled": "auto" takes the precision of gin or the base Config (Hugging Face takes --fp16 / --bf16); the
fp16 block's loss-scaler keys are LossScaleConfig's fields, whose defaults are DeepSpeed's.
"""
from __future__ import annotations

from zeroflax.config import Config, ConfigError, LossScaleConfig
from zeroflax.deepspeed_keys import as_block, as_bool, as_int, as_number, check_block
from zeroflax.deepspeed_settings import AUTO, Settings


def read_precision(ds: dict, settings: Settings, base: Config | None, notes: list) -> str:
    fp16 = as_block(ds.get("fp16", {}), "fp16")
    if "bf16" in ds and "bfloat16" in ds:
        raise ConfigError("bfloat16", "given together with bf16 (its new name)", "keep bf16")
    bf16_key = "bfloat16" if "bfloat16" in ds else "bf16"
    bf16 = as_block(ds.get(bf16_key, {}), bf16_key)
    check_block(fp16, "fp16", notes)
    check_block(bf16, bf16_key, notes)

    def enabled(block, name, path):
        value = block.get("enabled", False)
        if value == AUTO:  # Hugging Face: from --fp16 / --bf16; here from the base Config (gin's Config)
            precision = settings.bound.get("Config.precision", base.precision if base else None)
            if precision is None:
                raise ConfigError(path, "'auto' needs the precision from somewhere",
                                  "write true or false, or pass base=Config(precision=...)")
            notes.append(f"{path}: 'auto' resolved to {precision == name} (precision {precision!r})")
            return precision == name
        return as_bool(value, path)

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
            value = fp16.get(field, AUTO)
            written = field in fp16 and value != AUTO
            settings.set(f"LossScaleConfig.{field}", read(value, path) if written else default, path, written)
    return precision
