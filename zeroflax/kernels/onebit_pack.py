"""Sign packing and unpacking for 1-bit Adam's compressed all-reduce (DeepSpeed's OnebitAdam).

The two hot loops of the exchange (``zeroflax/optim/onebit.py``), on ``(R, C)`` float32 rows with
``C % 8 == 0`` and one scale per row:

``pack_signs(x, error, scale)``
    ``y = x + error``; ``s = +1`` where ``y >= 0`` (so ``sign(0) = sign(-0.0) = +1``; NaN gives -1),
    else ``-1``. Returns ``bits`` uint8 ``(R, C // 8)`` -- 8 signs per byte, bit = 1 for +1, the first
    element of each group of 8 in the most significant bit (``numpy.packbits(y >= 0, axis=-1)``) --
    and the new error-feedback buffer ``y - scale[r] * s``.
``unpack_signs(bits, scale, average=False)``
    ``scale[r] * s[r, c]``, float32 ``(R, C)``.
``unpack_signs(bits, scale, average=True)``
    float32 ``(C,)``: ``sum_r s[r, c] * (scale[r] / R)``, accumulated sequentially over
    ``r = 0, 1, ..., R - 1`` starting from the ``r = 0`` term, so that the result does not depend on
    the implementation (the Pallas kernel equals the jnp reference bitwise). ``scale[r] / R`` is
    computed as ``scale[r] * float32(1 / R)`` (see ``_row_weights``).

Each function has two implementations: ``impl="xla"``, the plain jnp reference below (the readable
definition), and ``impl="pallas"``, the Pallas kernels (Triton on GPU; ``interpret=True`` runs them
in Pallas interpret mode, e.g. on the CPU for tests). ``impl="auto"`` picks "pallas" when the default
backend is a GPU (or when ``interpret=True`` is asked for), else "xla".

Kernel layout. The columns are viewed as ``G = C // 8`` groups of 8 (a free row-major reshape to
``(R, G, 8)``), and every program handles a block of ``BLOCK_GROUPS`` groups (2048 elements, a
``(256, 8)`` tile; 256 bytes of bits). The bit weights 128, 64, ..., 1 are a shift along the last
axis, and a byte is an integer sum over it: simple 2-D ops that the Triton lowering handles.

* pack and unpack (``average=False``): grid ``(R, G / block)``. Every element is independent, R (the
  number of workers) is small and C large, so one program per (row, column block) gives the GPU all
  the parallelism there is and needs no loop.
* unpack (``average=True``): grid ``(G / block,)`` over column blocks only; each program loops over
  the rows in order ``0 .. R - 1``, keeping its accumulator in registers. The fixed order is what
  makes the sum reproducible (no atomics, no tree reduction), and matches the jnp reference bitwise.

A C that is not a multiple of the block: the block is ``min(BLOCK_GROUPS, next power of two >= G)``
(Triton needs power-of-two tiles), and the inputs are zero-padded to a whole number of blocks and
the outputs sliced back. Padding costs one extra copy of the inputs, so callers that care should make
``C`` a multiple of ``8 * BLOCK_GROUPS`` = 2048 (no padding then). Padding (rather than masked loads)
keeps the kernels identical in interpret mode and on the GPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

__all__ = ["pack_signs", "unpack_signs", "pack_signs_xla", "unpack_signs_xla", "BLOCK_GROUPS", "IMPLS"]

IMPLS = ("auto", "xla", "pallas")
BLOCK_GROUPS = 256  # groups of 8 columns per program: 2048 elements (a power of two, as Triton wants)

_F32 = jnp.float32


# ------------------------------------------------------------------------------- checks and dispatch
def _check_impl(name, impl, interpret):
    if impl not in IMPLS:
        raise ValueError(f"{name}: impl={impl!r}; choose one of {IMPLS}.")
    if impl == "auto":
        return "pallas" if (interpret or jax.default_backend() == "gpu") else "xla"
    return impl


def _as_f32(name, what, a):
    a = jnp.asarray(a)
    if not jnp.issubdtype(a.dtype, jnp.floating):
        raise ValueError(f"{name}: {what} must be floating point (float32), got dtype {a.dtype}.")
    return a.astype(_F32)


def _check_scale(name, scale, rows):
    scale = _as_f32(name, "scale", scale)
    if scale.shape != (rows,):
        raise ValueError(f"{name}: scale must have shape (R,) = ({rows},), one scale per row; "
                         f"got {scale.shape}.")
    return scale


# ------------------------------------------------------------------------- the jnp reference ('xla')
_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)  # bit weight of the k-th element of a group: 2 ** (7 - k)


def _signs(positive):
    return jnp.where(positive, _F32(1.0), _F32(-1.0))


def _row_weights(scale, rows):
    """scale[r] / R, the average's per-row weights, as ``scale * float32(1 / R)``.

    XLA rewrites a division by a constant into this multiplication anyway (XLA:CPU divides by R
    that way, up to 1 ulp off ``numpy``'s ``scale / R``); writing it out, with the reciprocal
    rounded once in numpy, gives the same bits on every backend. Both implementations use it.
    """
    return scale * (np.float32(1) / np.float32(rows))


@jax.jit
def pack_signs_xla(x, error, scale):
    """The reference :func:`pack_signs` (no checks; float32 ``(R, C)``, ``(R, C)``, ``(R,)``)."""
    rows, cols = x.shape
    y = x + error
    positive = y >= 0
    new_error = y - scale[:, None] * _signs(positive)
    groups = positive.reshape(rows, cols // 8, 8)
    bits = jnp.sum(jnp.where(groups, jnp.array(_WEIGHTS, jnp.int32), 0), axis=-1).astype(jnp.uint8)
    return bits, new_error


def _unpack_rows_xla(bits):
    """+-1 float32 (R, 8 * G) from uint8 bits (R, G)."""
    rows, groups = bits.shape
    shifts = jnp.arange(7, -1, -1, dtype=jnp.int32)  # 7, 6, ..., 0: first element in the top bit
    on = (bits.astype(jnp.int32)[:, :, None] >> shifts) & 1
    return _signs(on != 0).reshape(rows, groups * 8)


@functools.partial(jax.jit, static_argnames="average")
def unpack_signs_xla(bits, scale, *, average):
    """The reference :func:`unpack_signs` (no checks; uint8 ``(R, C // 8)``, float32 ``(R,)``)."""
    rows = bits.shape[0]
    s = _unpack_rows_xla(bits)
    if not average:
        return scale[:, None] * s
    w = _row_weights(scale, rows)
    # Sequential over the rows, starting from the r = 0 term (not from 0.0, which would turn a -0.0
    # term into +0.0): the order the Pallas kernel uses.
    return lax.fori_loop(1, rows, lambda r, acc: acc + s[r] * w[r], s[0] * w[0])


# ------------------------------------------------------------------------------ the Pallas kernels
def _block_groups(groups):
    """Groups per program: BLOCK_GROUPS, or the next power of two >= groups when that is smaller."""
    return min(BLOCK_GROUPS, pl.next_power_of_2(groups))


def _pad_groups(a, padded):
    """Zero-pad axis 1 of ``a`` (R, G, ...) to ``padded`` groups."""
    extra = padded - a.shape[1]
    if extra == 0:
        return a
    return jnp.pad(a, [(0, 0), (0, extra)] + [(0, 0)] * (a.ndim - 2))


def _bit_shifts(block):
    """(block, 8) int32: 7, 6, ..., 0 along the last axis."""
    return 7 - lax.broadcasted_iota(jnp.int32, (block, 8), 1)


def _pack_kernel(scale_ref, x_ref, e_ref, bits_ref, err_ref):
    # One row (program_id 0), one block of groups (program_id 1): tiles (block, 8).
    y = x_ref[...] + e_ref[...]
    positive = y >= 0.0
    err_ref[...] = y - scale_ref[...] * _signs(positive)
    shifts = _bit_shifts(y.shape[0])
    byte = jnp.sum(jnp.where(positive, jnp.left_shift(jnp.int32(1), shifts), 0), axis=1)
    bits_ref[...] = byte.astype(jnp.uint8)


def _tile_signs(bits_row, block):
    """(block, 8) float32 +-1 from (block,) uint8 bits."""
    on = jnp.right_shift(bits_row.astype(jnp.int32)[:, None], _bit_shifts(block)) & 1
    return _signs(on != 0)


def _unpack_kernel(scale_ref, bits_ref, out_ref):
    block = out_ref.shape[0]
    out_ref[...] = scale_ref[...] * _tile_signs(bits_ref[...], block)


def _average_kernel(w_ref, bits_ref, out_ref, *, rows):
    # One block of groups, all rows (bits_ref: (R, block)); rows in order 0 .. R-1, the accumulator
    # kept in registers: a fixed order, so the same bits as the jnp reference.
    block = out_ref.shape[0]

    def term(r):
        return _tile_signs(bits_ref[r, :], block) * w_ref[r]

    out_ref[...] = lax.fori_loop(1, rows, lambda r, acc: acc + term(r), term(0))


def _compiler_params(interpret):
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu  # GPU only

    return plgpu.CompilerParams(num_warps=4, num_stages=2)


def _call(kernel, grid, in_specs, out_specs, out_shapes, interpret, *args):
    """pallas_call on ``args``; ``out_shapes``: (shape, dtype) pairs.

    Inside a ``shard_map`` that checks varying manual axes (its default, ``check_vma=True``), a
    pallas_call needs its outputs' ``manual_axis_type``: the outputs vary over the union of the
    inputs' varying axes, and every input is ``pcast`` to that union first (e.g. a replicated scale
    next to sharded rows). Outside a shard_map all of this is empty and changes nothing.

    Interpret mode cannot run there: JAX's HLO interpreter evaluates the kernel on blocks that vary
    over the manual axes next to constants that do not, and fails ("Primitive ge requires varying
    manual axes to match"); hence the error below (``check_vma=False``, as the engine uses, is fine).
    """
    varying = frozenset().union(*(jax.typeof(a).manual_axis_type.varying for a in args))
    if interpret and varying:
        raise ValueError(f"onebit_pack: the Pallas kernels cannot run in interpret mode inside a shard_map "
                         f"with check_vma=True (inputs varying over {sorted(varying, key=str)}); use "
                         "check_vma=False, impl='xla', or the compiled kernels on a GPU.")
    args = [a if not (missing := varying - jax.typeof(a).manual_axis_type.varying)
            else lax.pcast(a, tuple(sorted(missing, key=str)), to="varying") for a in args]
    mat = jax.sharding.ManualAxisType(varying=varying)
    out_shape = [jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat) for shape, dtype in out_shapes]
    multiple = isinstance(out_specs, (list, tuple))
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                          out_shape=out_shape if multiple else out_shape[0],
                          interpret=interpret, compiler_params=_compiler_params(interpret))(*args)


@functools.partial(jax.jit, static_argnames="interpret")
def _pack_signs_pallas(x, error, scale, *, interpret):
    rows, cols = x.shape
    groups = cols // 8
    block = _block_groups(groups)
    padded = pl.cdiv(groups, block) * block
    x3 = _pad_groups(x.reshape(rows, groups, 8), padded)
    e3 = _pad_groups(error.reshape(rows, groups, 8), padded)
    tile = pl.BlockSpec((None, block, 8), lambda r, j: (r, j, 0))
    bits, err = _call(
        _pack_kernel, (rows, padded // block),
        [pl.BlockSpec((None,), lambda r, j: (r,)), tile, tile],
        [pl.BlockSpec((None, block), lambda r, j: (r, j)), tile],
        [((rows, padded), jnp.uint8), ((rows, padded, 8), _F32)],
        interpret, scale, x3, e3)
    return bits[:, :groups], err[:, :groups].reshape(rows, cols)


@functools.partial(jax.jit, static_argnames=("average", "interpret"))
def _unpack_signs_pallas(bits, scale, *, average, interpret):
    rows, groups = bits.shape
    block = _block_groups(groups)
    padded = pl.cdiv(groups, block) * block
    bits = _pad_groups(bits, padded)
    nblocks = padded // block
    if not average:
        out = _call(
            _unpack_kernel, (rows, nblocks),
            [pl.BlockSpec((None,), lambda r, j: (r,)), pl.BlockSpec((None, block), lambda r, j: (r, j))],
            pl.BlockSpec((None, block, 8), lambda r, j: (r, j, 0)),
            [((rows, padded, 8), _F32)],
            interpret, scale, bits)
        return out[:, :groups].reshape(rows, groups * 8)
    out = _call(
        functools.partial(_average_kernel, rows=rows), (nblocks,),
        [pl.BlockSpec((rows,), lambda j: (0,)), pl.BlockSpec((rows, block), lambda j: (0, j))],
        pl.BlockSpec((block, 8), lambda j: (j, 0)),
        [((padded, 8), _F32)],
        interpret, _row_weights(scale, rows), bits)
    return out[:groups].reshape(groups * 8)


# ------------------------------------------------------------------------------------ public API
def pack_signs(x, error, scale, *, impl="auto", interpret=False):
    """Signs of ``x + error``, 8 to a byte, and the new error-feedback buffer.

    Args:
      x, error: float32 ``(R, C)``, ``R >= 1``, ``C`` a multiple of 8 (other float dtypes are cast to
        float32).
      scale: float32 ``(R,)``, one scale per row.
      impl: "xla" (the jnp reference), "pallas" (the kernels), or "auto" ("pallas" on a GPU or when
        ``interpret``, else "xla").
      interpret: run the Pallas kernels in interpret mode (CPU; tests). Ignored by ``impl="xla"``.

    Returns ``(bits, new_error)``: uint8 ``(R, C // 8)`` with ``bits == numpy.packbits(y >= 0, axis=-1)``
    for ``y = x + error``, and float32 ``(R, C)`` ``y - scale[:, None] * s`` with ``s = +1`` where
    ``y >= 0`` (zeros and -0.0 included), else -1.
    """
    name = "pack_signs"
    impl = _check_impl(name, impl, interpret)
    x, error = _as_f32(name, "x", x), _as_f32(name, "error", error)
    if x.ndim != 2 or x.shape[0] < 1 or x.shape[1] < 8 or x.shape[1] % 8:
        raise ValueError(f"{name}: x must be (R, C) with R >= 1 and C a positive multiple of 8 (8 signs per "
                         f"byte); got shape {x.shape}.")
    if error.shape != x.shape:
        raise ValueError(f"{name}: error must have x's shape {x.shape}; got {error.shape}.")
    scale = _check_scale(name, scale, x.shape[0])
    if impl == "xla":
        return pack_signs_xla(x, error, scale)
    return _pack_signs_pallas(x, error, scale, interpret=bool(interpret))


def unpack_signs(bits, scale, *, average, impl="auto", interpret=False):
    """Decompress packed signs: ``scale[r] * s[r, c]``, or their average over the rows.

    Args:
      bits: uint8 ``(R, C // 8)`` as :func:`pack_signs` makes them (``R >= 1``).
      scale: float32 ``(R,)``, one scale per row.
      average: False: return float32 ``(R, C)``, ``scale[r] * s[r, c]``. True: return float32 ``(C,)``,
        ``sum_r s[r, c] * w[r]`` with ``w = scale * float32(1 / R)`` (i.e. ``scale[r] / R``), accumulated
        over ``r = 0, 1, ..., R - 1`` in that order, starting from the ``r = 0`` term (reproducible, and
        the same bits for both implementations).
      impl, interpret: as for :func:`pack_signs`.
    """
    name = "unpack_signs"
    impl = _check_impl(name, impl, interpret)
    if not isinstance(average, (bool, np.bool_)):
        raise ValueError(f"{name}: average must be True or False (static), got {average!r}.")
    bits = jnp.asarray(bits)
    if bits.dtype != jnp.uint8:
        raise ValueError(f"{name}: bits must be uint8 (8 signs per byte), got dtype {bits.dtype}.")
    if bits.ndim != 2 or bits.shape[0] < 1 or bits.shape[1] < 1:
        raise ValueError(f"{name}: bits must be (R, C // 8) with R >= 1 and C >= 8; got shape {bits.shape}.")
    scale = _check_scale(name, scale, bits.shape[0])
    if impl == "xla":
        return unpack_signs_xla(bits, scale, average=bool(average))
    return _unpack_signs_pallas(bits, scale, average=bool(average), interpret=bool(interpret))
