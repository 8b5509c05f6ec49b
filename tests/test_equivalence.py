"""ZeRO stages 0-3 on 8 simulated devices give the parameters of a plain single-device optax loop.

Deterministic: every case runs on fixed seeds. `ZEROFLAX_SOAK=N` (opt-in, never in CI) runs each case on
N further seeds instead; a failure's test id names its seed.

The bound is the reference loop's own rounding noise, measured in the same run on the same CPU
(tests/noise_floor.py: the argument, the factor and the clamps). The optimizer is chosen to keep that noise
small. Adam turns a gradient error dg into an update error of about lr * dg / (|g| + eps): harmless where
|g| is large, but an element whose terms cancel (|g| << eps) can take up to 2 * lr per step. With optax's
default eps 1e-8 and lr 1e-2, one such element in w2 of the 'odd' case put the whole vector at 1.0e-5 on a
2-core run (seed 943750582); with eps 1e-6 and lr 1e-3 the same seed gives 4.4e-8, and a soak over 8 seeds
per case (ZEROFLAX_SOAK=8, 170 runs) measured at most 1.7e-7. A wrong engine (a gradient scaled by N, a
shard updated twice, a missing all-reduce) is off by the parameters' movement itself, about 1e-3 relative
after 5 steps (tests/test_noise_floor.py).
"""
import functools
import os

import jax
import numpy as np
import optax
import pytest

import zeroflax
from zeroflax.models.gpt import GPT, GPTConfig, next_token_loss
from models import MLP, ConvNet, linen_case, odd_loss, odd_params
from noise_floor import assert_matches, noise_floor

STEPS = 5
LR = 1e-3
EPS = 1e-6
SOAK = int(os.environ.get("ZEROFLAX_SOAK", "0"))
SEEDS = list(range(1000, 1000 + SOAK)) if SOAK else [0]


def adamw(**kwargs):
    """The optimizer of every equivalence case (see the module docstring for lr and eps)."""
    return optax.adamw(LR, eps=EPS, **kwargs)


@pytest.fixture(params=SEEDS, ids=lambda s: f"seed{s}")
def seed(request):
    return request.param


def reference_step(loss_fn, optimizer):
    """One step of the plain single-device optax loop, jitted (one compile serves every run of it)."""
    @jax.jit
    def step(params, state, batch):
        grads = jax.grad(loss_fn)(params, batch, None)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state
    return step


def reference_run(loss_fn, params, optimizer, batches, step=None):
    """The reference: the plain optax loop on one device, in float32."""
    step = step or reference_step(loss_fn, optimizer)
    state = optimizer.init(params)
    for batch in batches:
        params, state = step(params, state, batch)
    return jax.device_get(params)


def reference_and_floor(loss_fn, params, optimizer, batches, block=1):
    """The reference loop's parameters and their noise floor (tests/noise_floor.py)."""
    step = reference_step(loss_fn, optimizer)
    run = lambda reordered: reference_run(loss_fn, params, optimizer, reordered, step)  # noqa: E731
    reference = run(batches)
    return reference, noise_floor(run, batches, reference, block)


OPTIMIZERS = {"adamw": adamw, "adamw_wd": lambda: adamw(weight_decay=0.1),
              "clip_adam": lambda: optax.chain(optax.clip_by_global_norm(0.05), optax.adam(LR, eps=EPS))}


@functools.cache
def expected(model, optimizer, seed):
    """(reference parameters, noise floor) of a case under OPTIMIZERS[optimizer], shared by the tests."""
    boxed, loss, batches = make_case(model, seed)
    return reference_and_floor(loss, zeroflax.unbox(boxed)[0], OPTIMIZERS[optimizer](), batches)


def engine_run(loss_fn, params, optimizer, batches, config, **kwargs):
    engine, state = zeroflax.initialize(loss_fn, params, optimizer, config, **kwargs)
    for batch in batches:
        state, metrics = engine.step(state, batch)
        assert np.isfinite(float(metrics["loss"]))
    return jax.device_get(engine.model_params(state)), engine


def make_case(name, seed):
    rng = np.random.default_rng(seed)
    key = jax.random.PRNGKey(seed)
    if name == "mlp":
        init, loss, make = linen_case(MLP(), (16,), 8)
    elif name == "conv":
        init, loss, make = linen_case(ConvNet(), (8, 8, 3), 4)
    elif name == "odd":
        init = lambda k, batch: odd_params(k)
        loss = odd_loss
        make = lambda r, n: {"x": r.normal(size=(n, 7)).astype(np.float32),
                             "y": r.normal(size=(n, 3)).astype(np.float32)}
    elif name == "gpt":
        model = GPT(GPTConfig(num_layers=2, d_model=32, num_heads=2, max_len=16))
        init = lambda k, batch: model.init(k, batch["tokens"][:, :-1])["params"]
        loss = next_token_loss(model)
        make = lambda r, n: {"tokens": r.integers(0, 256, size=(n, 17)).astype(np.int32)}
    batches = [make(rng, 32) for _ in range(STEPS)]
    boxed = init(key, batches[0])
    return boxed, loss, batches


@pytest.mark.parametrize("model", ["mlp", "conv", "odd", "gpt"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_stage_matches_optax(model, stage, seed):
    boxed, loss, batches = make_case(model, seed)
    config = zeroflax.Config(zero_stage=stage, micro_batch_size=4, persistence_threshold=0)
    params, engine = engine_run(loss, boxed, OPTIMIZERS["adamw_wd"](), batches, config)
    if stage == 3 and model != "odd":  # something really is partitioned
        specs = [s.spec for s in jax.tree.leaves(engine.plan.params)]
        assert any("data" in spec for spec in specs)
    assert_matches(params, *expected(model, "adamw_wd", seed), f"{model} stage {stage} seed {seed}")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_accumulation_matches_whole_batch(stage, seed):
    model = "gpt" if stage == 3 else "mlp"
    boxed, loss, batches = make_case(model, seed)
    config = zeroflax.Config(zero_stage=stage, micro_batch_size=1, grad_accum_steps=4, persistence_threshold=0)
    params, _ = engine_run(loss, boxed, adamw(), batches, config)
    assert_matches(params, *expected(model, "adamw", seed), f"{model} stage {stage} seed {seed}")


# XLA:CPU's runtime from jaxlib 0.11 on (docs/perf.md, "jax 0.11 on simulated CPU devices"): this GPT's
# stage-3 step on data 4 x tensor 2 schedules two entry gathers after the layer loop, ordered only by the
# loop's start, and with every shard_map collective on channel id 1 a device can join another collective's
# rendezvous: an abort, a hang or a NaN loss, in 4 of 4 runs of this case alone. Not seen on jax 0.10.2
# (this case passes there in every suite run) nor possible on GPUs (NCCL runs collectives in issue order).
XLA_CPU_RACE = pytest.mark.skipif(jax.__version_info__ >= (0, 11), reason="XLA:CPU collective race on jaxlib >= 0.11 "
                                  "(docs/perf.md): aborts the process")


@pytest.mark.parametrize("model,stage", [("mlp", 2), ("mlp", 3), pytest.param("gpt", 3, marks=XLA_CPU_RACE),
                                         ("conv", 1)])
def test_data_by_tensor_mesh(model, stage, seed):
    boxed, loss, batches = make_case(model, seed)
    config = zeroflax.Config(mesh=zeroflax.MeshConfig({"data": 4, "tensor": 2}), zero_stage=stage,
                             micro_batch_size=8, persistence_threshold=0)
    params, engine = engine_run(loss, boxed, adamw(), batches, config)
    if model != "conv":  # the logical names put some leaves on the tensor axis, ZeRO on data
        specs = [s.spec for s in jax.tree.leaves(engine.plan.opt_state) if hasattr(s, "spec")]
        assert any("tensor" in spec and "data" in spec for spec in specs)
    assert_matches(params, *expected(model, "adamw", seed), f"{model} stage {stage} data x tensor seed {seed}")


def test_clipping_matches_optax_chain(seed):
    boxed, loss, batches = make_case("mlp", seed)
    config = zeroflax.Config(zero_stage=2, micro_batch_size=4, grad_clip=0.05, persistence_threshold=0)
    params, _ = engine_run(loss, boxed, optax.adam(LR, eps=EPS), batches, config)
    assert_matches(params, *expected("mlp", "clip_adam", seed), f"mlp clipped seed {seed}")


def test_init_function_creates_partitioned_params(seed):
    model = GPT(GPTConfig(num_layers=2, d_model=32, num_heads=2, max_len=16))
    batch = {"tokens": np.zeros((32, 17), np.int32)}
    init = lambda k, b: model.init(k, b["tokens"][:, :-1])["params"]
    config = zeroflax.Config(zero_stage=3, micro_batch_size=4, persistence_threshold=0, seed=seed)
    engine, state = zeroflax.initialize(next_token_loss(model), init, optax.adam(1e-3), config,
                                        sample_batch=batch)
    w = state.params["w_in"]
    assert w.sharding.spec == jax.sharding.PartitionSpec(None, "data", None) or "data" in w.sharding.spec
    assert w.addressable_shards[0].data.size == w.size // 8
