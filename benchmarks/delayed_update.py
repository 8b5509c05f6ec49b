"""The delayed parameter update (DPU) as an algorithm, without the engine: the main job's GPT, data,
optimizer and clipping in a plain single-device optax loop: exact; with each gradient applied one step
late (from step --start on; the start step applies nothing), DeepSpeed's DPU
(`delayed_update_prediction=False`); and the same with each gradient taken at the parameters plus the
last update (`OffloadOptimizerConfig(delayed_update=True)`'s default). Prints validation bits per byte
at a few steps (about 15 minutes on 2 cores).

    python benchmarks/delayed_update.py [--steps 600] [--lr 3e-3] [--start 50]

tests/test_offload.py checks that the engine's delayed update equals this loop's rule; this script
shows what the rule costs on the main job, so that the cost is not mistaken for the engine's.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from zeroflax.data.corpus import load_tokens  # noqa: E402
from zeroflax.data.loader import TokenLoader, train_val_split  # noqa: E402
from zeroflax.models.gpt import GPT, GPTConfig, next_token_loss  # noqa: E402
from zeroflax.train import TrainConfig, make_optimizer  # noqa: E402


def run(delayed: bool, args, predict: bool = False) -> list[tuple[int, float]]:
    """predict: the gradient is taken at the parameters plus the last applied update, a prediction of the
    parameters it will be applied to (one update later)."""
    tc = TrainConfig(steps=args.steps, learning_rate=args.lr, warmup_steps=min(50, args.steps - 1), seq_len=128)
    model = GPT(GPTConfig(vocab_size=256, num_layers=4, d_model=128, num_heads=4, max_len=128))
    train_tokens, val_tokens = train_val_split(load_tokens("builtin"), tc.val_fraction, min_tokens=tc.seq_len + 1)
    loader = TokenLoader(train_tokens, tc.seq_len, 32, seed=0)
    params = model.init(jax.random.PRNGKey(0), np.zeros((1, tc.seq_len), np.int32))["params"]
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), make_optimizer(tc))
    state = optimizer.init(params)
    loss_fn = next_token_loss(model)
    grad_fn = jax.jit(jax.grad(lambda p, b: loss_fn(p, b, None)))

    @jax.jit
    def apply(params, state, grads):
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    val = np.stack([val_tokens[i * 129:(i + 1) * 129] for i in range(min(64, len(val_tokens) // 129))])
    eval_loss = jax.jit(lambda p: loss_fn(p, {"tokens": jnp.asarray(val)}, None))
    pending, curve, last = None, [], None
    for step in range(args.steps):
        at = params if last is None else jax.tree.map(lambda p, d: p + d, params, last)
        grads = grad_fn(at, {"tokens": jnp.asarray(loader.next_batch()["tokens"])})
        before = params
        if not delayed or step < args.start:
            params, state = apply(params, state, grads)
        else:
            if step > args.start:
                params, state = apply(params, state, pending)
            pending = grads
        if predict and step >= args.start:
            last = jax.tree.map(lambda a, b: a - b, params, before)
        if (step + 1) % (args.steps // 3) == 0:
            curve.append((step + 1, float(eval_loss(params)) / math.log(2)))
    return curve


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--start", type=int, default=50)
    args = parser.parse_args(argv)
    exact, delayed = run(False, args), run(True, args)
    predicted = run(True, args, predict=True)
    print(f"lr {args.lr}, delayed from step {args.start}: validation bits per byte (64 sequences)")
    for (step, a), (_, b), (_, c) in zip(exact, delayed, predicted):
        print(f"  step {step}: exact {a:.3f}, delayed {b:.3f} ({b / a - 1:+.1%}), "
              f"delayed + prediction {c:.3f} ({c / a - 1:+.1%})")


if __name__ == "__main__":
    main()
