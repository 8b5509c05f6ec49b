"""The main job's GPT at sequence length 1024 with and without a sequence axis: the two loss curves.

Runs `zeroflax train` twice on 8 simulated CPU devices (the built-in corpus, ZeRO-3, fp32, 200 steps, the same
seed and global batch of 8 sequences): data 8, and data 2 x sequence 4 (Ulysses, Config.sequence_attention's
default). Then writes the per-step losses of both, their largest relative difference and a figure.

    python benchmarks/sequence_loss_curve.py --out docs/figures/sequence_axis_loss [--steps 200]

About 25 minutes on 2 CPU cores. Recorded in docs/parallelism.md ("Long sequences").
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
RUNS = {"data 8": ("{'data': -1, 'tensor': 1}", 1),
        "data 2 x sequence 4": ("{'data': -1, 'sequence': 4, 'tensor': 1}", 4)}


def train(workdir: str, axes: str, micro: int, steps: int, seq: int) -> list[dict]:
    bindings = {"TrainConfig.seq_len": seq, "GPTConfig.max_len": seq, "TrainConfig.steps": steps,
                "TrainConfig.warmup_steps": max(1, steps // 10), "TrainConfig.log_every": 10,
                "TrainConfig.eval_every": max(1, steps // 2), "TrainConfig.eval_batches": 2,
                "TrainConfig.checkpoint_every": steps, "TrainConfig.sample_length": 0,
                "MeshConfig.axes": axes, "Config.micro_batch_size": micro, "TrainConfig.workdir": repr(workdir)}
    args = [sys.executable, "-m", "zeroflax", "train", "--gin_file", os.path.join(ROOT, "experiments/gpt_tiny_zero3.gin"),
            "--no_progress", "--overwrite"]
    for key, value in bindings.items():
        args += ["--gin_param", f"{key} = {value}"]
    subprocess.run(args, check=True, cwd=ROOT)
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path without extension: writes .json and .png")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--workdir", default="/tmp/zeroflax_sequence_loss")
    parser.add_argument("--existing", default="", help="two workdirs (data 8, then sequence 4) of runs made with "
                        "these bindings: read their metrics instead of training again")
    args = parser.parse_args()
    curves = {}
    existing = args.existing.split(",") if args.existing else None
    for i, (name, (axes, micro)) in enumerate(RUNS.items()):
        if existing:
            with open(os.path.join(existing[i], "metrics.jsonl")) as f:
                rows = [json.loads(line) for line in f]
        else:
            rows = train(os.path.join(args.workdir, name.replace(" ", "_")), axes, micro, args.steps, args.seq_len)
        curves[name] = {"loss": {r["step"]: r["loss"] for r in rows if "loss" in r},
                        "val_bits_per_byte": {r["step"]: r["val_bits_per_byte"] for r in rows if "val_bits_per_byte" in r}}
    a, b = (curves[name]["loss"] for name in RUNS)
    worst = max(abs(a[s] - b[s]) / abs(a[s]) for s in a)
    print(f"{len(a)} logged steps; largest relative difference of the losses {worst:.2e}")
    for s in sorted(a):
        print(f"  step {s:>4}: {a[s]:.6f}  {b[s]:.6f}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"seq_len": args.seq_len, "steps": args.steps, "largest_relative_difference": worst,
                   "curves": curves}, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for (name, curve), style in zip(curves.items(), ("-", "--")):
        steps = sorted(curve["loss"])
        ax.plot(steps, [curve["loss"][s] for s in steps], style, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats)")
    ax.set_title(f"tiny GPT, sequence {args.seq_len}: largest difference {worst:.1e} (relative)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out + ".png", dpi=120)


if __name__ == "__main__":
    main()
