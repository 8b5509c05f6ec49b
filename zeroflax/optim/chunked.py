"""The optimizer applied to one chunk of one parameter leaf, and whether that equals applying it to the whole
tree: what the NVMe update (`zeroflax/step/streamed_update.py`) runs for each chunk it streams.

A chunk's update calls the optimizer on the user's own tree (its masks, its step counts), with the chunk
standing for its leaf and every other leaf an empty array of its rank, and the optimizer state's slots of the
leaf cut to the chunk (`param_slots` finds them by position, as the shardings do). For an optimizer that acts
on each element alone this is the whole tree's update, restricted to the chunk; `check_elementwise` tells.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zeroflax.config import ConfigError
from zeroflax.optim.clipping import global_norm


def param_slots(optimizer: optax.GradientTransformation, abstract_params, abstract_opt_state):
    """(per parameter leaf the indices of its parameter-shaped optimizer state leaves, the indices of the
    others). Found by position with `optax.tree_map_params`, as the shardings are. A slot whose shape is not
    its parameter's (a factored moment) is returned too: the caller refuses it."""
    leaves = jax.tree.leaves(abstract_params)
    index_tree = jax.tree.unflatten(jax.tree.structure(abstract_params), list(range(len(leaves))))
    owner = optax.tree_map_params(optimizer, lambda _, i: i, abstract_opt_state, index_tree,
                                  transform_non_params=lambda _: -1)
    owners = jax.tree.leaves(owner)
    if len(owners) != len(jax.tree.leaves(abstract_opt_state)):
        raise ValueError("the optimizer state's leaves could not be matched to the parameters")
    slots = tuple(tuple(j for j, o in enumerate(owners) if o == i) for i in range(len(leaves)))
    return slots, tuple(j for j, o in enumerate(owners) if o == -1)


def _empty(x):
    """An empty array of `x`'s rank and dtype: a leaf the chunk's update does not touch."""
    return jnp.zeros((0,) * len(x.shape), x.dtype)


def chunk_update(optimizer, abstract_params, abstract_opt, slots, shared, leaf: int, grad_clip: float, compute_dtype):
    """The update of one chunk of parameter leaf `leaf`: (master, its slots, shared, grad, norm) -> (master,
    slots, shared, compute copy). Every other leaf of the parameters, gradients and optimizer state is an
    empty array of its rank, so the optimizer sees its own tree."""
    p_leaves, p_def = jax.tree.leaves(abstract_params), jax.tree.structure(abstract_params)
    o_leaves, o_def = jax.tree.leaves(abstract_opt), jax.tree.structure(abstract_opt)

    def update(master, slot_values, shared_values, grad, norm):
        if grad_clip > 0:  # as optim/clipping.py clip_to scales the whole tree
            factor = jnp.where(norm < grad_clip, 1.0, grad_clip / norm)
            grad = (grad * factor).astype(grad.dtype)
        params = [master if i == leaf else _empty(x) for i, x in enumerate(p_leaves)]
        grads = [grad if i == leaf else _empty(x) for i, x in enumerate(p_leaves)]
        state = [_empty(x) for x in o_leaves]
        for j, v in zip(slots[leaf], slot_values):
            state[j] = v
        for j, v in zip(shared, shared_values):
            state[j] = v
        params, state = jax.tree.unflatten(p_def, params), jax.tree.unflatten(o_def, state)
        updates, new_state = optimizer.update(jax.tree.unflatten(p_def, grads), state, params)
        new = optax.apply_updates(params, updates)
        new_master = jax.tree.leaves(new)[leaf]
        new_state = jax.tree.leaves(new_state)
        copy = new_master.astype(compute_dtype) if jnp.issubdtype(new_master.dtype, jnp.floating) else new_master
        return new_master, tuple(new_state[j] for j in slots[leaf]), tuple(new_state[j] for j in shared), copy

    return update


def chunk_init(optimizer, abstract_params, abstract_opt, slots, shared, leaf: int):
    """The optimizer's initial slots of one chunk of leaf `leaf` (and its shared leaves), from its master."""
    p_leaves, p_def = jax.tree.leaves(abstract_params), jax.tree.structure(abstract_params)

    def init(master):
        params = jax.tree.unflatten(p_def, [master if i == leaf else _empty(x) for i, x in enumerate(p_leaves)])
        state = jax.tree.leaves(optimizer.init(params))
        return tuple(state[j] for j in slots[leaf]), tuple(state[j] for j in shared)

    return init


def check_elementwise(optimizer, abstract_params, abstract_opt, grad_clip: float) -> None:
    """ConfigError unless updating chunk by chunk equals updating the whole tree for `optimizer`: two steps on
    small random parameters of the same tree (each dimension at most 3), the whole tree against its two halves
    (every leaf's first row, and the rest) each updated alone, on the host CPU. A transformation that looks
    across elements (a norm, a trust ratio, a factored moment) sees different numbers in a half."""
    slots, _ = param_slots(optimizer, abstract_params, abstract_opt)
    fix = ("use an optimizer that acts on each element alone (adam, adamw, sgd, lion; Config.grad_clip clips), or "
           "OffloadOptimizerConfig.device='cpu'")
    for i, x in enumerate(jax.tree.leaves(abstract_params)):
        for j in slots[i]:
            if tuple(jax.tree.leaves(abstract_opt)[j].shape) != tuple(x.shape):
                raise ConfigError("OffloadOptimizerConfig.device", "'nvme' updates the state chunk by chunk, but this "
                                  "optimizer keeps a state of another shape than its parameter (a factored moment)", fix)
    small = jax.tree.map(lambda x: jax.ShapeDtypeStruct(tuple(min(n, 3) for n in x.shape), x.dtype), abstract_params)
    cut = lambda x: x.ndim > 0 and x.shape[0] > 1  # a leaf with rows to split (the others go whole into the first half)

    def probe(key):
        leaves, treedef = jax.tree.flatten(small)
        keys = jax.random.split(key, 3 * len(leaves))
        normal = lambda k, x, scale: (scale * jax.random.normal(k, x.shape, jnp.float32)).astype(x.dtype)
        params = [normal(k, x, 1.0) for k, x in zip(keys[::3], leaves)]
        # Two steps of gradients of different sizes, so that a clip or a normalisation inside the optimizer
        # scales them differently for a half than for the whole.
        steps = [[normal(k, x, 100.0) for k, x in zip(keys[1::3], leaves)],
                 [normal(k, x, 0.3) for k, x in zip(keys[2::3], leaves)]]
        halves = [lambda x: x[:1] if cut(x) else x, lambda x: x[1:] if cut(x) else x[:0] if x.ndim else x]

        def run(pick):
            p = jax.tree.unflatten(treedef, [pick(x) for x in params])
            state = optimizer.init(p)
            for grads in steps:
                whole = jax.tree.unflatten(treedef, grads)
                g = jax.tree.unflatten(treedef, [pick(x) for x in grads])
                if grad_clip > 0:  # the engine clips by the whole tree's norm, before the optimizer
                    norm = global_norm(whole)
                    g = jax.tree.map(lambda a: (a * jnp.where(norm < grad_clip, 1.0, grad_clip / norm)).astype(a.dtype), g)
                u, state = optimizer.update(g, state, p)
                p = optax.apply_updates(p, u)
            return jax.tree.leaves(p)

        whole, first, rest = run(lambda x: x), run(halves[0]), run(halves[1])
        joined = [jnp.concatenate([a, b]) if cut(x) else a for a, b, x in zip(first, rest, params)]
        return whole, joined

    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        whole, joined = jax.jit(probe)(jax.random.PRNGKey(0))
    close = lambda a, b: np.allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-5, atol=1e-6)
    if not all(close(a, b) for a, b in zip(whole, joined)):
        raise ConfigError("OffloadOptimizerConfig.device", "'nvme' updates the state chunk by chunk, and this "
                          "optimizer's update of a chunk differs from its update of the whole (a trust ratio as LAMB's, "
                          "or a global-norm clip inside the optimizer)", fix)
