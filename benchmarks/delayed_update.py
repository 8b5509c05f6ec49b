"""The delayed parameter update (DPU) as an algorithm, without the engine: the main job's GPT, data,
optimizer and clipping in a plain single-device optax loop: exact; with each gradient applied one step
late (from step --start on; the start step applies nothing), DeepSpeed's DPU
(`delayed_update_prediction='none'`); the same with each gradient taken at the parameters plus the last
update ('extrapolate'); and at the parameters plus the next update as the secant through +-(the gradient
just applied) gives it, evaluated at the gradient just computed ('linear', the default). Prints
validation bits per byte at a few steps (about 5 minutes per variant on 2 cores).

    python benchmarks/delayed_update.py [--steps 600] [--lr 3e-3] [--start 50] [--variants exact,none,extrapolate,linear]

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


def run(variant: str, args) -> list[tuple[int, float]]:
    """variant: 'exact', or how a delayed gradient's parameters are predicted ('none', 'extrapolate',
    'linear'; OffloadOptimizerConfig.delayed_update_prediction)."""
    delayed = variant != "exact"
    tc = TrainConfig(steps=args.steps, learning_rate=args.lr, warmup_steps=min(50, args.steps - 1), seq_len=128)
    model = GPT(GPTConfig(vocab_size=256, num_layers=4, d_model=128, num_heads=4, max_len=128))
    train_tokens, val_tokens = train_val_split(load_tokens("builtin"), tc.val_fraction, min_tokens=tc.seq_len + 1)
    loader = TokenLoader(train_tokens, tc.seq_len, 32, seed=0)
    params = model.init(jax.random.PRNGKey(0), np.zeros((1, tc.seq_len), np.int32))["params"]
    adam = make_optimizer(tc)
    clip = lambda g: optax.clip_by_global_norm(1.0).update(g, None)[0]  # noqa: E731 (Config.grad_clip)
    state = adam.init(params)
    loss_fn = next_token_loss(model)
    grad_fn = jax.jit(jax.grad(lambda p, b: loss_fn(p, b, None)))

    @jax.jit
    def apply(params, state, grads):
        updates, state = adam.update(clip(grads), state, params)
        return optax.apply_updates(params, updates), state

    @jax.jit
    def linear_guess(params, state, applied, grads):
        """params + c + s clip(grads): the next update's secant through +-clip(applied) (the engine's rule)."""
        probe = clip(applied)
        up = adam.update(probe, state, params)[0]
        down = adam.update(jax.tree.map(jnp.negative, probe), state, params)[0]
        slope = jax.tree.map(lambda a, b, h: jnp.where(h != 0, (a - b) / jnp.where(h != 0, 2 * h, 1), 0), up, down, probe)
        return jax.tree.map(lambda p, a, b, d, g: p + (a + b) / 2 + d.astype(jnp.bfloat16).astype(jnp.float32) * g,
                            params, up, down, slope, clip(grads))

    val = np.stack([val_tokens[i * 129:(i + 1) * 129] for i in range(min(64, len(val_tokens) // 129))])
    eval_loss = jax.jit(lambda p: loss_fn(p, {"tokens": jnp.asarray(val)}, None))
    pending, curve, at = None, [], params
    for step in range(args.steps):
        grads = grad_fn(at, {"tokens": jnp.asarray(loader.next_batch()["tokens"])})
        before, applied = params, jax.tree.map(jnp.zeros_like, grads)
        if not delayed or step < args.start:
            params, state = apply(params, state, grads)
        else:
            if step > args.start:
                params, state = apply(params, state, pending)
                applied = pending
            pending = grads
        at = params
        if variant == "extrapolate" and step >= args.start:
            at = jax.tree.map(lambda new, old: new + (new - old), params, before)
        elif variant == "linear" and step >= args.start:
            at = linear_guess(params, state, applied, grads)
        if (step + 1) % (args.steps // 3) == 0:
            curve.append((step + 1, float(eval_loss(params)) / math.log(2)))
    return curve


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--start", type=int, default=50)
    parser.add_argument("--variants", default="exact,none,extrapolate,linear")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    if "exact" not in variants or not set(variants) <= {"exact", "none", "extrapolate", "linear"}:
        parser.error("--variants: 'exact' and any of none, extrapolate, linear")
    curves = {v: run(v, args) for v in variants}
    print(f"lr {args.lr}, delayed from step {args.start}: validation bits per byte (64 sequences)")
    for i, (step, exact) in enumerate(curves["exact"]):
        others = ", ".join(f"DPU '{v}' {curves[v][i][1]:.3f} ({curves[v][i][1] / exact - 1:+.1%})"
                           for v in variants if v != "exact")
        print(f"  step {step}: exact {exact:.3f}, {others}")


if __name__ == "__main__":
    main()
