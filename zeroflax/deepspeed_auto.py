"""'auto' in a DeepSpeed JSON, resolved in one place, before any block is read.

Hugging Face's Trainer and accelerate let a JSON say "auto" and replace each one with a value of their own
arguments before DeepSpeed sees the file. `resolve_auto` does the same on a copy of the JSON: every "auto"
of a key in `AUTO_KEYS` takes the first value it finds in

  1. gin's explicit bindings (`bound`: the CLI's `--gin_param Config.grad_clip = 0.5`),
  2. from_deepspeed's keywords (learning_rate=, ...; the CLI passes TrainConfig's fields),
  3. the `base` Config (the API's micro_batch_size, grad_accum_steps, grad_clip, precision, zero_stage),
  4. Hugging Face's defaults: its TrainingArguments' (per_device_train_batch_size 8, learning_rate 5e-5,
     max_grad_norm 1.0, ...) and, for what only accelerate fills, accelerate's (`HF_DEFAULTS`),

and the result carries one note that lists every value filled and where it came from. A value none of them
knows (total_num_steps "auto" with no total_steps=: Hugging Face counts it from the data set) is an error
that lists every such key at once. "auto" of a key whose value zeroflax does not use (moot keys such as
reduce_bucket_size) stays as it is.

The batch keys follow Hugging Face's rule: train_batch_size "auto" is micro-batch x accumulation x the
data-parallel size, and a JSON with neither train_batch_size nor train_micro_batch_size_per_gpu (accelerate
fills them) gets the micro-batch, and the accumulation if absent, the same way as "auto".
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Mapping

from zeroflax import deepspeed_keys as keys
from zeroflax.config import Config, ConfigError

AUTO = "auto"

# quantity -> (Hugging Face's value, the argument it comes from). None: no default (truly unknown here).
HF_DEFAULTS: dict[str, tuple[Any, str]] = {
    "micro_batch_size": (8, "TrainingArguments.per_device_train_batch_size"),
    "grad_accum_steps": (1, "TrainingArguments.gradient_accumulation_steps"),
    "grad_clip": (1.0, "TrainingArguments.max_grad_norm"),
    "precision": ("fp32", "TrainingArguments.fp16 and .bf16 (both False)"),
    "learning_rate": (5e-5, "TrainingArguments.learning_rate"),
    "weight_decay": (0.0, "TrainingArguments.weight_decay"),
    "betas": ((0.9, 0.999), "TrainingArguments.adam_beta1, adam_beta2"),
    "eps": (1e-8, "TrainingArguments.adam_epsilon"),
    "warmup_steps": (0, "TrainingArguments.warmup_steps"),
    "zero_stage": (2, "accelerate's DeepSpeedPlugin.zero_stage"),
    "offload_optimizer": ("none", "accelerate's DeepSpeedPlugin.offload_optimizer_device"),
    "offload_param": ("none", "accelerate's DeepSpeedPlugin.offload_param_device"),
    "total_steps": (None, "the number of training steps, which Hugging Face counts from the data set: pass "
                          "total_steps= (the CLI: TrainConfig.steps)"),
    "hidden_size": (None, "the model's hidden size: pass hidden_size="),
}
# quantity -> its gin name, where gin can bind it; a Config.* field the base Config gives too.
CONFIG_NAMES = {"micro_batch_size": "Config.micro_batch_size", "grad_accum_steps": "Config.grad_accum_steps",
                "grad_clip": "Config.grad_clip", "precision": "Config.precision", "zero_stage": "Config.zero_stage",
                "offload_optimizer": "OffloadOptimizerConfig.device", "offload_param": "OffloadParamConfig.device"}
# Blocks DeepSpeed reads with pydantic, which drops an "auto" it was not given a value for (the default applies).
DEFAULTED_BLOCKS = ("zero_optimization", "fp16", "bf16", "bfloat16", "tensor_parallel")


@dataclasses.dataclass(frozen=True)
class AutoSources:
    """The values "auto" can take, in order: gin's bindings, the keywords, the base Config, Hugging Face's."""

    bound: Mapping[str, Any]
    keywords: Mapping[str, Any]
    base: Config | None
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)  # how notes name each keyword
    stage: int = 0  # the JSON's ZeRO stage, once resolved (Hugging Face's ZeRO-3 sizes depend on it)

    def lookup(self, quantity: str) -> tuple[Any, str]:
        """(value, where it came from); value None when nothing knows it."""
        name = CONFIG_NAMES.get(quantity)
        if name is not None and name in self.bound:
            return self.bound[name], f"gin's {name}"
        if self.keywords.get(quantity) is not None:
            return self.keywords[quantity], self.labels.get(quantity, f"{quantity}=")
        if name is not None and name.startswith("Config.") and self.base is not None:
            return getattr(self.base, name.split(".", 1)[1]), f"the base {name}"
        value, source = HF_DEFAULTS[quantity]
        return value, (f"Hugging Face's default {source}" if value is not None else source)


def _hidden(fn: Callable[[int], int], name: str, default: int):
    """A ZeRO-3 size Hugging Face derives from the hidden size at stage 3 (below, DeepSpeed drops the "auto"
    and takes its default); gin's binding first, DeepSpeed's default when the hidden size is unknown (Hugging
    Face would stop; the size only tunes grouping and persistence)."""
    def resolve(sources: AutoSources):
        if name in sources.bound:
            return sources.bound[name], f"gin's {name}"
        if sources.stage != 3:
            return default, f"DeepSpeed's default: Hugging Face fills it at stage 3 only"
        h, where = sources.lookup("hidden_size")
        if h is None:
            return default, "DeepSpeed's default: no hidden size for Hugging Face's rule (pass hidden_size=)"
        return fn(h), f"Hugging Face's rule from the hidden size {h} ({where})"
    return resolve


def _from(quantity: str, convert: Callable = lambda v: v):
    def resolve(sources: AutoSources):
        value, where = sources.lookup(quantity)
        return (None if value is None else convert(value)), where
    return resolve


def _fixed(value, where: str):
    return lambda sources: (value, where)


def _bound_or(name: str, default):
    """gin's binding of `name`, else DeepSpeed's default (what DeepSpeed takes for a dropped "auto")."""
    def resolve(sources: AutoSources):
        return (sources.bound[name], f"gin's {name}") if name in sources.bound else (default, "DeepSpeed's default")
    return resolve


def _warmup(sources: AutoSources):
    """Hugging Face's warm-up steps; its default, 0, becomes 1: DeepSpeed >= 0.19.3 refuses 0 (lr_schedules.py
    validates it), and older DeepSpeed, which Hugging Face's default was written for, floored 0 at 2 warm-up
    steps, as it floors 1: the same schedule."""
    value, where = sources.lookup("warmup_steps")
    if value is not None and value < 1:
        return 1, f"{where} is {value}: 1 runs the 2-step warm-up DeepSpeed before 0.19.3 ran for 0, which it now refuses"
    return value, where


_ZERO3_SIZES = {
    "param_persistence_threshold": _hidden(lambda h: 10 * h, "Config.persistence_threshold", 100_000),
    "prefetch_bucket_size": _hidden(lambda h: int(0.9 * h * h), "Config.prefetch_bucket_size", 50_000_000),
    "max_live_parameters": _bound_or("Config.max_live_parameters", 1_000_000_000),
    "max_reuse_distance": _bound_or("Config.max_reuse_distance", 1_000_000_000),
}
# JSON path -> how its "auto" resolves. The batch sizes are resolved together (`_batch`).
AUTO_KEYS: dict[str, Callable[[AutoSources], tuple[Any, str]]] = {
    "gradient_clipping": _from("grad_clip", float),
    "fp16.enabled": _from("precision", lambda p: p == "fp16"),
    "bf16.enabled": _from("precision", lambda p: p == "bf16"),
    "bfloat16.enabled": _from("precision", lambda p: p == "bf16"),
    "amp.enabled": _fixed(False, "Hugging Face's default (its fp16 backend is torch's amp, not Apex)"),
    "zero_optimization.stage": _from("zero_stage"),
    "zero_optimization.offload_optimizer.device": _from("offload_optimizer"),
    "zero_optimization.offload_param.device": _from("offload_param"),
    **{f"zero_optimization.{prefix}{field}": fn for field, fn in _ZERO3_SIZES.items() for prefix in ("stage3_", "")},
    "optimizer.params.lr": _from("learning_rate"),
    "optimizer.params.betas": _from("betas", list),
    "optimizer.params.eps": _from("eps"),
    "optimizer.params.weight_decay": _from("weight_decay"),
    "scheduler.params.warmup_min_lr": _fixed(0.0, "Hugging Face's rule"),
    "scheduler.params.warmup_max_lr": _from("learning_rate"),
    "scheduler.params.warmup_num_steps": _warmup,
    "scheduler.params.total_num_steps": _from("total_steps"),
}
BATCH_KEYS = {"train_micro_batch_size_per_gpu": "micro_batch_size", "gradient_accumulation_steps": "grad_accum_steps"}


def _get(tree: dict, path: str):
    *blocks, key = path.split(".")
    for block in blocks:
        tree = tree.get(block) if isinstance(tree, dict) else None
        if not isinstance(tree, dict):
            return None
    return tree.get(key)


def _put(tree: dict, path: str, value) -> None:
    *blocks, key = path.split(".")
    for block in blocks:
        tree = tree[block]
    tree[key] = value


def _batch(ds: dict, sources: AutoSources, data_size: int, filled: list) -> None:
    """Hugging Face's batch rule on the three batch keys (see the module's docstring)."""
    missing_both = ds.get("train_batch_size") is None and ds.get("train_micro_batch_size_per_gpu") is None
    effective = {}
    for key, quantity in BATCH_KEYS.items():
        value = ds.get(key)
        if value == AUTO or (missing_both and value is None):
            was_absent = value is None
            value, where = sources.lookup(quantity)
            ds[key] = value
            filled.append((key, value, where + (", absent from the JSON" if was_absent else "")))
        effective[key] = value if value is not None else sources.lookup(quantity)[0]
    if ds.get("train_batch_size") == AUTO:
        for key, value in effective.items():  # the product needs numbers: name the key that is not one
            keys.as_int(value, key, 1)
        value = effective["train_micro_batch_size_per_gpu"] * effective["gradient_accumulation_steps"] * data_size
        ds["train_batch_size"] = value
        filled.append(("train_batch_size", value, f"micro-batch x accumulation x {data_size} data-parallel devices"))


def _defaulted(tree: dict, prefix: str, filled: list) -> None:
    """Drop every "auto" left in a block DeepSpeed validates with pydantic, as DeepSpeed does."""
    for key in list(tree):
        path = f"{prefix}.{key}"
        if tree[key] == AUTO:
            del tree[key]
            filled.append((path, "its default", "DeepSpeed drops 'auto' in this block"))
        elif isinstance(tree[key], dict):
            _defaulted(tree[key], path, filled)


def _ignored(path: str) -> bool:
    """Whether zeroflax reads nothing at `path`: a moot key or a key inside one, a refused block (its own check
    decides), an optimizer parameter that does nothing under XLA, a top-level key DeepSpeed does not know."""
    parts = path.split(".")
    prefixes = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    if any(p in keys.MOOT or p in keys.REFUSED for p in prefixes) or parts[0] not in keys.MAPPED:
        return True
    return prefixes[-2:-1] == ["optimizer.params"] and (parts[-1] in keys.ADAM_MOOT or parts[-1] in keys.ONEBIT_MOOT)


def _leftover(tree: dict, prefix: str, unknown: dict) -> None:
    """Every "auto" still in the JSON at a key zeroflax reads and no source knows: nothing fills it."""
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        if _ignored(path):
            continue
        if value == AUTO:
            unknown.setdefault(path, "nothing fills it: write a value")
        elif isinstance(value, dict):
            _leftover(value, path, unknown)


def resolve_auto(ds: dict, sources: AutoSources, data_size: int) -> tuple[dict, list[str]]:
    """(a copy of `ds` with every resolvable "auto" replaced, notes). Raises one ConfigError listing every
    "auto" that nothing resolves."""
    ds = copy.deepcopy(ds)
    filled: list[tuple[str, Any, str]] = []
    _batch(ds, sources, data_size, filled)
    unknown: dict[str, str] = {}  # JSON path -> why nothing fills it

    def fill(path, sources):
        if _get(ds, path) != AUTO:
            return
        value, where = AUTO_KEYS[path](sources)
        if value is None:
            unknown[path] = where
        else:
            _put(ds, path, value)
            filled.append((path, value, where))

    fill("zero_optimization.stage", sources)  # first: Hugging Face's ZeRO-3 sizes depend on it
    zero = ds.get("zero_optimization")
    stage = zero.get("stage", 0) if isinstance(zero, dict) else int(zero) if isinstance(zero, bool) else 0
    sources = dataclasses.replace(sources, stage=stage)
    for path in AUTO_KEYS:
        fill(path, sources)
    for block in DEFAULTED_BLOCKS:
        if isinstance(ds.get(block), dict):
            _defaulted(ds[block], block, filled)
    _leftover(ds, "", unknown)
    if unknown:
        raise ConfigError(next(iter(unknown)), "'auto' has nothing to resolve it: "
                          + "; ".join(f"{path} ({why})" for path, why in unknown.items()))
    notes = []
    if filled:
        how = "; ".join(f"{path} = {value if isinstance(value, str) else repr(value)} ({where})"
                        for path, value, where in filled)
        notes.append(f"auto: {len(filled)} value{'s' * (len(filled) != 1)} filled: {how}")
    return ds, notes
