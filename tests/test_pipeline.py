"""Pipeline parallelism: schedules as data (checked against DeepSpeed's TrainSchedule rules), the order
the compiled step really executes, the GPT trained through gpipe and 1f1b on data x pipe x tensor meshes
at every ZeRO stage equal to a single-device optax loop, bounded in-flight memory, and bad input.

Equivalence: within the reference loop's own rounding noise, as tests/test_equivalence.py (tests/noise_floor.py).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflax
from zeroflax import Config, ConfigError, MeshConfig
from zeroflax.models.gpt import GPT, GPTConfig, next_token_loss
from zeroflax.pipeline.executor import observe_ticks, tables
from zeroflax.pipeline.schedule import build_schedule
from noise_floor import assert_matches
from test_equivalence import STEPS, adamw, reference_and_floor
from tolerance import close


# ------------------------------------------------------------------------------ schedules as data
def deepspeed_train_schedule(S: int, M: int, s: int) -> list:
    """Stage s's steps in DeepSpeed's TrainSchedule, written out from its rules: a stage runs forwards on
    steps of its own parity and backwards on the others; the micro-batch id follows from the step, the
    stage and S, and ids outside [0, M) are idle steps."""
    steps = []
    for step in range(2 * (M + S - 1)):
        if step % 2 == s % 2:
            kind, micro = "F", step // 2 - s // 2
        elif step % 2 == 0:  # even step, odd stage
            kind, micro = "B", step // 2 - S + (s + 1) // 2
        else:  # odd step, even stage
            kind, micro = "B", (step - 1) // 2 - S + 1 + s // 2
        steps.append((kind, micro) if 0 <= micro < M else None)
    return steps


@pytest.mark.parametrize("S,M", [(2, 4), (4, 4), (4, 8), (3, 5)])
def test_1f1b_is_deepspeeds_train_schedule(S, M):
    schedule = build_schedule("1f1b", S, M)
    assert schedule.num_ticks == 2 * (M + S - 1)
    for s in range(S):
        assert schedule.stage_ops(s) == deepspeed_train_schedule(S, M, s), f"stage {s}"
        warmup = next(i for i, op in enumerate(o for o in schedule.stage_ops(s) if o) if op[0] == "B")
        assert warmup == min(S - s, M)
        assert schedule.in_flight(s) == min(S - s, M)


@pytest.mark.parametrize("name,S,M,V", [("gpipe", 4, 8, 1), ("gpipe", 3, 5, 1), ("1f1b", 4, 8, 1),
                                        ("1f1b", 2, 4, 1), ("interleaved", 4, 8, 2), ("interleaved", 2, 6, 3),
                                        ("interleaved", 3, 6, 2)])
def test_idle_fraction(name, S, M, V):
    schedule = build_schedule(name, S, M, V)
    expected = (S - 1) / (V * M + S - 1)
    for s in range(S):
        assert schedule.idle_fraction(s) == pytest.approx(expected)
        ops = [op for op in schedule.stage_ops(s) if op]
        assert sorted(ops) == sorted((k, m) + ((v,) if V > 1 else ()) for k in "FB" for m in range(M)
                                     for v in range(V)), "every micro-batch once forward, once backward"


def test_gpipe_runs_all_forwards_first_and_holds_every_micro_batch():
    schedule = build_schedule("gpipe", 4, 8)
    for s in range(4):
        kinds = [op[0] for op in schedule.stage_ops(s) if op]
        assert kinds == ["F"] * 8 + ["B"] * 8
        assert schedule.in_flight(s) == 8


def test_buffer_slots_follow_in_flight_micro_batches():
    """1f1b's buffers do not grow with M (slots are reused); gpipe's hold all M."""
    for M in (4, 8, 16):
        assert tables(build_schedule("1f1b", 4, M)).act_slots <= 4
        assert tables(build_schedule("gpipe", 4, M)).act_slots == M


# ------------------------------------------------------------------------------ the GPT through it
def gpt_case(layers=4, tie=True, seed=0):
    model = GPT(GPTConfig(num_layers=layers, d_model=32, num_heads=2, max_len=16, tie_embeddings=tie))
    rng = np.random.default_rng(seed)
    batches = [{"tokens": rng.integers(0, 256, size=(32, 17)).astype(np.int32)} for _ in range(STEPS)]
    boxed = model.init(jax.random.PRNGKey(seed), batches[0]["tokens"][:, :-1])["params"]
    return boxed, next_token_loss(model), batches


def pipeline_config(mesh, stage=0, schedule="1f1b", micro_batches=8, **kw):
    return Config(mesh=MeshConfig(mesh), zero_stage=stage, micro_batch_size=32 // (mesh["data"] * micro_batches),
                  grad_accum_steps=micro_batches, persistence_threshold=0, pipeline_schedule=schedule, **kw)


@functools.cache
def expected(layers, tie):
    """(reference parameters, noise floor) of gpt_case(layers, tie), shared by every configuration."""
    boxed, loss, batches = gpt_case(layers, tie)
    return reference_and_floor(loss, zeroflax.unbox(boxed)[0], adamw(), batches)


def run_and_compare(config, layers=4, tie=True):
    boxed, loss, batches = gpt_case(layers, tie)
    engine, state = zeroflax.initialize(loss, boxed, adamw(), config)
    for batch in batches:
        state, metrics = engine.step(state, batch)
    assert_matches(jax.device_get(engine.model_params(state)), *expected(layers, tie), "pipelined GPT")
    return engine, state


def test_pipe_8():
    engine, state = run_and_compare(pipeline_config({"data": 1, "pipe": 8, "tensor": 1}), layers=8)
    spec = state.params["w_in"].sharding.spec
    assert spec[0] == "pipe", spec


@pytest.mark.parametrize("stage,sequence_parallel", [(0, False), (1, False), (2, False), (3, False), (3, True)])
def test_data_pipe_tensor(stage, sequence_parallel):
    """data 2 x pipe 2 x tensor 2: ZeRO on data, layers split over pipe, heads/mlp/vocab over tensor; with
    sequence parallelism too, where the stages send their sequence slices (half the activation)."""
    engine, state = run_and_compare(pipeline_config({"data": 2, "pipe": 2, "tensor": 2}, stage,
                                                    sequence_parallel=sequence_parallel))
    spec = state.params["w_in"].sharding.spec
    assert spec[0] == "pipe" and "tensor" in spec and (("data" in spec) == (stage == 3)), spec
    if sequence_parallel:
        boxed, loss, batches = gpt_case()
        report = zeroflax.comm_report(engine, state, batches[0])
        print(report)
        assert report.permute_bytes == pytest.approx(report.permute_theory, rel=1e-6)
        assert 0.95 <= report.by_axis["tensor"] / report.theory_by_axis["tensor"] <= 1.1


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_schedules_on_pipe_4(schedule):
    virtual = 2 if schedule == "interleaved" else 1
    run_and_compare(pipeline_config({"data": 2, "pipe": 4, "tensor": 1}, 1, schedule, micro_batches=8,
                                    pipeline_virtual_stages=virtual), layers=4 * virtual)


def test_interleaved_stores_layers_in_pipeline_order_and_checkpoints_model_order(tmp_path):
    """Device s holds virtual stages s, S + s: the engine keeps the stacked layers in that order, and
    evaluation, model_params and checkpoints see model order, so a checkpoint restores on data 8."""
    from zeroflax.checkpoint import Checkpointer

    boxed, loss, batches = gpt_case(layers=8)
    config = pipeline_config({"data": 2, "pipe": 4, "tensor": 1}, 0, "interleaved", micro_batches=4,
                             pipeline_virtual_stages=2)
    engine, state = zeroflax.initialize(loss, boxed, optax.adam(1e-3), config)
    stored, model = jax.device_get(state.params["w_in"]), np.asarray(zeroflax.unbox(boxed)[0]["w_in"])
    # 8 layers, S = 4, V = 2: device s holds rows 2s, 2s + 1 = virtual stages s and 4 + s.
    for row, layer in enumerate([0, 4, 1, 5, 2, 6, 3, 7]):
        np.testing.assert_array_equal(stored[row], model[layer])
    np.testing.assert_array_equal(jax.device_get(engine.model_params(state))["w_in"], model)
    state, _ = engine.step(state, batches[0])
    expected = loss(jax.device_get(engine.model_params(state)), batches[1], None)
    close(float(engine.evaluate(state, batches[1])), float(expected), rtol=1e-5,
          what="the interleaved pipeline's evaluate against the loss in model order")

    checkpoints = Checkpointer(str(tmp_path / "ckpt"), every=1)
    checkpoints.save(1, state, {}, {}, view=engine.model_order)
    checkpoints.close()
    flat, flat_state = zeroflax.initialize(loss, boxed, optax.adam(1e-3), Config(micro_batch_size=4))
    restored, _, _ = Checkpointer(str(tmp_path / "ckpt")).restore(None, flat_state, flat.state_shardings)
    for a, b in zip(jax.tree.leaves(jax.device_get(restored.params)),
                    jax.tree.leaves(jax.device_get(engine.model_params(state)))):
        np.testing.assert_array_equal(a, b)


def test_untied_embeddings():
    """The embedding (first stage) and the head (last stage) are separate leaves; the tied case (every
    test above) sums both stages' gradients of one leaf over pipe."""
    run_and_compare(pipeline_config({"data": 4, "pipe": 2, "tensor": 1}, 2, micro_batches=4), tie=False)


@pytest.mark.parametrize("schedule_name,virtual", [("1f1b", 1), ("interleaved", 2)])
def test_executed_order_is_the_schedule(schedule_name, virtual):
    """What the compiled step runs, tick by tick on every device, is engine.pipeline_schedule() (for 1f1b:
    DeepSpeed's TrainSchedule)."""
    boxed, loss, batches = gpt_case(layers=4 * virtual)
    config = pipeline_config({"data": 2, "pipe": 4, "tensor": 1}, 0, schedule_name, micro_batches=4,
                             pipeline_virtual_stages=virtual)
    engine, state = zeroflax.initialize(loss, boxed, optax.sgd(0.1), config)
    seen = {}
    with observe_ticks(lambda stage, tick, kind, micro, chunk: seen.setdefault((stage, tick), set()).add(
            None if kind is None else ((kind, micro) if virtual == 1 else (kind, micro, chunk)))):
        state, _ = engine.step(state, batches[0])
        jax.block_until_ready(state)
    schedule = engine.pipeline_schedule()
    if schedule_name == "1f1b":
        assert schedule == [deepspeed_train_schedule(4, 4, s) for s in range(4)]
    for s, ops in enumerate(schedule):
        for t, op in enumerate(ops):
            assert seen[(s, t)] == {op}, (s, t)  # both data replicas of the stage ran the same op


def test_1f1b_memory_does_not_grow_with_micro_batches():
    """S = 4: from M = 4 to 8, 1f1b's temporaries stay the same (at most S inputs in flight); gpipe's grow
    by 4 more micro-batches' stage inputs."""
    model = GPT(GPTConfig(num_layers=4, d_model=32, num_heads=2, max_len=32))
    temps = {}
    for schedule in ("1f1b", "gpipe"):
        for M in (4, 8):
            config = Config(mesh=MeshConfig({"data": 2, "pipe": 4, "tensor": 1}), micro_batch_size=2,
                            grad_accum_steps=M, persistence_threshold=0, pipeline_schedule=schedule)
            batch = {"tokens": np.zeros((2 * 2 * M, 33), np.int32)}
            engine, state = zeroflax.initialize(next_token_loss(model), lambda r, b: model.init(
                r, b["tokens"][:1, :-1])["params"], optax.adam(1e-3), config, sample_batch=batch)
            temps[schedule, M] = zeroflax.memory_report(engine, state, batch).temp
    activation = 2 * 32 * 32 * 4  # one micro-batch's stage input: [2, 32, 32] fp32
    print({k: v / 2**10 for k, v in temps.items()}, "KiB; one stage input", activation / 2**10, "KiB")
    assert abs(temps["1f1b", 8] - temps["1f1b", 4]) <= 0.05 * temps["1f1b", 4]
    grown = temps["gpipe", 8] - temps["gpipe", 4]
    assert 3.5 * activation <= grown <= 5 * activation, grown / activation


# ------------------------------------------------------------------------------------ bad input
def init_gpt(layers):
    model = GPT(GPTConfig(num_layers=layers, d_model=16, num_heads=2, max_len=8))
    return next_token_loss(model), model.init(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))["params"]


def plain_loss(params, batch, rng):
    return jnp.mean((batch["x"] @ params["w"]) ** 2)


def stacked_without_scan_layers(params, batch, rng):
    x = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), batch["x"], params["w"])[0]
    return jnp.mean(x ** 2)


PIPE2 = MeshConfig({"data": 4, "pipe": 2, "tensor": 1})
PIPE4 = MeshConfig({"data": 2, "pipe": 4, "tensor": 1})
INVALID = {
    "unknown schedule": (lambda: Config(pipeline_schedule="zigzag"), "Config.pipeline_schedule"),
    "virtual stages 0": (lambda: Config(pipeline_virtual_stages=0), "Config.pipeline_virtual_stages"),
    "virtual stages with 1f1b": (lambda: Config(pipeline_virtual_stages=2), "Config.pipeline_virtual_stages"),
    "interleaved with one chunk": (lambda: Config(pipeline_schedule="interleaved"), "Config.pipeline_virtual_stages"),
    "1f1b with fewer micro-batches than stages": (
        lambda: Config(mesh=PIPE4, grad_accum_steps=2), "Config.grad_accum_steps"),
    "interleaved micro-batches not divisible by stages": (
        lambda: Config(mesh=PIPE4, grad_accum_steps=6, pipeline_schedule="interleaved", pipeline_virtual_stages=2),
        "Config.grad_accum_steps"),
    "pipe axis -1": (lambda: MeshConfig({"data": 2, "pipe": -1, "tensor": 1}) and Config(
        mesh=MeshConfig({"data": 2, "pipe": -1, "tensor": 1})), "MeshConfig.axes['pipe']"),
    "mesh product is not the device count": (
        lambda: zeroflax.initialize(*init_gpt(4), optax.sgd(0.1), Config(
            mesh=MeshConfig({"data": 2, "pipe": 2, "tensor": 1}), grad_accum_steps=2)), "MeshConfig.axes"),
    "layers not divisible by stages": (
        lambda: zeroflax.initialize(*init_gpt(3), optax.sgd(0.1), Config(mesh=PIPE2, grad_accum_steps=2)),
        "MeshConfig.axes['pipe']"),
    "model without stacked layers": (
        lambda: zeroflax.initialize(plain_loss, {"w": jnp.ones((4, 8))}, optax.sgd(0.1),
                                    Config(mesh=PIPE2, grad_accum_steps=2)), "MeshConfig.axes['pipe']"),
    "layers not divisible by stages x virtual stages": (
        lambda: zeroflax.initialize(*init_gpt(4), optax.sgd(0.1), Config(
            mesh=PIPE2, grad_accum_steps=2, pipeline_schedule="interleaved", pipeline_virtual_stages=4)),
        "Config.pipeline_virtual_stages"),
    "stacked layers the loss does not run with scan_layers": (
        lambda: step_once(stacked_without_scan_layers), "MeshConfig.axes['pipe']"),
    "model state": (
        lambda: zeroflax.initialize(lambda p, b, r, st: (plain_loss(p, b, r), st),
                                    {"params": {"w": jnp.ones((2, 4, 4))}, "batch_stats": {"m": jnp.zeros(4)}},
                                    optax.sgd(0.1), Config(mesh=PIPE2, grad_accum_steps=2),
                                    logical_axes={"w": ("layers", None, None)}, model_state=("batch_stats",)),
        "MeshConfig.axes['pipe']"),
}


def step_once(loss):
    engine, state = zeroflax.initialize(loss, {"w": jnp.ones((2, 4, 4))}, optax.sgd(0.1),
                                        Config(mesh=PIPE2, micro_batch_size=1, grad_accum_steps=2, remat="none"),
                                        logical_axes={"w": ("layers", None, None)})
    return engine.step(state, {"x": np.ones((8, 4), np.float32)})


@pytest.mark.parametrize("name", sorted(INVALID))
def test_invalid_pipeline_configs_name_the_key(name):
    build, key = INVALID[name]
    with pytest.raises(ConfigError) as error:
        build()
    assert key in str(error.value), str(error.value)


@pytest.mark.parametrize("stage", [0, 3])
def test_pipeline_sends_exactly_what_the_schedule_sends(stage):
    """Collective-permute bytes equal the schedule's sends (one micro-batch's activation per pair per
    tick); nothing is all-gathered over pipe (no parameter crosses it); the pipe axis otherwise only sums
    the shared leaves' gradients, and that beside its theory too."""
    boxed, loss, batches = gpt_case()
    engine, state = zeroflax.initialize(loss, boxed, optax.adam(1e-3), pipeline_config(
        {"data": 2, "pipe": 4, "tensor": 1}, stage, micro_batches=8))
    report = zeroflax.comm_report(engine, state, batches[0])
    print(report)
    assert report.permute_bytes == pytest.approx(report.permute_theory, rel=1e-6)
    assert report.by_axis["pipe"] == pytest.approx(report.theory_by_axis["pipe"], rel=0.02)
    assert not [c for c in report.collectives if "pipe" in c["axes"] and c["kind"] == "all-gather"]
