"""Mixed precision: bf16/fp16 compute with fp32 master weights; fp16 dynamic loss scaling with
DeepSpeed's semantics (skip on overflow, hysteresis, window, minimum scale)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflax
from zeroflax.config import LossScaleConfig
from zeroflax.optim.loss_scale import init_loss_scale, update_loss_scale


class PlainScaler:
    """DeepSpeed's dynamic loss scaler, restated in plain Python for comparison."""

    def __init__(self, c: LossScaleConfig):
        self.c, self.scale, self.hysteresis = c, 2.0 ** c.initial_scale_power, c.hysteresis
        self.last_overflow, self.iteration = -1, 0

    def update(self, overflow: bool):
        if overflow:
            if self.hysteresis == 1:
                self.scale = max(self.scale / 2, self.c.min_loss_scale)
            else:
                self.hysteresis -= 1
            self.last_overflow = self.iteration
        else:
            if self.c.consecutive_hysteresis:
                self.hysteresis = self.c.hysteresis
            if (self.iteration - self.last_overflow) % self.c.loss_scale_window == 0:
                if not self.c.consecutive_hysteresis:
                    self.hysteresis = self.c.hysteresis
                self.scale *= 2
        self.iteration += 1


@pytest.mark.parametrize("consecutive", [False, True])
def test_scaler_follows_deepspeed(consecutive):
    config = LossScaleConfig(initial_scale_power=4, loss_scale_window=3, hysteresis=2, min_loss_scale=2.0,
                             consecutive_hysteresis=consecutive)
    rng = np.random.default_rng(7)
    flags = list(rng.random(60) < 0.35) + [True] * 8 + [False] * 7
    plain, state = PlainScaler(config), init_loss_scale(config, enabled=True)
    update = jax.jit(lambda s, o: update_loss_scale(s, o, config, dynamic=True))
    for flag in flags:
        plain.update(bool(flag))
        state = update(state, jnp.asarray(flag))
        assert float(state.scale) == plain.scale
        assert int(state.hysteresis) == plain.hysteresis
    assert plain.scale >= 2.0


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


def test_fp16_overflow_skips_the_step_and_lowers_the_scale():
    engine, state, batch = _poisoned_setup("fp16", initial_scale_power=10, hysteresis=2)
    state, metrics = engine.step(state, batch(1.0))
    assert not bool(metrics["skipped"]) and float(metrics["loss_scale"]) == 1024.0
    before = jax.device_get(state.params)
    state, metrics = engine.step(state, batch(np.inf))  # first overflow: hysteresis absorbs it
    assert bool(metrics["skipped"])
    np.testing.assert_array_equal(jax.device_get(state.params)["w"], before["w"])
    assert float(state.loss_scale.scale) == 1024.0
    state, metrics = engine.step(state, batch(np.inf))  # second overflow: the scale halves
    assert bool(metrics["skipped"]) and float(state.loss_scale.scale) == 512.0
    np.testing.assert_array_equal(jax.device_get(state.params)["w"], before["w"])
    state, metrics = engine.step(state, batch(1.0))
    assert not bool(metrics["skipped"])
    assert not np.array_equal(jax.device_get(state.params)["w"], before["w"])


def test_fp16_large_scale_overflows_in_half_precision_then_recovers():
    # 2**24 times a loss of order 1 overflows fp16 gradients (max 65504): real overflow, no poison.
    engine, state, batch = _poisoned_setup("fp16", initial_scale_power=24, hysteresis=1)
    skipped = []
    for _ in range(12):
        state, metrics = engine.step(state, batch(1.0))
        skipped.append(bool(metrics["skipped"]))
    assert skipped[0] and not skipped[-1]
    assert float(state.loss_scale.scale) < 2.0 ** 24


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
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
    assert abs(losses[precision] - losses["fp32"]) <= 0.02 * losses["fp32"]
    assert losses["fp32"] < np.log(256)
