"""Many steps of one sequence-parallel configuration on 8 simulated CPU devices: does XLA:CPU abort?

    python benchmarks/collective_race.py [--attention ring] [--stage 3] [--sequence 4] [--steps 300]

XLA:CPU from jaxlib 0.11 on can pair a collective inside a loop with one beside the loop (docs/perf.md,
"jax 0.11 on simulated CPU devices"): the process aborts after a 40 s rendezvous timeout, "only 4 of them
arrived". A suite runs each case for a few steps, so it meets the race by chance; this runs one case until
it does or `--steps` pass. The case is tests/test_sequence.py's: a 2-layer GPT (d_model 32, 4 heads, 16
tokens, 8 rows per step), data x sequence with the rest of the 8 devices on data, AdamW. It prints the
step every 10 steps and the last loss; the exit status is the process's (134 on an abort).
"""
from __future__ import annotations

import argparse
import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zeroflax  # noqa: E402
from zeroflax.models.gpt import GPT, GPTConfig, next_token_loss  # noqa: E402

ROWS, SEQ = 8, 16


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attention", default="ring", choices=["ring", "ulysses"])
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--sequence", type=int, default=4, help="devices on the sequence axis")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()

    model = GPT(GPTConfig(num_layers=2, d_model=32, num_heads=4, max_len=SEQ))
    rng = np.random.default_rng(0)
    batches = [{"tokens": rng.integers(0, 256, size=(ROWS, SEQ + 1)).astype(np.int32)} for _ in range(3)]
    params = model.init(jax.random.PRNGKey(0), batches[0]["tokens"][:, :-1])["params"]
    data = 8 // args.sequence
    config = zeroflax.Config(mesh=zeroflax.MeshConfig({"data": data, "sequence": args.sequence, "tensor": 1}),
                             zero_stage=args.stage, micro_batch_size=ROWS // data, persistence_threshold=0,
                             sequence_attention=args.attention)
    engine, state = zeroflax.initialize(next_token_loss(model), params, optax.adamw(1e-3, weight_decay=0.1), config)
    print(f"jax {jax.__version__}: {args.attention} attention, stage {args.stage}, data {data} x sequence "
          f"{args.sequence}, {args.steps} steps", flush=True)
    loss = float("nan")
    for step in range(args.steps):
        state, metrics = engine.step(state, batches[step % len(batches)])
        loss = float(metrics["loss"])
        if not np.isfinite(loss):
            raise SystemExit(f"step {step}: loss {loss}")
        if step % 10 == 0:
            print(f"step {step}", flush=True)
    print(f"{args.steps} steps, last loss {loss:.5f}")


if __name__ == "__main__":
    main()
