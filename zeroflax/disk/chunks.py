"""How the master weights and optimizer state are cut into chunks, each a record of the state's file.

A pure function of (the true abstract parameters and optimizer state, the master weights' shardings, the
optimizer, the chunk size): no array is read. The unit is one device's shard of one parameter leaf, as
the master weights are partitioned over data at rest (`sharding/policy.py`), cut along its first
dimension into runs of rows of at most `buffer_size` elements (at least one row). Shards that several of
this process's devices hold alike (a leaf below the persistence threshold is whole on every device) are one
chunk, applied to each. So each process writes only its own shards, as each DeepSpeed rank swaps its
own partition.

A chunk's record holds only the elements of the true leaf: the padding a partitioned leaf is stored with
(`sharding/padding.py`) is zero and stays zero (the optimizer never sees it, as in the offloaded update),
so it is neither read nor written. The record holds the chunk's master weights, then each of the leaf's
parameter-shaped optimizer slots (Adam: mu, nu), each part aligned to 64 bytes.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from zeroflax.optim.chunked import param_slots
from zeroflax.sharding.padding import stored_shape

PART_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class Chunk:
    leaf: int  # the parameter leaf
    devices: tuple  # this process's devices whose shard holds it (one, or the replicas of a whole leaf)
    shard_rows: int  # where its rows start in the shard (the device copy is updated there)
    box: tuple[int, ...]  # its shape as the record holds it: the true elements (rows x the rest, unpadded)
    global_start: tuple[int, ...]  # its first element's index in the stored global leaf
    parts: tuple  # (state leaf or -1 for the master, its numpy dtype, byte offset) per part
    nbytes: int  # the record's payload

    @property
    def elements(self) -> int:
        return math.prod(self.box)


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    chunks: tuple[Chunk, ...]
    slots: tuple[tuple[int, ...], ...]  # per parameter leaf: its parameter-shaped optimizer state leaves
    shared: tuple[int, ...]  # optimizer state leaves that belong to no parameter (step counts): kept whole

    @property
    def record_sizes(self) -> list[int]:
        return [c.nbytes for c in self.chunks]

    @property
    def largest(self) -> int:
        return max((c.nbytes for c in self.chunks), default=0)


def _aligned(n: int, to: int) -> int:
    return -(-n // to) * to


def chunk_layout(abstract_params, abstract_opt_state, master_shardings, optimizer, buffer_size: int) -> ChunkLayout:
    """The chunks of this process's shards (true shapes in; `master_shardings` as the plan stores them)."""
    slots, shared = param_slots(optimizer, abstract_params, abstract_opt_state)
    params = jax.tree.leaves(abstract_params)
    opt = jax.tree.leaves(abstract_opt_state)
    chunks = []
    for i, (leaf, sharding) in enumerate(zip(params, jax.tree.leaves(master_shardings))):
        true = tuple(leaf.shape)
        stored = stored_shape(true, sharding)
        by_index: dict = {}
        for device, index in sharding.addressable_devices_indices_map(stored).items():
            key = tuple((s.start or 0, s.stop if s.stop is not None else n) for s, n in zip(index, stored))
            by_index.setdefault(key, []).append(device)
        for key, devices in sorted(by_index.items(), key=lambda kv: kv[0]):
            shard = tuple(stop - start for start, stop in key)
            if not shard:  # a scalar leaf
                chunks.append(_chunk(i, tuple(devices), 0, (), (), leaf, slots[i], opt))
                continue
            per_row = math.prod(shard[1:])
            step = max(1, buffer_size // max(per_row, 1))
            for row in range(0, shard[0], step):
                rows = min(step, shard[0] - row)
                start = (key[0][0] + row,) + tuple(k[0] for k in key[1:])
                extent = (rows,) + shard[1:]
                box = tuple(max(0, min(n, t - s)) for n, t, s in zip(extent, true, start))
                if 0 in box and 0 not in extent:
                    continue  # all padding: zero at rest and never updated
                chunks.append(_chunk(i, tuple(devices), row, box, start, leaf, slots[i], opt))
    return ChunkLayout(tuple(chunks), slots, shared)


def _chunk(i, devices, row, box, start, leaf, slot_leaves, opt) -> Chunk:
    n = math.prod(box)
    parts, offset = [], 0
    for j, dtype in [(-1, leaf.dtype)] + [(j, opt[j].dtype) for j in slot_leaves]:
        parts.append((j, np.dtype(dtype), offset))
        offset = _aligned(offset + n * np.dtype(dtype).itemsize, PART_ALIGN)
    return Chunk(i, devices, row, box, start, tuple(parts), offset)


def views(chunk: Chunk, buf) -> dict:
    """State leaf (-1: the master weights) -> a numpy view of its part of `buf` (a record's buffer)."""
    n = chunk.elements
    out = {}
    for j, dtype, offset in chunk.parts:
        dtype = np.dtype(dtype)
        out[j] = np.frombuffer(buf, dtype=dtype, count=n, offset=offset).reshape(chunk.box)
    return out
