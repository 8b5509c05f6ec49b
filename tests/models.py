"""Small models for the tests: a Linen MLP with logical axis names, a Linen conv net, a plain pytree
with dimensions that 8 does not divide, and an NNX MLP."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class MLP(nn.Module):
    hidden: int = 64
    out: int = 8

    @nn.compact
    def __call__(self, x):
        dense = lambda n, names: nn.Dense(n, kernel_init=nn.with_logical_partitioning(
            nn.initializers.lecun_normal(), names))
        x = jnp.tanh(dense(self.hidden, ("embed", "mlp"))(x))
        x = jnp.tanh(dense(self.hidden, ("mlp", "embed"))(x))
        return dense(self.out, ("embed", None))(x)


class ConvNet(nn.Module):
    @nn.compact
    def __call__(self, x):  # x: [batch, 8, 8, 3]
        x = nn.relu(nn.Conv(16, (3, 3))(x))
        x = nn.relu(nn.Conv(16, (3, 3), strides=2)(x))
        x = x.reshape(x.shape[0], -1)
        return nn.Dense(4)(x)


def regression_loss(apply):
    def loss_fn(params, batch, rng):
        pred = apply(params, batch["x"]).astype(jnp.float32)
        return jnp.mean((pred - batch["y"]) ** 2)
    return loss_fn


def linen_case(module, x_shape, y_dim, seed=0):
    """(init_fn(rng, batch) -> boxed params, loss_fn, batch maker)."""
    init = lambda rng, batch: module.init(rng, batch["x"])["params"]
    loss = regression_loss(lambda p, x: module.apply({"params": p}, x))
    return init, loss, lambda rng, n: {
        "x": rng.normal(size=(n,) + x_shape).astype(np.float32),
        "y": rng.normal(size=(n, y_dim)).astype(np.float32)}


def odd_params(rng):
    """Leaves with dimensions 8 does not divide (7, 13, 5, 3) next to divisible ones."""
    k = jax.random.split(rng, 4)
    return {"w1": jax.random.normal(k[0], (7, 24)) * 0.3, "b1": jnp.zeros((24,)),
            "w2": jax.random.normal(k[1], (24, 13)) * 0.3, "w3": jax.random.normal(k[2], (13, 5)) * 0.3,
            "b3": jnp.zeros((5,)), "scale": jnp.ones((3,))}


def odd_loss(params, batch, rng):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    h = jnp.tanh(h @ params["w2"])
    out = h @ params["w3"] + params["b3"]
    return jnp.mean((out[:, :3] * params["scale"] - batch["y"]) ** 2)


class NNXMLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(6, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 2, rngs=rngs)

    def __call__(self, x):
        return self.l2(jnp.tanh(self.l1(x)))
