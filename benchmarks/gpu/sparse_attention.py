"""GPU benchmark: block-sparse attention (Pallas kernel) time and TFLOP/s against density.

What it measures (run on a GPU machine; needs only jax, numpy and zeroflax):

* For bf16 q, k, v of shape [batch, L, heads, head_dim] with head_dim 64 and 128,
  L from 2k to 32k (batch * L = ``--tokens``, default 32k tokens), and layouts
  of several densities (bidirectional sliding-window bands of LocalSlidingWindow
  blocks, plus BigBird defaults and the dense layout), the median wall time
  of the jitted forward and of forward+backward of
  ``zeroflax.kernels.sparse_attention(implementation='pallas')``.
* TFLOP/s counting only the computed blocks: forward ``4 * nnz_blocks * block^2 *
  head_dim`` per (batch, head) (QK^T and PV), forward+backward 3.5x that
  (dq, dk, dv add five block matmuls: S is recomputed, dP, dV, dK, dQ).
* Next to it, jax's dense attention ``jax.nn.dot_product_attention`` with
  implementation='cudnn' where available (else 'xla'), timed the same way;
  its FLOPs count the full L x L product.
* Before timing, a small correctness check of the Pallas kernel (forward and the
  three gradients, causal, key padding) against the dense masked reference.

Timing: compile and two warm-up calls, then ``--iters`` samples of back-to-back
calls (enough calls to fill ``--min-sample-ms``, default 20 ms, dispatched
asynchronously and waited for once: launch and sync overheads amortized); the
median time per call is reported. Output: a markdown table on stdout and a JSON
file (``--json``, default sparse_attention_gpu.json).

The GPU pass (benchmarks/gpu/pass.sh, part d; pass_parts.py) imports the
functions below (correctness_check, check_passes, cudnn_available, pass_layouts,
random_inputs, measure_case) and runs them at the shapes of shapes.py.

Usage: ``python benchmarks/gpu/sparse_attention.py [--quick] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import passlib  # noqa: E402
from zeroflax import kernels  # noqa: E402

# The correctness check passes when every relative error (max |pallas - reference| / max |reference|, over
# the output and the three gradients) is finite and under these. On the GPU a float32 dot runs as tf32
# (~1e-3 here); bf16 operands land at a few 1e-3 (measured in interpret mode: up to 5.8e-3).
CHECK_TOLERANCE = {"float32": 1e-2, "bfloat16": 3e-2}


def median_time(fn, args, iters, min_sample_s=0.0):
    """Median seconds per call: compile, 2 warm-up calls, then ``iters`` samples of back-to-back calls
    (as many as fill ``min_sample_s``; 1 when it is 0), each sample waited for once."""
    return passlib.time_batched(fn, args, samples=iters, min_sample_s=min_sample_s)["median_s"]


def fwd_and_fwdbwd(attn):
    fwd = jax.jit(attn)

    def loss(q, k, v, do):
        return jnp.sum((attn(q, k, v) * do).astype(jnp.float32))
    fwdbwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return fwd, fwdbwd


def layouts(length, block, quick):
    """(name, layout) pairs over a range of densities."""
    nb = length // block
    out = []
    for window in ([3, 15] if quick else [1, 3, 7, 15, 31, 63]):
        if window <= nb:
            cfg = kernels.LocalSlidingWindowSparsityConfig(1, block=block, num_sliding_window_blocks=window,
                                                           attention="bidirectional")
            out.append((f"window{window}", cfg.make_layout(length)))
    out.append(("bigbird", kernels.BigBirdSparsityConfig(1, block=block).make_layout(length)))
    if not quick or length <= 8192:
        out.append(("dense_layout", kernels.DenseSparsityConfig(1, block=block).make_layout(length)))
    return out


def correctness_check():
    b, length, h, d = 2, 256, 2, 64
    ks = jax.random.split(jax.random.PRNGKey(1), 4)
    q, k, v, do = (jax.random.normal(x, (b, length, h, d), jnp.float32) for x in ks)
    layout = kernels.BigBirdSparsityConfig(h, block=16, different_layout_per_head=True,
                                           attention="unidirectional").make_layout(length)
    layout[0, 5] = 0
    kpm = np.arange(length)[None] < np.array([[200], [256]])
    errs = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        res = {}
        for impl in ("pallas", "reference"):
            def loss(q, k, v):
                o = kernels.sparse_attention(q, k, v, layout, causal=True, key_padding_mask=kpm,
                                             implementation=impl)
                return jnp.sum(o.astype(jnp.float32) * do), o
            (_, o), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
                *(x.astype(dtype) for x in (q, k, v)))
            res[impl] = [np.asarray(x, np.float32) for x in (o, *g)]
        errs[jnp.dtype(dtype).name] = [
            float(np.abs(a - r).max() / np.abs(r).max()) if np.isfinite(a).all() else float("nan")
            for a, r in zip(res["pallas"], res["reference"])]
    return errs


def check_passes(errs) -> bool:
    """correctness_check's result: every error finite and under CHECK_TOLERANCE."""
    return all(np.isfinite(e) and e <= CHECK_TOLERANCE[dtype] for dtype, values in errs.items() for e in values)


def cudnn_available(head_dim=64):
    """(True, None) if jax.nn.dot_product_attention(implementation='cudnn') runs here, else (False, why)."""
    try:
        x = jax.random.normal(jax.random.PRNGKey(0), (1, 256, 2, head_dim), jnp.float32).astype(jnp.bfloat16)
        jax.block_until_ready(jax.jit(lambda q: jax.nn.dot_product_attention(q, q, q, implementation="cudnn"))(x))
        return True, None
    except Exception as e:  # noqa: BLE001 - no GPU, no cuDNN, or an unsupported shape
        return False, passlib.error_text(e)


def dense_impl():
    return "cudnn" if cudnn_available()[0] else "xla"


def pass_layouts(length, window, block):
    """The pass's layouts at one length: the bidirectional sliding window of ``window`` blocks (~10%
    density at shapes.SPARSE_WINDOWS) and BigBird's defaults."""
    cfg = kernels.LocalSlidingWindowSparsityConfig(1, block=block, num_sliding_window_blocks=window,
                                                   attention="bidirectional")
    return [(f"window{window}", cfg.make_layout(length)),
            ("bigbird", kernels.BigBirdSparsityConfig(1, block=block).make_layout(length))]


def random_inputs(shape, seed=0):
    """q, k, v, do: random normal bf16 of ``shape`` ([batch, L, heads, head_dim])."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    return tuple(jax.random.normal(x, shape, jnp.float32).astype(jnp.bfloat16) for x in ks)


def sparse_fn(layout, implementation="pallas"):
    return lambda q, k, v: kernels.sparse_attention(q, k, v, layout, causal=False, implementation=implementation)


def dense_fn(implementation):
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation=implementation)


def measure_case(name, block, layout, attn, inputs, iters, min_sample_s=0.0):
    """One row: the median time of ``attn``'s forward and forward+backward on ``inputs`` (q, k, v, do),
    and TFLOP/s of the computed blocks (dense: the full L x L; forward+backward 3.5x the forward)."""
    q, k, v, do = inputs
    batch, length, heads, d = q.shape
    row = dict(kind=name, block=block, L=length, batch=batch, heads=heads, head_dim=d)
    if layout is None:
        density, flops = 1.0, 4.0 * length * length * d * batch * heads
    else:
        layout = np.asarray(layout)
        density = float(layout.mean())
        blocks = layout.sum() if layout.ndim == 3 and layout.shape[0] == heads > 1 else layout.sum() * heads
        flops = 4.0 * float(blocks) * block * block * d * batch
    row.update(density=density, fwd_flop=flops)
    try:
        fwd, fwdbwd = fwd_and_fwdbwd(attn)
        row["fwd_s"] = median_time(fwd, (q, k, v), iters, min_sample_s)
        row["fwdbwd_s"] = median_time(fwdbwd, (q, k, v, do), iters, min_sample_s)
        row["fwd_tflops"] = flops / row["fwd_s"] / 1e12
        row["fwdbwd_tflops"] = 3.5 * flops / row["fwdbwd_s"] / 1e12
    except Exception as e:  # keep going: record and report
        row["error"] = passlib.error_text(e)
        traceback.print_exc(limit=2)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384, 32768])
    ap.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--blocks", type=int, nargs="+", default=[64],
                    help="layout block sizes (= kernel tile; DeepSpeed's default is 16)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32768, help="batch * L, kept constant")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--min-sample-ms", type=float, default=20.0,
                    help="back-to-back calls per timed sample, enough to last this long (0: one call)")
    ap.add_argument("--quick", action="store_true", help="fewer densities, fewer iterations")
    ap.add_argument("--json", default="sparse_attention_gpu.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.iters = min(args.iters, 5)

    dev = jax.devices()[0]
    meta = dict(device=dev.device_kind, platform=dev.platform, jax=jax.__version__, heads=args.heads,
                tokens=args.tokens, iters=args.iters, dtype="bfloat16")
    print(f"# block-sparse attention (Pallas) vs jax.nn.dot_product_attention; {meta}")
    if dev.platform != "gpu":
        print("warning: no GPU; the Pallas kernel runs in interpret mode (very slow)", file=sys.stderr)
    meta["check_rel_err_out_dq_dk_dv"] = correctness_check()
    print(f"correctness vs dense reference (rel. err. out, dq, dk, dv): {meta['check_rel_err_out_dq_dk_dv']}")
    meta["dense_impl"] = dense = dense_impl()

    rows = []
    for d in args.head_dims:
        for length in args.lengths:
            batch = max(1, args.tokens // length)
            shape = (batch, length, args.heads, d)
            inputs = random_inputs(shape)
            cases = [("jax_dense_" + dense, None, None, dense_fn(dense))]
            for block in args.blocks:
                for name, lay in layouts(length, block, args.quick):
                    cases.append((name, block, lay, sparse_fn(lay)))
            for name, block, lay, attn in cases:
                row = measure_case(name, block, lay, attn, inputs, args.iters, args.min_sample_ms / 1e3)
                rows.append(row)
                print(f"  {row}", file=sys.stderr, flush=True)
                with open(args.json, "w") as f:
                    json.dump(dict(meta=meta, rows=rows), f, indent=1)

    print("| head_dim | L | batch | layout | block | density | fwd ms | fwd TFLOP/s | fwd+bwd ms | "
          "fwd+bwd TFLOP/s | fwd+bwd speedup vs dense |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['head_dim']} | {r['L']} | {r['batch']} | {r['kind']} | {r['block']} | "
                  f"{r['density']:.4f} | error: {r['error']} |||||")
            continue
        base = next((x for x in rows if x["kind"].startswith("jax_dense") and x["L"] == r["L"]
                     and x["head_dim"] == r["head_dim"] and "error" not in x), None)
        speed = f"{base['fwdbwd_s'] / r['fwdbwd_s']:.2f}x" if base else ""
        print(f"| {r['head_dim']} | {r['L']} | {r['batch']} | {r['kind']} | {r['block'] or ''} | "
              f"{r['density']:.4f} | {r['fwd_s'] * 1e3:.3f} | {r['fwd_tflops']:.1f} | "
              f"{r['fwdbwd_s'] * 1e3:.3f} | {r['fwdbwd_tflops']:.1f} | {speed} |")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
