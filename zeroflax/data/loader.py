"""Deterministic, resumable, process-sharded batches of next-token windows (numpy only).

The whole sample order is a pure function of (seed, epoch, step), so every process computes the same
global batch without communicating, takes its own rows, and a checkpoint needs only a few integers.
"""
from __future__ import annotations

import numbers

import numpy as np

from zeroflax.data.corpus import DataError

__all__ = ["TokenLoader", "num_windows", "train_val_split", "validation_batches"]


def _check_int(value, key: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise DataError(f"{key} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_tokens(tokens) -> np.ndarray:
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(
            f"tokens must be a 1-D integer array, got shape {tokens.shape} dtype {tokens.dtype}; "
            "use zeroflax.data.load_tokens(...) to build one"
        )
    return tokens


def _check_processes(global_batch: int, process_index: int, process_count: int) -> int:
    """Per-process batch size; every process must get the same number of rows or the global batch
    (and with it the loss) would depend on the process count."""
    process_count = _check_int(process_count, "process_count", 1)
    process_index = _check_int(process_index, "process_index", 0)
    if process_index >= process_count:
        raise DataError(f"process_index={process_index} must be < process_count={process_count}")
    if global_batch % process_count:
        raise DataError(
            f"global_batch={global_batch} is not divisible by process_count={process_count}; "
            "choose a global_batch that is a multiple of the number of processes"
        )
    return global_batch // process_count


def num_windows(num_tokens: int, seq_len: int) -> int:
    """Number of windows of seq_len + 1 tokens starting at multiples of seq_len in a stream of num_tokens.

    Stepping by seq_len (not seq_len + 1) makes every token a target exactly once, except the first.
    """
    return max(0, (int(num_tokens) - 1) // int(seq_len))


def _gather(tokens: np.ndarray, window_ids: np.ndarray, seq_len: int) -> np.ndarray:
    starts = np.asarray(window_ids, dtype=np.int64) * seq_len
    return tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32, copy=False)


def _too_short(what: str, n_tokens: int, n_win: int, global_batch: int, seq_len: int) -> DataError:
    return DataError(
        f"{what} of {n_tokens} tokens ({n_win} windows) is too short for one batch of {global_batch} windows "
        f"of {seq_len + 1} tokens; use more data, a smaller global_batch or a smaller seq_len"
    )


def train_val_split(tokens: np.ndarray, val_fraction: float = 0.05, *,
                    min_tokens: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Split a stream into (train, validation): the last ``val_fraction`` of the tokens is validation.

    Contiguous rather than random so that no validation window shares text with a training window. Both
    parts must hold at least ``min_tokens`` tokens (default 2, one window of one input and one target;
    pass ``seq_len + 1`` to require a full window). The parts are views, not copies.
    """
    tokens = _check_tokens(tokens)
    if isinstance(val_fraction, bool) or not isinstance(val_fraction, numbers.Real) or not 0 < val_fraction <= 0.5:
        raise DataError(f"val_fraction must be in (0, 0.5], got {val_fraction!r}")
    min_tokens = _check_int(min_tokens, "min_tokens", 1)
    n = tokens.shape[0]
    n_val = max(1, int(round(n * float(val_fraction))))
    n_train = n - n_val
    if n_train < min_tokens or n_val < min_tokens:
        raise DataError(
            f"stream of {n} tokens is too short to split with val_fraction={val_fraction}: train gets {n_train} "
            f"and validation {n_val} tokens, each needs at least {min_tokens}; use more data"
        )
    return tokens[:n_train], tokens[n_train:]


class TokenLoader:
    """Shuffled training batches of windows of ``seq_len + 1`` tokens (inputs and next-token targets).

    Window k is ``tokens[k*seq_len : k*seq_len + seq_len + 1]``. Epoch e visits every window once, in the
    order ``np.random.default_rng((seed, e)).permutation(num_windows)``; step s of the epoch is positions
    ``[s*global_batch, (s+1)*global_batch)`` of that order, and the tail that does not fill a batch is
    dropped so a batch never mixes epochs. This process gets rows
    ``[process_index*b, (process_index+1)*b)`` of the global batch, ``b = global_batch // process_count``.
    The position is just (epoch, step_in_epoch), so :meth:`state` / :meth:`restore` resume exactly, even
    with a different process count.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, *, seed: int = 0,
                 process_index: int = 0, process_count: int = 1):
        self._tokens = _check_tokens(tokens)
        self.seq_len = _check_int(seq_len, "seq_len", 1)
        self.global_batch = _check_int(global_batch, "global_batch", 1)
        self.seed = _check_int(seed, "seed", 0)  # default_rng needs a non-negative seed
        self.local_batch = _check_processes(self.global_batch, process_index, process_count)
        self.process_index = int(process_index)
        self.process_count = int(process_count)
        self.num_windows = num_windows(self._tokens.shape[0], self.seq_len)
        if self.num_windows < self.global_batch:
            raise _too_short("training stream", self._tokens.shape[0], self.num_windows,
                             self.global_batch, self.seq_len)
        self._epoch = 0
        self._step = 0
        self._perm_epoch = -1
        self._perm: np.ndarray | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Full global batches per epoch (the partial tail batch is dropped)."""
        return self.num_windows // self.global_batch

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:  # one permutation per epoch, computed once
            self._perm = np.random.default_rng((self.seed, epoch)).permutation(self.num_windows)
            self._perm_epoch = epoch
        return self._perm

    def window_ids(self, epoch: int, step: int) -> np.ndarray:
        """Window indices of this process's rows at (epoch, step) — a pure function, handy for tests/debugging."""
        start = step * self.global_batch + self.process_index * self.local_batch
        return self._permutation(epoch)[start:start + self.local_batch]

    def next_batch(self) -> dict:
        """``{'tokens': int32 [global_batch // process_count, seq_len + 1]}`` and advance one step."""
        ids = self.window_ids(self._epoch, self._step)
        self._step += 1
        if self._step >= self.steps_per_epoch:
            self._epoch, self._step = self._epoch + 1, 0
        return {"tokens": _gather(self._tokens, ids, self.seq_len)}

    def __iter__(self):
        while True:
            yield self.next_batch()

    def state(self) -> dict:
        """JSON-serialisable position: the next batch is step ``step_in_epoch`` of epoch ``epoch``.

        Includes the settings that determine the sample order, so restoring into a loader that would
        produce a different order fails loudly instead of silently changing the data.
        """
        return {
            "epoch": self._epoch,
            "step_in_epoch": self._step,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "global_batch": self.global_batch,
            "num_windows": self.num_windows,
        }

    def restore(self, state: dict) -> None:
        """Continue exactly from ``state`` (from :meth:`state`). DataError, naming the key, if the state is
        malformed or was saved with a different seed, seq_len, global_batch or data length."""
        if not isinstance(state, dict):
            raise DataError(f"loader state must be a dict from TokenLoader.state(), got {type(state).__name__}")
        for key in ("seed", "seq_len", "global_batch", "num_windows"):
            if key not in state:
                if key == "num_windows":
                    continue  # optional: hand-written states may omit it
                raise DataError(f"loader state has no {key!r}; pass a dict from TokenLoader.state()")
            if state[key] != getattr(self, key):
                raise DataError(
                    f"loader state has {key}={state[key]!r} but this loader has {key}={getattr(self, key)!r}; "
                    f"the sample order would differ, so build the loader with the same {key}"
                    + (" (the same data)" if key == "num_windows" else "")
                )
        for key in ("epoch", "step_in_epoch"):
            if key not in state:
                raise DataError(f"loader state has no {key!r}; pass a dict from TokenLoader.state()")
        epoch = _check_int(state["epoch"], "loader state 'epoch'", 0)
        step = _check_int(state["step_in_epoch"], "loader state 'step_in_epoch'", 0)
        if step > self.steps_per_epoch:
            raise DataError(
                f"loader state 'step_in_epoch'={step} exceeds steps_per_epoch={self.steps_per_epoch}"
            )
        if step == self.steps_per_epoch:
            epoch, step = epoch + 1, 0
        self._epoch, self._step = epoch, step


def validation_batches(tokens: np.ndarray, seq_len: int, global_batch: int, *, max_batches: int | None = None,
                       process_index: int = 0, process_count: int = 1):
    """Iterator over validation batches: windows 0, 1, 2, ... in order, no shuffling, same row slicing per
    process as :class:`TokenLoader`; the last partial batch is dropped so every batch has the same shape
    (one compiled eval step).

    Arguments are checked now, not at the first ``next()``: DataError if the stream holds no full batch,
    because an empty evaluation would otherwise report a meaningless (NaN) loss.
    """
    tokens = _check_tokens(tokens)
    seq_len = _check_int(seq_len, "seq_len", 1)
    global_batch = _check_int(global_batch, "global_batch", 1)
    local_batch = _check_processes(global_batch, process_index, process_count)
    if max_batches is not None:
        max_batches = _check_int(max_batches, "max_batches", 0)
    n_win = num_windows(tokens.shape[0], seq_len)
    n_batches = n_win // global_batch
    if n_batches == 0:
        raise _too_short("validation stream", tokens.shape[0], n_win, global_batch, seq_len)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    offset = int(process_index) * local_batch

    def batches():
        for b in range(n_batches):
            start = b * global_batch + offset
            yield {"tokens": _gather(tokens, np.arange(start, start + local_batch), seq_len)}

    return batches()
