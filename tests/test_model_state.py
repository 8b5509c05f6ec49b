"""Model state (BatchNorm statistics) travels through the step: a ResNet-18 written as Flax's examples
write it trains through `initialize` at stages 0-3 and equals Flax's own per-device train-step pattern.

The reference runs the model once per device on that device's rows with mutable=['batch_stats'] and
averages the 8 gradients and the 8 new statistics, which is what data parallelism with per-device
BatchNorm computes. fp32 (lr 1e-3, eps 1e-6, 3 steps); the bound is the reference's own rounding noise,
measured with each device's rows reordered among and within the devices' blocks (tests/noise_floor.py).
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflax
from models import resnet18
from noise_floor import assert_matches, noise_floor
from tolerance import close, relative_error

DEVICES = 8
MICRO = 4
STEPS = 3
MODEL = resnet18(num_classes=4, num_filters=8)


def cross_entropy(logits, labels):
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def loss_fn(params, batch, rng, state):
    """The engine's form: (loss, new state); rng None (evaluate) selects the running averages."""
    train = rng is not None
    logits, updates = MODEL.apply({"params": params, **state}, batch["image"], train=train, mutable=["batch_stats"])
    return cross_entropy(logits, batch["label"]), updates


@functools.cache
def setup():
    rng = np.random.default_rng(0)
    batches = [{"image": rng.normal(size=(DEVICES * MICRO, 32, 32, 3)).astype(np.float32),
                "label": rng.integers(0, 4, size=(DEVICES * MICRO,)).astype(np.int32)} for _ in range(STEPS)]
    variables = jax.jit(functools.partial(MODEL.init, train=False))(jax.random.PRNGKey(0), batches[0]["image"][:1])
    return variables, batches


def optimizer():
    return optax.adamw(1e-3, eps=1e-6)


@functools.cache
def reference():
    """Flax's train step per device, gradients and new statistics averaged over the devices, and the noise
    floor of (parameters, statistics): both kinds of leaf are compared."""
    variables, batches = setup()
    expected = reference_run(variables, batches)
    return expected, noise_floor(lambda reordered: reference_run(variables, reordered), batches, expected, block=MICRO)


@jax.jit
def device_step(params, stats, image, label):
    """Flax's train step on one device's rows: the gradient and the new statistics."""
    def loss(p):
        logits, updates = MODEL.apply({"params": p, "batch_stats": stats}, image, mutable=["batch_stats"])
        return cross_entropy(logits, label), updates["batch_stats"]
    return jax.grad(loss, has_aux=True)(params)


def reference_run(variables, batches):
    params, stats = variables["params"], variables["batch_stats"]
    opt = optimizer()
    opt_state = opt.init(params)
    for batch in batches:
        results = [device_step(params, stats, batch["image"][d * MICRO:(d + 1) * MICRO],
                               batch["label"][d * MICRO:(d + 1) * MICRO]) for d in range(DEVICES)]
        grads = jax.tree.map(lambda *g: sum(g) / DEVICES, *[r[0] for r in results])
        stats = jax.tree.map(lambda *s: sum(s) / DEVICES, *[r[1] for r in results])
        updates, opt_state = opt.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return params, stats


# Stage 1 is left out: its model state is handled exactly as stage 2's (replicated, averaged over `data`).
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_resnet18_batch_stats_match_flax_per_device(stage):
    variables, batches = setup()
    config = zeroflax.Config(zero_stage=stage, micro_batch_size=MICRO, persistence_threshold=0,
                             prefetch_bucket_size=20_000)
    engine, state = zeroflax.initialize(loss_fn, variables, optimizer(), config, model_state=("batch_stats",))
    assert jax.tree.structure(state.model_state) == jax.tree.structure({"batch_stats": variables["batch_stats"]})
    for batch in batches:
        state, metrics = engine.step(state, batch)
        assert np.isfinite(float(metrics["loss"]))
    (ref_params, ref_stats), floor = reference()
    params, stats = jax.device_get((engine.model_params(state), state.model_state["batch_stats"]))
    moved = relative_error(ref_stats, variables["batch_stats"])
    assert moved > 1e-2, moved  # the statistics really were updated
    assert_matches((params, stats), (ref_params, ref_stats), floor, f"ResNet-18 stage {stage}: parameters and statistics")
    # Every device holds the same (averaged) statistics.
    leaf = jax.tree.leaves(state.model_state)[0]
    shards = [np.asarray(s.data) for s in leaf.addressable_shards]
    assert all(np.array_equal(shards[0], s) for s in shards[1:])
    if stage == 3:
        assert engine.gather_usage.groups, "the ResNet's blocks run as gather groups"
        # evaluate uses the running statistics and leaves them as they are
        before = jax.device_get(state.model_state)
        eval_loss = float(engine.evaluate(state, batches[0]))
        logits = MODEL.apply({"params": params, "batch_stats": stats}, batches[0]["image"], train=False)
        close(eval_loss, float(cross_entropy(logits, batches[0]["label"])), rtol=1e-5,
              what="evaluate against the model's loss with the running statistics")
        assert jax.tree.all(jax.tree.map(np.array_equal, before, jax.device_get(state.model_state)))


def test_model_state_names_a_missing_collection():
    variables, _ = setup()
    with pytest.raises(zeroflax.ConfigError, match=r"^model_state: collections \['cache'\]"):
        zeroflax.initialize(loss_fn, variables, optimizer(), zeroflax.Config(), model_state=("cache",))
    with pytest.raises(zeroflax.ConfigError, match="^model_state: .*'params' entry"):
        zeroflax.initialize(loss_fn, variables["params"], optimizer(), zeroflax.Config(), model_state=("batch_stats",))


def test_model_state_is_checkpointed_and_restored(tmp_path):
    from zeroflax.checkpoint import Checkpointer

    variables, batches = setup()
    config = zeroflax.Config(zero_stage=3, micro_batch_size=MICRO, persistence_threshold=0)
    engine, state = zeroflax.initialize(loss_fn, variables, optimizer(), config, model_state=("batch_stats",))
    state, _ = engine.step(state, batches[0])
    saved = jax.device_get(state.model_state)
    checkpoints = Checkpointer(str(tmp_path / "ckpt"), every=1, asynchronous=False)
    checkpoints.save(1, state, {"epoch": 0}, {})
    checkpoints.close()
    # A fresh engine at another stage restores the statistics exactly.
    engine1, fresh = zeroflax.initialize(loss_fn, variables, optimizer(), config.replace(zero_stage=1),
                                         model_state=("batch_stats",))
    restored, _, _ = Checkpointer(str(tmp_path / "ckpt")).restore(None, fresh, engine1.state_shardings)
    assert jax.tree.all(jax.tree.map(np.array_equal, saved, jax.device_get(restored.model_state)))
    assert not jax.tree.all(jax.tree.map(np.array_equal, saved, jax.device_get(fresh.model_state)))
