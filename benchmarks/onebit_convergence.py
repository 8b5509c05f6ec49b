"""1-bit Adam (or 1-bit LAMB) against AdamW on the main job (experiments/gpt_tiny_onebit.gin: the tiny GPT at
ZeRO stage 2 on 8 simulated CPU devices, warm-up 15% of the steps), both through `zeroflax train`, both at
stage 2. Writes the two curves (training loss, validation bits per byte) as JSON and as one figure.

    python benchmarks/onebit_convergence.py [--steps 600] [--seed 0] [--local_clip] [--optimizer onebit_lamb]
        [--lr 3e-3] [--weight_decay 0.1] [--adamw_from JSON] [--out docs/figures/onebit_convergence]

--seed sets Config.seed (initialisation and data order) for both runs; --local_clip gives the compressed
optimizer DeepSpeed's clipping rule in the compressed phase (each device clips its own local gradient);
--optimizer picks it (onebit_adam, the default, onebit_lamb or zero_one_adam), --lr its peak learning rate
(AdamW keeps the main job's 3e-3: LAMB's learning rate is a step relative to each layer's norm, not Adam's)
and --weight_decay its weight decay (AdamW keeps 0.1: 0/1 Adam's sync steps fold the decay into the momentum,
about 1 / (1 - b1) = 10x it, so 0.01 is its equivalent; docs/onebit_adam.md).

Each run takes about as long as `make run` (minutes on 2 cores).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def run(name: str, workdir: str, steps: int, optimizer: str, freeze: int, seed: int, local_clip: bool,
        lr: float | None = None, weight_decay: float | None = None) -> dict:
    params = {**({"TrainConfig.learning_rate": lr} if lr else {}),
              **({"TrainConfig.weight_decay": weight_decay} if weight_decay is not None else {}),"TrainConfig.steps": steps, "TrainConfig.eval_every": 100, "TrainConfig.workdir": repr(workdir),
              "TrainConfig.optimizer": repr(optimizer), "TrainConfig.freeze_step": freeze,
              "TrainConfig.sample_length": 0, "TrainConfig.tensorboard": False, "Config.seed": seed,
              "TrainConfig.onebit_local_clip": local_clip}
    args = [sys.executable, "-m", "zeroflax", "train", "--gin_file", "experiments/gpt_tiny_onebit.gin", "--no_progress"]
    for key, value in params.items():
        args += ["--gin_param", f"{key} = {value}"]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    return {"loss": [(r["step"], r["loss"]) for r in rows if "loss" in r],
            "val_bpb": [(r["step"], r["val_bits_per_byte"]) for r in rows if "val_bits_per_byte" in r],
            "stdout_tail": done.stdout[-600:]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--warmup_fraction", type=float, default=0.15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local_clip", action="store_true")
    parser.add_argument("--optimizer", default="onebit_adam", choices=("onebit_adam", "onebit_lamb", "zero_one_adam"))
    parser.add_argument("--lr", type=float, default=None, help="the compressed optimizer's peak learning rate")
    parser.add_argument("--weight_decay", type=float, default=None, help="the compressed optimizer's weight decay")
    parser.add_argument("--adamw_from", default=None, help="a JSON this script wrote with the same --steps and "
                        "--seed: reuse its AdamW curve (the run is deterministic) instead of running it again")
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "figures", "onebit_convergence"))
    args = parser.parse_args()
    freeze = round(args.warmup_fraction * args.steps)
    compressed = args.optimizer
    label = {"onebit_adam": "1-bit Adam", "onebit_lamb": "1-bit LAMB", "zero_one_adam": "0/1 Adam"}[compressed]
    results = {"steps": args.steps, "freeze_step": freeze, "seed": args.seed, "local_clip": args.local_clip,
               "optimizer": compressed, "lr": args.lr, "weight_decay": args.weight_decay}
    runs = (("adamw", "adamw", None, None), (compressed, compressed, args.lr, args.weight_decay))
    if args.adamw_from:  # the baseline is deterministic: reuse the recorded one
        recorded = json.load(open(args.adamw_from))
        if (recorded["steps"], recorded["seed"]) != (args.steps, args.seed):
            raise SystemExit(f"--adamw_from {args.adamw_from}: steps {recorded['steps']}, seed {recorded['seed']}; "
                             f"this run: {args.steps}, {args.seed}")
        results["adamw"] = recorded["adamw"]
        runs = runs[1:]
    with tempfile.TemporaryDirectory() as tmp:
        for name, optimizer, lr, weight_decay in runs:
            results[name] = run(name, os.path.join(tmp, name), args.steps, optimizer, freeze, args.seed,
                                args.local_clip, lr, weight_decay)
            print(name, "validation bits per byte:", results[name]["val_bpb"], flush=True)
    end_adamw, end_onebit = results["adamw"]["val_bpb"][-1][1], results[compressed]["val_bpb"][-1][1]
    results["relative_gap"] = end_onebit / end_adamw - 1
    print(f"final validation: adamw {end_adamw:.4f}, {label} {end_onebit:.4f} bits per byte "
          f"({100 * results['relative_gap']:+.2f}%)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(results, f, indent=1)

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, curve in (("adamw", "AdamW"), (compressed, f"{label} (warm-up {freeze} steps)")):
        steps, loss = zip(*results[name]["loss"])
        left.plot(steps, loss, label=curve)
        steps, bpb = zip(*results[name]["val_bpb"])
        right.plot(steps, bpb, marker="o", label=curve)
    for ax in (left, right):
        ax.axvline(freeze, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("step")
        ax.legend()
    left.set_ylabel("training loss (nats per byte)")
    right.set_ylabel("validation bits per byte")
    fig.suptitle(f"main job (tiny GPT, ZeRO-2, 8 simulated devices): {label} vs AdamW")
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=110)
    print("wrote", args.out + ".png")


if __name__ == "__main__":
    main()
