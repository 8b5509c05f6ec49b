"""Reading XLA's HLO text (`compiled.as_text()`): the pieces the reports and the cost model share.

- the module's computations, each with its instruction lines in schedule order (`split_computations`), and
  how many times each runs per step: the sum over its call sites, loop bodies times the loops' known trip
  counts (`computation_multipliers`);
- array types: element types and their bytes (`DTYPE_BYTES`, `ARRAY_TYPE`, `array_bytes`);
- an instruction's attributes: its op_name metadata (`OP_NAME`) and the share of a pipeline tick's loop
  in which its named scope runs (`scope_weight`), a collective's first replica group in any of XLA's three
  spellings (`first_replica_group`) and a collective-permute's source-target pairs
  (`source_target_pairs`);
- the names jax gives the entry computation's arguments (`entry_arguments`).

comm.py reads the collectives with these, memory.py the gathered weights in the schedule, explain.py the
step's arguments and the instructions' name scopes, cost.py the dots' FLOPs.
"""
from __future__ import annotations

import collections
import math
import re

import numpy as np

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e5m2fnuz": 1, "f8e4m3fnuz": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}

# An array in an HLO type: (element type, dimensions), e.g. f32[4,8] -> ('f32', '4,8').
ARRAY_TYPE = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([0-9,]*)\]")
# An instruction's op_name metadata: jax's name scopes of the operation it comes from.
OP_NAME = re.compile(r'op_name="([^"]*)"')
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_CALLEE = re.compile(r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')
_GROUPS_LIST = re.compile(r"replica_groups=\{(\{[^=]*?\})\}")
_IOTA_FULL = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_ARGUMENT = re.compile(r'=\s*\S+\s+parameter\(\d+\).*?op_name="([^"]*)"')


def split_computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """({computation name: its instruction lines, in schedule order}, the ENTRY computation's name)."""
    body: dict[str, list[str]] = {}
    entry = None
    current = None
    for line in hlo_text.splitlines():
        match = _COMPUTATION.match(line)
        if match and "=" not in line.split("(")[0]:
            current = match.group(1)
            body[current] = []
            if line.lstrip().startswith("ENTRY"):
                entry = current
            continue
        if current is not None:
            if line.strip() == "}":
                current = None
            else:
                body[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return body, entry


def computation_multipliers(body: dict, entry: str) -> tuple[dict, bool]:
    """({computation: how many times it runs per step}, whether a loop without a known trip count was
    met (counted once)): the sum over its call sites, loop bodies times their trip counts."""
    multiplier: dict[str, int] = collections.defaultdict(int)
    unknown_trip = False

    def visit(name: str, times: int, depth: int = 0):
        nonlocal unknown_trip
        if depth > 64 or name not in body:
            return
        multiplier[name] += times
        for line in body[name]:
            callees = _CALLEE.findall(line)
            branches = _BRANCHES.search(line)
            if branches:
                callees += [("branch", b.strip().lstrip("%")) for b in branches.group(1).split(",") if b.strip()]
            if not callees:
                continue
            is_while = re.search(r"\swhile\(", line) is not None
            trip = 1
            if is_while:
                found = _TRIP.search(line)
                if found:
                    trip = int(found.group(1))
                else:
                    unknown_trip = True
            for role, callee in callees:
                if role == "to_apply":  # reduction regions hold no collectives
                    continue
                visit(callee, times * (trip if role == "body" else 1), depth + 1)

    visit(entry, 1)
    return multiplier, unknown_trip


def array_bytes(type_text: str) -> list[int]:
    """The bytes of each array of a known element type in an HLO type (`f32[4,8]`, or a tuple of them)."""
    sizes = []
    for dtype, dims in ARRAY_TYPE.findall(type_text):
        if dtype in DTYPE_BYTES:
            count = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
            sizes.append(count * DTYPE_BYTES[dtype])
    return sizes


def scope_weight(attrs: str, weights: dict) -> float:
    """The share of its loop's iterations in which an instruction runs: the weight of the innermost
    named scope of `weights` in its op_name metadata (pipeline tick branches), else 1."""
    op_name = OP_NAME.search(attrs)
    if op_name and weights:
        # The innermost scope wins: the scopes nest in the order the op name lists them.
        scoped = [(op_name.group(1).rfind(scope), w) for scope, w in weights.items() if scope in op_name.group(1)]
        if scoped:
            return max(scoped)[1]
    return 1


def first_replica_group(attrs: str, num_devices: int) -> list[int]:
    """Device (partition) ids of the first replica group; all devices when the groups are implicit.

    Three spellings: listed groups `{{0,2},{1,3}}`; iota `[2,2]<=[4]` (optionally transposed, `T(1,0)`);
    and a device mesh with the axes the groups span, `mesh['axis_0'=2,'axis_1'=2] {'axis_0'}` (ids
    row-major over that mesh; a group varies along the named axes)."""
    iota = _IOTA_FULL.search(attrs)
    if iota:
        shape = [int(v) for v in iota.group(1).split(",")]
        dims = [int(v) for v in iota.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if iota.group(3):
            ids = ids.transpose([int(v) for v in iota.group(3).split(",")])
        return [int(v) for v in ids.reshape(-1, shape[-1])[0]]  # groups of shape[-1] devices
    on_mesh = _GROUPS_MESH.search(attrs)
    if on_mesh:
        axes = re.findall(r"'([^']+)'\s*=\s*(\d+)", on_mesh.group(1))
        spanned = set(re.findall(r"'([^']+)'", on_mesh.group(2)))
        if spanned - {name for name, _ in axes} or re.search(r"[:(]", on_mesh.group(2)):
            raise ValueError(f"replica groups over mesh axes the parser does not know: {on_mesh.group(0)}")
        ids = np.arange(math.prod(int(size) for _, size in axes)).reshape([int(size) for _, size in axes])
        index = tuple(slice(None) if name in spanned else 0 for name, _ in axes)
        return [int(v) for v in ids[index].ravel()]
    listed = _GROUPS_LIST.search(attrs)
    if listed:
        first = listed.group(1).split("}")[0].strip("{ ")
        return [int(x) for x in first.split(",") if x.strip()]
    return list(range(num_devices))


def source_target_pairs(attrs: str) -> list[tuple[int, int]]:
    """A collective-permute's (source, target) device pairs; empty where it lists none."""
    found = _PAIRS.search(attrs)
    if not found:
        return []
    return [tuple(int(v) for v in pair.split(",")) for pair in re.findall(r"\{(\d+,\d+)\}", found.group(1))]


def entry_arguments(hlo_text: str) -> set:
    """The names jax gives the compiled step's arguments ("state.params['w']", "batch['x']"), read
    from its entry parameters' metadata; empty where a jax version writes none."""
    body, entry = split_computations(hlo_text)
    return {match.group(1).replace("\\'", "'") for line in body.get(entry, []) for match in [_ARGUMENT.search(line)]
            if match}
