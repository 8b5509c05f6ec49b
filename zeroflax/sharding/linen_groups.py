"""Flax Linen modules as gather groups, unchanged: a method interceptor installed while the engine traces
the loss (`sharding.groups` has the group itself and the rule for which modules are groups).

What model code does that the interceptor meets (docs/zero3.md, "Model code that meets a handle"):
parameters declared in `setup()` (a global-shape view for Flax's shape check), modules held but not
owned (their parameters join the group under the attribute name), recurrent cells in lifted transforms
(their caller is one group, found by the probe), and `axis_name` fields written for `pmap`
(`Config.data_axis_aliases`).
"""
from __future__ import annotations

import contextlib

from zeroflax.sharding.groups import call_level, in_group, param_elements, run_group
from zeroflax.sharding.context import current_context, layer_context
from zeroflax.sharding.handles import gather, global_shape_view, is_handle
from zeroflax.sharding.scopes import ThreadStack


def _path(module) -> str:
    return "/".join(str(p) for p in module.path) or type(module).__name__


def _has_child_params(params) -> bool:
    return any(isinstance(v, dict) or hasattr(v, "items") for v in params.values())


def _foreign_modules(module) -> dict | None:
    """The modules a module holds as attributes that are not its descendants, by attribute name: wmt's
    encoder and decoder hold the Transformer's shared embedding, `nn.RNN` holds a cell created by (and
    owned by) its caller. Re-applied on its own as a group, the module binds them as its children
    under those names, so the group gathers their parameters with its own. None when that cannot
    work: one of them is an ancestor, or keeps mutable state (the group would not write it back)."""
    import flax.linen as nn

    own = tuple(module.path)
    foreign = {}
    for name, value in vars(module).items():
        if not isinstance(value, nn.Module) or value is module or name.startswith("_"):
            continue
        try:
            path = tuple(value.path)
        except Exception:  # not bound (yet): it will be bound as this module's child
            continue
        if path[:len(own)] == own:
            continue
        if own[:len(path)] == path or set(value.variables) - {"params"}:
            return None
        foreign[name] = value
    return foreign


def _variables_with(module, foreign: dict) -> dict:
    """The module's variables, with each foreign module's under its attribute name."""
    variables = dict(module.variables)
    for name, other in foreign.items():
        for collection, tree in other.variables.items():
            variables[collection] = {**variables.get(collection, {}), name: tree}
    return variables


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
    if ctx is not None and in_group() and module.scope is not None:
        _note_lifted_in_group(module, ctx)
    if (ctx is None or in_group() or context.method_name == "setup" or module.scope is None
            or module.is_initializing()):
        return next_fun(*args, **kwargs)
    _note_lifted_call(module, ctx)
    foreign = _foreign_modules(module)
    variables = _variables_with(module, foreign or {})
    params = variables.get("params", {})
    if not params:
        return _pass_through(module, next_fun, args, kwargs)
    size, stacked = param_elements(params)
    root = module.scope.parent is None
    whole = size <= ctx.bucket or not _has_child_params(params) or _path(module) in ctx.scan_owners
    if not root and not stacked and foreign is not None and whole:
        return _linen_group(module, context.method_name, variables, args, kwargs)
    direct = [k for k, v in module.variables.get("params", {}).items() if is_handle(v) and not v.stacked]
    if not direct:
        return _pass_through(module, next_fun, args, kwargs)
    with call_level():
        return _with_direct_gathered(module, context.method_name, direct, args, kwargs)


# The module calls passed through (not groups) that are running now, innermost last: (path, the root of
# its scope tree, whether it could be one group: not the model itself, not a stack of layers).
_passing = ThreadStack()


def _scope_root(scope):
    while scope.parent is not None:
        scope = scope.parent
    return scope


@contextlib.contextmanager
def _passing_through(module):
    params = module.variables.get("params", {})
    eligible = module.scope.parent is not None and not param_elements(params)[1]
    with _passing.push((_path(module), _scope_root(module.scope), eligible)), call_level():
        yield


def _pass_through(module, next_fun, args, kwargs):
    with _passing_through(module):
        return next_fun(*args, **kwargs)


def _note_lifted_call(module, ctx) -> None:
    """In the probe: a module bound to another scope tree than the module passed through last runs
    inside a lifted transform that module called (nn.scan, nn.RNN, nn.vmap, nn.remat). When that caller's
    parameters are not a stack of layers, the transform shares them at every step (a recurrent cell):
    the caller is noted, to be one group in the step, so they are gathered once, outside the loop."""
    if ctx.usage is None or not ctx.usage.probe or not _passing:
        return
    path, root, eligible = _passing.top()
    if eligible and _scope_root(module.scope) is not root:
        ctx.usage.scan_owners.add(path)


# The scope tree of each Linen group being traced, innermost last (None until its module's first call).
_group_roots = ThreadStack()


def _note_lifted_in_group(module, ctx) -> None:
    """In the probe: a module inside a Linen group bound to another scope tree than the group's module
    runs in a lifted transform (nn.scan, nn.RNN): a recurrent region, for `remat_choice`."""
    if ctx.usage is None or not ctx.usage.probe or not _group_roots:
        return
    root = _scope_root(module.scope)
    if _group_roots.top() is None:
        _group_roots.set_top(root)
    elif root is not _group_roots.top():
        ctx.usage.lifted_in_groups += 1


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


def _linen_group(module, method: str, variables: dict, args, kwargs):
    mutable = [c for c in variables if c != "params" and module.is_mutable_collection(c)]
    rngs = {name: module.make_rng(name) for name in module.scope.rngs}
    unbound = module.clone(parent=None)

    def pure(v, *a, _rngs, **k):
        with _group_roots.push(None):
            return unbound.apply(v, *a, method=method, mutable=mutable or False, rngs=_rngs, **k)

    out = run_group(pure, variables, args, {**kwargs, "_rngs": rngs}, name=_path(module))
    if not mutable:
        return out
    out, updates = out
    for collection, tree in updates.items():
        for key, value in tree.items():
            module.put_variable(collection, key, value)
    return out


def _is_alias(name, aliases) -> bool:
    names = name if isinstance(name, (tuple, list)) else (name,)
    return any(isinstance(n, str) and n in aliases for n in names)


def _rename_axes(name, ctx):
    if isinstance(name, (tuple, list)):
        return type(name)(ctx.data_axis if n in ctx.data_axis_aliases else n for n in name)
    return ctx.data_axis


def _with_axis_name(module, axis_name, interceptor, next_fun, args, kwargs, context):
    """The call with the module's `axis_name` field (a pmap-era name) set to the mesh's data axis. The
    field is read by the module's own code (BatchNorm's statistics): set on the instance for the call
    only, and back after, so the model the user holds is unchanged."""
    original = module.axis_name
    object.__setattr__(module, "axis_name", axis_name)
    try:
        return interceptor(next_fun, args, kwargs, context)
    finally:
        object.__setattr__(module, "axis_name", original)


@contextlib.contextmanager
def linen_groups():
    """Linen module calls inside this context run as gather groups (when the engine's context is set)."""
    import flax.linen as nn

    def interceptor(next_fun, args, kwargs, context):
        ctx = current_context()
        alias = getattr(context.module, "axis_name", None)
        if ctx is not None and ctx.data_axis_aliases and _is_alias(alias, ctx.data_axis_aliases):
            return _with_axis_name(context.module, _rename_axes(alias, ctx), interceptor, next_fun, args, kwargs,
                                   context)
        if getattr(context.module, "_zeroflax_passed", False):
            object.__setattr__(context.module, "_zeroflax_passed", False)
            with _passing_through(context.module):  # re-bound by map_variables: its own scope tree
                return next_fun(*args, **kwargs)
        return _linen_interceptor(next_fun, args, kwargs, context)

    with nn.intercept_methods(interceptor):
        yield


@contextlib.contextmanager
def loss_scope(ctx):
    """Where the engine traces the user's loss: its context, Linen modules as groups, fresh anchors."""
    with layer_context(ctx), linen_groups(), call_level():
        yield
