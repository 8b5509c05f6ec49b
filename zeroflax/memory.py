"""Memory report: per-device bytes of the compiled step, by category, beside ZeRO's theory.

The totals come from XLA (`compiled.memory_analysis()`): arguments, outputs, temporaries. The
arguments are split into categories by the shardings of the train state (what one device holds of
each leaf); `unaccounted` is what memory_analysis counts beyond them and should be ~0.
`grad_buffer` is the gradient buffer held from the backward pass to the update, from the plan:
full size where gradients are accumulated unreduced (stages 0 and 1), one shard for stages 2 and 3.
It lives in the temporaries.

Theory (docs/design.md section 2; offload: section 5) for model states at rest, with Psi parameters, N data-parallel devices,
P the parameters' bytes per element and K the optimizer state's bytes per parameter (Adam: 8):
    stage 0: (P + K) Psi    stages 1, 2: P Psi + K Psi / N    stage 3: (P + K) Psi / N
With offload (Config.offload_optimizer) the model states split into host and device memory, each
category by the memory kind of its shardings: on the host (P + K) Psi / N at every stage; on the device
the compute-dtype copy, C Psi (stages 1-2), C Psi / N (stage 3), and with offload_param only the leaves
below the persistence threshold. XLA's own host figures (memory_analysis' host_* fields) are reported
beside them; the CPU backend leaves them 0, as its host memory is its device memory.

On any data size (sharding.padding) Psi / N is of the *stored* leaves: a leaf that N divides in no free
dimension is stored zero-padded to a multiple of N, so the theory counts each partitioned state's stored
bytes / N and the measured figure matches it exactly when every leaf is partitioned. The report lists the
padded leaves with their padding per device (`padded_leaves`), and the leaves held whole over `data`
(`whole_leaves`: below the persistence threshold, every dimension already partitioned by tensor slicing
or the pipeline, or a data size of 1) with their bytes per device and the reason; `whole_excess` is what
they (and the optimizer's scalars) hold beyond their 1/N, so that at rest = theory + whole_excess exactly
without pipe or tensor axes.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re

import jax
import numpy as np
import optax

from zeroflax.axes import DATA_AXIS, PIPE_AXIS, TENSOR_AXIS
from zeroflax.hlo import ARRAY_TYPE, DTYPE_BYTES, array_bytes, split_computations
from zeroflax.sharding.padding import shards_per_dim, stored_shape
from zeroflax.sharding.mesh import sequence_size
from zeroflax.sharding.scopes import GROUP_NAME
from zeroflax.sharding.policy import is_none, is_placement, shard_bytes

LISTED = 10  # leaves listed by name in the printed sections (the largest; the rest counted)


@dataclasses.dataclass
class MemoryReport:
    stage: int
    data_size: int
    num_params: int
    params: int
    opt_state: int
    grad_buffer: int
    other_state: int
    batch: int
    argument: int
    output: int
    temp: int
    alias: int
    theory_at_rest: float
    pipe_size: int = 1  # pipeline stages (the pipe axis)
    tensor_size: int = 1  # tensor-slicing ways (the tensor axis)
    sequence_size: int = 1  # devices each example's tokens are split over (the sequence axis; part of N)
    bubble_fraction: float = 0.0  # idle share of the configured pipeline schedule's ticks
    # ZeRO-3's gathered weights (stage 3; zeros and empty otherwise), see `gathered_weights_at_peak`:
    gathered_peak: int = 0  # most bytes of gathered weights alive at once
    gathered_by_group: dict = dataclasses.field(default_factory=dict)  # those bytes by gather group
    gathered_wide_copies: int = 0  # wider (fp32) copies of them alive then (XLA:CPU's bf16 matmuls)
    groups: dict = dataclasses.field(default_factory=dict)  # gather group -> parameter elements
    gathered_on_entry: dict = dataclasses.field(default_factory=dict)  # leaf path -> why it is gathered on entry
    # Offload: bytes per device in host memory (by the state's memory kinds) and the device's compute copy.
    compute_params: int = 0  # the compute-dtype copy of the parameters (device)
    pending_grads: int = 0  # the delayed update's gradients (host)
    host_params: int = 0  # of `params`, in host memory
    host_opt_state: int = 0  # of `opt_state`, in host memory
    theory_device: float = 0.0  # offload: model states the device should hold at rest
    theory_host: float = 0.0  # offload: model states the host should hold (per device)
    xla_host: dict = dataclasses.field(default_factory=dict)  # memory_analysis' host_* fields (0 on CPU)
    # NVMe offload: the state's file per device (this process's file over its devices), its theory (the
    # host column's master weights and optimizer state, on disk instead), and the stream's host buffers
    # per process (the only host memory the update holds).
    disk: float = 0.0
    theory_disk: float = 0.0
    host_buffers: int = 0
    # 1-bit Adam: its sync state (error buffers, the last exchanged momentum's bits) and that state's theory.
    sync_state: int = 0
    sync_theory: float = 0.0
    # Any data size: model-state bytes per device at rest that are padding zeros (in the theory too), the
    # padded leaves (path -> true shape, stored shape, padding bytes per device), the leaves held whole over
    # `data` (path -> bytes per device, reason) and what they hold beyond 1/N (module docstring).
    padding: float = 0.0
    padded_leaves: dict = dataclasses.field(default_factory=dict)
    whole_leaves: dict = dataclasses.field(default_factory=dict)
    whole_excess: float = 0.0

    @property
    def at_rest(self) -> int:
        """Model states at rest: parameters (and their compute copy) and optimizer state held for one
        device, in its memory and, under offload, in host memory."""
        return self.params + self.opt_state + self.compute_params + self.disk

    @property
    def host_at_rest(self) -> int:
        return self.host_params + self.host_opt_state

    @property
    def device_at_rest(self) -> int:
        return self.at_rest - self.host_at_rest - self.disk

    @property
    def ratio(self) -> float:
        return self.at_rest / self.theory_at_rest

    @property
    def unaccounted(self) -> int:
        return self.argument - (self.at_rest + self.pending_grads + self.sync_state + self.other_state + self.batch)

    @property
    def peak_estimate(self) -> int:
        """Arguments + temporaries + outputs not aliased to (donated) arguments."""
        return self.argument + self.temp + self.output - self.alias

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(at_rest=self.at_rest, ratio=self.ratio, unaccounted=self.unaccounted,
                   peak_estimate=self.peak_estimate, host_at_rest=self.host_at_rest, device_at_rest=self.device_at_rest)
        return json.loads(json.dumps(out))

    def __str__(self) -> str:
        mib = lambda b: f"{b / 2**20:12.2f}"
        rows = [
            ("params", self.params), ("optimizer state", self.opt_state),
            ("gradient buffer (in temp)", self.grad_buffer), ("other state", self.other_state),
            ("batch", self.batch), ("arguments (XLA)", self.argument), ("outputs (XLA)", self.output),
            ("temporaries (XLA)", self.temp), ("aliased (donated)", self.alias),
            ("peak estimate", self.peak_estimate),
        ]
        axes = f", pipe {self.pipe_size}, tensor {self.tensor_size}" if self.pipe_size * self.tensor_size > 1 else ""
        if self.sequence_size > 1:  # ZeRO's N is data x sequence
            axes += f", of it sequence {self.sequence_size}"
        lines = [f"memory per device (ZeRO stage {self.stage}, N={self.data_size}{axes}, Psi={self.num_params:,})",
                 f"  {'category':<28}{'MiB':>12}"]
        lines += [f"  {name:<28}{mib(value)}" for name, value in rows]
        lines.append(f"  {'model states at rest':<28}{mib(self.at_rest)}   theory {self.theory_at_rest / 2**20:.2f} MiB,"
                     f" ratio {self.ratio:.3f}")
        if self.theory_host and not self.theory_disk:
            lines += [
                "  offload, from the state's memory kinds:",
                f"  {'  compute copy (device)':<28}{mib(self.compute_params)}",
                f"  {'  params in host memory':<28}{mib(self.host_params)}",
                f"  {'  opt state in host memory':<28}{mib(self.host_opt_state)}",
                f"  {'  delayed-update grads (host)':<28}{mib(self.pending_grads)}",
                f"  {'  device at rest':<28}{mib(self.device_at_rest)}   theory {self.theory_device / 2**20:.2f} MiB",
                f"  {'  host at rest':<28}{mib(self.host_at_rest)}   theory {self.theory_host / 2**20:.2f} MiB",
                "  XLA's host figures (memory_analysis; 0 on the CPU backend): "
                + ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in self.xla_host.items())]
        if self.theory_disk:
            lines += [
                "  NVMe offload (OffloadOptimizerConfig.device 'nvme'):",
                f"  {'  compute copy (device)':<28}{mib(self.compute_params)}   theory {self.theory_device / 2**20:.2f} MiB",
                f"  {'  state on disk':<28}{mib(self.disk)}   theory {self.theory_disk / 2**20:.2f} MiB "
                "(master weights and optimizer state: the file, per device)",
                f"  {'  host buffers (process)':<28}{mib(self.host_buffers)}   (buffer_count x the largest chunk's record)"]
        if self.sync_theory:
            lines.append(f"  {'1-bit buffers':<28}{mib(self.sync_state)}   theory {self.sync_theory / 2**20:.2f} MiB "
                         "(worker error 4 N C + server error 4 C + sign bits per buffer: a leaf, or 1-bit LAMB's one)")
        lines += self._leaf_lines()
        if self.pipe_size > 1:
            lines.append(f"  pipeline bubble: {self.bubble_fraction:.3f} of each stage's ticks idle")
        if self.stage == 3:
            by_group = ", ".join(f"{g} {b / 2**20:.2f}" for g, b in sorted(self.gathered_by_group.items()))
            lines.append(f"  {'gathered weights at peak':<28}{mib(self.gathered_peak)}   {by_group}")
            if self.gathered_wide_copies:
                lines.append(f"  {'  + their fp32 copies':<28}{mib(self.gathered_wide_copies)}   (XLA:CPU widens bf16 matmuls)")
            if self.groups:
                largest = sorted(self.groups.values(), reverse=True)[:2]
                lines.append(f"  gather groups: {len(self.groups)}, the two largest {largest[0]:,}"
                             + (f" and {largest[1]:,}" if len(largest) > 1 else "") + " parameters")
            if self.gathered_on_entry:
                by_reason: dict = {}
                for path, why in self.gathered_on_entry.items():
                    by_reason.setdefault(why, []).append(path)
                for why, paths in by_reason.items():
                    shown = ", ".join(paths[:6]) + (f" and {len(paths) - 6} more" if len(paths) > 6 else "")
                    lines.append(f"  gathered on entry ({why}): {shown}")
        return "\n".join(lines)

    def _leaf_lines(self) -> list[str]:
        """The padded leaves and the leaves held whole over `data`, the largest `LISTED` of each."""
        lines = []
        if self.padded_leaves:
            lines.append(f"  padded leaves (N={self.data_size} divides no free dimension): {len(self.padded_leaves)}, "
                         f"{_size(self.padding)} of padding per device at rest")
            rows = sorted(self.padded_leaves.items(), key=lambda kv: -kv[1]["bytes"])
            for path, row in rows[:LISTED]:
                shapes = f"{tuple(row['shape'])} -> {tuple(row['stored'])}"
                lines.append(f"    {path:<40} {shapes:<28} {_size(row['bytes']):>10}")
            if len(rows) > LISTED:
                rest = sum(row["bytes"] for _, row in rows[LISTED:])
                lines.append(f"    and {len(rows) - LISTED} more, {_size(rest)}")
        if self.whole_leaves:
            total = sum(row["bytes"] for row in self.whole_leaves.values())
            count = len(self.whole_leaves)
            lines.append(f"  held whole over data: {count} {'leaf' if count == 1 else 'leaves'}, {_size(total)} per device "
                         f"({_size(self.whole_excess)} beyond 1/N)")
            rows = sorted(self.whole_leaves.items(), key=lambda kv: -kv[1]["bytes"])
            for path, row in rows[:LISTED]:
                lines.append(f"    {path:<40} {_size(row['bytes']):>10}   {row['reason']}")
            if len(rows) > LISTED:
                rest = sum(row["bytes"] for _, row in rows[LISTED:])
                lines.append(f"    and {len(rows) - LISTED} more, {_size(rest)}")
        return lines


def _size(b: float) -> str:
    """Bytes for the leaf sections: B, KiB, MiB or GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def _bytes(x) -> int:
    return int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize


def theory_at_rest(stage: int, num_params: int, data_size: int, param_bytes: float, opt_bytes: float,
                   model_parallel: int = 1, padding: tuple[float, float] = (0.0, 0.0)) -> float:
    """Bytes of parameters and optimizer state per device: Psi / (pipe x tensor) of them, and ZeRO's
    1/N on top. `padding`: the (parameter, optimizer state) bytes of zeros their stored leaves add where
    ZeRO partitions them (`sharding.padding`), divided with the rest. Leaves that every stage or tensor
    slice holds whole (embeddings, norms), or that stay whole over `data`, make the measured share larger;
    the ratio shows by how much."""
    params = (param_bytes * num_params + (padding[0] if stage == 3 else 0)) / (data_size if stage == 3 else 1)
    opt = (opt_bytes * num_params + (padding[1] if stage >= 1 else 0)) / (data_size if stage >= 1 else 1)
    return (params + opt) / model_parallel


def _has_data(sharding) -> bool:
    """Whether a sharding partitions anything over the `data` axis."""
    spec = getattr(sharding, "spec", ())
    return any(DATA_AXIS in ((a,) if isinstance(a, str) else tuple(a or ())) for a in spec)


def _padding_per_device(x, sharding) -> float:
    """Bytes of zeros one device holds of a leaf (true shape `x`) stored padded under `sharding`."""
    added = math.prod(stored_shape(x.shape, sharding)) - math.prod(tuple(x.shape))
    return added * np.dtype(x.dtype).itemsize / math.prod(shards_per_dim(sharding, len(x.shape)))


def whole_reason(placement, data_size: int, threshold: int) -> str:
    """Why ZeRO keeps a parameter leaf whole over `data` (its placement's zero_dim is None)."""
    if data_size == 1:
        return "data size 1"
    if len(placement.shape) == 0:
        return "a scalar"
    per_layer = math.prod(placement.shape[1 if placement.stacked else 0:])
    if per_layer < max(threshold, 1):
        return f"below persistence_threshold ({per_layer:,} < {threshold:,} elements)"
    return "every dimension already partitioned (tensor slicing, pipe, or the layer stack)"


def leaf_states(engine) -> tuple[list, list]:
    """The model states at rest by parameter leaf: (per leaf in the params' flat order, a list of (kind, true
    ShapeDtypeStruct, sharding) of its parameter, optimizer state slots and (offload) compute copy; the
    states that belong to no leaf (the optimizer's counts), likewise)."""
    true = engine.abstract_state(stored=False)
    shardings = engine.state_shardings
    plan = engine.plan
    # With the state on disk (NVMe) the TrainState has no params or opt_state: the plan still says how they are cut.
    true_params, true_opt = plan.abstract_params, plan.abstract_opt_state
    params = jax.tree.leaves(true_params)
    per_leaf = [[("params", x, s)] for x, s in zip(params, jax.tree.leaves(plan.params))]
    index = jax.tree.unflatten(jax.tree.structure(true_params), list(range(len(params))))
    owners = jax.tree.leaves(optax.tree_map_params(engine.optimizer, lambda leaf, i: i, true_opt, index,
                                                   transform_non_params=lambda leaf: -1))
    opt = list(zip(jax.tree.leaves(true_opt), jax.tree.leaves(plan.opt_state)))
    others = []
    if len(owners) != len(opt):  # an optimizer whose state tree_map_params cannot follow: none owned
        owners = [-1] * len(opt)
    for owner, (x, s) in zip(owners, opt):
        (per_leaf[owner] if owner >= 0 else others).append(("opt_state", x, s))
    if true.compute_params is not None:
        for i, (x, s) in enumerate(zip(jax.tree.leaves(true.compute_params, is_leaf=is_none),
                                       jax.tree.leaves(shardings.compute_params, is_leaf=is_none))):
            if x is not None and s is not None:
                per_leaf[i].append(("compute_params", x, s))
    return per_leaf, others


def leaf_sections(engine) -> dict:
    """The report's padded and whole leaves, the padding per device and the whole leaves' excess over 1/N
    (`MemoryReport`'s fields of those names)."""
    config, plan, n = engine.config, engine.plan, engine.zero_size
    stage, offload = config.zero_stage, plan.offload
    # The states the theory divides by N (at this stage, or on the host under offload).
    divided = {"params": stage == 3 or offload, "opt_state": stage >= 1 or offload,
               "compute_params": stage == 3 and not config.offload_param.enabled}
    placements = jax.tree.leaves(plan.placements, is_leaf=is_placement)
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(
        plan.placements, is_leaf=is_placement)[0]]
    per_leaf, others = leaf_states(engine)
    excess = lambda states: sum(shard_bytes(x, s) * (1 - 1 / n) for kind, x, s in states
                                if divided[kind] and not _has_data(s))
    padded, whole, padding, whole_excess = {}, {}, 0.0, excess(others)
    for path, placement, states in zip(paths, placements, per_leaf):
        pad = sum(_padding_per_device(x, s) for _, x, s in states)
        padding += pad
        if pad:
            padded[path] = dict(shape=list(placement.shape), stored=list(placement.stored_shape), bytes=pad)
        if placement.zero_dim is None and any(divided[kind] for kind, _, _ in states):
            whole[path] = dict(bytes=sum(shard_bytes(x, s) for _, x, s in states),
                               reason=whole_reason(placement, n, config.persistence_threshold))
            whole_excess += excess(states)
    return dict(padding=padding, padded_leaves=padded, whole_leaves=whole, whole_excess=whole_excess)


def state_bytes_by_memory(state) -> dict:
    """{TrainState field: {memory kind: bytes one device holds}} of a live state's arrays, read from
    the arrays' own shardings."""
    out = {}
    for field in ("params", "opt_state", "compute_params", "pending_grads", "model_state"):
        kinds: dict = {}
        for x in jax.tree.leaves(getattr(state, field)):
            kind = x.sharding.memory_kind or "device"
            kinds[kind] = kinds.get(kind, 0) + shard_bytes(x, x.sharding)
        out[field] = kinds
    return out


def split_bytes(abstract_tree, sharding_tree) -> tuple[int, int]:
    """(all, in host memory): bytes one device's share of the tree takes, and those in a host memory kind."""
    pairs = list(zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(sharding_tree)))
    total = sum(shard_bytes(a, s) for a, s in pairs)
    host = sum(shard_bytes(a, s) for a, s in pairs if (s.memory_kind or "device").endswith("host"))
    return total, host



def memory_report(engine, state, batch) -> MemoryReport:
    """Bytes per device of the compiled step beside ZeRO's formulas. It compiles the step: in a run of
    several processes call it on every process (`Engine.compile` says why) and print it on one."""
    compiled = engine.compile(state, batch)
    stats = compiled.memory_analysis()
    plan = engine.plan
    # A live state's own shardings (their memory kinds) where it has them, else the plan's.
    shardings = jax.tree.map(lambda x, s: getattr(x, "sharding", None) or s, state, engine.state_shardings)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), state)
    params, host_params = split_bytes(abstract.params, shardings.params)
    opt, host_opt = split_bytes(abstract.opt_state, shardings.opt_state)
    compute_params = shard_bytes(abstract.compute_params, shardings.compute_params)
    pending = shard_bytes(abstract.pending_grads, shardings.pending_grads)
    other = (shard_bytes(abstract.step, shardings.step) + shard_bytes(abstract.rng, shardings.rng)
             + shard_bytes(abstract.loss_scale, shardings.loss_scale))
    batch_bytes = engine.batch_layout.bytes_per_device(batch)  # 1/data_size of the global batch
    # Stages 0-1 accumulate unreduced gradients in full; stages 2-3 hold one shard.
    with_data = engine.config.zero_stage >= 2
    grad_shardings = jax.tree.map(lambda p: jax.sharding.NamedSharding(plan.mesh, p.spec(with_data)),
                                  plan.placements, is_leaf=is_placement)
    grads = shard_bytes(abstract.params, grad_shardings)

    # Psi and the bytes per element from the true shapes; the stored leaves' padding apart.
    num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(plan.abstract_params))
    full_params = sum(_bytes(x) for x in jax.tree.leaves(plan.abstract_params))
    placements = jax.tree.leaves(plan.placements, is_leaf=is_placement)
    pad_params = sum((math.prod(p.stored_shape) - math.prod(p.shape)) * np.dtype(x.dtype).itemsize
                     for p, x in zip(placements, jax.tree.leaves(plan.abstract_params)))
    pad_opt = sum((math.prod(stored_shape(x.shape, s)) - math.prod(x.shape)) * np.dtype(x.dtype).itemsize
                  for x, s in zip(jax.tree.leaves(plan.abstract_opt_state), jax.tree.leaves(plan.opt_state)))
    gathered = {}
    if engine.config.zero_stage == 3:
        peak, by_group, wide = gathered_weights_at_peak(compiled.as_text(), np.dtype(engine.config.compute_dtype).itemsize)
        # The probe's groups, and those only the step has: each use of a leaf gathered where the program
        # uses it (sharding/relocate.py), which the probe (on handles) does not make.
        groups = dict(engine.probe_usage.groups)
        step_usage = engine.trace.gather_usage
        groups.update({k: v for k, v in (step_usage.groups if step_usage else {}).items() if k not in groups})
        gathered = dict(gathered_peak=peak, gathered_by_group=by_group, gathered_wide_copies=wide,
                        groups=groups, gathered_on_entry=engine.gathered_on_entry_reasons())
    full_opt = sum(_bytes(x) for x in jax.tree.leaves(plan.abstract_opt_state))
    pipe, tensor = engine.mesh.shape.get(PIPE_AXIS, 1), engine.mesh.shape.get(TENSOR_AXIS, 1)
    offload = {}
    if plan.offload:
        theory_device, theory_host = engine.update.at_rest_theory(engine.abstract_params)
        offload = dict(theory_device=theory_device, theory_host=theory_host)
    if engine.state_files is not None:  # NVMe: the host column's states are in the file
        local = max(len(engine.mesh.local_devices), 1)
        offload.update(theory_host=0.0, theory_disk=offload["theory_host"], disk=engine.update.disk_at_rest() / local,
                       host_buffers=engine.update.host_buffer_bytes())
    xla_host = {name: getattr(stats, f"host_{name}_size_in_bytes", 0) for name in ("argument", "output", "temp")}
    sync = {}
    if engine.sync.state_bytes():
        sync = dict(sync_state=shard_bytes(abstract.sync_state, shardings.sync_state),
                    sync_theory=engine.sync.state_bytes())
    theory = theory_at_rest(engine.config.zero_stage, num_params, engine.zero_size, full_params / num_params,
                            full_opt / num_params, pipe * tensor, (pad_params, pad_opt))
    if offload:
        theory = offload["theory_device"] + offload["theory_host"] + offload.get("theory_disk", 0.0)
    return MemoryReport(
        stage=engine.config.zero_stage, data_size=engine.zero_size, num_params=num_params,
        params=params, opt_state=opt, grad_buffer=grads, other_state=other, batch=batch_bytes,
        argument=stats.argument_size_in_bytes, output=stats.output_size_in_bytes,
        temp=stats.temp_size_in_bytes, alias=stats.alias_size_in_bytes,
        theory_at_rest=theory, compute_params=compute_params, pending_grads=pending, host_params=host_params,
        host_opt_state=host_opt, xla_host=xla_host, **offload, **sync,
        pipe_size=pipe, tensor_size=tensor, sequence_size=sequence_size(engine.mesh),
        bubble_fraction=engine.schedule.bubble_fraction() if engine.schedule is not None else 0.0, **gathered,
        **leaf_sections(engine))


# ------------------------------------------------------------------ gathered weights in the schedule
_VALUE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_OPERAND = re.compile(r"%([\w.\-]+)")
# Instructions whose result is another view of their operand (no buffer of their own).
_ALIASES = {"bitcast", "get-tuple-element", "tuple", "parameter", "all-gather-done", "copy-done", "optimization-barrier"}
# Ops that turn a gathered weight into the same weight in another type or layout.
_SAME_WEIGHT = {"fusion", "convert", "bitcast-convert", "copy", "transpose", "reshape"}


def _elements(type_text: str) -> int:
    return sum(int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
               for _, dims in ARRAY_TYPE.findall(type_text))


def gathered_weights_at_peak(hlo_text: str, compute_bytes: int) -> tuple[int, dict, int]:
    """(the most bytes of gathered ZeRO-3 weights alive at once in the compiled step, those bytes by
    group, and the bytes of wider copies of them alive at that point).

    For each computation of the scheduled HLO (the entry and every loop body on its own), a value is
    live from its instruction to its last use; gathered weights are the results of all-gathers and
    of the conversions that copy them whole (dequantisation, bitcasts, casts). Groups are read from
    the `zeroflax_group[...]` scope in the all-gathers' metadata ('(no group)' for gathers on entry
    or in scanned layers). Copies wider than the compute dtype (XLA:CPU has no bf16 matrix multiply
    and widens its operands to fp32; GPUs do not) are counted apart, as the third value. An estimate
    from the schedule's order, not XLA's buffer assignment.
    """
    best, best_groups, best_wide = 0, {}, 0
    for lines in split_computations(hlo_text)[0].values():
        order, size, elements, owner, source, last, wide = [], {}, {}, {}, {}, {}, set()
        for index, line in enumerate(lines):
            match = _VALUE.match(line)
            if not match:
                continue
            name, type_text, opcode, rest = match.groups()
            operands = [o for o in _OPERAND.findall(rest.split("metadata=")[0]) if o in source]
            for o in operands:
                last[source[o]] = index
            source[name] = source[operands[0]] if opcode in _ALIASES and operands else name
            if source[name] != name:
                continue
            order.append((index, name))
            last[name] = index
            sizes = array_bytes(type_text)
            size[name] = sizes[-1] if opcode.endswith("-start") else sum(sizes)  # async: the output
            elements[name] = _elements(type_text.rsplit("(", 1)[0] if not opcode.endswith("-start")
                                       else type_text.rsplit(",", 1)[-1])
            if opcode in ("all-gather", "all-gather-start"):
                group = GROUP_NAME.search(line)
                owner[name] = group.group(1) if group else "(no group)"
            elif opcode in _SAME_WEIGHT:
                for o in operands:
                    src = source[o]
                    # The same element count, up to qwZ's padding of the last block of each shard.
                    if src in owner and abs(elements[name] - elements[src]) <= 0.02 * elements[src]:
                        owner[name] = owner[src]
                        dtypes = [d for d, _ in ARRAY_TYPE.findall(type_text) if d in DTYPE_BYTES]
                        if dtypes and DTYPE_BYTES[dtypes[0]] > compute_bytes:
                            wide.add(name)
                        break
        live: set = set()
        for index, name in order:
            live = {n for n in live if last[n] >= index}
            if name in owner:
                live.add(name)
            total = sum(size[n] for n in live if n not in wide)
            if total > best:
                best, best_groups = total, {}
                best_wide = sum(size[n] for n in live if n in wide)
                for n in live - wide:
                    best_groups[owner[n]] = best_groups.get(owner[n], 0) + size[n]
    return best, best_groups, best_wide
