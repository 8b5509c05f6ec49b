"""Gather groups: ZeRO-3's per-module schedule and activation checkpointing, for any model.

A gather group is one call of a function whose ZeRO-3 parameters are gathered (compute dtype) just
before it runs and dropped after it; its backward pass gathers them again and recomputes the group's
activations with `Config.remat`'s policy. Flax modules become groups without a change to their code
(Linen through a method interceptor, NNX through `zeroflax.nnx_split`); a hand-written loss marks its
blocks with `zeroflax.group(fn)(params, *args)`. Which modules: the outermost module (below the model
itself) whose parameters number at most `Config.prefetch_bucket_size` is one group, so small modules
share one gather; a module with more descends into its submodules, and one with no submodules that own
parameters is a group whatever its size.

Why a custom_vjp around `jax.checkpoint`, and the "ties": XLA (on the CPU at least) removes
optimization barriers and merges the backward pass's recomputation with the forward pass's identical
operations, so a checkpointed re-gather would become the forward gather again, its result kept until
the backward pass, and recomputed activations likewise. So:
  - backward: the group's residuals are tied to the incoming cotangent (0 times one of its elements
    is added), so the re-gather and the recomputation depend on a value that exists only once this
    group's backward pass begins: they cannot be merged with the forward pass or hoisted early;
  - backward: the cotangent handed to the previous group is tied to this group's parameter gradients,
    so this group's full-size gradient is reduce-scattered before the previous group starts;
  - forward: the gather is tied to the group's own input (no prefetch), or to the previous group's
    input when both fit in `Config.max_live_parameters` (prefetch: the next group's gather may run
    while the previous group computes), so XLA cannot issue every gather at the start.
A tie costs one scalar multiply-add per array. A non-finite anchor (an overflowing fp16 step) makes the
tied values non-finite, and such a step is skipped anyway. Whole (unsharded) parameters are tied too:
left untied, XLA merges the weight-only values of the recomputation (on the CPU, the fp32 copies it makes
of bf16 convolution and matmul operands) with the forward pass's, and keeps them from one to the other
(measured before the engine checkpointed the code between groups too: ResNet-18 with remat 'full',
235.6 MiB of temporaries with the ties, 299.9 MiB without the backward pass's ties on whole
parameters, 277.9 MiB without the forward pass's).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from zeroflax.sharding.layers import (current_context, gather, global_shape_view, in_host_memory, is_handle, layer_context,
                                      mark_boundary, remat_policy)
from zeroflax.sharding.scopes import GROUP_SCOPE, SCOPE_END as GROUP_SCOPE_END

_group_depth = [0]
# One list per nesting level of module calls: [input anchor, parameter elements] of the last group run.
_levels: list[list] = [[None, 0]]


def in_group() -> bool:
    return _group_depth[0] > 0


@contextlib.contextmanager
def _inside_group():
    _group_depth[0] += 1
    try:
        yield
    finally:
        _group_depth[0] -= 1


@contextlib.contextmanager
def call_level():
    """A new level for prefetch anchors: calls below it may run under another trace (a scan body)."""
    _levels.append([None, 0])
    try:
        yield
    finally:
        _levels.pop()


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _floating(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _anchor(tree, every: bool = False):
    """A float32 zero computed from the first floating, non-empty array of `tree` (from one element of
    each of them with `every`); None without one."""
    firsts = [jnp.ravel(x)[0].astype(jnp.float32) for x in jax.tree.leaves(tree) if _floating(x) and np.size(x)]
    if not firsts:
        return None
    return (sum(firsts) if every else firsts[0]) * 0.0


def _same_trace(a, b) -> bool:
    """Whether two values belong to the same trace (a prefetch anchor must not cross into a scan body
    or out of one). Without the (private) attribute, assume not: no prefetch, never a leaked tracer."""
    missing = object()
    return getattr(a, "_trace", missing) is getattr(b, "_trace", None)


def _tie(tree, anchor):
    """`tree` with `anchor` (a zero) added to every floating array: same values, one more dependency."""
    if anchor is None:
        return tree
    return jax.tree.map(lambda x: x + anchor.astype(x.dtype) if _floating(x) else x, tree)


def param_elements(tree) -> tuple[int, bool]:
    """(elements of the parameters once gathered, whether any is a stack of layers still to be sliced)."""
    total, stacked = 0, False
    for x in jax.tree.leaves(tree, is_leaf=is_handle):
        if is_handle(x):
            total += x.size
            stacked = stacked or x.stacked
        elif hasattr(x, "shape"):
            total += int(np.prod(x.shape))
    return total, stacked


def run_group(fn: Callable, variables, args=(), kwargs=None, *, name: str = "group"):
    """`fn(gather(variables), *args, **kwargs)` as one gather group (see the module docstring).

    Outside the engine, or inside another group, it is that plain call. Arguments that are not arrays
    (flags, sizes, None) are passed through as Python values.
    """
    kwargs = kwargs or {}
    ctx = current_context()
    if ctx is None or in_group():
        return fn(gather(variables), *args, **kwargs)
    policy = remat_policy(ctx.remat)
    size, _ = param_elements(variables)
    has_handles = any(is_handle(x) for x in jax.tree.leaves(variables, is_leaf=is_handle))
    if ctx.usage is not None:
        base, count = name, 1
        while name in ctx.usage.groups:  # a block called more than once (or traced twice)
            count += 1
            name = f"{base}#{count}"
        ctx.usage.groups[name] = size
        ctx.usage.remat_regions += policy is not None
    if policy is None and not has_handles:
        with _inside_group():
            return fn(variables, *args, **kwargs)

    leaves, treedef = jax.tree.flatten((args, kwargs))
    positions = [i for i, x in enumerate(leaves) if _is_array(x)]
    dynamic = [leaves[i] for i in positions]

    level = _levels[-1]
    own = _anchor(dynamic)
    prefetch = (level[0] is not None and own is not None and _same_trace(level[0], own)
                and ctx.max_live and size + level[1] <= ctx.max_live)
    anchor = level[0] if prefetch else own
    level[0], level[1] = own, size
    if anchor is None:
        anchor = jnp.zeros((), jnp.float32)

    def body(v, dyn, a):
        full = list(leaves)
        for i, x in zip(positions, dyn):
            full[i] = x
        call_args, call_kwargs = jax.tree.unflatten(treedef, full)
        # The scope names the group in the HLO's metadata, where the memory report finds its gathers.
        with _inside_group(), jax.named_scope(f"{GROUP_SCOPE}{name}{GROUP_SCOPE_END}"):
            return fn(gather(_tie(v, a)), *call_args, **call_kwargs)

    checkpointed = body if policy is None else jax.checkpoint(body, policy=policy, prevent_cse=False)

    @jax.custom_vjp
    def call_group(v, dyn, a):
        return checkpointed(v, dyn, a)

    def call_group_fwd(v, dyn, a):
        return jax.vjp(checkpointed, v, dyn, a)  # (outputs, pullback): the pullback holds the residuals

    # Host-memory leaves (offload_param's sources) get no cotangent: their gradient is their sink's.
    on_host = [in_host_memory(x) for x in jax.tree.leaves(variables)]

    def call_group_bwd(pullback, cotangent):
        pullback = _tie(pullback, _anchor(cotangent))
        grad_v, grad_dyn, grad_a = pullback(cotangent)
        if any(on_host):
            flat, tree = jax.tree.flatten(grad_v)
            grad_v = tree.unflatten([None if host else g for g, host in zip(flat, on_host)])
        return grad_v, _tie(grad_dyn, _anchor(grad_v, every=True)), grad_a

    call_group.defvjp(call_group_fwd, call_group_bwd)
    # Named, the group's inputs (its residuals) and outputs are what the loss's own checkpoint keeps.
    return mark_boundary(call_group(variables, mark_boundary(dynamic), anchor))


def group(fn: Callable, name: str | None = None) -> Callable:
    """Mark a block of a hand-written loss as one gather group: `group(fn)(params, *args, **kwargs)`.

    Under the engine at ZeRO-3 the ZeRO-3 parameters in `params` (any pytree) are gathered just before
    `fn(params, *args, **kwargs)` runs and again for its backward pass, never kept in between, and the
    block is rematerialised with `Config.remat`'s policy (at every stage). Outside the engine it is the
    plain call.
    """
    label = name or getattr(fn, "__name__", "group")

    @functools.wraps(fn)
    def wrapped(params, *args, **kwargs):
        return run_group(fn, params, args, kwargs, name=label)

    return wrapped


# ------------------------------------------------------------------------------------- Flax Linen
def _path(module) -> str:
    return "/".join(str(p) for p in module.path) or type(module).__name__


def _has_child_params(params) -> bool:
    return any(isinstance(v, dict) or hasattr(v, "items") for v in params.values())


def _linen_interceptor(next_fun, args, kwargs, context):
    """Every Linen method call under the engine: a group, or a pass-through that gathers its own
    direct parameters (those of the model itself, or of a module too big to be one group)."""
    module = context.module
    ctx = current_context()
    if ctx is not None and not in_group() and context.method_name == "setup":
        # setup() declares parameters before any method of the module is intercepted: Flax's shape
        # check there must see the declared shapes, not this device's shards.
        with global_shape_view():
            return next_fun(*args, **kwargs)
    if (ctx is None or in_group() or context.method_name == "setup" or module.scope is None
            or module.is_initializing()):
        return next_fun(*args, **kwargs)
    variables = module.variables
    params = variables.get("params", {})
    if not params:
        return next_fun(*args, **kwargs)
    size, stacked = param_elements(params)
    root = module.scope.parent is None
    if not root and not stacked and (size <= ctx.bucket or not _has_child_params(params)):
        return _linen_group(module, context.method_name, args, kwargs)
    direct = [k for k, v in params.items() if is_handle(v) and not v.stacked]
    with call_level():
        if not direct:
            return next_fun(*args, **kwargs)
        return _with_direct_gathered(module, context.method_name, direct, args, kwargs)


def _with_direct_gathered(module, method: str, names, args, kwargs):
    import flax.linen as nn

    def gather_direct(tree):
        params = dict(tree["params"])
        for key in names:
            params[key] = gather(params[key])
        return {**tree, "params": params}

    def call(inner, *a, **k):
        object.__setattr__(inner, "_zeroflax_passed", True)  # its next call is this one: let it through
        return getattr(inner, method)(*a, **k)

    mapped = nn.map_variables(call, "params", trans_in_fn=gather_direct)
    return mapped(module, *args, **kwargs)


def _linen_group(module, method: str, args, kwargs):
    variables = dict(module.variables)
    mutable = [c for c in variables if c != "params" and module.is_mutable_collection(c)]
    rngs = {name: module.make_rng(name) for name in module.scope.rngs}
    unbound = module.clone(parent=None)

    def pure(v, *a, _rngs, **k):
        return unbound.apply(v, *a, method=method, mutable=mutable or False, rngs=_rngs, **k)

    out = run_group(pure, variables, args, {**kwargs, "_rngs": rngs}, name=_path(module))
    if not mutable:
        return out
    out, updates = out
    for collection, tree in updates.items():
        for key, value in tree.items():
            module.put_variable(collection, key, value)
    return out


@contextlib.contextmanager
def linen_groups():
    """Linen module calls inside this context run as gather groups (when the engine's context is set)."""
    import flax.linen as nn

    def interceptor(next_fun, args, kwargs, context):
        if getattr(context.module, "_zeroflax_passed", False):
            object.__setattr__(context.module, "_zeroflax_passed", False)
            with call_level():
                return next_fun(*args, **kwargs)
        return _linen_interceptor(next_fun, args, kwargs, context)

    with nn.intercept_methods(interceptor):
        yield


# --------------------------------------------------------------------------------------- Flax NNX
_nnx_grouped_classes: dict = {}


def _nnx_grouped_class(cls):
    """A subclass of an NNX module class whose __call__ runs as one gather group."""
    if cls not in _nnx_grouped_classes:
        def __call__(self, *args, **kwargs):
            from flax import nnx

            graphdef, state = nnx.split(self)

            def pure(st, *a, **k):
                return cls.__call__(nnx.merge(graphdef, st), *a, **k)

            return run_group(pure, state, args, kwargs, name=getattr(self, "_zeroflax_name", cls.__name__))

        _nnx_grouped_classes[cls] = type(cls.__name__, (cls,), {"__call__": __call__})
    return _nnx_grouped_classes[cls]


def nnx_groups(module) -> None:
    """Under the engine, turn the submodules of an NNX module (freshly merged, so this changes nothing
    the caller keeps) into gather groups by the same rule as for Linen. Their state updates inside the
    group (e.g. NNX BatchNorm statistics) are not carried out: NNX model state is not supported yet."""
    ctx = current_context()
    if ctx is None or in_group():
        return
    from flax import nnx

    iterate = getattr(nnx, "iter_modules", None) or (lambda m: m.iter_modules())
    subs = [(tuple(path), sub) for path, sub in iterate(module)]
    sizes = {path: param_elements(nnx.state(sub, nnx.Param))[0] for path, sub in subs}
    chosen: list[tuple] = []
    for path, sub in sorted(subs, key=lambda item: len(item[0])):
        if not path or not sizes[path] or any(path[:len(c)] == c for c in chosen):
            continue
        has_children = any(len(p) > len(path) and p[:len(path)] == path and sizes[p] for p in sizes)
        if sizes[path] <= ctx.bucket or not has_children:
            chosen.append(path)
            object.__setattr__(sub, "_zeroflax_name", "/".join(map(str, path)))
            sub.__class__ = _nnx_grouped_class(type(sub))


@contextlib.contextmanager
def loss_scope(ctx):
    """Where the engine traces the user's loss: its context, Linen modules as groups, fresh anchors."""
    with layer_context(ctx), linen_groups(), call_level():
        yield
