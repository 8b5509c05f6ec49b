"""Pipeline schedules as data: which stage runs which micro-batch forward or backward at which tick.

A schedule is one small table built by a pure function of (name, stages S, micro-batches M, virtual
stages V). The compiled step executes exactly this table (`pipeline.executor` turns it into arrays),
and `Engine.pipeline_schedule()` returns it, so what the docs draw is what runs. One tick is one
forward or one backward of one micro-batch through one stage's share of the layers (a chunk of
L/(S·V) layers when V > 1).

    gpipe        all forwards, then all backwards: F(m, s) at tick m + s, B(m, s) at tick
                 (M + S - 1) + m + (S - 1 - s). 2(M + S - 1) ticks; a stage holds M inputs.
    1f1b         DeepSpeed's TrainSchedule: F(m, s) at tick 2m + s, B(m, s) at tick 2m + 2S - 1 - s.
                 2(M + S - 1) ticks; stage s runs min(S - s, M) forwards before its first backward
                 and holds at most that many inputs.
    interleaved  Megatron's interleaved 1F1B: V chunks per device (virtual stage k = v·S + s runs on
                 device s), each device running its operations in Megatron's order (warm-up of
                 2(S - s - 1) + (V - 1)·S forwards, then one forward, one backward), each as early as
                 its inputs allow. Needs M divisible by S. Idle fraction (S - 1)/(V·M + S - 1).

In every schedule a stage is idle for 2(S - 1) ticks of chunk work, so its idle fraction is
(S - 1)/(M + S - 1) for gpipe and 1f1b and (S - 1)/(V·M + S - 1) interleaved (the tests check it).
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

SCHEDULES = ("gpipe", "1f1b", "interleaved")


class Op(NamedTuple):
    kind: str  # 'F' or 'B'
    micro: int  # micro-batch index
    chunk: int = 0  # virtual stage chunk on this device (0 unless interleaved)


@dataclasses.dataclass(frozen=True)
class Schedule:
    name: str
    stages: int
    micro_batches: int
    virtual: int
    ticks: tuple  # ticks[t][s]: the Op stage s runs at tick t, or None (idle)

    @property
    def num_ticks(self) -> int:
        return len(self.ticks)

    def stage_ops(self, stage: int) -> list:
        """What `stage` runs at each tick: ('F', m) / ('B', m) (with the chunk, ('F', m, v), when
        V > 1) or None."""
        out = []
        for row in self.ticks:
            op = row[stage]
            out.append(None if op is None else (tuple(op) if self.virtual > 1 else (op.kind, op.micro)))
        return out

    def idle_fraction(self, stage: int) -> float:
        return sum(row[stage] is None for row in self.ticks) / self.num_ticks

    def bubble_fraction(self) -> float:
        """Idle share of all stage-ticks (the same for every stage in these schedules)."""
        return sum(self.idle_fraction(s) for s in range(self.stages)) / self.stages

    def virtual_stage(self, stage: int, chunk: int) -> int:
        return chunk * self.stages + stage

    def in_flight(self, stage: int) -> int:
        """The most micro-batch inputs `stage` holds at once (forward done, backward not yet)."""
        live, most = 0, 0
        for row in self.ticks:
            op = row[stage]
            if op is not None:
                live += 1 if op.kind == "F" else -1
                most = max(most, live)
        return most


def _gpipe(S: int, M: int):
    table = {}
    for s in range(S):
        for m in range(M):
            table[(m + s, s)] = Op("F", m)
            table[(M + S - 1 + m + S - 1 - s, s)] = Op("B", m)
    return table


def _one_f_one_b(S: int, M: int):
    table = {}
    for s in range(S):
        for m in range(M):
            table[(2 * m + s, s)] = Op("F", m)
            table[(2 * m + 2 * S - 1 - s, s)] = Op("B", m)
    return table


def _megatron_order(S: int, M: int, V: int, s: int) -> list[Op]:
    """The order device `s` runs its V·M forwards and V·M backwards in Megatron's interleaved 1F1B."""
    total = M * V

    def op(kind: str, i: int) -> Op:
        group = i // S
        chunk = group % V if kind == "F" else V - 1 - group % V
        return Op(kind, (i // (S * V)) * S + i % S, chunk)

    warmup = min(total, 2 * (S - s - 1) + (V - 1) * S)
    order = [op("F", i) for i in range(warmup)]
    for j in range(total - warmup):
        order += [op("F", warmup + j), op("B", j)]
    order += [op("B", j) for j in range(total - warmup, total)]
    return order


def _as_soon_as_possible(S: int, M: int, V: int, orders: list[list[Op]]):
    """Tick of every op: each device runs its ops in order, each at the first tick after its inputs
    (the previous virtual stage's forward, the next one's backward) are done."""
    last = S * V - 1
    done: dict = {}  # (kind, micro, virtual stage) -> tick it ran
    table = {}
    position = [0] * S
    tick = 0
    while any(position[s] < len(orders[s]) for s in range(S)):
        ran = []
        for s in range(S):
            if position[s] == len(orders[s]):
                continue
            op = orders[s][position[s]]
            k = op.chunk * S + s
            if op.kind == "F":
                needs = [("F", op.micro, k - 1)] if k > 0 else []
            else:
                needs = [("F", op.micro, k)] + ([("B", op.micro, k + 1)] if k < last else [])
            if all(done.get(n, tick) < tick for n in needs):
                table[(tick, s)] = op
                ran.append((op.kind, op.micro, k))
                position[s] += 1
        for key in ran:
            done[key] = tick
        tick += 1
        if tick > 4 * (V * M + S) * S:  # cannot happen for a valid order: fail loudly, never hang
            raise RuntimeError(f"pipeline schedule does not terminate for S={S}, M={M}, V={V}")
    return table


def build_schedule(name: str, stages: int, micro_batches: int, virtual: int = 1) -> Schedule:
    """The tick table of a schedule (see the module docstring). Arguments are assumed valid
    (`Config` checks them and names the key at fault)."""
    S, M, V = stages, micro_batches, virtual
    if name == "gpipe":
        table = _gpipe(S, M)
    elif name == "1f1b":
        table = _one_f_one_b(S, M)
    elif name == "interleaved":
        table = _as_soon_as_possible(S, M, V, [_megatron_order(S, M, V, s) for s in range(S)])
    else:
        raise ValueError(f"unknown pipeline schedule {name!r}; use one of {SCHEDULES}")
    num_ticks = 1 + max(t for t, _ in table)
    ticks = tuple(tuple(table.get((t, s)) for s in range(S)) for t in range(num_ticks))
    return Schedule(name, S, M, V if name == "interleaved" else 1, ticks)

