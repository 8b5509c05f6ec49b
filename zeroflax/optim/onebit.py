"""1-bit Adam (DeepSpeed's OnebitAdam): Adam for `freeze_step` steps, then a frozen variance and the
momentum exchanged as sign bits with error feedback (docs/onebit_adam.md).

Two pieces, one per part of the step (docs/design.md section 7):

  * `onebit_adam(...)`: the update, an optax `GradientTransformationExtraArgs`. DeepSpeed's rules: no bias
    correction, eps outside the square root, weight decay added to the update (decoupled, scaled by the
    learning rate). From step `freeze_step` on the variance is frozen. Called by itself (one worker) the
    momentum follows the gradient as in Adam: DeepSpeed does not compress with one worker either.
  * `OneBitSync` (`zeroflax/step/onebit_sync.py`): the engine's gradient sync for it. During warm-up it is ZeRO's (the mean gradient);
    after it each device updates the momentum with its *local* gradient and the momentum goes through the
    compressed all-reduce (`exchange`); the update then receives the exchanged momentum (`momentum=`).
    Clipping then scales every local gradient by one factor, from the mean gradient's norm as estimated
    by an all-reduced count sketch (`norm_sketch`); `local_clip=True` is DeepSpeed's per-device rule.

The compressed all-reduce works on each parameter leaf as N rows of C columns (`Layout`): row i is the
chunk device i serves. A worker adds its error to the rows of its momentum, compresses them to signs with
one scale ||x||_2 / sqrt(N C) and keeps what that lost as its new error; an all-to-all gives each server
its row from every worker; the server averages sign x scale / N, adds its own error, compresses again with
one scale for its row, and an all-gather of the packed bits and scales gives every device the same result.
The layout is DeepSpeed's (the leaf flattened and zero-padded to a multiple of N lcm(N, 8)) for a leaf
that ZeRO keeps whole on every device, and the ZeRO shard (each flattened, padded to a multiple of 8) for a
partitioned one, so that a server's row is the shard whose optimizer state it holds.

With ZeRO stages 1-2 a device holds only its shard of the momentum, but the next step's worker momentum
needs all of it: the all-gathered bits and scales (1/32 of the fp32 momentum) are kept in the sync state and
decompressed. The first compressed step has no such bits (the warm-up's momentum is fp32): it all-gathers the
momentum once (phase 'first').
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax


# ------------------------------------------------------------------------------------------ the update
class OneBitAdamState(NamedTuple):
    count: jax.Array  # int32: steps taken
    mu: Any  # momentum (exp_avg)
    nu: Any  # variance (exp_avg_sq), frozen from step freeze_step on


@dataclasses.dataclass(frozen=True)
class OneBitSettings:
    learning_rate: Any  # float or optax schedule of the step count
    b1: float
    b2: float
    eps: float
    weight_decay: float
    freeze_step: int
    local_clip: bool = False  # DeepSpeed's clipping in the compressed phase (see onebit_adam)


def check_arguments(function: str, eps, weight_decay, fractions: dict, counts: dict) -> None:
    """The compressed optimizers' common checks: each of `fractions` (betas, ...) in [0, 1), each of `counts`
    ({name: (value, least)}) an integer >= least, eps and weight_decay >= 0; a ValueError naming `function`."""
    for name, value in fractions.items():
        if not 0 <= value < 1:
            raise ValueError(f"{function}: {name} must be in [0, 1), got {value!r}")
    for name, (value, least) in counts.items():
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
            raise ValueError(f"{function}: {name} must be an integer >= {least}, got {value!r}")
    if eps < 0 or weight_decay < 0:
        raise ValueError(f"{function}: eps and weight_decay must be >= 0, got {eps!r}, {weight_decay!r}")


class CompressedMomentum(optax.GradientTransformationExtraArgs):
    """An optimizer whose momentum the engine exchanges compressed (1-bit Adam, 1-bit LAMB): its update takes
    the exchanged momentum as `momentum=`, and `settings` holds what the engine's sync reads."""

    __slots__ = ()

    @property
    def settings(self):
        return self.update.settings


class OneBitAdam(CompressedMomentum):
    """What `onebit_adam` returns: an optax transformation the engine recognises (`settings`)."""

    __slots__ = ()


@dataclasses.dataclass(frozen=True)
class _Update:
    settings: OneBitSettings

    def __call__(self, grads, state: OneBitAdamState, params=None, *, momentum=None, **_):
        """`momentum`: the momentum already exchanged by the engine's compressed all-reduce; `grads` are
        then ignored. Without it (warm-up, or one worker) the momentum follows `grads`."""
        s = self.settings
        frozen = state.count >= s.freeze_step
        if momentum is None:
            mu = jax.tree.map(lambda m, g: s.b1 * m + (1 - s.b1) * g, state.mu, grads)
            nu = jax.tree.map(lambda v, g: jnp.where(frozen, v, s.b2 * v + (1 - s.b2) * g * g), state.nu, grads)
        else:
            mu, nu = momentum, state.nu
        lr = s.learning_rate(state.count) if callable(s.learning_rate) else s.learning_rate
        if s.weight_decay and params is None:
            raise ValueError("onebit_adam with weight_decay needs params in update(grads, state, params)")

        def step(m, v, p):
            update = m / (jnp.sqrt(v) + s.eps)
            if s.weight_decay:
                update = update + s.weight_decay * p
            return (-lr * update).astype(m.dtype)

        updates = jax.tree.map(step, mu, nu, params if params is not None else mu)
        return updates, OneBitAdamState(state.count + 1, mu, nu)


def onebit_adam(learning_rate: float | Callable = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                weight_decay: float = 0.0, freeze_step: int = 100000, local_clip: bool = False) -> OneBitAdam:
    """DeepSpeed's 1-bit Adam (defaults: DeepSpeed's). `freeze_step`: the number of warm-up steps of plain
    Adam (on the mean gradient) before the variance freezes and the momentum is exchanged compressed.
    Unlike DeepSpeed's fp32 engine, the first step's gradient is used, not discarded: the warm-up is
    `freeze_step` real steps. Pass the result to `zeroflax.initialize` as the optimizer.

    `local_clip`: how `Config.grad_clip` acts in the compressed phase, where no device holds the mean
    gradient. False (default): every device scales its local gradient by the same factor, from the mean
    gradient's norm estimated by a count sketch that is all-reduced (`norm_sketch`: 4 KiB per step), so the
    exchanged momentum follows the clipped mean gradient as in the warm-up. True: DeepSpeed's rule, each
    device clips its local gradient by its own norm; local gradients are noisier and larger than their mean,
    so this clips far more often (docs/onebit_adam.md measures the difference)."""
    check_arguments("onebit_adam", eps, weight_decay, {"b1": b1, "b2": b2}, {"freeze_step": (freeze_step, 0)})
    settings = OneBitSettings(learning_rate, b1, b2, eps, weight_decay, freeze_step, bool(local_clip))

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return OneBitAdamState(jnp.zeros((), jnp.int32), zeros, jax.tree.map(jnp.zeros_like, params))

    return OneBitAdam(init, _Update(settings))
