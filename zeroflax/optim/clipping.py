"""The gradient's global L2 norm, optax.clip_by_global_norm's rule and a finiteness check, shared by the engine's update and
1-bit Adam's sync (which clips its local gradients in the compressed phase)."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def global_norm(tree):
    """optax.tree.norm's sum, written so that it creates no device constant: under offload the update runs
    on the host, where jax (0.10) refuses to mix memory spaces."""
    return jnp.sqrt(functools.reduce(jnp.add, [jnp.sum(jnp.square(g)) for g in jax.tree.leaves(tree)]))


def clip_to(tree, norm, max_norm: float):
    """`tree` (whose global norm is `norm`) scaled to at most `max_norm`, as optax.clip_by_global_norm does."""
    factor = jnp.where(norm < max_norm, 1.0, max_norm / norm)
    return jax.tree.map(lambda g: (g * factor).astype(g.dtype), tree)


def all_finite(tree):
    """True where every element of every leaf is finite (one scalar; the reduction runs on shards). No
    device constant, as in global_norm."""
    return functools.reduce(jnp.logical_and, [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)])
