"""A GPT-style decoder: pre-LayerNorm, causal self-attention, GELU MLP, optional tied embeddings.

The layers are stacked (leading logical axis 'layers') and run with `zeroflax.scan_layers`, so under
ZeRO-3 one layer's weights are gathered at a time and the remat policy comes from `Config.remat`.
Every parameter has logical axis names (`vocab`, `embed`, `heads`, `kv`, `mlp`, `layers`, `length`),
so tensor slicing is a change of `Config.logical_rules`, not of this file. Activations and the loss are
computed in the dtype the engine hands in (bf16/fp16 under mixed precision), with LayerNorm statistics,
softmax and the cross-entropy in fp32.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from zeroflax.config import configurable
from zeroflax.sharding.sequence import sequence_attention, sequence_slice
from zeroflax.sharding.tensor import sequence_split, tensor_parallel
from zeroflax.sharding.layers import scan_layers


ATTENTIONS = ("dense", "dot_product", "cudnn", "sparse", "blockwise")


@configurable
@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    num_layers: int = 4
    d_model: int = 128
    num_heads: int = 4
    d_ff: int | None = None  # default 4 * d_model
    max_len: int = 256
    tie_embeddings: bool = True
    # 'dense' (this file's, fp32 softmax), 'dot_product' (jax.nn.dot_product_attention, XLA's choice),
    # 'cudnn' (its cuDNN flash attention, GPUs only), 'sparse' (block-sparse, DeepSpeed layouts; needs `sparsity`),
    # 'blockwise' (tiles of 512 with an online softmax, memory linear in the sequence on any backend:
    # zeroflax/sharding/ring_attention.py)
    attention: str = "dense"
    sparsity: Any = None  # a zeroflax.kernels SparsityConfig, e.g. BigBirdSparsityConfig(num_heads=4)

    def __post_init__(self):
        from zeroflax.config import ConfigError
        for key in ("vocab_size", "num_layers", "d_model", "num_heads", "max_len"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"GPTConfig.{key}", f"must be a positive integer, got {value!r}")
        if self.d_model % self.num_heads:
            raise ConfigError("GPTConfig.num_heads", f"{self.num_heads} heads do not divide d_model {self.d_model}")
        if self.d_ff is not None and (not isinstance(self.d_ff, int) or self.d_ff < 1):
            raise ConfigError("GPTConfig.d_ff", f"must be None (4 x d_model) or a positive integer, got {self.d_ff!r}")
        if self.attention not in ATTENTIONS:
            raise ConfigError("GPTConfig.attention", f"unknown attention {self.attention!r}",
                              f"use one of {', '.join(ATTENTIONS)}")
        if self.attention == "sparse":
            from zeroflax.kernels import SparsityConfig
            if not isinstance(self.sparsity, SparsityConfig):
                raise ConfigError("GPTConfig.sparsity", "sparse attention needs a sparsity config",
                                  "e.g. GPTConfig.sparsity = @BigBirdSparsityConfig() in gin")
            if self.sparsity.num_heads != self.num_heads:
                raise ConfigError("GPTConfig.sparsity", f"the layout has {self.sparsity.num_heads} heads, the "
                                  f"model {self.num_heads}", "set the sparsity config's num_heads to match")

    def to_dict(self) -> dict:
        """JSON-serialisable (checkpoint metadata); `from_dict` inverts it."""
        out = dataclasses.asdict(self)
        out["sparsity"] = None if self.sparsity is None else self.sparsity.to_dict()
        return out

    @classmethod
    def from_dict(cls, spec: dict) -> "GPTConfig":
        spec = dict(spec)
        if spec.get("sparsity") is not None:
            from zeroflax.kernels.sparsity_config import sparsity_from_dict
            spec["sparsity"] = sparsity_from_dict(spec["sparsity"])
        return cls(**spec)

    def attention_fn(self) -> Callable:
        """attention(q, k, v) on [batch, seq, heads, head_dim], causal."""
        if self.attention == "dense":
            return dense_causal_attention
        if self.attention == "blockwise":
            from zeroflax.sharding.ring_attention import blockwise_attention
            return functools.partial(blockwise_attention, causal=True)
        if self.attention in ("dot_product", "cudnn"):
            implementation = "cudnn" if self.attention == "cudnn" else None
            return functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation=implementation)
        from zeroflax.kernels import SparseAttention
        return SparseAttention(self.sparsity, causal=True)

    @property
    def ff(self) -> int:
        return self.d_ff or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def num_params(self) -> int:
        d, f, L = self.d_model, self.ff, self.num_layers
        per_layer = 4 * d + 3 * d * d + d * d + d * f + f + f * d + d
        head = 0 if self.tie_embeddings else d * self.vocab_size
        return L * per_layer + self.vocab_size * d + self.max_len * d + 2 * d + head


def layer_norm(x, scale, bias, eps: float = 1e-5):
    x32 = x.astype(jnp.float32)
    mean = x32.mean(-1, keepdims=True)
    var = jnp.square(x32 - mean).mean(-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps)
    return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(x.dtype)


def dense_causal_attention(q, k, v):
    """q, k, v: [batch, seq, heads, head_dim] -> [batch, seq, heads, head_dim]."""
    scale = q.shape[-1] ** -0.5
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * scale
    t = q.shape[1]
    causal = jnp.tril(jnp.ones((t, t), bool))
    logits = jnp.where(causal, logits, -1e30)
    weights = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v)


def _mlp(h, w_in, b_in, w_out):
    return jax.nn.gelu(h @ w_in + b_in) @ w_out


def block(x, p, attention: Callable = dense_causal_attention):
    """One decoder layer on x [batch, seq, d_model] with this layer's parameters p.

    Each sublayer (attention, MLP) is one Megatron pair, column-parallel in and row-parallel out
    (`tensor_parallel`); under Config.sequence_parallel x arrives split along the sequence (`GPT` splits
    it after the embedding) and the pairs keep it so: the layer norms and residual adds run on slices.
    A plain call otherwise, and outside the engine."""
    def attend(h, w_qkv, w_o):
        q, k, v = jnp.einsum("btd,dshk->sbthk", h, w_qkv)
        return jnp.einsum("bthk,hkd->btd", attention(q, k, v), w_o)

    h = layer_norm(x, p["ln1_scale"], p["ln1_bias"])
    x = x + tensor_parallel(attend, ("embed", None, "heads", "kv"), ("heads", "kv", "embed"))(h, p["w_qkv"], p["w_o"])
    h = layer_norm(x, p["ln2_scale"], p["ln2_bias"])
    out = tensor_parallel(_mlp, ("embed", "mlp"), ("mlp",), ("mlp", "embed"))(h, p["w_in"], p["b_in"], p["w_out"])
    return x + out + p["b_out"]


def _register_sparsity_configs_with_gin() -> None:
    try:
        import gin
    except ImportError:
        return
    from zeroflax import kernels
    for name in ("DenseSparsityConfig", "FixedSparsityConfig", "VariableSparsityConfig", "BigBirdSparsityConfig",
                 "BSLongformerSparsityConfig", "LocalSlidingWindowSparsityConfig"):
        gin.external_configurable(getattr(kernels, name), module="zeroflax.kernels")


_register_sparsity_configs_with_gin()


def _stacked(module: nn.Module, name: str, init, shape, names):
    # `variable` rather than `param`: under ZeRO-3 the stacked leaf arrives as this device's shard,
    # whose shape Linen's `param` would reject; `scan_layers` gathers it one layer at a time.
    boxed = nn.with_logical_partitioning(init, names)
    return module.variable("params", name, lambda: boxed(module.make_rng("params"), shape)).value


class GPT(nn.Module):
    config: GPTConfig
    remat: str | None = None  # None: the engine's Config.remat (or none outside the engine)

    @nn.compact
    def __call__(self, tokens):
        c = self.config
        L, d, f, H, K = c.num_layers, c.d_model, c.ff, c.num_heads, c.head_dim
        normal = nn.initializers.normal(0.02)
        out_normal = nn.initializers.normal(0.02 / (2 * L) ** 0.5)
        ones, zeros = nn.initializers.ones, nn.initializers.zeros
        embed = self.param("embed", nn.with_logical_partitioning(normal, ("vocab", "embed")), (c.vocab_size, d))
        pos = self.param("pos_embed", nn.with_logical_partitioning(normal, ("length", "embed")), (c.max_len, d))
        layers = {
            "ln1_scale": _stacked(self, "ln1_scale", ones, (L, d), ("layers", "embed")),
            "ln1_bias": _stacked(self, "ln1_bias", zeros, (L, d), ("layers", "embed")),
            "w_qkv": _stacked(self, "w_qkv", normal, (L, d, 3, H, K), ("layers", "embed", None, "heads", "kv")),
            "w_o": _stacked(self, "w_o", out_normal, (L, H, K, d), ("layers", "heads", "kv", "embed")),
            "ln2_scale": _stacked(self, "ln2_scale", ones, (L, d), ("layers", "embed")),
            "ln2_bias": _stacked(self, "ln2_bias", zeros, (L, d), ("layers", "embed")),
            "w_in": _stacked(self, "w_in", normal, (L, d, f), ("layers", "embed", "mlp")),
            "b_in": _stacked(self, "b_in", zeros, (L, f), ("layers", "mlp")),
            "w_out": _stacked(self, "w_out", out_normal, (L, f, d), ("layers", "mlp", "embed")),
            "b_out": _stacked(self, "b_out", zeros, (L, d), ("layers", "embed")),
        }
        ln_scale = self.param("ln_f_scale", nn.with_logical_partitioning(ones, ("embed",)), (d,))
        ln_bias = self.param("ln_f_bias", nn.with_logical_partitioning(zeros, ("embed",)), (d,))

        # With a `sequence` axis each device embeds and runs its own tokens (sharding/sequence.py); with
        # Megatron's sequence parallelism the tensor devices split the residual stream (sharding/tensor.py).
        t = tokens.shape[1]
        x = sequence_split(jnp.take(embed, sequence_slice(tokens), axis=0) + sequence_slice(pos[:t], axis=0))
        attention = sequence_attention(c.attention_fn(), causal=True, softmax=c.attention != "sparse")
        x = scan_layers(lambda h, p: block(h, p, attention), x, layers, remat=self.remat)
        x = layer_norm(x, ln_scale, ln_bias)
        if c.tie_embeddings:
            return jnp.einsum("btd,vd->btv", x, embed)
        head = self.param("head", nn.with_logical_partitioning(normal, ("embed", "vocab")), (d, c.vocab_size))
        return x @ head


def next_token_loss(model: GPT):
    """loss_fn(params, batch, rng) for the engine: mean next-token cross-entropy (nats) of
    batch['tokens'] [batch, seq + 1]."""

    def loss_fn(params, batch, rng):
        tokens = batch["tokens"]
        logits = model.apply({"params": params}, tokens[:, :-1]).astype(jnp.float32)
        targets = sequence_slice(tokens[:, 1:])  # the tokens this device predicts (all, without a sequence axis)
        logz = jax.nn.logsumexp(logits, axis=-1)
        picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        return jnp.mean(logz - picked)

    return loss_fn
