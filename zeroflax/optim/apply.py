"""Applying the optimizer to one step's gradients: measure and clip, `optimizer.update`, apply, and keep
the old values when the step is skipped. Shared by the update on the device and the offloaded one."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from zeroflax.optim.clipping import clip_to, global_norm


def apply_optimizer(optimizer: optax.GradientTransformation, params, opt_state, grads, *, grad_clip: float,
                    skips_nonfinite: bool, norm=None, extra=None, apply=None):
    """(params, opt_state, grad_norm, finite) after one update, on whatever shards the arguments are.

    `norm`: the gradient norm when the sync measured it and clipped (1-bit Adam); else it is measured
    here and the gradient clipped to `grad_clip` (so a clipped step equals optax's chain). `extra`:
    keyword arguments of `optimizer.update`. The step is skipped (the old values kept) when `apply` is
    False, and when its gradient is not finite if `skips_nonfinite` (fp16, Config.nonfinite 'skip')."""
    if norm is None:
        norm = global_norm(grads)
        if grad_clip > 0:
            grads = clip_to(grads, norm, grad_clip)
    updates, new_opt_state = optimizer.update(grads, opt_state, params, **(extra or {}))
    new_params = optax.apply_updates(params, updates)
    finite = jnp.isfinite(norm)
    if not skips_nonfinite and apply is None:
        return new_params, new_opt_state, norm, finite
    # The step is applied only if its gradient is finite (and `apply`). Selecting between the old and
    # the new state keeps both alive through the update (XLA cannot update in place): fp16's loss
    # scaling and Config.nonfinite = 'skip' pay that; 'error' stops the run instead (train.py).
    take = finite if apply is None else apply & finite
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(take, a, b), new, old)
    return keep(new_params, params), keep(new_opt_state, opt_state), norm, finite
