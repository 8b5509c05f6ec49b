"""One layout of tests/test_layouts.py: run every configuration of CONFIGS in turn, 5 steps each, on this
job's devices (one process, or one of the processes of `zeroflax launch`), and have process 0 write
`<outdir>/<config>.npz`: the final parameters in model order (brought to the host whole), the initial ones,
the per-step losses and step programs (phases), the process/device counts and the leaves that ZeRO partitioned over `data`.

    ZEROFLAX_CPU_DEVICES=6 python tests/layout_worker.py OUTDIR [CONFIG ...]
    python -m zeroflax launch --nproc 2 --devices_per_process 3 -- python tests/layout_worker.py OUTDIR

A configuration that raises writes `<outdir>/<config>.error` (process 0) with the exception instead, and
the worker goes on with the next one; the test fails on it. Only the public API is used: zeroflax.initialize,
engine.batch_share, engine.step, engine.model_params, and jax's process_allgather.
"""
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cli_helpers import xla_flags_without_device_count  # noqa: E402  (the suite's LLVM -O0 and the user's flags)
from layout_grid import CONFIGS  # noqa: E402

os.environ["XLA_FLAGS"] = (f"{xla_flags_without_device_count()} --xla_force_host_platform_device_count="
                           f"{os.environ.get('ZEROFLAX_CPU_DEVICES', '8')}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
from zeroflax.distributed import maybe_initialize  # noqa: E402

maybe_initialize()
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

import zeroflax  # noqa: E402
from zeroflax import Config, MeshConfig, OffloadOptimizerConfig  # noqa: E402
from zeroflax.optim import onebit_adam  # noqa: E402

STEPS = 5
IN, HIDDEN, OUT, LAYERS = 37, 13, 5, 2  # odd widths: 2, 3, 4, 6 and 8 divide none of them
LR, EPS = 1e-3, 1e-6  # tests/test_equivalence.py's: small eps amplifies reassociation, lr keeps it bounded
# 1-bit Adam's compressed update is lr * (leaf-wide momentum scale) / (sqrt(v) + eps) with v frozen after 2
# warm-up steps, so an element whose warm-up gradients nearly cancel (tiny v) moves ~0.1 per step, and the
# fp32 reassociation error of its v (a different sum order across processes) moves it with it: with eps
# 1e-6, w_in[3, 4] on 2x4 vs 1x8 has v 2.8e-9 +- 1.6e-13 and ends 6.4e-6 apart (3 compressed steps of
# ~2e-6 each). eps 1e-3 bounds that sensitivity (about lr * |m| * sqrt(1 - b2) * |dg| / eps^2 per step):
# 6e-8 there, while the parameters still move by 9e-3 to 7e-2.
ONEBIT_EPS = 1e-3


def init_params():
    """A fixed-seed pytree (numpy): an input layer, a stack of LAYERS residual layers ('layers' first, so
    a pipe axis splits them), a head. Every dimension but the layer count is odd."""
    rng = np.random.default_rng(1234)
    normal = lambda *shape: (rng.normal(size=shape) / np.sqrt(shape[-2] if len(shape) > 1 else 1)).astype(np.float32)
    return {"w_in": normal(IN, HIDDEN), "b_in": (0.1 * rng.normal(size=(HIDDEN,))).astype(np.float32),
            "layers": {"w": normal(LAYERS, HIDDEN, HIDDEN),
                       "b": (0.1 * rng.normal(size=(LAYERS, HIDDEN))).astype(np.float32)},
            "w_out": normal(HIDDEN, OUT), "b_out": np.zeros((OUT,), np.float32)}


LOGICAL_AXES = {"w_in": ("embed", "mlp"), "b_in": ("mlp",),
                "layers": {"w": ("layers", "mlp", "embed"), "b": ("layers", "embed")},
                "w_out": ("embed", None), "b_out": (None,)}


def loss_fn(params, batch, rng):
    h = jnp.tanh(batch["x"] @ params["w_in"] + params["b_in"])
    h = zeroflax.scan_layers(lambda c, p: c + jnp.tanh(c @ p["w"] + p["b"]), h, params["layers"])
    out = h @ params["w_out"] + params["b_out"]
    return jnp.mean((out - batch["y"]) ** 2)


def batches(rows):
    rng = np.random.default_rng(99)
    return [{"x": rng.normal(size=(rows, IN)).astype(np.float32), "y": rng.normal(size=(rows, OUT)).astype(np.float32)}
            for _ in range(STEPS)]


def global_rows(devices: int) -> int:
    """Rows per step for every configuration on `devices` devices: 2 per device (micro-batch x accumulation
    x data, with data = devices, or devices / 2 beside a pipe axis of 2)."""
    return 2 * devices


def pipeline_mesh(order):
    """pipe 2 x data N/2 in either mesh order: 'pipe_major' puts a stage's devices together (what a process
    holding a whole stage needs), 'data_major' a data shard's (what a process holding one shard of both
    stages needs); zeroflax refuses a layout where a process's devices hold no whole block of data shards."""
    axes = {"pipe": 2, "data": -1, "tensor": 1} if order == "pipe_major" else {"data": -1, "pipe": 2, "tensor": 1}
    return MeshConfig(axes)


def configs():
    """name -> (Config, optimizer). Each takes global_rows(devices) rows per step: 2 per data shard, or
    2 micro-batches of 2 per data shard beside the pipe axis (data = devices / 2); the optimizer state is
    fresh for each engine."""
    adamw = lambda: optax.adamw(LR, eps=EPS, weight_decay=0.1)
    base = dict(persistence_threshold=0, precision="fp32")
    out = {}
    for stage in (0, 1, 3):
        out[f"stage{stage}"] = (Config(zero_stage=stage, micro_batch_size=2, **base), adamw())
    out["stage2_accum2"] = (Config(zero_stage=2, micro_batch_size=1, grad_accum_steps=2, **base), adamw())
    for order in ("pipe_major", "data_major"):
        out[f"pipeline_{order}"] = (Config(mesh=pipeline_mesh(order), zero_stage=1, micro_batch_size=2,
                                           grad_accum_steps=2, pipeline_schedule="1f1b", **base), adamw())
    out["offload_stage3"] = (Config(zero_stage=3, micro_batch_size=2, offload_optimizer=OffloadOptimizerConfig("cpu"),
                                    **base), adamw())
    out["onebit_stage2"] = (Config(zero_stage=2, micro_batch_size=2, **base),
                            onebit_adam(LR, eps=ONEBIT_EPS, weight_decay=0.01, freeze_step=2))
    # Config.deterministic_reductions: the sums over `data` in device order, so the layouts agree bit for bit;
    # 1-bit Adam then at the eps whose near-zero frozen variances amplify any reassociation (see ONEBIT_EPS).
    ordered = dict(base, deterministic_reductions=True, grad_clip=1.0)
    out["stage2_ordered"] = (Config(zero_stage=2, micro_batch_size=1, grad_accum_steps=2, **ordered), adamw())
    out["onebit_ordered"] = (Config(zero_stage=2, micro_batch_size=2, **ordered),
                             onebit_adam(LR, eps=EPS, weight_decay=0.01, freeze_step=2))
    return out


def flat(tree) -> dict:
    return {jax.tree_util.keystr(path): np.asarray(x) for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def run(config, optimizer, params0, data):
    engine, state = zeroflax.initialize(loss_fn, params0, optimizer, config, logical_axes=LOGICAL_AXES)
    index, count = engine.batch_share()
    rows = data[0]["x"].shape[0] // count
    losses, phases = [], []
    for batch in data:
        phases.append(str(engine.clock.phase(state)))  # the program this step runs (1-bit Adam: warmup, first, compressed)
        state, metrics = engine.step(state, {k: v[index * rows:(index + 1) * rows] for k, v in batch.items()})
        losses.append(float(metrics["loss"]))
    params = engine.model_params(state)
    partitioned = [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(state.params)
                   if "data" in jax.tree.leaves(tuple(x.sharding.spec))]
    host = multihost_utils.process_allgather(params, tiled=True)
    return flat(host), np.asarray(losses), phases, (index, count), partitioned


def main():
    outdir, wanted = sys.argv[1], sys.argv[2:]
    params0, data = init_params(), batches(global_rows(jax.device_count()))
    table = configs()
    assert tuple(table) == CONFIGS, f"layout_grid.CONFIGS {CONFIGS} != the worker's {tuple(table)}"
    unknown = set(wanted) - set(table)
    if unknown:
        raise SystemExit(f"unknown configurations {sorted(unknown)}; known: {sorted(table)}")
    layout = f"{jax.process_count()}x{jax.local_device_count()}"
    for name, (config, optimizer) in table.items():
        if wanted and name not in wanted:
            continue
        start = time.perf_counter()
        try:
            params, losses, phases, share, partitioned = run(config, optimizer, params0, data)
        except Exception as error:  # recorded for the test, which fails on it; the other configurations still run
            print(f"[{layout} p{jax.process_index()}] {name}: {type(error).__name__}: {error}", file=sys.stderr,
                  flush=True)
            if jax.process_index() == 0:
                with open(os.path.join(outdir, f"{name}.error"), "w") as f:
                    f.write(f"{type(error).__name__}: {error}\n\n{traceback.format_exc()}")
            continue
        seconds = time.perf_counter() - start
        print(f"[{layout} p{jax.process_index()}] {name}: {seconds:.1f} s, batch share {share}, "
              f"losses {np.round(losses, 5).tolist()}, phases {phases}", file=sys.stderr, flush=True)
        if jax.process_index() == 0:
            np.savez(os.path.join(outdir, f"{name}.npz"), processes=jax.process_count(),
                     devices=jax.device_count(), losses=losses, seconds=seconds, phases=np.asarray(phases, dtype=str),
                     partitioned=np.asarray(partitioned, dtype=str),
                     **{f"final{k}": v for k, v in params.items()},
                     **{f"init{k}": v for k, v in flat(params0).items()})


if __name__ == "__main__":
    main()
