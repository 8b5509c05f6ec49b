"""ZeRO-Offload on 8 simulated CPU devices: where the model states live and what crosses between host
and device memory per step, each beside its theory. Compile-only (nothing is trained).

    python benchmarks/offload.py [--layers 12] [--d-model 384] [--json runs/offload.json]

For a GPT (bf16 compute, fp32 master weights and Adam) it reports, for ZeRO stages 1-3 with
`offload_optimizer` (update on the host), stage 3 with `offload_param` too, the update streamed to
the device, and the delayed update:
  - model states at rest per device, read from the live state's arrays and their memory kinds:
    on the device (theory: the bf16 compute copy, b_c Psi at stages 1-2, b_c Psi / N at stage 3, only
    the persistent leaves with offload_param) and on the host (theory 12 Psi / N);
  - host<->device bytes per step from the step's program (theory in zeroflax/comm.py's docstring);
  - the data axis' collective bytes from the compiled HLO against ZeRO's volume;
  - XLA's temporaries beside the same stage without offload.
On the CPU backend host memory is device memory: the bytes are what the program places and moves,
not a saving this machine can show (the GPU benchmark, benchmarks/gpu/offload.py, measures that).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import zeroflax  # noqa: E402
from zeroflax import OffloadOptimizerConfig, OffloadParamConfig  # noqa: E402
from zeroflax.memory import state_bytes_by_memory  # noqa: E402
from zeroflax.models.gpt import GPTConfig  # noqa: E402

import zero_report  # noqa: E402  (benchmarks/, the script's own folder)

MiB = 2**20
HOST = OffloadOptimizerConfig("cpu")
CASES = [  # name, stage, offload_optimizer, offload_param
    ("stage 1", 1, HOST, False),
    ("stage 2", 2, HOST, False),
    ("stage 3", 3, HOST, False),
    ("stage 3 + offload_param", 3, HOST, True),
    ("stage 2, update on device", 2, OffloadOptimizerConfig("cpu", update="device"), False),
    ("stage 2, delayed update", 2, OffloadOptimizerConfig("cpu", delayed_update=True), False),
]


def build(gpt: GPTConfig, seq: int, stage: int, offload=None, stream=False):
    """zero_report's GPT engine (bf16, 2 micro-batches), with offload when given."""
    changes = {}
    if offload is not None:
        changes = dict(offload_optimizer=offload, offload_param=OffloadParamConfig("cpu" if stream else "none"))
    return zero_report.build(gpt, seq, stage, "bf16", accum=2, **changes)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--json", default="runs/offload.json")
    args = parser.parse_args(argv)

    gpt = GPTConfig(num_layers=args.layers, d_model=args.d_model, num_heads=args.heads, max_len=args.seq)
    n, psi = jax.device_count(), gpt.num_params()
    started = time.time()
    print(f"GPT: {args.layers} scanned layers, d_model {args.d_model}, Psi = {psi:,}; N = {n}, bf16, "
          "2 micro-batches per step\n")
    rows, temps_without = [], {}
    for stage in (1, 2, 3):
        engine, state, batch = build(gpt, args.seq, stage)
        temps_without[stage] = zeroflax.memory_report(engine, state, batch).temp
    for name, stage, offload, stream in CASES:
        engine, state, batch = build(gpt, args.seq, stage, offload, stream)
        live = state_bytes_by_memory(state)
        kinds = ("params", "opt_state", "compute_params")
        device = sum(live[k].get("device", 0) for k in kinds)
        host = sum(b for k in kinds for kind, b in live[k].items() if kind.endswith("host"))
        memory = zeroflax.memory_report(engine, state, batch)
        comm = zeroflax.comm_report(engine, state, batch)
        rows.append(dict(
            name=name, stage=stage, device=device, device_theory=memory.theory_device, host=host,
            host_theory=12 * psi / n, pending=memory.pending_grads,
            h2d=comm.host_to_device, h2d_theory=comm.host_to_device_theory,
            d2h=comm.device_to_host, d2h_theory=comm.device_to_host_theory,
            collectives=comm.total_bytes, collectives_theory=comm.theory_bytes,
            temp=memory.temp, temp_without=temps_without[stage]))
        print(f"  {name}: done ({time.time() - started:.0f} s)", flush=True)

    print("\n| case | device at rest MiB (theory) | host at rest MiB (12Psi/N) | host->device MiB (theory) "
          "| device->host MiB (theory) | collectives / ZeRO volume | temp MiB (without offload) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['device'] / MiB:.2f} ({r['device_theory'] / MiB:.2f}, "
              f"{r['device'] / r['device_theory']:.3f}x) | {r['host'] / MiB:.2f} ({r['host_theory'] / MiB:.2f}, "
              f"{r['host'] / r['host_theory']:.3f}x) | {r['h2d'] / MiB:.2f} ({r['h2d_theory'] / MiB:.2f}, "
              f"{r['h2d'] / r['h2d_theory']:.3f}x) | {r['d2h'] / MiB:.2f} ({r['d2h_theory'] / MiB:.2f}, "
              f"{r['d2h'] / r['d2h_theory']:.3f}x) | {r['collectives'] / r['collectives_theory']:.3f} "
              f"| {r['temp'] / MiB:.1f} ({r['temp_without'] / MiB:.1f}) |")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = dict(psi=psi, devices=n, layers=args.layers, d_model=args.d_model, jax=jax.__version__, commit=commit,
               rows=rows)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"\n{time.time() - started:.0f} s; JSON in {args.json}")


if __name__ == "__main__":
    main()
