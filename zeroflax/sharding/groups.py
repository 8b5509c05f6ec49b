"""Gather groups: ZeRO-3's per-module schedule and activation checkpointing, for any model.

A gather group is one call of a function whose ZeRO-3 parameters are gathered (compute dtype) just
before it runs and dropped after it; its backward pass gathers them again and recomputes the group's
activations with `Config.remat`'s policy. Flax modules become groups without a change to their code
(Linen through a method interceptor, `sharding.linen_groups`; NNX through `zeroflax.nnx_split`); a hand-written loss marks its
blocks with `zeroflax.group(fn)(params, *args)`. Which modules: the outermost module (below the model
itself) whose parameters number at most `Config.prefetch_bucket_size` is one group, so small modules
share one gather; a module with more descends into its submodules, and one with no submodules that own
parameters is a group whatever its size.

Why a custom_vjp around `jax.checkpoint`, and the "ties": XLA (on the CPU at least) removes
optimization barriers and merges the backward pass's recomputation with the forward pass's identical
operations, so a checkpointed re-gather would become the forward gather again, its result kept until
the backward pass, and recomputed activations likewise. So:
  - backward: the group's residuals are tied to the incoming cotangent (0 times one element of each array
    is added), so the re-gather and the recomputation depend on a value that exists only once this
    group's backward pass begins: they cannot be merged with the forward pass or hoisted early;
  - backward: the cotangent handed to the previous group is tied to this group's parameter gradients,
    so this group's full-size gradient is reduce-scattered before the previous group starts;
  - forward: the gather is tied to the groups before it in program order (`_Level`): to the output of
    the group before the last one when both fit in `Config.max_live_parameters` (prefetch: the next
    group's gather may run while the previous group computes), else to the last group's output and its
    own input; so XLA can neither issue every gather at the start nor run two branches' gathers (an
    encoder's and a decoder's) side by side.
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
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from zeroflax.sharding.collectives import in_host_memory
from zeroflax.sharding.context import current_context
from zeroflax.sharding.handles import gather, is_handle
from zeroflax.sharding.remat import is_floating, mark_boundary, remat_policy
from zeroflax.sharding.scopes import GROUP_SCOPE, SCOPE_END as GROUP_SCOPE_END, ThreadStack

_groups_running = ThreadStack()  # one entry per group call being traced (in this thread)


class _Level:
    """What the groups run so far at one nesting level of module calls tell the next one: anchors (zeros
    computed from a value) of the last group's input and output and of the output of the one before it,
    and the last group's parameter elements."""

    def __init__(self):
        self.last_input = self.last_output = self.before_output = None
        self.last_size, self.last_leaves = 0, frozenset()

    def gather_anchor(self, own, size: int, max_live: int, leaves: frozenset = frozenset()):
        """The value the next group's gather waits for, whatever order XLA schedules branches in:
        - prefetch (both groups fit in `max_live`): the output of the group before the last one, so
          only the last group (still computing) and this one hold gathered weights; before there is
          one, the last group's input (its gather's own anchor);
        - otherwise: the last group's output and this group's own input, so one group at a time.
        A group that gathers a leaf the last group gathered too (`leaves`: their indices; a shared
        embedding's lookup in the encoder, then in the decoder) is not prefetched: tied to the last
        group's input, both gathers of that leaf could be tied to the same value, which makes them one
        to XLA, and the first one's result would be kept for the second."""
        usable = lambda a: a is not None and own is not None and _same_trace(a, own)
        if max_live and size + self.last_size <= max_live and not leaves & self.last_leaves:
            for candidate in (self.before_output, self.last_input):
                if usable(candidate):
                    return candidate
            return own
        if usable(self.last_output):
            return self.last_output + own
        return own

    def ran(self, own, out_anchor, size: int, leaves: frozenset = frozenset()) -> None:
        self.before_output, self.last_output = self.last_output, out_anchor
        self.last_input, self.last_size, self.last_leaves = own, size, leaves


_levels = ThreadStack(bottom=_Level)  # the nesting levels of module calls, innermost last


def in_group() -> bool:
    return bool(_groups_running)


def _inside_group():
    return _groups_running.push(True)


@contextlib.contextmanager
def call_level():
    """A nesting level of module calls. The groups below it continue the chain of the groups before it
    (so branches of a model, its encoder and its decoder, are ordered too) and the groups after it
    continue theirs; an anchor from another trace (a scan body) is never used (`_same_trace`)."""
    outer = _levels.top()
    inner = _Level()
    inner.__dict__.update(outer.__dict__)
    try:
        with _levels.push(inner):
            yield
    finally:
        outer.__dict__.update(inner.__dict__)


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _anchor(tree, every: bool = False):
    """A float32 zero computed from the first floating, non-empty array of `tree` (from one element of
    each of them with `every`); without one, from the first integer array (a group whose inputs are token
    ids, T5's decoder embedding: its gather must wait for them too, not be issued when the step starts);
    None without either. Concrete arrays (not traced) are passed over: a tie to a constant is folded away.
    A traced value computed from constants alone is not seen here: the placement pass puts its groups'
    inputs from the batch first (`sharding.relocate`; an LSTM's initial carry of zeros)."""
    arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.core.Tracer) and np.size(x)]
    # The first element by index, not `ravel(x)[0]`: a reshape of an array sliced over an automatic axis
    # (the vocabulary-parallel logits' cotangent, `tensor`) makes XLA gather it whole first.
    first = lambda x: x[(0,) * x.ndim].astype(jnp.float32)
    firsts = [first(x) for x in arrays if is_floating(x)]
    if not firsts:
        ints = [x for x in arrays if jnp.issubdtype(x.dtype, jnp.integer)]
        return first(ints[0]) * 0.0 if ints else None
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
    return jax.tree.map(lambda x: x + anchor.astype(x.dtype) if is_floating(x) else x, tree)


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


def record_group(name: str, size: int, leaves: frozenset, remat: bool = False) -> str:
    """Note a gather group in the trace running (`GatherUsage`: its elements in `groups`, the call and
    the leaves it gathers in `group_calls`, one more remat region with `remat`) and return its name,
    numbered (`name#2`) when a block runs, or the loss is traced, more than once. The memory report finds
    the group's gathers by that name (`GROUP_SCOPE`)."""
    ctx = current_context()
    if ctx is None or ctx.usage is None:
        return name
    base, count = name, 1
    while name in ctx.usage.groups:
        count += 1
        name = f"{base}#{count}"
    ctx.usage.groups[name] = size
    ctx.usage.remat_regions += remat
    ctx.usage.group_calls.append((name, size, leaves))
    return name


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
    handles = [x for x in jax.tree.leaves(variables, is_leaf=is_handle) if is_handle(x) and not x.stacked]
    name = record_group(name, size, frozenset(x.index for x in handles), remat=policy is not None)
    if policy is None and not has_handles:
        with _inside_group():
            return fn(variables, *args, **kwargs)

    leaves, treedef = jax.tree.flatten((args, kwargs))
    positions = [i for i, x in enumerate(leaves) if _is_array(x)]
    dynamic = [leaves[i] for i in positions]

    level = _levels.top()
    own = _anchor(dynamic)
    gathers = frozenset(x.index for x in jax.tree.leaves(variables, is_leaf=is_handle) if is_handle(x))
    anchor = level.gather_anchor(own, size, ctx.max_live, gathers)
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
        # One element of every cotangent array: an output nobody reads (an LSTM's final cell state) has a
        # cotangent of zeros, a constant XLA folds, and a tie to it alone let the re-gather merge with the
        # forward gather (a plain-JAX LSTM: 0.67x ZeRO-3's volume, the weights kept through the step).
        pullback = _tie(pullback, _anchor(cotangent, every=True))
        grad_v, grad_dyn, grad_a = pullback(cotangent)
        if any(on_host):
            flat, tree = jax.tree.flatten(grad_v)
            grad_v = tree.unflatten([None if host else g for g, host in zip(flat, on_host)])
        return grad_v, _tie(grad_dyn, _anchor(grad_v, every=True)), grad_a

    call_group.defvjp(call_group_fwd, call_group_bwd)
    # Named, the group's inputs (its residuals) and outputs are what the loss's own checkpoint keeps.
    out = mark_boundary(call_group(variables, mark_boundary(dynamic), anchor))
    level.ran(own, _anchor(out), size, gathers)
    return out


def gather_once_data_exists(handles: dict, data, name: str) -> dict:
    """Leaf index -> `handles[index]` gathered outside any group, once `data` (the inputs of the first
    use) exists: the tie keeps XLA from issuing the gather when the step starts. Named `name` in the
    HLO's metadata, where the memory report finds it. Its backward pass reduce-scatters the gradient
    summed over every use of the result (`sharding.relocate` keeps a shared leaf gathered this way)."""
    name = record_group(name, sum(h.size for h in handles.values()), frozenset(handles))
    anchor = _anchor(data)
    with jax.named_scope(f"{GROUP_SCOPE}{name}{GROUP_SCOPE_END}"):
        # A block boundary: the loss's checkpoint keeps it to the backward pass rather than gathering it
        # again there, where nothing would tie the gather to its uses (XLA issues it when the step starts).
        return {index: mark_boundary(gather(_tie(handle, anchor))) for index, handle in handles.items()}


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
