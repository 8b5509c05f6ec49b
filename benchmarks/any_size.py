"""ZeRO on any cluster size: a LLaMA-7B layer's two large matrices at N = 6, 8, 12, 24, compile-only.

    python benchmarks/any_size.py [--sizes 6,8,12,24] [--stages 1,2,3] [--json runs/any_size.json]

The matrices are a LLaMA-7B layer's attention projection (4096 x 4096) and MLP up-projection
(4096 x 11008), fp32 (master weights, gradients and compute), Adam, `persistence_threshold=0`, one
`zeroflax.group` around the tiny loss mean(((x @ wq) @ w_up) ** 2) on one row per device (so that ZeRO-3
gathers both again for the backward pass). 4096 and 11008 are multiples of 8 but of none of 6, 12, 24:
there ZeRO stores each matrix zero-padded along the dimension that adds the fewest zeros
(`zeroflax/sharding/padding.py`). Nothing is allocated: `zeroflax.initialize(..., abstract=True)`, then
the memory and communication reports on the compiled step, in one subprocess per N with N simulated
devices. Per N and ZeRO stage:

  params/ideal   each device's parameter bytes at rest / (the true parameter bytes / N)   (stage 3: <= 1.02)
  opt/ideal      each device's optimizer state bytes / (the true optimizer state bytes / N)   (<= 1.02)
  comm/theory    the collective bytes per device per step read from the compiled HLO (what
                 `zeroflax.comm_report` measures) / ZeRO's volume counting the padding   (within 1.05x)
  padding        bytes of padding zeros per device: at rest (memory report) and moved per step (comm)
The acceptance bounds are checked and every miss printed; the exit status is 1 if any.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
D_MODEL, D_FF = 4096, 11008
BOUNDS = dict(params=1.02, opt=1.02, comm=1.05)


def worker(n: int, stages: list[int]) -> list[dict]:
    """The rows for one data size, in this process (XLA_FLAGS set by `main` for n devices)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    sys.path.insert(0, ROOT)
    import zeroflax

    assert jax.device_count() == n, (jax.device_count(), n)

    def init(rng):
        a, b = jax.random.split(rng)
        return {"wq": jax.random.normal(a, (D_MODEL, D_MODEL), jnp.float32) * 0.02,
                "w_up": jax.random.normal(b, (D_MODEL, D_FF), jnp.float32) * 0.02}

    layer = zeroflax.group(lambda p, x: (x @ p["wq"]) @ p["w_up"], name="layer")

    def loss(params, batch, rng):
        return jnp.mean(layer(params, batch["x"]) ** 2)

    rows = []
    for stage in stages:
        config = zeroflax.Config(zero_stage=stage, persistence_threshold=0, micro_batch_size=1, precision="fp32")
        start = time.perf_counter()
        engine, state = zeroflax.initialize(loss, init, optax.adam(1e-4), config, abstract=True)
        batch = {"x": np.zeros((config.resolve_train_batch(n), D_MODEL), np.float32)}
        memory = zeroflax.memory_report(engine, state, batch)
        comm = zeroflax.comm_report(engine, state, batch)
        true = engine.abstract_state(stored=False)
        nbytes = lambda tree: sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
        params_total, opt_total = nbytes(true.params), nbytes(true.opt_state)
        placements = jax.tree.leaves(engine.plan.placements, is_leaf=lambda x: hasattr(x, "zero_dim"))
        rows.append(dict(
            n=n, stage=stage, seconds=round(time.perf_counter() - start, 1),
            stored={k: list(p.stored_shape) for k, p in zip(("w_up", "wq"), placements)},
            params_per_device=memory.params, params_total=params_total,
            params_ratio=memory.params / (params_total / n),
            opt_per_device=memory.opt_state, opt_total=opt_total, opt_ratio=memory.opt_state / (opt_total / n),
            at_rest=memory.at_rest, at_rest_theory=memory.theory_at_rest, memory_ratio=memory.ratio,
            padding_at_rest=memory.padding, padding_moved=comm.padding_bytes,
            comm_bytes=comm.total_bytes, comm_theory=comm.theory_bytes, comm_ratio=comm.ratio,
            comm_by_kind={k: v["bytes"] for k, v in comm.by_kind.items()},
            collectives=[dict(kind=c["kind"], dims=c["dims"], dtype=c["dtype"], trips=c["trip_count"],
                              bytes=c["bytes_per_step"], op_name=c["op_name"][-80:]) for c in comm.collectives],
            unknown_trip_count=comm.unknown_trip_count))
    return rows


def misses(row: dict) -> list[str]:
    """The acceptance bounds a row misses (module docstring)."""
    out = []
    if row["stage"] == 3 and row["params_ratio"] > BOUNDS["params"]:
        out.append(f"params/ideal {row['params_ratio']:.4f} > {BOUNDS['params']}")
    if row["stage"] >= 1 and row["opt_ratio"] > BOUNDS["opt"]:
        out.append(f"opt/ideal {row['opt_ratio']:.4f} > {BOUNDS['opt']}")
    if not 1 / BOUNDS["comm"] <= row["comm_ratio"] <= BOUNDS["comm"]:
        out.append(f"comm/theory {row['comm_ratio']:.4f} outside [{1 / BOUNDS['comm']:.3f}, {BOUNDS['comm']}]")
    if row["unknown_trip_count"]:
        out.append("a loop without a known trip count")
    return out


def table(rows: list[dict]) -> str:
    MiB = 2**20
    lines = ["|  N | stage | stored wq, w_up | params/device MiB | params/ideal | opt/device MiB | opt/ideal | "
             "comm MiB/step | theory MiB | comm/theory | padding at rest KiB | padding moved KiB |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        shapes = f"{'x'.join(map(str, r['stored']['wq']))}, {'x'.join(map(str, r['stored']['w_up']))}"
        lines.append(
            f"| {r['n']} | {r['stage']} | {shapes} | {r['params_per_device'] / MiB:.2f} | {r['params_ratio']:.4f} | "
            f"{r['opt_per_device'] / MiB:.2f} | {r['opt_ratio']:.4f} | {r['comm_bytes'] / MiB:.2f} | "
            f"{r['comm_theory'] / MiB:.2f} | {r['comm_ratio']:.4f} | {r['padding_at_rest'] / 1024:.1f} | "
            f"{r['padding_moved'] / 1024:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="6,8,12,24", help="data sizes N, comma-separated")
    parser.add_argument("--stages", default="1,2,3", help="ZeRO stages, comma-separated")
    parser.add_argument("--json", default=None, help="write every row (with its collectives) here")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    stages = [int(s) for s in args.stages.split(",")]
    if args.worker is not None:
        print(json.dumps(worker(args.worker, stages)))
        return 0
    rows = []
    for n in [int(s) for s in args.sizes.split(",")]:
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}").strip())
        done = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", str(n), "--stages", args.stages],
                              env=env, cwd=ROOT, capture_output=True, text=True)
        if done.returncode:
            sys.stderr.write(done.stderr)
            raise SystemExit(f"the worker for N={n} failed ({done.returncode})")
        rows += json.loads(done.stdout.strip().splitlines()[-1])
        print(f"N={n}: {sum(r['seconds'] for r in rows if r['n'] == n):.0f} s", file=sys.stderr)
    print(table(rows))
    failed = [(r["n"], r["stage"], m) for r in rows for m in misses(r)]
    for n, stage, miss in failed:
        print(f"MISS N={n} stage {stage}: {miss}")
    if not failed:
        print("all acceptance bounds hold (stage 3 params/ideal <= 1.02, opt/ideal <= 1.02, comm/theory within 1.05x)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(dict(bounds=BOUNDS, rows=rows), f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
