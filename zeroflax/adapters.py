"""Small adapters from Flax (Linen and NNX) to the engine's contract: a params pytree, optional
logical axis names per leaf, and `loss_fn(params, batch, rng)`.

Linen: `model.init` returns boxed parameters when layers use `nn.with_logical_partitioning`
(logical names) or `nn.with_partitioning` (mesh axis names); `initialize` unboxes them itself,
so `initialize(loss_fn, lambda rng, batch: model.init(rng, batch), ...)` just works.
NNX: `nnx_split(model)` returns the parameters as a plain pytree plus a pure `apply` function.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
from flax.core import meta


def _is_box(x) -> bool:
    return isinstance(x, meta.AxisMetadata)


def unbox(tree) -> tuple[Any, Any]:
    """(values, names): strip Flax partitioning boxes, keeping each leaf's axis names (or None)."""

    def names_of(x):
        if isinstance(x, meta.Partitioned):  # LogicallyPartitioned is a subclass: both carry .names
            return tuple(x.names)
        return None

    values = meta.unbox(tree)
    if not any(_is_box(x) for x in jax.tree.leaves(tree, is_leaf=_is_box)):
        return values, None
    # Tuples of names sit where the values' leaves are (flatten_up_to reads them back per leaf).
    names = jax.tree.map(names_of, tree, is_leaf=_is_box)
    return values, names


def nnx_split(model) -> tuple[Any, Callable]:
    """Parameters of an NNX module as a plain nested dict, and `apply(params, *args, **kwargs)`.

    `apply` rebuilds the module from the given parameters (its other state, e.g. batch statistics,
    is kept as it was when split) and calls it, so it is a pure function of `params`. Under the engine
    its submodules run as ZeRO-3 gather groups and activation-checkpointing units (`sharding.groups`).
    """
    from zeroflax.sharding.groups import nnx_groups

    from flax import nnx

    graphdef, params_state, rest = nnx.split(model, nnx.Param, ...)
    params = nnx.to_pure_dict(params_state)

    def apply(params_dict, *args, **kwargs):
        state = jax.tree.map(lambda x: x, params_state)  # a fresh container for this call
        nnx.replace_by_pure_dict(state, params_dict)
        module = nnx.merge(graphdef, state, rest)
        nnx_groups(module)
        return module(*args, **kwargs)

    return params, apply
