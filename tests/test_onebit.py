"""1-bit Adam (zeroflax.optim.onebit_adam) against a numpy simulation of N DeepSpeed workers (onebit_sim.py),
its bytes per step from the compiled HLO, its checkpoints, and the configurations it refuses."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflax
from zeroflax.checkpoint import Checkpointer
from zeroflax.optim import onebit_adam
from zeroflax.step.onebit_sync import SKETCH_BUCKETS, norm_sketch
from cli_helpers import xla_flags_without_device_count
from tolerance import claim, close
from onebit_sim import _sketch, simulate_onebit_adam

N = 8
# (13,): below the persistence threshold (14), replicated at every stage (DeepSpeed's flat layout, 13 -> 64
# padded); (6, 40): 240 elements, not a multiple of 64, partitioned along its last dimension at stages 1-2
# (shards of 30 -> 32); (24, 5): along its first (shards of 15 -> 16); (7, 5): 8 divides neither dimension,
# so it is stored padded to (8, 5) and partitioned along its first (shards of 5 -> 8; sharding/padding.py).
SHAPES = {"a": (13,), "b": (6, 40), "c": (24, 5), "d": (7, 5)}
THRESHOLD = 14
HYPER = dict(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, freeze_step=4)


def linear_loss(params, batch, rng):
    """Device k's gradient of leaf x is its batch row batch[x][k] (one example per device)."""
    return sum(jnp.mean(jnp.sum((params[k] * batch[k]).reshape(batch[k].shape[0], -1), axis=1)) for k in params)


def problem(steps, seed=0):
    rng = np.random.default_rng(seed)
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    grads = [{k: rng.normal(size=(N,) + s).astype(np.float32) for k, s in SHAPES.items()} for _ in range(steps)]
    return params, grads


def engine_for(stage, grad_clip=0.0, devices=None, local_clip=False, ordered=False, precision="fp32", **hyper):
    hp = {**HYPER, **hyper}
    optimizer = onebit_adam(hp["lr"], hp["b1"], hp["b2"], hp["eps"], hp["weight_decay"], hp["freeze_step"],
                            local_clip=local_clip)
    # fp16: DeepSpeed's FP16_Optimizer, which wraps OnebitAdam, halves the scale on every overflow (no hysteresis)
    config = zeroflax.Config(zero_stage=stage, micro_batch_size=1, persistence_threshold=THRESHOLD, grad_clip=grad_clip,
                             remat="none", deterministic_reductions=ordered, precision=precision,
                             loss_scale=zeroflax.LossScaleConfig(hysteresis=1))
    return zeroflax.initialize(linear_loss, problem(0)[0], optimizer, config, devices=devices)


def simulated(engine, params, grads, steps, grad_clip=0.0, local_clip=False):
    keys = sorted(SHAPES)
    layouts = [("flat",) if engine.sync.layouts[k].zero_dim is None else ("zero", engine.sync.layouts[k].zero_dim)
               for k in keys]
    per_worker = [[[g[k][w] for k in keys] for w in range(N)] for g in grads[:steps]]
    final, state = simulate_onebit_adam([params[k] for k in keys], per_worker, layouts=layouts, grad_clip=grad_clip,
                                        local_clip=local_clip, **HYPER)
    return dict(zip(keys, final)), layouts, state


@pytest.mark.parametrize("stage,grad_clip,local_clip", [(0, 0.0, False), (1, 0.0, False), (2, 0.0, False),
                                                        (2, 3.0, True), (2, 3.0, False)])
def test_matches_deepspeed_workers(stage, grad_clip, local_clip):
    """12 steps, freeze_step 4, on 8 devices: the parameters equal the simulation's within 1e-5 (the
    warm-up, the first compressed step, and ten more), with the server chunks laid out as ZeRO shards at
    stages 1-2. grad_clip clips the mean gradient during warm-up, then, with local_clip, each device's
    local one as DeepSpeed does, or, without, every device's by the factor for the sketched mean norm."""
    steps = 12
    params, grads = problem(steps)
    engine, state = engine_for(stage, grad_clip, local_clip=local_clip)
    phases = []
    for t in range(steps):
        phases.append(engine.clock.phase(state))
        state, metrics = engine.step(state, grads[t])
    expected, layouts, sim_state = simulated(engine, params, grads, steps, grad_clip, local_clip)
    partitioned = stage in (1, 2)
    assert layouts == ([("flat",), ("zero", 1), ("zero", 0), ("zero", 0)] if partitioned else [("flat",)] * 4)
    assert engine.plan.padded == partitioned  # the optimizer state of 'd'
    if partitioned:
        assert state.opt_state.mu["d"].shape == (8, 5)
    assert phases == ["warmup"] * 4 + (["first"] if partitioned else ["compressed"]) + ["compressed"] * 7
    for k in SHAPES:
        close(engine.model_params(state)[k], expected[k], atol=1e-5, what="1-bit Adam against the simulation")
    # The error buffers are the simulation's too (worker errors of the replicated leaf 'a').
    close(state.sync_state.leaves["a"].worker_error, sim_state["worker_errors"][0], atol=1e-5,
          what="1-bit Adam's worker error against the simulation's")
    if grad_clip:  # the clip acted: the mean of the local norms, or the sketched mean norm, was above it
        assert float(metrics["grad_norm"]) > grad_clip


@pytest.mark.parametrize("stage", [0, 2])
@pytest.mark.fp16
def test_fp16_skips_an_overflowing_step_as_deepspeed_does(stage):
    """fp16 with the dynamic loss scale (2^16): a step whose gradient overflows on one device changes nothing
    (parameters, momentum, variance, error buffers, update count) and halves the scale, as DeepSpeed's
    FP16_Optimizer skips OnebitAdam.step(); freeze_step counts the updates applied. Overflows at step 1 (warm-up)
    and step 5 (the first compressed step: step 6 is the first again); the other ten steps equal the simulation
    of DeepSpeed's workers given those ten. The gradients are multiples of 2^-8 below 8, exact in fp16, and
    unscaled before the exchange, so fp16's compute changes none of them."""
    steps, bad = 12, (1, 5)
    params, grads = problem(steps)
    grads = [{k: (np.round(v * 256) / 256).astype(np.float32) for k, v in g.items()} for g in grads]
    for t in bad:
        grads[t]["b"][3, 0, 0] = np.inf  # device 3's gradient
    engine, state = engine_for(stage, precision="fp16")
    phases, scales = [], []
    for t in range(steps):
        phases.append(engine.clock.phase(state))
        before = jax.device_get((state.params, state.opt_state, state.sync_state))
        state, metrics = engine.step(state, grads[t])
        scales.append(float(metrics["loss_scale"]))
        assert bool(metrics["skipped"]) == (t in bad)
        if t in bad:  # nothing of the optimizer's moved, the sync's error buffers included
            after = jax.device_get((state.params, state.opt_state, state.sync_state))
            for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
                np.testing.assert_array_equal(a, b)
    assert phases == ["warmup"] * 5 + (["first"] * 2 if stage else ["compressed"] * 2) + ["compressed"] * 5
    assert scales == [2.0 ** 16] * 2 + [2.0 ** 15] * 4 + [2.0 ** 14] * 6  # the scale each step ran with
    good = [g for t, g in enumerate(grads) if t not in bad]
    expected, _, _ = simulated(engine, params, good, len(good))
    for k in SHAPES:
        close(engine.model_params(state)[k], expected[k], atol=1e-5, what="1-bit Adam with skipped steps against the simulation")


def test_the_norm_sketch_is_the_simulations_and_estimates_the_norm():
    """The count sketch that sets the compressed phase's clip factor (trees of 6 to 60 times the bucket
    count, so buckets collide): equal to the simulation's own rewrite of its rule, and its norm within a
    few percent of the exact one, without bias over 100 trees with rows of very different scales."""
    rng = np.random.default_rng(3)
    ratios = []
    for trial in range(100):
        scale = rng.exponential(size=(96, 1)).astype(np.float32)
        tree = {"embed": rng.normal(size=(96, 64)).astype(np.float32) * scale, "bias": rng.normal(size=(13,)).astype(np.float32),
                "w": rng.normal(size=(3, 40, 500)).astype(np.float32) * (trial % 7 + 1)}
        sketch = np.asarray(jax.jit(norm_sketch)(tree))
        if trial < 3:
            close(sketch, _sketch([tree[k] for k in sorted(tree)], SKETCH_BUCKETS), rtol=1e-5, atol=1e-4,
                  what="the norm sketch against the simulation's")
        exact = np.sqrt(sum(np.sum(np.square(x, dtype=np.float64)) for x in tree.values()))
        ratios.append(np.linalg.norm(sketch.astype(np.float64)) / exact)
    ratios = np.asarray(ratios)
    claim(abs(ratios.mean() - 1), 0.01, "the sketched norm's bias")  # statistics of the estimator, not rounding
    claim(ratios.std(), 0.04, "the sketched norm's spread")
    claim(np.abs(ratios - 1).max(), 0.12, "the sketched norm's worst error")


def two_processes(tmp_path, *args):
    """The final parameters of tests/onebit_multiprocess.py run as 2 processes x 4 devices (gloo)."""
    out = tmp_path / "params.npz"
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "XLA_FLAGS": xla_flags_without_device_count()}  # the launcher sets the device count
    done = subprocess.run([sys.executable, "-m", "zeroflax", "launch", "--nproc", "2", "--devices_per_process", "4",
                           "--", sys.executable, os.path.join(here, "onebit_multiprocess.py"), str(out), *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=os.path.dirname(here))
    assert done.returncode == 0, done.stderr[-3000:]
    two = dict(np.load(out))
    assert int(two.pop("processes")) == 2
    return two


@pytest.mark.slow  # multi-process or end-to-end: `make test-slow` (and CI)
def test_two_processes_match_one(tmp_path):
    """2 processes x 4 devices (gloo), ZeRO stage 2, 12 steps with freeze_step 4: the same parameters as
    1 x 8 (and as the simulation) within 1e-6."""
    two = two_processes(tmp_path)
    params, grads = problem(12)
    engine, state = engine_for(2)
    for t in range(12):
        state, _ = engine.step(state, grads[t])
    expected, _, _ = simulated(engine, params, grads, 12)
    for k in SHAPES:
        close(two[k], engine.model_params(state)[k], atol=1e-6, what="2 processes against 1")
        close(two[k], expected[k], atol=1e-5, what="2 processes against the simulation")


@pytest.mark.slow  # multi-process or end-to-end: `make test-slow` (and CI)
def test_two_processes_equal_one_bitwise_with_ordered_reductions(tmp_path):
    """The same run with Config.deterministic_reductions: 2 x 4 equals 1 x 8 bitwise (with psum and gloo
    they differ by up to 2.4e-7), warm-up, first and compressed steps alike."""
    two = two_processes(tmp_path, "ordered")
    _, grads = problem(12)
    engine, state = engine_for(2, ordered=True)
    for t in range(12):
        state, _ = engine.step(state, grads[t])
    for k in SHAPES:
        np.testing.assert_array_equal(two[k], np.asarray(engine.model_params(state)[k]))


def test_one_worker_is_adam_without_bias_correction_and_a_frozen_variance():
    """As a plain optax transformation (one worker: DeepSpeed does not compress) onebit_adam is Adam without
    bias correction, eps outside the square root, whose variance stops at freeze_step."""
    params, grads = problem(8, seed=1)
    optimizer = onebit_adam(HYPER["lr"], HYPER["b1"], HYPER["b2"], HYPER["eps"], HYPER["weight_decay"],
                            HYPER["freeze_step"])
    state = optimizer.init(params)
    p = params
    for g in grads:
        updates, state = optimizer.update({k: v[0] for k, v in g.items()}, state, p)
        p = optax.apply_updates(p, updates)
    keys = sorted(SHAPES)
    expected, _ = simulate_onebit_adam([params[k] for k in keys], [[[g[k][0] for k in keys]] for g in grads],
                                       layouts=[("flat",)] * len(keys), **HYPER)
    for k, e in zip(keys, expected):
        close(p[k], e, atol=1e-6, what="the optax transformation against the simulation")


@pytest.mark.parametrize("grad_clip", [0.0, 1.0])
def test_compressed_step_moves_a_32nd_of_an_all_reduce(grad_clip):
    """A 1M-element buffer at stage 0 on 8 devices: the compressed step's collectives (from the compiled
    HLO) are 1/32 of the warm-up's fp32 all-reduce (goal <= 1/25), 1/31 with clipping (the sketch's
    all-reduce, 7 KiB), and a run with 15% warm-up moves 5.6x less than Adam (goal >= 5x); both steps meet
    their theory."""
    params = {"w": np.zeros((1000, 1003), np.float32)}
    loss = lambda p, batch, rng: jnp.mean(batch["x"] @ p["w"])
    config = zeroflax.Config(zero_stage=0, micro_batch_size=1, remat="none", grad_clip=grad_clip)
    engine, state = zeroflax.initialize(loss, params, onebit_adam(1e-3, freeze_step=4), config)
    batch = {"x": np.ones((N, 1000), np.float32)}
    warmup, compressed = (zeroflax.comm_report(engine, state, batch, phase) for phase in ("warmup", "compressed"))
    for report in (warmup, compressed):
        assert abs(report.ratio - 1) < 0.01, str(report)
    assert warmup.total_bytes / compressed.total_bytes >= (30.9 if grad_clip else 31.9), (str(warmup), str(compressed))
    run = 0.15 * warmup.total_bytes + 0.85 * compressed.total_bytes
    assert warmup.total_bytes / run >= 5
    assert "all-to-all" in compressed.by_kind and "compressed step" in str(compressed)
    memory = zeroflax.memory_report(engine, state, batch)  # the error buffers: 4 N C + 4 C bytes per device
    assert memory.sync_state == memory.sync_theory and "1-bit buffers" in str(memory)


def checkpoint_round_trip(engine_for, grads, save_at, tmp_path, check_restored=lambda restored: None):
    """Train at stage 1 to step `save_at`, save, train on to the end of `grads`; restored on 8 devices (where
    `check_restored` looks at the state first) the run must continue bitwise as if never stopped. Returns the
    restore on 4 devices: (its engine, its state, the restorer's notes), for the caller's checks of the reset."""
    engine, state = engine_for(1)
    for t in range(save_at):
        state, _ = engine.step(state, grads[t])
    checkpoints = Checkpointer(str(tmp_path / "ckpt"), every=1, asynchronous=False)
    checkpoints.save(save_at, state, {"epoch": 0}, {})
    checkpoints.close()
    for t in range(save_at, len(grads)):
        state, _ = engine.step(state, grads[t])

    again, template = engine_for(1)
    restorer = Checkpointer(str(tmp_path / "ckpt"))
    restored, _, _ = restorer.restore(None, template, again.state_shardings)
    assert restorer.notes == []
    check_restored(restored)
    for t in range(save_at, len(grads)):
        restored, _ = again.step(restored, grads[t])
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    fewer, template = engine_for(1, devices=jax.devices()[:4])
    restorer = Checkpointer(str(tmp_path / "ckpt"))
    restored, _, _ = restorer.restore(None, template, fewer.state_shardings)
    return fewer, restored, restorer.notes


def test_checkpoints_keep_the_error_buffers_and_reset_them_on_another_device_count(tmp_path):
    """Saved in the compressed phase and restored on 8 devices, the run continues bitwise as if never
    stopped; restored on 4, the error buffers start afresh (as DeepSpeed's always do), the note says so,
    and the next step re-gathers the momentum (phase 'first')."""
    _, grads = problem(8)

    def exchanged_last_at_step_5(restored):
        assert int(restored.sync_state.exchanged_at) == 5

    fewer, restored, notes = checkpoint_round_trip(engine_for, grads, 6, tmp_path, exchanged_last_at_step_5)
    assert notes and "reset" in notes[0] and "device count" in notes[0]
    assert int(restored.sync_state.exchanged_at) == -1
    four = lambda g: {k: v[:4] for k, v in g.items()}
    restored, _ = fewer.step(restored, four(grads[6]))
    assert list(fewer._jit_steps) == ["first"] and fewer.clock.phase(restored) == "compressed"
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(restored.params))


@pytest.mark.parametrize("change,key", [
    (dict(zero_stage=3, remat="full"), "Config.zero_stage"),
    (dict(mesh=zeroflax.MeshConfig(axes={"data": 4, "tensor": 2})), "MeshConfig.axes['tensor']"),
    (dict(offload_optimizer=zeroflax.OffloadOptimizerConfig(device="cpu")), "OffloadOptimizerConfig.device"),
])
def test_refused_configurations_name_the_key(change, key):
    base = dict(zero_stage=1, micro_batch_size=1, persistence_threshold=0, remat="none")
    with pytest.raises(zeroflax.ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        zeroflax.initialize(linear_loss, problem(0)[0], onebit_adam(1e-3, freeze_step=2),
                            zeroflax.Config(**{**base, **change}))


def test_a_wrapped_onebit_adam_is_refused():
    with pytest.raises(zeroflax.ConfigError, match="optimizer"):
        zeroflax.initialize(linear_loss, problem(0)[0], optax.chain(optax.clip(1.0), onebit_adam(1e-3)),
                            zeroflax.Config(zero_stage=1, micro_batch_size=1, remat="none"))


def test_the_main_job_names_an_unknown_optimizer():
    from zeroflax.train import TrainConfig
    with pytest.raises(zeroflax.ConfigError, match="TrainConfig.optimizer"):
        TrainConfig(optimizer="sgd")
