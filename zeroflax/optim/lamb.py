"""LAMB as DeepSpeed's FusedLamb computes it (optimizer.type "Lamb"), an optax GradientTransformation.

FusedLamb is not the LAMB of optax.lamb or of the paper's pseudo-code in three ways, each kept here:
  * the moments are never bias-corrected themselves: the trust ratio is measured on the uncorrected
    direction u = m / (sqrt(v) + eps) + weight_decay * p, and the bias correction is one scalar,
    lr * sqrt(1 - b2^t) / (1 - b1^t), on the whole step (weight decay included);
  * the trust ratio ||p|| / ||u|| is clipped to [min_coeff, max_coeff] (10 and 0.01 by default), and is
    exactly 1 where either norm is 0 (then not clipped);
  * eps is added outside the square root, or inside it with eps_inside_sqrt.
One ratio per leaf, as FusedLamb has one per parameter tensor without ZeRO (DeepSpeed's ZeRO would measure
it on its flat partition instead; zeroflax's update sees whole leaves, partitioned or not).

So the update of a leaf p at step t (1-based) is
    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    u = m / (sqrt(v) + eps) + weight_decay p
    p -= lr * (sqrt(1 - b2^t) / (1 - b1^t) if bias_correction else 1) * clip(||p|| / ||u||) * u
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class LambState(NamedTuple):
    count: jnp.ndarray  # steps taken (int32); t of the next step is count + 1
    mu: Any  # m, uncorrected
    nu: Any  # v, uncorrected


def scale_by_deepspeed_lamb(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                            bias_correction: bool = True, eps_inside_sqrt: bool = False, max_coeff: float = 10.0,
                            min_coeff: float = 0.01) -> optax.GradientTransformation:
    """FusedLamb's step without the learning rate: -(the step) / lr (chain it with scale_by_learning_rate)."""

    def init(params):
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)
        return LambState(jnp.zeros([], jnp.int32), zeros(), zeros())

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("LAMB's trust ratio needs the parameters: call update(grads, state, params)")
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, updates)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, updates)
        t = (state.count + 1).astype(jnp.float32)
        scale = jnp.sqrt(1 - b2 ** t) / (1 - b1 ** t) if bias_correction else jnp.float32(1)

        def leaf(m, v, p):
            denom = jnp.sqrt(v + eps) if eps_inside_sqrt else jnp.sqrt(v) + eps
            u = m / denom + weight_decay * p
            w_norm, u_norm = jnp.linalg.norm(p.ravel()), jnp.linalg.norm(u.ravel())
            ratio = jnp.where((w_norm != 0) & (u_norm != 0),
                              jnp.clip(w_norm / jnp.where(u_norm != 0, u_norm, 1), min_coeff, max_coeff), 1.0)
            return (scale * ratio * u).astype(p.dtype)

        return jax.tree.map(leaf, mu, nu, params), LambState(state.count + 1, mu, nu)

    return optax.GradientTransformation(init, update)


def deepspeed_lamb(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0,
                   bias_correction: bool = True, eps_inside_sqrt: bool = False, max_coeff: float = 10.0,
                   min_coeff: float = 0.01) -> optax.GradientTransformation:
    """DeepSpeed's FusedLamb (module docstring); `learning_rate` a number or an optax schedule."""
    return optax.chain(scale_by_deepspeed_lamb(b1, b2, eps, weight_decay, bias_correction, eps_inside_sqrt,
                                               max_coeff, min_coeff),
                       optax.scale_by_learning_rate(learning_rate))
