"""ZeRO-3 gathers moved from the loss's entry to each use of the parameter, read from the program (issue 42).

A ZeRO-3 leaf that no module, group or scan gathers itself (a tied head's `wte.T`, `x @ w`, `w[ids]`), and
every leaf of a loss that cannot run on handles at all (a plain `lax.scan` over a dict of stacked arrays,
an `nn.scan` without the 'layers' name), used to be gathered once when the loss starts and kept to the
backward pass: the tied token embedding, the largest tensor of most language models, or the whole model,
on every device for the whole step. Here the loss is traced once to a jaxpr with each such gather marked
(`gathered_on_entry`), and the jaxpr is evaluated with the marked gathers left out: their results become
*lazy* values (the handle, and the weight-only equations that follow it: a transpose, a cast), and

- each equation where a lazy value meets the data (`zeroflax/sharding/uses.py` calls that a use) runs in a
  gather group (`sharding.groups.run_group`), with the uses after it in program order while their leaves
  fit in Config.prefetch_bucket_size (`sharding.program_groups`; one use alone with a bucket of 0): the
  leaves are gathered just before it, dropped after it, gathered again for its backward pass (unless the
  group is a lookup, `_linear_in`), and their gradient reduce-scattered there. A tied embedding is
  gathered at the lookup and at the head, never between;
- a leaf several groups share within Config.max_reuse_distance (`kept`) is gathered at its first use
  instead, tied to that use's inputs from the batch, and handed to the later uses as an input (`keep`);
- a `scan` that takes stacks as its scanned inputs runs again with each stack as a handle sliced per
  iteration (`scan_per_iteration`): each iteration gathers its layer, checkpointed, as `scan_layers` does.

Every other equation is evaluated as `jax.core.eval_jaxpr` would (same primitives, same parameters, the
same source information and name stack, so the groups the module interceptor made keep their names in
the compiled program's metadata, where the memory report finds them). Any other equation that holds
jaxprs (a `jit`, a `custom_vjp`, a `cond`, a loop over a stack read whole at each iteration) and takes a
lazy value runs whole inside one group: correct, and no worse than on entry.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend import core as jcore
from jax.extend import source_info_util

from zeroflax.compat import scan_counts
from zeroflax.sharding.context import current_context
from zeroflax.sharding.groups import gather_once_data_exists, record_group, run_group
from zeroflax.sharding.handles import ShardedLeaf, gather
from zeroflax.sharding.program_groups import MARK, ProgramGroup, form_group, last_reads, marked_leaf
from zeroflax.sharding.scopes import GROUP_SCOPE, SCOPE_END as GROUP_SCOPE_END
from zeroflax.sharding.remat import mark_boundary, remat_policy

def gathered_on_entry(handle: ShardedLeaf, index: int):
    """`handle` gathered, marked in the jaxpr as the entry gather of leaf `index` (a named jit call)."""
    def gather(shard, source):
        return dataclasses.replace(handle, shard=shard, source=source)._gathered()

    gather.__name__ = f"{MARK}{index}"
    return jax.jit(gather)(handle.shard, handle.source)


@dataclasses.dataclass(frozen=True)
class _Lazy:
    """A value computed from parameters alone, not computed yet: the handles it needs (leaf index ->
    handle) and how to build it from those leaves gathered; `root`: the leaf, when the value is that
    leaf itself (no equation applied yet), which a scan can then read one slice per iteration; `linear`:
    whether the value is linear in the leaves (then a use that meets only integers, a lookup, does not need
    the leaves again for its backward pass)."""

    handles: dict
    build: Callable[[dict], Any]
    root: int | None = None
    linear: bool = True  # built from the leaves by linear equations only (a cast, a transpose)


def _leaf(index: int) -> Callable[[dict], Any]:
    return lambda gathered: gathered[index]


# Equations linear in their one parameter input when every other input is a literal or an integer (a
# cast, a transpose, a lookup `w[ids]`): a use built of these alone, whose results are its outputs, has a
# backward pass that scatters the cotangent and needs no parameters, so it gathers them only forward.
_LINEAR = {"convert_element_type", "transpose", "reshape", "broadcast_in_dim", "squeeze", "expand_dims", "slice",
           "rev", "copy", "neg", "mul", "div", "reduce_sum", "gather", "dynamic_slice"}
# Equations that pass each input to the output in its place (a tie between a gather and its anchor).
_PER_OPERAND = {"optimization_barrier"}
# Sums: linear in each input, whatever the other (a gather tied to its anchor by adding a zero).
_SUMS = {"add", "sub", "add_any"}


def _linear_in(eqns, tainted: set) -> bool:
    """Whether the values in `tainted` (parameters) go through linear equations only and meet no
    floating-point value on the way but in a sum: then a pass over `eqns` is linear in the parameters and
    its backward pass does not need them. Jaxprs inside equations (a `jit`, a `custom_vjp` call, a checkpoint) are
    followed; a loop or a branch is taken to need them."""
    is_var = lambda a: not isinstance(a, jcore.Literal)
    for eqn in eqns:
        hit = [is_var(a) and a in tainted for a in eqn.invars]
        if not any(hit):
            continue
        name = eqn.primitive.name
        if name in _PER_OPERAND:
            tainted.update(o for o, h in zip(eqn.outvars, hit) if h)
            continue
        inner = list(jcore.jaxprs_in_params(eqn.params))
        if inner:
            jaxpr = inner[0]
            if len(inner) != 1 or name in ("scan", "while", "cond") or len(jaxpr.invars) != len(eqn.invars):
                return False
            inside = {v for v, h in zip(jaxpr.invars, hit) if h}
            if not _linear_in(jaxpr.eqns, inside):
                return False
            tainted.update(o for o, v in zip(eqn.outvars, jaxpr.outvars) if is_var(v) and v in inside)
            continue
        others = [a for a, h in zip(eqn.invars, hit) if not h]
        if name in _SUMS:
            tainted.update(eqn.outvars)
            continue
        if name not in _LINEAR or sum(hit) != 1 or any(
                is_var(a) and jnp.issubdtype(a.aval.dtype, jnp.inexact) for a in others):
            return False
        tainted.update(eqn.outvars)
    return True


def _is_lookup(eqns, lazies: dict) -> bool:
    """Whether equations `eqns` are linear in their parameters (`_linear_in`), `lazies` being their lazy
    inputs (variable -> `_Lazy`): an embedding lookup `w[ids]`, `jnp.take`, an embedding module's gather
    group; the backward pass needs no parameters, so only the forward gathers."""
    return all(v.linear for v in lazies.values()) and _linear_in(list(eqns), set(lazies))


def _lazy_inputs(eqn, values: Sequence[Any]) -> dict:
    """`eqn`'s input variables whose values are lazy, with those values."""
    return {a: v for a, v in zip(eqn.invars, values) if isinstance(v, _Lazy) and not isinstance(a, jcore.Literal)}


def _count_placed(leaves, lookup: bool) -> None:
    """Note one more group of the pass for each of `leaves` (and whether it is a lookup), for the
    communication report's theory (`GatherUsage.placed_by_leaf`)."""
    ctx = current_context()
    if ctx is None or ctx.usage is None:
        return
    for index in leaves:
        ctx.usage.placed[index] = ctx.usage.placed.get(index, 0) + 1
        if lookup:
            ctx.usage.lookups[index] = ctx.usage.lookups.get(index, 0) + 1


def _per_iteration(handle: ShardedLeaf) -> ShardedLeaf | None:
    """The handle of a stack read by a scan, as one whose slices (along its first dimension) are each
    gathered on their own; None where its partitioned dimension is the first (one slice is then on one
    device only, and the scan gets it whole)."""
    if handle.stacked or handle.dim < 1 or len(handle.shape) < 2:
        return None
    sliced = handle.sliced[1:] if handle.sliced else handle.sliced
    return dataclasses.replace(handle, dim=handle.dim - 1, shape=tuple(handle.shape[1:]), sliced=sliced)


def _bind(eqn, values: Sequence[Any]):
    """`eqn` applied to `values`, as `jax.core.eval_jaxpr` applies it (source information, name stack)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        out = eqn.primitive.bind(*values, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


class _Evaluation:
    def __init__(self, templates: dict[int, ShardedLeaf], names: dict[int, str], kept: frozenset = frozenset()):
        self.templates, self.names, self.kept = templates, names, kept
        self.kept_values: dict = {}  # leaf index -> its gathered array, from its first use on
        self.from_weights: set = set()  # variables of the outer jaxpr computed from parameters and constants

    def run(self, jaxpr, consts, args, weights: int = 0) -> list:
        """The values of `jaxpr`'s outputs; its first `weights` inputs are the parameters."""
        env: dict = {}
        lazy: dict = {}  # variable -> the leaves its lazy value needs (`program_groups.form_group` reads it)
        read = lambda atom: atom.val if isinstance(atom, jcore.Literal) else env[atom]

        def assign(variables, values):
            for var, value in zip(variables, values):
                env[var] = value
                if isinstance(value, _Lazy):
                    lazy[var] = tuple(value.handles)

        assign(jaxpr.constvars, consts)
        assign(jaxpr.invars, args)
        if weights:  # the outer jaxpr: its constants (a table of positions) exist from the start too
            self.from_weights.update(list(jaxpr.constvars) + list(jaxpr.invars[:weights]))
        eqns, index, last = jaxpr.eqns, 0, None
        while index < len(eqns):
            eqn = eqns[index]
            values = [read(v) for v in eqn.invars]
            leaf = marked_leaf(eqn)
            touches_lazy = any(isinstance(v, _Lazy) for v in values)
            if leaf is None and touches_lazy:
                grouped = form_group(eqns, index, lazy, lambda k: self.templates[k].size, self.bucket(), self.alone)
                if grouped is not None:
                    last = last if last is not None else last_reads(jaxpr)
                    self.run_program_group(grouped, eqns, env, assign, last)
                    index = grouped.end
                    continue
            self.note_origin(eqn)
            if leaf is not None:
                template = self.templates[leaf]
                handle = dataclasses.replace(template, shard=values[0], source=values[1] if len(values) > 1 else None)
                outs = [_Lazy({leaf: handle}, _leaf(leaf), root=leaf)]
            elif touches_lazy:
                outs = self.lazy_or_use(eqn, values)
            else:
                outs = _bind(eqn, values)
            assign(eqn.outvars, outs)
            index += 1
        return [self.materialize(read(v)) for v in jaxpr.outvars]

    def note_origin(self, eqn) -> None:
        """Note `eqn`'s outputs as computed from parameters and constants alone when its inputs are."""
        if not any(self.from_data(a) for a in eqn.invars):
            self.from_weights.update(eqn.outvars)

    @staticmethod
    def bucket() -> int:
        ctx = current_context()
        return ctx.bucket if ctx is not None else 0

    def alone(self, eqn, leaves) -> bool:
        """Whether a use is placed on its own, never in a program-order group: a scan (its stacks sliced per
        iteration), a use of a kept leaf (gathered once, at its first use)."""
        return eqn.primitive.name == "scan" or any(leaf in self.kept for leaf in leaves)

    def run_program_group(self, grouped: ProgramGroup, eqns, env: dict, assign, last: dict) -> None:
        """Equations `grouped.start`..`grouped.end - 1` as one gather group (`program_groups`): its weight
        views built lazily first, then its body (uses and the data equations between them) inside one
        `run_group`, gathering the distinct leaves its uses need once; the body's values read after it
        are its outputs."""
        for eqn in eqns[grouped.start:grouped.end]:
            self.note_origin(eqn)
        read = lambda atom: atom.val if isinstance(atom, jcore.Literal) else env[atom]
        for eqn in grouped.views:
            assign(eqn.outvars, self.lazy_or_use(eqn, [read(v) for v in eqn.invars]))
        defined = [v for eqn in grouped.body for v in eqn.outvars]  # in program order: the group's signature
        inside, inputs, lazies = set(defined), [], []
        for eqn in grouped.body:
            for atom in eqn.invars:
                if isinstance(atom, jcore.Literal) or atom in inside:
                    continue
                inside.add(atom)
                (lazies if isinstance(env[atom], _Lazy) else inputs).append(atom)
        inputs.sort(key=lambda atom: not self.from_data(atom))  # the batch's first: see `use`
        outputs = [v for v in defined if last.get(v, -1) >= grouped.end]
        handles = {k: h for atom in lazies for k, h in env[atom].handles.items()}

        def apply(gathered, *dyn):
            local = dict(zip(inputs, dyn))
            for atom in lazies:
                local[atom] = env[atom].build(gathered)
            value = lambda atom: atom.val if isinstance(atom, jcore.Literal) else local[atom]
            for eqn in grouped.body:
                local.update(zip(eqn.outvars, _bind(eqn, [value(a) for a in eqn.invars])))
            return [local[v] for v in outputs]

        _count_placed(handles, _is_lookup(grouped.body, {a: env[a] for a in lazies}))
        ends = [self.names.get(k, str(k)) for k in (grouped.leaves[0], grouped.leaves[-1])]
        name = "uses:" + (ends[0] if len(grouped.leaves) == 1 else "..".join(ends))
        outs = run_group(apply, {k: handles[k] for k in sorted(handles)}, tuple(env[a] for a in inputs), name=name)
        assign(outputs, outs)

    def lazy_or_use(self, eqn, values: list) -> list:
        lazies = [v for v in values if isinstance(v, _Lazy)]
        handles = {k: h for lazy in lazies for k, h in lazy.handles.items()}
        if eqn.primitive.name == "scan":
            outs = self.scan_per_iteration(eqn, values)
            if outs is not None:
                return outs
        weight_only = all(isinstance(v, _Lazy) or isinstance(a, jcore.Literal) for v, a in zip(values, eqn.invars))
        if weight_only and not list(jcore.jaxprs_in_params(eqn.params)):
            # A transpose, a cast, a scale by a literal: built after the gather, inside the use's group.
            def build(gathered, i):
                return _bind(eqn, [v.build(gathered) if isinstance(v, _Lazy) else v for v in values])[i]

            linear = _is_lookup([eqn], _lazy_inputs(eqn, values))
            return [_Lazy(handles, lambda gathered, i=i: build(gathered, i), linear=linear)
                    for i in range(len(eqn.outvars))]
        return self.use(eqn, values, handles)

    def from_data(self, atom) -> bool:
        """Whether `atom` may depend on the batch: a variable not computed from parameters and constants
        alone (a literal is a constant, and unhashable)."""
        return not isinstance(atom, jcore.Literal) and atom not in self.from_weights

    def use(self, eqn, values: list, handles: dict) -> list:
        """`eqn` as a gather group of its own: the lazy inputs gathered and built inside it. A leaf of
        `kept` is gathered at its first use only, outside the group, and handed to this use and the later
        ones as an input (`keep`)."""
        # The inputs from the batch first: the group's gather is tied to its first floating input, and a
        # tie to a value computed from constants alone (a scan's initial carry of zeros) is folded away.
        positions = sorted((i for i, v in enumerate(values) if not isinstance(v, _Lazy)),
                           key=lambda i: not self.from_data(eqn.invars[i]))
        dynamic = [values[i] for i in positions]
        kept = sorted(k for k in handles if k in self.kept)
        if kept:
            data = [values[i] for i in positions if self.from_data(eqn.invars[i])]
            dynamic += self.keep({k: handles[k] for k in kept}, data)
            handles = {k: h for k, h in handles.items() if k not in self.kept}

        def apply(gathered, *dyn):
            gathered = {**gathered, **dict(zip(kept, dyn[len(positions):]))}
            full = [v.build(gathered) if isinstance(v, _Lazy) else None for v in values]
            for i, x in zip(positions, dyn):
                full[i] = x
            return _bind(eqn, full)

        if not handles:  # every leaf it needs is kept gathered: the equation as it was
            return apply({}, *dynamic)
        _count_placed(handles, _is_lookup([eqn], _lazy_inputs(eqn, values)))
        leaves = ":".join(self.names.get(k, str(k)) for k in sorted(handles))
        return run_group(apply, {k: handles[k] for k in sorted(handles)}, tuple(dynamic),
                         name=f"{eqn.primitive.name}:{leaves}")

    def keep(self, handles: dict, data: list) -> list:
        """The gathered arrays of the kept leaves in `handles` (sorted by index): each gathered at its first
        use, once that use's inputs `data` exist, and kept for the uses after it (DeepSpeed's
        max_reuse_distance). The gather's backward pass reduce-scatters the gradient once, summed over
        every use."""
        new = {k: h for k, h in handles.items() if k not in self.kept_values}
        if new:
            name = "kept:" + ":".join(self.names.get(k, str(k)) for k in sorted(new))
            self.kept_values.update(gather_once_data_exists(new, data, name))
        return [self.kept_values[k] for k in sorted(handles)]

    def scan_per_iteration(self, eqn, values: list) -> list | None:
        """A scan that reads parameter stacks as its scanned inputs, run again with each stack as a handle
        sliced per iteration: each iteration is a layer, gathered whole at its start and dropped after it,
        checkpointed with Config.remat's policy, so its backward pass gathers it once more, as
        `zeroflax.scan_layers` runs a stack. None where that cannot be done: a parameter among the scan's
        constants or initial carry (used whole at every iteration), a stack transformed before the scan,
        or one partitioned along its first dimension; the scan then runs whole inside one group."""
        params = eqn.params
        n_consts, n_carry = scan_counts(params)
        consts, init, xs = values[:n_consts], values[n_consts:n_consts + n_carry], values[n_consts + n_carry:]
        if any(isinstance(v, _Lazy) for v in consts + init):
            return None
        stacks = {}
        for i, v in enumerate(xs):
            if isinstance(v, _Lazy):
                handle = _per_iteration(v.handles[v.root]) if v.root is not None else None
                if handle is None:
                    return None
                stacks[i] = (v.root, handle)
        body = params["jaxpr"]
        scanned = [stacks[i][1] if i in stacks else v for i, v in enumerate(xs)]
        leaves = sorted(k for k, _ in stacks.values())
        name = f"layer:{self.names.get(leaves[0], leaves[0])}"
        ctx = current_context()
        _count_placed(leaves, lookup=False)
        policy = remat_policy(ctx.remat) if ctx is not None else None
        name = record_group(name, sum(h.size for _, h in stacks.values()), frozenset(leaves), remat=policy is not None)

        def step(carry, sliced):
            # The scope names the layer's gathers in the HLO's metadata, where the memory report finds them.
            with jax.named_scope(f"{GROUP_SCOPE}{name}{GROUP_SCOPE_END}"):
                sliced = [gather(x) if i in stacks else x for i, x in enumerate(sliced)]
            outs = self.run(body.jaxpr, body.consts, list(consts) + list(carry) + sliced)
            return outs[:n_carry], outs[n_carry:]

        # Config.remat per iteration, as zeroflax.scan_layers applies it: a layer's activations (and its
        # gathered weights) are recomputed in its backward pass, the carries kept.
        if policy is not None:
            checkpointed = jax.checkpoint(step, policy=policy, prevent_cse=False)
            step = lambda carry, sliced: checkpointed(mark_boundary(carry), sliced)

        carry, ys = jax.lax.scan(step, list(init), scanned, length=params["length"], reverse=params["reverse"],
                                 unroll=params["unroll"])
        return list(carry) + list(ys)

    def materialize(self, value):
        """A lazy output of the loss (a weight returned or reduced alone) built in a group of its own."""
        if not isinstance(value, _Lazy):
            return value
        handles = {k: value.handles[k] for k in sorted(value.handles)}
        return run_group(lambda gathered: value.build(gathered), handles, (), name="output")


def relocated(fn: Callable, templates: dict[int, ShardedLeaf], names: dict[int, str],
              kept: frozenset = frozenset()) -> Callable:
    """`fn` (whose entry gathers are marked with `gathered_on_entry`) with each marked gather moved to
    the uses of its leaf; its first argument holds the parameters. `templates`: leaf index -> its handle
    as traced (shape, axis, dtype); `names`: leaf index -> its path, for the groups' names; `kept`: leaves
    gathered at their first use and kept for the later ones (shared within Config.max_reuse_distance)
    rather than gathered at each."""
    def call(*args):
        closed, shapes = jax.make_jaxpr(fn, return_shape=True)(*args)
        flat = jax.tree.leaves(args)
        outs = _Evaluation(templates, names, kept).run(closed.jaxpr, closed.consts, flat,
                                                       weights=len(jax.tree.leaves(args[0])))
        return jax.tree.unflatten(jax.tree.structure(shapes), outs)

    return call
