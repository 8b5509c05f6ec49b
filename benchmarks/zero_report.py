"""ZeRO stages 0-3 on 8 simulated CPU devices: per-device model-state bytes and per-step collective
bytes for a GPT-like stack, each beside the theory of docs/design.md section 2. Compile-only (nothing is trained).

    python benchmarks/zero_report.py [--layers 12] [--d-model 384] [--json runs/zero_report.json]

Prints a markdown table (for docs/perf.md) and writes everything as JSON. Also measures:
  - with 4 accumulation steps, stage 1's and stage 2's gradient buffers and XLA temp bytes;
  - stage 3's XLA temp bytes at L and 2L layers (the gathered weights must not pile up).
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
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import zeroflax  # noqa: E402
from zeroflax.models.gpt import GPT, GPTConfig, next_token_loss  # noqa: E402

MiB = 2**20


def build(gpt: GPTConfig, seq: int, stage: int, precision: str, accum: int = 1, threshold: int = 4096,
          **changes):
    """(engine, state, batch) of the GPT at this stage; `changes` are further Config keys (e.g. offload)."""
    model = GPT(gpt)
    config = zeroflax.Config(zero_stage=stage, precision=precision, micro_batch_size=1, grad_accum_steps=accum,
                             persistence_threshold=threshold, remat="full", **changes)
    batch = {"tokens": np.zeros((config.resolve_train_batch(jax.device_count()), seq + 1), np.int32)}
    init = lambda rng, b: model.init(rng, b["tokens"][:, :-1])["params"]
    # Abstract state: the init function is only traced, so nothing of Psi size is allocated here.
    engine, state = zeroflax.initialize(next_token_loss(model), init, optax.adamw(1e-4), config,
                                        sample_batch=batch)
    return engine, state, batch


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--json", default="runs/zero_report.json")
    args = parser.parse_args(argv)

    gpt = GPTConfig(num_layers=args.layers, d_model=args.d_model, num_heads=args.heads, max_len=args.seq)
    n = jax.device_count()
    results = {"psi": gpt.num_params(), "devices": n, "layers": args.layers, "d_model": args.d_model,
               "precision": args.precision, "jax": jax.__version__, "stages": {}}
    started = time.time()
    print(f"GPT: {args.layers} scanned layers, d_model {args.d_model}, Psi = {gpt.num_params():,}; N = {n}, "
          f"{args.precision} compute, fp32 master/grads/Adam", flush=True)
    for stage in range(4):
        engine, state, batch = build(gpt, args.seq, stage, args.precision)
        memory, comm = zeroflax.memory_report(engine, state, batch), zeroflax.comm_report(engine, state, batch)
        results["stages"][stage] = {"memory": memory.to_dict(), "comm": {k: v for k, v in comm.to_dict().items()
                                                                          if k != "collectives"}}
        print(f"stage {stage} done ({time.time() - started:.0f} s)", flush=True)

    accum = {}
    for stage in (1, 2):
        engine, state, batch = build(gpt, args.seq, stage, args.precision, accum=4)
        report = zeroflax.memory_report(engine, state, batch)
        accum[stage] = {"grad_buffer": report.grad_buffer, "temp": report.temp}
    results["accumulation_4"] = accum
    print(f"accumulation done ({time.time() - started:.0f} s)", flush=True)

    deep = GPTConfig(num_layers=2 * args.layers, d_model=args.d_model, num_heads=args.heads, max_len=args.seq)
    engine, state, batch = build(deep, args.seq, 3, args.precision)
    deep_memory = zeroflax.memory_report(engine, state, batch)
    shallow = results["stages"][3]["memory"]
    d, f = args.d_model, gpt.ff
    per_layer_weights = 4 * d + 4 * d * d + 2 * d * f + f + d
    extra_layers = args.layers
    compute_bytes = 2 if args.precision in ("bf16", "fp16") else 4
    results["stage3_depth"] = {
        "layers": [args.layers, 2 * args.layers],
        "temp": [shallow["temp"], deep_memory.temp],
        "temp_growth": deep_memory.temp - shallow["temp"],
        # The extra layers' sharded fp32 gradients live in XLA's temporaries too.
        "grad_buffer_growth": deep_memory.grad_buffer - shallow["grad_buffer"],
        # Remat keeps each layer's input (the residual stream) for the backward pass: micro-batch 1 per device.
        "extra_activations": extra_layers * args.seq * d * 4,
        # What keeping every layer's gathered weights would add instead.
        "extra_if_gathered_weights_kept": extra_layers * per_layer_weights * compute_bytes,
    }
    results["stage3_partitioner_only"] = partitioner_only_comm(gpt, args.seq, args.precision)
    print(f"depth check done ({time.time() - started:.0f} s)", flush=True)

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(__file__)).stdout.strip()
    results["commit"] = commit
    print(markdown(results))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {args.json}")


def partitioner_only_comm(gpt: GPTConfig, seq: int, precision: str) -> dict:
    """The "before": stage 3 expressed only as sharding annotations, for comparison with the engine."""
    from zeroflax.comm import parse_collectives, theory_bytes
    engine, state, batch = build(gpt, seq, 3, precision)
    plan, model, optimizer = engine.plan, GPT(gpt, remat="full"), engine.optimizer
    dtype = engine.config.compute_dtype
    loss_fn = next_token_loss(model)

    def step(params, opt_state, batch):
        cast = lambda p: jax.tree.map(lambda x: x.astype(dtype), p)
        grads = jax.grad(lambda p: loss_fn(cast(p), batch, None))(params)
        grads = jax.lax.with_sharding_constraint(grads, plan.grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return jax.lax.with_sharding_constraint(optax.apply_updates(params, updates), plan.params), opt_state

    data_sharding = jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec("data"))
    compiled = jax.jit(step, in_shardings=(plan.params, plan.opt_state, {"tokens": data_sharding}),
                       out_shardings=(plan.params, plan.opt_state)).lower(
        state.params, state.opt_state, batch).compile()
    collectives, _ = parse_collectives(compiled.as_text(), plan.mesh.size)
    by_kind: dict = {}
    for c in collectives:
        by_kind[c.kind] = by_kind.get(c.kind, 0.0) + c.bytes_per_step
    total = sum(by_kind.values())
    theory = theory_bytes(3, gpt.num_params(), plan.mesh.shape["data"], np.dtype(dtype).itemsize, 4)
    return {"by_kind": by_kind, "total": total, "ratio": total / theory}


def markdown(r) -> str:
    psi, n = r["psi"], r["devices"]
    lines = [f"Psi = {psi:,} parameters ({r['layers']} scanned layers, d_model {r['d_model']}), N = {n}, "
             f"{r['precision']} compute, fp32 master weights, gradients and Adam state.", "",
             "| stage | params MiB | opt state MiB | at rest MiB | theory MiB | ratio | grad buffer MiB | "
             "XLA temp MiB | comm MiB/step | comm theory MiB | ratio | collectives |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for stage, row in r["stages"].items():
        m, c = row["memory"], row["comm"]
        kinds = ", ".join(f"{k} {v['bytes'] / MiB:.1f}" for k, v in sorted(c["by_kind"].items()))
        lines.append(f"| {stage} | {m['params'] / MiB:.1f} | {m['opt_state'] / MiB:.1f} | {m['at_rest'] / MiB:.1f} | "
                     f"{m['theory_at_rest'] / MiB:.1f} | {m['ratio']:.3f} | {m['grad_buffer'] / MiB:.1f} | "
                     f"{m['temp'] / MiB:.1f} | {c['total_bytes'] / MiB:.1f} | {c['theory_bytes'] / MiB:.1f} | "
                     f"{c['ratio']:.3f} | {kinds} |")
    a = r["accumulation_4"]
    lines += ["", f"With 4 accumulation steps: gradient buffer stage 1 {a[1]['grad_buffer'] / MiB:.1f} MiB, "
              f"stage 2 {a[2]['grad_buffer'] / MiB:.1f} MiB (ratio {a[2]['grad_buffer'] / a[1]['grad_buffer']:.3f}); "
              f"XLA temp stage 1 {a[1]['temp'] / MiB:.1f} MiB, stage 2 {a[2]['temp'] / MiB:.1f} MiB.", ""]
    d = r["stage3_depth"]
    lines.append(f"Stage 3 depth: XLA temp {d['temp'][0] / MiB:.1f} MiB at {d['layers'][0]} layers, "
                 f"{d['temp'][1] / MiB:.1f} MiB at {d['layers'][1]} (+{d['temp_growth'] / MiB:.1f} MiB, of which "
                 f"{d['grad_buffer_growth'] / MiB:.1f} MiB are the extra layers' sharded gradients, leaving "
                 f"{(d['temp_growth'] - d['grad_buffer_growth']) / MiB:.1f} MiB); the extra layers' saved activations "
                 f"are {d['extra_activations'] / MiB:.1f} MiB; keeping their gathered weights would add "
                 f"{d['extra_if_gathered_weights_kept'] / MiB:.1f} MiB.")
    b = r["stage3_partitioner_only"]
    kinds = ", ".join(f"{k} {v / MiB:.1f}" for k, v in sorted(b["by_kind"].items()))
    lines += ["", f"Stage 3 left to XLA's partitioner alone (params sharded, the loss in the global view, gradients "
              f"constrained to the shards, no shard_map): {b['total'] / MiB:.1f} MiB/step, ratio {b['ratio']:.3f} "
              f"to theory ({kinds}); zeroflax's explicit gather/reduce-scatter: "
              f"{r['stages'][3]['comm']['total_bytes'] / MiB:.1f} MiB/step."]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
