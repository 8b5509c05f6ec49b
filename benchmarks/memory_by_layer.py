"""The memory explainer's tables and figures: the GPT of the main job and a 3D U-Net, ZeRO stages 0-3,
and the collectives of one step of a 2-layer MLP.

    python benchmarks/memory_by_layer.py [--out docs/figures] [--json memory_by_layer.json]

Compile-only, on 8 simulated CPU devices (about 2 minutes on 2 cores). For each model and stage it prints
the per-layer table (`zeroflax.memory_report(engine, state, batch, by="layer")`) and how much of memory_analysis'
total the rows explain, and writes one figure per model (one panel per stage) as PNG; then the MLP's
step timelines (`explain.step_timeline`) at stages 0, 2 and 3, as tables and one figure.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import zeroflax  # noqa: E402
from zeroflax.explain import format_timeline, plot_layers, plot_timeline, step_timeline  # noqa: E402

STAGES = (0, 1, 2, 3)


def gpt_reports(stages=STAGES):
    """The main job's GPT (experiments/gpt_tiny_zero3.gin) at each stage."""
    from zeroflax.command_flags import parse_gin
    from zeroflax.plan import abstract_gpt_engine
    from zeroflax.models.gpt import GPTConfig
    from zeroflax.train import TrainConfig, make_optimizer

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parse_gin([os.path.join(root, "experiments", "gpt_tiny_zero3.gin")], [])
    base, gpt, tc = zeroflax.Config(), GPTConfig(), TrainConfig()
    reports = []
    for stage in stages:
        engine, state, batch = abstract_gpt_engine(gpt, base.replace(zero_stage=stage), make_optimizer(tc), tc.seq_len)
        reports.append(zeroflax.memory_report(engine, state, batch, by="layer"))
    return reports


def unet_reports(stages=STAGES):
    """A 3D U-Net (channels 8, 16, 32; 16^3 volumes, 1 per device), fp32 Adam, remat 'none'."""
    from zeroflax.models.unet3d import UNet3D, UNet3DConfig, segmentation_loss

    model = UNet3D(UNet3DConfig(channels=(8, 16, 32), groups=4))
    size = 16
    sample = {"image": jax.ShapeDtypeStruct((1, size, size, size, 1), jnp.float32),
              "labels": jax.ShapeDtypeStruct((1, size, size, size), jnp.int32)}
    reports = []
    for stage in stages:
        config = zeroflax.Config(zero_stage=stage, micro_batch_size=1, persistence_threshold=64,
                                 mesh=zeroflax.MeshConfig({"data": -1, "tensor": 1}))
        engine, state = zeroflax.initialize(segmentation_loss(model), lambda rng, b: model.init(rng, b["image"])["params"],
                                            optax.adam(1e-3), config, sample_batch=sample, abstract=True)
        rows = engine.train_batch_size
        batch = {k: jax.ShapeDtypeStruct((rows,) + v.shape[1:], v.dtype) for k, v in sample.items()}
        reports.append(zeroflax.memory_report(engine, state, batch, by="layer"))
    return reports


def mlp_timelines(stages=(0, 2, 3)):
    """The collectives of one step of a 2-layer MLP (32 -> 64 -> 16, every leaf partitioned)."""
    import flax.linen as nn
    import numpy as np

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            kernel = lambda names: nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)
            x = jnp.tanh(nn.Dense(64, kernel_init=kernel(("embed", "mlp")), name="hidden")(x))
            return nn.Dense(16, kernel_init=kernel(("mlp", "embed")), name="out")(x)

    model = MLP()
    loss = lambda p, b, rng: jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)
    batch = {"x": np.zeros((16, 32), np.float32), "y": np.zeros((16, 16), np.float32)}
    timelines = {}
    for stage in stages:
        config = zeroflax.Config(zero_stage=stage, micro_batch_size=2, persistence_threshold=0,
                                 mesh=zeroflax.MeshConfig({"data": -1, "tensor": 1}))
        engine, state = zeroflax.initialize(loss, lambda rng, b: model.init(rng, b["x"])["params"], optax.adam(1e-2),
                                            config, sample_batch=batch, abstract=True)
        timelines[f"ZeRO stage {stage}"] = step_timeline(engine, state, batch)
    return timelines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/figures", help="directory for the PNG figures")
    parser.add_argument("--json", default=None, help="write every report as JSON here")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    results, worst = {}, 1.0
    for name, build, title in (("gpt", gpt_reports, "GPT of the main job (4 layers, d 128), 8 devices"),
                               ("unet3d", unet_reports, "3D U-Net (channels 8-16-32, 16^3 volumes), 8 devices")):
        reports = build()
        for report in reports:
            print(report, "\n")
            worst = min(worst, report.coverage)
        path = os.path.join(args.out, f"memory_by_layer_{name}.png")
        plot_layers(reports, path, title)
        print(f"wrote {path}")
        results[name] = [r.to_dict() for r in reports]
    print("| model | stage | memory_analysis total (MiB) | charged to rows (MiB) | coverage | live at peak (MiB) |")
    print("|---|---|---|---|---|---|")
    for name, reports in results.items():
        for r in reports:
            print(f"| {name} | {r['stage']} | {r['total'] / 2**20:.2f} | {r['charged'] / 2**20:.2f} | "
                  f"{r['coverage']:.2%} | {r['peak_live'] / 2**20:.2f} |")
    timelines = mlp_timelines()
    for label, transfers in timelines.items():
        print(label, "\n" + format_timeline(transfers), "\n")
    path = os.path.join(args.out, "step_timeline_mlp.png")
    plot_timeline(timelines, path, "One step of a 2-layer MLP on 8 devices: every collective, in schedule order")
    print(f"wrote {path}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if worst >= 0.95 else 1


if __name__ == "__main__":
    sys.exit(main())
