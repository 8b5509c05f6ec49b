"""Dynamic loss scaling for fp16 training, with DeepSpeed's semantics.

On overflow (a non-finite gradient) the step is skipped; the scale is halved (never below
`min_loss_scale`) once the hysteresis budget is used up, otherwise the budget shrinks by one.
After `loss_scale_window` steps since the last overflow the scale doubles and the budget refills
(with `consecutive_hysteresis`, it refills on every good step). A fixed `loss_scale` > 0 never changes.
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
    hysteresis: jax.Array  # int32: overflows left before the scale is halved
    last_overflow: jax.Array  # int32: iteration of the last overflow (-1: none yet)
    iteration: jax.Array  # int32: steps seen by the scaler


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
    )


def update_loss_scale(state: LossScaleState, overflow: jax.Array, config: LossScaleConfig,
                      dynamic: bool) -> LossScaleState:
    """The scaler's state after a step that did (or did not) overflow."""
    if not dynamic:
        return state.replace(iteration=state.iteration + 1)
    halve = overflow & (state.hysteresis <= 1)
    scale_after_overflow = jnp.where(halve, jnp.maximum(state.scale / 2.0, config.min_loss_scale), state.scale)
    hysteresis_after_overflow = jnp.where(halve, state.hysteresis, state.hysteresis - 1)

    good_hysteresis = jnp.asarray(config.hysteresis, jnp.int32) if config.consecutive_hysteresis else state.hysteresis
    since_overflow = state.iteration - state.last_overflow
    grow = (since_overflow % config.loss_scale_window) == 0
    scale_after_good = jnp.where(grow, state.scale * 2.0, state.scale)
    hysteresis_after_good = jnp.where(grow, jnp.asarray(config.hysteresis, jnp.int32), good_hysteresis)

    return LossScaleState(
        scale=jnp.where(overflow, scale_after_overflow, scale_after_good),
        hysteresis=jnp.where(overflow, hysteresis_after_overflow, hysteresis_after_good),
        last_overflow=jnp.where(overflow, state.iteration, state.last_overflow),
        iteration=state.iteration + 1,
    )
