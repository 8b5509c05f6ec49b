"""ZeRO-3 for any model, measured (issue 7): per-device memory and collective bytes of one compiled
step on 8 simulated CPU devices, bf16 compute. Compile-only: nothing is trained.

    python benchmarks/zero3_models.py [--json runs/zero3_models.json] [--quick]

1. One model (12 residual blocks d 512 -> 2048 -> 512, Psi = 25.2M) written six ways: unscanned Linen
   (12 Block modules), Linen nn.scan (its stacked dimension named 'layers'), zeroflax.scan_layers, a
   plain jax.lax.scan over stacked parameters with its body a zeroflax.group, and as a user who never
   heard of zeroflax writes it (issue 42): a plain jax.lax.scan over a dict of arrays, no names, no
   group; a Linen nn.scan of plain nn.Dense named 'blocks', no logical names. Stage 3: XLA temporaries, gathered weights alive at the peak
   (schedule analysis) against the two largest groups, collective bytes against (2 b_c + b_g) Psi (N-1)/N.
   The unscanned model also at 24 blocks, and with prefetch off (max_live_parameters 0).
2. The 3D U-Net at 32^3 (channels 32-256) and a ResNet-18 (BatchNorm, 224x224 images, 8 per device; a
   model the groups were not tuned for): temporaries with remat none / full / dots at stage 0, and the
   U-Net at stage 3.
3. qwZ: all-gather bytes with int8 gathers against bf16 gathers, on the unscanned model.
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
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import linen as nn  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
import zeroflax  # noqa: E402
from models import DeepMLP, ScannedMLP, resnet18  # noqa: E402
from zeroflax.models.unet3d import UNet3D, UNet3DConfig, segmentation_loss  # noqa: E402

MiB = 2**20


def mean_square(apply):
    return lambda params, batch, rng: jnp.mean(jnp.square(apply(params, batch["x"]).astype(jnp.float32)))


def stacked_params(key, blocks, d, hidden):
    k1, k2 = jax.random.split(key)
    return {"w_in": jax.random.normal(k1, (blocks, d, hidden)) * d ** -0.5, "b_in": jnp.zeros((blocks, hidden)),
            "w_out": jax.random.normal(k2, (blocks, hidden, d)) * hidden ** -0.5, "b_out": jnp.zeros((blocks, d))}


STACKED_NAMES = {"w_in": ("layers", "embed", "mlp"), "b_in": ("layers", "mlp"),
                 "w_out": ("layers", "mlp", "embed"), "b_out": ("layers", "embed")}


def block_fn(p, x):
    return x + jax.nn.gelu(x @ p["w_in"] + p["b_in"]) @ p["w_out"] + p["b_out"]


def scan_layers_loss(params, batch, rng):
    x = zeroflax.scan_layers(lambda x, p: block_fn(p, x), batch["x"], params)
    return jnp.mean(jnp.square(x.astype(jnp.float32)))


def lax_scan_loss(params, batch, rng):
    x, _ = jax.lax.scan(lambda x, p: (zeroflax.group(block_fn)(p, x), None), batch["x"], params)
    return jnp.mean(jnp.square(x.astype(jnp.float32)))


def plain_scan_loss(params, batch, rng):
    x, _ = jax.lax.scan(lambda x, p: (block_fn(p, x), None), batch["x"], params)
    return jnp.mean(jnp.square(x.astype(jnp.float32)))


class _PlainBlock(nn.Module):
    d: int
    hidden: int

    @nn.compact
    def __call__(self, x, _):
        return x + nn.Dense(self.d)(jax.nn.gelu(nn.Dense(self.hidden)(x))), None


class UnnamedScannedMLP(nn.Module):
    """The stack as an nn.scan of plain nn.Dense, named 'blocks', with no logical names anywhere."""

    blocks: int
    d: int
    hidden: int
    out: int

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(_PlainBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.blocks)
        x, _ = stack(self.d, self.hidden, name="blocks")(x, None)
        return nn.Dense(self.out)(x)


def mlp_case(kind, blocks, d, hidden, seq, micro):
    batch = {"x": np.zeros((8 * micro, seq, d), np.float32)}
    if kind in ("linen", "nn.scan", "nn.scan unnamed"):
        model = {"linen": DeepMLP, "nn.scan": ScannedMLP, "nn.scan unnamed": UnnamedScannedMLP}[kind](
            blocks=blocks, d=d, hidden=hidden, out=d)
        # The head maps back to d so every way has the same parameter count up to one d x d matrix.
        init = lambda rng, b: model.init(rng, b["x"][:1])["params"]
        return mean_square(lambda p, x: model.apply({"params": p}, x)), init, batch, None
    if kind == "lax.scan plain":
        return plain_scan_loss, lambda rng, b: stacked_params(rng, blocks, d, hidden), batch, None
    loss = scan_layers_loss if kind == "scan_layers" else lax_scan_loss
    return loss, lambda rng, b: stacked_params(rng, blocks, d, hidden), batch, STACKED_NAMES


def measure(loss, init, batch, logical_axes=None, **config):
    settings = dict(zero_stage=3, precision="bf16", micro_batch_size=batch_rows(batch), persistence_threshold=4096,
                    prefetch_bucket_size=3_000_000)
    settings.update(config)
    engine, state = zeroflax.initialize(loss, init, optax.adamw(1e-4), zeroflax.Config(**settings),
                                        sample_batch=batch, logical_axes=logical_axes)
    memory, comm = zeroflax.memory_report(engine, state, batch), zeroflax.comm_report(engine, state, batch)
    largest = sorted(memory.groups.values(), reverse=True)[:2]
    compute = 2 if settings["precision"] != "fp32" else 4
    return {"psi": memory.num_params, "temp_mib": memory.temp / MiB, "gathered_peak_mib": memory.gathered_peak / MiB,
            "gathered_by_group_mib": {g: b / MiB for g, b in memory.gathered_by_group.items()},
            "two_largest_groups_mib": compute * sum(largest) / MiB, "groups": len(memory.groups),
            "gathered_on_entry": memory.gathered_on_entry, "comm_mib": comm.total_bytes / MiB,
            "comm_theory_mib": comm.theory_bytes / MiB, "comm_ratio": comm.ratio,
            "all_gather_mib": comm.by_kind.get("all-gather", {}).get("bytes", 0) / MiB,
            "all_gather_by_dtype_mib": {k: v / MiB for k, v in comm.by_dtype.get("all-gather", {}).items()}}


def batch_rows(batch) -> int:
    return len(next(iter(batch.values()))) // 8


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="runs/zero3_models.json")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, to check the script itself")
    args = parser.parse_args(argv)
    d, hidden, seq, micro, size, channels = (512, 2048, 128, 8, 32, (32, 64, 128, 256))
    if args.quick:
        d, hidden, seq, micro, size, channels = (64, 256, 16, 2, 8, (8, 16, 32))
    started = time.time()
    results = {"jax": jax.__version__, "devices": jax.device_count(), "mlp": {}, "remat": {}}

    def log(what):
        print(f"{what} ({time.time() - started:.0f} s)", flush=True)

    for kind in ("linen", "nn.scan", "scan_layers", "lax.scan+group", "lax.scan plain", "nn.scan unnamed"):
        loss, init, batch, names = mlp_case(kind, 12, d, hidden, seq, micro)
        results["mlp"][kind] = measure(loss, init, batch, names)
        log(f"mlp {kind}")
    loss, init, batch, names = mlp_case("linen", 24, d, hidden, seq, micro)
    results["mlp"]["linen_24"] = measure(loss, init, batch, names)
    loss, init, batch, names = mlp_case("linen", 12, d, hidden, seq, micro)
    results["mlp"]["linen_no_prefetch"] = measure(loss, init, batch, names, max_live_parameters=0)
    results["mlp"]["linen_qwz"] = measure(loss, init, batch, names, quantized_weights=True)
    log("mlp depth, prefetch, qwZ")

    unet = UNet3D(UNet3DConfig(channels=channels, in_channels=1, num_classes=3, groups=8))  # stride-2 convs down
    volume = {"image": np.zeros((8, size, size, size, 1), np.float32), "labels": np.zeros((8, size, size, size), np.int32)}
    unet_init = lambda rng, b: unet.init(jax.random.key(0, impl="unsafe_rbg"), b["image"][:1])["params"]
    resnet = resnet18(num_classes=10, num_filters=16 if args.quick else 64)
    # ImageNet-sized inputs, 8 per device: the scale a ResNet is trained at (compile-only, nothing allocated).
    side, per_device = (32, 2) if args.quick else (224, 8)
    images = {"image": np.zeros((8 * per_device, side, side, 3), np.float32), "label": np.zeros((8 * per_device,), np.int32)}

    def resnet_loss(params, batch, rng, state):
        logits, updates = resnet.apply({"params": params, **state}, batch["image"], mutable=["batch_stats"])
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"])), updates

    for remat in ("none", "full", "dots"):
        config = zeroflax.Config(zero_stage=0, precision="bf16", micro_batch_size=1, remat=remat,
                                 persistence_threshold=4096)
        engine, state = zeroflax.initialize(segmentation_loss(unet), unet_init, optax.adam(1e-4), config,
                                            sample_batch=volume)
        results["remat"][f"unet_{remat}"] = {"psi": zeroflax.memory_report(engine, state, volume).num_params,
                                              "temp_mib": zeroflax.memory_report(engine, state, volume).temp / MiB}
        config = config.replace(micro_batch_size=per_device)
        engine, state = zeroflax.initialize(
            resnet_loss, lambda rng, b: resnet.init(rng, b["image"][:1]), optax.adam(1e-4), config,
            sample_batch=images, model_state=("batch_stats",))
        report = zeroflax.memory_report(engine, state, images)
        results["remat"][f"resnet18_{remat}"] = {"psi": report.num_params, "temp_mib": report.temp / MiB}
        log(f"remat {remat}")
    results["unet_stage3"] = measure(segmentation_loss(unet), unet_init, volume, remat="full", micro_batch_size=1)
    log("unet stage 3")

    results["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                       cwd=ROOT).stdout.strip()
    print(markdown(results))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nwrote {args.json}")


def markdown(r) -> str:
    lines = ["| model (stage 3, bf16, N = 8) | Psi | groups | XLA temp MiB | gathered at peak MiB | two largest groups MiB "
             "| comm MiB | theory MiB | ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for kind, row in r["mlp"].items():
        lines.append(f"| {kind} | {row['psi']:,} | {row['groups']} | {row['temp_mib']:.1f} | {row['gathered_peak_mib']:.2f} "
                     f"| {row['two_largest_groups_mib']:.2f} | {row['comm_mib']:.1f} | {row['comm_theory_mib']:.1f} "
                     f"| {row['comm_ratio']:.3f} |")
    u = r["unet_stage3"]
    lines.append(f"| 3D U-Net | {u['psi']:,} | {u['groups']} | {u['temp_mib']:.1f} | {u['gathered_peak_mib']:.2f} "
                 f"| {u['two_largest_groups_mib']:.2f} | {u['comm_mib']:.1f} | {u['comm_theory_mib']:.1f} | {u['comm_ratio']:.3f} |")
    q, b = r["mlp"]["linen_qwz"], r["mlp"]["linen"]
    lines += ["", f"qwZ (int8 gathers, block {zeroflax.Config().quantization_block}): all-gather {q['all_gather_mib']:.1f} MiB vs bf16 {b['all_gather_mib']:.1f} "
              f"MiB, ratio {q['all_gather_mib'] / b['all_gather_mib']:.3f}; by dtype {q['all_gather_by_dtype_mib']}", ""]
    lines += ["| remat (stage 0, bf16) | Psi | none MiB | full MiB | dots MiB | full / none |", "|---|---|---|---|---|---|"]
    for model in ("unet", "resnet18"):
        t = {k: r["remat"][f"{model}_{k}"]["temp_mib"] for k in ("none", "full", "dots")}
        lines.append(f"| {model} | {r['remat'][f'{model}_none']['psi']:,} | {t['none']:.1f} | {t['full']:.1f} | {t['dots']:.1f} "
                     f"| {t['full'] / t['none']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
