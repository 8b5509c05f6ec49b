"""Gather groups formed in program order: which equations of a jaxpr the placement pass runs as one group.

DeepSpeed's `stage3_prefetch_bucket_size` is how many parameter elements its prefetcher fetches ahead, in
the order the model used them in the last step. Here the order is the loss's jaxpr, read once: starting
at an equation where a parameter meets the data (a *use*, `zeroflax/sharding/uses.py`), the group takes
the equations that follow while the distinct parameters its uses need number at most
`Config.prefetch_bucket_size` elements; a layer of an unscanned pure-JAX model (its matmul, its bias, its
activation) is then one gather, not three, and the next bucket is prefetched while it computes, as
`max_live_parameters` allows (`sharding.groups._Level`). A group always takes its first use, whatever
its size; a bucket of 0 makes each use a group of its own.

A group stops before an equation it cannot hold:
- a gather group traced already (a Flax module the interceptor made a group, a `zeroflax.group`: a
  `custom_vjp` call, or a collective, anywhere inside the equation), so groups never nest;
- a `scan` that reads a parameter (the pass slices its stacks per iteration) and a use of a leaf kept
  gathered between uses (`max_reuse_distance`), which the pass places on their own;
- a marked entry gather (`sharding.relocate`), and an equation with an effect (a callback), which the
  group's backward pass would run again.
Equations computed from parameters alone (a transpose, a cast: *weight views*) stay lazy, built inside
the group that uses them; the data equations after the last use are left to the equations after the group.

Pure functions of the jaxpr: what the group holds is decided before anything is traced.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from jax.extend import core as jcore

MARK = "zeroflax_gathered_on_entry_"  # + a leaf's index: the name of its marked entry gather

# A trace of a group already placed (a custom_vjp call) or of a collective: a group stops before it.
_GROUP_PRIMITIVES = ("custom_vjp_call", "custom_vjp_call_jaxpr", "all_gather", "all_gather_invariant",
                     "reduce_scatter", "psum_scatter")


@dataclasses.dataclass(frozen=True)
class ProgramGroup:
    """Equations `start`..`end - 1` of a jaxpr as one gather group: `views` (weight views, built lazily
    before it), `body` (the uses and the data equations between them, in order), `leaves` (the parameters
    its uses need, in the order first used) and `uses` (how many equations of `body` use a parameter)."""

    start: int
    end: int
    views: tuple
    body: tuple
    leaves: tuple
    uses: int


def holds_group(eqn) -> bool:
    """Whether `eqn` is, or holds, a gather group already traced or a collective."""
    if eqn.primitive.name in _GROUP_PRIMITIVES:
        return True
    return any(holds_group(inner) for jaxpr in jcore.jaxprs_in_params(eqn.params) for inner in jaxpr.eqns)


def _is_var(atom) -> bool:
    return not isinstance(atom, jcore.Literal)


def is_view(eqn, lazy: dict) -> bool:
    """Whether `eqn` computes from parameters alone (its inputs lazy or literals) without holding a jaxpr:
    a transpose, a cast, a scale. It then stays lazy (`sharding.relocate._Lazy`)."""
    return (any(_is_var(a) and a in lazy for a in eqn.invars)
            and all(not _is_var(a) or a in lazy for a in eqn.invars)
            and not list(jcore.jaxprs_in_params(eqn.params)))


def form_group(eqns: Sequence, start: int, lazy: dict, size_of: Callable[[int], int], bucket: int,
               alone: Callable[[object, list], bool]) -> ProgramGroup | None:
    """The group starting at `eqns[start]`, a use, or None where that use is placed on its own (`alone(eqn,
    leaves)` says so of a scan the pass may slice per iteration, a use of a kept leaf; a group traced
    already) or no other use joins it.

    `lazy`: variable -> the leaves (indices) a lazy value needs, for the values computed so far;
    `size_of`: a leaf's elements gathered; `bucket`: Config.prefetch_bucket_size."""
    first = [leaf for a in eqns[start].invars if _is_var(a) and a in lazy for leaf in lazy[a]]
    if bucket <= 0 or is_view(eqns[start], lazy) or alone(eqns[start], first) or holds_group(eqns[start]):
        return None  # a view stays lazy: the group starts at the use that reads it
    lazy = dict(lazy)
    views, body, leaves, uses, last_use = [], [], [], 0, start
    elements = 0
    for index in range(start, len(eqns)):
        eqn = eqns[index]
        needs = [leaf for a in eqn.invars if _is_var(a) and a in lazy for leaf in lazy[a]]
        if not needs:
            if holds_group(eqn) or marked_leaf(eqn) is not None or eqn.effects:
                break  # an effect (a callback) inside a group would run again when its backward recomputes it
            body.append((index, eqn))
            continue
        if is_view(eqn, lazy):
            for out in eqn.outvars:
                lazy[out] = tuple(dict.fromkeys(needs))
            views.append((index, eqn))
            continue
        if index > start and (alone(eqn, needs) or holds_group(eqn) or eqn.primitive.name == "scan"):
            break
        new = [leaf for leaf in dict.fromkeys(needs) if leaf not in leaves]
        grown = elements + sum(size_of(leaf) for leaf in new)
        if uses and grown > bucket:
            break
        leaves += new
        elements, uses, last_use = grown, uses + 1, index
        body.append((index, eqn))
    end = last_use + 1
    body = tuple(eqn for index, eqn in body if index < end)
    if uses < 2:
        return None  # one use: the pass's group of one equation (`relocate._Evaluation.use`)
    return ProgramGroup(start, end, tuple(eqn for index, eqn in views if index < end), body, tuple(leaves), uses)


def marked_leaf(eqn) -> int | None:
    """The leaf whose entry gather `eqn` is (a jit call named `MARK` + its index), or None."""
    name = eqn.params.get("name") if eqn.primitive.name in ("pjit", "jit") else None
    if isinstance(name, str) and name.startswith(MARK):
        return int(name[len(MARK):])
    return None


def last_reads(jaxpr) -> dict:
    """Variable -> the index of the last equation that reads it (`len(eqns)` for the jaxpr's outputs)."""
    last = {}
    for index, eqn in enumerate(jaxpr.eqns):
        for atom in eqn.invars:
            if _is_var(atom):
                last[atom] = index
    for atom in jaxpr.outvars:
        if _is_var(atom):
            last[atom] = len(jaxpr.eqns)
    return last
