"""1-bit LAMB (zeroflax.optim.onebit_lamb) against a numpy simulation of N DeepSpeed workers
(onebit_lamb_sim.py), its bytes per step from the compiled HLO, and what from_deepspeed maps to it."""
import jax
import numpy as np
import pytest

import zeroflax
from zeroflax.optim import onebit_lamb
from onebit_lamb_sim import simulate_onebit_lamb
from test_onebit import N, SHAPES, THRESHOLD, linear_loss, problem

HYPER = dict(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, freeze_step=4)


def engine_for(stage, **hyper):
    hp = {**HYPER, **hyper}
    optimizer = onebit_lamb(hp["lr"], hp["b1"], hp["b2"], hp["eps"], hp["weight_decay"], hp["freeze_step"])
    config = zeroflax.Config(zero_stage=stage, micro_batch_size=1, persistence_threshold=THRESHOLD, remat="none")
    return zeroflax.initialize(linear_loss, problem(0)[0], optimizer, config)


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
        np.testing.assert_allclose(np.asarray(model[k]), expected[j], atol=1e-5, rtol=0)
        np.testing.assert_allclose(float(state.opt_state.last_factor[k]), sim["last_factor"][j], atol=1e-5)
        np.testing.assert_allclose(float(state.sync_state.scaling[k]), sim["scaling_coeff"][j], rtol=1e-6)
    fresh = jax.device_get(state.opt_state.nu_fresh)
    for j, k in enumerate(keys):
        np.testing.assert_allclose(np.asarray(fresh[k])[tuple(slice(0, s) for s in SHAPES[k])], sim["v_fresh"][j],
                                   rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state.sync_state.buffer.worker_error), sim["worker_errors"], atol=1e-5)
    np.testing.assert_allclose(np.asarray(state.sync_state.buffer.server_error), sim["server_errors"], atol=1e-5)
    clamps = {c for step in sim["factor_clamps"] for c in step}
    assert clamps - {"none"}, "no clamp acted: the test would not see the clamps"
