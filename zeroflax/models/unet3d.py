"""A small 3D U-Net for volumetric segmentation: conv encoder, transposed-conv decoder, skip concatenation.

    level 0   [conv block c0] ------------------------------------ concat -> [conv block c0] -> 1x1x1 head
    level 1       down -> [conv block c1] ------------ concat -> [conv block c1] -> up
    level 2                   down -> [conv block c2] -> up

A conv block is two (3x3x3 conv -> GroupNorm -> SiLU); `down` halves D, H and W (a stride-2 3x3x3 conv
or 2x2x2 max pooling) and `up` doubles them (a 2x2x2 stride-2 `nn.ConvTranspose`). There is no
BatchNorm: the engine's loss is a pure function of the parameters, so normalisation must not keep
running statistics (GroupNorm normalises each example on its own).

Every parameter carries logical axis names: conv kernels `(None, None, None, 'conv_in', 'conv_out')`,
biases and GroupNorm scale/bias `('conv_out',)`, the head's class dimension `None` (class counts are
rarely divisible by a tensor axis). With the default rules `conv_out` maps to the `tensor` axis, so
tensor slicing of the channels is a change of `Config.logical_rules`, not of this file.

Dtypes: convolutions run in the dtype the engine hands in (parameters and image cast to bf16/fp16
under mixed precision); GroupNorm statistics, the 1x1x1 head, the logits and the cross-entropy are
fp32. Outside the engine, with fp32 parameters, everything is fp32.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

KERNEL_NAMES = (None, None, None, "conv_in", "conv_out")
CHANNEL_NAMES = ("conv_out",)
DOWNSAMPLE = ("conv", "pool")
# Untruncated normals: the truncated ones (Flax's he_normal) cost seconds of XLA compile time per shape on CPU.
HE_INIT = nn.initializers.variance_scaling(2.0, "fan_in", "normal")
LECUN_INIT = nn.initializers.variance_scaling(1.0, "fan_in", "normal")


@dataclasses.dataclass(frozen=True)
class UNet3DConfig:
    """channels: feature channels per resolution level (the volume halves at each further level).
    in_channels: channels of the input image. num_classes: segmentation classes (logit channels).
    groups: GroupNorm groups (must divide every entry of `channels`); 0 disables normalisation.
    downsample: 'conv' (stride-2 3x3x3 convolution) or 'pool' (2x2x2 max pooling).
    """

    channels: tuple[int, ...] = (8, 16, 32)
    in_channels: int = 1
    num_classes: int = 3
    groups: int = 4
    downsample: str = "conv"

    def __post_init__(self):
        object.__setattr__(self, "channels", tuple(self.channels))
        if not self.channels or any(not isinstance(c, int) or c < 1 for c in self.channels):
            raise ValueError(f"UNet3DConfig.channels: must be positive integers, got {self.channels!r}")
        if self.in_channels < 1 or self.num_classes < 2:
            raise ValueError("UNet3DConfig: in_channels must be >= 1 and num_classes >= 2, got "
                             f"{self.in_channels} and {self.num_classes}")
        if self.groups < 0 or (self.groups and any(c % self.groups for c in self.channels)):
            raise ValueError(f"UNet3DConfig.groups: {self.groups} must be 0 or divide every level's channels "
                             f"{self.channels} (e.g. a power of two no larger than {min(self.channels)})")
        if self.downsample not in DOWNSAMPLE:
            raise ValueError(f"UNet3DConfig.downsample: {self.downsample!r} is not one of {DOWNSAMPLE}")

    @property
    def min_size(self) -> int:
        """Volumes' D, H and W must be multiples of this (each level halves them)."""
        return 2 ** (len(self.channels) - 1)


def group_norm(x, scale, bias, groups: int, eps: float = 1e-5):
    """GroupNorm over (D, H, W, channels of a group) per example, statistics in fp32; x: [B, D, H, W, C]."""
    *lead, c = x.shape
    x32 = x.astype(jnp.float32).reshape(*lead, groups, c // groups)
    axes = tuple(range(1, x32.ndim - 2)) + (x32.ndim - 1,)
    mean = x32.mean(axes, keepdims=True)
    var = jnp.square(x32 - mean).mean(axes, keepdims=True)
    y = ((x32 - mean) * jax.lax.rsqrt(var + eps)).reshape(*lead, c)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def _conv(features: int, kernel: int = 3, stride: int = 1, name: str | None = None, **kwargs) -> nn.Conv:
    return nn.Conv(
        features, (kernel,) * 3, strides=(stride,) * 3, padding="SAME", name=name,
        kernel_init=nn.with_logical_partitioning(HE_INIT, KERNEL_NAMES),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, CHANNEL_NAMES), **kwargs)


class ConvBlock(nn.Module):
    """Two (3x3x3 conv -> GroupNorm -> SiLU)."""

    features: int
    groups: int

    @nn.compact
    def __call__(self, x):
        for i in range(2):
            x = _conv(self.features, name=f"conv{i}")(x)
            if self.groups:
                scale = self.param(f"norm{i}_scale",
                                   nn.with_logical_partitioning(nn.initializers.ones, CHANNEL_NAMES),
                                   (self.features,))
                bias = self.param(f"norm{i}_bias",
                                  nn.with_logical_partitioning(nn.initializers.zeros, CHANNEL_NAMES),
                                  (self.features,))
                x = group_norm(x, scale, bias, self.groups)
            x = nn.silu(x)
        return x


class UNet3D(nn.Module):
    """image [B, D, H, W, in_channels] -> fp32 logits [B, D, H, W, num_classes].

    D, H and W must be multiples of `config.min_size`.
    """

    config: UNet3DConfig

    @nn.compact
    def __call__(self, image):
        c = self.config
        spatial = image.shape[1:4]
        if any(s % c.min_size for s in spatial):
            raise ValueError(f"UNet3D: volume size {spatial} must be a multiple of {c.min_size} "
                             f"(2 ** (levels - 1) for channels {c.channels})")
        if image.shape[-1] != c.in_channels:
            raise ValueError(f"UNet3D: image has {image.shape[-1]} channels, config.in_channels is {c.in_channels}")

        x = image
        skips = []
        for level, features in enumerate(c.channels):
            if level > 0:
                if c.downsample == "conv":
                    x = _conv(features, stride=2, name=f"down{level}")(x)
                else:
                    x = nn.max_pool(x, (2, 2, 2), strides=(2, 2, 2))
            x = ConvBlock(features, c.groups, name=f"enc{level}")(x)
            skips.append(x)
        for level in reversed(range(len(c.channels) - 1)):
            features = c.channels[level]
            x = nn.ConvTranspose(
                features, (2, 2, 2), strides=(2, 2, 2), padding="SAME", name=f"up{level}",
                kernel_init=nn.with_logical_partitioning(HE_INIT, KERNEL_NAMES),
                bias_init=nn.with_logical_partitioning(nn.initializers.zeros, CHANNEL_NAMES))(x)
            x = jnp.concatenate([x, skips[level]], axis=-1)
            x = ConvBlock(features, c.groups, name=f"dec{level}")(x)
        # The head is a 1x1x1 convolution in fp32: the logits feed a softmax.
        head = nn.Conv(
            c.num_classes, (1, 1, 1), name="head", dtype=jnp.float32,
            kernel_init=nn.with_logical_partitioning(LECUN_INIT,
                                                     (None, None, None, "conv_in", None)),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, (None,)))
        return head(x).astype(jnp.float32)


def segmentation_loss(model: UNet3D):
    """loss_fn(params, batch, rng) for the engine: mean per-voxel softmax cross-entropy (nats, fp32) of
    batch {'image': float [B, D, H, W, C], 'labels': int [B, D, H, W]}."""

    def loss_fn(params, batch, rng):
        logits = model.apply({"params": params}, batch["image"]).astype(jnp.float32)
        labels = batch["labels"]
        logz = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
        return jnp.mean(logz - picked)

    return loss_fn


def synthetic_volumes(rng: np.random.Generator, n: int, size: int = 16, *, in_channels: int = 1,
                      max_objects: int = 3, noise: float = 0.3) -> dict:
    """n learnable segmentation examples: noisy volumes holding 1..max_objects spheres and cubes.

    Labels: 0 background, 1 sphere, 2 cube (later objects overwrite earlier ones where they overlap).
    Both shapes are equally bright (intensity 1 on a 0 background, plus Gaussian noise of std `noise`,
    drawn independently per channel), so foreground vs background is visible voxel by voxel, while
    sphere vs cube needs the spatial context a U-Net has. Returns {'image': float32 [n, size, size,
    size, in_channels], 'labels': int32 [n, size, size, size]}; use num_classes=3.
    """
    grid = np.stack(np.meshgrid(*(np.arange(size),) * 3, indexing="ij"), axis=-1).astype(np.float32) + 0.5
    labels = np.zeros((n, size, size, size), np.int32)
    for i in range(n):
        for _ in range(rng.integers(1, max_objects + 1)):
            kind = int(rng.integers(1, 3))
            radius = rng.uniform(0.15, 0.3) * size
            center = rng.uniform(radius, size - radius, size=3)
            offset = grid - center
            if kind == 1:
                mask = np.sum(offset ** 2, axis=-1) <= radius ** 2
            else:
                mask = np.max(np.abs(offset), axis=-1) <= radius * 0.806  # the sphere's volume: (pi/6)^(1/3)
            labels[i][mask] = kind
    foreground = (labels > 0).astype(np.float32)[..., None]
    image = foreground + noise * rng.standard_normal((n, size, size, size, in_channels)).astype(np.float32)
    return {"image": image.astype(np.float32), "labels": labels}
