"""Block-sparse attention in plain XLA, with memory linear in the sequence length.

Runs on CPU, TPU and GPU. Every query block gathers only the K/V blocks its
layout row lists, never an ``L x L`` array:

forward
    The nonzero blocks are cut into "virtual rows" of at most ``chunk`` blocks
    (:func:`layout_table.split_table`). All virtual rows are processed as one
    batch: scores ``[V, B, block, chunk*block]``, a local softmax (max, sum,
    weighted V), and then the pieces of each query block are merged with a
    log-sum-exp, i.e. the online softmax across chunks (``segment_max`` /
    ``segment_sum`` over the sorted virtual-row -> row map). Residuals: q, k,
    v, the output and the row log-sum-exp.
backward (``jax.custom_vjp``)
    dq over the same virtual rows; dk and dv over the virtual rows of the
    *transposed* layout (for every key block, the query blocks that use it),
    so no gradient is scattered pair by pair.

Work and memory are ``O(nnz_blocks * block^2 + L * head_dim)`` per (batch,
head). Queries without any allowed key get zeros (and zero gradients).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from zeroflax.kernels import layout_table as lt

__all__ = ["sparse_attention_xla"]

_F32 = jnp.float32


def _to_blocks(x, block):
    """[B, L, H, ...] -> [H, nb, B, block, ...]."""
    b, length, h = x.shape[:3]
    x = x.reshape(b, length // block, block, h, *x.shape[3:])
    return jnp.moveaxis(jnp.moveaxis(x, 3, 0), 2, 1)  # [H, B, nb, blk, ...] -> [H, nb, B, blk, ...]


def _from_blocks(x):
    """[H, nb, B, block, D] -> [B, L, H, D]."""
    h, nb, b, block, d = x.shape
    return jnp.transpose(x, (2, 1, 3, 0, 4)).reshape(b, nb * block, h, d)


def _gather_blocks(xb, idx):
    """xb [nb, B, blk, ...], idx [V, c] -> [V, B, c*blk, ...]."""
    g = xb[idx]  # [V, c, B, blk, ...]
    g = jnp.moveaxis(g, 2, 1)  # [V, B, c, blk, ...]
    return g.reshape(g.shape[0], g.shape[1], -1, *g.shape[4:])


def _pair_mask(qblk, kblk, qvalid, kvalid, block, causal, kpm_blocks):
    """Mask [V, B|1, Q, K] for the queries of blocks ``qblk`` [V, cq] and keys of ``kblk`` [V, ck]."""
    offs = jnp.arange(block)
    qpos = (qblk[..., None] * block + offs).reshape(qblk.shape[0], -1)
    kpos = (kblk[..., None] * block + offs).reshape(kblk.shape[0], -1)
    mask = jnp.repeat(qvalid, block, axis=1)[:, :, None] & jnp.repeat(kvalid, block, axis=1)[:, None, :]
    if causal:
        mask = mask & (qpos[:, :, None] >= kpos[:, None, :])
    mask = mask[:, None]  # [V, 1, Q, K]
    if kpm_blocks is not None:
        mask = mask & _gather_blocks(kpm_blocks, kblk)[:, :, None, :]  # [V, B, 1, K]
    return mask


def _fwd_head(qb, kb, vb, kpm, row, cols, valid, *, block, causal, scale):
    nb = qb.shape[0]
    qg = qb[row]  # [V, B, blk, D]
    kg, vg = _gather_blocks(kb, cols), _gather_blocks(vb, cols)  # [V, B, c*blk, D]
    mask = _pair_mask(row[:, None], cols, jnp.ones_like(row, bool)[:, None], valid, block, causal, kpm)
    s = jnp.einsum("vbqd,vbkd->vbqk", qg, kg, preferred_element_type=_F32) * scale
    s = jnp.where(mask, s, -jnp.inf)
    m = s.max(-1)  # [V, B, blk]
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe[..., None])  # masked entries: exp(-inf) = 0
    acc = jnp.einsum("vbqk,vbkd->vbqd", p.astype(vg.dtype), vg, preferred_element_type=_F32)
    # Merge the virtual rows of each query block (log-sum-exp across chunks).
    m_row = jax.ops.segment_max(m, row, nb, indices_are_sorted=True)
    m_row = jnp.where(jnp.isfinite(m_row), m_row, 0.0)
    w = jnp.where(jnp.isfinite(m), jnp.exp(m - m_row[row]), 0.0)
    l_row = jax.ops.segment_sum(p.sum(-1) * w, row, nb, indices_are_sorted=True)
    acc = jax.ops.segment_sum(acc * w[..., None], row, nb, indices_are_sorted=True)
    o = acc / jnp.where(l_row == 0, 1.0, l_row)[..., None]
    lse = jnp.where(l_row > 0, m_row + jnp.log(jnp.where(l_row > 0, l_row, 1.0)), jnp.inf)
    return o.astype(qb.dtype), lse


def _probs(s, lse, mask):
    return jnp.where(mask, jnp.exp(s - lse[..., None]), 0.0)


def _dq_head(qb, kb, vb, dob, lse, delta, kpm, row, cols, valid, *, block, causal, scale):
    nb = qb.shape[0]
    qg, dog = qb[row], dob[row]
    kg, vg = _gather_blocks(kb, cols), _gather_blocks(vb, cols)
    mask = _pair_mask(row[:, None], cols, jnp.ones_like(row, bool)[:, None], valid, block, causal, kpm)
    s = jnp.einsum("vbqd,vbkd->vbqk", qg, kg, preferred_element_type=_F32) * scale
    p = _probs(s, lse[row], mask)
    dp = jnp.einsum("vbqd,vbkd->vbqk", dog, vg, preferred_element_type=_F32)
    ds = p * (dp - delta[row][..., None])
    dq = jnp.einsum("vbqk,vbkd->vbqd", ds.astype(kg.dtype), kg, preferred_element_type=_F32)
    return jax.ops.segment_sum(dq, row, nb, indices_are_sorted=True) * scale


def _dkv_head(qb, kb, vb, dob, lse, delta, kpm, row, cols, valid, *, block, causal, scale):
    """Over the transposed table: ``row`` are key blocks, ``cols`` the query blocks using them."""
    nb = kb.shape[0]
    kg, vg = kb[row], vb[row]  # [V, B, blk, D]
    qg, dog = _gather_blocks(qb, cols), _gather_blocks(dob, cols)  # [V, B, c*blk, D]
    lse_g, delta_g = _gather_blocks(lse, cols), _gather_blocks(delta, cols)  # [V, B, c*blk]
    mask = _pair_mask(cols, row[:, None], valid, jnp.ones_like(row, bool)[:, None], block, causal, kpm)
    s = jnp.einsum("vbqd,vbkd->vbqk", qg, kg, preferred_element_type=_F32) * scale
    p = _probs(s, lse_g, mask)  # [V, B, c*blk, blk]
    dv = jnp.einsum("vbqk,vbqd->vbkd", p.astype(dog.dtype), dog, preferred_element_type=_F32)
    dp = jnp.einsum("vbqd,vbkd->vbqk", dog, vg, preferred_element_type=_F32)
    ds = p * (dp - delta_g[..., None])
    dk = jnp.einsum("vbqk,vbqd->vbkd", ds.astype(qg.dtype), qg, preferred_element_type=_F32)
    seg = functools.partial(jax.ops.segment_sum, segment_ids=row, num_segments=nb, indices_are_sorted=True)
    return seg(dk) * scale, seg(dv)


def _per_head(fn, n_shared_leading, tables, per_head_layout, **static):
    """vmap ``fn`` over heads: block arrays on axis 0, kpm shared, tables per head or shared."""
    tab_axis = 0 if per_head_layout else None
    in_axes = (0,) * n_shared_leading + (None,) + (tab_axis,) * len(tables)
    return jax.vmap(functools.partial(fn, **static), in_axes=in_axes)


def sparse_attention_xla(q, k, v, layout, *, causal: bool, key_padding_mask=None, sm_scale=None,
                         chunk: int | None = None):
    """Block-sparse attention, pure XLA; see :func:`zeroflax.kernels.sparse_attention`.

    ``chunk``: layout blocks gathered per virtual row (default: the mean row
    count rounded up, at most 8). It trades padding against merge work and does
    not change results beyond rounding.
    """
    b, length, heads, dim = q.shape
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"sparse_attention: q, k, v must share one shape [batch, seq, heads, head_dim]; "
                         f"got {q.shape}, {k.shape}, {v.shape}.")
    lay, block = lt.normalize_layout(layout, heads, length)
    lay = lt.effective_layout(lay, causal)
    chunk = lt.default_chunk(lay) if chunk is None else int(chunk)
    fwd_t = lt.split_table(lay, chunk)
    bwd_t = lt.split_table(lay, chunk, transpose=True)
    per_head = lay.shape[0] > 1
    scale = float(dim ** -0.5 if sm_scale is None else sm_scale)
    static = dict(block=block, causal=causal, scale=scale)
    pick = (lambda a: a) if per_head else (lambda a: a[0])  # shared tables are not vmapped
    # Host (numpy) tables: the custom_vjp below closes over them, and a jax array made here would be a
    # tracer when this runs inside another transformation (scan, checkpoint, shard_map).
    tf = tuple(np.asarray(pick(a)) for a in (fwd_t.row, fwd_t.cols, fwd_t.valid))
    tb = tuple(np.asarray(pick(a)) for a in (bwd_t.row, bwd_t.cols, bwd_t.valid))
    fwd = _per_head(_fwd_head, 3, tf, per_head, **static)
    dq_fn = _per_head(_dq_head, 6, tf, per_head, **static)
    dkv_fn = _per_head(_dkv_head, 6, tb, per_head, **static)

    def kpm_blocks(mask):
        if mask is None:
            return None
        mask = jnp.asarray(mask).astype(bool).reshape(b, length // block, block)
        return jnp.swapaxes(mask, 0, 1)  # [nb, B, blk]

    def forward(q, k, v, mask):
        o, lse = fwd(_to_blocks(q, block), _to_blocks(k, block), _to_blocks(v, block), kpm_blocks(mask), *tf)
        return _from_blocks(o), (o, lse)

    @jax.custom_vjp
    def attend(q, k, v, mask):
        return forward(q, k, v, mask)[0]

    def attend_fwd(q, k, v, mask):
        out, (ob, lse) = forward(q, k, v, mask)
        return out, (q, k, v, mask, ob, lse)

    def attend_bwd(res, do):
        q, k, v, mask, ob, lse = res
        qb, kb, vb, dob = (_to_blocks(x, block) for x in (q, k, v, do))
        delta = jnp.sum(dob.astype(_F32) * ob.astype(_F32), axis=-1)  # [H, nb, B, blk]
        kpm = kpm_blocks(mask)
        dq = dq_fn(qb, kb, vb, dob, lse, delta, kpm, *tf)
        dk, dv = dkv_fn(qb, kb, vb, dob, lse, delta, kpm, *tb)
        grads = tuple(_from_blocks(g).astype(x.dtype) for g, x in ((dq, q), (dk, k), (dv, v)))
        return grads + (None,)

    attend.defvjp(attend_fwd, attend_bwd)
    return attend(q, k, v, key_padding_mask)
