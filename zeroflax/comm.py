"""Communication report: the bytes every collective moves per step, read from the compiled HLO.

Each collective instruction is counted with the product of the trip counts of the while loops it sits
in (`known_trip_count` in the loop's backend config). Bytes are per device, for ring algorithms, with
R the bytes of the instruction's result and G the size of its replica group:

    all-gather          R (G-1)/G          reduce-scatter    R (G-1)
    all-reduce          2 R (G-1)/G        all-to-all        R (G-1)/G
    collective-permute  R x (pairs / devices): the devices that send, averaged over all of them

The theory of docs/design.md section 2, with N the data-parallel size, b_g the gradient and b_c the
compute dtype's bytes: stages 0-2 move 2 b_g Psi (N-1)/N, stage 3 (2 b_c + b_g) Psi (N-1)/N; with
quantized weights (qwZ) b_c = 1 + b_scale/block (int8 elements, one compute-dtype scale per block).
With M micro-batches per step stage 2 moves (M + 1) b_g Psi (N-1)/N and stage 3 M times its volume
(`theory_bytes`). The tensor axis is beside Megatron's volume (`megatron_all_reduces`). On any data size
Psi counts the stored leaves (`sharding.padding`): at stages 1-3 a partitioned leaf that N divides in no
free dimension is reduce-scattered and all-gathered with its padding, so the theory moves it too
(`CommReport.padded_params`; stage 0 all-reduces the true gradients). At stage 3 a leaf that the placement
pass (`sharding/relocate.py`) gathers in k groups (a tied embedding at the lookup and at the head) moves
its volume k times, a lookup among them without the backward gather it does not need
(`CommReport.repeated_gathers` lists them).

Host <-> device traffic (offload) is counted from the step's program: every transfer between memory
kinds (a `device_put` to another memory space) with its per-device bytes, times the trip counts of the
scans around it (`host_transfers`). The compiled HLO cannot be used on the CPU backend, where host
memory is device memory and XLA compiles the transfers away; on a GPU they are the copies XLA keeps.
Theory per step, per device (`OffloadedUpdate.host_traffic_theory`), with G the elements of this device's
gradient shards, C those of the compute copy, S those of the streamed (offload_param) shards, K the
optimizer state's bytes:
    update on the host:    device->host b_g G; host->device b_c C (+ M x 2 x b_master S, offload_param)
    update on the device:  host->device and device->host (b_master + K/elements) x master elements
With the state on disk (NVMe offload) nothing moves between memory kinds inside the program; the report
gives the state file's bytes instead, per process and step: read and written, each the records' aligned
extents (`StreamedUpdate.disk_traffic_theory`), beside the bytes the file layer counted in the last step.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re

import jax
import numpy as np

from zeroflax.axes import PIPE_AXIS, SEQUENCE_AXIS, TENSOR_AXIS
from zeroflax.config import RECOMPUTE_WHOLE
from zeroflax.hlo import (ARRAY_TYPE, DTYPE_BYTES, OP_NAME, array_bytes, computation_multipliers, first_replica_group,
                          scope_weight, source_target_pairs, split_computations)
from zeroflax.sharding.padding import stored_shape
from zeroflax.sharding.mesh import axis_names, sequence_size, zero_axes
from zeroflax.sharding.policy import is_placement
from zeroflax.step.phases import STEADY

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")


def mesh_axes_of(ids: list[int], mesh_shape: dict) -> tuple[str, ...]:
    """The mesh axes along which the devices `ids` (partition ids, row-major over the mesh) differ."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    coords = np.array(np.unravel_index(np.asarray(ids), sizes)).T
    return tuple(name for i, name in enumerate(names) if len(set(coords[:, i])) > 1)


def _per_device_bytes(kind: str, result_bytes: int, group: int, senders: float = 1.0) -> float:
    """Bytes per device; for a collective-permute, `senders` is the share of devices that send."""
    if kind == "collective-permute":
        return result_bytes * senders
    if group <= 1:
        return 0.0
    return {
        "all-gather": result_bytes * (group - 1) / group,
        "reduce-scatter": result_bytes * (group - 1),
        "all-reduce": 2 * result_bytes * (group - 1) / group,
        "all-to-all": result_bytes * (group - 1) / group,
    }[kind]


@dataclasses.dataclass
class Collective:
    kind: str
    computation: str
    dtype: str  # element type of the result (16-bit floats are all-gathered as u16 bit patterns)
    result_bytes: int
    group_size: int
    trip_count: float  # executions per step (averaged over pipeline stages inside a pipeline tick)
    bytes_per_step: float
    axes: tuple = ()  # the mesh axes it communicates over
    name: str = ""  # the instruction's name (its place in the schedule: `explain.step_timeline`)
    op_name: str = ""  # its metadata's op_name: the name scopes of the step part and layer it serves
    dims: tuple = ()  # the shape of its (last) result


def parse_collectives(hlo_text: str, num_devices: int, mesh_shape: dict | None = None,
                      weights: dict | None = None) -> tuple[list[Collective], bool]:
    """All collectives in an HLO module with their per-step bytes; second value: any unknown trip count.

    `weights` maps a named scope (found in an instruction's op_name metadata) to the share of its
    loop's iterations in which the region runs: a pipeline tick's branches run as often as the schedule
    says, not at every tick. `mesh_shape` names the axes each collective spans."""
    weights = weights or {}
    body, entry = split_computations(hlo_text)
    multiplier, unknown_trip = computation_multipliers(body, entry)
    collectives = []
    for name, times in multiplier.items():
        for line in body[name]:
            match = _INSTRUCTION.match(line)
            if not match:
                continue
            result_type, opcode, rest = match.groups()
            kind = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
            if kind not in COLLECTIVES:
                continue
            sizes = array_bytes(result_type)
            dtypes = [d for d, _ in ARRAY_TYPE.findall(result_type) if d in DTYPE_BYTES]
            # Async "-start" results are tuples (operands..., outputs...): the output is the last array.
            result_bytes = sizes[-1] if opcode.endswith("-start") else sum(sizes)
            dtype = (dtypes[-1] if opcode.endswith("-start") else "/".join(sorted(set(dtypes)))) if dtypes else "?"
            group = len(first_replica_group(rest, num_devices))
            count = times * scope_weight(rest, weights)
            pairs = source_target_pairs(rest) if kind == "collective-permute" else []
            ids = sorted({i for pair in pairs[:1] for i in pair}) if pairs else first_replica_group(rest, num_devices)
            axes = mesh_axes_of(ids, mesh_shape) if mesh_shape else ()
            senders = len(pairs) / num_devices if pairs else 1.0
            shapes = ARRAY_TYPE.findall(result_type)
            op_name = OP_NAME.search(rest)
            collectives.append(Collective(kind, name, dtype, result_bytes, group, count,
                                          count * _per_device_bytes(kind, result_bytes, group, senders), axes,
                                          _NAME.match(line).group(1), op_name.group(1) if op_name else "",
                                          tuple(int(d) for d in shapes[-1][1].split(",") if d) if shapes else ()))
    return collectives, unknown_trip


@dataclasses.dataclass
class CommReport:
    stage: int
    data_size: int
    num_params: int
    compute_bytes: float  # bytes a gathered element travels in (1 + 2/block with qwZ)
    grad_bytes: int
    by_kind: dict  # kind -> {"count": instructions x trips, "bytes": per device per step}
    by_dtype: dict  # kind -> {element type: bytes per device per step}
    total_bytes: float
    theory_bytes: float
    unknown_trip_count: bool
    collectives: list
    # By mesh axis ('data', 'pipe', 'tensor', or several joined by '+'): bytes per device per step,
    # and the theory for the axes that have one (data: ZeRO's volume for this device's parameters;
    # pipe: the activations and cotangents the schedule sends, plus the shared leaves' gradient sum).
    by_axis: dict = dataclasses.field(default_factory=dict)
    theory_by_axis: dict = dataclasses.field(default_factory=dict)
    permute_bytes: float = 0.0  # collective-permute bytes (pipeline sends)
    permute_theory: float = 0.0  # what the schedule sends: its pairs x one micro-batch's activation
    # Offload: bytes per device per step between host and device memory, and their theory.
    host_to_device: float = 0.0
    device_to_host: float = 0.0
    host_to_device_theory: float = 0.0
    device_to_host_theory: float = 0.0
    # NVMe offload: bytes of this process's state file per step, read and written (measured in the engine's
    # last step, -1 before it has run one), and their theory (every chunk's record once each way).
    disk_read: float = 0.0
    disk_written: float = 0.0
    disk_read_theory: float = 0.0
    disk_written_theory: float = 0.0
    phase: str = STEADY  # which of the engine's step programs (1-bit Adam: 'warmup', 'first', 'compressed')
    # Padding zeros the ZeRO collectives move with the stored leaves (elements, of Psi on this device's
    # pipe/tensor part), and the bytes of the theory that are theirs.
    padded_params: int = 0
    padding_bytes: float = 0.0
    # Stage 3: leaf path -> how many gather groups gather it, where more than one (each use of a tied
    # embedding): the theory moves the leaf's volume once per group.
    repeated_gathers: dict = dataclasses.field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.total_bytes / self.theory_bytes if self.theory_bytes else float("nan")

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["ratio"] = self.ratio
        return json.loads(json.dumps(out))

    def __str__(self) -> str:
        phase = "" if self.phase == STEADY else f", {self.phase} step"
        lines = [f"communication per step, per device (ZeRO stage {self.stage}, N={self.data_size}, "
                 f"Psi={self.num_params:,}{phase})",
                 f"  {'collective':<20}{'count':>8}{'MiB':>12}"]
        for kind, row in sorted(self.by_kind.items()):
            split = ", ".join(f"{dtype} {b / 2**20:.2f}" for dtype, b in sorted(self.by_dtype.get(kind, {}).items()))
            lines.append(f"  {kind:<20}{row['count']:>8}{row['bytes'] / 2**20:>12.2f}   {split}")
        lines.append(f"  {'total':<20}{'':>8}{self.total_bytes / 2**20:>12.2f}")
        covers = f" ({' + '.join(sorted(self.theory_by_axis))} only)" if len(self.by_axis) > 1 else ""
        lines.append(f"  {'theory' + covers:<20}{'':>8}{self.theory_bytes / 2**20:>12.2f}   ratio {self.ratio:.3f}")
        if self.repeated_gathers:
            each = ", ".join(f"{path} x{count}" for path, count in sorted(self.repeated_gathers.items()))
            lines.append(f"  {'  gathered per use':<20}{'':>8}{'':>12}   (the theory moves each once per group: {each})")
        if self.padded_params:
            lines.append(f"  {'  of it padding':<20}{'':>8}{self.padding_bytes / 2**20:>12.2f}   "
                         f"({self.padded_params:,} zeros the padded leaves move with them)")
        if len(self.by_axis) > 1 or self.permute_theory:
            for axis, value in sorted(self.by_axis.items()):
                theory = self.theory_by_axis.get(axis)
                beside = f"   theory {theory / 2**20:.2f}, ratio {value / theory:.3f}" if theory else ""
                lines.append(f"  {'over ' + axis:<28}{value / 2**20:>12.2f}{beside}")
            if self.permute_theory:
                lines.append(f"  {'pipeline sends':<28}{self.permute_bytes / 2**20:>12.2f}   schedule "
                             f"{self.permute_theory / 2**20:.2f}, ratio {self.permute_bytes / self.permute_theory:.3f}")
        for name, value, theory in (("host -> device", self.host_to_device, self.host_to_device_theory),
                                    ("device -> host", self.device_to_host, self.device_to_host_theory)):
            if value or theory:
                beside = f"   theory {theory / 2**20:.2f}, ratio {value / theory:.3f}" if theory else ""
                lines.append(f"  {name + ' (program)':<28}{value / 2**20:>12.2f}{beside}")
        for name, value, theory in (("disk read", self.disk_read, self.disk_read_theory),
                                    ("disk written", self.disk_written, self.disk_written_theory)):
            if theory:
                measured = f"{value / 2**20:>12.2f}" if value >= 0 else f"{'(no step)':>12}"
                ratio = f", ratio {value / theory:.3f}" if value >= 0 else ""
                lines.append(f"  {name + ' (process)':<28}{measured}   theory {theory / 2**20:.2f}{ratio}")
        if self.unknown_trip_count:
            lines.append("  warning: a loop without a known trip count was counted once")
        return "\n".join(lines)


def theory_bytes(stage: int, num_params: int, data_size: int, compute_bytes: float, grad_bytes: int,
                 micro_batches: int = 1, offload: bool = False) -> float:
    """ZeRO's volume per step over `data`. With M micro-batches, stage 2 reduce-scatters each one's
    gradients (then all-gathers the updated parameters once) and stage 3 gathers and reduce-scatters per
    micro-batch, as DeepSpeed does; stages 0 and 1 accumulate locally and reduce once. Under offload
    stages 1-2 all-gather the compute copy (b_c) instead of the master weights."""
    share = (data_size - 1) / data_size
    gather = compute_bytes if offload else grad_bytes
    if stage == 3:
        return micro_batches * (2 * compute_bytes + grad_bytes) * num_params * share
    if stage == 2:
        return (micro_batches * grad_bytes + gather) * num_params * share
    if stage == 1:
        return (grad_bytes + gather) * num_params * share
    return 2 * grad_bytes * num_params * share


def megatron_all_reduces(layers: int, stages: int, virtual: int, micro_batches: int, remat: str,
                         vocab_parallel: bool, sequence_parallel: bool = False) -> float:
    """All-reduces over `tensor` of one layer activation (a micro-batch's [batch, seq, d_model] on one
    device) that Megatron's tensor slicing needs per step for a transformer stack, per device
    (averaged over pipeline stages). Under sequence parallelism an all-reduce is a reduce-scatter plus an
    all-gather, each counted as half of one.

    Per layer and micro-batch: 2 in a forward (the row-parallel attention-out and MLP-out), 2 in the
    backward (the inputs of the column-parallel QKV and MLP-in), and per recomputed forward the
    forward's 2 less the layer's last exit, whose output is not needed again: 1 all-reduce, or under
    sequence parallelism 2 all-gathers and the attention's reduce-scatter (1.5). Which remat recomputes
    them (measured): 'full'; the selective policies ('dots', 'dots_no_batch') keep the matmul outputs
    the all-reduces follow, so they need none, except under sequence parallelism, where the weight
    gradients need the all-gathered inputs again. A vocab-parallel embedding adds 1 per forward that
    runs it, a vocab-parallel head 1 in the backward (its input's cotangent); the vocab-parallel
    cross-entropy's reductions of [batch, seq] scalars are not counted. Without a pipeline each layer runs forward once
    and, with recomputation, once more in the backward. With one (K = stages x virtual chunks, each a
    virtual stage), a virtual stage that is not the last runs its forward at its F tick and again at its
    backward tick (where its last layer's exit is not needed), and with recomputation once more; the
    last one's F tick only files its input."""
    exit_cost = 0.5 if sequence_parallel else 1.0
    recompute = remat in RECOMPUTE_WHOLE or (sequence_parallel and remat != "none")
    r = (2 - exit_cost) if recompute else 0.0
    e = 1 if vocab_parallel else 0
    if stages == 1:
        return micro_batches * (layers * (2 + 2 + r) + 2 * e)
    K = stages * virtual
    L = layers // K
    per_virtual = [2 * L + (2 * L - exit_cost) + r * L + 2 * L] * (K - 1) + [2 * L + r * L + 2 * L]
    per_virtual[0] += 2 * e  # the embedding, at the F tick and again at the backward tick
    per_virtual[-1] += e  # the head's backward
    return micro_batches * sum(per_virtual) / stages


def sequence_axis_bytes(attention: str, calls: float, q_bytes: int, kv_bytes: int, kv_elements: int, size: int,
                        recompute: bool) -> float:
    """Bytes per device per step over `sequence` for `calls` attention calls (layers x micro-batches) on this
    device's tokens: q and each of k, v of `q_bytes` and `kv_bytes` (zeroflax/sharding/sequence.py).

    Ulysses: per call 4 all-to-alls forward (q, k, v to a split over heads, the output back) and their 4
    transposes backward, each moving (S-1)/S of its array. Ring: forward, S-1 sends of this device's k and v
    block; backward (a custom VJP that keeps only O(T/S) residuals), k and v sent round again (S-1) and the
    float32 dk/dv accumulators S times (sharding/ring_attention.py). A remat policy recomputes the forward
    in the backward pass, with its collectives (all-to-all and custom-VJP outputs are not matmul outputs, so
    every policy but 'none' does)."""
    if size <= 1:
        return 0.0
    forwards = 2 if recompute else 1
    if attention == "ulysses":
        return calls * (forwards + 1) * (2 * q_bytes + 2 * kv_bytes) * (size - 1) / size
    forward = 2 * (size - 1) * kv_bytes
    backward = 2 * (size - 1) * kv_bytes + 2 * size * kv_elements * 4
    return calls * (forwards * forward + backward)


def _is_host_space(aval) -> bool:
    return str(getattr(aval, "memory_space", "")).endswith("Host")


def host_transfers(jaxpr, times: int = 1, local: bool = False) -> tuple[float, float]:
    """(host->device, device->host) bytes per device of the transfers in a jaxpr (module docstring).
    `local`: inside a shard_map, where avals are already one device's; outside, a transfer's target
    sharding gives the shard it moves."""
    to_device = to_host = 0.0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "device_put":
            for source, target, dest in zip(eqn.invars, eqn.outvars, eqn.params["devices"]):
                src_host, dst_host = _is_host_space(source.aval), _is_host_space(target.aval)
                if src_host == dst_host:
                    continue
                shape = tuple(target.aval.shape)
                if not local and hasattr(dest, "shard_shape"):
                    shape = dest.shard_shape(stored_shape(shape, dest))
                moved = times * math.prod(shape) * np.dtype(target.aval.dtype).itemsize
                to_host, to_device = (to_host + moved, to_device) if dst_host else (to_host, to_device + moved)
            continue
        inner_times = times * (eqn.params.get("length", 1) if name == "scan" else 1)
        inner_local = local or name == "shard_map"
        for value in eqn.params.values():
            for sub in (value if isinstance(value, (list, tuple)) else [value]):
                sub = getattr(sub, "jaxpr", sub)  # ClosedJaxpr -> Jaxpr
                if hasattr(sub, "eqns"):
                    a, b = host_transfers(sub, inner_times, inner_local)
                    to_device, to_host = to_device + a, to_host + b
    return to_device, to_host



def _local_elements(abstract, shardings, keep) -> int:
    """Elements one device holds of the leaves `keep(placement)` selects."""
    return sum(math.prod(sh.shard_shape(stored_shape(x.shape, sh))) for x, sh, p in zip(*abstract) if keep(p))


def comm_report(engine, state, batch, phase: str | None = None) -> CommReport:
    """The bytes of the step program of `phase` (default: the steady state; see `Engine.phases`). It compiles
    the step: in a run of several processes call it on every process (`Engine.compile` says why)."""
    phase = phase or engine.phases[-1]
    compiled = engine.compile(state, batch, phase)
    schedule_tables = engine.pipeline_tables()
    weights = schedule_tables.tick_weights() if schedule_tables is not None else None
    collectives, unknown = parse_collectives(compiled.as_text(), engine.mesh.size, dict(engine.mesh.shape), weights)
    by_kind: dict = {}
    by_dtype: dict = {}
    for c in collectives:
        row = by_kind.setdefault(c.kind, {"count": 0, "bytes": 0.0})
        row["count"] += c.trip_count
        row["bytes"] += c.bytes_per_step
        split = by_dtype.setdefault(c.kind, {})
        split[c.dtype] = split.get(c.dtype, 0.0) + c.bytes_per_step
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(engine.abstract_params))
    compute = np.dtype(engine.config.compute_dtype).itemsize
    if engine.config.quantized_weights:  # qwZ: one int8 per element plus a scale (compute dtype) per block
        compute = 1 + compute / engine.config.quantization_block
    grad = max(np.dtype(x.dtype).itemsize for x in jax.tree.leaves(engine.abstract_params))  # master dtype
    total = sum(c.bytes_per_step for c in collectives)
    by_axis: dict = {}
    stage = engine.config.zero_stage
    for c in collectives:
        key = "+".join(c.axes) or "none"
        by_axis[key] = by_axis.get(key, 0.0) + c.bytes_per_step
    offload = engine.plan.offload
    placements = jax.tree.leaves(engine.plan.placements, is_leaf=is_placement)
    without_data = [jax.sharding.NamedSharding(engine.mesh, p.spec(False)) for p in placements]
    leaves = jax.tree.leaves(engine.abstract_params)
    # This device's parameters once the pipe and tensor axes have split them (ZeRO then splits them N ways),
    # as the ZeRO collectives move them: at stages 1-3 a partitioned leaf with its padding (its stored shape).
    local_true = _local_elements((leaves, without_data, placements), None, lambda p: True)
    with_data = [jax.sharding.NamedSharding(engine.mesh, p.spec(True)) for p in placements]
    local = local_true if stage == 0 else (
        engine.zero_size * _local_elements((leaves, with_data, placements), None, lambda p: p.zero_dim is not None)
        + _local_elements((leaves, without_data, placements), None, lambda p: p.zero_dim is None))
    # A leaf the placement pass gathers in several groups (a tied embedding at the lookup and at the head, each use its
    # own group: sharding/relocate.py) moves stage 3's volume once per group: each gathers it for its forward
    # and its backward and reduce-scatters its share of the gradient (a single reduce-scatter would keep the
    # whole gradient alive between the uses). The theory counts each such group.
    # A lookup (`w[ids]`) gathers only for its forward pass: its gradient is a scatter of the cotangent.
    repeated, repeat_elements = {}, 0.0
    usage = engine.gather_usage
    if stage == 3 and usage is not None:
        paths = engine.trace.leaf_paths()
        per_use = 2 * compute + grad
        for index, (count, lookups) in sorted(usage.placed_by_leaf().items()):
            if count > 1 or lookups:
                if count > 1:
                    repeated[paths[index]] = count
                shard = math.prod(with_data[index].shard_shape(stored_shape(leaves[index].shape, with_data[index])))
                volume = count * per_use - lookups * compute  # in units of one element
                repeat_elements += (volume / per_use - 1) * engine.zero_size * shard
    accum = engine.config.grad_accum_steps
    # The gradient sync's own theory over `data` (ZeRO's volume, or 1-bit Adam's compressed exchange).
    data_theory = lambda params: engine.sync.data_axis_bytes(
        theory_bytes(stage, params, engine.zero_size, compute, grad, accum, offload), stage, grad, engine.clock.of(
            engine.sync, phase))
    zero_key = "+".join(axis_names(zero_axes(engine.mesh)))  # 'data', or 'data+sequence'
    theory_by_axis = {zero_key: data_theory(local + repeat_elements)}
    if engine.schedule is not None and stage >= 2:
        # Under a pipeline stages 2 and 3 reduce (and, at 3, gather) per micro-batch and tick, a stage's
        # backward tick recomputes its forward (gathering again at 3), and only the first and last
        # stages use the shared leaves: no formula is claimed for that (docs/perf.md has the measured
        # bytes), so none is printed beside it.
        del theory_by_axis[zero_key]
    permute = sum(c.bytes_per_step for c in collectives if c.kind == "collective-permute")
    permute_theory = 0.0
    if schedule_tables is not None:
        S = engine.schedule.stages
        activation = engine.pipeline_activation
        act_bytes = math.prod(activation.shape) * np.dtype(activation.dtype).itemsize
        if engine.config.sequence_parallel:  # the stages send their sequence slices
            act_bytes /= engine.mesh.shape.get(TENSOR_AXIS, 1)
        sends = sum(len(schedule_tables.patterns[k]) for k in schedule_tables.send_pattern)
        permute_theory = sends * act_bytes / S  # per device: the pairs' sends spread over the S stages
        grads = jax.tree.leaves(engine.plan.grads)
        shared = _local_elements((leaves, grads, placements), None, lambda p: not p.stacked)
        theory_by_axis[PIPE_AXIS] = permute_theory + 2 * grad * shared * (S - 1) / S
    tensor = engine.mesh.shape.get(TENSOR_AXIS, 1)
    sliced = [p for p in placements if TENSOR_AXIS in p.base]
    if tensor > 1 and usage is not None and usage.layer_carry_bytes and any(p.stacked for p in sliced):
        # Megatron's volume for the stack of layers (an all-reduce moves 2 R (T-1)/T; sequence parallelism's
        # all-gather + reduce-scatter as much); leaves that are not stacked layers and are sliced are
        # taken to be a vocab-parallel embedding and head.
        layers = next(p.shape[0] for p in placements if p.stacked)
        schedule = engine.schedule
        count = megatron_all_reduces(layers, schedule.stages if schedule else 1, schedule.virtual if schedule else 1,
                                     engine.config.grad_accum_steps, engine.remat,
                                     any(not p.stacked for p in sliced), engine.config.sequence_parallel)
        theory_by_axis[TENSOR_AXIS] = count * 2 * usage.layer_carry_bytes * (tensor - 1) / tensor
    sequence = sequence_size(engine.mesh)
    if sequence > 1 and usage is not None and usage.sequence_attentions and engine.schedule is None:
        # One attention per traced call; a call traced in a scanned layer runs once per layer.
        layers = next((p.shape[0] for p in placements if p.stacked), 1)
        q_bytes, kv_bytes, kv_elements = usage.attention_bytes
        theory_by_axis[SEQUENCE_AXIS] = sequence_axis_bytes(
            engine.config.sequence_attention, layers * usage.sequence_attentions * accum, q_bytes, kv_bytes,
            kv_elements, sequence, engine.remat != "none")
    transfers = {}
    if offload:
        state_abs, batch_abs = engine.abstract_args(state, batch)
        jaxpr = jax.make_jaxpr(engine.step_function(batch_abs, phase))(state_abs, batch_abs).jaxpr
        to_device, to_host = host_transfers(jaxpr)
        to_device_theory, to_host_theory = engine.update.host_traffic_theory(
            engine.abstract_params, engine.clock.of(engine.update, phase))
        transfers = dict(host_to_device=to_device, device_to_host=to_host, host_to_device_theory=to_device_theory,
                       device_to_host_theory=to_host_theory)
    if engine.state_files is not None:  # NVMe: the file's bytes (the last step's, beside the theory)
        read_theory, written_theory = engine.update.disk_traffic_theory()
        read, written = engine.update.disk_traffic() or (-1, -1)
        transfers.update(disk_read=read, disk_written=written, disk_read_theory=read_theory,
                         disk_written_theory=written_theory)
    return CommReport(
        stage=stage, data_size=engine.zero_size, num_params=num_params,
        compute_bytes=compute, grad_bytes=grad, by_kind=by_kind, by_dtype=by_dtype, total_bytes=total,
        # With a pipe or tensor axis the whole-step theory is the sum of the axes that have one.
        theory_bytes=(sum(theory_by_axis.values()) if len(engine.mesh.shape) > 1 and
                      (engine.mesh.shape.get(PIPE_AXIS, 1) > 1 or engine.mesh.shape.get(TENSOR_AXIS, 1) > 1
                       or sequence > 1) else data_theory(local + repeat_elements)),
        phase=phase, padded_params=local - local_true, padding_bytes=data_theory(local) - data_theory(local_true),
        unknown_trip_count=unknown, collectives=[dataclasses.asdict(c) for c in collectives],
        by_axis=by_axis, theory_by_axis=theory_by_axis, permute_bytes=permute, permute_theory=permute_theory,
        repeated_gathers=repeated, **transfers)
