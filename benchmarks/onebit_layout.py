"""Does a run depend on its process layout? The tiny GPT of the CLI tests (2 layers, d 32, sequences of 32,
one sequence per device, grad_clip 1.0, 8 data-parallel devices) trained for a few steps; the whole state
(parameters, optimizer state, 1-bit sync state) and the metrics are written after every step, so that two
layouts can be compared element by element (docs/onebit_adam.md, "Multi-process").

    # 1 process x 8 devices
    python benchmarks/onebit_layout.py --out /tmp/one.npz
    # 2 processes x 4 devices (gloo)
    python -m zeroflax launch --nproc 2 --devices_per_process 4 -- python benchmarks/onebit_layout.py --out /tmp/two.npz
    # compare (first differing step, per leaf the count and size of the differences)
    python benchmarks/onebit_layout.py --compare /tmp/one.npz /tmp/two.npz

--optimizer adamw|onebit_adam, --stage 0|1|2, --freeze_step, --steps, --deterministic (Config.deterministic_reductions).
--cost: each phase's collective bytes per step from the compiled HLO; with --time K, the steady step's median time.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np


def parse():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    parser.add_argument("--compare", nargs=2)
    parser.add_argument("--optimizer", default="onebit_adam", choices=("adamw", "onebit_adam"))
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--freeze_step", type=int, default=1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--grad_clip", type=float, default=1.0)
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument("--cost", action="store_true", help="print each phase's bytes (and --time steps' median)")
    parser.add_argument("--time", type=int, default=0)
    return parser.parse_args()


def build(args):
    """(engine, state, loader) of the tiny GPT, in this process's layout."""
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count="
                               + os.environ.get("ZEROFLAX_CPU_DEVICES", "8"))
    from zeroflax.distributed import maybe_initialize
    maybe_initialize()
    from zeroflax.config import Config, MeshConfig
    from zeroflax.data import TokenLoader, load_tokens, train_val_split
    from zeroflax.engine import initialize
    from zeroflax.models.gpt import GPT, GPTConfig, next_token_loss
    from zeroflax.train import TrainConfig, make_optimizer

    config = Config(mesh=MeshConfig(axes={"data": -1, "tensor": 1}), zero_stage=args.stage, precision="fp32",
                    micro_batch_size=1, grad_accum_steps=1, grad_clip=args.grad_clip, persistence_threshold=0,
                    remat="dots", seed=0, deterministic_reductions=args.deterministic)
    model_config = GPTConfig(vocab_size=256, num_layers=2, d_model=32, num_heads=2, max_len=32)
    tc = TrainConfig(optimizer=args.optimizer, freeze_step=args.freeze_step, seq_len=32, steps=100, warmup_steps=1,
                     learning_rate=3e-3, workdir="/tmp/unused")
    model = GPT(model_config)
    engine, state = initialize(next_token_loss(model), lambda rng, b: model.init(rng, b["tokens"][:, :-1])["params"],
                               make_optimizer(tc), config, sample_batch={"tokens": np.zeros((1, 33), np.int32)})
    index, count = engine.batch_share()
    train_tokens, _ = train_val_split(load_tokens("builtin"), tc.val_fraction, min_tokens=33)
    loader = TokenLoader(train_tokens, 32, engine.train_batch_size, seed=0, process_index=index, process_count=count)
    return engine, state, loader


def run(args):
    engine, state, loader = build(args)
    import jax
    from jax.experimental import multihost_utils

    # the mesh's data axis, device by device: (its process, its place among that process's devices); the
    # same in every layout when the mesh is process-major
    order = [(d.process_index, jax.local_devices(d.process_index).index(d)) for d in engine.mesh.devices.reshape(-1)]
    whole = lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))
    dump = {"mesh_order": np.asarray(order)}
    for step in range(args.steps):
        phase = engine.clock.phase(state)
        state, metrics = engine.step(state, loader.next_batch())
        leaves = jax.tree_util.tree_flatten_with_path({"params": state.params, "opt_state": state.opt_state,
                                                       "sync_state": state.sync_state})[0]
        for path, leaf in leaves:
            if hasattr(leaf, "dtype") and np.issubdtype(leaf.dtype, np.floating):
                dump[f"{step}/{jax.tree_util.keystr(path)}"] = whole(leaf)
        for key in ("loss", "grad_norm"):
            dump[f"{step}/metric/{key}"] = whole(metrics[key])
        dump[f"{step}/phase"] = np.asarray(phase)
    if jax.process_index() == 0:
        np.savez(args.out, processes=jax.process_count(), **dump)
        print(f"{args.out}: {jax.process_count()} process(es), mesh order {order}")


def cost(args):
    """Bytes per step and device of every phase's program (from the compiled HLO), then the median time of
    `--time` steps after the compilations (the step alternates no phases: the steady program is timed)."""
    import time
    import zeroflax
    engine, state, loader = build(args)
    batch = loader.next_batch()
    for phase in engine.phases:
        report = zeroflax.comm_report(engine, state, batch, phase)
        kinds = ", ".join(f"{k} {v['count']} x = {v['bytes']:.0f} B" for k, v in sorted(report.by_kind.items()))
        print(f"{phase:10s} data axis {report.by_axis.get('data', 0):9.0f} B per device: {kinds}")
    if args.time:
        while engine.clock.phase(state) != engine.phases[-1]:
            state, _ = engine.step(state, batch)
        times = []
        for _ in range(args.time + 1):
            start = time.perf_counter()
            state, metrics = engine.step(state, batch)
            float(metrics["loss"])
            times.append(time.perf_counter() - start)
        print(f"steady step: median {np.median(times[1:]) * 1e3:.2f} ms over {args.time} steps")


def compare(a_path, b_path):
    a, b = np.load(a_path), np.load(b_path)
    print(f"{a_path} ({int(a['processes'])} processes) vs {b_path} ({int(b['processes'])})")
    for name, x in ((a_path, a), (b_path, b)):
        print(f"{name}: data index -> (process, local device):", [tuple(p) for p in x["mesh_order"].tolist()])
    steps = sorted({int(k.split("/")[0]) for k in a.files if "/" in k})
    for step in steps:
        keys = [k for k in a.files if k.startswith(f"{step}/") and not k.endswith("/phase")]
        diff = {k: np.abs(a[k].astype(np.float64) - b[k]) for k in keys}
        unequal = {k: d for k, d in diff.items() if (a[k] != b[k]).any()}
        worst = max((float(d.max()) for d in diff.values()), default=0.0)
        print(f"step {step} ({a[f'{step}/phase']}): {len(unequal)} of {len(keys)} arrays differ, "
              f"max |difference| {worst:.3g}")
        for k, d in sorted(unequal.items()):
            print(f"    {k[len(str(step)) + 1:]:70s} {int((d > 0).sum()):7d} of {d.size:7d} differ, max {d.max():.3g}")


if __name__ == "__main__":
    args = parse()
    if args.compare:
        compare(*args.compare)
    elif args.cost:
        cost(args)
    else:
        run(args)
        sys.exit(0)
