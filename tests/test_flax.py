"""Flax Linen and NNX models train through the same `initialize` (small adapters, one engine)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import zeroflax
from models import MLP, NNXMLP, linen_case
from tolerance import close, claim


def train(loss_fn, params, config, make_batch, steps=25, **kwargs):
    engine, state = zeroflax.initialize(loss_fn, params, optax.adam(1e-2), config, **kwargs)
    batch = make_batch()
    losses = []
    for _ in range(steps):
        state, metrics = engine.step(state, batch)
        losses.append(float(metrics["loss"]))
    return losses, engine, state


def test_linen_model_trains_with_logical_names():
    rng = np.random.default_rng(0)
    init, loss, make = linen_case(MLP(), (16,), 8)
    config = zeroflax.Config(mesh=zeroflax.MeshConfig({"data": 4, "tensor": 2}), zero_stage=3,
                             micro_batch_size=4, persistence_threshold=0)
    losses, engine, state = train(loss, init, config, lambda: make(rng, 16), sample_batch=make(rng, 16))
    claim(losses[-1] / losses[0], 0.5, "the last loss over the first")
    kernel = state.params["Dense_0"]["kernel"]  # names ('embed', 'mlp'): mlp -> tensor, ZeRO on embed
    assert kernel.sharding.spec == jax.sharding.PartitionSpec("data", "tensor")


def test_nnx_model_trains():
    rng = np.random.default_rng(1)
    params, apply = zeroflax.nnx_split(NNXMLP(nnx.Rngs(0)))

    def loss_fn(p, batch, key):
        return jnp.mean((apply(p, batch["x"]) - batch["y"]) ** 2)

    make = lambda: {"x": rng.normal(size=(16, 6)).astype(np.float32),
                    "y": rng.normal(size=(16, 2)).astype(np.float32)}
    config = zeroflax.Config(zero_stage=2, micro_batch_size=2, persistence_threshold=0)
    losses, engine, state = train(loss_fn, params, config, make)
    claim(losses[-1] / losses[0], 0.5, "the last loss over the first")
    # The trained parameters load back into the NNX module.
    model = NNXMLP(nnx.Rngs(0))
    graphdef, model_params, rest = nnx.split(model, nnx.Param, ...)
    nnx.replace_by_pure_dict(model_params, jax.device_get(engine.model_params(state)))
    model = nnx.merge(graphdef, model_params, rest)
    batch = make()
    close(model(batch["x"]), apply(jax.device_get(engine.model_params(state)), batch["x"]), rtol=1e-6,
          what="the NNX module with the trained parameters against the engine's apply")
