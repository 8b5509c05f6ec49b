"""0/1 Adam (zeroflax.optim.zero_one_adam) against a numpy simulation of N DeepSpeed workers (zoadam_sim.py):
the schedule, every kind of step on 8 devices at ZeRO stages 0-2, the bytes each kind moves, checkpoints."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zeroflax
from zeroflax.optim import zero_one_adam
from zeroflax.optim.zero_one_adam import step_kinds
from test_onebit import N, SHAPES, THRESHOLD, checkpoint_round_trip, linear_loss, problem
from tolerance import at_least, close
from zoadam_sim import simulate_zero_one_adam, zero_one_adam_schedule

HYPER = dict(lr=1e-2, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)
SCHEDULE = dict(var_freeze_step=8, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)
NAMES = {"full": "full", "onebit_grad": "onebit_grad", "freeze_sync": "local+sync", "freeze_local": "local",
         "sync": "local+sync", "local": "local"}


def engine_for(stage, devices=None, **schedule):
    optimizer = zero_one_adam(HYPER["lr"], HYPER["b1"], HYPER["b2"], HYPER["eps"], HYPER["weight_decay"],
                              **{**SCHEDULE, **schedule})
    config = zeroflax.Config(zero_stage=stage, micro_batch_size=1, persistence_threshold=THRESHOLD, remat="none")
    return zeroflax.initialize(linear_loss, problem(0)[0], optimizer, config, devices=devices)


def own_params(engine, state):
    """Each device's own parameters: those at rest plus its accumulator."""
    rest = engine.model_params(state)
    leaves = jax.device_get(state.sync_state.leaves)
    return [{k: np.asarray(rest[k]) + np.asarray(leaves[k].accumulated[w]) for k in SHAPES} for w in range(N)]


def test_the_schedule_is_deepspeeds():
    """The kinds of steps, from the host's schedule, equal the simulation's (DeepSpeed's counters on its real
    steps) for DeepSpeed's defaults and for short intervals."""
    for settings in (dict(var_freeze_step=100, var_update_scaler=16, local_step_scaler=32678, local_step_clipper=16),
                     dict(var_freeze_step=40, var_update_scaler=3, local_step_scaler=2, local_step_clipper=8)):
        optimizer = zero_one_adam(1e-3, **settings)
        ours = [{"sync": "local+sync"}.get(k, k) for k in step_kinds(optimizer.settings, 300)]
        assert ours == zero_one_adam_schedule(300, **settings)


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_matches_deepspeed_workers(stage):
    """20 steps on 8 devices, var_freeze_step 8: full and 1-bit gradient steps, the freeze, then local steps
    with syncs at growing intervals, ending on a local step (the devices' parameters differ). Every device's
    own parameters (at rest plus its accumulator) and momentum equal the simulated worker's within 1e-5."""
    steps = 20
    params, grads = problem(steps)
    engine, state = engine_for(stage)
    phases = []
    for t in range(steps):
        phases.append(engine.clock.phase(state))
        state, _ = engine.step(state, grads[t])
    keys = sorted(SHAPES)
    layouts = [("flat",) if engine.sync.layouts[k].zero_dim is None else ("zero", engine.sync.layouts[k].zero_dim)
               for k in keys]
    per_worker = [[[g[k][w] for k in keys] for w in range(N)] for g in grads]
    workers, sim, log = simulate_zero_one_adam([params[k] for k in keys], per_worker, layouts=layouts, **HYPER,
                                               **SCHEDULE)
    assert [NAMES[p] for p in phases] == log
    assert set(phases) == {"full", "onebit_grad", "freeze_sync", "sync", "local"} and phases[-1] == "local"
    mine = own_params(engine, state)
    momentum = jax.device_get(state.sync_state.leaves)
    error = 0.0
    for w in range(N):
        for j, k in enumerate(keys):
            close(mine[w][k], workers[w][j], atol=1e-5, what="0/1 Adam's workers against the simulation's")
            close(momentum[k].momentum[w], sim["m"][w][j], atol=1e-5, what="0/1 Adam's momentum against the simulation's")
            error = max(error, float(np.max(np.abs(mine[w][k] - workers[w][j]))))
    spread = max(float(np.max(np.abs(mine[w][k] - mine[0][k]))) for w in range(N) for k in keys)
    at_least(spread, 100 * max(error, 1e-7), "the devices' spread since the last sync")  # they went their own ways
    print(f"stage {stage}: largest difference from the simulated workers {error:.2e}; devices' spread {spread:.2e}")


def test_each_kind_of_step_moves_its_theory():
    """A 1M-element leaf at stage 0 on 8 devices, from the compiled HLO: 'full' is ZeRO's all-reduce, the
    1-bit gradient and sync steps a 32nd of it, a local step only the loss's and the gradient norm's 8-byte
    all-reduce (at stage 2 too: no all-gather of unchanged parameters), each within 1% of its theory; with DeepSpeed's other defaults, 1100 steps with
    var_freeze_step 100 (45 full steps, every frozen step a sync) move 14x less than Adam's."""
    params = {"w": np.zeros((1000, 1003), np.float32)}
    loss = lambda p, batch, rng: jnp.mean(batch["x"] @ p["w"])
    config = zeroflax.Config(zero_stage=0, micro_batch_size=1, remat="none")
    optimizer = zero_one_adam(1e-3, var_freeze_step=100)
    engine, state = zeroflax.initialize(loss, params, optimizer, config)
    batch = {"x": np.ones((N, 1000), np.float32)}
    reports = {p: zeroflax.comm_report(engine, state, batch, p) for p in ("full", "onebit_grad", "local", "sync")}
    for report in reports.values():
        assert abs(report.ratio - 1) < 0.01, str(report)
    assert reports["local"].total_bytes <= 16  # the loss's and the norm's all-reduce only
    # At stage 2 too: a local step leaves the parameters at rest, so nothing gathers them.
    stage2, state2 = zeroflax.initialize(loss, params, optimizer, config.replace(zero_stage=2))
    for phase in ("local", "onebit_grad", "freeze_sync"):
        report = zeroflax.comm_report(stage2, state2, batch, phase)
        assert abs(report.ratio - 1) < 0.01, str(report)
        assert phase != "local" or report.total_bytes <= 16, str(report)
    memory = zeroflax.memory_report(stage2, state2, batch)
    assert memory.sync_state == memory.sync_theory
    full = reports["full"].total_bytes
    assert full / reports["onebit_grad"].total_bytes >= 31.9 and full / reports["sync"].total_bytes >= 31.9
    kinds = step_kinds(optimizer.settings, 1100)
    moved = sum(reports[{"freeze_sync": "sync"}.get(k, k)].total_bytes for k in kinds)
    assert full * len(kinds) / moved >= 13, (kinds.count("full"), moved)
    print({p: r.total_bytes for p, r in reports.items()}, f"{kinds.count('full')} full steps of {len(kinds)}: "
          f"{full * len(kinds) / moved:.1f}x less than Adam")


def test_checkpoints_keep_each_devices_own_state(tmp_path):
    """Saved between two syncs (the devices' parameters differ) and restored on 8 devices, the run continues
    bitwise; restored on 4, the sync state starts afresh (the local steps since the last sync are dropped, the
    note says so) and the next step takes the momentum and variance again ('freeze_*')."""
    _, grads = problem(16)

    def between_two_syncs(restored):  # frozen, with local steps taken since the last sync
        assert int(restored.sync_state.frozen) == 1 and float(restored.sync_state.lrs) > 0

    fewer, restored, notes = checkpoint_round_trip(engine_for, grads, 13, tmp_path, between_two_syncs)
    assert notes and "reset" in notes[0]
    assert fewer.clock.phase(restored).startswith("freeze_")
    restored, _ = fewer.step(restored, {k: v[:4] for k, v in grads[13].items()})
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(restored.params))

BERT = ("tests/data/deepspeed_corpus/deepspeedai__DeepSpeedExamples/"
        "training__bing_bert__01_adam__mpi_ethernet__deepspeed_bsz4k_01adam_config_seq128_mpi_ethernet.json")


def test_a_real_zerooneadam_config_imports():
    """DeepSpeedExamples' BERT config (ZeroOneAdam, fp16, var_freeze_step 12500): its params reach zero_one_adam
    with DeepSpeed's defaults for the rest, the moot keys are said, fp16 takes DeepSpeed's fused wrapper's loss
    scaling (hysteresis 1), and the engine syncs with ZeroOneSync."""
    import os

    from zeroflax import from_deepspeed
    from zeroflax.step.zero_one_sync import ZeroOneSync

    imported = from_deepspeed(os.path.join(os.path.dirname(__file__), "..", BERT), world_size=N)
    settings = imported.optimizer.settings
    assert (settings.var_freeze_step, settings.var_update_scaler, settings.local_step_scaler,
            settings.local_step_clipper, settings.weight_decay) == (12500, 16, 32678, 16, 0.01)
    assert imported.hyperparameters["type"] == "ZeroOneAdam" and imported.config.loss_scale.hysteresis == 1
    assert any("bias_correction" in n for n in imported.notes)
    config = imported.config.replace(micro_batch_size=1, grad_accum_steps=1, train_batch_size=None, precision="fp32",
                                     persistence_threshold=THRESHOLD, remat="none")
    engine, state = zeroflax.initialize(linear_loss, problem(0)[0], imported.optimizer, config)
    assert isinstance(engine.sync, ZeroOneSync) and engine.clock.phase(state) == "full"


def test_refused_where_it_cannot_run():
    """Wrapped in a chain (the engine must own its exchange) and at ZeRO stage 3 (no device holds its local
    gradient): each a ConfigError naming the key."""
    import optax

    from zeroflax import ConfigError

    params = problem(0)[0]
    config = zeroflax.Config(micro_batch_size=1, persistence_threshold=THRESHOLD, remat="none")
    with pytest.raises(ConfigError) as error:
        zeroflax.initialize(linear_loss, params, optax.chain(zero_one_adam(1e-3)), config)
    assert error.value.key == "optimizer" and "0/1 Adam" in str(error.value)
    with pytest.raises(ConfigError) as error:
        zeroflax.initialize(linear_loss, params, zero_one_adam(1e-3), config.replace(zero_stage=3, remat="dots"))
    assert error.value.key == "Config.zero_stage" and "zero_one_adam" in str(error.value)


def test_sync_steps_fold_weight_decay_into_the_momentum():
    """DeepSpeed's rule, kept: a sync step sets the momentum from the exchanged accumulator, which holds the
    weight-decay step too, so each frozen step decays by about lr x wd / (1 - b1), 10x AdamW's. Measured on the
    simulation (which zeroflax equals, above): with zero gradients after the freeze the parameters shrink by
    11.5 x lr x wd per step (the momentum lags the shrinking parameters). Hence wd 0.01 in the main job."""
    ones = [np.ones((16,), np.float32)]
    lr, wd = 1e-2, 0.1
    grads = lambda t, k: [np.full((16,), 1.0 if t <= 2 else 0.0, np.float32)]
    ends = [simulate_zero_one_adam(ones, grads, n_workers=2, n_steps=steps, lr=lr, b1=0.9, b2=0.999, eps=1e-8,
                                   weight_decay=wd, var_freeze_step=2, var_update_scaler=16, local_step_scaler=10**6,
                                   local_step_clipper=16, layouts=[("flat",)])[0][0][0][0] for steps in (60, 61)]
    rate = 1 - float(ends[1] / ends[0])
    assert 9 * lr * wd < rate < 13 * lr * wd, rate
