"""The layout grid shared by tests/test_layouts.py and benchmarks/layouts.py: run tests/layout_worker.py on
a layout (P processes x D simulated CPU devices, through `zeroflax launch` when P > 1), load what it wrote,
and compare every configuration's final parameters with the reference layout's (1 process x the same
device count). Imports neither jax nor zeroflax: the layouts run in their own processes.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import numpy as np

from cli_helpers import xla_flags_without_device_count
from tolerance import at_least, at_most

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORKER = os.path.join(HERE, "layout_worker.py")

# The worker's configurations (it checks that its table has exactly these names).
CONFIGS = ("stage0", "stage1", "stage3", "stage2_accum2", "pipeline_pipe_major", "pipeline_data_major",
           "offload_stage3", "onebit_stage2", "stage2_ordered", "onebit_ordered")
# (config, layout) -> the ConfigError zeroflax gives, by design: with a pipe axis of 2 over 6 devices, a
# process must hold whole blocks of data shards (zeroflax/batch.py: batch_share). Processes of 3 devices
# can only hold a whole stage (pipe-major order); processes of 2 only one data shard of both stages
# (data-major). Each pipeline layout runs in the order it allows and is compared with 1x6 in that order.
REFUSALS = {("pipeline_data_major", "2x3"): "not one contiguous block",
            ("pipeline_pipe_major", "3x2"): "not one contiguous block"}
TOL = 1e-6
MIN_MOVE = 1e-4  # every leaf's largest change in 5 steps (adamw lr 1e-3: about 4e-3): the run trained


@dataclasses.dataclass(frozen=True)
class Layout:
    processes: int
    devices_per_process: int

    @property
    def name(self) -> str:
        return f"{self.processes}x{self.devices_per_process}"

    @property
    def devices(self) -> int:
        return self.processes * self.devices_per_process

    @property
    def reference(self) -> "Layout":
        return Layout(1, self.devices)


def parse(name: str) -> Layout:
    p, d = name.split("x")
    return Layout(int(p), int(d))


def launch(layout: Layout, outdir: str, timeout_s: float = 180, configs=()) -> float:
    """Run the worker on `layout`, writing into `outdir`; the wall seconds. A non-zero exit or a timeout is
    an AssertionError that shows the end of the worker's stderr."""
    os.makedirs(outdir, exist_ok=True)
    python = sys.executable
    worker = [python, WORKER, outdir, *configs]
    env = {**os.environ, "XLA_FLAGS": xla_flags_without_device_count()}  # the worker sets its own device count
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if layout.processes == 1:
        command = worker
        env["ZEROFLAX_CPU_DEVICES"] = str(layout.devices_per_process)
    else:
        command = [python, "-m", "zeroflax", "launch", "--nproc", str(layout.processes), "--devices_per_process",
                   str(layout.devices_per_process), "--", *worker]
    start = time.perf_counter()
    # A session of its own, so that a timeout ends the launcher's worker processes too, not only the launcher.
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                               start_new_session=True)
    try:
        _, stderr = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, stderr = process.communicate()
        raise AssertionError(f"layout {layout.name} ran past {timeout_s:g} s; its stderr ends:\n{_tail(stderr)}") from None
    finally:
        if process.poll() is None:  # interrupted (Ctrl-C): take the job down with the test
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    seconds = time.perf_counter() - start
    assert process.returncode == 0, (f"layout {layout.name} exited with {process.returncode}; stderr ends:\n"
                                     f"{_tail(stderr)}")
    return seconds


def _tail(text, chars: int = 4000) -> str:
    lines = [line for line in (text or "").splitlines() if "[Gloo]" not in line]  # gloo's connection chatter
    return "\n".join(lines)[-chars:]


@dataclasses.dataclass
class Run:
    """One configuration on one layout, as the worker wrote it."""
    final: dict
    init: dict
    losses: np.ndarray
    phases: list
    processes: int
    devices: int
    partitioned: list


def load(outdir: str, config: str) -> Run | str:
    """The run, or the worker's error text when the configuration raised; an AssertionError if neither
    file exists (the worker never got to it)."""
    error = os.path.join(outdir, f"{config}.error")
    if os.path.exists(error):
        with open(error) as f:
            return f.read()
    path = os.path.join(outdir, f"{config}.npz")
    assert os.path.exists(path), f"{path}: the worker wrote neither results nor an error for {config}"
    with np.load(path) as z:
        return Run(final={k[len("final"):]: z[k] for k in z.files if k.startswith("final")},
                   init={k[len("init"):]: z[k] for k in z.files if k.startswith("init")},
                   losses=z["losses"], phases=list(z["phases"]), processes=int(z["processes"]), devices=int(z["devices"]),
                   partitioned=list(z["partitioned"]))


def check_trained(run: Run, what: str) -> None:
    """The run is what it claims and really trained: finite losses, every leaf moved from its init."""
    assert np.all(np.isfinite(run.losses)), f"{what}: losses {run.losses}"
    assert run.final.keys() == run.init.keys(), f"{what}: leaves {sorted(run.final)} vs init {sorted(run.init)}"
    for k in run.final:
        assert run.final[k].shape == run.init[k].shape, f"{what}: leaf {k} has shape {run.final[k].shape}"
        assert np.all(np.isfinite(run.final[k])), f"{what}: leaf {k} is not finite"
        moved = float(np.max(np.abs(run.final[k] - run.init[k])))
        at_least(moved, MIN_MOVE, "a leaf's largest change in 5 steps", f"({what}: leaf {k}: did it train?)")


def difference(run: Run, reference: Run) -> tuple[float, bool]:
    """(max |run - reference| over every element of every leaf, bitwise equal)."""
    assert run.final.keys() == reference.final.keys(), (sorted(run.final), sorted(reference.final))
    for k in run.init:
        np.testing.assert_array_equal(run.init[k], reference.init[k], err_msg=f"initial {k} differs")
    diff = max(float(np.max(np.abs(run.final[k] - reference.final[k]))) for k in run.final)
    bitwise = all(np.array_equal(run.final[k], reference.final[k]) for k in run.final)
    return diff, bitwise


@dataclasses.dataclass
class Cell:
    config: str
    layout: str
    reference: str  # "<config>@<layout>" compared with
    diff: float | None = None
    bitwise: bool | None = None
    refused: str | None = None  # the expected ConfigError's text
    partitioned: int = 0  # leaves whose state.params sharding names the data axis (informative)
    leaves: int = 0
    failure: str | None = None


def compare(root: str, layouts: list[Layout]) -> list[Cell]:
    """Every configuration on every layout of `layouts` (outputs under root/<layout>) against its reference
    layout (which must be in `layouts`), plus the two pipeline mesh orders against each other on each
    reference. A cell's `failure` says what is wrong; none is skipped."""
    cells = []
    names = {layout.name for layout in layouts}
    for layout in layouts:
        ref = layout.reference
        assert ref.name in names, f"layout {layout.name} needs its reference {ref.name} in the grid"
        pairs = [(config, config) for config in CONFIGS]
        if layout == ref:  # the reference against itself only where two configurations should agree
            pairs = [("pipeline_data_major", "pipeline_pipe_major")]
        for config, ref_config in pairs:
            cell = Cell(config, layout.name, f"{ref_config}@{ref.name}")
            cells.append(cell)
            run, reference = load(os.path.join(root, layout.name), config), load(os.path.join(root, ref.name), ref_config)
            expected_refusal = REFUSALS.get((config, layout.name))
            if isinstance(reference, str):
                cell.failure = f"the reference {cell.reference} raised: {reference.splitlines()[0]}"
                continue
            if isinstance(run, str):
                if expected_refusal and "ConfigError" in run and expected_refusal in run:
                    cell.refused = run.splitlines()[0]
                else:
                    cell.failure = f"raised: {run.splitlines()[0]}"
                continue
            try:
                check_trained(reference, cell.reference)
                check_trained(run, f"{config}@{layout.name}")
                assert (run.processes, run.devices) == (layout.processes, layout.devices), (
                    f"{config}@{layout.name} ran on {run.processes} processes, {run.devices} devices")
                assert run.phases == reference.phases, f"step programs {run.phases} vs {reference.phases}"
                if config.startswith("onebit"):  # past the freeze step: compressed momentum exchanges ran
                    assert run.phases.count("compressed") >= 2, f"1-bit Adam's step programs {run.phases}"
                cell.diff, cell.bitwise = difference(run, reference)
                cell.partitioned, cell.leaves = len(run.partitioned), len(run.final)
                at_most(cell.diff, TOL, "max |diff| from the reference layout", f"({config}@{layout.name})")
                if config.endswith("_ordered"):  # Config.deterministic_reductions: the same bits on any layout
                    assert cell.bitwise, f"not bitwise with deterministic_reductions (max |diff| {cell.diff:.3g})"
            except AssertionError as error:
                cell.failure = str(error)
    return cells


def table(cells: list[Cell], seconds: dict | None = None) -> str:
    """configuration x layout -> max |diff| vs the reference, bitwise yes/no (markdown)."""
    lines = ["| configuration | layout | vs | max abs diff | bitwise | ZeRO-partitioned leaves |",
             "|---|---|---|---|---|---|"]
    for c in cells:
        if c.refused:
            result = f"refused: {c.refused} | - | -"
        elif c.diff is None:
            result = f"FAILED: {c.failure} | - | -"
        else:
            result = (f"{c.diff:.3g} | {'yes' if c.bitwise else 'no'} | {c.partitioned}/{c.leaves}"
                      + (f" FAILED: {c.failure}" if c.failure else ""))
        lines.append(f"| {c.config} | {c.layout} | {c.reference} | {result} |")
    if seconds:
        lines.append("")
        lines.append("wall seconds per layout: " + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()))
    return "\n".join(lines)
