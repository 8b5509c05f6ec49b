"""The GPU pass's parts, one per process: ``python benchmarks/gpu/pass_parts.py PART --json OUT.json
[--smoke] [--deadline EPOCH] [--probe-json PROBE.json]`` (pass_runner.py starts them; see pass.sh).

    a  probe           probe.py: versions, device, commit, the bf16 matmul and copy ceilings
    b  onebit          onebit_kernels.py: 1-bit Adam's Pallas kernels vs the jnp version, GB/s
    c  host_bandwidth  host_bandwidth.py: pinned / pageable host <-> device GB/s
    d  sparse_attention  sparse_attention.py's functions at shapes.SPARSE_*: window (~10%) and BigBird vs
                       cuDNN's dense attention, forward and forward+backward
    e  train_mfu       train_mfu.py's main: GPT 1.3B, then 350M, then 125M (--attention cudnn), MFU
    f  offload         offload.py's main, ratio phase only: step time with offload variants / no offload at 1.3B

Every part writes its JSON as it goes (after each row where it has rows), so a part killed at its
timeout leaves what it measured. --deadline (epoch seconds, from the runner) is when the part should be
done: parts with several units of work (shapes, sizes, configs) start the next one only if the last one's
cost still fits. Test hooks (env): PASS_FAIL=c[,d] makes those parts raise at their start; PASS_HANG=a
makes them sleep until killed.

Nothing is imported at module level beyond the standard library, so that each part's script can set
its environment (memory fraction, pinned pool size) before jax starts.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import passlib  # noqa: E402
import shapes  # noqa: E402

PARTS = {letter: name for letter, (name, _) in passlib.PARTS.items()}


def _env_parts(name: str) -> set[str]:
    return {p.strip() for p in os.environ.get(name, "").replace(" ", ",").split(",") if p.strip()}


# --------------------------------------------------------------------------------------------- a b c
def part_a(args, clock):
    import probe

    result = probe.run(args.smoke)
    passlib.write_json(args.json, result)
    return 0


def part_b(args, clock):
    import onebit_kernels

    result = onebit_kernels.run(args.smoke, args.probe_json, clock.epoch,
                                on_row=lambda r: passlib.write_json(args.json, r))
    passlib.write_json(args.json, result)
    if not result["checks"] or not all(c["all_equal"] for c in result["checks"]):
        return f"the Pallas kernels are not bitwise equal to the jnp version: {result['checks']}"
    return 0


def part_c(args, clock):
    import host_bandwidth

    result = host_bandwidth.run(args.smoke, clock.epoch, on_row=lambda r: passlib.write_json(args.json, r))
    passlib.write_json(args.json, result)
    return 0 if any("gbs" in r for r in result["rows"]) else "no transfer was measured"


# ------------------------------------------------------------------------------------------------- d
def part_d(args, clock):
    import datetime

    import jax

    import sparse_attention as sa

    if args.smoke:
        lengths, block, heads, dims = (shapes.SMOKE_SPARSE_LENGTHS, shapes.SMOKE_SPARSE_BLOCK,
                                       shapes.SMOKE_SPARSE_HEADS, shapes.SMOKE_SPARSE_HEAD_DIMS)
        iters, min_sample_s = 2, 0.0
    else:
        lengths, block, heads, dims = (shapes.SPARSE_WINDOWS, shapes.SPARSE_BLOCK, shapes.SPARSE_HEADS,
                                       shapes.SPARSE_HEAD_DIMS)
        iters, min_sample_s = 10, 0.02
    batch = shapes.SPARSE_BATCH
    device = jax.devices()[0]
    ceilings = passlib.ceilings_from_probe(args.probe_json)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    meta = dict(part="sparse_attention", date=now,
                device_kind=device.device_kind, platform=device.platform, jax=jax.__version__, batch=batch,
                heads=heads, block=block, head_dims=list(dims), windows={str(k): v for k, v in lengths.items()},
                iters=iters, min_sample_s=min_sample_s, dtype="bfloat16", causal=False, ceilings=ceilings,
                interpret=device.platform != "gpu", smoke=args.smoke,
                flops="forward 4 * computed blocks * block^2 * head_dim per (batch, head) (dense: L^2 instead of "
                      "blocks * block^2); forward+backward 3.5x the forward")
    result = dict(meta=meta, rows=[])
    write = lambda: passlib.write_json(args.json, result)  # noqa: E731

    t = time.perf_counter()
    try:
        errs = sa.correctness_check()
        passed, check_error = sa.check_passes(errs), None
    except Exception as e:  # noqa: BLE001 - still time the kernels; the part fails at its end
        traceback.print_exc()
        errs, passed, check_error = {}, False, passlib.error_text(e)
    meta["check"] = dict(rel_err_out_dq_dk_dv=errs, tolerance=sa.CHECK_TOLERANCE, passed=passed, error=check_error,
                         seconds=time.perf_counter() - t,
                         what="Pallas vs the dense masked reference: b 2, L 256, 2 heads, d 64, block 16, BigBird "
                              "per head, causal, key padding; float32 and bfloat16; output and dq, dk, dv")
    write()
    if args.smoke:
        dense, why = "xla", "SMOKE: XLA's dense attention stands in for cuDNN's"
    else:
        ok, why = sa.cudnn_available()
        dense = "cudnn" if ok else None
    meta["dense_impl"], meta["dense_note"] = dense, why
    write()

    last_cost = 0.0
    for length, window in lengths.items():
        for d in dims:
            if not clock.allows(last_cost + 2.0):
                result["rows"].append(dict(kind="all", L=length, head_dim=d, skipped=True,
                                           error=f"skipped: {clock.left():.0f} s left, the last shape took "
                                                 f"{last_cost:.0f} s"))
                write()
                continue
            begin = time.perf_counter()
            inputs = sa.random_inputs((batch, length, heads, d), seed=length + d)
            base = None
            if dense is None:
                result["rows"].append(dict(kind="dense (cudnn)", L=length, head_dim=d, batch=batch, heads=heads,
                                           skipped=True, error=f"skipped: cuDNN attention unavailable ({why})"))
            else:
                base = sa.measure_case(f"dense ({dense})", None, None, sa.dense_fn(dense), inputs, iters, min_sample_s)
                result["rows"].append(base)
                write()
                if "error" in base:
                    base = None
            for name, layout in sa.pass_layouts(length, window, block):
                row = sa.measure_case(name, block, layout, sa.sparse_fn(layout), inputs, iters, min_sample_s)
                if base is not None and "fwd_s" in row:
                    row["fwd_speedup_vs_dense"] = base["fwd_s"] / row["fwd_s"]
                    row["fwdbwd_speedup_vs_dense"] = base["fwdbwd_s"] / row["fwdbwd_s"]
                if "matmul_tflops" in ceilings and "fwd_s" in row:
                    row["fwdbwd_of_matmul_ceiling"] = row["fwdbwd_tflops"] / ceilings["matmul_tflops"]
                result["rows"].append(row)
                print(row, flush=True)
                write()
            del inputs
            last_cost = time.perf_counter() - begin
    meta["imported_gin_or_tensorboardx"] = passlib.blocked_modules()
    write()
    measured = [r for r in result["rows"] if "fwd_s" in r and not r["kind"].startswith("dense")]
    if not meta["check"]["passed"]:
        return f"the correctness check failed: {check_error or errs}"
    return 0 if measured else "no sparse case was measured"


# ------------------------------------------------------------------------------------------------ e
def part_e(args, clock):
    import train_mfu

    budget = max(1.0, clock.left() - 5.0) if clock.epoch else 300.0
    argv = ["--sizes", *shapes.MFU_SIZES, "--attention", "cudnn", "--budget-s", f"{budget:.0f}", "--skip-by-estimate",
            "--size-limit-s", "20", "--json", args.json]
    if args.smoke:  # a 2-layer model; XLA's dense attention stands in for cuDNN's
        argv = ["--quick", "--attention", "xla", "--budget-s", f"{budget:.0f}", "--json", args.json]
    rc = train_mfu.main(argv)
    data = passlib.load_json(args.json) or {}
    ceilings = passlib.ceilings_from_probe(args.probe_json)
    for row in data.get("rows", []):
        if "tflops" in row:
            row["mfu_datasheet"] = row["tflops"] / passlib.DATASHEET_BF16_TFLOPS
            if "matmul_tflops" in ceilings:
                row["mfu_measured_ceiling"] = row["tflops"] / ceilings["matmul_tflops"]
    data.setdefault("meta", {}).update(ceilings=ceilings, train_mfu_rc=rc, argv=argv)
    passlib.write_json(args.json, data)
    return 0 if any("median_step_s" in r for r in data.get("rows", [])) else "no size was measured"


# ------------------------------------------------------------------------------------------------ f
def part_f(args, clock):
    import offload

    budget = max(1.0, clock.left() - 5.0) if clock.epoch else 300.0
    argv = ["--phases", "ratio", "--ratio-layers", str(shapes.OFFLOAD_RATIO_LAYERS), "--warmup", "1", "--steps", "3",
            "--config-limit-s", "15", "--budget-s", f"{budget:.0f}", "--ratio-budget-s", f"{budget:.0f}",
            "--json", args.json]
    if args.smoke:  # offload.py's tiny model (--quick's settings), the two configurations that give the ratio
        argv = ["--quick", "--phases", "ratio", "--ratio-modes", "no offload", "offload", "--warmup", "1",
                "--budget-s", f"{budget:.0f}",
                "--ratio-budget-s", f"{budget:.0f}", "--json", args.json]
    rc = offload.main(argv)
    data = passlib.load_json(args.json) or {}
    data.setdefault("meta", {}).update(offload_rc=rc, argv=argv)
    passlib.write_json(args.json, data)
    return 0 if any("median_step_s" in r for r in data.get("rows", [])) else "no configuration was measured"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=sorted(PARTS))
    ap.add_argument("--json", required=True)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--deadline", type=float, default=None, help="epoch seconds: be done by then")
    ap.add_argument("--probe-json", default=None)
    args = ap.parse_args(argv)
    print(f"[part {args.part}: {PARTS[args.part]}] python {sys.version.split()[0]}, smoke={args.smoke}, "
          f"deadline in {args.deadline - time.time() if args.deadline else float('inf'):.0f} s", flush=True)
    if args.part in _env_parts("PASS_HANG"):
        print(f"PASS_HANG={os.environ['PASS_HANG']}: part {args.part} sleeps until it is killed", flush=True)
        while True:
            time.sleep(3600)
    if args.part in _env_parts("PASS_FAIL"):
        raise RuntimeError(f"PASS_FAIL={os.environ['PASS_FAIL']}: part {args.part} fails on purpose "
                           "(a test of the pass)")
    clock = passlib.Deadline(args.deadline)
    outcome = globals()[f"part_{args.part}"](args, clock)
    if isinstance(outcome, str):  # the part ran but failed its own check
        print(f"PartFailure: {outcome}", file=sys.stderr, flush=True)
        return 1
    return outcome


if __name__ == "__main__":
    sys.exit(main())
