"""3D parallelism, measured (issue 8): per-device memory and collective bytes of one compiled step on 8
simulated CPU devices. Compile-only: nothing is trained.

    python benchmarks/pipeline.py [--json runs/pipeline.json]

1. Schedules: ticks and idle fraction per stage of gpipe, 1f1b (S = 4, M = 8 and 16) and the
   interleaved table (V = 2), against (S-1)/(V M + S-1).
2. Memory, pipe 4 x data 2, the GPT below in fp32: XLA temporaries at M = 8 and 16 for 1f1b and gpipe,
   against one micro-batch's stage input; model states at rest against 1/(S T) (stage 0) and
   1/(S T D) (stage 3) of the whole, on three meshes (S = 2 and 4).
3. Communication, pipe 2 x data 2 x tensor 2 at ZeRO stages 0-3 (and pipe 4 x data 2): bytes per device
   per step by mesh axis beside each axis's theory; the pipeline's sends beside the schedule's.
4. The tensor axis against Megatron's volume (`zeroflax.comm.megatron_all_reduces`, the report's theory)
   at every ZeRO stage, with and without a pipeline, remat and sequence parallelism; sequence
   parallelism's temporaries against none.
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

import numpy as np  # noqa: E402
import optax  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
import zeroflax  # noqa: E402
from zeroflax.models.gpt import GPT, GPTConfig, next_token_loss  # noqa: E402
from zeroflax.pipeline.schedule import build_schedule  # noqa: E402

MiB = 2**20


def engine_for(model, mesh, stage, schedule, micro_batches, micro_batch_size, seq, **overrides):
    config = zeroflax.Config(mesh=zeroflax.MeshConfig(mesh), zero_stage=stage, micro_batch_size=micro_batch_size,
                             grad_accum_steps=micro_batches, persistence_threshold=0, pipeline_schedule=schedule,
                             **overrides)
    batch = {"tokens": np.zeros((mesh["data"] * micro_batch_size * micro_batches, seq + 1), np.int32)}
    engine, state = zeroflax.initialize(next_token_loss(model), lambda r, b: model.init(r, b["tokens"][:1, :-1])[
        "params"], optax.adam(1e-3), config, sample_batch=batch)
    return engine, state, batch


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="runs/pipeline.json")
    args = parser.parse_args(argv)
    started = time.time()
    results = {"schedules": [], "memory": {}, "at_rest": {}, "comm": []}

    for name, S, M, V in [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 4, 16, 1), ("interleaved", 4, 8, 2)]:
        s = build_schedule(name, S, M, V)
        results["schedules"].append({"name": name, "S": S, "M": M, "V": V, "ticks": s.num_ticks,
                                     "idle": [s.idle_fraction(i) for i in range(S)],
                                     "theory": (S - 1) / (V * M + S - 1), "in_flight": [s.in_flight(i) for i in range(S)]})

    seq, micro = 64, 4
    model = GPT(GPTConfig(num_layers=8, d_model=64, num_heads=2, max_len=seq))
    for schedule in ("1f1b", "gpipe"):
        for M in (8, 16):
            engine, state, batch = engine_for(model, {"data": 2, "pipe": 4, "tensor": 1}, 0, schedule, M, micro, seq)
            results["memory"][f"{schedule}_{M}"] = zeroflax.memory_report(engine, state, batch).temp / MiB
    results["memory"]["stage_input_mib"] = micro * seq * 64 * 4 / MiB
    print(f"memory ({time.time() - started:.0f} s)", flush=True)

    # Layers dominate here (as in a large model): embeddings, which every stage holds whole, are ~1%.
    wide = GPT(GPTConfig(num_layers=8, d_model=256, num_heads=4, max_len=32))
    for mesh in ({"data": 2, "pipe": 2, "tensor": 2}, {"data": 2, "pipe": 4, "tensor": 1}, {"data": 1, "pipe": 4, "tensor": 2}):
        for stage in (0, 3):
            engine, state, batch = engine_for(wide, mesh, stage, "1f1b", 4, 1, 32)
            report = zeroflax.memory_report(engine, state, batch)
            name = " x ".join(f"{k} {v}" for k, v in mesh.items())
            results["at_rest"][f"{name}, stage {stage}"] = {
                "at_rest_mib": report.at_rest / MiB, "theory_mib": report.theory_at_rest / MiB,
                "ratio": report.ratio, "psi": report.num_params}
    print(f"at rest ({time.time() - started:.0f} s)", flush=True)

    small = GPT(GPTConfig(num_layers=4, d_model=64, num_heads=2, max_len=32))
    for mesh, stage in [({"data": 2, "pipe": 2, "tensor": 2}, s) for s in range(4)] + [
            ({"data": 2, "pipe": 4, "tensor": 1}, 0), ({"data": 2, "pipe": 4, "tensor": 1}, 3)]:
        engine, state, batch = engine_for(small, mesh, stage, "1f1b", 8, 2, 32)
        r = zeroflax.comm_report(engine, state, batch)
        results["comm"].append({"mesh": mesh, "stage": stage, "by_axis_mib": {k: v / MiB for k, v in r.by_axis.items()},
                                "theory_by_axis_mib": {k: v / MiB for k, v in r.theory_by_axis.items()},
                                "permute_mib": r.permute_bytes / MiB, "permute_theory_mib": r.permute_theory / MiB})
        print(f"comm {mesh} stage {stage} ({time.time() - started:.0f} s)", flush=True)

    results["tensor"] = []
    cases = ([({"data": 4, "tensor": 2}, 1, "none", False, 0)]
             + [({"data": 4, "tensor": 2}, 1, "full", False, stage) for stage in range(4)]
             + [({"data": 4, "tensor": 2}, 1, remat, True, 1) for remat in ("full", "dots", "none")]
             + [({"data": 4, "tensor": 2}, 1, "full", True, 3)]
             + [({"data": 2, "pipe": 2, "tensor": 2}, 8, "full", sp, 3) for sp in (False, True)])
    for mesh, M, remat, sp, stage in cases:
        engine, state, batch = engine_for(small, mesh, stage, "1f1b", M, 2, 32, remat=remat,
                                          sequence_parallel=sp)
        r = zeroflax.comm_report(engine, state, batch)
        kinds = {}
        for c in r.collectives:
            if tuple(c["axes"]) == ("tensor",):
                kinds[c["kind"]] = kinds.get(c["kind"], 0.0) + c["bytes_per_step"] / MiB
        results["tensor"].append({"mesh": mesh, "micro_batches": M, "remat": remat, "sequence_parallel": sp,
                                  "stage": stage, "measured_mib": r.by_axis.get("tensor", 0.0) / MiB,
                                  "megatron_mib": r.theory_by_axis["tensor"] / MiB, "kinds_mib": kinds,
                                  "data_mib": r.by_axis.get("data", 0.0) / MiB, "permute_mib": r.permute_bytes / MiB,
                                  "data_theory_mib": r.theory_by_axis.get("data", float("nan")) / MiB})
    print(f"tensor ({time.time() - started:.0f} s)", flush=True)

    # Sequence parallelism's memory: activations large next to the weights (8 layers, d 128, 4 x 256 tokens).
    results["sequence_parallel_memory"] = []
    long = GPT(GPTConfig(num_layers=8, d_model=128, num_heads=4, max_len=256))
    for remat in ("full", "none"):
        row = {"remat": remat}
        for sp in (False, True):
            engine, state, batch = engine_for(long, {"data": 4, "tensor": 2}, 1, "1f1b", 1, 4, 256, remat=remat,
                                              sequence_parallel=sp)
            row["temp_mib_sp" if sp else "temp_mib"] = zeroflax.memory_report(engine, state, batch).temp / MiB
        results["sequence_parallel_memory"].append(row)
    print(f"sequence parallel memory ({time.time() - started:.0f} s)", flush=True)

    results["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=ROOT).stdout.strip()
    print(markdown(results))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {args.json}")


def markdown(r) -> str:
    lines = ["| schedule | S | M | V | ticks | idle per stage | (S-1)/(VM+S-1) | inputs in flight per stage |",
             "|---|---|---|---|---|---|---|---|"]
    for s in r["schedules"]:
        lines.append(f"| {s['name']} | {s['S']} | {s['M']} | {s['V']} | {s['ticks']} | "
                     f"{', '.join(f'{x:.3f}' for x in s['idle'])} | {s['theory']:.3f} | {s['in_flight']} |")
    m = r["memory"]
    lines += ["", "| temporaries (pipe 4 x data 2, fp32) | M = 8 MiB | M = 16 MiB | growth MiB | growth / stage input |",
              "|---|---|---|---|---|"]
    for schedule in ("1f1b", "gpipe"):
        a, b = m[f"{schedule}_8"], m[f"{schedule}_16"]
        lines.append(f"| {schedule} | {a:.3f} | {b:.3f} | {b - a:.3f} | {(b - a) / m['stage_input_mib']:.1f} |")
    lines += ["", "| at rest | Psi | MiB per device | theory MiB (1/(S T), x 1/D at stage 3) | ratio |", "|---|---|---|---|---|"]
    for name, row in r["at_rest"].items():
        lines.append(f"| {name} | {row['psi']:,} | {row['at_rest_mib']:.3f} | {row['theory_mib']:.3f} | {row['ratio']:.3f} |")
    lines += ["", "| mesh | stage | by axis MiB (measured / theory) | pipeline sends MiB (measured / schedule) |",
              "|---|---|---|---|"]
    for c in r["comm"]:
        axes = "; ".join(f"{k} {v:.3f}" + (f" / {c['theory_by_axis_mib'][k]:.3f}" if k in c["theory_by_axis_mib"] else "")
                         for k, v in sorted(c["by_axis_mib"].items()))
        mesh = " x ".join(f"{k} {v}" for k, v in c["mesh"].items())
        lines.append(f"| {mesh} | {c['stage']} | {axes} | {c['permute_mib']:.4f} / {c['permute_theory_mib']:.4f} |")
    lines += ["", "| tensor axis | stage | M | remat | seq. parallel | measured MiB | Megatron MiB | ratio | by kind MiB "
              "| data axis MiB (measured / ZeRO) | pipeline sends MiB |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for t in r["tensor"]:
        mesh = " x ".join(f"{k} {v}" for k, v in t["mesh"].items())
        kinds = ", ".join(f"{k} {v:.3f}" for k, v in sorted(t["kinds_mib"].items()))
        lines.append(f"| {mesh} | {t['stage']} | {t['micro_batches']} | {t['remat']} | {'yes' if t['sequence_parallel'] else 'no'} "
                     f"| {t['measured_mib']:.3f} | {t['megatron_mib']:.3f} | {t['measured_mib'] / t['megatron_mib']:.3f} "
                     f"| {kinds} | {t['data_mib']:.3f} / {t['data_theory_mib']:.3f} | {t['permute_mib']:.4f} |")
    lines += ["", "Sequence parallelism's temporaries (GPT 8 layers d 128, 4 x 256 tokens per device, data 4 x tensor 2, "
              "stage 1, fp32):", "", "| remat | off MiB | on MiB | on / off |", "|---|---|---|---|"]
    for row in r["sequence_parallel_memory"]:
        lines.append(f"| {row['remat']} | {row['temp_mib']:.2f} | {row['temp_mib_sp']:.2f} | "
                     f"{row['temp_mib_sp'] / row['temp_mib']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
