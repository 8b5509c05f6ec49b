"""Block lookup tables for block-sparse attention, independent of any kernel backend.

A layout (``(heads, nq, nk)`` 0/1, see ``sparsity_config``) is turned, once and in
numpy at trace time, into small integer tables that the kernels index:

* :class:`RowTable` -- per (head, row block) the list of its nonzero column
  blocks, padded to a common width, plus the count. The Pallas kernels loop
  over ``cols[h, i, :counts[h, i]]`` (forward and dq: the layout's rows; dk/dv:
  the rows of the transposed layout). Nothing here depends on Triton or Mosaic
  GPU, so a Mosaic GPU kernel can use the same tables.
* :class:`SplitTable` -- the same nonzeros cut into "virtual rows" of at most
  ``chunk`` column blocks each (a row with many blocks, e.g. a global row,
  becomes several virtual rows). The XLA path processes all virtual rows as
  one batch and merges the pieces of each row with a log-sum-exp (the online
  softmax across chunks). Its size is ``nnz / chunk + rows``, linear in L at a
  fixed number of blocks per row, even when a few global rows are dense.

With ``causal=True`` the blocks strictly above the diagonal are dropped (they
are fully masked); the diagonal blocks keep an element-wise causal mask in the
kernels.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

__all__ = ["normalize_layout", "effective_layout", "RowTable", "SplitTable", "row_table", "split_table",
           "default_chunk"]


def normalize_layout(layout, num_heads: int, seq_len: int) -> tuple[np.ndarray, int]:
    """Check a layout against the attention shapes; return it as bool ``(Hl, nb, nb)`` and the block size.

    ``layout`` may be ``(nb, nb)`` or ``(Hl, nb, nb)`` with ``Hl`` equal to 1 or
    ``num_heads``. It must be concrete (numpy, or a concrete jax array): the
    sparsity pattern is a compile-time constant.
    """
    try:
        arr = np.asarray(layout)
    except Exception as e:  # a tracer
        raise TypeError("sparse_attention: `layout` must be a concrete array (e.g. the numpy array from "
                        "SparsityConfig.make_layout), not a traced value; it is a compile-time constant.") from e
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3 or arr.shape[1] != arr.shape[2]:
        raise ValueError(f"sparse_attention: layout must have shape (heads, nb, nb) or (nb, nb); got {arr.shape}.")
    if arr.shape[0] not in (1, num_heads):
        raise ValueError(f"sparse_attention: layout has {arr.shape[0]} heads but q has {num_heads}; give one "
                         "layout per head or a single layout for all heads.")
    nb = arr.shape[1]
    if nb == 0 or seq_len % nb != 0:
        raise ValueError(f"sparse_attention: sequence length {seq_len} is not a multiple of the layout's "
                         f"{nb} blocks; the layout must come from make_layout({seq_len}).")
    return arr != 0, seq_len // nb


def effective_layout(layout: np.ndarray, causal: bool) -> np.ndarray:
    """Drop the blocks that ``causal`` masks entirely (strictly above the diagonal)."""
    if not causal:
        return layout
    return layout & np.tri(layout.shape[-1], dtype=bool)


@dataclasses.dataclass(frozen=True)
class RowTable:
    """Nonzero column blocks per row: ``cols[h, i, t]`` for ``t < counts[h, i]`` (int32).

    Entries at ``t >= counts[h, i]`` repeat a valid column (never read by a
    kernel that loops to the count, and harmless if one reads them).
    """

    cols: np.ndarray  # (Hl, rows, width) int32
    counts: np.ndarray  # (Hl, rows) int32

    @property
    def width(self) -> int:
        return self.cols.shape[-1]


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def row_table(layout: np.ndarray, *, transpose: bool = False, pow2_width: bool = False) -> RowTable:
    """The :class:`RowTable` of a bool ``(Hl, n, n)`` layout (of its transpose if ``transpose``)."""
    lay = np.swapaxes(layout, -1, -2) if transpose else layout
    counts = lay.sum(-1).astype(np.int32)
    width = max(1, int(counts.max(initial=0)))
    if pow2_width:
        width = _next_pow2(width)
    # Stable sort puts the nonzero columns first, in increasing order.
    order = np.argsort(~lay, axis=-1, kind="stable")[..., :width].astype(np.int32)
    t = np.arange(width)
    last = np.take_along_axis(order, np.maximum(counts - 1, 0)[..., None], axis=-1)
    cols = np.where(t < counts[..., None], order, last).astype(np.int32)
    return RowTable(cols=cols, counts=counts)


@dataclasses.dataclass(frozen=True)
class SplitTable:
    """Nonzeros cut into virtual rows of at most ``chunk`` blocks.

    ``row[h, v]``: the row block of virtual row ``v`` (non-decreasing in ``v``);
    ``cols[h, v, c]`` its column blocks, valid where ``valid[h, v, c]``. Heads are
    padded to a common number of virtual rows with fully invalid entries.
    """

    row: np.ndarray  # (Hl, V) int32
    cols: np.ndarray  # (Hl, V, chunk) int32
    valid: np.ndarray  # (Hl, V, chunk) bool

    @property
    def chunk(self) -> int:
        return self.cols.shape[-1]


def default_chunk(layout: np.ndarray) -> int:
    """Blocks per virtual row: the mean count of the nonempty rows, rounded up, at most 8."""
    counts = layout.sum(-1)
    nonempty = counts[counts > 0]
    if nonempty.size == 0:
        return 1
    return int(min(8, max(1, math.ceil(nonempty.mean()))))


def split_table(layout: np.ndarray, chunk: int, *, transpose: bool = False) -> SplitTable:
    """The :class:`SplitTable` of a bool ``(Hl, n, n)`` layout (of its transpose if ``transpose``)."""
    lay = np.swapaxes(layout, -1, -2) if transpose else layout
    per_head = []
    for h in range(lay.shape[0]):
        r, c = np.nonzero(lay[h])  # row-major: grouped by row, columns increasing
        counts = np.bincount(r, minlength=lay.shape[1])
        first = np.concatenate([[0], np.cumsum(counts)[:-1]])
        rank = np.arange(r.size) - first[r]  # position of each nonzero within its row
        pieces = -(-counts // chunk)  # virtual rows per row
        base = np.concatenate([[0], np.cumsum(pieces)[:-1]])
        v = base[r] + rank // chunk
        n_v = int(pieces.sum())
        row = np.repeat(np.arange(lay.shape[1]), pieces)
        cols = np.zeros((n_v, chunk), np.int32)
        valid = np.zeros((n_v, chunk), bool)
        cols[v, rank % chunk] = c
        valid[v, rank % chunk] = True
        per_head.append((row, cols, valid))
    n_max = max(1, max(p[0].size for p in per_head))
    n = lay.shape[1]
    rows = np.full((len(per_head), n_max), n - 1, np.int32)
    cols = np.zeros((len(per_head), n_max, chunk), np.int32)
    valid = np.zeros((len(per_head), n_max, chunk), bool)
    for h, (r, c, m) in enumerate(per_head):
        rows[h, :r.size], cols[h, :r.size], valid[h, :r.size] = r, c, m
    return SplitTable(row=rows, cols=cols, valid=valid)
