"""DeepSpeed's `optimizer` block -> an optax optimizer.

Adam and AdamW become `deepspeed_adam` (the arithmetic of DeepSpeed's FusedAdam, CPU Adam and torch
Adam/AdamW: eps outside the square root, adam_w_mode, bias_correction, torch_adam) under
`optax.inject_hyperparams`; Lamb becomes `deepspeed_lamb` (FusedLamb's arithmetic, zeroflax/optim/lamb.py), and
OneBitAdam, OneBitLamb and ZeroOneAdam zeroflax.optim.onebit_adam, onebit_lamb and zero_one_adam.
`read_optimizer` reads and checks
the block ("auto" was resolved before, deepspeed_auto.py); `build_optimizer` builds the optimizer once the
learning-rate schedule (deepspeed_scheduler.py) is known.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from zeroflax import deepspeed_keys as keys
from zeroflax.config import ConfigError
from zeroflax.deepspeed_keys import as_block, as_bool, as_int, as_number, check_block, check_params, is_number
from zeroflax.optim.lamb import deepspeed_lamb
from zeroflax.optim.onebit import onebit_adam
from zeroflax.optim.onebit_lamb import onebit_lamb
from zeroflax.optim.schedules import ONE_CYCLE_BETA2
from zeroflax.optim.zero_one_adam import zero_one_adam

# The optimizers whose exchange is compressed to signs (the engine's sync parts do it).
COMPRESSED = {"onebitadam": "OneBitAdam", "onebitlamb": "OneBitLamb", "zerooneadam": "ZeroOneAdam"}


class _Moments(NamedTuple):
    mu: Any
    nu: Any


def _scale_by_adam_without_bias_correction(b1, b2, eps) -> optax.GradientTransformation:
    """Adam's moments without bias correction (FusedAdam's bias_correction=False): m / (sqrt(v) + eps)."""

    def init(params):
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)
        return _Moments(zeros(), zeros())

    def update(updates, state, params=None):
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, updates)
        out = jax.tree.map(lambda m, v: (m / (jnp.sqrt(v) + eps)).astype(m.dtype), mu, nu)
        return out, _Moments(mu, nu)

    return optax.GradientTransformation(init, update)


def deepspeed_adam(learning_rate, b1: float, b2: float, eps: float, weight_decay: float, decoupled: bool = True,
                   bias_correction: bool = True) -> optax.GradientTransformation:
    """DeepSpeed's Adam family (FusedAdam, DeepSpeedCPUAdam, torch Adam/AdamW): eps outside the square root;
    `decoupled`: AdamW's weight decay (lr x wd x p) else L2 (wd x p added to the gradient first)."""
    scale = optax.scale_by_adam(b1, b2, eps) if bias_correction else _scale_by_adam_without_bias_correction(b1, b2, eps)
    decay = optax.add_decayed_weights(weight_decay)
    parts = (scale, decay) if decoupled else (decay, scale)
    return optax.chain(*parts, optax.scale_by_learning_rate(learning_rate))


def _betas(value, path):
    if not (isinstance(value, (list, tuple)) and len(value) == 2 and all(is_number(b) and 0 <= b < 1 for b in value)):
        raise ConfigError(path, f"must be two numbers in [0, 1), got {value!r}")
    return float(value[0]), float(value[1])


def _optimizer_params(ds: dict, kind: str, notes: list) -> dict:
    """The optimizer block's params with DeepSpeed's defaults filled in."""
    params = as_block(ds["optimizer"].get("params", {}), "optimizer.params")
    if kind == "onebitadam":
        takes, moot = keys.ONEBIT_PARAMS, keys.ONEBIT_MOOT
    elif kind == "onebitlamb":
        takes, moot = keys.ONEBIT_LAMB_PARAMS, keys.ONEBIT_LAMB_MOOT
    elif kind == "zerooneadam":
        takes, moot = keys.ZERO_ONE_PARAMS, keys.ZERO_ONE_MOOT
    elif kind == "lamb":
        takes, moot = keys.LAMB_PARAMS, {}
    else:
        takes, moot = keys.ADAM_PARAMS, keys.ADAM_MOOT
    if "max_grad_norm" in params:  # DeepSpeed raises too (_configure_basic_optimizer)
        raise ConfigError("optimizer.params.max_grad_norm", "refused, as DeepSpeed does", "use gradient_clipping")
    check_params(params, "optimizer.params", takes, moot, notes, f"optimizer {ds['optimizer']['type']!r}")
    for key, refused in (("fp32_optimizer_states", False), ("maximize", True)):
        if key in params and params[key] is refused:
            raise ConfigError(f"optimizer.params.{key}", f"refused: {key} = {refused}", f"set it {not refused}")
    out = {key: params.get(key, default) for key, default in takes.items()}
    if kind in ("adam", "adamw") and out["torch_adam"] is True and "weight_decay" not in params:
        decoupled = kind == "adamw" or out["adam_w_mode"] is not False
        out["weight_decay"] = 0.01 if decoupled else 0.0  # torch.optim.AdamW's default weight decay is 0.01
    return out


def read_optimizer(ds: dict, notes: list) -> tuple[str, dict] | None:
    """The optimizer block read and checked: (kind, params with DeepSpeed's defaults)."""
    if "optimizer" not in ds:
        return None
    block = as_block(ds["optimizer"], "optimizer")
    check_block(block, "optimizer", notes)
    if "type" not in block:
        raise ConfigError("optimizer.type", "missing", "e.g. \"AdamW\"")
    name = block["type"]
    if not isinstance(name, str):
        raise ConfigError("optimizer.type", f"must be a name, got {name!r}", "e.g. \"AdamW\"")
    kind = name.lower()  # DeepSpeed lower-cases the names of its own optimizers
    if kind in keys.OPTIMIZERS_REFUSED:
        raise ConfigError("optimizer.type", f"{name!r} is refused: {keys.OPTIMIZERS_REFUSED[kind]}",
                          "use Adam, AdamW, Lamb, OneBitAdam, OneBitLamb or ZeroOneAdam, or pass your own optax optimizer "
                          "(drop the block)")
    if kind not in ("adam", "adamw", "lamb", *COMPRESSED):
        raise ConfigError("optimizer.type", f"{name!r} is not mapped (DeepSpeed would build torch.optim.{name})",
                          "use Adam, AdamW, Lamb, OneBitAdam, OneBitLamb or ZeroOneAdam, or pass your own optax "
                          "optimizer (drop the block)")
    p = _optimizer_params(ds, kind, notes)
    path = "optimizer.params."
    p["lr"] = as_number(p["lr"], path + "lr")
    p["betas"] = _betas(p["betas"], path + "betas")
    p["eps"] = as_number(p["eps"], path + "eps")
    p["weight_decay"] = as_number(p["weight_decay"], path + "weight_decay")
    if as_bool(p["amsgrad"], path + "amsgrad"):
        raise ConfigError(path + "amsgrad", "refused: AMSGrad is not built (DeepSpeed's fused and 1-bit Adam refuse "
                          "it too)", "set it false")
    if kind in ("onebitadam", "onebitlamb"):
        p["freeze_step"] = as_int(p["freeze_step"], path + "freeze_step", 0)
    if kind == "zerooneadam":
        p["var_freeze_step"] = as_int(p["var_freeze_step"], path + "var_freeze_step", 0)
        for key in ("var_update_scaler", "local_step_scaler", "local_step_clipper"):
            p[key] = as_int(p[key], path + key, 1)
    if kind == "lamb":
        for key in ("bias_correction", "eps_inside_sqrt"):
            p[key] = as_bool(p[key], path + key)
    if kind in ("lamb", "onebitlamb"):
        p["max_coeff"], p["min_coeff"] = (as_number(p[k], path + k) for k in ("max_coeff", "min_coeff"))
        if p["min_coeff"] > p["max_coeff"]:
            raise ConfigError(path + "min_coeff", f"{p['min_coeff']} > max_coeff {p['max_coeff']}", "swap them")
        fp16 = ds.get("fp16", {})
        if isinstance(fp16, dict) and fp16.get("loss_scale", 0) not in (0, 0.0):  # DeepSpeed asserts it too
            raise ConfigError("fp16.loss_scale", f"a static loss scale with {name}: DeepSpeed requires the dynamic "
                              "one", "use 0 (dynamic)")
    if kind == "onebitlamb":
        for key in ("coeff_beta", "factor_max", "factor_min", "factor_threshold"):
            p[key] = as_number(p[key], path + key)
        if not 0 <= p["coeff_beta"] < 1:
            raise ConfigError(path + "coeff_beta", f"must be in [0, 1), got {p['coeff_beta']!r}")
        if not 0 < p["factor_min"] <= p["factor_max"]:
            raise ConfigError(path + "factor_min", f"{p['factor_min']} with factor_max {p['factor_max']}: need "
                              "0 < factor_min <= factor_max", "e.g. DeepSpeed's defaults 0.5 and 4")
        if not 0 <= p["factor_threshold"] < 1:
            raise ConfigError(path + "factor_threshold", f"must be in [0, 1), got {p['factor_threshold']!r}")
    elif kind in ("adam", "adamw"):
        for key in ("torch_adam", "adam_w_mode", "bias_correction"):
            p[key] = as_bool(p[key], path + key)
        if p["torch_adam"] and "bias_correction" in ds["optimizer"].get("params", {}):
            raise ConfigError(path + "bias_correction", "torch.optim.Adam(W) (torch_adam) takes no bias_correction",
                              "remove it, or torch_adam")
    return kind, p


def fp16_loss_scaling(spec, precision: str, settings, notes: list) -> None:
    """DeepSpeed wraps OnebitAdam under fp16 in its FP16_Optimizer (runtime/fp16/fused_optimizer.py), whose
    dynamic loss scale halves on every overflow: it ignores fp16.hysteresis. zeroflax's scaler does the same
    with hysteresis 1; an overflowing step is skipped whole, the 1-bit exchange's error buffers included."""
    if spec is None or spec[0] not in ("onebitadam", "zerooneadam") or precision != "fp16":
        return
    settings.set("LossScaleConfig.hysteresis", 1, "fp16.hysteresis", written=False)
    notes.append(f"fp16 with {COMPRESSED[spec[0]]}: DeepSpeed's FP16_Optimizer halves the loss scale on every overflow "
                 "(fp16.hysteresis is ignored, as there: hysteresis 1) and skips the step whole; a skipped step does "
                 "not count towards freeze_step")


# Each compressed optimizer: its builder and the params it takes besides lr, betas, eps and weight_decay.
_COMPRESSED_BUILDS = {
    "onebitadam": (onebit_adam, ("freeze_step",)),
    "onebitlamb": (onebit_lamb, ("freeze_step", "max_coeff", "min_coeff", "coeff_beta", "factor_max", "factor_min",
                                 "factor_threshold")),
    "zerooneadam": (zero_one_adam, ("var_freeze_step", "var_update_scaler", "local_step_scaler", "local_step_clipper")),
}


def build_optimizer(spec, schedule, stage: int, precision: str, default_optimizer, notes: list, beta1=None):
    """(optimizer, hyperparameters). `schedule`: the lr as a function of the count, or None (constant lr);
    `beta1`: OneCycle's cycled beta1 as a function of the count (beta2 is then its 0.99), or None."""
    if beta1 is not None and (spec is None or spec[0] in COMPRESSED):
        what = "the optimizer is your own (no optimizer block)" if spec is None else \
            f"cycling {COMPRESSED[spec[0]]}'s momentum is not built"
        raise ConfigError("scheduler.params.cycle_momentum", f"OneCycle cycles the optimizer's beta1, but {what}",
                          "set it false" + (", or write an optimizer block" if spec is None else ""))
    if spec is None:
        if default_optimizer is None:
            notes.append("optimizer: absent: pass your own optimizer to zeroflax.initialize (DeepSpeed's client "
                         "optimizer)")
            return None, {}
        return default_optimizer(schedule), {"type": "default_optimizer"}
    kind, p = spec
    learning_rate = schedule if schedule is not None else p["lr"]
    b1, b2 = p["betas"] if beta1 is None else (beta1, ONE_CYCLE_BETA2)
    if kind in COMPRESSED:
        name, (build, takes) = COMPRESSED[kind], _COMPRESSED_BUILDS[kind]
        if stage == 3:
            raise ConfigError("zero_optimization.stage", f"refused with {name}: stage 3 never holds the local gradient "
                              "whose momentum it compresses", "use stage 0, 1 or 2")
        if stage:
            notes.append(f"optimizer.type: {name} at ZeRO stage {stage}: DeepSpeed forbids it, zeroflax "
                         "compresses each device's ZeRO shard (docs/onebit_adam.md)")
        when = "in its 1-bit gradient steps" if kind == "zerooneadam" else "after freeze_step"
        notes.append(f"optimizer.type: {name}: {when}, gradient_clipping scales every device's local "
                     "gradient by one factor from the mean gradient's norm (estimated by an all-reduced sketch); "
                     f"DeepSpeed clips each local gradient by its own norm, which is {build.__name__}(local_clip=True) "
                     + ("(its local steps always clip so) " if kind == "zerooneadam" else "") + "(docs/onebit_adam.md)")
        common = dict(b1=b1, b2=b2, eps=p["eps"], weight_decay=p["weight_decay"])
        extra = {k: p[k] for k in takes}
        optimizer = build(learning_rate, **common, **extra)
        return optimizer, dict(type=name, lr=p["lr"], **common, **extra)
    if kind == "lamb":
        notes.append("optimizer.type: Lamb: FusedLamb's trust ratio on each whole leaf, partitioned or not (DeepSpeed's "
                     "ZeRO measures it on each rank's flat partition, and wants zero_allow_untested_optimizer)"
                     + ("; DeepSpeed's fp16 wrapper also takes one hidden step with zero gradients before training "
                        "(bias correction starts at t = 2; weight decay shrinks the weights once), zeroflax does not"
                        if precision == "fp16" else ""))
        optimizer = optax.inject_hyperparams(deepspeed_lamb, static_args=("bias_correction", "eps_inside_sqrt"))(
            learning_rate=learning_rate, b1=b1, b2=b2, eps=p["eps"], weight_decay=p["weight_decay"],
            bias_correction=p["bias_correction"], eps_inside_sqrt=p["eps_inside_sqrt"], max_coeff=p["max_coeff"],
            min_coeff=p["min_coeff"])
        return optimizer, dict(type="Lamb", lr=p["lr"], b1=b1, b2=b2, eps=p["eps"], weight_decay=p["weight_decay"],
                               bias_correction=p["bias_correction"], eps_inside_sqrt=p["eps_inside_sqrt"],
                               max_coeff=p["max_coeff"], min_coeff=p["min_coeff"])
    # DeepSpeed: type "Adam" is AdamW (decoupled weight decay) unless adam_w_mode is false; "AdamW" always.
    decoupled = kind == "adamw" or p["adam_w_mode"]
    optimizer = optax.inject_hyperparams(deepspeed_adam, static_args=("decoupled", "bias_correction"))(
        learning_rate=learning_rate, b1=b1, b2=b2, eps=p["eps"], weight_decay=p["weight_decay"], decoupled=decoupled,
        bias_correction=p["bias_correction"])
    return optimizer, dict(type="AdamW" if decoupled else "Adam", lr=p["lr"], b1=b1, b2=b2, eps=p["eps"],
                           weight_decay=p["weight_decay"], decoupled=decoupled, bias_correction=p["bias_correction"])
