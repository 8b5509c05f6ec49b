"""GPU pass, part (b): 1-bit Adam's sign packing kernels (zeroflax/kernels/onebit_pack.py) on 100M elements.

* Shapes: float32 (R, C) = (shapes.ONEBIT_ROWS, shapes.ONEBIT_COLS) = 8 x 12.5M, and the same rows at
  shapes.ONEBIT_ALIGNED_COLS (C rounded up to a whole number of kernel blocks of 2048 columns: at 12.5M
  the Pallas path zero-pads its inputs and slices its outputs, one extra copy each, which is timed but
  not counted as bytes).
* Correct first: on fresh random inputs (with exact zeros in x + error), the Pallas kernels (impl='pallas';
  interpret mode off the GPU) against the jnp version (impl='xla'): pack_signs' bits and new error, and
  unpack_signs average=False / average=True of the same bits, compared bit for bit (float32 as uint32, so
  -0.0 != +0.0) on the device.
* Bytes each kernel must move at least (N = R * C elements):
      pack_signs                 read x, error (8N) + scale, write bits (N/8) and the new error (4N): 12.125 N
      unpack_signs average=False read bits (N/8) + scale, write (R, C) float32 (4N):                     4.125 N
      unpack_signs average=True  read bits (N/8) + scale, write (C,) float32 (4N / R):             N/8 + 4N/R
  GB/s = those bytes / the median time per call, and its fraction of the probe's copy ceiling.
* Timing: one jitted function makes K calls (K = 8 on the GPU), each on its own input set (so that nothing
  is shared between them, nothing is cached in L2 from the call before, and XLA cannot merge the jnp
  version's calls into one pass); time per call = the function's median time (passlib.time_batched) / K.

Standalone: python benchmarks/gpu/onebit_kernels.py [--smoke] [--probe-json probe.json] [--json onebit.json]
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import passlib  # noqa: E402
import shapes  # noqa: E402

KERNELS = ("pack_signs", "unpack_signs average=False", "unpack_signs average=True")


def min_bytes(kernel: str, rows: int, cols: int) -> float:
    n = rows * cols
    if kernel == "pack_signs":
        return 12.0 * n + n / 8 + 4 * rows
    if kernel == "unpack_signs average=False":
        return n / 8 + 4.0 * rows + 4.0 * n
    return n / 8 + 4.0 * rows + 4.0 * cols


def inputs(key, rows: int, cols: int):
    """x, error, scale: random normal, with exact zeros of y = x + error in every 97th column."""
    import jax
    import jax.numpy as jnp

    kx, ke, ks = jax.random.split(key, 3)
    x = jax.random.normal(kx, (rows, cols), jnp.float32)
    error = 0.5 * jax.random.normal(ke, (rows, cols), jnp.float32)
    error = error.at[:, ::97].set(-x[:, ::97])
    scale = jax.random.uniform(ks, (rows,), jnp.float32, 0.1, 2.0)
    return x, error, scale


def check(rows: int, cols: int, interpret: bool, seed: int) -> dict:
    """Bitwise equality of the Pallas kernels and the jnp version on fresh random inputs."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    from zeroflax.kernels.onebit_pack import pack_signs, unpack_signs

    x, error, scale = inputs(jax.random.PRNGKey(seed), rows, cols)

    def same(a, b):
        if a.dtype == jnp.float32:
            a, b = lax.bitcast_convert_type(a, jnp.uint32), lax.bitcast_convert_type(b, jnp.uint32)
        return bool(a.shape == b.shape and jnp.array_equal(a, b))

    out = {}
    bits_p, err_p = pack_signs(x, error, scale, impl="pallas", interpret=interpret)
    bits_x, err_x = pack_signs(x, error, scale, impl="xla")
    out["pack_signs"] = same(bits_p, bits_x) and same(err_p, err_x)
    del err_p, err_x
    for average in (False, True):
        a = unpack_signs(bits_x, scale, average=average, impl="pallas", interpret=interpret)
        b = unpack_signs(bits_x, scale, average=average, impl="xla")
        out[f"unpack_signs average={average}"] = same(a, b)
        del a, b
    return out


def timed_fn(kernel: str, impl: str, interpret: bool, calls: int):
    """jit of ``calls`` independent calls of the kernel, one per input set (the argument is a list)."""
    import jax

    from zeroflax.kernels.onebit_pack import pack_signs, unpack_signs

    if kernel == "pack_signs":
        def body(sets):
            return [pack_signs(x, e, s, impl=impl, interpret=interpret) for x, e, s in sets]
    else:
        average = kernel.endswith("True")

        def body(sets):
            return [unpack_signs(b, s, average=average, impl=impl, interpret=interpret) for b, s in sets]
    return jax.jit(body)


def run(smoke: bool, probe_json: str | None = None, deadline: float | None = None, on_row=None) -> dict:
    import jax

    from zeroflax.kernels.onebit_pack import pack_signs

    clock = passlib.Deadline(deadline)
    device = jax.devices()[0]
    interpret = device.platform != "gpu"
    ceilings = passlib.ceilings_from_probe(probe_json)
    rows_n = shapes.SMOKE_ONEBIT_ROWS if smoke else shapes.ONEBIT_ROWS
    shapes_run = [shapes.SMOKE_ONEBIT_COLS, shapes.SMOKE_ONEBIT_ALIGNED_COLS] if smoke else \
        [shapes.ONEBIT_COLS, shapes.ONEBIT_ALIGNED_COLS]
    shapes_run = list(dict.fromkeys(shapes_run))  # smoke: the two are equal
    calls = 2 if smoke else 8
    samples = 3 if smoke else 7
    meta = dict(part="onebit", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device_kind=device.device_kind, platform=device.platform, interpret=interpret, rows=rows_n,
                cols=shapes_run, calls_per_jit=calls, ceilings=ceilings, smoke=smoke,
                bytes_formula={k: v for k, v in zip(KERNELS, ("12.125 N (+ 4R)", "4.125 N (+ 4R)", "N/8 + 4C (+ 4R)"))})
    result = dict(meta=meta, checks=[], rows=[])
    last_cost = 0.0
    for seed, cols in enumerate(shapes_run):
        if not clock.allows(last_cost):
            result["rows"].append(dict(rows=rows_n, cols=cols, skipped=True,
                                       error=f"skipped: {clock.left():.0f} s left, the last shape took "
                                             f"{last_cost:.0f} s"))
            continue
        begin = time.perf_counter()
        try:
            equal = check(rows_n, cols, interpret, seed=100 + seed)
            result["checks"].append(dict(rows=rows_n, cols=cols, bitwise_equal=equal, all_equal=all(equal.values())))
        except Exception as e:  # noqa: BLE001 - still time the kernels; the part fails at its end
            traceback.print_exc()
            result["checks"].append(dict(rows=rows_n, cols=cols, bitwise_equal={}, all_equal=False,
                                         error=passlib.error_text(e)))
        if on_row:
            on_row(result)
        sets = []
        for i in range(calls):
            x, e, s = inputs(jax.random.PRNGKey(1000 * seed + i), rows_n, cols)
            sets.append((x, e, s))
        bits_sets = [(pack_signs(x, e, s, impl="xla")[0], s) for x, e, s in sets]
        for kernel in KERNELS:
            for impl in ("pallas", "xla"):
                row = dict(kernel=kernel, impl=impl + (" (interpret)" if impl == "pallas" and interpret else ""),
                           rows=rows_n, cols=cols, elements=rows_n * cols, bytes=min_bytes(kernel, rows_n, cols),
                           padded=cols % 2048 != 0)
                try:
                    fn = timed_fn(kernel, impl, interpret, calls)
                    args = (sets,) if kernel == "pack_signs" else (bits_sets,)
                    t = passlib.time_batched(fn, args, samples=samples, min_sample_s=0.0 if smoke else 0.02)
                    row.update(median_s=t["median_s"] / calls, min_s=t["min_s"] / calls,
                               calls_per_sample=t["calls_per_sample"], compile_and_first_s=t["first_call_s"])
                    row["gbs"] = row["bytes"] / row["median_s"] / 1e9
                    if "copy_gbs" in ceilings:
                        row["of_copy_ceiling"] = row["gbs"] / ceilings["copy_gbs"]
                except Exception as e:  # noqa: BLE001 - one kernel failing must not lose the others
                    traceback.print_exc()
                    row["error"] = passlib.error_text(e)
                result["rows"].append(row)
                print(row, flush=True)
                if on_row:
                    on_row(result)
        del sets, bits_sets
        last_cost = time.perf_counter() - begin
    meta["imported_gin_or_tensorboardx"] = passlib.blocked_modules()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, Pallas interpret mode (CPU)")
    ap.add_argument("--probe-json", default=None, help="the probe's JSON (part a): the copy ceiling")
    ap.add_argument("--json", default="onebit_kernels.json")
    args = ap.parse_args(argv)
    result = run(args.smoke, args.probe_json, on_row=lambda r: passlib.write_json(args.json, r))
    passlib.write_json(args.json, result)
    print(result["checks"])
    return 0 if all(c["all_equal"] for c in result["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
