"""DeepSpeed's `sparse_attention` block -> a zeroflax.kernels.sparsity_config layout.

`read_sparse_attention` checks the block (the mode's keys, then the layout class's own checks, keyed by the
JSON key they name) and returns a `SparseAttention`: the class name and its arguments but num_heads, which
the model gives; `make_sparsity` builds the layout for a model's head count.
"""
from __future__ import annotations

import re
from typing import NamedTuple

from zeroflax import deepspeed_keys as keys
from zeroflax.config import ConfigError
from zeroflax.deepspeed_keys import as_block, check_params


class SparseAttention(NamedTuple):
    mode: str
    cls: str  # a zeroflax.kernels.sparsity_config class name
    kwargs: dict  # its arguments, all but num_heads


def read_sparse_attention(ds: dict, notes: list) -> SparseAttention | None:
    if "sparse_attention" not in ds:
        return None
    block = as_block(ds["sparse_attention"], "sparse_attention")
    mode = block.get("mode", "fixed")  # DeepSpeed's default mode
    if not isinstance(mode, str) or mode not in keys.SPARSE_MODES:
        raise ConfigError("sparse_attention.mode", f"unknown mode {mode!r}", f"use one of {', '.join(keys.SPARSE_MODES)}")
    cls, takes = keys.SPARSE_MODES[mode]
    check_params(block, "sparse_attention", {"mode": None, **takes}, {}, notes, f"sparse_attention mode {mode!r}")
    kwargs = {k: block.get(k, default) for k, default in takes.items()}
    sparse = SparseAttention(mode, cls, kwargs)
    try:  # the class checks its arguments; one head suffices to check them now
        make_sparsity(sparse, 1)
    except (ValueError, TypeError) as error:
        message = str(error).splitlines()[0]
        # The classes name the argument at fault first: key the error by the earliest key in the message.
        found = [(m.start(), k) for k in kwargs for m in [re.search(rf"\b{k}\b", message)] if m]
        raise ConfigError(f"sparse_attention.{min(found)[1]}" if found else "sparse_attention", message) from None
    return sparse


def make_sparsity(sparse: SparseAttention, num_heads: int):
    from zeroflax.kernels import sparsity_config
    return getattr(sparsity_config, sparse.cls)(num_heads=num_heads, **sparse.kwargs)
