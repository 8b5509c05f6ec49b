"""Where 1-bit Adam's convergence goes on the main job: the compression, or the clipping of the compressed
phase? Runs experiments/gpt_tiny_onebit.gin (8 simulated devices) with the compressed phase's sync replaced,
for this process only, by a variant that takes one piece away (docs/onebit_adam.md, "Convergence"):

    exact-local     the momenta averaged exactly (pmean, no compression); each device clips its local
                    gradient by its own norm (DeepSpeed's rule)
    exact-noclip    the momenta averaged exactly; no clipping in the compressed phase
    exact-norm      compressed as built; every device's local gradient scaled by one factor from the mean
                    gradient's exact norm (a full all-reduce, so no saving: the sketch's reference)

    python benchmarks/onebit_clip_ablation.py MODE [--stage 0] [--steps 600]

Prints the validation bits per byte; each run takes about as long as `make run`. The built rules are run by
benchmarks/onebit_convergence.py (--local_clip for DeepSpeed's).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
MODES = ("exact-local", "exact-noclip", "exact-norm")


def patch(mode: str) -> None:
    import jax
    import jax.numpy as jnp

    import zeroflax.step.onebit_sync as onebit
    from zeroflax.optim.clipping import clip_to, global_norm

    built = onebit.OneBitSync.exchanged  # the compressed phase's exchange (OneBitSync.final calls it)

    def final(self, grads, mu_prev, sync, step):
        if mode == "exact-norm":  # the mean gradient's exact norm, then the built (sketch-free) compressed path
            norm = global_norm(jax.tree.map(lambda g: jax.lax.psum(g.astype(jnp.float32), self.axis), grads))
            grads = clip_to(grads, norm, self.grad_clip)
            return built(dataclasses.replace(self, grad_clip=0.0), grads, mu_prev, sync, step)
        if any(layout.zero_dim is not None for layout in jax.tree.leaves(self.layouts, is_leaf=lambda x: isinstance(x, onebit.Layout))):
            raise SystemExit(f"{mode} averages whole momenta: run it at --stage 0")
        s, n = self.settings, self.data_size
        local = jax.tree.map(lambda g: g.astype(jnp.float32) * n, grads)
        norm = global_norm(local)
        if mode == "exact-local" and self.grad_clip > 0:
            local = clip_to(local, norm, self.grad_clip)
        momentum = jax.tree.map(lambda m, g: jax.lax.pmean(s.b1 * m + (1 - s.b1) * g, self.axis), mu_prev, local)
        return momentum, onebit.SyncState(sync.leaves, jnp.asarray(step, jnp.int32)), jax.lax.pmean(norm, self.axis)

    onebit.OneBitSync.exchanged = final


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=MODES)
    parser.add_argument("--stage", type=int, default=0, help="Config.zero_stage (exact-* need 0)")
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    sys.path.insert(0, ROOT)
    patch(args.mode)
    from zeroflax.cli import main as cli

    with tempfile.TemporaryDirectory() as workdir:
        bindings = {"Config.zero_stage": args.stage, "TrainConfig.steps": args.steps, "TrainConfig.eval_every": 100,
                    "TrainConfig.freeze_step": round(0.15 * args.steps), "TrainConfig.workdir": repr(workdir),
                    "TrainConfig.sample_length": 0, "TrainConfig.tensorboard": False}
        argv = ["train", "--gin_file", os.path.join(ROOT, "experiments", "gpt_tiny_onebit.gin"), "--no_progress"]
        for key, value in bindings.items():
            argv += ["--gin_param", f"{key} = {value}"]
        if cli(argv):
            raise SystemExit(f"{args.mode}: the run failed")
        rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    curve = [(r["step"], round(r["val_bits_per_byte"], 4)) for r in rows if "val_bits_per_byte" in r]
    print(f"{args.mode} (stage {args.stage}): validation bits per byte {curve}")


if __name__ == "__main__":
    main()
