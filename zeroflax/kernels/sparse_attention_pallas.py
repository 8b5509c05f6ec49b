"""Block-sparse flash attention as Pallas kernels (GPU; interpret mode elsewhere).

Three kernels, all driven by :class:`layout_table.RowTable` lookup tables that
are built in numpy and passed in as int32 arrays:

forward, grid (batch, head, query block)
    The program of query block ``i`` keeps its ``[block, head_dim]`` queries
    resident and loops over ``cols[h, i, :counts[h, i]]``: it loads each listed
    K/V block, masks (causal on the diagonal, key padding), and updates the
    running max, sum and output (online softmax). It writes the output and the
    row log-sum-exp (``+inf`` for a query with no allowed key, whose output is 0).
dq, same grid
    Loops over the same row and accumulates ``dS @ K``.
dk/dv, grid (batch, head, key block)
    Loops over the row of the *transposed* table (the query blocks that use
    key block ``j``) and accumulates ``P^T @ dO`` and ``dS^T @ Q``.

Only the kernel bodies and the ``pallas_call`` plumbing here are Pallas; the
tables are backend-independent (the Triton backend used on GPU today is
deprecated in favour of Mosaic GPU, which can reuse them). Block size =
layout block; on GPU it and ``head_dim`` must be powers of two >= 16.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from zeroflax.kernels import layout_table as lt

__all__ = ["sparse_attention_pallas"]

_F32 = jnp.float32


def _dot(a, b, trans_a=False, trans_b=False):
    dims = (((0,) if trans_a else (1,), (1,) if trans_b else (0,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=_F32)


def _mask(qi, kj, block, causal, kpm_ref):
    """[block, block] mask of query block ``qi`` against key block ``kj`` (or None if all True)."""
    mask = None
    if causal:
        rows = qi * block + lax.broadcasted_iota(jnp.int32, (block, block), 0)
        cols = kj * block + lax.broadcasted_iota(jnp.int32, (block, block), 1)
        mask = rows >= cols
    if kpm_ref is not None:
        keep = (kpm_ref[pl.ds(kj * block, block)] != 0)[None, :]
        mask = keep if mask is None else mask & keep
    return mask


def _fwd_kernel(cnt_ref, tab_ref, q_ref, k_ref, v_ref, *rest, block, causal, scale, has_kpm):
    kpm_ref = rest[0] if has_kpm else None
    o_ref, lse_ref = rest[-2:]
    i = pl.program_id(2)
    q = q_ref[...]
    dim = q.shape[-1]

    def body(t, carry):
        acc, m, l = carry
        j = tab_ref[t]
        ks = pl.ds(pl.multiple_of(j * block, block), block)
        s = _dot(q, k_ref[ks, :], trans_b=True) * scale
        mask = _mask(i, j, block, causal, kpm_ref)
        if mask is not None:
            s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(axis=-1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[:, None])
        v = v_ref[ks, :]
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v)
        return acc, m_new, l * alpha + p.sum(axis=-1)

    init = (jnp.zeros((block, dim), _F32), jnp.full((block,), -jnp.inf, _F32), jnp.zeros((block,), _F32))
    acc, m, l = lax.fori_loop(0, cnt_ref[0], body, init)
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log(l_safe))


def _dq_kernel(cnt_ref, tab_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest,
               block, causal, scale, has_kpm):
    kpm_ref = rest[0] if has_kpm else None
    dq_ref = rest[-1]
    i = pl.program_id(2)
    q, do = q_ref[...], do_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]

    def body(t, dq):
        j = tab_ref[t]
        ks = pl.ds(pl.multiple_of(j * block, block), block)
        k, v = k_ref[ks, :], v_ref[ks, :]
        s = _dot(q, k, trans_b=True) * scale
        p = jnp.exp(s - lse[:, None])  # lse = +inf on empty rows: p = 0
        mask = _mask(i, j, block, causal, kpm_ref)
        if mask is not None:
            p = jnp.where(mask, p, 0.0)
        ds = p * (_dot(do, v, trans_b=True) - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(0, cnt_ref[0], body, jnp.zeros(q.shape, _F32))
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(cnt_ref, tab_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, *rest,
                block, causal, scale, has_kpm):
    kpm_ref = rest[0] if has_kpm else None
    dk_ref, dv_ref = rest[-2:]
    j = pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    keep = None
    if kpm_ref is not None:
        keep = (kpm_ref[...] != 0)[None, :]

    def body(t, carry):
        dk, dv = carry
        r = tab_ref[t]
        qs = pl.ds(pl.multiple_of(r * block, block), block)
        q, do = q_ref[qs, :], do_ref[qs, :]
        s = _dot(q, k, trans_b=True) * scale  # [block_q, block_k]
        p = jnp.exp(s - lse_ref[qs][:, None])
        if causal:
            rows = r * block + lax.broadcasted_iota(jnp.int32, (block, block), 0)
            cols = j * block + lax.broadcasted_iota(jnp.int32, (block, block), 1)
            p = jnp.where(rows >= cols, p, 0.0)
        if keep is not None:
            p = jnp.where(keep, p, 0.0)
        dv = dv + _dot(p.astype(do.dtype), do, trans_a=True)
        ds = p * (_dot(do, v, trans_b=True) - delta_ref[qs][:, None])
        dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True)
        return dk, dv

    zeros = jnp.zeros(k.shape, _F32)
    dk, dv = lax.fori_loop(0, cnt_ref[0], body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _compiler_params(interpret):
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu  # GPU only
    return plgpu.CompilerParams(num_warps=4, num_stages=2)


def sparse_attention_pallas(q, k, v, layout, *, causal: bool, key_padding_mask=None, sm_scale=None,
                            interpret: bool | None = None):
    """Block-sparse flash attention with Pallas; see :func:`zeroflax.kernels.sparse_attention`.

    ``interpret``: run the kernels in Pallas interpret mode (default: when the
    default backend is not a GPU), which is exact but slow -- for tests.
    """
    b, length, heads, dim = q.shape
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"sparse_attention: q, k, v must share one shape [batch, seq, heads, head_dim]; "
                         f"got {q.shape}, {k.shape}, {v.shape}.")
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    lay, block = lt.normalize_layout(layout, heads, length)
    lay = lt.effective_layout(lay, causal)
    nb = length // block
    fwd_t = lt.row_table(lay, pow2_width=True)
    bwd_t = lt.row_table(lay, transpose=True, pow2_width=True)
    scale = float(dim ** -0.5 if sm_scale is None else sm_scale)
    has_kpm = key_padding_mask is not None
    hsel = (lambda h: h) if lay.shape[0] > 1 else (lambda h: 0)
    static = dict(block=block, causal=causal, scale=scale, has_kpm=has_kpm)
    call = functools.partial(pl.pallas_call, grid=(b, heads, nb), interpret=interpret,
                             compiler_params=_compiler_params(interpret))

    def table_specs(t):
        return [pl.BlockSpec((None, 1), lambda b_, h, i: (hsel(h), i)),
                pl.BlockSpec((None, None, t.width), lambda b_, h, i: (hsel(h), i, 0))]

    blk = pl.BlockSpec((None, block, None, dim), lambda b_, h, i: (b_, i, h, 0))
    full = pl.BlockSpec((None, length, None, dim), lambda b_, h, i: (b_, 0, h, 0))
    row_blk = pl.BlockSpec((None, None, block), lambda b_, h, i: (b_, h, i))
    row_full = pl.BlockSpec((None, None, length), lambda b_, h, i: (b_, h, 0))
    kpm_full = pl.BlockSpec((None, length), lambda b_, h, i: (b_, 0))
    kpm_blk = pl.BlockSpec((None, block), lambda b_, h, i: (b_, i))
    # Host (numpy) tables: closed over by the custom_vjp below, where a jax array made inside another
    # transformation (scan, checkpoint, shard_map) would be a leaked tracer.
    tabs_f = (np.asarray(fwd_t.counts), np.asarray(fwd_t.cols))
    tabs_b = (np.asarray(bwd_t.counts), np.asarray(bwd_t.cols))
    row_shape = jax.ShapeDtypeStruct((b, heads, length), _F32)

    def forward(q, k, v, kpm):
        extra = (kpm,) if has_kpm else ()
        return call(
            functools.partial(_fwd_kernel, **static),
            in_specs=table_specs(fwd_t) + [blk, full, full] + ([kpm_full] if has_kpm else []),
            out_specs=[blk, row_blk],
            out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype), row_shape],
        )(*tabs_f, q, k, v, *extra)

    def backward(q, k, v, kpm, o, lse, do):
        extra = (kpm,) if has_kpm else ()
        delta = jnp.einsum("blhd,blhd->bhl", o.astype(_F32), do.astype(_F32))
        dq = call(
            functools.partial(_dq_kernel, **static),
            in_specs=table_specs(fwd_t) + [blk, full, full, blk, row_blk, row_blk]
            + ([kpm_full] if has_kpm else []),
            out_specs=blk,
            out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        )(*tabs_f, q, k, v, do, lse, delta, *extra)
        dk, dv = call(
            functools.partial(_dkv_kernel, **static),
            in_specs=table_specs(bwd_t) + [full, blk, blk, full, row_full, row_full]
            + ([kpm_blk] if has_kpm else []),
            out_specs=[blk, blk],
            out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        )(*tabs_b, q, k, v, do, lse, delta, *extra)
        return dq, dk, dv

    @jax.custom_vjp
    def attend(q, k, v, kpm):
        return forward(q, k, v, kpm)[0]

    def attend_fwd(q, k, v, kpm):
        o, lse = forward(q, k, v, kpm)
        return o, (q, k, v, kpm, o, lse)

    def attend_bwd(res, do):
        q, k, v, kpm, o, lse = res
        return backward(q, k, v, kpm, o, lse, do) + (None,)

    attend.defvjp(attend_fwd, attend_bwd)

    kpm = None if not has_kpm else jnp.asarray(key_padding_mask).astype(jnp.int32).reshape(b, length)
    return attend(q, k, v, kpm)
