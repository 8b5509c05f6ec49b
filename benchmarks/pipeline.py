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
4. The tensor axis against Megatron's volume for this GPT (`megatron_all_reduces`), with and without a
   pipeline and remat.
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


def engine_for(model, mesh, stage, schedule, micro_batches, micro_batch_size, seq):
    config = zeroflax.Config(mesh=zeroflax.MeshConfig(mesh), zero_stage=stage, micro_batch_size=micro_batch_size,
                             grad_accum_steps=micro_batches, persistence_threshold=0, pipeline_schedule=schedule)
    batch = {"tokens": np.zeros((mesh["data"] * micro_batch_size * micro_batches, seq + 1), np.int32)}
    engine, state = zeroflax.initialize(next_token_loss(model), lambda r, b: model.init(r, b["tokens"][:1, :-1])[
        "params"], optax.adam(1e-3), config, sample_batch=batch)
    return engine, state, batch


def megatron_all_reduces(layers: int, stages: int, micro_batches: int, remat: bool) -> float:
    """All-reduces of one [batch, seq, d_model] activation over `tensor` per device per step that Megatron's
    tensor slicing needs for the GPT, averaged over pipeline stages. Per layer and micro-batch: 2 in a
    forward (attention out, MLP out), 2 in the backward (the inputs of the column-parallel QKV and MLP-in),
    and 1 per recomputed forward (attention out: it feeds the MLP; the layer's own output is not needed
    again). The vocab-parallel embedding adds 1 per forward that needs it, the tied head 1 in the backward.
    Without a pipeline a step runs each layer forward once and, with remat, once more in the backward.
    With one, a stage that is not the last runs its forward at its F tick, again in the backward tick
    (where its last layer's output is not needed), and with remat once more; the last stage's F tick
    only files its input."""
    L = layers // stages
    r = 1 if remat else 0
    if stages == 1:
        per_micro = L * (2 + 2 + r) + 1 + 1
    else:
        first_and_middle = 2 * L + (2 * L - 1) + r * L + 2 * L
        last = 2 * L + r * L + 2 * L
        # The embedding (first stage: F tick and backward tick) and the head (last stage's backward).
        per_stage = [first_and_middle] * (stages - 1) + [last]
        per_stage[0] += 2
        per_stage[-1] += 1
        per_micro = sum(per_stage) / stages
    return micro_batches * per_micro


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
            results["memory"][f"{schedule}_{M}"] = engine.memory_report(state, batch).temp / MiB
    results["memory"]["stage_input_mib"] = micro * seq * 64 * 4 / MiB
    print(f"memory ({time.time() - started:.0f} s)", flush=True)

    # Layers dominate here (as in a large model): embeddings, which every stage holds whole, are ~1%.
    wide = GPT(GPTConfig(num_layers=8, d_model=256, num_heads=4, max_len=32))
    for mesh in ({"data": 2, "pipe": 2, "tensor": 2}, {"data": 2, "pipe": 4, "tensor": 1}, {"data": 1, "pipe": 4, "tensor": 2}):
        for stage in (0, 3):
            engine, state, batch = engine_for(wide, mesh, stage, "1f1b", 4, 1, 32)
            report = engine.memory_report(state, batch)
            name = " x ".join(f"{k} {v}" for k, v in mesh.items())
            results["at_rest"][f"{name}, stage {stage}"] = {
                "at_rest_mib": report.at_rest / MiB, "theory_mib": report.theory_at_rest / MiB,
                "ratio": report.ratio, "psi": report.num_params}
    print(f"at rest ({time.time() - started:.0f} s)", flush=True)

    small = GPT(GPTConfig(num_layers=4, d_model=64, num_heads=2, max_len=32))
    for mesh, stage in [({"data": 2, "pipe": 2, "tensor": 2}, s) for s in range(4)] + [
            ({"data": 2, "pipe": 4, "tensor": 1}, 0), ({"data": 2, "pipe": 4, "tensor": 1}, 3)]:
        engine, state, batch = engine_for(small, mesh, stage, "1f1b", 8, 2, 32)
        r = engine.comm_report(state, batch)
        results["comm"].append({"mesh": mesh, "stage": stage, "by_axis_mib": {k: v / MiB for k, v in r.by_axis.items()},
                                "theory_by_axis_mib": {k: v / MiB for k, v in r.theory_by_axis.items()},
                                "permute_mib": r.permute_bytes / MiB, "permute_theory_mib": r.permute_theory / MiB})
        print(f"comm {mesh} stage {stage} ({time.time() - started:.0f} s)", flush=True)

    results["tensor"] = []
    for mesh, M, remat in [({"data": 4, "tensor": 2}, 1, "none"), ({"data": 4, "tensor": 2}, 1, "full"),
                           ({"data": 2, "pipe": 2, "tensor": 2}, 8, "full")]:
        config = zeroflax.Config(mesh=zeroflax.MeshConfig(mesh), micro_batch_size=2, grad_accum_steps=M,
                                 persistence_threshold=0, remat=remat)
        batch = {"tokens": np.zeros((mesh["data"] * 2 * M, 33), np.int32)}
        engine, state = zeroflax.initialize(next_token_loss(small), lambda r, b: small.init(r, b["tokens"][:1, :-1])[
            "params"], optax.adam(1e-3), config, sample_batch=batch)
        measured = engine.comm_report(state, batch).by_axis.get("tensor", 0.0)
        activation = 2 * 32 * 64 * 4  # [2, 32, 64] fp32; an all-reduce over T = 2 moves 2 R (T-1)/T = R
        theory = megatron_all_reduces(4, mesh.get("pipe", 1), M, remat != "none") * activation
        results["tensor"].append({"mesh": mesh, "micro_batches": M, "remat": remat, "measured_mib": measured / MiB,
                                  "megatron_mib": theory / MiB})
    print(f"tensor ({time.time() - started:.0f} s)", flush=True)

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
    lines += ["", "| tensor axis, stage 0 | M | remat | measured MiB | Megatron MiB | ratio |", "|---|---|---|---|---|---|"]
    for t in r["tensor"]:
        mesh = " x ".join(f"{k} {v}" for k, v in t["mesh"].items())
        lines.append(f"| {mesh} | {t['micro_batches']} | {t['remat']} | {t['measured_mib']:.3f} | {t['megatron_mib']:.3f} "
                     f"| {t['measured_mib'] / t['megatron_mib']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
