"""Mixed precision: bf16/fp16 compute with fp32 master weights; fp16 dynamic loss scaling with
DeepSpeed's semantics (skip on overflow, hysteresis, window, minimum scale)."""
import dataclasses
import functools
import json
import os
import pathlib
import platform
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflax
from zeroflax.config import LossScaleConfig
from zeroflax.optim.loss_scale import init_loss_scale, update_loss_scale
from cli_helpers import ROOT, xla_flags_without_device_count
from tolerance import claim


# Traces of DeepSpeed's own DynamicLossScaler, built from JSON `fp16` blocks the way its ZeRO optimizers build
# it, and stepped over scripted overflow sequences (tools/gen_loss_scale_traces.py; the file records the
# DeepSpeed commit). Restating DeepSpeed's rule here instead would only test zeroflax against our reading of it.
TRACES = json.loads((pathlib.Path(__file__).parent / "data" / "loss_scale_traces.json").read_text())


def test_traces_cover_the_rules():
    """A regenerated trace file must keep exercising every rule the replay checks."""
    dynamic = [t for t in TRACES["traces"] if t["fp16"]["loss_scale"] == 0]
    keys = {(t["fp16"]["loss_scale_window"], t["fp16"]["hysteresis"], t["fp16"]["consecutive_hysteresis"])
            for t in dynamic}
    assert {(w, h, c) for w in (1, 2, 3, 5) for h in (1, 2, 3) for c in (False, True)} <= keys
    assert sum(bool(t["raises_at"]) for t in dynamic) >= 5  # overflows at the minimum scale
    assert any(t["fp16"]["loss_scale"] > 0 for t in TRACES["traces"])  # a static scale
    assert max(len(t["overflow"]) for t in dynamic) > 2 * 1000  # two windows of DeepSpeed's default 1000


def test_config_is_deepspeeds_fp16_block():
    """LossScaleConfig's fields are the scaler keys of DeepSpeed's `fp16` block, with its defaults, and its
    engine builds the scaler to raise at the minimum scale (what min_scale_overflows stands in for)."""
    defaults = {f.name: f.default for f in dataclasses.fields(LossScaleConfig)}
    assert defaults == TRACES["fp16_defaults"]
    assert TRACES["engine_scaler"]["raise_error_at_min_scale"] is True


@functools.lru_cache(maxsize=None)
def _replayed() -> dict:
    """Every trace's states after each of its steps, by trace name. The dynamic traces run in one compiled
    scan, vmapped over the traces (padded with good steps to one length) with each config's fields as
    arrays: update_loss_scale only does arithmetic on them, so one compilation serves 40-odd configs."""
    traces = TRACES["traces"]
    configs = [LossScaleConfig(**t["fp16"]) for t in traces]  # DeepSpeed's keys are our fields, one for one
    dynamic = [c.loss_scale == 0 for c in configs]  # as step/scaler.py's LossScaler.dynamic decides
    out = {}
    for is_dynamic in (True, False):
        group = [i for i, d in enumerate(dynamic) if d == is_dynamic]
        flags = np.zeros((len(group), max(len(traces[i]["overflow"]) for i in group)), bool)
        for row, i in enumerate(group):
            flags[row, :len(traces[i]["overflow"])] = traces[i]["overflow"]
        fields = {f.name: np.asarray([getattr(configs[i], f.name) for i in group],
                                     {bool: bool, int: np.int32, float: np.float32}[type(f.default)])
                  for f in dataclasses.fields(LossScaleConfig)}
        initial = jax.tree.map(lambda *x: jnp.stack(x), *[init_loss_scale(configs[i], enabled=True) for i in group])

        def replay(state, fields, flags):
            config = types.SimpleNamespace(**fields)

            def step(state, overflow):
                state = update_loss_scale(state, overflow, config, is_dynamic)
                return state, state

            return jax.lax.scan(step, state, flags)[1]

        states = jax.device_get(jax.jit(jax.vmap(replay))(initial, fields, flags))
        out.update({traces[i]["name"]: jax.tree.map(lambda x: x[row, :len(traces[i]["overflow"])], states)
                    for row, i in enumerate(group)})
    return out


@pytest.mark.parametrize("trace", TRACES["traces"], ids=lambda t: t["name"])
def test_scaler_replays_deepspeed_trace(trace):
    initial = init_loss_scale(LossScaleConfig(**trace["fp16"]), enabled=True)
    assert float(initial.scale) == trace["initial"]["scale"]
    states = _replayed()[trace["name"]]
    steps = np.arange(len(trace["overflow"]))
    expected = {"scale": np.asarray(trace["scale"], np.float32),
                # a DeepSpeed run ends at its first exception; the count is how zeroflax reports such steps
                "min_scale_overflows": np.cumsum(np.isin(steps, trace["raises_at"]))}
    if trace["initial"]["hysteresis"] is not None:  # DeepSpeed's static scaler has no hysteresis
        assert int(initial.hysteresis) == trace["initial"]["hysteresis"]
        expected["hysteresis"] = np.asarray(trace["hysteresis"])
    for field, want in expected.items():
        got = np.asarray(getattr(states, field))
        wrong = np.flatnonzero(got != want)
        if wrong.size:
            at = wrong[0]
            pytest.fail(f"{trace['name']}: {field} differs from DeepSpeed's first at step {at}: {got[at]} != "
                        f"{want[at]}; overflow flags of steps {max(0, at - 20)}..{at}: "
                        f"{trace['overflow'][max(0, at - 20):at + 1]}")


def _poisoned_setup(precision, **scale_kwargs):
    def loss_fn(params, batch, rng):
        pred = batch["x"] @ params["w"]
        return jnp.mean((pred.astype(jnp.float32) - batch["y"]) ** 2) * batch["poison"][0]

    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(8, 4)) * 0.3, jnp.float32)}
    config = zeroflax.Config(precision=precision, micro_batch_size=2, loss_scale=LossScaleConfig(**scale_kwargs))
    engine, state = zeroflax.initialize(loss_fn, params, optax.adam(1e-2), config)

    def batch(poison):
        return {"x": rng.normal(size=(16, 8)).astype(np.float32), "y": rng.normal(size=(16, 4)).astype(np.float32),
                "poison": np.full((16,), poison, np.float32)}

    return engine, state, batch


@pytest.mark.fp16
def test_fp16_overflow_skips_the_step_and_lowers_the_scale():
    engine, state, batch = _poisoned_setup("fp16", initial_scale_power=10, hysteresis=2)
    state, metrics = engine.step(state, batch(1.0))
    assert not bool(metrics["skipped"]) and float(metrics["loss_scale"]) == 1024.0
    before = jax.device_get(engine.model_params(state))
    state, metrics = engine.step(state, batch(np.inf))  # first overflow: hysteresis absorbs it
    assert bool(metrics["skipped"])
    np.testing.assert_array_equal(jax.device_get(engine.model_params(state))["w"], before["w"])
    assert float(state.loss_scale.scale) == 1024.0
    state, metrics = engine.step(state, batch(np.inf))  # second overflow: the scale halves
    assert bool(metrics["skipped"]) and float(state.loss_scale.scale) == 512.0
    np.testing.assert_array_equal(jax.device_get(engine.model_params(state))["w"], before["w"])
    state, metrics = engine.step(state, batch(1.0))
    assert not bool(metrics["skipped"])
    assert not np.array_equal(jax.device_get(engine.model_params(state))["w"], before["w"])


@pytest.mark.fp16
def test_fp16_overflow_at_the_minimum_scale_is_counted_in_the_train_state():
    # Halving 2 -> 1 reaches the minimum (no error); the next overflow there is where DeepSpeed's ZeRO
    # optimizers raise. The jitted step skips it, keeps the scale and counts it in the train state.
    engine, state, batch = _poisoned_setup("fp16", initial_scale_power=1, hysteresis=1, min_loss_scale=1)
    state, metrics = engine.step(state, batch(np.inf))
    assert bool(metrics["skipped"]) and float(state.loss_scale.scale) == 1.0
    assert int(state.loss_scale.min_scale_overflows) == 0
    before = jax.device_get(engine.model_params(state))
    state, metrics = engine.step(state, batch(np.inf))
    assert bool(metrics["skipped"]) and float(state.loss_scale.scale) == 1.0
    assert int(state.loss_scale.min_scale_overflows) == 1
    np.testing.assert_array_equal(jax.device_get(engine.model_params(state))["w"], before["w"])
    state, metrics = engine.step(state, batch(1.0))
    assert not bool(metrics["skipped"]) and int(state.loss_scale.min_scale_overflows) == 1


@pytest.mark.fp16
def test_fp16_large_scale_overflows_in_half_precision_then_recovers():
    # 2**24 times a loss of order 1 overflows fp16 gradients (max 65504): real overflow, no poison.
    engine, state, batch = _poisoned_setup("fp16", initial_scale_power=24, hysteresis=1)
    skipped = []
    for _ in range(12):
        state, metrics = engine.step(state, batch(1.0))
        skipped.append(bool(metrics["skipped"]))
    assert skipped[0] and not skipped[-1]
    assert float(state.loss_scale.scale) < 2.0 ** 24


@pytest.mark.parametrize("precision", ["bf16", pytest.param("fp16", marks=pytest.mark.fp16)])
def test_half_precision_tracks_fp32(precision):
    from zeroflax.models.gpt import GPT, GPTConfig, next_token_loss
    model = GPT(GPTConfig(num_layers=2, d_model=32, num_heads=2, max_len=16))
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(0, 64, size=(16, 17)).astype(np.int32)}
    params = model.init(jax.random.PRNGKey(0), batch["tokens"][:, :-1])["params"]
    losses = {}
    for p in ("fp32", precision):
        config = zeroflax.Config(zero_stage=3, precision=p, micro_batch_size=2, persistence_threshold=0)
        engine, state = zeroflax.initialize(next_token_loss(model), params, optax.adam(3e-3), config)
        for _ in range(10):
            state, metrics = engine.step(state, batch)
        losses[p] = float(metrics["loss"])
        assert state.params["w_in"].dtype == jnp.float32  # master weights stay fp32
    claim(abs(losses[precision] - losses["fp32"]) / losses["fp32"], 0.02, f"{precision}'s loss after 10 steps against fp32's")
    assert losses["fp32"] < np.log(256)


FP16_REFUSED = r"""
import jax.numpy as jnp, optax, zeroflax
from zeroflax.platform import float16_compiles
print("float16 compiles:", float16_compiles("cpu"))
loss = lambda p, b, r: jnp.sum(p["w"]) * jnp.mean(b["x"])
for precision in ("fp16", "bf16"):
    try:
        zeroflax.initialize(loss, {"w": jnp.ones(4)}, optax.sgd(0.1), zeroflax.Config(precision=precision))
        print(precision, "initialized")
    except zeroflax.ConfigError as error:
        print(precision, "refused:", error.key)
"""


@pytest.mark.skipif(platform.machine() != "x86_64", reason="--xla_cpu_max_isa=SSE4_2 caps an x86-64 CPU")
def test_fp16_is_refused_by_key_where_xla_cannot_compile_float16():
    """XLA's CPU code capped at SSE4.2 (no F16C) cannot link a float16 conversion (zeroflax/platform.py):
    initialize refuses Config.precision='fp16' with a ConfigError naming the key, and bf16 still runs. In a
    subprocess: the cap is read when the backend starts."""
    flags = f"{xla_flags_without_device_count()} --xla_cpu_max_isa=SSE4_2 --xla_force_host_platform_device_count=2"
    done = subprocess.run([sys.executable, "-c", FP16_REFUSED], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "XLA_FLAGS": flags}, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:3] == ["float16 compiles: False", "fp16 refused: Config.precision",
                                          "bf16 initialized"], done.stdout
