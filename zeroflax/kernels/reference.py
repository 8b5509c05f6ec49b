"""Dense masked attention with a block layout: the ground truth for the sparse kernels' tests.

Memory is quadratic in the sequence length; use it only on small shapes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zeroflax.kernels.layout_table import normalize_layout


def element_mask(layout, seq_len: int, num_heads: int, *, causal: bool) -> np.ndarray:
    """The ``(heads, L, L)`` boolean mask that a block layout (and ``causal``) allows."""
    lay, block = normalize_layout(layout, num_heads, seq_len)
    mask = np.repeat(np.repeat(lay, block, axis=1), block, axis=2)
    if causal:
        mask = mask & np.tri(seq_len, dtype=bool)
    return np.broadcast_to(mask, (num_heads, seq_len, seq_len))


def sparse_attention_reference(q, k, v, layout, *, causal: bool, key_padding_mask=None, sm_scale=None):
    """Softmax attention over the allowed (query, key) pairs, computed densely in float32.

    Same arguments and conventions as :func:`zeroflax.kernels.sparse_attention`:
    ``[batch, seq, heads, head_dim]`` arrays, ``key_padding_mask`` ``[batch, seq]``
    with True for real keys; a query with no allowed key gets zeros.
    """
    _, seq_len, num_heads, head_dim = q.shape
    scale = head_dim ** -0.5 if sm_scale is None else sm_scale
    mask = jnp.asarray(element_mask(layout, seq_len, num_heads, causal=causal))[None]  # [1, H, L, L]
    if key_padding_mask is not None:
        mask = mask & jnp.asarray(key_padding_mask, bool)[:, None, None, :]
    f32 = jnp.float32
    s = jnp.einsum("bqhd,bkhd->bhqk", q.astype(f32), k.astype(f32),
                   precision=jax.lax.Precision.HIGHEST) * scale
    s = jnp.where(mask, s, 0.0)
    m = jax.lax.stop_gradient(jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1, keepdims=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(denom == 0, 1.0, denom)
    o = jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(f32), precision=jax.lax.Precision.HIGHEST)
    return o.astype(q.dtype)
