"""Running a pipeline schedule inside the engine's shard_map (manual over `data` and `pipe`).

Every device runs the same program: a `lax.scan` over the schedule's ticks. At each tick a device
looks up, in the schedule's table, what its stage does (run a forward, run a backward, or nothing)
and for which micro-batch and chunk, runs that branch of a `lax.switch`, then sends activations to the
next stage and input cotangents to the previous one along exactly the pairs the table names for that
tick (`ppermute`), and files what it received into its buffers. Nothing here knows the model: a
stage's computation is `piece(params, micro_batch, rng, x, start, role)`, the user's loss with its one
`scan_layers` call restricted to one chunk of this device's layers (see `stage_hook`).

Backward passes recompute their stage's forward from the stored input (`jax.vjp` in the backward
branch), so a stage keeps only its inputs for the micro-batches in flight: the schedule's
`in_flight` count of them, M for gpipe and at most S for 1f1b, whatever M is. The last stage's
forward therefore only files its input; its backward computes the loss and seeds the cotangent.
Buffers are slots reused once their micro-batch's backward has run; the slot assignment is static
(this module's `tables`), computed from the schedule.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from zeroflax.config import ConfigError
from zeroflax.pipeline.schedule import Schedule
from zeroflax.sharding.layers import layer_runner
from zeroflax.sharding.mesh import PIPE_AXIS
from zeroflax.sharding.scopes import ThreadStack

# Branches of the per-tick switch. "first": the first virtual stage (runs the loss's code before the
# layers); "last": the last one (runs the code after them and the loss); "mid": every other.
IDLE, F_FIRST, F_MID, F_LAST, B_FIRST, B_MID, B_LAST = range(7)
# Named scopes of a tick's regions in the HLO metadata: the comm report counts their collectives by
# how often the schedule runs them, not once per tick.
SEND_SCOPE, OP_SCOPE = "zeroflax_pipe_send[", "zeroflax_pipe_op["


@dataclasses.dataclass(frozen=True)
class Tables:
    """The schedule as integer arrays [ticks, stages], plus the buffer sizes they need."""

    branch: np.ndarray
    micro: np.ndarray
    chunk: np.ndarray
    in_slot: np.ndarray  # forward/backward: the slot holding this op's input (and, backward, its cotangent)
    recv_act_slot: np.ndarray  # slot to file the activation arriving at the end of this tick; -1 none
    recv_ct_slot: np.ndarray  # slot to file the cotangent arriving at the end of this tick; -1 none
    act_slots: int
    ct_slots: int
    # The sends of each tick, exactly: patterns[k] is a tuple of (source, destination, 'act' or 'ct'),
    # send_pattern[t] the pattern of tick t (the same on every device). Only those pairs communicate.
    patterns: tuple = ()
    send_pattern: np.ndarray = None

    def tick_weights(self) -> dict:
        """The share of ticks in which each named region of the tick runs: a send pattern (the same on
        every device), a stage branch (averaged over the stages). For the communication report."""
        ticks = len(self.send_pattern)
        weights = {f"{SEND_SCOPE}{k}]": float(np.sum(self.send_pattern == k)) / ticks for k in range(len(self.patterns))}
        for b in range(B_LAST + 1):
            weights[f"{OP_SCOPE}{b}]"] = float(np.mean(np.sum(self.branch == b, axis=0))) / ticks
        return weights


def _allocate(events: dict, S: int, num_ticks: int):
    """Static slot assignment: events[(s, key)] = (first tick it is held, last tick it is needed)."""
    slot_of, most = {}, 1
    for s in range(S):
        free_at: list[int] = []  # per slot: the tick after which it is free again
        for key, (start, end) in sorted(((k, v) for k, v in events.items() if k[0] == s), key=lambda kv: kv[1]):
            for i, free in enumerate(free_at):
                if free < start:
                    free_at[i] = end
                    slot_of[key] = i
                    break
            else:
                free_at.append(end)
                slot_of[key] = len(free_at) - 1
        most = max(most, len(free_at))
    return slot_of, most


def tables(schedule: Schedule) -> Tables:
    S, V = schedule.stages, schedule.virtual
    last = S * V - 1
    T = schedule.num_ticks
    when = {}  # (kind, micro, virtual stage) -> tick
    for t, row in enumerate(schedule.ticks):
        for s, op in enumerate(row):
            if op is not None:
                when[(op.kind, op.micro, op.chunk * S + s)] = t
    # An input arrives at the end of the previous virtual stage's forward and is needed until this
    # stage's backward; a cotangent arrives at the end of the next one's backward, needed until ours.
    acts, cts = {}, {}
    for (kind, m, k), t in when.items():
        s = k % S
        if kind == "B":
            if k > 0:
                acts[(s, (m, k))] = (when[("F", m, k - 1)] + 1, t)
            if k < last:
                cts[(s, (m, k))] = (when[("B", m, k + 1)] + 1, t)
    act_slot, act_slots = _allocate(acts, S, T)
    ct_slot, ct_slots = _allocate(cts, S, T)

    shape = (T, S)
    branch, micro, chunk, in_slot, ct_in = (np.zeros(shape, np.int32) for _ in range(5))
    recv_act, recv_ct = np.full(shape, -1, np.int32), np.full(shape, -1, np.int32)
    sends = [[] for _ in range(T)]  # per tick: (source, destination, 'act' or 'ct')
    for t, row in enumerate(schedule.ticks):
        for s, op in enumerate(row):
            if op is None:
                continue
            k = op.chunk * S + s
            role = 0 if k == 0 else (2 if k == last else 1)
            branch[t, s] = (F_FIRST if op.kind == "F" else B_FIRST) + role
            micro[t, s], chunk[t, s] = op.micro, op.chunk
            in_slot[t, s] = act_slot.get((s, (op.micro, k)), 0)
            if op.kind == "F" and k < last:
                receiver = (k + 1) % S
                recv_act[t, receiver] = act_slot[(receiver, (op.micro, k + 1))]
                sends[t].append((s, receiver, "act"))
            if op.kind == "B" and k < last:
                ct_in[t, s] = ct_slot[(s, (op.micro, k))]
            if op.kind == "B" and k > 0:
                receiver = (k - 1) % S
                recv_ct[t, receiver] = ct_slot[(receiver, (op.micro, k - 1))]
                sends[t].append((s, receiver, "ct"))
    patterns = sorted({tuple(sorted(x)) for x in sends})
    send_pattern = np.array([patterns.index(tuple(sorted(x))) for x in sends], np.int32)
    return Tables(branch, micro, chunk, np.stack([in_slot, ct_in], -1), recv_act, recv_ct, act_slots, ct_slots,
                  tuple(patterns), send_pattern)


# ------------------------------------------------------------------------------ the stage hook
@dataclasses.dataclass
class _Stage:
    x: Any  # the stage's input, or None on the first virtual stage (the loss's own code makes it)
    start: Any  # first layer of the chunk within this device's layers (traced int)
    size: int  # layers per chunk
    output: Any = None
    calls: int = 0


_stages = ThreadStack()  # of _Stage: the stage hooks entered in this thread
_observers = ThreadStack()  # of callbacks: see observe_ticks


@contextlib.contextmanager
def observe_ticks(callback: Callable):
    """Steps traced inside this context (in this thread) report every tick as it runs, on every device:
    callback(stage, tick, kind, micro, chunk) with kind 'F', 'B' or None (idle). For tests and
    debugging: the order the compiled step really executes."""
    with _observers.push(callback):
        yield


def _notify(observers, stage, tick, branch, micro, chunk):
    kind = None if int(branch) == IDLE else ("F" if int(branch) < B_FIRST else "B")
    for observer in observers:
        observer(int(stage), int(tick), kind, int(micro), int(chunk))


def active_stage() -> _Stage | None:
    return _stages.top()


@contextlib.contextmanager
def stage_hook(x, start, size: int):
    """While the loss runs inside this context, its `scan_layers` call runs only layers
    [start, start + size) of this device's share, on `x` (when given) instead of its own carry
    (`run_stage`, installed as the layers' runner: `sharding.layers.layer_runner`)."""
    stage = _Stage(x, start, size)
    with _stages.push(stage), layer_runner(functools.partial(run_stage, stage)):
        yield stage


def run_stage(stage: _Stage, run: Callable, carry, stacked_params, xs):
    """`scan_layers`'s loop under a stage hook: one chunk of layers; the output is recorded."""
    stage.calls += 1
    if stage.calls > 1:
        raise ConfigError(f"MeshConfig.axes['{PIPE_AXIS}']", "the loss calls zeroflax.scan_layers more than once; a "
                          "pipeline splits exactly one stack of layers over the pipe axis",
                          "use one scan_layers call, or set the pipe axis to 1")
    chunk = lambda tree: jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, stage.start, stage.size, 0), tree)
    x = carry if stage.x is None else stage.x.astype(carry.dtype)
    stage.output = run(x, chunk(stacked_params), None if xs is None else chunk(xs))
    return stage.output


# ----------------------------------------------------------------------------------- execution
def run_schedule(schedule: Schedule, piece: Callable, params, micro, rng, seed, activation: jax.ShapeDtypeStruct,
                 per_microbatch: Callable, layers_per_chunk: int, aux_shape):
    """Loss sum, aux sum and accumulated parameter gradients of this device's micro-batches.

    piece(params, micro_batch, rng, x, start, role) -> the chunk's output (role 'first'/'mid') or
    (loss, aux) (role 'last', the loss a float32 scalar); `start` is the chunk's first layer among
    this device's.
    `seed` scales every micro-batch's loss cotangent (loss scale x the step's weight). Gradients of
    leaves shared by all stages (embeddings, the head) are this stage's contribution only: the
    caller sums them over `pipe`.
    """
    tab = tables(schedule)
    stage = jax.lax.axis_index(PIPE_AXIS)
    S = schedule.stages
    zeros_act = jnp.zeros(activation.shape, activation.dtype)
    acts0 = jnp.zeros((tab.act_slots,) + activation.shape, activation.dtype)
    cts0 = jnp.zeros((tab.ct_slots,) + activation.shape, activation.dtype)
    # At ZeRO-2 a micro-batch's gradients are reduce-scattered before they are added: a shard each.
    grads0 = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(per_microbatch, params))
    loss0 = jnp.zeros((), jnp.float32)
    aux0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), aux_shape)

    def at(table, t):
        return jnp.asarray(table)[t, stage]

    def take(tree, m):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, m, 0, keepdims=False), tree)

    def tick(carry, t):
        acts, cts, grads, loss_sum, aux_sum = carry
        m, v = at(tab.micro, t), at(tab.chunk, t)
        slot_in, slot_ct = at(tab.in_slot[..., 0], t), at(tab.in_slot[..., 1], t)
        batch, micro_rng = take(micro, m), jax.random.fold_in(rng, m)
        start = v * layers_per_chunk
        x_in = jax.lax.dynamic_index_in_dim(acts, slot_in, 0, keepdims=False)
        ct_in = jax.lax.dynamic_index_in_dim(cts, slot_ct, 0, keepdims=False)

        def idle(_):
            return zeros_act, zeros_act, grads, loss_sum, aux_sum

        def forward(role):
            def run(_):
                x = None if role == "first" else x_in
                y = piece(params, batch, micro_rng, x, start, role)
                return y.astype(activation.dtype), zeros_act, grads, loss_sum, aux_sum
            return run

        def forward_last(_):  # the backward recomputes it (and the loss) from the filed input
            return zeros_act, zeros_act, grads, loss_sum, aux_sum

        def backward(role):
            def run(_):
                if role == "first":
                    y, pullback = jax.vjp(lambda p: piece(p, batch, micro_rng, None, start, role), params)
                    (g,) = pullback(ct_in.astype(y.dtype))
                    return zeros_act, zeros_act, add(grads, per_microbatch(g)), loss_sum, aux_sum
                if role == "mid":
                    y, pullback = jax.vjp(lambda p, x: piece(p, batch, micro_rng, x, start, role), params, x_in)
                    g, dx = pullback(ct_in.astype(y.dtype))
                    return zeros_act, dx.astype(activation.dtype), add(grads, per_microbatch(g)), loss_sum, aux_sum
                loss, pullback, aux = jax.vjp(lambda p, x: piece(p, batch, micro_rng, x, start, role),
                                              params, x_in, has_aux=True)
                g, dx = pullback(jnp.asarray(seed, loss.dtype))
                return (zeros_act, dx.astype(activation.dtype), add(grads, per_microbatch(g)),
                        loss_sum + loss.astype(jnp.float32), add(aux_sum, aux))
            return run

        branches = [idle, forward("first"), forward("mid"), forward_last,
                    backward("first"), backward("mid"), backward("last")]
        branch = at(tab.branch, t)
        if _observers:
            jax.debug.callback(functools.partial(_notify, tuple(_observers)), stage, t, branch, m, v)
        act_out, ct_out, grads, loss_sum, aux_sum = jax.lax.switch(
            branch, [_scoped(f"{OP_SCOPE}{b}]", fn) for b, fn in enumerate(branches)], None)
        # Activations go to the next stage, cotangents to the previous one: exactly the pairs this
        # tick's pattern names (the same pattern on every device, so the switch is uniform).
        act_recv, ct_recv = jax.lax.switch(
            jnp.asarray(tab.send_pattern)[t],
            [_scoped(f"{SEND_SCOPE}{k}]", functools.partial(_exchange, p)) for k, p in enumerate(tab.patterns)],
            act_out, ct_out)
        acts = _file(acts, act_recv, at(tab.recv_act_slot, t))
        cts = _file(cts, ct_recv, at(tab.recv_ct_slot, t))
        return (acts, cts, grads, loss_sum, aux_sum), None

    carry = (acts0, cts0, grads0, loss0, aux0)
    (_, _, grads, loss_sum, aux_sum), _ = jax.lax.scan(tick, carry, jnp.arange(schedule.num_ticks))
    return grads, loss_sum, aux_sum


def _scoped(name: str, fn: Callable) -> Callable:
    def run(*args):
        with jax.named_scope(name):
            return fn(*args)
    return run


def _exchange(pattern, act_out, ct_out):
    """One tick's sends: activations and cotangents along exactly the pairs of `pattern`."""
    def send(value, which):
        pairs = [(a, b) for a, b, w in pattern if w == which]
        return jax.lax.ppermute(value, PIPE_AXIS, pairs) if pairs else jnp.zeros_like(value)
    return send(act_out, "act"), send(ct_out, "ct")


def add(a, b):
    return jax.tree.map(jnp.add, a, b)


def _file(buffer, value, slot):
    """buffer[slot] = value when slot >= 0 (something arrived this tick), else buffer unchanged."""
    safe = jnp.maximum(slot, 0)
    current = jax.lax.dynamic_index_in_dim(buffer, safe, 0, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buffer, jnp.where(slot >= 0, value, current), safe, 0)
