"""1-bit LAMB (zeroflax.optim.onebit_lamb) against a numpy simulation of N DeepSpeed workers
(onebit_lamb_sim.py), its bytes per step from the compiled HLO, and what from_deepspeed maps to it."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zeroflax
from zeroflax import ConfigError, from_deepspeed
from zeroflax.optim import onebit_lamb
from zeroflax.step.onebit_lamb_sync import OneBitLambSync
from onebit_lamb_sim import simulate_onebit_lamb
from test_onebit import N, SHAPES, THRESHOLD, checkpoint_round_trip, linear_loss, problem
from tolerance import close

HYPER = dict(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, freeze_step=4)


def engine_for(stage, devices=None, **hyper):
    hp = {**HYPER, **hyper}
    optimizer = onebit_lamb(hp["lr"], hp["b1"], hp["b2"], hp["eps"], hp["weight_decay"], hp["freeze_step"])
    config = zeroflax.Config(zero_stage=stage, micro_batch_size=1, persistence_threshold=THRESHOLD, remat="none")
    return zeroflax.initialize(linear_loss, problem(0)[0], optimizer, config, devices=devices)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_matches_deepspeed_workers(stage):
    """12 steps, freeze_step 4, on 8 devices: the warm-up (LAMB, its coefficient averaged), the first
    compressed step (scaling coefficients measured), and seven more through one buffer for all leaves
    (DeepSpeed's exactly at stage 0; at stage 2 the partitioned leaves' shard rows after the whole leaf's
    segment). Parameters, the fresh variance, the factors and the united error buffers equal the simulation's
    within 1e-5. Gradients grow tenfold after warm-up, so the factor's clamps act."""
    steps = 12
    params, grads = problem(steps)
    grads = [g if t < 4 else {k: 10 * v for k, v in g.items()} for t, g in enumerate(grads)]
    engine, state = engine_for(stage)
    phases = []
    for t in range(steps):
        phases.append(engine.clock.phase(state))
        state, _ = engine.step(state, grads[t])
    assert phases == ["warmup"] * 4 + ["first"] + ["compressed"] * 7
    keys = sorted(SHAPES)
    layouts = [("flat",) if engine.sync.layouts[k].zero_dim is None else ("zero", engine.sync.layouts[k].zero_dim)
               for k in keys]
    assert layouts == ([("flat",), ("zero", 1), ("zero", 0), ("zero", 0)] if stage else [("flat",)] * 4)
    per_worker = [[[g[k][w] for k in keys] for w in range(N)] for g in grads]
    expected, sim = simulate_onebit_lamb([params[k] for k in keys], per_worker, layouts=layouts, **HYPER)
    model = engine.model_params(state)
    error = max(float(np.max(np.abs(np.asarray(model[k]) - expected[j]))) for j, k in enumerate(keys))
    print(f"stage {stage}: largest parameter difference {error:.2e}; clamps {sim['factor_clamps']}")
    for j, k in enumerate(keys):
        close(model[k], expected[j], atol=1e-5, what="1-bit LAMB against the simulation")
        close(float(state.opt_state.last_factor[k]), sim["last_factor"][j], atol=1e-5, what="the last trust factor")
        close(float(state.sync_state.scaling[k]), sim["scaling_coeff"][j], rtol=1e-6, what="the scaling coefficient")
    fresh = jax.device_get(state.opt_state.nu_fresh)
    for j, k in enumerate(keys):
        close(np.asarray(fresh[k])[tuple(slice(0, s) for s in SHAPES[k])], sim["v_fresh"][j], rtol=1e-4, atol=1e-6,
              what="the fresh variance")
    # The error buffers carry each compression's residual across 8 steps at magnitudes up to 5 (float32 ulp
    # 4.8e-7 there): 3.8e-6 off at most, measured on SSE4.2 and AVX2 alike. A wrong compression or a lost
    # residual is off by the entry itself, O(1).
    close(state.sync_state.buffer.worker_error, sim["worker_errors"], atol=4e-5, what="the worker errors")
    close(state.sync_state.buffer.server_error, sim["server_errors"], atol=4e-5, what="the server errors")
    clamps = {c for step in sim["factor_clamps"] for c in step}
    assert clamps - {"none"}, "no clamp acted: the test would not see the clamps"


CIFAR = "tests/data/deepspeed_corpus/deepspeedai__DeepSpeedExamples/cifar__ds_config_onebitlamb.json"


def test_a_real_onebitlamb_config_imports_and_trains_with_the_lamb_sync():
    """DeepSpeedExamples' CIFAR config (OneBitLamb, max_coeff 0.3, factor_max 2): its params reach onebit_lamb,
    the moot keys are said, the engine exchanges through OneBitLambSync, and stage 3 is refused by key."""
    path = os.path.join(os.path.dirname(__file__), "..", CIFAR)
    imported = from_deepspeed(path, world_size=N)
    hyper = imported.hyperparameters
    assert hyper["type"] == "OneBitLamb"
    assert (hyper["lr"], hyper["max_coeff"], hyper["factor_max"], hyper["freeze_step"]) == (5e-3, 0.3, 2.0, 1000)
    settings = imported.optimizer.settings
    assert (settings.max_coeff, settings.min_coeff, settings.factor_max, settings.weight_decay) == (0.3, 0.01, 2.0, 0.01)
    assert any("bias_correction" in n for n in imported.notes)
    config = imported.config.replace(micro_batch_size=1, grad_accum_steps=1, train_batch_size=None,
                                     persistence_threshold=THRESHOLD, remat="none")
    engine, state = zeroflax.initialize(linear_loss, problem(0)[0], imported.optimizer, config)
    assert isinstance(engine.sync, OneBitLambSync)
    state, metrics = engine.step(state, problem(1)[1][0])
    assert np.isfinite(float(metrics["loss"]))
    ds = json.load(open(path))
    with pytest.raises(ConfigError) as error:
        from_deepspeed({**ds, "zero_optimization": {"stage": 3}}, world_size=N)
    assert error.value.key == "zero_optimization.stage" and "OneBitLamb" in str(error.value)


def test_compressed_step_moves_a_32nd_of_an_all_reduce():
    """Two leaves (1000 x 1003 and 1003) at stage 0 on 8 devices: one united buffer, and the compressed step's
    collectives (from the compiled HLO) are a 32nd of the warm-up's fp32 all-reduce, 'first' the same (the
    scaling coefficients are measured locally), each within 1% of its theory; a run with 15% warm-up moves
    5.6x less than LAMB. The sync state's bytes are its theory."""
    params = {"w": np.zeros((1000, 1003), np.float32), "b": np.zeros((1003,), np.float32)}
    loss = lambda p, batch, rng: jnp.mean(batch["x"] @ p["w"] + p["b"])
    config = zeroflax.Config(zero_stage=0, micro_batch_size=1, remat="none")
    engine, state = zeroflax.initialize(loss, params, onebit_lamb(1e-3, freeze_step=4), config)
    assert engine.sync.buffer_cols() == [engine.sync.united.cols]
    batch = {"x": np.ones((N, 1000), np.float32)}
    reports = {phase: zeroflax.comm_report(engine, state, batch, phase) for phase in ("warmup", "first", "compressed")}
    for report in reports.values():
        assert abs(report.ratio - 1) < 0.01, str(report)
    warmup, compressed = reports["warmup"].total_bytes, reports["compressed"].total_bytes
    assert warmup / compressed >= 31.9 and reports["first"].total_bytes == compressed
    assert warmup / (0.15 * warmup + 0.85 * compressed) >= 5.5
    memory = zeroflax.memory_report(engine, state, batch)
    assert memory.sync_state == memory.sync_theory and "1-bit buffers" in str(memory)
    print(f"warm-up {warmup:,.0f} B, compressed {compressed:,.0f} B per device: {warmup / compressed:.1f}x; "
          f"15% warm-up: {warmup / (0.15 * warmup + 0.85 * compressed):.2f}x")


def test_checkpoints_keep_the_scaling_and_measure_it_again_on_another_device_count(tmp_path):
    """Saved in the compressed phase and restored on 8 devices, the run continues bitwise (the scaling
    coefficients and the united buffer's errors restored); restored on 4, the sync state starts afresh with a
    note, and the next step ('first') measures the scaling coefficients again."""
    _, grads = problem(8)

    def scaled(restored):
        assert all(float(c) > 0 for c in jax.tree.leaves(restored.sync_state.scaling))

    fewer, restored, notes = checkpoint_round_trip(engine_for, grads, 6, tmp_path, scaled)
    assert notes and "reset" in notes[0]
    assert fewer.clock.phase(restored) == "first" and not any(float(c) for c in jax.tree.leaves(restored.sync_state.scaling))
    restored, _ = fewer.step(restored, {k: v[:4] for k, v in grads[6].items()})
    scaled(restored)

