"""DeepSpeed's learning-rate schedulers as optax schedules (jittable functions of the step count).

An optax schedule maps the optimizer's update count `c` (0 for the first update) to the learning rate that
update uses. DeepSpeed's schedulers (deepspeed/runtime/lr_schedules.py) are objects whose
`last_batch_iteration` starts at -1: on construction they write their value for iteration -1 into the
optimizer, and the engine calls `step()` after every optimizer step it applied (an fp16 step skipped for
overflow does not advance it; zeroflax's skipped step keeps the optimizer state, count included, so the
two agree). Update `c` therefore runs with the scheduler's value at iteration `c - 1`:

    lr(c) = f(c - 1),  with f(-1) = the value set on construction:
            warmup_min_lr (WarmupLR, WarmupDecayLR), 0 (WarmupCosineLR), lr_range_test_min_lr (LRRangeTest).

So the first two updates of a warm-up both use warmup_min_lr (log warm-up: log(0 + 1) = 0; linear: 0 / W).
`tests/data/deepspeed_schedule_traces.json` holds the learning rate every update saw under DeepSpeed's own
code (tools/gen_deepspeed_schedule_traces.py); tests/test_from_deepspeed.py compares these functions to it.

The curves (W = max(2, warmup_num_steps), T = total_num_steps, i = c - 1 >= 0):
    warm-up fraction g(i) = log(i + 1) / log(W) ('log') or i / W ('linear'), for i < W
    WarmupLR:       min + (max - min) * (g(i) if i < W else 1)
    WarmupDecayLR:  min + (max - min) * (g(i) if i < W else max(0, (T - i) / max(1, T - W)))
    WarmupCosineLR: lr * (r0 + (1 - r0) g(i)) if i < W, else
                    lr * max(0, rc + (1 - rc) (1 + cos(pi min(1, (i - W + 1) / max(1, T - W)))) / 2)
    LRRangeTest:    min * (1 + rate * (c / size))   (floor(c / size) with staircase)
    OneCycle:       `one_cycle` below (it also cycles Adam's beta1)
DeepSpeed computes in Python floats (float64); these run in float32, within 1e-6 relative.
"""
from __future__ import annotations

import math
from typing import Callable

import jax.numpy as jnp

WARMUP_TYPES = ("log", "linear")

Schedule = Callable[[jnp.ndarray], jnp.ndarray]


def _check(warmup_num_steps: int, warmup_type: str) -> int:
    if isinstance(warmup_num_steps, bool) or not isinstance(warmup_num_steps, int) or warmup_num_steps <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_type not in WARMUP_TYPES:
        raise ValueError(f"warmup_type must be one of {', '.join(WARMUP_TYPES)}, got {warmup_type!r}")
    return max(2, warmup_num_steps)  # DeepSpeed's floor: log(W) must not be 0


def _iteration(count) -> jnp.ndarray:
    """DeepSpeed's last_batch_iteration when update `count` runs (-1 for the first update)."""
    return jnp.asarray(count, jnp.float32) - 1.0


def _warmup_fraction(i, warmup: int, warmup_type: str):
    """g(i) for 0 <= i < warmup (evaluated at i >= 0 only: callers mask i = -1)."""
    i = jnp.maximum(i, 0.0)
    if warmup_type == "log":
        return jnp.log1p(i) * (1.0 / math.log(warmup))  # 1/log(W) in float64, as DeepSpeed's inverse_log_warm_up
    return i / warmup


def warmup_lr(warmup_min_lr: float = 0.0, warmup_max_lr: float = 1e-3, warmup_num_steps: int = 1000,
              warmup_type: str = "log") -> Schedule:
    """DeepSpeed's WarmupLR: from warmup_min_lr to warmup_max_lr over warmup_num_steps, then constant.
    (DeepSpeed's own default for warmup_max_lr is the optimizer's lr; deepspeed_config resolves that.)"""
    warmup = _check(warmup_num_steps, warmup_type)
    delta = warmup_max_lr - warmup_min_lr

    def schedule(count):
        i = _iteration(count)
        gamma = jnp.where(i < warmup, _warmup_fraction(i, warmup, warmup_type), 1.0)
        return jnp.where(i < 0, warmup_min_lr, warmup_min_lr + delta * gamma)

    return schedule


def warmup_decay_lr(total_num_steps: int, warmup_min_lr: float = 0.0, warmup_max_lr: float = 1e-3,
                    warmup_num_steps: int = 1000, warmup_type: str = "log") -> Schedule:
    """DeepSpeed's WarmupDecayLR: WarmupLR's warm-up, then linear decay to 0 at total_num_steps (and 0 after)."""
    warmup = _check(warmup_num_steps, warmup_type)
    delta = warmup_max_lr - warmup_min_lr
    span = float(max(1.0, total_num_steps - warmup))

    def schedule(count):
        i = _iteration(count)
        decay = jnp.maximum(0.0, (total_num_steps - i) / span)
        gamma = jnp.where(i < warmup, _warmup_fraction(i, warmup, warmup_type), decay)
        return jnp.where(i < 0, warmup_min_lr, warmup_min_lr + delta * gamma)

    return schedule


def warmup_cosine_lr(learning_rate: float, total_num_steps: int, warmup_min_ratio: float = 0.0,
                     warmup_num_steps: int = 1000, cos_min_ratio: float = 1e-4,
                     warmup_type: str = "log") -> Schedule:
    """DeepSpeed's WarmupCosineLR: ratios of the optimizer's `learning_rate`: warm-up from warmup_min_ratio
    to 1, then a half cosine down to cos_min_ratio at total_num_steps (and held there). The first update
    runs at lr 0: DeepSpeed's value before its first step() is 0, not warmup_min_ratio."""
    warmup = _check(warmup_num_steps, warmup_type)
    span = float(max(1, total_num_steps - warmup))

    def schedule(count):
        i = _iteration(count)
        warm = warmup_min_ratio + _warmup_fraction(i, warmup, warmup_type) * (1.0 - warmup_min_ratio)
        progress = jnp.minimum(1.0, (i - warmup + 1.0) / span)
        cosine = jnp.maximum(0.0, cos_min_ratio + (1.0 - cos_min_ratio) * (1.0 + jnp.cos(math.pi * progress)) / 2)
        ratio = jnp.where(i < warmup, warm, cosine)
        return jnp.where(i < 0, 0.0, learning_rate * ratio)

    return schedule


def lr_range_test(lr_range_test_min_lr: float = 1e-3, lr_range_test_step_size: int = 2000,
                  lr_range_test_step_rate: float = 1.0, lr_range_test_staircase: bool = False) -> Schedule:
    """DeepSpeed's LRRangeTest: the lr grows linearly (or in stairs) from lr_range_test_min_lr, by
    lr_range_test_step_rate x min per lr_range_test_step_size updates. Its iteration i + 1 is the count."""
    size = lr_range_test_step_size
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"lr_range_test_step_size must be a positive integer, got {size!r}")

    def schedule(count):
        interval = jnp.asarray(count, jnp.float32) / size
        if lr_range_test_staircase:
            interval = jnp.floor(interval)
        return lr_range_test_min_lr * (1.0 + lr_range_test_step_rate * interval)

    return schedule


def one_cycle(cycle_min_lr: float, cycle_max_lr: float, decay_lr_rate: float = 0.0, cycle_first_step_size: int = 2000,
              cycle_second_step_size: int | None = None, cycle_first_stair_count: int = 0,
              cycle_second_stair_count: int | None = None, decay_step_size: int = 0, cycle_momentum: bool = True,
              cycle_min_mom: float = 0.8, cycle_max_mom: float = 0.9,
              decay_mom_rate: float = 0.0) -> tuple[Schedule, Schedule | None]:
    """DeepSpeed's OneCycle: (the lr, Adam's beta1 or None without cycle_momentum) as functions of the count.

    One cycle of F + S updates (F = cycle_first_step_size, S = cycle_second_step_size, F by default): the lr
    rises from cycle_min_lr to cycle_max_lr over the first F and falls back over the next S, while beta1
    falls from cycle_max_mom to cycle_min_mom and rises back; then the lr decays as
    min / (1 + decay_lr_rate d / decay_step_size) and beta1 grows as max (1 + decay_mom_rate d /
    decay_step_size), d updates after the cycle (held at min and max when either is 0). With a stair
    count the half cycle moves in that many flat steps. DeepSpeed's scheduler also pins Adam's beta2 to 0.99
    (the builder applies that), and before its first step() beta1 is cycle_min_mom: the first update runs
    with it, where the curve would give cycle_max_mom. Update c's position in the cycle is c (its
    last_batch_iteration c - 1, plus the 1 DeepSpeed adds)."""
    first = cycle_first_step_size
    second = first if cycle_second_step_size is None else cycle_second_step_size
    for name, size, least in (("cycle_first_step_size", first, 1), ("cycle_second_step_size", second, 0),
                              ("cycle_first_stair_count", cycle_first_stair_count, 0),
                              ("decay_step_size", decay_step_size, 0)):
        if isinstance(size, bool) or not isinstance(size, int) or size < least:
            raise ValueError(f"{name} must be an integer >= {least}, got {size!r}")
    stairs_up = cycle_first_stair_count
    stairs_down = stairs_up if cycle_second_stair_count is None else cycle_second_stair_count
    total = first + second
    lr_decays = decay_step_size != 0 and decay_lr_rate != 0
    mom_decays = decay_step_size != 0 and decay_mom_rate != 0

    def scale(count):
        """0 at the cycle's ends, 1 at its peak (the position in the cycle is exact in integers)."""
        c = jnp.asarray(count, jnp.int32)
        k = c % total
        rising = k <= first
        smooth = jnp.where(rising, k / first, (total - k) / max(second, 1))
        stairs = jnp.where(rising, stairs_up, stairs_down)
        position = jnp.where(rising, k * stairs / first, (total - k) * stairs / max(second, 1))
        stepped = jnp.floor(position) / jnp.maximum(stairs, 1)
        return jnp.where(stairs > 0, stepped, smooth).astype(jnp.float32)

    def after(count):
        return jnp.asarray(count, jnp.float32) - total  # d: updates after the cycle

    def lr(count):
        cycling = cycle_min_lr + (cycle_max_lr - cycle_min_lr) * scale(count)
        decayed = cycle_min_lr / (1.0 + decay_lr_rate * after(count) / decay_step_size) if lr_decays else cycle_min_lr
        return jnp.where(jnp.asarray(count) <= total, cycling, decayed)

    def beta1(count):
        cycling = cycle_max_mom - (cycle_max_mom - cycle_min_mom) * scale(count)
        decayed = cycle_max_mom * (1.0 + decay_mom_rate * after(count) / decay_step_size) if mom_decays else cycle_max_mom
        value = jnp.where(jnp.asarray(count) <= total, cycling, decayed)
        return jnp.where(jnp.asarray(count) == 0, cycle_min_mom, value)

    return lr, (beta1 if cycle_momentum else None)


# DeepSpeed's OneCycle sets Adam's betas to (the cycled beta1, 0.99) from its construction.
ONE_CYCLE_BETA2 = 0.99


def constant(learning_rate: float) -> Schedule:
    """No scheduler block: the optimizer's lr, unchanged."""
    return lambda count: jnp.full((), learning_rate, jnp.float32)
