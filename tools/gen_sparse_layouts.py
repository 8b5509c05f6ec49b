"""Generate the expected sparse-attention layouts from DeepSpeed's own code.

Usage (outside the repository's venv: this needs torch, which zeroflax does not)::

    python3 -m venv /tmp/dsvenv && /tmp/dsvenv/bin/pip install torch==2.13.0 numpy
    git show HEAD:deepspeed/ops/sparse_attention/sparsity_config.py > /tmp/ds/sparsity_config.py
    /tmp/dsvenv/bin/python tools/gen_sparse_layouts.py /tmp/ds/sparsity_config.py \
        --out tests/data/sparse_layouts.npz --source "deepspeedai/DeepSpeed@<commit>"

For every config class it builds a grid of constructor arguments and sequence
lengths, seeds Python's global ``random`` with ``random.seed(seed)`` right
before ``make_layout`` (the seeding rule zeroflax reproduces with
``Config(..., seed=seed)``), and stores either the layout or the exception
DeepSpeed raised. Output: ``tests/data/sparse_layouts.npz`` with one uint8
array ``layout_<i>`` per successful case and a JSON string ``cases``: a list of
``{"cls", "kwargs", "seq_len", "seed", "error"}`` (``error`` is the exception
type name, or null). DeepSpeed's file is only imported, never copied.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import random

import numpy as np

BI, UNI = "bidirectional", "unidirectional"


def grid():
    """Yield (class name, kwargs, seq_len, seed) over the argument grid."""
    for heads, block, nb, dlph in itertools.product([1, 3], [16, 32], [3, 6], [False, True]):
        yield "DenseSparsityConfig", dict(num_heads=heads, block=block, different_layout_per_head=dlph), nb * block, 0
    yield "DenseSparsityConfig", dict(num_heads=2), 72, 0  # not divisible by 16

    for nl, ng, (att, hor), ndgp, dlph, nb in itertools.product(
            [1, 2, 3, 4, 6], [1, 2, 3], [(BI, False), (BI, True), (UNI, False), (UNI, True)],
            [1, 2, 3], [False, True], [7, 12]):
        kw = dict(num_heads=4, block=16, different_layout_per_head=dlph, num_local_blocks=nl,
                  num_global_blocks=ng, attention=att, horizontal_global_attention=hor,
                  num_different_global_patterns=ndgp)
        yield "FixedSparsityConfig", kw, nb * 16, 0
    yield "FixedSparsityConfig", dict(num_heads=2), 8 * 16, 0  # DeepSpeed's defaults
    yield "FixedSparsityConfig", dict(num_heads=2, attention="sideways"), 8 * 16, 0
    yield "FixedSparsityConfig", dict(num_heads=2, block=32), 100, 0

    globals_ = [dict(global_block_indices=[0]), dict(global_block_indices=[1, 5]),
                dict(global_block_indices=[0, 4], global_block_end_indices=[2, 6]),
                dict(global_block_indices=[3], global_block_end_indices=[20]),
                dict(global_block_indices=[15]),
                dict(global_block_indices=[2, 1], global_block_end_indices=[3]),
                dict(global_block_indices=[4], global_block_end_indices=[4])]
    windows = [[4], [2, 3], [1, 2, 5], [3, 1], [20]]
    for nr, lw, g, (att, hor), dlph, seed, nb in itertools.product(
            [0, 1, 2, 7], windows, globals_, [(BI, False), (BI, True), (UNI, False), (UNI, True)],
            [False, True], [0, 1], [6, 10]):
        if (nr == 7) != (nb == 6):  # exercise "too many random blocks" only at nb=6
            continue
        if g in globals_[5:] and (nr, dlph, seed, lw) != (0, False, 0, [4]):  # invalid: a few suffice
            continue
        kw = dict(num_heads=3, block=16, different_layout_per_head=dlph, num_random_blocks=nr,
                  local_window_blocks=lw, attention=att, horizontal_global_attention=hor, **g)
        yield "VariableSparsityConfig", kw, nb * 16, seed
    yield "VariableSparsityConfig", dict(num_heads=2), 10 * 16, 3  # defaults

    for nr, sw, ng, att, dlph, seed, nb in itertools.product(
            [0, 1, 2, 3], [1, 2, 3, 5, 8], [0, 1, 2, 9], [BI, UNI], [False, True], [0, 7], [5, 9]):
        kw = dict(num_heads=3, block=16, different_layout_per_head=dlph, num_random_blocks=nr,
                  num_sliding_window_blocks=sw, num_global_blocks=ng, attention=att)
        yield "BigBirdSparsityConfig", kw, nb * 16, seed
    yield "BigBirdSparsityConfig", dict(num_heads=2), 12 * 16, 5  # defaults
    yield "BigBirdSparsityConfig", dict(num_heads=2, attention="causal"), 12 * 16, 5

    for sw, g, att, dlph, nb in itertools.product(
            [1, 2, 3, 4, 7, 11], globals_, [BI, UNI], [False, True], [6, 10]):
        kw = dict(num_heads=2, block=16, different_layout_per_head=dlph, num_sliding_window_blocks=sw,
                  attention=att, **g)
        yield "BSLongformerSparsityConfig", kw, nb * 16, 0
    yield "BSLongformerSparsityConfig", dict(num_heads=2), 8 * 16, 0

    for sw, att, nb in itertools.product([1, 2, 3, 4, 5, 9], [BI, UNI], [4, 8, 11]):
        kw = dict(num_heads=2, block=16, num_sliding_window_blocks=sw, attention=att)
        yield "LocalSlidingWindowSparsityConfig", kw, nb * 16, 0
    yield "LocalSlidingWindowSparsityConfig", dict(num_heads=2), 8 * 16, 0
    yield "LocalSlidingWindowSparsityConfig", dict(num_heads=2, block=8), 20, 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("deepspeed_sparsity_config", help="path to DeepSpeed's sparsity_config.py")
    ap.add_argument("--out", default="tests/data/sparse_layouts.npz")
    ap.add_argument("--source", default="", help="where the DeepSpeed file came from (recorded)")
    args = ap.parse_args()

    spec = importlib.util.spec_from_file_location("ds_sparsity_config", args.deepspeed_sparsity_config)
    ds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ds)

    cases, arrays = [], {}
    for cls, kw, seq_len, seed in grid():
        case = dict(cls=cls, kwargs=kw, seq_len=seq_len, seed=seed, error=None)
        try:
            cfg = getattr(ds, cls)(**kw)
            random.seed(seed)
            layout = cfg.make_layout(seq_len).numpy()
            assert set(np.unique(layout)) <= {0, 1}
            arrays[f"layout_{len(cases)}"] = layout.astype(np.uint8)
        except Exception as e:  # recorded: zeroflax must reject the same arguments
            case["error"] = type(e).__name__
        cases.append(case)
    meta = dict(source=args.source, generator="tools/gen_sparse_layouts.py",
                seeding="random.seed(seed) immediately before make_layout(seq_len)")
    np.savez_compressed(args.out, cases=json.dumps(cases), meta=json.dumps(meta), **arrays)
    n_err = sum(c["error"] is not None for c in cases)
    print(f"wrote {args.out}: {len(cases)} cases, {len(arrays)} layouts, {n_err} DeepSpeed errors")


if __name__ == "__main__":
    main()
