"""GPU benchmark: ZeRO-Offload on one GPU -- the largest GPT that trains with and without `offload_optimizer`,
and what offload costs in step time at ~1.3B params.

What it measures (one GPU, written for one NVIDIA H200 with 141 GB of device memory in a machine with
128 GiB of host memory; needs jax, flax, optax, numpy and zeroflax only, no gin-config and no tensorboardX):

* The model: `zeroflax.models.gpt.GPT` at d 2048, 16 heads, GPT-2 vocabulary padded to 50304, sequence
  1024, tied embeddings (train_mfu.py's 1.3b shape, whose 24 layers are 1.31B params; each layer adds
  12 d^2 + 9 d = 50.35M), trained through `zeroflax.initialize` with
  `Config(zero_stage=2, precision='bf16', remat='full')` and AdamW: fp32 master weights and Adam state,
  bf16 compute. Without offload the step runs as usual; with
  `offload_optimizer=OffloadOptimizerConfig(device='cpu', pin_memory=True, update='host')` the master
  weights and Adam moments live in pinned host memory, the device keeps a bf16 copy of the weights and
  the update runs on the host (compute_on('device_host')). One GPU has a data axis of 1, so the ZeRO
  stage partitions nothing: both runs use the same stage (offload needs stage >= 1), only offload differs.
* Memory per parameter (Psi parameters, at rest plus the gradient buffer):
      no offload, device: 16 B/param = 4 (fp32 params) + 4 (fp32 grads) + 8 (Adam m, v)  + activations
      offload,    device:  6 B/param = 2 (bf16 compute copy) + 4 (fp32 grads)            + activations
                  host:   12 B/param = 4 (fp32 params) + 8 (Adam m, v)   (+ 4 with the delayed update)
  so 141 GB of device memory holds ~8B params (~150 layers) without offload; with offload the device
  would hold several times more, but the host's 12 B/param in --host-gib (default 100 of the 128 GiB)
  caps it near 9B params (~175 layers).
* Phase "ratio": at 1.3B (--ratio-layers 24, --ratio-batch 8), the median step time with no offload, with
  offload (update on the host), with offload plus the delayed parameter update from the first step (DPU,
  DeepSpeed's: one step stale) and with DPU and the 'linear' prediction (the default: 2 B/param more
  host->device and two more optimizer evaluations on the host), and the ratios of each to no offload.
  Each config: initialize, compile,
  2 warm-up steps, then --steps timed steps, each followed by jax.block_until_ready (timing stops early
  after --config-limit-s seconds, with at least 2 timed steps). The memory report's device and host bytes
  at rest are recorded for each.
* Phase "search": for no offload and for offload, the largest number of layers (--search-batch 1) whose
  step compiles and runs. Compiling is cheap next to running, so the search compiles the step on an
  abstract state (jax.eval_shape of zeroflax.initialize: nothing is allocated) and reads its needs:
      device need = XLA's memory_analysis: arguments + temporaries + outputs - aliased (donated) arguments
      host need   = the host-resident state (12 B/param), or XLA's host figures where they are larger
  against the limits: device = 0.97 x the device's bytes_limit, host = --host-gib (capped at 90% of the
  machine's memory and at the pinned-host pool, XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, which this script
  sets to --host-gib + 10 unless set: XLA's default of 64 GiB would cap offload first). Both needs are
  linear in layers, so two probe compiles (--probe-layers) give a line per limit; the search compiles
  where the lines cross their limits and then secant/bisects until it has the largest layer count that
  fits and one more that does not. It then initializes that model for real (the parameters made under
  jit with the plan's shardings: on the device, or straight into pinned host memory with offload, never
  whole in numpy) and runs one step with the compiled executable, which must give a finite loss; on
  failure it backs off (5% fewer layers) up to --max-run-tries times.
* Budget: the ratio phase runs first (it is cheap, and its step and init times per parameter tell the
  search what a run at size will cost). The whole script stops starting work after --budget-s seconds
  (the ratio phase after --ratio-budget-s; each search mode gets an equal share of what is left),
  skipping what its measured compile and step times say would not fit, and says so in its output.
* Output: markdown tables on stdout and a JSON file (--json, default offload.json, rewritten after every
  measurement so a timeout keeps what was measured) with the hardware, jax version, commit, date, the
  limits used and every row (each compile of the search, each run, each timed config).

Usage (on the GPU machine, from the repository root; about 6-8 minutes on one H200):
    python benchmarks/gpu/offload.py --json offload.json
Options: --phases ratio search, --budget-s 450, --ratio-budget-s 200, --steps 5, --ratio-layers 24,
--ratio-batch 8, --ratio-modes (default: all four), --search-batch 1, --probe-layers 32 96, --max-layers 1024,
--host-gib 100, --zero-stage 2, --remat full, --d-model 2048 --heads 16 --vocab 50304 --seq 1024.
Smoke run on a CPU: --quick (d 64, 2-11 layers, seq 32, vocab 256, batch 2, 3 timed steps, fake memory
limits of 8 MiB device and 6 MiB host so that the search iterates; the numbers mean nothing; about a
minute on 2 cores).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import json
import math
import os
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
QUICK = "--quick" in sys.argv[1:]
if QUICK:  # a CPU smoke run: one CPU device, and XLA's cheapest compiles (the step is compiled ~12 times)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
                               " --xla_llvm_disable_expensive_passes=true").strip()


def _host_gib_from_argv(default: float = 100.0) -> float:
    """--host-gib before argparse runs: the pinned-host pool's size must be set before jax starts."""
    argv = sys.argv[1:]
    for i, arg in enumerate(argv):
        try:
            if arg == "--host-gib" and i + 1 < len(argv):
                return float(argv[i + 1])
            if arg.startswith("--host-gib="):
                return float(arg.split("=", 1)[1])
        except ValueError:
            break
    return default


# JAX preallocates 75% of GPU memory by default; the search wants as much of the 141 GB as it can get.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")
# XLA's pinned host memory pool (where offloaded state lives) is capped at 64 GiB unless this is set.
os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(int(math.ceil(_host_gib_from_argv() + 10))))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402


def _load_train_mfu():
    """benchmarks/gpu/train_mfu.py by its path (importing it runs nothing: its main is guarded)."""
    spec = importlib.util.spec_from_file_location("_zeroflax_gpu_train_mfu", os.path.join(HERE, "train_mfu.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_train_mfu = _load_train_mfu()
git_commit, is_oom, memory_limit = _train_mfu.git_commit, _train_mfu.is_oom, _train_mfu.memory_limit

import passlib  # noqa: E402  (benchmarks/gpu: standard library only)
import zeroflax  # noqa: E402
from zeroflax import Config, MeshConfig, OffloadOptimizerConfig, OffloadParamConfig  # noqa: E402
from zeroflax.memory import state_bytes_by_memory  # noqa: E402
from zeroflax.models.gpt import GPT, GPTConfig, next_token_loss  # noqa: E402

GiB = 2**30
MiB = 2**20
UNIT = ["GiB", GiB]  # the tables' byte unit (--quick: MiB)
MODES = {
    "no offload": None,
    "offload": OffloadOptimizerConfig(device="cpu", pin_memory=True, update="host", delayed_update=False),
    # DPU from the first step (its default start, 50, is past the timed steps); DeepSpeed's rule, and ours
    "offload + DPU": OffloadOptimizerConfig(device="cpu", pin_memory=True, update="host", delayed_update=True,
                                            delayed_update_start=0, delayed_update_prediction="none"),
    "offload + DPU linear": OffloadOptimizerConfig(device="cpu", pin_memory=True, update="host", delayed_update=True,
                                                   delayed_update_start=0, delayed_update_prediction="linear"),
}
ENV_SHOWN = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "XLA_FLAGS", "JAX_PLATFORMS")
RATIO_MODES = ("no offload", "offload", "offload + DPU", "offload + DPU linear")
SEARCH_MODES = ("no offload", "offload")
# --quick: a tiny model, and fake memory limits under which the search lands on a handful of layers.
QUICK_SETTINGS = dict(d_model=64, heads=2, vocab=256, seq=32, ratio_layers=4, ratio_batch=2, search_batch=2,
                      probe_layers=[2, 4], max_layers=32, steps=3, fake_device_mib=8.0, fake_host_mib=6.0)


class Clock:
    def __init__(self, budget_s: float):
        self.start, self.budget_s = time.perf_counter(), budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def gpt_config(layers: int, args) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, num_layers=layers, d_model=args.d_model, num_heads=args.heads,
                     max_len=args.seq)


def build(layers: int, mode: str, batch: int, args, device, abstract: bool):
    """(engine, state, host batch). abstract: the state as ShapeDtypeStructs with the engine's shardings
    (jax.eval_shape of zeroflax.initialize: nothing is allocated or run), for compile-only probes."""
    model = GPT(gpt_config(layers, args))
    offload = MODES[mode]
    changes = {}
    if offload is not None:  # offload_param 'cpu' would need stage 3: only the optimizer is offloaded here
        changes = dict(offload_optimizer=offload, offload_param=OffloadParamConfig(device="none"))
    config = Config(zero_stage=args.zero_stage, precision="bf16", micro_batch_size=batch, remat=args.remat,
                    mesh=MeshConfig({"data": -1, "tensor": 1}), **changes)
    tokens = np.random.default_rng(0).integers(0, args.vocab, (batch, args.seq + 1), dtype=np.int32)
    init = lambda rng, b: model.init(rng, b["tokens"][:, :-1])["params"]
    make = lambda: zeroflax.initialize(next_token_loss(model), init, optax.adamw(3e-4, weight_decay=0.1), config,
                                       sample_batch={"tokens": tokens}, devices=[device])
    if not abstract:
        engine, state = make()
        return engine, state, {"tokens": tokens}
    made = {}

    def state_only():
        made["engine"], state = make()
        return state

    shapes = jax.eval_shape(state_only)
    engine = made["engine"]
    # The shardings (with their memory kinds) must come along: without them Engine.compile traces the
    # offloaded state as device arrays and the host update fails to lower.
    state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                         engine.state_shardings)
    return engine, state, {"tokens": tokens}


def needs(report) -> tuple[int, int, str | None]:
    """(device bytes, host bytes, note) the compiled step needs, from zeroflax's memory report."""
    host_state = report.host_at_rest + report.pending_grads
    xla_host = report.xla_host or {}
    device = report.peak_estimate
    note = None
    if host_state and report.argument >= report.device_at_rest + 0.9 * host_state:
        # XLA counted the host-resident arguments with the device's (the CPU backend, whose host memory is
        # its device memory, always does; it reports no host figures).
        device -= host_state
        note = "XLA counted the host-resident state among the device's arguments: taken out of the device need"
    host = max(host_state, int(xla_host.get("argument", 0)) + int(xla_host.get("temp", 0)))
    return int(device), int(host), note


def report_fields(report) -> dict:
    return dict(device_at_rest=int(report.device_at_rest), host_at_rest=int(report.host_at_rest),
                pending_grads=int(report.pending_grads), peak_estimate=int(report.peak_estimate),
                temp=int(report.temp), xla_host={k: int(v) for k, v in (report.xla_host or {}).items()})


def error_text(error: BaseException) -> str:
    text = str(error).splitlines()[0][:300] if str(error) else ""
    return f"{type(error).__name__}: {text}"


def cleanup():
    gc.collect()
    jax.clear_caches()


class Recorder:
    """Rows, printed as they come and written to the JSON after each one."""

    def __init__(self, path: str, meta: dict):
        self.path, self.meta, self.rows, self.summary = path, meta, [], {}

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        self.write()
        return row

    def write(self):
        with open(self.path, "w") as f:
            json.dump(dict(meta=self.meta, summary=self.summary, rows=self.rows), f, indent=1)


# ----------------------------------------------------------------------------------------- ratio
def time_config(mode: str, args, device, limits, rec: Recorder) -> dict:
    layers, batch = args.ratio_layers, args.ratio_batch
    cfg = gpt_config(layers, args)
    row = dict(phase="ratio", mode=mode, layers=layers, params=cfg.num_params(), d_model=args.d_model,
               batch=batch, seq=args.seq, zero_stage=args.zero_stage, remat=args.remat)
    t0 = time.perf_counter()
    engine, state, host_batch = build(layers, mode, batch, args, device, abstract=False)
    jax.block_until_ready(state)
    row["init_s"] = time.perf_counter() - t0
    data = engine.put_batch(host_batch)
    t0 = time.perf_counter()
    step = engine.compile(state, data)
    row["compile_s"] = time.perf_counter() - t0
    report = zeroflax.memory_report(engine, state, data)
    device_need, host_need, note = needs(report)
    row.update(report_fields(report), device_need=device_need, host_need=host_need)
    if note:
        row["notes"] = note
    if device_need > limits["device"] or host_need > limits["host"]:
        raise MemoryError(f"needs {device_need / GiB:.2f} GiB device (limit {limits['device'] / GiB:.2f}), "
                          f"{host_need / GiB:.2f} GiB host (limit {limits['host'] / GiB:.2f})")
    losses, warm = [], []
    for _ in range(args.warmup):
        t = time.perf_counter()
        state, metrics = step(state, data)
        jax.block_until_ready((state, metrics))
        warm.append(time.perf_counter() - t)
        losses.append(float(metrics["loss"]))
    times = []
    start = time.perf_counter()
    while len(times) < args.steps and (len(times) < 2 or time.perf_counter() - start < args.config_limit_s):
        t = time.perf_counter()
        state, metrics = step(state, data)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t)
    losses.append(float(metrics["loss"]))
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    row.update(warmup_s=warm, step_s=times, steps_timed=len(times), median_step_s=statistics.median(times),
               min_step_s=min(times), loss_first=losses[0], loss_last=losses[-1],
               process_peak_bytes_in_use=(stats or {}).get("peak_bytes_in_use"),
               total_s=row["init_s"] + row["compile_s"] + sum(warm) + sum(times))
    if not all(np.isfinite(losses)):
        row["error"] = f"loss not finite: {losses}"
    del state, data, step, engine
    return row


def ratio_phase(args, device, limits, clock: Clock, rec: Recorder) -> list[dict]:
    rows, phase_start, last_cost = [], clock.elapsed(), None
    for mode in args.ratio_modes:
        spent = clock.elapsed() - phase_start
        estimate = last_cost or 0.0
        if spent + estimate > args.ratio_budget_s or clock.elapsed() + estimate > clock.budget_s:
            rows.append(rec.add(dict(phase="ratio", mode=mode, layers=args.ratio_layers, skipped=True,
                                     error=f"skipped: {spent:.0f} s spent in this phase ({clock.elapsed():.0f} s in "
                                           f"all), the last config took {estimate:.0f} s; budgets "
                                           f"{args.ratio_budget_s:.0f} s / {args.budget_s:.0f} s")))
            continue
        t = time.perf_counter()
        try:
            row = time_config(mode, args, device, limits, rec)
        except Exception as e:  # noqa: BLE001 - one config failing must not lose the others
            traceback.print_exc()
            row = dict(phase="ratio", mode=mode, layers=args.ratio_layers, batch=args.ratio_batch,
                       error=error_text(e), oom=is_oom(e))
        finally:
            cleanup()
        last_cost = time.perf_counter() - t
        rows.append(rec.add(row))
    base = next((r for r in rows if r["mode"] == "no offload" and "median_step_s" in r), None)
    ratios = {}
    for r in rows:
        if base is not None and "median_step_s" in r and r is not base:
            r["ratio_to_no_offload"] = r["median_step_s"] / base["median_step_s"]
            ratios[f"{r['mode']} / no offload"] = r["ratio_to_no_offload"]
    rec.summary["ratio"] = dict(layers=args.ratio_layers, batch=args.ratio_batch,
                                params=gpt_config(args.ratio_layers, args).num_params(),
                                median_step_s={r["mode"]: r.get("median_step_s") for r in rows}, ratios=ratios)
    rec.write()
    return rows


# ---------------------------------------------------------------------------------------- search
def predict(points: dict, key: str, limit: float) -> int | None:
    """The most layers whose `key` need stays within `limit`, on the line through the two measured points
    nearest the limit (the needs are linear in layers: stacked, scanned layers)."""
    usable = [(layers, p[key]) for layers, p in points.items() if p.get(key) is not None]
    if len(usable) < 2:
        return None
    (x1, y1), (x2, y2) = sorted(sorted(usable, key=lambda lp: abs(lp[1] - limit))[:2])
    if x1 == x2 or y2 <= y1:
        return None
    slope = (y2 - y1) / (x2 - x1)
    return int(math.floor(x1 + (limit - y1) / slope))


def search_mode(mode: str, args, device, limits, clock: Clock, rec: Recorder, deadline: float,
                step_estimate: dict) -> dict:
    """Largest layer count whose compiled step fits the limits, then confirmed by running one step."""
    points, compiled, compile_times = {}, {}, []
    good = bad = None
    result = dict(phase="search-result", mode=mode, batch=args.search_batch, notes=[])

    def out_of_time(what: str, cost: float) -> bool:
        if clock.elapsed() + cost > deadline:
            result["notes"].append(f"{what} skipped: {clock.elapsed():.0f} s spent, it would take ~{cost:.0f} s, "
                                   f"this mode's share of the budget ends at {deadline:.0f} s")
            print(result["notes"][-1], flush=True)
            return True
        return False

    def probe(layers: int) -> bool:
        nonlocal good, bad
        row = dict(phase="search-compile", mode=mode, layers=layers, params=gpt_config(layers, args).num_params(),
                   batch=args.search_batch)
        t = time.perf_counter()
        try:
            engine, state, host_batch = build(layers, mode, args.search_batch, args, device, abstract=True)
            step = engine.compile(state, host_batch)
            report = zeroflax.memory_report(engine, state, host_batch)
            device_need, host_need, note = needs(report)
            fits = device_need <= limits["device"] and host_need <= limits["host"]
            row.update(report_fields(report), device_need=device_need, host_need=host_need, fits=fits,
                       limited_by=[k for k, v in (("device", device_need), ("host", host_need)) if v > limits[k]])
            if note:
                row["notes"] = note
            points[layers] = dict(device=device_need, host=host_need if MODES[mode] is not None else None)
            if fits:
                compiled[layers] = step
        except Exception as e:  # noqa: BLE001 - a compile that fails (e.g. too big to compile) does not fit
            traceback.print_exc()
            fits = False
            row.update(fits=False, error=error_text(e))
        finally:
            cleanup()
        row["compile_s"] = time.perf_counter() - t
        compile_times.append(row["compile_s"])
        rec.add(row)
        if fits and (good is None or layers > good):
            good = layers
        if not fits and (bad is None or layers < bad):
            bad = layers
        return fits

    def run_cost(layers) -> float:  # one real step (and the initialization) at `layers`, from the 1.3B runs
        return step_estimate.get(mode, 0.0) * gpt_config(max(layers or 1, 1), args).num_params()

    compiles = 0
    for layers in sorted(set(min(p, args.max_layers) for p in args.probe_layers)):
        if good is not None and bad is not None and layers > bad:
            break
        if compiles and out_of_time(f"probe compile at {layers} layers", max(compile_times) + run_cost(layers)):
            break
        probe(layers)
        compiles += 1
    while compiles < args.max_compiles:
        if bad is not None and (good or 0) + 1 >= bad:
            break
        if good is not None and good >= args.max_layers:
            result["notes"].append(f"capped at --max-layers {args.max_layers}")
            break
        candidates = [predict(points, "device", limits["device"])]
        if MODES[mode] is not None:
            candidates.append(predict(points, "host", limits["host"]))
        candidates = [c for c in candidates if c is not None]
        low, high = (good or 0) + 1, (bad - 1) if bad is not None else args.max_layers
        if candidates:
            layers = min(max(min(candidates), low), high)
        else:  # no line yet (one point, or a compile failed): double up or bisect
            layers = (low + high) // 2 if bad is not None else min(2 * (good or 1), high)
        if layers in points:  # the line predicts a point already measured: bisect the gap instead
            layers = (low + high) // 2
        # Keep time for the confirming run: a verified largest size that also ran beats an exact bound.
        if out_of_time(f"compile at {layers} layers (the search's next)",
                       (max(compile_times) if compile_times else 0.0) + run_cost(min(layers, good or layers))):
            break
        probe(layers)
        compiles += 1
    result.update(largest_compiled=good, smallest_not_fitting=bad, compiles=compiles,
                  exact=bad is not None and good is not None and bad == good + 1)
    if good is not None and not result["exact"] and good < args.max_layers:
        result["notes"].append(f"not exact: {good} fits, " + (f"{bad} was the smallest measured that does not"
                                                              if bad else "nothing larger was measured"))
    if good is not None:
        cfg = gpt_config(good, args)
        result["largest_compiled_params"] = cfg.num_params()
        p = points[good]
        result.update(device_need=p["device"], host_need=p["host"])
        if bad is not None and bad in points:
            q = points[bad]
            result["limited_by"] = [k for k in ("device", "host") if q.get(k) is not None and q[k] > limits[k]]
    rec.add(dict(result, phase="search-compiles-done"))

    # Confirm by running one step; back off on failure.
    layers, tries = good, 0
    while layers is not None and layers >= 1 and tries < args.max_run_tries:
        params = gpt_config(layers, args).num_params()
        cost = run_cost(layers) + (0.0 if layers in compiled else (max(compile_times) if compile_times else 0.0))
        if out_of_time(f"running one step at {layers} layers ({params / 1e9:.2f}B params)", cost):
            break
        tries += 1
        row = run_once(layers, mode, args, device, compiled.pop(layers, None))
        rec.add(row)
        if "error" not in row:
            result.update(largest_ran=layers, largest_ran_params=params, ran_step_s=row["step_s"],
                          ran_loss=row["loss"], ran_device_at_rest=row.get("device_at_rest"),
                          ran_host_at_rest=row.get("host_at_rest"))
            break
        result["notes"].append(f"{layers} layers failed to run: {row['error'][:160]}")
        if row.get("oom") is False:  # not a memory failure: fewer layers would not help
            break
        layers = min(layers - 1, int(layers * 0.95))
    compiled.clear()
    result["notes"] = "; ".join(result["notes"])
    return rec.add(result)


def run_once(layers: int, mode: str, args, device, step=None) -> dict:
    """Initialize the model for real and run one step (with the search's executable when given)."""
    cfg = gpt_config(layers, args)
    row = dict(phase="search-run", mode=mode, layers=layers, params=cfg.num_params(), batch=args.search_batch)
    t0 = time.perf_counter()
    try:
        engine, state, host_batch = build(layers, mode, args.search_batch, args, device, abstract=False)
        jax.block_until_ready(state)
        row["init_s"] = time.perf_counter() - t0
        data = engine.put_batch(host_batch)
        # At rest, from the live arrays' memory kinds (zeroflax.memory_report would compile the step again).
        by_kind = state_bytes_by_memory(state)
        on_host = lambda fields, host: sum(b for f in fields for kind, b in by_kind[f].items()
                                           if kind.endswith("host") == host)
        row.update(device_at_rest=on_host(("params", "opt_state", "compute_params"), False),
                   host_at_rest=on_host(("params", "opt_state", "pending_grads"), True))
        if step is None:
            step = engine.compile(state, data)
        t = time.perf_counter()
        state, metrics = step(state, data)
        jax.block_until_ready((state, metrics))
        row["step_s"] = time.perf_counter() - t
        row["loss"] = float(metrics["loss"])
        if not np.isfinite(row["loss"]):
            row.update(error=f"loss is {row['loss']}", oom=False)
        stats = device.memory_stats() if hasattr(device, "memory_stats") else None
        row["process_peak_bytes_in_use"] = (stats or {}).get("peak_bytes_in_use")
        del state, data, engine, metrics
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        row.update(error=error_text(e), oom=is_oom(e))
    finally:
        step = None
        cleanup()
    row["total_s"] = time.perf_counter() - t0
    return row


def search_phase(args, device, limits, clock: Clock, rec: Recorder, ratio_rows: list[dict]) -> list[dict]:
    # Seconds per parameter of one step (and init), from the 1.3B runs, to judge whether a run fits the budget.
    step_estimate = {}
    for r in ratio_rows:
        if "median_step_s" in r and r["mode"] in SEARCH_MODES:
            per_step = (r["median_step_s"] * args.search_batch / r["batch"] if r["mode"] == "no offload"
                        else r["median_step_s"])  # offload: the host update dominates, whatever the batch
            step_estimate[r["mode"]] = (per_step + r["init_s"]) / r["params"]
    results = []
    for i, mode in enumerate(SEARCH_MODES):
        left = clock.budget_s - clock.elapsed()
        deadline = clock.elapsed() + left / (len(SEARCH_MODES) - i)  # an equal share of what is left
        if left <= 0:
            note = f"skipped: {clock.elapsed():.0f} s spent, budget {clock.budget_s:.0f} s"
            results.append(rec.add(dict(phase="search-result", mode=mode, skipped=True, notes=note)))
            continue
        results.append(search_mode(mode, args, device, limits, clock, rec, deadline, step_estimate))
    rec.summary["search"] = {r["mode"]: {k: r.get(k) for k in ("largest_compiled", "largest_compiled_params",
                                                                "smallest_not_fitting", "limited_by", "largest_ran",
                                                                "largest_ran_params", "ran_step_s", "notes")}
                             for r in results}
    rec.write()
    return results


# ---------------------------------------------------------------------------------------- output
def gib(x) -> str:
    return "" if x is None else f"{x / GiB:.2f}"


def size(x) -> str:
    """Bytes in the tables' unit."""
    return "" if x is None else f"{x / UNIT[1]:.2f}"


def count(params) -> str:
    return f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.3f}M"


def ratio_table(rows) -> str:
    u = UNIT[0]
    lines = [f"| config | params | batch x seq | median step (ms) | min (ms) | vs no offload | device at rest ({u}) | "
             f"host at rest ({u}) | XLA peak, device ({u}) | loss first -> last |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "median_step_s" not in r:
            lines.append(f"| {r['mode']} | | | {r.get('error', '')[:90]} | | | | | | |")
            continue
        ratio = f"{r['ratio_to_no_offload']:.2f}x" if "ratio_to_no_offload" in r else ""
        lines.append(f"| {r['mode']} | {count(r['params'])} | {r['batch']} x {r['seq']} | "
                     f"{r['median_step_s'] * 1e3:.1f} | {r['min_step_s'] * 1e3:.1f} | {ratio} | "
                     f"{size(r['device_at_rest'])} | {size(r['host_at_rest'] + r.get('pending_grads', 0))} | "
                     f"{size(r['device_need'])} | {r['loss_first']:.3f} -> {r['loss_last']:.3f} |")
    return "\n".join(lines)


def search_table(results) -> str:
    u = UNIT[0]
    lines = ["| config | largest that compiles within the limits | next, does not fit | limited by | "
             f"device need ({u}) | host need ({u}) | largest that ran (1 step) | step (s) | notes |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        compiled = (f"{r['largest_compiled']} layers ({count(r['largest_compiled_params'])})"
                    if r.get("largest_compiled") else "none")
        ran = f"{r['largest_ran']} layers ({count(r['largest_ran_params'])})" if r.get("largest_ran") else "not run"
        step = f"{r['ran_step_s']:.2f}" if r.get("ran_step_s") is not None else ""
        lines.append(f"| {r['mode']} | {compiled} | {r.get('smallest_not_fitting') or ''} | "
                     f"{', '.join(r.get('limited_by') or [])} | {size(r.get('device_need'))} | "
                     f"{size(r.get('host_need'))} | "
                     f"{ran} | {step} | {str(r.get('notes', ''))[:160]} |")
    return "\n".join(lines)


def compile_table(rows) -> str:
    u = UNIT[0]
    lines = [f"| config | layers | params | device need ({u}) | host need ({u}) | fits | compile (s) |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("phase") != "search-compile":
            continue
        lines.append(f"| {r['mode']} | {r['layers']} | {count(r['params'])} | {size(r.get('device_need'))} | "
                     f"{size(r.get('host_need')) if r['mode'] != 'no offload' else ''} | "
                     f"{'yes' if r.get('fits') else 'no' + (' (' + r['error'][:60] + ')' if 'error' in r else '')} | "
                     f"{r['compile_s']:.1f} |")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phases", nargs="+", default=["ratio", "search"], choices=["ratio", "search"])
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=50304, help="50304: GPT-2's 50257 padded to a multiple of 64")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--zero-stage", type=int, default=2, choices=[1, 2],
                    help="the same for every config (offload needs >= 1; one GPU partitions nothing)")
    ap.add_argument("--remat", default="full", choices=["none", "full", "dots", "dots_no_batch"])
    ap.add_argument("--ratio-layers", type=int, default=24, help="24 layers at d 2048: 1.31B params")
    ap.add_argument("--ratio-batch", type=int, default=8, help="sequences per step in the ratio phase")
    ap.add_argument("--ratio-modes", nargs="+", default=list(RATIO_MODES), choices=list(RATIO_MODES),
                    help="the configurations the ratio phase times, in this order ('no offload' first: the "
                         "ratios are to it)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5, help="timed steps per config (after compile + warm-up)")
    ap.add_argument("--config-limit-s", type=float, default=60.0,
                    help="stop timing a config after this many seconds (at least 2 timed steps)")
    ap.add_argument("--search-batch", type=int, default=1, help="sequences per step in the size search")
    ap.add_argument("--probe-layers", type=int, nargs="+", default=[32, 96],
                    help="the first compiles of the search (two or more: the lines are fitted through them)")
    ap.add_argument("--max-layers", type=int, default=1024)
    ap.add_argument("--max-compiles", type=int, default=7, help="compiles per search mode")
    ap.add_argument("--max-run-tries", type=int, default=3, help="runs per search mode (backing off on failure)")
    ap.add_argument("--host-gib", type=float, default=100.0,
                    help="host memory the offloaded state may take (the machine has 128 GiB)")
    ap.add_argument("--device-fraction", type=float, default=0.97, help="of the device's bytes_limit")
    ap.add_argument("--budget-s", type=float, default=450.0, help="start no work after this many seconds")
    ap.add_argument("--ratio-budget-s", type=float, default=200.0, help="of which the ratio phase may use")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: a tiny model and fake memory limits")
    ap.add_argument("--fake-device-mib", type=float, default=None, help="--quick's device limit (default 8)")
    ap.add_argument("--fake-host-mib", type=float, default=None, help="--quick's host limit (default 6)")
    ap.add_argument("--json", default="offload.json")
    args = ap.parse_args(argv)
    if args.quick:
        for key, value in QUICK_SETTINGS.items():
            if getattr(args, key, None) is None or ap.get_default(key) == getattr(args, key):
                setattr(args, key, value)
    return args


def main(argv=None):
    args = parse_args(argv)
    device = jax.devices()[0]
    memory = passlib.host_memory()
    pool = float(os.environ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"]) * GiB
    if args.quick:
        UNIT[:] = ["MiB", MiB]
        limits = dict(device=int(args.fake_device_mib * MiB), host=int(args.fake_host_mib * MiB))
        limit_note = (f"--quick: fake memory limits (device {args.fake_device_mib:g} MiB, host "
                      f"{args.fake_host_mib:g} MiB) so that the search iterates; on {device.platform} the sizes "
                      "and times found mean nothing")
    else:
        device_limit = memory_limit(device)
        machine = min([v for k, v in memory.items() if k in ("MemTotal", "cgroup_limit")] or [args.host_gib * GiB])
        host_limit = min(args.host_gib * GiB, 0.9 * machine, pool - 4 * GiB)
        limits = dict(device=int(args.device_fraction * device_limit) if device_limit else 2**62, host=int(host_limit))
        limit_note = (f"device limit {args.device_fraction:g} x bytes_limit {gib(device_limit) or '(none)'} GiB; "
                      f"host limit "
                      f"min(--host-gib {args.host_gib:g}, 0.9 x machine {gib(machine)}, pinned pool "
                      f"{gib(pool)} - 4) GiB")
        if not device_limit:
            limit_note += "; the device reports no bytes_limit: device memory is not checked"
    meta = dict(benchmark="offload", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                commit=git_commit(), device=device.device_kind, platform=device.platform, jax=jax.__version__,
                device_count=jax.device_count(), quick=args.quick, limits=limits, limit_note=limit_note,
                host_memory=memory, pinned_host_pool_bytes=int(pool),
                env={k: os.environ.get(k) for k in ENV_SHOWN},
                model=dict(d_model=args.d_model, heads=args.heads, vocab=args.vocab, seq=args.seq, remat=args.remat,
                           zero_stage=args.zero_stage, precision="bf16", optimizer="adamw(3e-4, weight_decay=0.1)"),
                formulas=dict(no_offload_device="16 B/param (fp32 params 4 + fp32 grads 4 + Adam 8) + activations",
                              offload_device="6 B/param (bf16 compute copy 2 + fp32 grads 4) + activations",
                              offload_host="12 B/param (fp32 params 4 + Adam 8), +4 with the delayed update",
                              device_need="memory_analysis: argument + temp + output - alias (host state excluded)",
                              host_need="max(host-resident state, XLA's host argument + temp)"),
                args=vars(args), command=" ".join([os.path.basename(sys.executable)] + (
                    sys.argv if argv is None else ["benchmarks/gpu/offload.py", *argv])))
    print(json.dumps(meta, indent=1))
    print(limit_note, flush=True)
    if device.platform != "gpu" and not args.quick:
        print(f"warning: running on {device.platform}, not a GPU; try --quick", file=sys.stderr)

    rec = Recorder(args.json, meta)
    clock = Clock(args.budget_s)
    ratio_rows, search_results = [], []
    if "ratio" in args.phases:
        ratio_rows = ratio_phase(args, device, limits, clock, rec)
    if "search" in args.phases:
        search_results = search_phase(args, device, limits, clock, rec, ratio_rows)
    meta["total_s"] = clock.elapsed()
    meta["gin_or_tensorboardx_imported"] = sorted(m for m in sys.modules if m.split(".")[0] in ("gin", "tensorboardX"))
    rec.write()

    print()
    if args.quick:
        print(f"NOTE: {limit_note}\n")
    if ratio_rows:
        print(f"Step time at {args.ratio_layers} layers, d {args.d_model} "
              f"({count(gpt_config(args.ratio_layers, args).num_params())} params), batch {args.ratio_batch} x "
              f"{args.seq}, ZeRO stage {args.zero_stage}, remat {args.remat}, bf16 (median of timed steps):\n")
        print(ratio_table(ratio_rows))
        for name, value in rec.summary.get("ratio", {}).get("ratios", {}).items():
            print(f"  step-time ratio {name}: {value:.2f}")
        print()
    if search_results:
        print(f"Largest GPT at d {args.d_model} (by layers), batch {args.search_batch} x {args.seq}, one device "
              f"({limit_note}):\n")
        print(search_table(search_results))
        print("\nEvery compile of the search:\n")
        print(compile_table(rec.rows))
    print(f"\nwrote {args.json} ({meta['total_s']:.0f} s)")
    ok = all("median_step_s" in r for r in ratio_rows) and all(r.get("largest_ran") for r in search_results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
