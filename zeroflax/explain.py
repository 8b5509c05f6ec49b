"""Where a step's memory goes: every byte XLA reserves for the compiled step, by layer and by category.

`zeroflax.memory_report(engine, state, batch, by="layer")` and `zeroflax explain` (per ZeRO stage, with a figure).
All figures are per device. Two sources, summed:

- The step's arguments, the train state and the batch: each leaf's bytes on one device, from its sharding
  (exact), charged to the layer that owns it (a stacked leaf evenly to its layers), in device or host
  memory by its memory kind. Optimizer state, compute copies and 1-bit buffers follow their parameter.
- Everything else XLA reserves (its temporary buffer and the outputs not donated to arguments): XLA's own
  buffer assignment, dumped while the step compiles. XLA reuses each region of its buffer for several
  values in turn; each byte is charged to the value occupying it at the step's worst moment (the most
  bytes live, by XLA's live ranges), so the table is the picture at the peak; a byte free at that moment
  goes to the value occupying it longest over the step (XLA's packing slack, charged to the value that
  region mostly exists for; ties: the larger, then the earlier). That value's layer and category
  come from the name scopes of the operation defining it (`sharding.scopes`) and from its live range:
    gathered weights   all-gathers inside the model (ZeRO-3); outside it (stages 1-2's re-gather of the
                       updated shards) they count as parameters
    gradients          the gradient synchronisation, and backward values shaped like a parameter (whole,
                       one layer of a stack, or a shard)
    optimizer state    the update's working values: new moments and master weights before they replace
                       the old, clipping
    saved activations  forward values still live when the backward pass starts (remat's residuals)
    other temporaries  the rest: activation gradients, recomputation, the loss, an operation's scratch
  Its layer: the innermost gather group (Flax module path); in a `scan_layers` loop, values that carry the
  layers' leading dimension are split over the layers and the loop body's own values are the row
  "<stack> (one layer at a time)"; other model values are "(outside layers)"; the rest of the step
  (update, gradient sync) is "(step)".

The sum equals memory_analysis' total (arguments + outputs + temporaries - aliased) up to what no value
occupies (alignment, XLA's own bookkeeping): `coverage` is the fraction explained. Beside it,
`peak_live` is what is live at the step's worst moment by XLA's live ranges; the reserved total exceeds
it by XLA's packing slack (regions free at that moment, needed at others).
"""
from __future__ import annotations

import dataclasses
import json
import os
import re

import jax
import numpy as np

from zeroflax.buffer_assignment import Value, charge_regions, compile_with_buffers, peak_live
from zeroflax.hlo import entry_arguments
from zeroflax.sharding.padding import stored_shape
from zeroflax.sharding.policy import is_placement, shard_bytes
from zeroflax.sharding.scopes import GRAD_SYNC_SCOPE, GROUP_NAME, LAYERS_SCOPE, SCOPE_END, UPDATE_SCOPE

PARAMS, GRADS, OPT = "parameters", "gradients", "optimizer state"
GATHERED, SAVED, OTHER, BATCH = "gathered weights", "saved activations", "other temporaries", "batch"
CATEGORIES = (PARAMS, GRADS, OPT, GATHERED, SAVED, OTHER, BATCH)
DEVICE, HOST = "device", "host"
OUTSIDE, STEP, BATCH_ROW = "(outside layers)", "(step)", "(batch)"
ONE_AT_A_TIME = " (one layer at a time)"


# ------------------------------------------------------------------------------- attribution
def _path(key_path) -> str:
    return "/".join(str(k.key) for k in key_path if isinstance(k, jax.tree_util.DictKey))


@dataclasses.dataclass
class Owners:
    """Which row owns what: parameter paths, stacks and groups of one engine."""
    rows: list  # rows in display order
    by_path: dict  # parameter path -> [(row, fraction)]
    stacks: dict  # stack length -> row prefix
    groups: list  # gather group names, longest first
    grad_dims: set  # shapes a parameter's gradient (or the parameter) takes on one device
    by_dims: dict  # such a shape -> the rows owning every parameter of that shape, where they agree

    def of_path(self, path: str) -> list:
        """The rows owning a state leaf at this path (a parameter's, or its optimizer state's)."""
        return self.by_path.get(path) or _owner(path, self.groups)


def _owner(path: str, groups: list) -> list:
    """A leaf outside any stack: its innermost gather group, else its top-level name."""
    for group in groups:  # longest first
        if path == group or path.startswith(group + "/"):
            return [(group, 1.0)]
    return [(path.split("/")[0], 1.0)] if path else [(STEP, 1.0)]


def _owners(engine) -> Owners:
    plan = engine.plan
    placements = jax.tree.leaves(plan.placements, is_leaf=is_placement)
    paths = [_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(engine.abstract_params)[0]]
    usage = engine.probe_usage
    groups = sorted((g.split("#")[0] for g in (usage.groups if usage is not None else {})), key=len, reverse=True)
    stacked = [(path, p) for path, p in zip(paths, placements) if p.stacked]
    stacks = {}
    for path, p in stacked:
        local = _device_shape(engine, p, True)[0]
        prefix = stacks.get(local)
        stacks[local] = path if prefix is None else os.path.commonpath([prefix, path])
    # A stack's row names: the stacked leaves' common path ("layers" where they have none in common).
    stacks = {length: prefix if prefix not in paths else prefix.rpartition("/")[0] for length, prefix in stacks.items()}
    stacks = {length: prefix or "layers" for length, prefix in stacks.items()}
    rows, by_path, grad_dims, by_dims = [], {}, set(), {}
    for path, p in zip(paths, placements):
        shapes = {tuple(p.shape), _device_shape(engine, p, True), _device_shape(engine, p, False)}
        if p.stacked:
            shapes |= {s[1:] for s in shapes}
            local = _device_shape(engine, p, True)[0]
            owners = [(f"{stacks[local]}.{i}", 1.0 / local) for i in range(local)]
        else:
            owners = _owner(path, groups)
        grad_dims |= shapes
        by_path[path] = owners
        for dims in shapes:
            by_dims.setdefault(dims, []).append(owners)
        rows += [r for r, _ in owners if r not in rows]
    # Gather groups in the order the model calls them (the probe trace's order), the other rows as they come.
    called = [g.split("#")[0] for g in (usage.groups if usage is not None else {})]
    rows = sorted(rows, key=lambda r: called.index(r) if r in called else -1)
    rows += [f"{prefix}{ONE_AT_A_TIME}" for prefix in stacks.values()] + [OUTSIDE, STEP, BATCH_ROW]
    # A shape that only one set of rows' parameters take (the step's gradients, updates) names those rows.
    by_dims = {dims: found[0] for dims, found in by_dims.items() if all(f == found[0] for f in found)}
    return Owners(rows, by_path, stacks, groups, grad_dims, by_dims)


def _device_shape(engine, placement, with_data: bool) -> tuple:
    """One device's shape of a parameter leaf, sharded over `data` (ZeRO) or not."""
    sharding = jax.sharding.NamedSharding(engine.mesh, placement.spec(with_data))
    return tuple(sharding.shard_shape(stored_shape(placement.shape, sharding)))


_LAYERS = re.compile(re.escape(LAYERS_SCOPE) + r"(\d+)" + re.escape(SCOPE_END))


def value_rows(value: Value, owners: Owners) -> list:
    """[(row, fraction)] that own a working value (module docstring)."""
    op = value.op_name
    groups = GROUP_NAME.findall(op)
    if groups:
        name = groups[-1].split("#")[0]
        return [(name, 1.0)]
    layers = _LAYERS.search(op)
    if layers:
        length = int(layers.group(1))
        prefix = owners.stacks.get(length, f"scan[{length}]")
        rest = op[layers.end():]
        stacked = value.dims and value.dims[0] == length and ("/while/body" not in rest
                                                               or rest.endswith("dynamic_update_slice"))
        if stacked:
            return [(f"{prefix}.{i}", 1.0 / length) for i in range(length)]
        return [(f"{prefix}{ONE_AT_A_TIME}", 1.0)]
    if "jvp(" in op or "transpose(" in op:
        return [(OUTSIDE, 1.0)]
    return owners.by_dims.get(value.dims) or [(STEP, 1.0)]


def value_category(value: Value, owners: Owners, backward_start: int) -> str:
    """The category of a working value (module docstring)."""
    op = value.op_name
    in_model = "jvp(" in op or "transpose(" in op
    if value.opcode.startswith("all-gather") or op.endswith("/all_gather"):
        return GATHERED if in_model else PARAMS
    if UPDATE_SCOPE in op:
        return OPT
    if GRAD_SYNC_SCOPE in op:
        return GRADS
    if "transpose(" in op or not in_model:  # the backward pass; the step between it and the update
        return GRADS if value.dims in owners.grad_dims else OTHER
    if in_model and value.end > backward_start >= 0:
        return SAVED
    return OTHER


# ------------------------------------------------------------------------------------ report
@dataclasses.dataclass
class LayerMemory:
    """Bytes per device by row (layer, module, or a part of the step) and (category, device | host)."""
    stage: int
    data_size: int
    rows: list
    bytes: dict  # row -> {(category, place): bytes}
    total: int  # memory_analysis: arguments + outputs + temporaries - aliased
    peak_live: int  # arguments + XLA's working buffers live at the worst moment
    arguments_xla: int  # memory_analysis' argument bytes
    arguments: int = 0  # the state's and the batch's bytes charged from their shardings (should equal it)
    unread: int = 0  # state bytes the step never reads (jit drops them from its arguments): not charged

    @property
    def charged(self) -> int:
        return int(round(sum(sum(cells.values()) for cells in self.bytes.values())))

    @property
    def coverage(self) -> float:
        return self.charged / self.total

    def by_category(self, place: str | None = None) -> dict:
        out = dict.fromkeys(CATEGORIES, 0.0)
        for cells in self.bytes.values():
            for (category, where), b in cells.items():
                if place is None or where == place:
                    out[category] += b
        return out

    def row_total(self, row: str) -> float:
        return sum(self.bytes.get(row, {}).values())

    def to_dict(self) -> dict:
        return json.loads(json.dumps({
            "stage": self.stage, "data_size": self.data_size, "total": self.total, "charged": self.charged,
            "coverage": self.coverage, "peak_live": self.peak_live, "arguments_xla": self.arguments_xla,
            "arguments": self.arguments, "unread": self.unread,
            "rows": {row: {f"{c}/{p}": b for (c, p), b in self.bytes.get(row, {}).items()} for row in self.rows}}))

    def __str__(self) -> str:
        unit, scale = ("MiB", 2**20) if self.total >= 8 * 2**20 else ("KiB", 2**10)
        filled = {cell for cell, b in _cells(self) if b}
        columns = [(c, p) for p in (DEVICE, HOST) for c in CATEGORIES if (c, p) in filled]
        head = "".join(f"{(c if p == DEVICE else c + ' (host)')[:17]:>18}" for c, p in columns)
        lines = [f"memory per device by layer (ZeRO stage {self.stage}, N={self.data_size}), {unit}",
                 f"  {'row':<30}{head}{'total':>12}"]
        for row in self.rows:
            cells = self.bytes.get(row, {})
            if not any(cells.values()):
                continue
            line = "".join(f"{cells.get(col, 0) / scale:18.2f}" for col in columns)
            lines.append(f"  {row[:29]:<30}{line}{sum(cells.values()) / scale:12.2f}")
        sums = {col: sum(self.bytes.get(r, {}).get(col, 0) for r in self.rows) for col in columns}
        lines.append(f"  {'sum':<30}" + "".join(f"{sums[col] / scale:18.2f}" for col in columns)
                     + f"{self.charged / scale:12.2f}")
        lines.append(f"  memory_analysis total {self.total / scale:.2f} {unit}: {self.coverage:.1%} charged above; "
                     f"the rest, {(self.total - self.charged) / scale:.2f} {unit}, is XLA's own (bytes no value occupies)")
        if self.unread:
            lines.append(f"  not charged: {self.unread / scale:.2f} {unit} of state this step never reads "
                         "(not among its arguments)")
        lines.append(f"  live at the step's worst moment: {self.peak_live / scale:.2f} {unit} "
                     f"({self.peak_live / self.total:.1%} of the total; the rest is packing slack: regions "
                     "free then, needed at other moments)")
        return "\n".join(lines)


def _cells(report: LayerMemory):
    for cells in report.bytes.values():
        yield from cells.items()


def _add(table: dict, owners: list, category: str, place: str, nbytes: float) -> None:
    for row, fraction in owners:
        cells = table.setdefault(row, {})
        cells[(category, place)] = cells.get((category, place), 0.0) + nbytes * fraction


def _place(sharding) -> str:
    return HOST if (getattr(sharding, "memory_kind", None) or "device").endswith("host") else DEVICE


def layer_report(engine, state, batch, phase: str | None = None) -> LayerMemory:
    """The step's memory per device by layer and category (module docstring)."""
    owners = _owners(engine)
    abstract, batch_abs = engine.abstract_args(state, batch)
    compiled, allocations, _ = compile_with_buffers(engine.step_function(batch_abs, phase).lower(abstract, batch_abs))
    stats = compiled.memory_analysis()
    total = (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
             - stats.alias_size_in_bytes)

    # The arguments the compiled step takes, by name (jit drops the ones it never reads).
    kept = entry_arguments(compiled.as_text())
    table: dict = {}
    unread = 0
    categories = {"params": PARAMS, "compute_params": PARAMS, "model_state": PARAMS, "opt_state": OPT,
                  "sync_state": OPT, "pending_grads": GRADS, "step": OPT, "rng": OPT, "loss_scale": OPT}
    for field, category in categories.items():
        leaves = jax.tree_util.tree_flatten_with_path(getattr(abstract, field))[0]
        for key_path, leaf in leaves:
            nbytes = shard_bytes(leaf, leaf.sharding)
            if kept and f"state.{field}{jax.tree_util.keystr(key_path)}" not in kept:
                unread += nbytes
                continue
            path = _path(key_path)
            rows = owners.of_path(path) if field not in ("step", "rng", "loss_scale") else [(STEP, 1.0)]
            _add(table, rows, category, _place(leaf.sharding), nbytes)
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(batch_abs)[0]:
        if not kept or f"batch{jax.tree_util.keystr(key_path)}" in kept:
            _add(table, [(BATCH_ROW, 1.0)], BATCH, DEVICE, shard_bytes(leaf, leaf.sharding))
    arguments = sum(sum(cells.values()) for cells in table.values())

    working = [a for a in allocations if a.working]
    peak, moment = peak_live(allocations)
    backward = [v.start for a in working for v in a.values if "transpose(" in v.op_name and v.start >= 0]
    backward_start = min(backward) if backward else -1
    for allocation in working:
        charged = charge_regions(allocation, moment)
        place = HOST if allocation.host else DEVICE
        for value in allocation.values:
            if charged.get(value.id):
                _add(table, value_rows(value, owners), value_category(value, owners, backward_start), place,
                     charged[value.id])
    rows = [r for r in owners.rows if r in table] + [r for r in table if r not in owners.rows]
    return LayerMemory(stage=engine.config.zero_stage, data_size=engine.data_size, rows=rows, bytes=table,
                       total=total, peak_live=stats.argument_size_in_bytes + peak,
                       arguments_xla=stats.argument_size_in_bytes, arguments=int(round(arguments)), unread=unread)


# ---------------------------------------------------------------------------------- timeline
@dataclasses.dataclass(frozen=True)
class Transfer:
    """One collective of the step, at its place in the compiled schedule."""
    moment: int  # position in XLA's schedule of the whole step (`buffer_assignment.parse_sequence`)
    phase: str
    kind: str
    row: str  # the layer (or part of the step) whose bytes it moves
    bytes: float  # per device per step, loop trips included (`comm.parse_collectives`)
    dtype: str


def transfer_phase(kind: str, op_name: str) -> str:
    """The part of the step a collective belongs to, from its name scopes."""
    if UPDATE_SCOPE in op_name:
        return "all-gather of the updated parameters" if kind == "all-gather" else f"update ({kind})"
    if GRAD_SYNC_SCOPE in op_name:
        return f"gradient sync ({kind})"
    if "transpose(" in op_name:
        return "backward gather" if kind == "all-gather" else f"backward {kind}"
    if "jvp(" in op_name:
        return "forward gather" if kind == "all-gather" else f"forward {kind}"
    return f"step ({kind})"


def step_timeline(engine, state, batch, phase: str | None = None) -> list[Transfer]:
    """Every collective of the compiled step in schedule order: which part of the step it serves, whose
    bytes it moves, how many. Drawn from the compiled HLO and XLA's schedule, not by hand."""
    from zeroflax.comm import parse_collectives

    abstract, batch_abs = engine.abstract_args(state, batch)
    compiled, _, schedule = compile_with_buffers(engine.step_function(batch_abs, phase).lower(abstract, batch_abs))
    collectives, _ = parse_collectives(compiled.as_text(), engine.mesh.size, dict(engine.mesh.shape))
    owners = _owners(engine)
    transfers = []
    for c in collectives:
        rows = value_rows(Value(-1, c.name, c.result_bytes, 0, c.dims, op_name=c.op_name), owners)
        row = rows[0][0] if len(rows) == 1 else f"{rows[0][0]}..{rows[-1][0]}"
        if row == STEP and (GRAD_SYNC_SCOPE in c.op_name or UPDATE_SCOPE in c.op_name):
            row = "(several)"  # a combined collective, or a shape several layers' leaves share
        transfers.append(Transfer(schedule.get(c.name, -1), transfer_phase(c.kind, c.op_name), c.kind, row,
                                  c.bytes_per_step, c.dtype))
    return sorted(transfers, key=lambda t: t.moment)


def format_timeline(transfers: list) -> str:
    lines = [f"  {'#':>3}  {'phase':<38}{'collective':<16}{'layer':<26}{'KiB/step':>10}  dtype"]
    lines += [f"  {i:>3}  {t.phase:<38}{t.kind:<16}{t.row[:25]:<26}{t.bytes / 2**10:10.2f}  {t.dtype}"
              for i, t in enumerate(transfers)]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ figure
COLORS = {PARAMS: "#4c72b0", GRADS: "#dd8452", OPT: "#55a868", GATHERED: "#c44e52", SAVED: "#8172b3",
          OTHER: "#937860", BATCH: "#da8bc3"}


def _matplotlib():
    """matplotlib's Figure, Patch and colormaps, used without pyplot (no global backend is touched: a
    notebook's inline plots keep working). An optional dependency: say how to get it."""
    try:
        from matplotlib import colormaps
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as error:
        raise RuntimeError("the figure needs matplotlib: pip install 'zeroflax[docs]'") from error
    return Figure, Patch, colormaps


def plot_layers(reports: list, path: str, title: str = "") -> None:
    """Stacked horizontal bars per row, one panel per report (ZeRO stage), written as a PNG. Host bytes
    are hatched."""
    Figure, Patch, _ = _matplotlib()
    rows = []
    for report in reports:
        rows += [r for r in report.rows if r not in rows and any(report.bytes.get(r, {}).values())]
    scale, unit = (2**20, "MiB") if max(r.total for r in reports) >= 8 * 2**20 else (2**10, "KiB")
    fig = Figure(figsize=(3.6 * len(reports) + 1.5, 0.32 * len(rows) + 1.8))
    axes = fig.subplots(1, len(reports), sharex=True, sharey=True, squeeze=False)
    for ax, report in zip(axes[0], reports):
        left = np.zeros(len(rows))
        for place in (DEVICE, HOST):
            for category in CATEGORIES:
                widths = np.array([report.bytes.get(r, {}).get((category, place), 0.0) for r in rows]) / scale
                if widths.any():
                    ax.barh(range(len(rows)), widths, left=left, color=COLORS[category],
                            hatch="//" if place == HOST else None, edgecolor="white", linewidth=0.3)
                    left += widths
        ax.set_title(f"ZeRO stage {report.stage}: {report.total / scale:.1f} {unit}\n"
                     f"({report.coverage:.1%} charged)", fontsize=9)
        ax.set_xlabel(f"{unit} per device")
        ax.grid(axis="x", alpha=0.3)
    axes[0][0].set_yticks(range(len(rows)), rows, fontsize=8)
    axes[0][0].invert_yaxis()
    handles = [Patch(color=COLORS[c], label=c) for c in CATEGORIES]
    if any(p == HOST for r in reports for (_, p), b in _cells(r) if b):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="in host memory"))
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.08 + 0.02 * (len(handles) > 8), 1, 1))
    fig.savefig(path, dpi=120)


def plot_timeline(timelines: dict, path: str, title: str = "") -> None:
    """{label: [Transfer]} drawn as one strip each: the step's collectives in schedule order, bar height
    the bytes moved, colour the part of the step, the layer written on the bar. PNG."""
    Figure, Patch, colormaps = _matplotlib()
    phases = list(dict.fromkeys(t.phase for transfers in timelines.values() for t in transfers))
    palette = colormaps["tab10"]
    color = {phase: palette(i % 10) for i, phase in enumerate(phases)}
    width = max(len(t) for t in timelines.values())
    fig = Figure(figsize=(max(7.0, 0.55 * width + 2), 2.1 * len(timelines) + 1.2))
    axes = fig.subplots(len(timelines), 1, sharex=True, squeeze=False)
    for ax, (label, transfers) in zip(axes[:, 0], timelines.items()):
        kib = [t.bytes / 2**10 for t in transfers]
        ax.bar(range(len(transfers)), kib, color=[color[t.phase] for t in transfers])
        for i, t in enumerate(transfers):
            ax.text(i, kib[i], t.row, rotation=90, ha="center", va="bottom", fontsize=7)
        ax.set_ylim(0, max(kib + [1e-9]) * 1.9)
        ax.set_ylabel("KiB per device")
        ax.set_title(label, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("the step's collectives, in XLA's schedule order")
    fig.legend(handles=[Patch(color=color[p], label=p) for p in phases], loc="lower center",
               ncol=min(3, len(phases)), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.02 + 0.03 * ((len(phases) + 2) // 3), 1, 1))
    fig.savefig(path, dpi=120)
