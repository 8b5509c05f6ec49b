"""Dynamic loss scaling for fp16 training: DeepSpeed's `DynamicLossScaler`, step for step.

The rule (per optimizer step; `H` = `hysteresis`, `W` = `loss_scale_window`, the scale starts at
2**initial_scale_power, the budget `h` at H, the step counter `i` at 0 and the last overflow at -1):

- overflow (a non-finite gradient; the step is skipped): if `h` is 1 the scale becomes
  max(scale / 2, min_loss_scale), else `h` drops by one. Either way the last overflow is step `i`.
- good step: with `consecutive_hysteresis` `h` is refilled to H. Then, with
  `stable = i - last_overflow - 1` (the good steps *before* this one since the last overflow), the scale
  doubles if `stable > 0` and `stable % W == 0`, and (without `consecutive_hysteresis`) `h` is refilled to
  H. So the first doubling comes on the good step that follows W good ones: with no overflow at all, at
  steps W, 2W, ... (0-based); after an overflow at step k, at steps k + 1 + W, k + 1 + 2W, ...
- `i` grows by one after every step, overflow or not. A fixed `loss_scale` > 0 never changes.

At the minimum: an overflow that finds `h` at 1 and the scale equal to `min_loss_scale` makes DeepSpeed's
ZeRO optimizers raise ("loss scale already at minimum") and the run ends; their scaler is built with
`raise_error_at_min_scale` left at its default, True. A jitted step cannot raise, so here the step is
skipped like any overflow, the scale stays at the minimum (what DeepSpeed's scaler does with
`raise_error_at_min_scale=False`), and `min_scale_overflows` counts such steps: a run with a nonzero
count is one DeepSpeed would have stopped at the first of them. Read it whenever the host syncs anyway.

Tested against traces of DeepSpeed's own class (tests/data/loss_scale_traces.json, made by
tools/gen_loss_scale_traces.py). DeepSpeed keeps the scale as a Python float; here it is float32, exact for
every scale DeepSpeed reaches below 2**127 (powers of two times an integer minimum below 2**24).
DeepSpeed's non-ZeRO fp16 optimizers (FP16_Optimizer, FP16_UnfusedOptimizer) use a simpler rule of their
own, without hysteresis or the exception: that is this rule with hysteresis 1 and the run going on.

The state is a small pytree of scalars, so it lives in the train state and is checkpointed with it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from zeroflax.config import LossScaleConfig


@struct.dataclass
class LossScaleState:
    scale: jax.Array  # float32 scalar
    hysteresis: jax.Array  # int32: overflows left before the scale is halved (1: the next one halves)
    last_overflow: jax.Array  # int32: iteration of the last overflow (-1: none yet)
    iteration: jax.Array  # int32: steps seen by the scaler
    min_scale_overflows: jax.Array  # int32: overflows at the minimum scale with hysteresis 1 (DeepSpeed raises)


def init_loss_scale(config: LossScaleConfig, enabled: bool) -> LossScaleState:
    if not enabled:
        scale = 1.0
    elif config.loss_scale > 0:
        scale = float(config.loss_scale)
    else:
        scale = 2.0 ** config.initial_scale_power
    return LossScaleState(
        scale=jnp.asarray(scale, jnp.float32),
        hysteresis=jnp.asarray(config.hysteresis, jnp.int32),
        last_overflow=jnp.asarray(-1, jnp.int32),
        iteration=jnp.asarray(0, jnp.int32),
        min_scale_overflows=jnp.asarray(0, jnp.int32),
    )


def update_loss_scale(state: LossScaleState, overflow: jax.Array, config: LossScaleConfig,
                      dynamic: bool) -> LossScaleState:
    """The scaler's state after a step that did (or did not) overflow (the rule in the module docstring)."""
    if not dynamic:
        return state.replace(iteration=state.iteration + 1)
    full = jnp.asarray(config.hysteresis, jnp.int32)
    min_scale = jnp.asarray(config.min_loss_scale, jnp.float32)

    # Overflow: the budget absorbs it, or (spent) the scale halves down to the minimum. The budget
    # never goes below 1, so "h is 1" is DeepSpeed's `delayed_shift == 1 or cur_hysteresis == 1`.
    spent = state.hysteresis <= 1
    at_min = overflow & spent & (state.scale == min_scale)
    scale_after_overflow = jnp.where(spent, jnp.maximum(state.scale / 2.0, min_scale), state.scale)
    hysteresis_after_overflow = jnp.where(spent, state.hysteresis, state.hysteresis - 1)

    # Good step: `stable` excludes this step, so a window closes on the step after W good ones.
    stable = state.iteration - state.last_overflow - 1
    grow = (stable > 0) & (stable % config.loss_scale_window == 0)
    scale_after_good = jnp.where(grow, state.scale * 2.0, state.scale)
    refill = jnp.logical_or(config.consecutive_hysteresis, grow)  # also takes an array (the trace test vmaps)
    hysteresis_after_good = jnp.where(refill, full, state.hysteresis)

    return LossScaleState(
        scale=jnp.where(overflow, scale_after_overflow, scale_after_good),
        hysteresis=jnp.where(overflow, hysteresis_after_overflow, hysteresis_after_good),
        last_overflow=jnp.where(overflow, state.iteration, state.last_overflow),
        iteration=state.iteration + 1,
        min_scale_overflows=state.min_scale_overflows + at_min.astype(jnp.int32),
    )
