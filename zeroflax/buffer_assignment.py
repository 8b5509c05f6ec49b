"""XLA's buffer assignment of a compiled program: which values occupy which bytes, and when.

`compile_with_buffers` compiles with XLA's dump switched on and reads it: the allocations of
`*-buffer-assignment.txt`, each with the values placed in it (`Allocation`, `Value`; `parse_buffer_dump`),
their defining operation and op_name (`*-buffer-assignment-values.txt`), their live ranges and the whole
step's schedule (`*-live-range.txt`; `parse_sequence`). A region of an allocation holds several values in
turn: `charge_regions` gives each byte to the value occupying it at a moment (else to the one occupying it
longest), and `peak_live` finds the moment when the most bytes of XLA's working buffers are live.
explain.py's layer report and step timeline are built on these.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re
import tempfile

import numpy as np

from zeroflax.hlo import OP_NAME


@dataclasses.dataclass(frozen=True)
class Value:
    """One HLO value XLA placed in an allocation: bytes [offset, offset + size), live [start, end]."""
    id: int
    name: str
    size: int
    offset: int
    dims: tuple | None  # None for a tuple
    start: int = -1  # -1: no live range in the dump
    end: int = -1
    opcode: str = ""
    op_name: str = ""


@dataclasses.dataclass
class Allocation:
    index: int
    size: int
    kind: str  # the dump's description: "parameter 3, ...", "preallocated-temp", "thread-local", ...
    host: bool
    values: list

    @property
    def working(self) -> bool:
        """XLA's own buffers for the step: its temporaries and the outputs not aliased to arguments."""
        return not any(word in self.kind for word in ("parameter", "thread-local", "constant"))


_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+), (.*):$")
_ASSIGNED = re.compile(r"^ value: <(\d+) (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (.*)$")
_DIMS = re.compile(r"^\w+\[([\d,]*)\]")
_DEFINED = re.compile(r"^<(\d+) \S+ @\d+>$")
_INSTRUCTION = re.compile(r"from instruction: %\S+ = (?:\(.*?\)|\S+) ([\w\-]+)\(")
_RANGE = re.compile(r"^\s+(\S+):(\d+)-(\d+)$")


def parse_buffer_dump(assignment: str, values: str, live_range: str) -> list[Allocation]:
    """The allocations of XLA's `*-buffer-assignment.txt`, their values completed with their defining
    operation (`*-buffer-assignment-values.txt`) and live range (`*-live-range.txt`)."""
    defined, current = {}, None
    for line in values.splitlines():
        match = _DEFINED.match(line)
        if match:
            current = int(match.group(1))
        elif current is not None and line.lstrip().startswith("from instruction:"):
            opcode, op_name = _INSTRUCTION.search(line), OP_NAME.search(line)
            defined[current] = (opcode.group(1) if opcode else "", op_name.group(1) if op_name else "")
    ranges, in_ranges = {}, False
    for line in live_range.splitlines():
        if line.strip() == "BufferLiveRange:":
            in_ranges = True
        elif in_ranges:
            match = _RANGE.match(line)
            if not match:
                break
            ranges[match.group(1)] = (int(match.group(2)), int(match.group(3)))
    allocations = []
    for line in assignment.splitlines():
        if line.startswith("Total bytes used"):
            break
        match = _ALLOCATION.match(line)
        if match:
            kind = match.group(3)
            color = re.search(r"color (\d+)", kind)
            allocations.append(Allocation(int(match.group(1)), int(match.group(2)), kind,
                                          bool(color and color.group(1) != "0"), []))
            continue
        match = _ASSIGNED.match(line)
        if match and allocations:
            ident, name, size, offset, shape = match.groups()
            dims = _DIMS.match(shape)
            start, end = ranges.get(name if "{" in name else name + "{}", (-1, -1))
            opcode, op_name = defined.get(int(ident), ("", ""))
            allocations[-1].values.append(Value(
                int(ident), name, int(size), int(offset),
                tuple(int(d) for d in dims.group(1).split(",") if d) if dims else None,
                start, end, opcode, op_name))
    return allocations


def parse_sequence(live_range: str) -> dict[str, int]:
    """{instruction: position} in XLA's schedule of the whole step, loop bodies inlined where they run
    (the `InstructionSequence` of `*-live-range.txt`)."""
    found = re.search(r"InstructionSequence:\n((?:\s+\d+:\S+\n)+)", live_range)
    return {name: int(index) for index, name in re.findall(r"(\d+):(\S+)", found.group(1))} if found else {}


def compile_with_buffers(lowered):
    """(compiled, allocations, schedule): compile `lowered` with XLA's buffer-assignment dump switched on
    (one more compilation than the step's own), and read the dump."""
    with tempfile.TemporaryDirectory(prefix="zeroflax-explain-") as directory:
        compiled = lowered.compile({"xla_dump_to": directory, "xla_dump_hlo_as_text": True})

        def read(suffix: str) -> str:
            paths = sorted(glob.glob(os.path.join(directory, f"*after_optimizations{suffix}")))
            if not paths:
                raise RuntimeError(f"XLA wrote no '*after_optimizations{suffix}' dump in {directory}: "
                                   "this jax/XLA version dumps buffer assignments differently")
            with open(paths[-1]) as f:
                return f.read()

        live_range = read("-live-range.txt")
        allocations = parse_buffer_dump(read("-buffer-assignment.txt"), read("-buffer-assignment-values.txt"),
                                        live_range)
    return compiled, allocations, parse_sequence(live_range)


def charge_regions(allocation: Allocation, moment: int) -> dict[int, int]:
    """{value id: bytes charged}: each byte of the allocation goes to the value occupying it at `moment`,
    else to the one occupying it longest (ties: the larger, then the lower id). Bytes no value occupies
    are not charged."""
    key = lambda v: (v.start <= moment <= v.end, v.end - v.start, v.size, -v.id)
    bounds = sorted({v.offset for v in allocation.values} | {v.offset + v.size for v in allocation.values})
    starting: dict = {}
    for v in allocation.values:
        starting.setdefault(v.offset, []).append(v)
    charged, active = {}, []
    for low, high in zip(bounds, bounds[1:]):
        active = [v for v in active if v.offset + v.size > low] + starting.get(low, [])
        if active:
            owner = max(active, key=key)
            charged[owner.id] = charged.get(owner.id, 0) + high - low
    return charged


def peak_live(allocations: list[Allocation]) -> tuple[int, int]:
    """(bytes, moment): the most bytes of XLA's working buffers live at once, and the first moment
    of XLA's live-range clock they are (values without a live range count throughout)."""
    values = [v for a in allocations if a.working for v in a.values]
    if not values:
        return 0, -1
    horizon = max(v.end for v in values) + 2
    delta = np.zeros(horizon + 1, np.int64)
    for v in values:
        start, end = (v.start, v.end) if v.start >= 0 else (0, horizon - 1)
        delta[start] += v.size
        delta[end + 1] -= v.size
    live = np.cumsum(delta)
    return int(live.max()), int(live.argmax())
