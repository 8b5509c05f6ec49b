"""Block-sparse attention layouts with DeepSpeed's configuration classes.

A *layout* is a 0/1 array of shape ``(num_heads, L // block, L // block)``:
``layout[h, i, j] == 1`` lets the queries of block ``i`` attend to the keys of
block ``j`` in head ``h``. The classes, their parameters and their defaults are
those of ``deepspeed.ops.sparse_attention.sparsity_config``, and for the same
arguments ``make_layout`` returns the same layout as DeepSpeed (checked against
layouts generated with DeepSpeed's own code, see ``tools/gen_sparse_layouts.py``
and ``docs/sparse_attention.md``). The code here is an independent numpy
implementation.

Differences from DeepSpeed, all deliberate:

* ``make_layout`` returns a numpy ``uint8`` array, not a torch ``int64`` tensor
  (a layout at L = 32k with 16 heads would otherwise take 512 MB).
* Random blocks (``Variable``, ``BigBird``) come from ``random.Random(seed)``,
  a private generator, instead of the global ``random`` module. The seeding
  rule: ``Config(..., seed=s).make_layout(L)`` equals DeepSpeed's
  ``random.seed(s); Config(...).make_layout(L)``. The draws are the same calls
  in the same order (``sample(range(n), k)`` per block row, heads in order).
  The default ``seed=0`` makes layouts deterministic, which JAX needs: a layout
  is a compile-time constant and must be identical on every host.
* Arguments DeepSpeed accepts silently or fails on obscurely (an unknown
  ``attention`` string, a negative global index, an empty
  ``local_window_blocks``, zero block counts) raise ``ValueError`` here.
* ``BigBird`` with unidirectional attention and ``num_random_blocks > 1``:
  DeepSpeed's ``random.sample`` fails on the first rows, whose causal range
  holds fewer blocks than requested. Here such a row takes all of its
  ``row + 1`` candidate blocks; later rows draw as DeepSpeed would.
"""

from __future__ import annotations

import random
from typing import Sequence

import numpy as np

__all__ = [
    "SparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "VariableSparsityConfig",
    "BigBirdSparsityConfig",
    "BSLongformerSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
]

_ATTENTION_KINDS = ("unidirectional", "bidirectional")


def _check_attention(name: str, attention: str) -> str:
    if attention not in _ATTENTION_KINDS:
        raise ValueError(f"{name}: attention={attention!r} is not supported; use 'unidirectional' "
                         "(causal, e.g. GPT) or 'bidirectional' (e.g. BERT).")
    return attention


def _check_int(name: str, key: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}: {key}={value!r} must be an integer >= {minimum}.")
    return int(value)


def _check_global_indices(name: str, starts, ends):
    starts = [_check_int(name, "global_block_indices[i]", s, 0) for s in starts]
    if ends is None:
        return starts, None
    ends = [_check_int(name, "global_block_end_indices[i]", e, 0) for e in ends]
    if len(starts) != len(ends):
        raise ValueError(f"{name}: global_block_indices has {len(starts)} entries but "
                         f"global_block_end_indices has {len(ends)}; give one end per start.")
    for s, e in zip(starts, ends):
        if s >= e:
            raise ValueError(f"{name}: global block start index {s} must be smaller than its end "
                             f"index {e} (the end is exclusive).")
    return starts, ends


def _global_spans(starts, ends, num_blocks):
    """[(start, end)] block ranges of the global blocks that fall inside the sequence."""
    if ends is None:
        return [(s, s + 1) for s in starts if s < num_blocks]
    return [(s, min(e, num_blocks)) for s, e in zip(starts, ends) if s < num_blocks]


def _windows_mask(num_blocks: int, window_starts: np.ndarray, causal: bool) -> np.ndarray:
    """Block-diagonal mask: rows/cols in the same window attend (lower part only if causal).

    ``window_starts`` is the sorted array of first blocks of consecutive windows,
    beginning with 0; the last window runs to ``num_blocks``.
    """
    ids = np.searchsorted(window_starts, np.arange(num_blocks), side="right")
    same = ids[:, None] == ids[None, :]
    if causal:
        same &= np.tri(num_blocks, dtype=bool)
    return same


def _band(num_blocks: int, below: int, above: int) -> np.ndarray:
    """Mask of |i - j| band: row i attends to columns i - below .. i + above."""
    d = np.arange(num_blocks)[None, :] - np.arange(num_blocks)[:, None]
    return (d >= -below) & (d <= above)


def _make_rng(seed):
    """``random.Random(seed)``; ``seed=None`` uses the global ``random`` module, like DeepSpeed."""
    return random if seed is None else random.Random(seed)


def _window_half_width(config, num_blocks: int) -> int:
    """Half the sliding window (blocks on each side of the diagonal), after checking it fits a row."""
    if num_blocks < config.num_sliding_window_blocks:
        raise ValueError(f"{type(config).__name__}: num_sliding_window_blocks="
                         f"{config.num_sliding_window_blocks} exceeds the {num_blocks} blocks of a row.")
    return config.num_sliding_window_blocks // 2


class SparsityConfig:
    """Base class: number of heads, block size, and whether heads differ.

    Subclasses implement :meth:`_head_layout`, which returns the boolean
    ``(num_blocks, num_blocks)`` layout of one head.
    """

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False):
        name = type(self).__name__
        self.num_heads = _check_int(name, "num_heads", num_heads, 1)
        self.block = _check_int(name, "block", block, 1)
        self.different_layout_per_head = bool(different_layout_per_head)
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def num_blocks(self, seq_len: int) -> int:
        if seq_len % self.block != 0:
            raise ValueError(f"{type(self).__name__}: sequence length {seq_len} must be divisible by "
                             f"the block size {self.block}; pad the sequence or change `block`.")
        return seq_len // self.block

    def setup_layout(self, seq_len: int) -> np.ndarray:
        """An all-zero ``(num_heads, L/block, L/block)`` layout (checks divisibility)."""
        nb = self.num_blocks(seq_len)
        return np.zeros((self.num_heads, nb, nb), dtype=np.uint8)

    def make_layout(self, seq_len: int) -> np.ndarray:
        """The ``(num_heads, L/block, L/block)`` 0/1 layout (``uint8``) for ``seq_len`` tokens."""
        layout = self.setup_layout(seq_len)
        nb = layout.shape[1]
        rng = self._rng()
        for h in range(self.num_layout_heads):
            layout[h] = self._head_layout(h, nb, rng)
        if not self.different_layout_per_head:
            layout[1:] = layout[0]
        return layout

    def _rng(self):
        return None

    def _head_layout(self, h: int, num_blocks: int, rng) -> np.ndarray:
        # The base class names no pattern (as in DeepSpeed); use one of the subclasses below.
        raise TypeError(f"{type(self).__name__} is the base class; use a subclass such as "
                        "BigBirdSparsityConfig or FixedSparsityConfig")

    def to_dict(self) -> dict:
        """JSON-serialisable: the class name and the constructor arguments (see `sparsity_from_dict`)."""
        return {"class": type(self).__name__,
                **{k: v for k, v in vars(self).items() if k != "num_layout_heads"}}

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if k != "num_layout_heads")
        return f"{type(self).__name__}({args})"


class DenseSparsityConfig(SparsityConfig):
    """Every block attends to every block (for comparison)."""

    def _head_layout(self, h, num_blocks, rng):
        return np.ones((num_blocks, num_blocks), dtype=bool)


class FixedSparsityConfig(SparsityConfig):
    """"Fixed" pattern of Sparse Transformers (Child et al. 2019), as customised by DeepSpeed.

    Local: the blocks are cut into windows of ``num_local_blocks``; each window
    attends within itself. Global: in every window, ``num_global_blocks``
    consecutive blocks, counted back from the window's end (shifted by
    ``h % num_different_global_patterns`` groups for head ``h``), are attended
    by all rows (unidirectional: by the rows from that block on) and, with
    ``horizontal_global_attention``, attend to all columns.
    """

    def __init__(self, num_heads, block=16, different_layout_per_head=False, num_local_blocks=4,
                 num_global_blocks=1, attention="bidirectional", horizontal_global_attention=False,
                 num_different_global_patterns=1):
        super().__init__(num_heads, block, different_layout_per_head)
        name = type(self).__name__
        self.num_local_blocks = _check_int(name, "num_local_blocks", num_local_blocks, 1)
        self.num_global_blocks = _check_int(name, "num_global_blocks", num_global_blocks, 1)
        if num_local_blocks % num_global_blocks != 0:
            raise ValueError(f"{name}: num_local_blocks={num_local_blocks} must be a multiple of "
                             f"num_global_blocks={num_global_blocks}.")
        self.attention = _check_attention(name, attention)
        if horizontal_global_attention and attention != "bidirectional":
            raise ValueError(f"{name}: horizontal_global_attention=True needs attention='bidirectional' "
                             "(a global row attending to all columns would see the future).")
        self.horizontal_global_attention = bool(horizontal_global_attention)
        self.num_different_global_patterns = _check_int(name, "num_different_global_patterns",
                                                        num_different_global_patterns, 1)
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError(f"{name}: num_different_global_patterns={num_different_global_patterns} "
                             "needs different_layout_per_head=True (otherwise all heads share head 0's layout).")
        most = num_local_blocks // num_global_blocks
        if num_different_global_patterns > most:
            raise ValueError(f"{name}: num_different_global_patterns={num_different_global_patterns} "
                             f"cannot exceed num_local_blocks // num_global_blocks = {most}.")

    def _head_layout(self, h, nb, rng):
        nl, ng = self.num_local_blocks, self.num_global_blocks
        uni = self.attention == "unidirectional"
        out = _windows_mask(nb, np.arange(0, nb, nl), causal=uni)
        offset = nl - (1 + h % self.num_different_global_patterns) * ng
        full = nb - nb % nl
        starts = list(range(offset, full, nl))
        if full < nb:  # a short last window: its global group is clamped inside the sequence
            starts.append(min(full + offset, nb - ng))
        for s in starts:
            out[s if uni else 0:, s:s + ng] = True
            if self.horizontal_global_attention:
                out[s:s + ng, :] = True
        return out


class VariableSparsityConfig(SparsityConfig):
    """Fixed-like pattern with random blocks, variable local windows and explicit global blocks.

    ``num_random_blocks`` random columns per row, drawn from all columns (as in
    DeepSpeed, also for unidirectional attention); local windows of sizes
    ``local_window_blocks`` (the last size repeats to the end); global blocks at
    ``global_block_indices`` (ranges up to ``global_block_end_indices`` if given).
    """

    def __init__(self, num_heads, block=16, different_layout_per_head=False, num_random_blocks=0,
                 local_window_blocks=(4,), global_block_indices=(0,), global_block_end_indices=None,
                 attention="bidirectional", horizontal_global_attention=False, seed: int = 0):
        super().__init__(num_heads, block, different_layout_per_head)
        name = type(self).__name__
        self.num_random_blocks = _check_int(name, "num_random_blocks", num_random_blocks, 0)
        if len(local_window_blocks) == 0:
            raise ValueError(f"{name}: local_window_blocks must list at least one window size.")
        self.local_window_blocks = [_check_int(name, "local_window_blocks[i]", w, 1)
                                    for w in local_window_blocks]
        self.global_block_indices, self.global_block_end_indices = _check_global_indices(
            name, global_block_indices, global_block_end_indices)
        self.attention = _check_attention(name, attention)
        if horizontal_global_attention and attention != "bidirectional":
            raise ValueError(f"{name}: horizontal_global_attention=True needs attention='bidirectional'.")
        self.horizontal_global_attention = bool(horizontal_global_attention)
        self.seed = seed

    def _rng(self):
        return _make_rng(self.seed)

    def _head_layout(self, h, nb, rng):
        name = type(self).__name__
        if nb < self.num_random_blocks:
            raise ValueError(f"{name}: num_random_blocks={self.num_random_blocks} exceeds the "
                             f"{nb} blocks of a row.")
        uni = self.attention == "unidirectional"
        out = np.zeros((nb, nb), dtype=bool)
        for row in range(nb):
            out[row, rng.sample(range(nb), self.num_random_blocks)] = True
        sizes = self.local_window_blocks
        starts = np.cumsum([0] + sizes[:-1])
        tail = int(starts[-1]) + sizes[-1]
        starts = np.concatenate([starts, np.arange(tail, nb, sizes[-1])]).astype(np.int64)
        starts = starts[starts < nb]
        out |= _windows_mask(nb, starts, causal=uni)
        for s, e in _global_spans(self.global_block_indices, self.global_block_end_indices, nb):
            if self.horizontal_global_attention:
                out[s:e, :] = True
            out[s if uni else 0:, s:e] = True
        return out


class BigBirdSparsityConfig(SparsityConfig):
    """BigBird (Zaheer et al. 2020): random + sliding window + global blocks.

    Row ``i`` draws ``num_random_blocks`` random columns (unidirectional: among
    ``0..i``), attends to the ``num_sliding_window_blocks`` blocks centred on
    ``i``, and the first ``num_global_blocks`` blocks are global rows and
    columns. Unidirectional keeps the lower triangle of the result.
    """

    def __init__(self, num_heads, block=16, different_layout_per_head=False, num_random_blocks=1,
                 num_sliding_window_blocks=3, num_global_blocks=1, attention="bidirectional",
                 seed: int = 0):
        super().__init__(num_heads, block, different_layout_per_head)
        name = type(self).__name__
        self.num_random_blocks = _check_int(name, "num_random_blocks", num_random_blocks, 0)
        self.num_sliding_window_blocks = _check_int(name, "num_sliding_window_blocks",
                                                    num_sliding_window_blocks, 1)
        self.num_global_blocks = _check_int(name, "num_global_blocks", num_global_blocks, 0)
        self.attention = _check_attention(name, attention)
        self.seed = seed

    def _rng(self):
        return _make_rng(self.seed)

    def _head_layout(self, h, nb, rng):
        name = type(self).__name__
        for key in ("num_random_blocks", "num_sliding_window_blocks", "num_global_blocks"):
            if nb < getattr(self, key):
                raise ValueError(f"{name}: {key}={getattr(self, key)} exceeds the {nb} blocks of a row.")
        uni = self.attention == "unidirectional"
        out = np.zeros((nb, nb), dtype=bool)
        for row in range(nb):
            n = row + 1 if uni else nb
            out[row, rng.sample(range(n), min(self.num_random_blocks, n))] = True
        w = self.num_sliding_window_blocks // 2
        out |= _band(nb, w, w)
        g = self.num_global_blocks
        out[:g, :] = True
        out[:, :g] = True
        if uni:
            out &= np.tri(nb, dtype=bool)
        return out


class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer (Beltagy et al. 2020): sliding window + global blocks.

    Global blocks (``global_block_indices``, ranges up to
    ``global_block_end_indices`` if given) are full rows and columns.
    Unidirectional keeps the lower triangle.
    """

    def __init__(self, num_heads, block=16, different_layout_per_head=False, num_sliding_window_blocks=3,
                 global_block_indices=(0,), global_block_end_indices=None, attention="bidirectional"):
        super().__init__(num_heads, block, different_layout_per_head)
        name = type(self).__name__
        self.num_sliding_window_blocks = _check_int(name, "num_sliding_window_blocks",
                                                    num_sliding_window_blocks, 1)
        self.global_block_indices, self.global_block_end_indices = _check_global_indices(
            name, global_block_indices, global_block_end_indices)
        self.attention = _check_attention(name, attention)

    def _head_layout(self, h, nb, rng):
        w = _window_half_width(self, nb)
        out = _band(nb, w, w)
        for s, e in _global_spans(self.global_block_indices, self.global_block_end_indices, nb):
            out[s:e, :] = True
            out[:, s:e] = True
        if self.attention == "unidirectional":
            out &= np.tri(nb, dtype=bool)
        return out


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """Purely local sliding window of ``num_sliding_window_blocks`` blocks.

    Bidirectional: row ``i`` attends to ``i - w .. i + w`` with
    ``w = num_sliding_window_blocks // 2``; unidirectional (the default, as in
    DeepSpeed): to ``i - w .. i``. All heads share one layout.
    """

    def __init__(self, num_heads, block=16, num_sliding_window_blocks=3, attention="unidirectional"):
        super().__init__(num_heads, block)
        name = type(self).__name__
        self.num_sliding_window_blocks = _check_int(name, "num_sliding_window_blocks",
                                                    num_sliding_window_blocks, 1)
        self.attention = _check_attention(name, attention)

    def _head_layout(self, h, nb, rng):
        w = _window_half_width(self, nb)
        return _band(nb, w, 0 if self.attention == "unidirectional" else w)


def sparsity_from_dict(spec: dict) -> SparsityConfig:
    """Rebuild a config from `SparsityConfig.to_dict()` (e.g. from a checkpoint's metadata)."""
    classes = {cls.__name__: cls for cls in (DenseSparsityConfig, FixedSparsityConfig, VariableSparsityConfig,
                                             BigBirdSparsityConfig, BSLongformerSparsityConfig,
                                             LocalSlidingWindowSparsityConfig)}
    spec = dict(spec)
    name = spec.pop("class")
    if name not in classes:
        raise ValueError(f"unknown sparsity config class {name!r}; expected one of {sorted(classes)}")
    return classes[name](**spec)
