"""Small models for the tests: a Linen MLP with logical axis names, a Linen conv net, a plain pytree
with dimensions that 8 does not divide, an NNX MLP, a ResNet with BatchNorm, and residual MLP stacks
written three ways (unscanned Linen, Linen nn.scan, NNX)."""
import functools
from typing import Any, Callable, Sequence

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


class ResNetBlock(nn.Module):
    """A basic residual block in the style of flax/examples/imagenet/models.py: conv, norm and
    activation are passed in, BatchNorm keeps running statistics in the `batch_stats` collection."""

    filters: int
    conv: Any
    norm: Any
    act: Callable
    strides: tuple = (1, 1)

    @nn.compact
    def __call__(self, x):
        residual = x
        y = self.conv(self.filters, (3, 3), self.strides)(x)
        y = self.act(self.norm()(y))
        y = self.conv(self.filters, (3, 3))(y)
        y = self.norm(scale_init=nn.initializers.zeros_init())(y)
        if residual.shape != y.shape:
            residual = self.conv(self.filters, (1, 1), self.strides, name="conv_proj")(residual)
            residual = self.norm(name="norm_proj")(residual)
        return self.act(residual + y)


class ResNet(nn.Module):
    """ResNet with BatchNorm, written the way Flax's ImageNet example writes it (`train` switches the
    statistics between batch and running averages; the train step applies it with mutable=['batch_stats'])."""

    stage_sizes: Sequence[int]
    num_classes: int
    num_filters: int = 64
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = True):
        conv = functools.partial(nn.Conv, use_bias=False, dtype=self.dtype)
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9, epsilon=1e-5,
                                 dtype=self.dtype)
        x = conv(self.num_filters, (7, 7), (2, 2), padding=[(3, 3), (3, 3)], name="conv_init")(x)
        x = nn.relu(norm(name="bn_init")(x))
        x = nn.max_pool(x, (3, 3), strides=(2, 2), padding="SAME")
        for i, block_size in enumerate(self.stage_sizes):
            for j in range(block_size):
                strides = (2, 2) if i > 0 and j == 0 else (1, 1)
                x = ResNetBlock(self.num_filters * 2 ** i, conv=conv, norm=norm, act=nn.relu, strides=strides)(x)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, dtype=self.dtype)(x).astype(jnp.float32)


def resnet18(num_classes: int = 10, num_filters: int = 64):
    return ResNet(stage_sizes=(2, 2, 2, 2), num_classes=num_classes, num_filters=num_filters)


def dense(features, names):
    """nn.Dense with logical names on the kernel and the bias."""
    return nn.Dense(features, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), names),
                    bias_init=nn.with_logical_partitioning(nn.initializers.normal(0.1), (names[1],)))


class Block(nn.Module):
    """d -> hidden -> d with a residual (the unit of issue 7's memory figures: 512 -> 2048 -> 512)."""

    d: int = 32
    hidden: int = 128

    @nn.compact
    def __call__(self, x):
        h = nn.gelu(dense(self.hidden, ("embed", "mlp"))(x))
        return x + dense(self.d, ("mlp", "embed"))(h)


class DeepMLP(nn.Module):
    """An unscanned Linen model: `blocks` Block modules one after another, then a head."""

    blocks: int = 4
    d: int = 32
    hidden: int = 128
    out: int = 8

    @nn.compact
    def __call__(self, x):
        for _ in range(self.blocks):
            x = Block(self.d, self.hidden)(x)
        return dense(self.out, ("embed", None))(x)


class _ScanBlock(nn.Module):
    d: int
    hidden: int

    @nn.compact
    def __call__(self, x, _):
        return Block(self.d, self.hidden)(x), None


class ScannedMLP(DeepMLP):
    """The same stack as a Linen nn.scan; 'layers' names the stacked dimension (metadata_params)."""

    @nn.compact
    def __call__(self, x):
        stack = nn.scan(_ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=self.blocks,
                        metadata_params={nn.PARTITION_NAME: "layers"})
        x, _ = stack(self.d, self.hidden)(x, None)
        return dense(self.out, ("embed", None))(x)


class NNXBlock(nnx.Module):
    def __init__(self, d, hidden, rngs):
        self.up = nnx.Linear(d, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, d, rngs=rngs)

    def __call__(self, x):
        return x + self.down(jax.nn.gelu(self.up(x)))


class NNXNet(nnx.Module):
    """The same kind of stack in NNX: blocks in an nnx.List, then a head."""

    def __init__(self, rngs, blocks=3, d=32, hidden=128, out=8):
        self.blocks = nnx.List([NNXBlock(d, hidden, rngs) for _ in range(blocks)])
        self.head = nnx.Linear(d, out, rngs=rngs)

    def __call__(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)
