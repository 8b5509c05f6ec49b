"""The 3D U-Net trains through the engine at ZeRO-3 on 8 simulated devices, and ZeRO-3 gives stage 0's
parameters."""
import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest

import zeroflax
from zeroflax.models.unet3d import UNet3D, UNet3DConfig, segmentation_loss, synthetic_volumes
from tolerance import at_most, claim, relative_error

SIZE = 8  # volumes 8^3: three levels 8 -> 4 -> 2
CONFIG = UNet3DConfig(channels=(4, 8, 16), in_channels=1, num_classes=3, groups=2)
MODEL = UNet3D(CONFIG)  # stride-2 convolutions down
POOL_MODEL = UNet3D(dataclasses.replace(CONFIG, downsample="pool"))  # max pooling down


@functools.cache
def initial_params(model=MODEL):
    """Boxed parameters (logical names kept), made once. The 'unsafe_rbg' key: with the default threefry
    key, XLA:CPU spends ~15 s compiling the initialisers' random bits (Flax folds the key in per module
    and per parameter); the initial values' distribution is the same."""
    image = np.zeros((1, SIZE, SIZE, SIZE, CONFIG.in_channels), np.float32)
    return jax.jit(model.init)(jax.random.key(0, impl="unsafe_rbg"), image)["params"]


def test_synthetic_volumes_are_labelled_objects():
    data = synthetic_volumes(np.random.default_rng(0), 6, SIZE)
    assert data["image"].shape == (6, SIZE, SIZE, SIZE, 1) and data["image"].dtype == np.float32
    assert data["labels"].shape == (6, SIZE, SIZE, SIZE) and data["labels"].dtype == np.int32
    counts = np.bincount(data["labels"].ravel(), minlength=3)
    assert set(np.unique(data["labels"])) <= {0, 1, 2} and counts[0] > counts[1:].sum() > 0
    # The objects are brighter than the background (that much is learnable voxel by voxel).
    fg = data["labels"] > 0
    assert data["image"][..., 0][fg].mean() > data["image"][..., 0][~fg].mean() + 0.8


def test_shapes_dtypes_and_names():
    model = MODEL
    image = np.zeros((2, 8, 8, 8, 1), np.float32)
    params, names = zeroflax.unbox(initial_params())
    for name in jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple)):
        assert name is not None  # every parameter carries logical names
    kernels = [n for n in jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple)) if len(n) == 5]
    assert (None, None, None, "conv_in", "conv_out") in kernels
    bf16 = jax.tree.map(lambda x: x.astype(jax.numpy.bfloat16), params)
    logits = jax.jit(model.apply)({"params": bf16}, image.astype(jax.numpy.bfloat16))
    assert logits.shape == (2, 8, 8, 8, 3) and logits.dtype == np.float32
    with pytest.raises(ValueError, match="multiple of 4"):
        model.apply({"params": params}, np.zeros((1, 6, 8, 8, 1), np.float32))


def test_trains_at_stage3_bf16():
    rng = np.random.default_rng(0)
    config = zeroflax.Config(zero_stage=3, precision="bf16", micro_batch_size=1, persistence_threshold=64,
                             mesh=zeroflax.MeshConfig({"data": -1, "tensor": 1}))
    engine, state = zeroflax.initialize(segmentation_loss(MODEL), initial_params(), optax.adam(1e-2), config)
    specs = [s.spec for s in jax.tree.leaves(engine.plan.params)]
    assert any("data" in spec for spec in specs), specs
    kernel = state.params["enc2"]["conv1"]["kernel"]  # (3, 3, 3, 16, 16): ZeRO on a channel dimension
    assert "data" in kernel.sharding.spec and kernel.addressable_shards[0].data.size == kernel.size // 8
    losses = []
    for _ in range(30):
        state, metrics = engine.step(state, synthetic_volumes(rng, 8, SIZE))
        losses.append(float(metrics["loss"]))
    assert all(np.isfinite(losses))
    initial, final = losses[0], float(np.mean(losses[-5:]))
    print(f"stage 3 bf16 loss: first {initial:.3f}, mean of last 5 {final:.3f}")
    claim(final / initial, 0.7, "the mean of the last 5 losses over the first")


def _run(config, boxed, loss, batches):
    engine, state = zeroflax.initialize(loss, boxed, optax.adam(1e-2), config)
    for batch in batches:
        state, _ = engine.step(state, batch)
    return jax.device_get(engine.model_params(state)), engine


def test_stage3_matches_stage0_fp32():
    rng = np.random.default_rng(1)
    batches = [synthetic_volumes(rng, 16, SIZE) for _ in range(3)]
    boxed, loss = initial_params(POOL_MODEL), segmentation_loss(POOL_MODEL)
    common = dict(precision="fp32", micro_batch_size=2, persistence_threshold=64)
    stage0, _ = _run(zeroflax.Config(zero_stage=0, **common), boxed, loss, batches)
    stage3, engine = _run(zeroflax.Config(zero_stage=3, **common), boxed, loss, batches)
    assert any("data" in s.spec for s in jax.tree.leaves(engine.plan.params))
    a, b = jax.tree.leaves(stage3), jax.tree.leaves(stage0)
    start = jax.tree.leaves(zeroflax.unbox(boxed)[0])
    moved = relative_error(b, start)
    assert moved > 1e-3, moved  # the three steps did change the parameters
    error = relative_error(a, b)
    print(f"stage 3 vs stage 0 relative L2 error after 3 steps: {error:.2e} (parameters moved {moved:.2e})")
    at_most(error, 1e-5, "stage 3 against stage 0")
