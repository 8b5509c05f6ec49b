"""The longest sequence whose compiled step fits a fixed per-device memory budget, by sequence axis size.

Compile-only (nothing runs): the GPT at d_model 512 (8 layers, 8 heads, byte vocabulary), bf16, remat 'full',
ZeRO stage 3 over all 8 simulated CPU devices, one example per data shard. With a sequence axis of S the
example's tokens are split over S devices (data 8/S); S = 1 is plain data parallelism. Attention is
memory-linear on every side (GPTConfig.attention 'blockwise' without a split, ring attention's tiles with
one), so the comparison is of the split, not of an attention kernel. For each S the
sequence length doubles until the step no longer fits, then a bisection (in steps of `--quantum` tokens)
finds the longest that does. Per-device memory is XLA's: arguments + outputs + temporaries - aliased
(memory_analysis of the compiled step), as `zeroflax plan` counts it.

    python benchmarks/long_sequence.py --budget_mib 512 --sizes 1,8 --attention ring [--json out.json]

Recorded in docs/perf.md ("Long sequences").
"""
import argparse
import json
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zeroflax  # noqa: E402
from zeroflax import Config, MeshConfig  # noqa: E402
from zeroflax.models.gpt import GPT, GPTConfig, next_token_loss  # noqa: E402


def step_bytes(seq: int, sequence: int, attention: str, layers: int, d_model: int, heads: int,
               model_attention: str) -> float:
    """Per-device bytes of the compiled step (compile-only) at this sequence length and axis size."""
    devices = jax.device_count()
    model = GPT(GPTConfig(vocab_size=256, num_layers=layers, d_model=d_model, num_heads=heads, max_len=seq,
                          attention=model_attention))
    config = Config(mesh=MeshConfig({"data": -1, "sequence": sequence, "tensor": 1}), zero_stage=3, precision="bf16",
                    remat="full", micro_batch_size=1, persistence_threshold=0, sequence_attention=attention)
    sample = {"tokens": np.zeros((1, seq + 1), np.int32)}
    engine, state = zeroflax.initialize(next_token_loss(model), lambda k, b: model.init(k, b["tokens"][:, :-1])["params"],
                                        optax.adamw(1e-3), config, sample_batch=sample, abstract=True)
    rows = devices // sequence  # one example per data shard
    batch = {"tokens": jax.ShapeDtypeStruct((rows, seq + 1), np.int32)}
    stats = engine.compile(state, batch).memory_analysis()
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
            - stats.alias_size_in_bytes)


def longest(sequence: int, budget: float, quantum: int, start: int, attention: str, model: dict, log) -> dict:
    fits = {}

    def fit(seq):
        t = time.perf_counter()
        used = step_bytes(seq, sequence, attention, **model)
        fits[seq] = used
        log(f"  S={sequence} T={seq:>9,}: {used / 2**20:10.1f} MiB {'fits' if used <= budget else 'over'}"
            f" ({time.perf_counter() - t:.0f} s)")
        return used <= budget

    low, high = 0, start
    while fit(high):
        low, high = high, high * 2
    while high - low > quantum:
        mid = (low + high) // 2 // quantum * quantum
        if mid in (low, high):
            break
        low, high = (mid, high) if fit(mid) else (low, mid)
    return {"sequence_axis": sequence, "longest": low, "bytes_at_longest": fits.get(low), "first_over": high,
            "bytes_first_over": fits.get(high), "compiled": {str(k): v for k, v in sorted(fits.items())}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget_mib", type=float, default=512.0)
    parser.add_argument("--sizes", default="1,8", help="sequence axis sizes (each divides the 8 devices)")
    parser.add_argument("--attention", default="ring", choices=("ring", "ulysses"))
    parser.add_argument("--quantum", type=int, default=1024, help="bisection step in tokens (a multiple of 2S)")
    parser.add_argument("--start", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d_model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--model_attention", default="blockwise",
                        help="GPTConfig.attention: what a device runs without a split (S = 1) and under Ulysses; "
                             "ring attention computes its own (blockwise) attention")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    budget = args.budget_mib * 2**20
    model = dict(layers=args.layers, d_model=args.d_model, heads=args.heads, model_attention=args.model_attention)
    print(f"jax {jax.__version__}, {jax.device_count()} CPU devices; GPT d {args.d_model}, {args.layers} layers, "
          f"{args.heads} heads, bf16, remat full, ZeRO-3; budget {args.budget_mib:.0f} MiB per device; "
          f"sequence attention {args.attention}, model attention {args.model_attention}", flush=True)
    results = [longest(int(s), budget, args.quantum, args.start, args.attention, model,
                       lambda line: print(line, flush=True)) for s in args.sizes.split(",")]
    print("\n| sequence axis | data | longest sequence that fits | MiB per device there | next length tried |")
    print("|---|---|---|---|---|")
    for r in results:
        print(f"| {r['sequence_axis']} | {jax.device_count() // r['sequence_axis']} | {r['longest']:,} | "
              f"{(r['bytes_at_longest'] or 0) / 2**20:.1f} | {r['first_over']:,} "
              f"({(r['bytes_first_over'] or 0) / 2**20:.1f} MiB) |")
    if len(results) > 1 and results[0]["longest"]:
        print(f"\nlongest with S={results[-1]['sequence_axis']} / with S={results[0]['sequence_axis']}: "
              f"{results[-1]['longest'] / results[0]['longest']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"budget_mib": args.budget_mib, "model": model, "attention": args.attention,
                       "jax": jax.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
