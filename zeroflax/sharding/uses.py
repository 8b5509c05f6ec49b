"""Where a program uses each parameter: the analysis under ZeRO-3's placement by the program (issue 42).

ZeRO-3 gathers a parameter just before it is used and drops it after. A module interceptor sees module
calls; the program sees every use, whatever the code that makes it: a tied head's `x @ wte.T` outside any
module, `params['w'][ids]`, a plain `lax.scan` over stacked layers. This module reads a jaxpr and lists,
in program order, each place where a parameter meets the data.

What counts as a use. Each value of the jaxpr is one of:
  - a weight view: computed from parameters only (the parameter itself, its all-gather, `w.T`,
    `w.astype(bf16)`, `w * 2`): the same numbers every step, whatever the batch;
  - data: anything that depends on the inputs that are not parameters (the batch, the RNG, the carry);
  - a constant: neither (literals, closed-over arrays, iotas).
An equation that takes a weight view and data is a *use* of every parameter behind that view: that is
where ZeRO-3 must have the parameter whole (the weight-only equations leading to it, a transpose or a
cast, can run right there, after the gather). A weight view among the program's outputs is a use too
(a regulariser that sums the weights).

Loops. A parameter that reaches a `scan` as a scanned input (`xs`, a stack of layers) is used one slice
per iteration: its uses inside the body are marked `per_iteration`, and ZeRO-3 can gather one layer's
slice at a time. One that reaches a loop as a constant (a `scan` const, a `while` or `fori_loop` body
const) is used whole at every iteration of that loop. Calls (`jit`, `checkpoint`, `custom_jvp`,
`custom_vjp`, `cond` branches and anything else that holds jaxprs whose inputs are its own) are read
through: their inner uses are the program's, at their place in program order.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jcore
from jax.extend import source_info_util

from zeroflax.compat import scan_counts

# A value's kind: DATA, CONSTANT, or a weight view, which is the frozenset of (leaf, per_iteration) it
# derives from.
DATA = "data"
CONSTANT = "constant"


@dataclasses.dataclass(frozen=True)
class Use:
    """One use of a parameter leaf: equation `order` in program order (nested equations counted where
    they run), its primitive, whether it sees one slice per loop iteration (a stack of layers read by
    `scan`) or the whole leaf, the loops around it (outermost first), its source line, and the
    primitives of every call and loop around it (outermost first: a gather group is a `custom_vjp_call`)."""

    leaf: int
    order: int
    primitive: str
    per_iteration: bool
    loops: tuple[str, ...]
    source: str
    inside: tuple[str, ...] = ()

    @property
    def whole_in_loop(self) -> bool:
        """Used whole at every iteration of a loop: gathering it there would gather it per iteration."""
        return bool(self.loops) and not self.per_iteration


def _join(kinds: Sequence[Any]):
    """The kind of a value computed from values of these kinds."""
    if any(k == DATA for k in kinds):
        return DATA
    views = [k for k in kinds if isinstance(k, frozenset)]
    return frozenset().union(*views) if views else CONSTANT


class _Walk:
    def __init__(self):
        self.order = 0
        self.uses: list[Use] = []
        self.inside: tuple[str, ...] = ()  # the calls and loops being walked, outermost first

    def nested(self, eqn, jaxpr, kinds: Sequence[Any], loops: tuple[str, ...]) -> list:
        """Walk the jaxpr of a call or loop `eqn` holds."""
        outer = self.inside
        self.inside = outer + (eqn.primitive.name,)
        try:
            return self.jaxpr(jaxpr, kinds, loops)
        finally:
            self.inside = outer

    def note(self, view: frozenset, eqn, loops: tuple[str, ...]) -> None:
        source = source_info_util.summarize(eqn.source_info) if eqn is not None else "the program's output"
        name = eqn.primitive.name if eqn is not None else "output"
        for leaf, per_iteration in sorted(view):
            self.uses.append(Use(leaf, self.order, name, per_iteration, loops, source, self.inside))

    def jaxpr(self, jaxpr, kinds: Sequence[Any], loops: tuple[str, ...]) -> list:
        """Walk `jaxpr` (open) with its invars of these kinds; the kinds of its outvars."""
        env = {}
        for var, kind in zip(jaxpr.invars, kinds):
            env[var] = kind
        for var in jaxpr.constvars:
            env[var] = CONSTANT

        def kind_of(atom):
            return CONSTANT if isinstance(atom, jcore.Literal) else env.get(atom, CONSTANT)

        for eqn in jaxpr.eqns:
            self.order += 1
            in_kinds = [kind_of(v) for v in eqn.invars]
            out_kinds = self.eqn(eqn, in_kinds, loops)
            for var, kind in zip(eqn.outvars, out_kinds):
                env[var] = kind
        return [kind_of(v) for v in jaxpr.outvars]

    def eqn(self, eqn, in_kinds: list, loops: tuple[str, ...]) -> list:
        name = eqn.primitive.name
        if name == "scan":
            return self.scan(eqn, in_kinds, loops)
        if name == "while":
            return self.while_loop(eqn, in_kinds, loops)
        if name == "cond":
            return self.cond(eqn, in_kinds, loops)
        inner = list(jcore.jaxprs_in_params(eqn.params))
        if inner and all(len(j.invars) == len(eqn.invars) for j in inner) and any(
                isinstance(k, frozenset) for k in in_kinds):
            # A call (jit, checkpoint, custom_jvp/vjp, shard_map): its jaxpr's inputs are the equation's.
            # The first is the primal jaxpr; a custom rule's other jaxprs run on the same values.
            outs = self.nested(eqn, inner[0], in_kinds, loops)
            if len(outs) == len(eqn.outvars):
                return outs
        kind = _join(in_kinds)
        if kind == DATA and any(isinstance(k, frozenset) for k in in_kinds):
            self.note(frozenset().union(*[k for k in in_kinds if isinstance(k, frozenset)]), eqn, loops)
        return [kind] * len(eqn.outvars)

    def scan(self, eqn, in_kinds: list, loops: tuple[str, ...]) -> list:
        params = eqn.params
        body = params["jaxpr"].jaxpr
        n_consts, n_carry = scan_counts(params)
        consts, carry, xs = (in_kinds[:n_consts], in_kinds[n_consts:n_consts + n_carry],
                             in_kinds[n_consts + n_carry:])
        # A scanned input's slice: the same leaves, one layer at a time.
        xs = [frozenset((leaf, True) for leaf, _ in k) if isinstance(k, frozenset) else k for k in xs]
        # The carry is data from the first iteration on, whatever its initial value.
        carry = [DATA for _ in carry]
        outs = self.nested(eqn, body, consts + carry + xs, loops + ("scan",))
        n_ys = len(outs) - n_carry
        return [DATA] * n_carry + [_stacked(k) for k in outs[n_carry:n_carry + n_ys]]

    def while_loop(self, eqn, in_kinds: list, loops: tuple[str, ...]) -> list:
        params = eqn.params
        n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
        cond_consts, body_consts = in_kinds[:n_cond], in_kinds[n_cond:n_cond + n_body]
        carry = [DATA] * (len(in_kinds) - n_cond - n_body)
        self.nested(eqn, params["cond_jaxpr"].jaxpr, cond_consts + carry, loops + ("while",))
        self.nested(eqn, params["body_jaxpr"].jaxpr, body_consts + carry, loops + ("while",))
        return [DATA] * len(eqn.outvars)

    def cond(self, eqn, in_kinds: list, loops: tuple[str, ...]) -> list:
        outs = [CONSTANT] * len(eqn.outvars)
        for branch in eqn.params["branches"]:
            branch_outs = self.nested(eqn, branch.jaxpr, in_kinds[1:], loops)
            outs = [_join([a, b]) for a, b in zip(outs, branch_outs)]
        if in_kinds[0] == DATA:  # the branch taken depends on the data: so do its outputs
            outs = [DATA if isinstance(k, frozenset) else k for k in outs]
        return outs


def _stacked(kind):
    """A per-iteration weight view stacked again by a scan's outputs is the stack's view."""
    if isinstance(kind, frozenset):
        return frozenset((leaf, False) for leaf, _ in kind)
    return kind


def uses_in_jaxpr(jaxpr, leaf_of_input: dict[int, int], *, outputs_are_uses: bool = True) -> list[Use]:
    """The uses, in program order, of the parameters that reach `jaxpr` (open or closed) as the inputs
    `leaf_of_input` names (input position -> leaf index); every other input is data."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    kinds = [frozenset({(leaf_of_input[i], False)}) if i in leaf_of_input else DATA
             for i in range(len(jaxpr.invars))]
    walk = _Walk()
    outs = walk.jaxpr(jaxpr, kinds, ())
    if outputs_are_uses:
        walk.order += 1
        for kind in outs:
            if isinstance(kind, frozenset):
                walk.note(kind, None, ())
    return walk.uses


def parameter_uses(fn: Callable, params, *args, **kwargs) -> list[Use]:
    """The uses of `params`' leaves (indices in `jax.tree.leaves(params)` order) by `fn(params, *args,
    **kwargs)`, traced abstractly; everything in `args` and `kwargs` is data."""
    leaves, treedef = jax.tree.flatten(params)
    closed = jax.make_jaxpr(lambda p, a, k: fn(treedef.unflatten(p), *a, **k))(leaves, args, kwargs)
    return uses_in_jaxpr(closed, {i: i for i in range(len(leaves))})


def uses_by_leaf(uses: Sequence[Use]) -> dict[int, list[Use]]:
    """The uses grouped by leaf, each leaf's in program order."""
    by_leaf: dict[int, list[Use]] = {}
    for use in uses:
        by_leaf.setdefault(use.leaf, []).append(use)
    return by_leaf
