"""GPU pass, part (c): host <-> device bandwidth, pinned and pageable host memory.

* Host memory as jax memory kinds on the device: 'pinned_host' (page-locked: the DMA engines read and
  write it directly; where ZeRO-Offload keeps its state) and 'unpinned_host' (pageable: staged through a
  pinned bounce buffer). Plus plain numpy arrays (pageable memory outside jax): jax.device_put(numpy) and
  numpy.asarray(device array).
* Per memory kind and size (shapes.HOST_TRANSFER_BYTES: 256 MiB and 1 GiB of float32):
      host -> device   jax.device_put(a_host, SingleDeviceSharding(dev, memory_kind='device'))
      device -> host   jax.device_put(b_dev, SingleDeviceSharding(dev, memory_kind=kind))
      both at once     the two dispatched together (each is asynchronous), then both waited for:
                       GB/s = (bytes up + bytes down) / the time until both are done
  and, for pinned memory, the same transfers inside one jitted program ("in jit": the form the
  offloaded optimizer step uses; XLA may overlap the two directions there).
* Timing: one warm-up transfer, then the median of several (each blocked on); fresh destination
  arrays every time. GB/s = bytes / seconds / 1e9.

Standalone: python benchmarks/gpu/host_bandwidth.py [--smoke] [--json host_bandwidth.json]
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import passlib  # noqa: E402
import shapes  # noqa: E402


def _median_time(make, repeats: int) -> tuple[float, float]:
    """(median, min) seconds of ``make()`` (which returns what to block on), after one warm-up call:
    each sample is one transfer, waited for."""
    t = passlib.time_batched(make, (), samples=repeats, min_sample_s=0.0, warmup=0)
    return t["median_s"], t["min_s"]


def run(smoke: bool, deadline: float | None = None, on_row=None) -> dict:
    import jax
    import numpy as np
    from jax.sharding import SingleDeviceSharding

    clock = passlib.Deadline(deadline)
    device = jax.devices()[0]
    kinds = [m.kind for m in device.addressable_memories()]
    on_device = SingleDeviceSharding(device, memory_kind="device")
    sizes = shapes.SMOKE_HOST_TRANSFER_BYTES if smoke else shapes.HOST_TRANSFER_BYTES
    repeats = 3 if smoke else 5
    meta = dict(part="host_bandwidth", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device_kind=device.device_kind, platform=device.platform, memory_kinds=kinds, sizes=list(sizes),
                repeats=repeats, smoke=smoke,
                pinned_pool_env=os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"))
    result = dict(meta=meta, rows=[])
    rng = np.random.default_rng(0)

    def record(row):
        if "median_s" in row:
            row["gbs"] = row["bytes"] / row["median_s"] / 1e9
        result["rows"].append(row)
        print(row, flush=True)
        if on_row:
            on_row(result)

    for nbytes in sizes:
        n = nbytes // 4
        a_np = rng.random(n, dtype=np.float32)  # uniform: a few times faster to draw than normal
        b_np = rng.random(n, dtype=np.float32)
        for kind in ("pinned_host", "unpinned_host", "numpy"):
            base = dict(memory=kind, mib=nbytes / 2**20)
            if not clock.allows(5.0):
                record(dict(base, direction="all", error=f"skipped: {clock.left():.0f} s left"))
                continue
            if kind != "numpy" and kind not in kinds:
                record(dict(base, direction="all", error=f"memory kind {kind!r} not on this device ({kinds})"))
                continue
            try:
                if kind == "numpy":
                    b_dev = jax.device_put(b_np, on_device)
                    bump = jax.jit(lambda x: x + 1.0)

                    def h2d():
                        return jax.device_put(a_np, on_device)

                    # numpy.asarray caches a device array's host copy: a fresh device array every time
                    # (made, and waited for, before the clock starts).
                    def d2h_timed(repeats=repeats):
                        times = []
                        for i in range(repeats + 1):
                            fresh = jax.block_until_ready(bump(b_dev))
                            t = time.perf_counter()
                            np.asarray(fresh)
                            if i:
                                times.append(time.perf_counter() - t)
                        return statistics.median(times), min(times)

                    med, low = _median_time(h2d, repeats)
                    record(dict(base, direction="host->device", how="jax.device_put(numpy)", bytes=nbytes,
                                median_s=med, min_s=low))
                    med, low = d2h_timed()
                    record(dict(base, direction="device->host", how="numpy.asarray(device array)", bytes=nbytes,
                                median_s=med, min_s=low))
                    b_dev = None
                    continue
                on_host = SingleDeviceSharding(device, memory_kind=kind)
                a_host = jax.block_until_ready(jax.device_put(a_np, on_host))
                b_dev = jax.block_until_ready(jax.device_put(b_np, on_device))
                assert a_host.sharding.memory_kind == kind, a_host.sharding
                cases = [
                    ("host->device", "device_put", nbytes, lambda: jax.device_put(a_host, on_device)),
                    ("device->host", "device_put", nbytes, lambda: jax.device_put(b_dev, on_host)),
                    ("both at once", "device_put", 2 * nbytes,
                     lambda: (jax.device_put(a_host, on_device), jax.device_put(b_dev, on_host))),
                ]
                if kind == "pinned_host":
                    up = jax.jit(lambda a: jax.device_put(a, on_device), out_shardings=on_device)
                    down = jax.jit(lambda b: jax.device_put(b, on_host), out_shardings=on_host)
                    both = jax.jit(lambda a, b: (jax.device_put(a, on_device), jax.device_put(b, on_host)),
                                   out_shardings=(on_device, on_host))
                    cases += [("host->device", "in jit", nbytes, lambda: up(a_host)),
                              ("device->host", "in jit", nbytes, lambda: down(b_dev)),
                              ("both at once", "in jit", 2 * nbytes, lambda: both(a_host, b_dev))]
                for direction, how, moved, make in cases:
                    row = dict(base, direction=direction, how=how, bytes=moved)
                    try:
                        med, low = _median_time(make, repeats)
                        row.update(median_s=med, min_s=low)
                        out = make()
                        kinds_out = [x.sharding.memory_kind for x in jax.tree.leaves(out)]
                        jax.block_until_ready(out)
                        del out
                        row["result_memory_kinds"] = kinds_out
                    except Exception as e:  # noqa: BLE001 - keep the other transfers
                        traceback.print_exc()
                        row["error"] = passlib.error_text(e)
                    record(row)
                a_host = b_dev = None  # freed before the next kind's arrays
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                record(dict(base, direction="all", error=passlib.error_text(e)))
        a_np = b_np = None
    meta["imported_gin_or_tensorboardx"] = passlib.blocked_modules()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="small transfers (CPU)")
    ap.add_argument("--json", default="host_bandwidth.json")
    args = ap.parse_args(argv)
    result = run(args.smoke, on_row=lambda r: passlib.write_json(args.json, r))
    passlib.write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
