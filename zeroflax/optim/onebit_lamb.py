"""1-bit LAMB (DeepSpeed's OnebitLamb): LAMB for `freeze_step` steps, then the momentum exchanged as sign
bits with error feedback, the variance frozen, and LAMB's per-layer coefficient frozen too, rescaled each
step by how far a fresh variance has moved (docs/onebit_adam.md, "1-bit LAMB").

The update of one leaf p (no bias correction, eps outside the square root, as DeepSpeed):

  warm-up (update counts 1..freeze_step), on the mean gradient g:
      m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;  at count freeze_step: v_fresh = v
      u = m / (sqrt(v) + eps) + weight_decay p
      coeff = clip(||p|| / ||u||, min_coeff, max_coeff), or 1 where either norm is 0
      coeff_freeze = coeff_beta coeff_freeze + (1 - coeff_beta) coeff   (only where coeff != 1)
      p -= lr coeff u
  compressed phase, m the exchanged momentum (the sync's, `momentum=`) and m_last the last one:
      g_rec = (m - b1 m_last) / (1 - b1);  v_fresh = b2 v_fresh + (1 - b2) g_rec^2
      prelim = m / (sqrt(v) + eps);  u = prelim + weight_decay p
      factor = max over the leaf of (sqrt(v) + eps) / (sqrt(v_fresh) + eps)
      with weight decay: r = min(1, ||prelim|| / ||u||), factor = r factor + 1 - r
      factor clipped to [factor_min, factor_max], then to last_factor (1 -+ factor_threshold)
      p -= lr coeff_freeze factor u;  last_factor = factor

The exchange (`zeroflax/step/onebit_lamb_sync.py`) is DeepSpeed's: all leaves' momenta in one buffer, each
first multiplied by its `scaling_coeff` (the mean of the leaves' momentum RMS over this leaf's, measured on
the warm-up's last momentum) so that one scale per worker fits them all, and divided by it after.
Called by itself (one worker, no engine) the momentum follows the gradient, as DeepSpeed's with one worker.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from zeroflax.optim.onebit import CompressedMomentum, check_arguments


class OneBitLambState(NamedTuple):
    count: jax.Array  # int32: updates applied
    mu: Any  # momentum (exp_avg)
    nu: Any  # variance (exp_avg_sq), frozen after warm-up
    nu_fresh: Any  # the variance of the reconstructed gradients (exp_avg_sq_fresh), from count freeze_step on
    coeff_freeze: Any  # per leaf, float32 scalar: the warm-up's running average of LAMB's coefficient
    last_factor: Any  # per leaf, float32 scalar: the last compressed step's factor (1 before)


@dataclasses.dataclass(frozen=True)
class OneBitLambSettings:
    learning_rate: Any  # float or optax schedule of the update count
    b1: float
    b2: float
    eps: float
    weight_decay: float
    freeze_step: int
    max_coeff: float = 10.0
    min_coeff: float = 0.01
    coeff_beta: float = 0.9
    factor_max: float = 4.0
    factor_min: float = 0.5
    factor_threshold: float = 0.1
    local_clip: bool = False  # as onebit_adam's


def _norm(x):
    return jnp.sqrt(jnp.sum(jnp.square(x)))


@dataclasses.dataclass(frozen=True)
class _Update:
    settings: OneBitLambSettings

    def __call__(self, grads, state: OneBitLambState, params=None, *, momentum=None, **_):
        """`momentum`: the exchanged momentum (compressed phase, from the engine); without it the momentum
        follows `grads` and the count picks warm-up or compressed formulas."""
        s = self.settings
        if params is None:
            raise ValueError("onebit_lamb needs the parameters: call update(grads, state, params)")
        lr = s.learning_rate(state.count) if callable(s.learning_rate) else s.learning_rate
        if momentum is not None:
            return self._compressed(momentum, state, params, lr)
        mu = jax.tree.map(lambda m, g: s.b1 * m + (1 - s.b1) * g, state.mu, grads)
        warm = self._warmup(mu, grads, state, params, lr)
        late = self._compressed(mu, state, params, lr)
        frozen = state.count >= s.freeze_step
        return jax.tree.map(lambda a, b: jnp.where(frozen, b, a), warm, late)

    def _warmup(self, mu, grads, state, params, lr):
        s = self.settings
        nu = jax.tree.map(lambda v, g: s.b2 * v + (1 - s.b2) * g * g, state.nu, grads)
        snapshot = state.count + 1 == s.freeze_step
        nu_fresh = jax.tree.map(lambda f, v: jnp.where(snapshot, v, f), state.nu_fresh, nu)

        def leaf(m, v, p, c_freeze):
            u = m / (jnp.sqrt(v) + s.eps)
            if s.weight_decay:
                u = u + s.weight_decay * p
            w_norm, u_norm = _norm(p), _norm(u)
            coeff = jnp.where((w_norm != 0) & (u_norm != 0),
                              jnp.clip(w_norm / jnp.where(u_norm != 0, u_norm, 1), s.min_coeff, s.max_coeff),
                              jnp.float32(1))
            c_freeze = jnp.where(coeff != 1, s.coeff_beta * c_freeze + (1 - s.coeff_beta) * coeff, c_freeze)
            return (-lr * coeff * u).astype(p.dtype), c_freeze

        out = jax.tree.map(leaf, mu, nu, params, state.coeff_freeze)
        updates, coeff_freeze = _split(out, params)
        return updates, OneBitLambState(state.count + 1, mu, nu, nu_fresh, coeff_freeze, state.last_factor)

    def _compressed(self, momentum, state, params, lr):
        s = self.settings

        def leaf(m, m_last, v, f, p, c_freeze, last):
            g_rec = (m - m_last * s.b1) / (1 - s.b1)
            f = s.b2 * f + (1 - s.b2) * g_rec * g_rec
            denom = jnp.sqrt(v) + s.eps
            prelim = m / denom
            u = prelim + s.weight_decay * p if s.weight_decay else prelim
            factor = jnp.max(denom / (jnp.sqrt(f) + s.eps))
            if s.weight_decay:
                u_norm = _norm(u)
                ratio = jnp.where(u_norm != 0, jnp.minimum(1.0, _norm(prelim) / jnp.where(u_norm != 0, u_norm, 1)), 1.0)
                factor = factor * ratio + (1 - ratio)
            factor = jnp.clip(factor, s.factor_min, s.factor_max)
            factor = jnp.clip(factor, last * (1 - s.factor_threshold), last * (1 + s.factor_threshold))
            return (-lr * (c_freeze * factor) * u).astype(p.dtype), (f, factor)

        out = jax.tree.map(leaf, momentum, state.mu, state.nu, state.nu_fresh, params, state.coeff_freeze,
                           state.last_factor)
        updates, fresh_and_factor = _split(out, params)
        nu_fresh, last_factor = _split(fresh_and_factor, params)
        return updates, OneBitLambState(state.count + 1, momentum, state.nu, nu_fresh, state.coeff_freeze,
                                        last_factor)


def _split(pairs, like):
    """A params-structured tree of pairs -> the pair of params-structured trees."""
    treedef = jax.tree.structure(like)
    leaves = treedef.flatten_up_to(pairs)
    return treedef.unflatten([a for a, _ in leaves]), treedef.unflatten([b for _, b in leaves])


class OneBitLamb(CompressedMomentum):
    """What `onebit_lamb` returns: an optax transformation the engine recognises (`settings`)."""

    __slots__ = ()


def onebit_lamb(learning_rate: float | Callable = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                weight_decay: float = 0.0, freeze_step: int = 100000, max_coeff: float = 10.0,
                min_coeff: float = 0.01, coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                factor_threshold: float = 0.1, local_clip: bool = False) -> OneBitLamb:
    """DeepSpeed's 1-bit LAMB (defaults: DeepSpeed's). `freeze_step`: the warm-up's updates of LAMB on the mean
    gradient. As `onebit_adam`, the first step is a real one (DeepSpeed's first call only initialises) and
    `local_clip` chooses how Config.grad_clip acts in the compressed phase. Pass the result to
    `zeroflax.initialize` as the optimizer, itself (not inside a chain)."""
    check_arguments("onebit_lamb", eps, weight_decay, {"b1": b1, "b2": b2, "coeff_beta": coeff_beta},
                    {"freeze_step": (freeze_step, 0)})
    if not 0 <= min_coeff <= max_coeff:
        raise ValueError(f"onebit_lamb: need 0 <= min_coeff <= max_coeff, got {min_coeff!r}, {max_coeff!r}")
    if not 0 < factor_min <= factor_max or not 0 <= factor_threshold < 1:
        raise ValueError(f"onebit_lamb: need 0 < factor_min <= factor_max and 0 <= factor_threshold < 1, got "
                         f"{factor_min!r}, {factor_max!r}, {factor_threshold!r}")
    settings = OneBitLambSettings(learning_rate, b1, b2, eps, weight_decay, freeze_step, max_coeff, min_coeff,
                                  coeff_beta, factor_max, factor_min, factor_threshold, bool(local_clip))

    def init(params):
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)
        scalars = lambda value: jax.tree.map(lambda _: jnp.asarray(value, jnp.float32), params)
        return OneBitLambState(jnp.zeros((), jnp.int32), zeros(), zeros(), zeros(), scalars(0.0), scalars(1.0))

    return OneBitLamb(init, _Update(settings))
