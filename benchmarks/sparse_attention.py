"""CPU benchmark: block-sparse attention (XLA path) against dense attention, forward + backward.

What it measures, per sequence length L (batch 1, fp32, ``--heads`` heads, head_dim 64):

* memory: XLA's compiled temporary bytes of ``jax.grad`` of the attention
  (forward + backward, gradients for q, k and v), from
  ``jax.jit(...).lower(...).compile().memory_analysis().temp_size_in_bytes``.
  Deterministic. Sparse: ``zeroflax.kernels.sparse_attention(implementation='xla')``
  with a BigBird layout (block 16, 1 random + 3 sliding-window + 1 global
  block: a fixed number of blocks per row except the global row/column).
  Dense: ``jax.nn.dot_product_attention`` (XLA implementation, no mask).
* CPU time: median wall time of the jitted forward + backward (after a
  warm-up run), and the ratio sparse/dense measured in the same run. Absolute
  CPU times depend on the machine; only the ratio is meant to be compared.

Usage: ``python benchmarks/sparse_attention.py [--lengths 2048 4096 8192 16384]
[--repeats 3] [--json out.json] [--no-time]``. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from zeroflax.kernels import BigBirdSparsityConfig, sparse_attention  # noqa: E402


def fwd_bwd(attn):
    def loss(q, k, v):
        return jnp.sum(attn(q, k, v))
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def measure(length, heads, dim, repeats, do_time, cfg):
    layout = cfg.make_layout(length)
    fns = {
        "sparse": fwd_bwd(lambda q, k, v: sparse_attention(q, k, v, layout, causal=False, implementation="xla")),
        "dense": fwd_bwd(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla")),
    }
    x = jax.ShapeDtypeStruct((1, length, heads, dim), jnp.float32)
    row = dict(L=length, blocks_per_row=float(layout[0].sum(-1).mean()),
               density=float(layout.mean()))
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    args = [jax.random.normal(k, x.shape, x.dtype) for k in keys]
    for name, fn in fns.items():
        compiled = fn.lower(x, x, x).compile()
        row[f"{name}_temp_bytes"] = int(compiled.memory_analysis().temp_size_in_bytes)
        if do_time:
            jax.block_until_ready(compiled(*args))  # warm-up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                jax.block_until_ready(compiled(*args))
                times.append(time.perf_counter() - t0)
            row[f"{name}_s"] = statistics.median(times)
        del compiled
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-time", action="store_true", help="memory only (compile, do not run)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = ap.parse_args()

    cfg = BigBirdSparsityConfig(args.heads, block=16, num_random_blocks=1, num_sliding_window_blocks=3,
                                num_global_blocks=1)
    print(f"# sparse (XLA path, {cfg}) vs dense jax.nn.dot_product_attention; batch 1, fp32, "
          f"heads {args.heads}, head_dim {args.head_dim}, forward+backward; jax {jax.__version__}, "
          f"{jax.devices()[0].device_kind}")
    rows = []
    for length in args.lengths:
        rows.append(measure(length, args.heads, args.head_dim, args.repeats, not args.no_time, cfg))
        print(f"  done L={length}", file=sys.stderr, flush=True)

    mib = 2.0 ** 20
    head = ("| L | blocks/row | sparse temp MiB | x per doubling | dense temp MiB | x per doubling "
            "| sparse/dense temp |")
    if not args.no_time:
        head += " sparse s | dense s | sparse/dense time |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for i, r in enumerate(rows):
        prev = rows[i - 1] if i and rows[i - 1]["L"] * 2 == r["L"] else None
        grow = (lambda key: f"{r[key] / prev[key]:.2f}" if prev else "")
        line = (f"| {r['L']} | {r['blocks_per_row']:.2f} | {r['sparse_temp_bytes'] / mib:.1f} | "
                f"{grow('sparse_temp_bytes')} | {r['dense_temp_bytes'] / mib:.1f} | {grow('dense_temp_bytes')} | "
                f"{r['sparse_temp_bytes'] / r['dense_temp_bytes']:.4f} |")
        if not args.no_time:
            line += f" {r['sparse_s']:.3f} | {r['dense_s']:.3f} | {r['sparse_s'] / r['dense_s']:.3f} |"
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(config=repr(cfg), jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
