"""GPU benchmark for issue 7 (one H200; one GPU gathers nothing at N = 1, so it measures what one GPU can):

1. The 3D U-Net (zeroflax.models.unet3d, channels 32-256, bf16, batch --batch) trained through
   zeroflax.initialize at stage 0 with remat 'none' and 'full': median step time (device-synchronised,
   after 2 warm-up steps) and peak memory (memory_analysis: arguments + temporaries + unaliased outputs;
   and the device's peak_bytes_in_use where the backend reports it).
2. qwZ's int8 block quantize + dequantize (zeroflax.sharding.layers.quantize_blocks/dequantize_blocks,
   block 256) on a bf16 tensor of --elements elements: GB/s of bytes read + written, next to the
   measured copy bandwidth of the same tensor (x * 1 through XLA, read + write).

Needs jax, flax, optax, numpy and zeroflax (no gin-config, no tensorboardX). Usage on the GPU machine:
    python benchmarks/gpu/zero3_unet.py --json zero3_unet.json
Smoke run on a CPU: --quick (a 16^3 U-Net, 2^20 elements).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import zeroflax  # noqa: E402
from zeroflax.models.unet3d import UNet3D, UNet3DConfig, segmentation_loss, synthetic_volumes  # noqa: E402
from zeroflax.sharding.layers import dequantize_blocks, quantize_blocks  # noqa: E402


def timed(fn, steps):
    """Median seconds of fn() (which returns something to block on) over `steps` runs, after 2 warm-ups."""
    for _ in range(2):
        jax.block_until_ready(fn())
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def unet_rows(size, batch, steps):
    model = UNet3D(UNet3DConfig(channels=(32, 64, 128, 256), in_channels=1, num_classes=3, groups=8,
                                downsample="pool"))
    data = synthetic_volumes(np.random.default_rng(0), batch, size)
    init = lambda rng, b: model.init(rng, b["image"][:1])["params"]
    rows = []
    for remat in ("none", "full"):
        config = zeroflax.Config(zero_stage=0, precision="bf16", micro_batch_size=batch, remat=remat,
                                 mesh=zeroflax.MeshConfig({"data": 1, "tensor": 1}))
        engine, state = zeroflax.initialize(segmentation_loss(model), init, optax.adam(1e-4), config,
                                            sample_batch=data, devices=jax.devices()[:1])
        report = zeroflax.memory_report(engine, state, data)
        holder = {"state": state}

        def step():
            holder["state"], metrics = engine.step(holder["state"], data)
            return metrics["loss"]

        seconds = timed(step, steps)
        stats = jax.devices()[0].memory_stats() or {}
        rows.append({"remat": remat, "volume": size, "batch": batch, "psi": report.num_params,
                     "step_ms": seconds * 1e3, "temp_mib": report.temp / 2**20,
                     "peak_estimate_mib": report.peak_estimate / 2**20,
                     "peak_bytes_in_use_mib": stats.get("peak_bytes_in_use", 0) / 2**20})
        print(rows[-1], flush=True)
    return rows


def quantization_row(elements, steps):
    x = jax.random.normal(jax.random.PRNGKey(0), (elements,), jnp.bfloat16)
    roundtrip = jax.jit(lambda v: dequantize_blocks(*quantize_blocks(v, 256), v.shape, v.dtype))
    copy = jax.jit(lambda v: v * jnp.asarray(1, v.dtype))
    t_q, t_copy = timed(lambda: roundtrip(x), steps), timed(lambda: copy(x), steps)
    # quantize reads 2 B/elt and writes 1 B + scales; dequantize reads those and writes 2 B.
    moved = elements * (2 + 1 + 1 + 2) + 2 * 4 * elements / 256
    row = {"elements": elements, "roundtrip_ms": t_q * 1e3, "roundtrip_gb_s": moved / t_q / 1e9,
           "copy_ms": t_copy * 1e3, "copy_gb_s": 4 * elements / t_copy / 1e9}
    print(row, flush=True)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=64, help="volume edge (D = H = W)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--elements", type=int, default=2**28)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--json", default="zero3_unet.json")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.batch, args.elements, args.steps = 16, 1, 2**20, 2
    results = {"device": str(jax.devices()[0]), "jax": jax.__version__,
               "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        cwd=ROOT).stdout.strip(),
               "unet": unet_rows(args.size, args.batch, args.steps),
               "quantization": quantization_row(args.elements, args.steps)}
    print("| remat | volume | batch | step ms | temp MiB | peak estimate MiB | peak in use MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in results["unet"]:
        print(f"| {r['remat']} | {r['volume']}^3 | {r['batch']} | {r['step_ms']:.1f} | {r['temp_mib']:.0f} | "
              f"{r['peak_estimate_mib']:.0f} | {r['peak_bytes_in_use_mib']:.0f} |")
    q = results["quantization"]
    print(f"\nint8 quantize+dequantize of {q['elements']:,} bf16 elements: {q['roundtrip_gb_s']:.0f} GB/s "
          f"({q['roundtrip_ms']:.2f} ms); copy: {q['copy_gb_s']:.0f} GB/s ({q['copy_ms']:.2f} ms)")
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
