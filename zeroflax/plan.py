"""`zeroflax plan`: the cheapest configuration of the GPT that fits the memory, by compiling, not running.

    zeroflax plan --devices 8 --device-memory 16MiB --gin_file experiments/gpt_tiny_zero3.gin --out plan.gin

The search space: ZeRO stage 0-3, offload (none; the optimizer on the CPU at stages 1-3; and the
parameters too at stage 3; on request, 'nvme': the optimizer's state on disk under --nvme-path at stages
1-3, ZeRO-Infinity), the remat policy (`Config.remat`), micro-batch size x accumulation steps for
the fixed global batch, and the tensor size of the mesh (the data axis takes the rest); pipe sizes on
request (--pipe; docs/plan.md says why not by default). Every candidate is first judged analytically
(no compile):

  - invalid: the engine refuses it (a `ConfigError`, e.g. a tensor size that does not divide the heads);
  - pruned, memory: rules that cannot reject a candidate that would fit (docs/plan.md):
      host states (`estimate.zeroflax_states`, exact) x devices, plus an 'nvme' candidate's stream buffers,
        > --host-memory;
      disk states ('nvme': `estimate.zeroflax_states`, exact) x devices > --disk-memory;
      the step's device arguments (states at rest + batch rows, exact) > --device-memory: the compiled
        peak is at least its arguments;
      the modeled peak (`estimate.gpt_peak`; not for pipelines) > --device-memory x
        (1 + PEAK_MARGIN): the model's largest measured over-estimate is below PEAK_MARGIN;
  - then, in order of its analytic cost (`cost.gpt_bound`, a lower bound of the compiled cost), each is
    compiled on simulated CPU devices from abstract inputs (`initialize(..., abstract=True)`): its
    compiled memory (memory_analysis: argument + output + temp - alias, less the states in host memory)
    decides fits / over budget, and its compiled cost (cost.measure) replaces the bound;
  - the search stops when the next bound is not below the best fitting compiled cost by more than the
    tie tolerance (--tie): no remaining candidate can be cheaper. Those are "pruned, cost".

The winner is written as a gin file that includes the input gin files and binds the chosen Config keys.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import os
import sys
import time
import warnings
from typing import Any

from zeroflax.axes import PIPE_AXIS, SEQUENCE_AXIS
from zeroflax.config import ConfigError

# The modeled peak is used to prune only when it exceeds the budget by more than this share: its largest
# over-estimate measured against memory_analysis is +16% on the main job's GPT (49 configurations) and +28%
# on the tests' 2-layer GPT (docs/plan.md, tests/test_estimate.py).
PEAK_MARGIN = 0.4
# The offload modes searched by default; 'nvme' (the state on disk) is searched on request only, since it
# needs a directory (--nvme-path) and a disk rate to mean anything.
OFFLOADS = ("none", "optimizer", "optimizer+param")
OFFLOAD_MODES = OFFLOADS + ("nvme",)


@dataclasses.dataclass
class Candidate:
    pipe: int
    tensor: int
    data: int
    stage: int
    offload: str
    remat: str
    micro_batch: int
    accum: int
    status: str = "pending"  # invalid | pruned | fits | over budget
    reason: str = ""
    arguments: float = 0.0  # analytic: device states at rest + batch rows (exact for the placement)
    host: float = 0.0  # analytic: host states per device
    peak_model: float | None = None  # analytic: modeled device peak (None under a pipeline)
    bound: Any = None  # cost.Cost, analytic lower bound
    measured: Any = None  # cost.Cost from the compiled program
    device_peak: float | None = None  # compiled: argument + output + temp - alias, less host states
    compile_s: float = 0.0
    sequence: int = 1  # the sequence axis (long sequences: docs/parallelism.md); data x sequence is ZeRO's N
    nvme_path: str = ""  # offload 'nvme': the state's directory (--nvme-path)
    disk: float = 0.0  # analytic: 'nvme' disk states per device (true elements)
    host_buffers: float = 0.0  # analytic: 'nvme' stream buffers per process

    @property
    def label(self) -> str:
        mesh = f"p{self.pipe}xd{self.data}" + (f"xs{self.sequence}" if self.sequence > 1 else "") + f"xt{self.tensor}"
        return f"{mesh} z{self.stage} {self.offload} {self.remat} {self.micro_batch}x{self.accum}"

    def seconds(self, rates) -> float:
        """The predicted step time: from the compiled program where compiled, else the analytic bound."""
        return (self.measured or self.bound).seconds(rates)

    def config(self, base):
        from zeroflax.config import MeshConfig
        from zeroflax.estimate import row_config
        axes = {PIPE_AXIS: self.pipe} if self.pipe > 1 else {}
        axes.update(data=self.data, tensor=self.tensor)
        if self.sequence > 1:
            axes[SEQUENCE_AXIS] = self.sequence
        return row_config(base, self.stage, self.offload, nvme_path=self.nvme_path or None, mesh=MeshConfig(axes),
                          remat=self.remat, micro_batch_size=self.micro_batch, grad_accum_steps=self.accum,
                          train_batch_size=self.micro_batch * self.accum * self.data)


@dataclasses.dataclass
class Space:
    """What the search varies; None = everything the model and devices allow."""
    stages: tuple = (0, 1, 2, 3)
    offloads: tuple = OFFLOADS
    remats: tuple | None = None
    micro_batches: tuple | None = None
    tensor: tuple | None = None
    pipe: tuple | None = (1,)  # pipelines only on request (--pipe): see docs/plan.md
    sequence: tuple | None = (1,)  # sequence axes only on request (--sequence); None: every divisor
    nvme_path: str = ""  # the directory of 'nvme' candidates (nothing is written there while planning)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_candidates(base, gpt, devices: int, global_batch: int, space: Space) -> list[Candidate]:
    from zeroflax.config import REMAT_POLICIES
    out = []
    tensors = space.tensor or [t for t in _divisors(devices) if gpt.num_heads % t == 0]
    pipes = space.pipe or [p for p in _divisors(devices) if gpt.num_layers % p == 0]
    remats = space.remats or REMAT_POLICIES
    sequences = space.sequence or _divisors(devices)
    for pipe, tensor, sequence in itertools.product(pipes, tensors, sequences):
        if devices % (pipe * tensor * sequence):
            continue
        data = devices // (pipe * tensor * sequence)
        if global_batch % data:
            continue
        per_rank = global_batch // data
        micros = [m for m in (space.micro_batches or _divisors(per_rank)) if per_rank % m == 0]
        for stage, offload, remat, micro in itertools.product(space.stages, space.offloads, remats, micros):
            if (offload in ("optimizer", "nvme") and stage == 0) or (offload == "optimizer+param" and stage != 3):
                continue  # not configurations at all (Config refuses them): not listed
            out.append(Candidate(pipe, tensor, data, stage, offload, remat, micro, per_rank // micro,
                                 sequence=sequence, nvme_path=space.nvme_path if offload == "nvme" else ""))
    return out


@dataclasses.dataclass
class PlanResult:
    candidates: list
    winner: Candidate | None
    budget: float
    host_budget: float | None
    rates: Any
    tie: float
    seconds: float
    compiles: int
    global_batch: int
    devices: int
    disk_budget: float | None = None

    def to_dict(self) -> dict:
        def row(c: Candidate):
            out = {k: v for k, v in dataclasses.asdict(c).items() if k not in ("bound", "measured")}
            out["label"] = c.label
            out["bound"] = dataclasses.asdict(c.bound) if c.bound else None
            out["measured"] = dataclasses.asdict(c.measured) if c.measured else None
            out["predicted_s"] = c.seconds(self.rates) if (c.bound or c.measured) else None
            return out
        return dict(budget=self.budget, host_budget=self.host_budget, disk_budget=self.disk_budget,
                    rates=dataclasses.asdict(self.rates),
                    tie=self.tie, seconds=self.seconds, compiles=self.compiles, global_batch=self.global_batch,
                    devices=self.devices, winner=row(self.winner) if self.winner else None,
                    candidates=[row(c) for c in self.candidates])


class Planner:
    """Judges candidates for one model, optimizer and base config on the local (simulated) devices."""

    def __init__(self, gpt, base, train_config, devices: int):
        import jax

        from zeroflax.estimate import spec_from_gpt
        from zeroflax.train import make_optimizer

        if jax.device_count() != devices:
            raise ConfigError("--devices", f"this process has {jax.device_count()} devices, not {devices}",
                              "run `zeroflax plan` in a fresh process (it sets the simulated device count)")
        self.gpt, self.base, self.tc, self.devices = gpt, base, train_config, devices
        self.optimizer = make_optimizer(train_config)
        self.spec = spec_from_gpt(gpt, self.optimizer)
        self.seq = train_config.seq_len

    def setup(self, c: Candidate):
        from zeroflax.estimate import Setup
        mesh = {PIPE_AXIS: c.pipe} if c.pipe > 1 else {}
        mesh.update(data=c.data, tensor=c.tensor)
        if c.sequence > 1:
            mesh[SEQUENCE_AXIS] = c.sequence
        return Setup(mesh, self.devices, self.base.precision, self.base.persistence_threshold, self.base.logical_rules)

    def analyse(self, c: Candidate, global_batch: int) -> None:
        """Fill in the analytic figures, or mark the candidate invalid."""
        from zeroflax.cost import gpt_bound
        from zeroflax.estimate import gpt_peak, host_buffer_bytes, zeroflax_states
        try:
            config = c.config(self.base)  # the Config's own checks
            setup = self.setup(c)
            states = zeroflax_states(self.spec, setup, c.stage, c.offload)
            if c.pipe > 1 and (self.gpt.num_layers % (c.pipe * self.base.pipeline_virtual_stages)):
                raise ConfigError("MeshConfig.axes['pipe']", f"{self.gpt.num_layers} layers do not split into "
                                  f"{c.pipe} stages")
        except ConfigError as error:
            c.status, c.reason = "invalid", _first_line(error)
            return
        batch = c.micro_batch * c.accum * (self.seq + 1) * 4
        c.arguments = states.device_at_rest + batch
        c.host = states.host_at_rest
        c.disk = states.disk_at_rest
        if c.offload == "nvme":
            stream = config.offload_optimizer
            c.host_buffers = host_buffer_bytes(self.spec, setup, stream.buffer_count, stream.buffer_size)
        train = dict(micro_batch=c.micro_batch, accum=c.accum, seq=self.seq, remat=c.remat)
        peak = gpt_peak(self.spec, setup, states, train)
        c.peak_model = None if peak is None else peak - states.host_at_rest
        c.bound = gpt_bound(self.spec, setup, c.stage, c.offload, c.remat, c.micro_batch, c.accum, self.seq,
                            global_batch)

    def compile(self, c: Candidate, global_batch: int) -> None:
        """Compile the candidate's step from abstract inputs; fill in its compiled memory and cost."""
        from zeroflax.cost import measure
        from zeroflax.memory import split_bytes

        started = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # e.g. "remat applies to nothing": the table says what ran
                engine, state, batch = abstract_gpt_engine(self.gpt, c.config(self.base), self.optimizer, self.seq,
                                                           global_batch)
                traced = engine.step_function(batch).trace(state, batch)
                compiled = traced.lower().compile()
        except ConfigError as error:
            c.status, c.reason = "invalid", _first_line(error)
            c.compile_s = time.perf_counter() - started
            return
        stats = compiled.memory_analysis()
        peak = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes - stats.alias_size_in_bytes
        # The states in host memory (their memory kinds): on XLA:CPU memory_analysis counts them with the
        # device's arguments (host memory is device memory there), so they are taken out. Under 'nvme' there
        # are none (params and opt_state are None: no leaves, 0 bytes) and pending_grads is in device memory,
        # so all of it stays in the device's peak.
        host = sum(split_bytes(getattr(state, f), getattr(engine.state_shardings, f))[1]
                   for f in ("params", "opt_state", "pending_grads"))
        c.device_peak = peak - host
        c.measured = measure(engine, compiled, traced.jaxpr.jaxpr)
        c.compile_s = time.perf_counter() - started


def abstract_gpt_engine(gpt, config, optimizer, seq_len: int, global_batch: int | None = None):
    """(engine, state, batch) for the GPT under `config`, the state and batch abstract (nothing is
    allocated): what compile-only tools (plan, explain) compile. The batch has `global_batch` rows,
    default the config's train batch."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from zeroflax.engine import initialize
    from zeroflax.models.gpt import GPT, next_token_loss
    from zeroflax.sharding.mesh import DATA_AXIS

    model = GPT(gpt)
    sample = {"tokens": jax.ShapeDtypeStruct((1, seq_len + 1), jnp.int32)}
    engine, state = initialize(
        next_token_loss(model), lambda rng, b: model.init(rng, b["tokens"][:, :-1])["params"],
        optimizer, config, sample_batch=sample, abstract=True)
    rows = global_batch or engine.train_batch_size
    batch = {"tokens": jax.ShapeDtypeStruct((rows, seq_len + 1), jnp.int32,
                                            sharding=NamedSharding(engine.mesh, P(DATA_AXIS)))}
    return engine, state, batch


def search(planner: Planner, space: Space, budget: float, rates, *, host_budget: float | None = None,
           global_batch: int, tie: float = 0.0, progress: bool = False, max_compiles: int | None = None,
           disk_budget: float | None = None) -> PlanResult:
    """The search of the module docstring."""
    started = time.perf_counter()
    candidates = enumerate_candidates(planner.base, planner.gpt, planner.devices, global_batch, space)
    if not candidates:
        raise ConfigError("--devices", f"no mesh of {planner.devices} devices divides the global batch "
                          f"{global_batch} (and the model's heads and layers)")
    for c in candidates:
        planner.analyse(c, global_batch)
        if c.status == "invalid":
            continue
        if host_budget is not None and c.host * planner.devices + c.host_buffers > host_budget:
            what = "host states" if not c.host_buffers else "host stream buffers"
            c.status, c.reason = "pruned", (f"memory: {what} {format_bytes(c.host * planner.devices + c.host_buffers)}"
                                             f" > --host-memory {format_bytes(host_budget)}")
        elif disk_budget is not None and c.disk * planner.devices > disk_budget:
            c.status, c.reason = "pruned", (f"memory: disk states {format_bytes(c.disk * planner.devices)} > "
                                             f"--disk-memory {format_bytes(disk_budget)}")
        elif c.arguments > budget:
            c.status, c.reason = "pruned", f"memory: arguments {format_bytes(c.arguments)} > budget (peak >= arguments)"
        elif c.peak_model is not None and c.peak_model > budget * (1 + PEAK_MARGIN):
            c.status, c.reason = "pruned", (f"memory: modeled peak {format_bytes(c.peak_model)} > budget x "
                                             f"{1 + PEAK_MARGIN:g}")
    queue = sorted((c for c in candidates if c.status == "pending"),
                   key=lambda c: (c.bound.seconds(rates), c.peak_model or c.arguments))
    best: Candidate | None = None
    compiles = 0
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(queue), desc="zeroflax plan: compiling", unit="candidate", file=sys.stderr)
    for c in queue:
        bound = c.bound.seconds(rates)
        if best is not None and bound >= best.seconds(rates) * (1 - tie):
            c.status, c.reason = "pruned", (f"cost: bound {bound:.3g} s >= best {best.seconds(rates):.3g} s"
                                             + (f" x (1 - {tie:g})" if tie else ""))
            continue
        if max_compiles is not None and compiles >= max_compiles:
            c.status, c.reason = "pruned", f"--max-compiles {max_compiles} reached (not judged)"
            continue
        planner.compile(c, global_batch)
        compiles += 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(c.label)
        if c.status == "invalid":
            continue
        if c.device_peak > budget:
            c.status, c.reason = "over budget", f"compiled peak {format_bytes(c.device_peak)} > {format_bytes(budget)}"
        else:
            c.status = "fits"
            c.reason = f"compiled peak {format_bytes(c.device_peak)}"
            if best is None or c.seconds(rates) < best.seconds(rates):
                best = c
    if bar is not None:
        bar.close()
    return PlanResult(candidates, best, budget, host_budget, rates, tie, time.perf_counter() - started, compiles,
                      global_batch, planner.devices, disk_budget)


def _first_line(error: Exception) -> str:
    """The error's own message (gin appends the configurable it was raised in on further lines)."""
    return str(error).split("\n")[0]


def format_bytes(b: float) -> str:
    """Bytes in GiB, MiB or KiB (the largest that is at least one), else B: as the plan's tables print them."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(b) >= size:
            return f"{b / size:.2f} {unit}"
    return f"{b:.0f} B"


def format_table(result: PlanResult, only: str = "all") -> str:
    rates = result.rates
    order = {"fits": 0, "over budget": 1, "pruned": 2, "invalid": 3, "pending": 4}
    rows = sorted(result.candidates, key=lambda c: (order[c.status], c.seconds(rates) if c.bound else math.inf))
    if only == "compiled":
        rows = [c for c in rows if c.measured is not None]
    header = (f"{'candidate (mesh, stage, offload, remat, micro x accum)':<52} {'bound ms':>9} {'compiled ms':>11} "
              f"{'args':>10} {'peak model':>11} {'compiled':>10}  status")
    lines = [header, "-" * len(header)]
    for c in rows:
        bound = f"{c.bound.seconds(rates) * 1e3:9.4f}" if c.bound else f"{'-':>9}"
        measured = f"{c.measured.seconds(rates) * 1e3:11.4f}" if c.measured else f"{'-':>11}"
        args = f"{format_bytes(c.arguments):>10}" if c.bound else f"{'-':>10}"
        model = f"{format_bytes(c.peak_model):>11}" if c.peak_model is not None else f"{'-':>11}"
        peak = f"{format_bytes(c.device_peak):>10}" if c.device_peak is not None else f"{'-':>10}"
        mark = "* " if c is result.winner else ""
        lines.append(f"{c.label:<52} {bound} {measured} {args} {model} {peak}  {mark}{c.status}: {c.reason}")
    counts = {s: sum(c.status == s for c in result.candidates) for s in order}
    lines.append(f"{len(result.candidates)} candidates: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)
                 + f"; {result.compiles} compiled in {result.seconds:.1f} s")
    if result.winner is None:
        lines.append(f"no candidate fits {format_bytes(result.budget)} per device")
    else:
        w = result.winner
        parts = w.measured.parts(rates)
        disk = f" + disk {parts['disk_s'] * 1e3:.4f}" if w.measured.disk else ""  # 'nvme' only
        disk_bytes = f"{w.measured.disk:,.0f} disk bytes, " if w.measured.disk else ""
        lines.append(f"winner: {w.label}: compiled peak {format_bytes(w.device_peak)} <= {format_bytes(result.budget)}; predicted "
                     f"{w.seconds(rates) * 1e3:.4f} ms/step = comm {parts['comm_s'] * 1e3:.4f} + host "
                     f"{parts['host_s'] * 1e3:.4f}{disk} + compute {parts['compute_s'] * 1e3:.4f} + bubble "
                     f"{parts['bubble_s'] * 1e3:.4f} ms ({w.measured.comm:,.0f} collective bytes, "
                     f"{w.measured.host:,.0f} host bytes, {disk_bytes}{w.measured.flops:,.0f} FLOPs per device, compiled)")
    return "\n".join(lines)


def gin_text(result: PlanResult, base, gin_files, gin_params, command: str) -> str:
    """A gin file that `zeroflax train --gin_file <it>` runs: the input gin files included (absolute
    paths), the input --gin_param bindings, then the winner's Config keys."""
    w = result.winner
    config = w.config(base)
    opt, param = config.offload_optimizer, config.offload_param
    lines = [f"# Written by `{command}`.",
             f"# The cheapest of {len(result.candidates)} candidates by the cost model that fits "
             f"{format_bytes(result.budget)} per device: {w.label},",
             f"# compiled peak {format_bytes(w.device_peak)} per device, predicted {w.seconds(result.rates) * 1e3:.4f} ms/step "
             "(docs/plan.md).", ""]
    lines += [f"include '{os.path.abspath(path)}'" for path in gin_files]
    lines += list(gin_params)
    axes = "{" + ", ".join(f"'{k}': {v}" for k, v in config.mesh.axes.items()) + "}"
    lines += ["", "Config.mesh = @MeshConfig()", f"MeshConfig.axes = {axes}",
              f"Config.zero_stage = {config.zero_stage}", f"Config.remat = '{config.remat}'",
              f"Config.micro_batch_size = {config.micro_batch_size}",
              f"Config.grad_accum_steps = {config.grad_accum_steps}",
              f"Config.train_batch_size = {config.train_batch_size}",
              "Config.offload_optimizer = @OffloadOptimizerConfig()",
              f"OffloadOptimizerConfig.device = '{opt.device}'", f"OffloadOptimizerConfig.pin_memory = {opt.pin_memory}",
              # Always bound: an included gin file's nvme_path would otherwise make a 'cpu' winner invalid.
              f"OffloadOptimizerConfig.nvme_path = {opt.nvme_path!r}"]
    if opt.on_disk:
        lines += [f"OffloadOptimizerConfig.buffer_count = {opt.buffer_count}",
                  f"OffloadOptimizerConfig.buffer_size = {opt.buffer_size}",
                  f"OffloadOptimizerConfig.io_threads = {opt.io_threads}",
                  f"OffloadOptimizerConfig.direct_io = {opt.direct_io}"]
    lines += [f"OffloadOptimizerConfig.update = '{opt.update}'",
              f"OffloadOptimizerConfig.delayed_update = {opt.delayed_update}",
              f"OffloadOptimizerConfig.delayed_update_start = {opt.delayed_update_start}",
              "Config.offload_param = @OffloadParamConfig()",
              f"OffloadParamConfig.device = '{param.device}'", f"OffloadParamConfig.pin_memory = {param.pin_memory}"]
    return "\n".join(lines) + "\n"
