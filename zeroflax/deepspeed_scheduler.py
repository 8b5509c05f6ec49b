"""DeepSpeed's `scheduler` block -> the learning rate as a function of the update count.

WarmupLR, WarmupDecayLR, WarmupCosineLR, LRRangeTest and OneCycle map to zeroflax.optim.schedules ("auto" was
resolved before, deepspeed_auto.py; total_steps= only adds a note when the JSON's length differs). Since
WarmupLR defaults to, and WarmupCosineLR scales, the optimizer's lr (the optimizer block's, else
learning_rate=), `read_scheduler` returns a factory: lr -> (schedule, beta1), where beta1 is OneCycle's cycled
momentum (None for the others), which the optimizer builder applies.
"""
from __future__ import annotations

from zeroflax import deepspeed_keys as keys
from zeroflax.config import ConfigError
from zeroflax.deepspeed_keys import as_block, as_bool, as_int, as_number, check_block, check_params
from zeroflax.optim import schedules


_KINDS = "WarmupLR, WarmupDecayLR, WarmupCosineLR, LRRangeTest or OneCycle"
# OneCycle's integer params and their least values (None: absent means the other half's)
_ONE_CYCLE_INTS = {"cycle_first_step_size": 1, "cycle_second_step_size": 0, "cycle_first_stair_count": 0,
                   "cycle_second_stair_count": 0, "decay_step_size": 0}


def read_scheduler(ds: dict, kw: dict, notes: list):
    """(a factory lr -> (schedule, beta1 schedule or None), applied to the optimizer's lr; or None without
    scheduler block)."""
    if "scheduler" not in ds:
        return None
    block = as_block(ds["scheduler"], "scheduler")
    check_block(block, "scheduler", notes)
    kind = block.get("type")
    if not isinstance(kind, str):
        raise ConfigError("scheduler.type", f"must be a scheduler name, got {kind!r}", "e.g. \"WarmupLR\"")
    if kind in keys.SCHEDULERS_REFUSED:
        raise ConfigError("scheduler.type", f"{kind!r} is refused: {keys.SCHEDULERS_REFUSED[kind]}",
                          "use " + _KINDS)
    if kind not in keys.SCHEDULER_PARAMS:
        raise ConfigError("scheduler.type", f"{kind!r} is not a DeepSpeed scheduler zeroflax maps (DeepSpeed would "
                          "look it up in torch.optim.lr_scheduler)", "use " + _KINDS)
    takes = keys.SCHEDULER_PARAMS[kind]
    params = as_block(block.get("params", {}), "scheduler.params")
    check_params(params, "scheduler.params", takes, {}, notes, f"scheduler {kind!r}")
    values = {key: params.get(key, default) for key, default in takes.items()}
    path = "scheduler.params."
    if values.pop("last_batch_iteration") != -1:
        raise ConfigError(path + "last_batch_iteration", "refused: a zeroflax run resumes its schedule from the "
                          "checkpointed step count", "remove it (-1)")
    for key, value in values.items():
        if isinstance(value, (list, tuple)):
            raise ConfigError(path + key, "a list (one value per torch parameter group) is refused: zeroflax has "
                              "one group", "give one number")
    for key in ("warmup_num_steps", "total_num_steps", "lr_range_test_step_size"):
        if key in values:
            if values[key] is None:
                raise ConfigError(path + key, f"missing: {kind} needs it", "write it, or 'auto' with total_steps=")
            values[key] = as_int(values[key], path + key, 1 if key != "total_num_steps" else 0)
    if "warmup_type" in values and values["warmup_type"] not in schedules.WARMUP_TYPES:
        raise ConfigError(path + "warmup_type", f"unknown warm-up {values['warmup_type']!r} (DeepSpeed would fall "
                          "back to 'log' with a warning)", "use 'log' or 'linear'")
    for key, least in _ONE_CYCLE_INTS.items():
        if key in values and values[key] is not None:
            values[key] = as_int(values[key], path + key, least)
    for key in ("cycle_min_lr", "cycle_max_lr"):
        if key in values and values[key] is None:
            raise ConfigError(path + key, f"missing: {kind} needs it", "write it")
    for key in ("warmup_min_lr", "warmup_max_lr", "warmup_min_ratio", "cos_min_ratio", "lr_range_test_min_lr",
                "lr_range_test_step_rate", "cycle_min_lr", "cycle_max_lr", "decay_lr_rate", "cycle_min_mom",
                "cycle_max_mom", "decay_mom_rate"):
        if values.get(key) is not None or (key in values and takes[key] is not None):  # None: only where it
            values[key] = as_number(values[key], path + key, None)  # means the optimizer's lr (warmup_max_lr)
    for key in ("lr_range_test_staircase", "cycle_momentum"):
        if key in values:
            values[key] = as_bool(values[key], path + key)
    if kind == "OneCycle" and values["cycle_momentum"]:
        notes.append(f"scheduler.type: OneCycle cycles Adam's beta1 from {values['cycle_max_mom']} down to "
                     f"{values['cycle_min_mom']} and back (the first update runs at {values['cycle_min_mom']}) and "
                     f"sets beta2 to {schedules.ONE_CYCLE_BETA2}, as DeepSpeed's scheduler does: optimizer.params.betas "
                     "is overridden (cycle_momentum false keeps it)")
    if kw["total_steps"] is not None and values.get("total_num_steps") not in (None, kw["total_steps"]):
        notes.append(f"scheduler.params.total_num_steps: {values['total_num_steps']}, but training runs "
                     f"{kw['total_steps']} steps: the schedule follows the JSON")

    def build(lr):
        # WarmupLR's warmup_max_lr and WarmupCosineLR's base are the optimizer's lr when absent / by design.
        if kind == "WarmupLR" and values["warmup_max_lr"] is None:
            if lr is None:
                raise ConfigError("scheduler.params.warmup_max_lr", "absent, so DeepSpeed takes the optimizer's lr, "
                                  "which is unknown here", "write warmup_max_lr, or pass learning_rate=")
            values["warmup_max_lr"] = float(lr)
        if kind == "WarmupCosineLR":
            if lr is None:
                raise ConfigError("optimizer.params.lr", "WarmupCosineLR scales the optimizer's lr, which is unknown "
                                  "here", "write an optimizer block with lr, or pass learning_rate=")
            return schedules.warmup_cosine_lr(float(lr), **values), None
        if kind == "OneCycle":
            return schedules.one_cycle(**values)
        fn = {"WarmupLR": schedules.warmup_lr, "WarmupDecayLR": schedules.warmup_decay_lr,
              "LRRangeTest": schedules.lr_range_test}[kind]
        return fn(**values), None

    return build
