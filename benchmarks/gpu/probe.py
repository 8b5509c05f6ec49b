"""GPU pass, part (a): the machine, and the two ceilings every other figure of the pass is divided by.

* Versions (python, jax, jaxlib, flax, optax, numpy), the device kind and count, the device's memory
  limit, the host's memory, the commit (read from .git without a git binary; else env COMMIT).
* The matrix ceiling: a bf16 product N x N x N (shapes.MATMUL_N = 8192: 2 N^3 = 1.10 TFLOP) on random
  normal data, two input sets used in turn; TFLOP/s = 2 N^3 / the median time per product.
* The memory ceiling: a device-to-device copy of shapes.COPY_BYTES (2 GiB of float32), counted as bytes
  read plus bytes written (2 x 2 GiB per copy), measured two ways: `jnp.copy` (XLA's copy) and the
  elementwise `x + 1` (a kernel that reads and writes each element once, as the pass's memory-bound
  kernels do). The ceiling is the faster of the two.
* Timing (passlib.time_batched): compile and two warm-up calls, then 10 samples of back-to-back calls
  (about 30 ms each, one block_until_ready per sample); the median per call.

Standalone: python benchmarks/gpu/probe.py [--smoke] [--json probe.json]
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import passlib  # noqa: E402
import shapes  # noqa: E402


def versions() -> dict:
    out = dict(python=platform.python_version())
    for name in ("jax", "jaxlib", "flax", "optax", "numpy", "orbax-checkpoint", "chex"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    for plugin in ("jax-cuda13-plugin", "jax-cuda12-plugin", "jax-cuda13-pjrt", "jax-cuda12-pjrt"):
        try:
            out[plugin] = importlib.metadata.version(plugin)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def run(smoke: bool, samples: int = 10, sample_s: float = 0.03) -> dict:
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    commit, commit_source = passlib.read_commit()
    meta = dict(part="probe", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                commit=commit, commit_source=commit_source, versions=versions(), platform=device.platform,
                device_kind=device.device_kind, device_count=jax.device_count(),
                devices=[d.device_kind for d in jax.devices()],
                device_memory_limit=(stats or {}).get("bytes_limit"), host_memory=passlib.host_memory(), smoke=smoke,
                xla_flags=os.environ.get("XLA_FLAGS"), jax_platforms=os.environ.get("JAX_PLATFORMS"))
    rows = []

    n = shapes.SMOKE_MATMUL_N if smoke else shapes.MATMUL_N
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    mats = [jax.random.normal(k, (n, n), jnp.bfloat16) for k in keys]
    matmul = jax.jit(lambda a, b: a @ b)
    sets = [(mats[0], mats[1]), (mats[2], mats[3])]
    timings = [passlib.time_batched(matmul, pair, samples=samples // 2, min_sample_s=sample_s) for pair in sets]
    median = sorted(t["median_s"] for t in timings)[len(timings) // 2]  # the slower set's median (2 sets)
    flop = 2.0 * n ** 3
    rows.append(dict(name=f"bf16 matmul {n}^3", n=n, flop=flop, median_s=median,
                     per_set_median_s=[t["median_s"] for t in timings], calls_per_sample=timings[0]["calls_per_sample"],
                     tflops=flop / median / 1e12))
    del mats, sets

    nbytes = shapes.SMOKE_COPY_BYTES if smoke else shapes.COPY_BYTES
    x = jax.random.normal(jax.random.PRNGKey(1), (nbytes // 4,), jnp.float32)
    for name, fn in (("copy (jnp.copy)", jax.jit(lambda a: jnp.copy(a))),
                     ("copy (x + 1, elementwise)", jax.jit(lambda a: a + 1.0))):
        t = passlib.time_batched(fn, (x,), samples=samples, min_sample_s=sample_s)
        moved = 2.0 * nbytes
        rows.append(dict(name=name, bytes=nbytes, bytes_moved=moved, median_s=t["median_s"],
                         calls_per_sample=t["calls_per_sample"], gbs=moved / t["median_s"] / 1e9))
    del x

    copies = sorted(r["gbs"] for r in rows[1:])
    ceilings = dict(matmul_tflops=rows[0]["tflops"], copy_gbs=copies[-1],
                    datasheet_bf16_tflops=passlib.DATASHEET_BF16_TFLOPS)
    if copies[-1] > 2 * copies[0]:  # one of them did not move the bytes (e.g. a copy XLA elided): not a ceiling
        ceilings["copy_gbs"] = copies[0]
        ceilings["note"] = f"the two copies differ by {copies[-1] / copies[0]:.1f}x: the slower one is the ceiling"
    ceilings["matmul_of_datasheet"] = ceilings["matmul_tflops"] / passlib.DATASHEET_BF16_TFLOPS
    meta["imported_gin_or_tensorboardx"] = passlib.blocked_modules()
    return dict(meta=meta, ceilings=ceilings, rows=rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU)")
    ap.add_argument("--json", default="probe.json")
    args = ap.parse_args(argv)
    result = run(args.smoke)
    passlib.write_json(args.json, result)
    for r in result["rows"]:
        print(r)
    print(result["ceilings"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
