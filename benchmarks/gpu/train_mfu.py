"""GPU benchmark: training throughput (tokens/s) and MFU of the zeroflax GPT at ~125M, ~350M and ~1.3B params.

What it measures (one GPU, written for one NVIDIA H200; needs jax, flax, optax, numpy and zeroflax only,
no gin-config and no tensorboardX):

* Full training steps (forward, backward, AdamW update) of `zeroflax.models.gpt.GPT` through
  `zeroflax.initialize` with `Config(zero_stage=0, precision='bf16', remat=--remat)` on one device:
  fp32 master weights and Adam state, bf16 compute, fp32 logits and loss.
* Sizes (GPT-2/3 shapes, tied embeddings, GPT-2 vocabulary padded to 50304, sequence 1024):
    125m: 12 layers, d 768, 12 heads      (124.5M params; default batch 32)
    350m: 24 layers, d 1024, 16 heads     (354.9M params; default batch 16)
    1.3b: 24 layers, d 2048, 16 heads     (1.31B params; default batch 8)
  Before timing, the compiled step's memory_analysis is checked against the device's memory limit,
  and the batch is halved until it fits (also after an out-of-memory error at run time).
* Timing: compile, 2 warm-up steps, then --steps steps, each followed by jax.block_until_ready;
  median step time (stopping early at --size-limit-s seconds of timing per size; sizes that would
  start after --budget-s seconds are skipped).
* Model FLOPs per token (fwd + bwd, the PaLM appendix-B convention):
      6 * Psi + 12 * L * seq * d
  Psi = all parameters except the position table (a lookup, not a matmul); the tied token embedding
  counts once, as the output-logits matmul. 12 * L * seq * d is QK^T and PV over the full seq x seq
  score matrix (what the dense causal attention computes). Recomputation under remat is not counted
  (MFU, not hardware FLOPs utilisation).
  TFLOP/s = FLOPs per token * tokens/s; MFU = TFLOP/s / --peak-tflops (989: H200 SXM dense bf16).
* Output: a markdown table on stdout and a JSON file (--json, default train_mfu.json) with the
  hardware, jax version, commit, formula and every row (step times, memory, loss first/last).

Usage (on the GPU machine, from the repository root; about 3-5 minutes on one H200):
    python benchmarks/gpu/train_mfu.py --json train_mfu.json
Options: --sizes 125m 350m 1.3b, --remat none|full|dots|dots_no_batch, --attention dense|cudnn|xla,
--batch N (all sizes), --steps N, --peak-tflops F, --budget-s S with --skip-by-estimate (a size starts only if
the last size's wall time still fits). Smoke run on a CPU: --quick (a 2-layer model). The GPU pass
(benchmarks/gpu/pass.sh, part e) calls main() with --sizes 1.3b 350m 125m --attention cudnn --skip-by-estimate.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
# JAX preallocates 75% of GPU memory by default; the large sizes want more of the 141 GB.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.92")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

try:
    import zeroflax  # noqa: E402
    from zeroflax.models import gpt  # noqa: E402
except ModuleNotFoundError as e:  # pragma: no cover - depends on the image
    if e.name in ("gin", "tensorboardX"):
        sys.exit(f"importing zeroflax needs {e.name!r}, which this image lacks: the Python API must not import "
                 f"it unconditionally (make it optional where it is imported)")
    raise

SIZES = {
    "125m": dict(num_layers=12, d_model=768, num_heads=12, batch=32),
    "350m": dict(num_layers=24, d_model=1024, num_heads=16, batch=16),
    "1.3b": dict(num_layers=24, d_model=2048, num_heads=16, batch=8),
}
QUICK = {"tiny": dict(num_layers=2, d_model=64, num_heads=2, batch=4)}


def flops_per_token(cfg: "gpt.GPTConfig", seq: int) -> tuple[float, int]:
    """(model FLOPs per token for fwd + bwd, Psi used for the 6 * Psi term)."""
    psi = cfg.num_params() - cfg.max_len * cfg.d_model
    return 6.0 * psi + 12.0 * cfg.num_layers * seq * cfg.d_model, psi


# --attention: this script's names for GPTConfig.attention.
ATTENTION = {"dense": "dense", "xla": "dot_product", "cudnn": "cudnn"}


def is_oom(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, MemoryError) or "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


class DoesNotFit(MemoryError):
    """The compiled step needs more memory than the device has: retry with a smaller batch."""


def memory_limit(device) -> int | None:
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    return (stats or {}).get("bytes_limit")


def measure(name, spec, batch, args, device):
    cfg = gpt.GPTConfig(vocab_size=args.vocab, num_layers=spec["num_layers"], d_model=spec["d_model"],
                        num_heads=spec["num_heads"], max_len=args.seq, attention=ATTENTION[args.attention])
    fpt, psi = flops_per_token(cfg, args.seq)
    row = dict(size=name, params=cfg.num_params(), psi=psi, layers=cfg.num_layers, d_model=cfg.d_model,
               heads=cfg.num_heads, vocab=cfg.vocab_size, seq=args.seq, batch=batch, tokens_per_step=batch * args.seq,
               remat=args.remat, attention=args.attention, zero_stage=args.zero_stage, flops_per_token=fpt)
    config = zeroflax.Config(zero_stage=args.zero_stage, precision="bf16", micro_batch_size=batch,
                             remat=args.remat, mesh=zeroflax.MeshConfig({"data": -1, "tensor": 1}))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, args.seq + 1), dtype=np.int32)
    model = gpt.GPT(cfg)
    init = lambda rng, b: model.init(rng, b["tokens"][:, :-1])["params"]
    t0 = time.perf_counter()
    engine, state = zeroflax.initialize(gpt.next_token_loss(model), init, optax.adamw(3e-4, weight_decay=0.1),
                                        config, sample_batch={"tokens": tokens}, devices=[device])
    data = jax.device_put({"tokens": tokens}, engine.plan.batch({"tokens": tokens}))
    step = engine.compile(state, data)
    row["compile_s"] = time.perf_counter() - t0
    ma = step.memory_analysis()
    if ma is not None:
        need = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes + ma.temp_size_in_bytes
        row.update(compiled_bytes=int(need), temp_bytes=int(ma.temp_size_in_bytes))
        limit = memory_limit(device)
        if limit and need > 0.97 * limit:
            raise DoesNotFit(f"batch {batch} needs {need / 2**30:.2f} GiB of {limit / 2**30:.2f} GiB")
    losses = []
    for _ in range(2):  # warm-up
        state, metrics = step(state, data)
        losses.append(float(metrics["loss"]))
    times = []
    start = time.perf_counter()
    while len(times) < args.steps and (len(times) < 3 or time.perf_counter() - start < args.size_limit_s):
        t = time.perf_counter()
        state, metrics = step(state, data)
        jax.block_until_ready((state, metrics))
        times.append(time.perf_counter() - t)
    losses.append(float(metrics["loss"]))
    median = statistics.median(times)
    tokens_per_s = batch * args.seq / median
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    row.update(steps_timed=len(times), median_step_s=median, mean_step_s=statistics.fmean(times),
               min_step_s=min(times), tokens_per_s=tokens_per_s, tflops=fpt * tokens_per_s / 1e12,
               mfu=fpt * tokens_per_s / (args.peak_tflops * 1e12), loss_first=losses[0], loss_last=losses[-1],
               peak_bytes_in_use=(stats or {}).get("peak_bytes_in_use"))
    if not np.isfinite(losses[-1]):
        row["error"] = f"loss is {losses[-1]}"
    del state, data, step, engine
    return row


def run_size(name, spec, args, device):
    batch = args.batch or spec["batch"]
    notes = []
    while True:
        try:
            row = measure(name, spec, batch, args, device)
            if notes:
                row["notes"] = "; ".join(notes)
            return row
        except Exception as e:  # noqa: BLE001 - one size failing must not lose the others
            traceback.print_exc()
            if is_oom(e) and batch > 1:
                notes.append(f"batch {batch} does not fit ({str(e).splitlines()[0][:120]}), halved")
                batch //= 2
            elif args.attention != "dense" and not is_oom(e):
                notes.append(f"attention {args.attention} failed ({type(e).__name__}), fell back to dense")
                args = argparse.Namespace(**{**vars(args), "attention": "dense"})
            else:
                return dict(size=name, batch=batch, remat=args.remat, attention=args.attention,
                            error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}",
                            notes="; ".join(notes))
        finally:
            gc.collect()
            jax.clear_caches()


def markdown(rows, peak) -> str:
    lines = ["| model | params | batch x seq | remat | attention | median step (ms) | tokens/s | TFLOP/s | "
             f"MFU (peak {peak:g}) | compile (s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "median_step_s" not in r:
            lines.append(f"| {r['size']} | | {r.get('batch')} | {r.get('remat')} | {r.get('attention')} | "
                         f"failed: {r.get('error', '')[:80]} | | | | |")
            continue
        lines.append(f"| {r['size']} | {r['params'] / 1e6:.1f}M | {r['batch']} x {r['seq']} | {r['remat']} | "
                     f"{r['attention']} | {r['median_step_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['tflops']:.1f} | {100 * r['mfu']:.1f}% | {r['compile_s']:.0f} |")
    return "\n".join(lines)


def git_commit() -> str | None:
    """HEAD's commit: `git rev-parse HEAD`, or where there is no git binary (the GPU image) .git's files
    read directly (passlib.read_commit; else env COMMIT)."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        if out:
            return out
    except Exception:  # noqa: BLE001
        pass
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import passlib

        commit = passlib.read_commit()[0]
        return None if commit == "unknown" else commit
    except Exception:  # noqa: BLE001
        return None


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    ap.add_argument("--vocab", type=int, default=50304, help="50304: GPT-2's 50257 padded to a multiple of 64")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=0, help="sequences per step for every size (0: per-size default)")
    ap.add_argument("--remat", default="none", choices=["none", "full", "dots", "dots_no_batch"])
    ap.add_argument("--attention", default="dense", choices=["dense", "cudnn", "xla"],
                    help="dense: the model's own (fp32 scores); cudnn/xla: jax.nn.dot_product_attention")
    ap.add_argument("--zero-stage", type=int, default=0, choices=[0, 1, 2, 3])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per size (after compile + 2 warm-up)")
    ap.add_argument("--size-limit-s", type=float, default=60.0, help="stop timing a size after this many seconds")
    ap.add_argument("--budget-s", type=float, default=300.0, help="skip sizes that would start after this")
    ap.add_argument("--skip-by-estimate", action="store_true",
                    help="also skip a size when the last size's wall time would take it past --budget-s")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak; 989 = H200 SXM")
    ap.add_argument("--quick", action="store_true", help="a tiny 2-layer model, seq 64, vocab 256 (CPU smoke test)")
    ap.add_argument("--json", default="train_mfu.json")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    sizes = {name: SIZES[name] for name in args.sizes}
    if args.quick:
        sizes, args.seq, args.vocab, args.steps = QUICK, 64, 256, 3

    device = jax.devices()[0]
    meta = dict(benchmark="train_mfu", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                commit=git_commit(), device=device.device_kind, platform=device.platform, jax=jax.__version__,
                device_count=jax.device_count(), peak_tflops=args.peak_tflops, quick=args.quick,
                memory_limit_bytes=memory_limit(device),
                flops_formula="6 * Psi + 12 * layers * seq * d_model per token (fwd+bwd; Psi excludes the "
                              "position table; remat recomputation not counted)",
                command=" ".join([os.path.basename(sys.executable)]
                                 + (sys.argv if argv is None else ["benchmarks/gpu/train_mfu.py", *argv])))
    print(json.dumps(meta, indent=1))
    if device.platform != "gpu" and not args.quick:
        print(f"warning: running on {device.platform}, not a GPU; try --quick", file=sys.stderr)

    rows = []
    begin = time.perf_counter()
    last_cost = 0.0  # the last size's wall time: what the next one is expected to take at most (sizes run
    for name, spec in sizes.items():  # largest first in the GPU pass; in the default order it underestimates)
        elapsed = time.perf_counter() - begin
        if elapsed > args.budget_s or (args.skip_by_estimate and elapsed + last_cost > args.budget_s):
            rows.append(dict(size=name, error=f"skipped: {elapsed:.0f}s spent, the last size took {last_cost:.0f}s, "
                                              f"budget {args.budget_s:.0f}s"))
            continue
        start = time.perf_counter()
        row = run_size(name, spec, args, device)
        last_cost = time.perf_counter() - start
        row["wall_s"] = last_cost
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args.json, "w") as f:  # after every size, so a timeout keeps what was measured
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    meta["total_s"] = time.perf_counter() - begin
    meta["gin_or_tensorboardx_imported"] = sorted(m for m in sys.modules if m.split(".")[0] in ("gin", "tensorboardX"))
    with open(args.json, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print()
    print(markdown(rows, args.peak_tflops))
    print(f"\nwrote {args.json} ({meta['total_s']:.0f} s)")
    return 0 if all("median_step_s" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
