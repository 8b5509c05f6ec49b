"""Pallas kernels and their pure-XLA counterparts.

Block-sparse attention (DeepSpeed's sparse attention, docs/sparse_attention.md)::

    from zeroflax.kernels import sparse_attention, BigBirdSparsityConfig
    cfg = BigBirdSparsityConfig(num_heads=8, block=16)
    out = sparse_attention(q, k, v, cfg, causal=False)   # q, k, v: [batch, seq, heads, head_dim]
"""

from __future__ import annotations

import jax
import numpy as np

from zeroflax.kernels.reference import sparse_attention_reference
from zeroflax.kernels.sparse_attention_pallas import sparse_attention_pallas
from zeroflax.kernels.sparse_attention_xla import sparse_attention_xla
from zeroflax.kernels.sparsity_config import (
    BigBirdSparsityConfig,
    BSLongformerSparsityConfig,
    DenseSparsityConfig,
    FixedSparsityConfig,
    LocalSlidingWindowSparsityConfig,
    SparsityConfig,
    VariableSparsityConfig,
)

IMPLEMENTATIONS = ("xla", "pallas", "pallas_interpret", "reference")


def default_implementation() -> str:
    """'pallas' on GPU, 'xla' on CPU and TPU."""
    return "pallas" if jax.default_backend() == "gpu" else "xla"


def sparse_attention(q, k, v, layout, *, causal: bool, key_padding_mask=None, sm_scale=None,
                     implementation: str | None = None):
    """Block-sparse softmax attention, differentiable in q, k and v.

    Args:
      q, k, v: ``[batch, seq, heads, head_dim]`` (Flax's layout), one dtype.
      layout: a :class:`SparsityConfig` (its ``make_layout(seq)`` is used) or a
        concrete 0/1 array ``(heads, seq/block, seq/block)``, ``(1, ...)`` or
        ``(seq/block, seq/block)``; ``block = seq / layout.shape[-1]``.
      causal: also mask keys after the query (element-wise). Use it for
        decoders; a 'unidirectional' layout alone is block-level only.
      key_padding_mask: optional ``[batch, seq]`` bool, True for real keys.
      sm_scale: score scale, default ``head_dim ** -0.5``.
      implementation: 'xla' (memory-linear, any backend), 'pallas' (GPU
        kernel; interpret mode off-GPU), 'pallas_interpret', 'reference'
        (dense, for tests), or None for :func:`default_implementation`.

    Returns ``[batch, seq, heads, head_dim]`` in q's dtype. A query with no
    allowed key gets zeros.
    """
    if isinstance(layout, SparsityConfig):
        layout = layout.make_layout(q.shape[1])
    impl = default_implementation() if implementation is None else implementation
    kw = dict(causal=causal, key_padding_mask=key_padding_mask, sm_scale=sm_scale)
    if impl == "xla":
        return sparse_attention_xla(q, k, v, layout, **kw)
    if impl in ("pallas", "pallas_interpret"):
        interpret = True if impl == "pallas_interpret" else None
        if impl == "pallas" and jax.default_backend() == "gpu":
            block = q.shape[1] // np.shape(layout)[-1]
            for name, n in (("block", block), ("head_dim", q.shape[-1])):
                if n < 16 or n & (n - 1):
                    raise ValueError(f"sparse_attention(implementation='pallas'): {name}={n} must be a power "
                                     "of two >= 16 on GPU; change the SparsityConfig block or use 'xla'.")
        return sparse_attention_pallas(q, k, v, layout, interpret=interpret, **kw)
    if impl == "reference":
        return sparse_attention_reference(q, k, v, layout, **kw)
    raise ValueError(f"sparse_attention: implementation={implementation!r}; choose one of {IMPLEMENTATIONS} "
                     "or None.")


class SparseAttention:
    """`sparse_attention` with one layout, as an ``attention(q, k, v)`` function (what a model hands to
    `zeroflax.sequence_attention`). ``for_heads(first, count)`` is the same attention for heads
    ``first .. first + count - 1`` only: the heads a device holds after Ulysses' all-to-all. It is this
    object itself when every head has the same layout, so a uniform layout compiles one program."""

    def __init__(self, layout, *, causal: bool, implementation: str | None = None, heads: tuple | None = None):
        self.layout, self.causal, self.implementation, self.heads = layout, causal, implementation, heads

    def __call__(self, q, k, v):
        layout = self.layout
        if self.heads is not None:
            full = layout.make_layout(q.shape[1]) if isinstance(layout, SparsityConfig) else np.asarray(layout)
            first, count = self.heads
            layout = full[first:first + count]
        return sparse_attention(q, k, v, layout, causal=self.causal, implementation=self.implementation)

    def for_heads(self, first: int, count: int) -> "SparseAttention":
        if isinstance(self.layout, SparsityConfig):
            uniform = not self.layout.different_layout_per_head
        else:
            uniform = np.ndim(self.layout) < 3 or np.shape(self.layout)[0] == 1
        if uniform:
            return self
        return SparseAttention(self.layout, causal=self.causal, implementation=self.implementation,
                               heads=(first, count))


__all__ = [
    "SparseAttention",
    "sparse_attention", "default_implementation", "IMPLEMENTATIONS",
    "sparse_attention_xla", "sparse_attention_pallas", "sparse_attention_reference",
    "SparsityConfig", "DenseSparsityConfig", "FixedSparsityConfig", "VariableSparsityConfig",
    "BigBirdSparsityConfig", "BSLongformerSparsityConfig", "LocalSlidingWindowSparsityConfig",
]
