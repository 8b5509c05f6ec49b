"""Sparsity layouts equal DeepSpeed's (test vectors from tools/gen_sparse_layouts.py)."""

import json
import pathlib
import random

import numpy as np
import pytest

from zeroflax import kernels
from zeroflax.kernels import sparsity_config as sc

DATA = pathlib.Path(__file__).parent / "data" / "sparse_layouts.npz"
CLASSES = ["DenseSparsityConfig", "FixedSparsityConfig", "VariableSparsityConfig",
           "BigBirdSparsityConfig", "BSLongformerSparsityConfig", "LocalSlidingWindowSparsityConfig"]
RANDOM = {"VariableSparsityConfig", "BigBirdSparsityConfig"}


def _load():
    with np.load(DATA) as d:
        cases = json.loads(str(d["cases"]))
        layouts = {k: d[k] for k in d.files if k.startswith("layout_")}
    return cases, layouts


CASES, LAYOUTS = _load()


def _build(case):
    kw = dict(case["kwargs"])
    if case["cls"] in RANDOM:
        kw["seed"] = case["seed"]
    return getattr(sc, case["cls"])(**kw).make_layout(case["seq_len"])


def _is_bigbird_extension(case):
    """Documented extension: causal BigBird with num_random_blocks > 1 (DeepSpeed fails)."""
    kw = case["kwargs"]
    if case["cls"] != "BigBirdSparsityConfig" or kw.get("attention") != "unidirectional":
        return False
    nb = case["seq_len"] // kw.get("block", 16)
    sizes = [kw.get(k, d) for k, d in [("num_random_blocks", 1), ("num_sliding_window_blocks", 3),
                                       ("num_global_blocks", 1)]]
    return sizes[0] > 1 and max(sizes) <= nb


@pytest.mark.parametrize("cls", CLASSES)
def test_layouts_equal_deepspeed(cls):
    cases = [(i, c) for i, c in enumerate(CASES) if c["cls"] == cls and c["error"] is None]
    assert len(cases) >= 10, "the test vectors should cover every class"
    for i, case in cases:
        got = _build(case)
        want = LAYOUTS[f"layout_{i}"]
        assert got.shape == want.shape and got.dtype == np.uint8, case
        np.testing.assert_array_equal(got, want, err_msg=json.dumps(case))


@pytest.mark.parametrize("cls", CLASSES)
def test_arguments_deepspeed_rejects_raise_value_error(cls):
    cases = [c for c in CASES if c["cls"] == cls and c["error"] is not None]
    assert cases, "every class has invalid-argument vectors"
    for case in cases:
        if _is_bigbird_extension(case):
            layout = _build(case)
            assert not np.triu(layout, 1).any()
            continue
        with pytest.raises(ValueError):
            _build(case)


def test_bigbird_causal_extension_keeps_deepspeeds_draws_where_it_can():
    # Rows whose causal range holds >= k blocks draw exactly as random.sample would.
    cfg = sc.BigBirdSparsityConfig(1, num_random_blocks=2, num_sliding_window_blocks=1,
                                   num_global_blocks=0, attention="unidirectional", seed=3)
    layout = cfg.make_layout(8 * 16)[0]
    rng = random.Random(3)
    for row in range(8):
        cols = rng.sample(range(row + 1), min(2, row + 1))
        expect = np.zeros(8, np.uint8)
        expect[cols] = 1
        expect[row] = 1
        np.testing.assert_array_equal(layout[row], expect)


def test_seed_none_uses_global_random_like_deepspeed():
    cfg = sc.VariableSparsityConfig(2, num_random_blocks=2, seed=None)
    random.seed(11)
    a = cfg.make_layout(160)
    b = sc.VariableSparsityConfig(2, num_random_blocks=2, seed=11).make_layout(160)
    np.testing.assert_array_equal(a, b)
    c = sc.VariableSparsityConfig(2, num_random_blocks=2, seed=12).make_layout(160)
    assert (a != c).any()


@pytest.mark.parametrize("make", [
    lambda: sc.FixedSparsityConfig(2).make_layout(100),
    lambda: sc.FixedSparsityConfig(2, num_local_blocks=4, num_global_blocks=3),
    lambda: sc.FixedSparsityConfig(2, attention="unidirectional", horizontal_global_attention=True),
    lambda: sc.FixedSparsityConfig(2, num_different_global_patterns=2),
    lambda: sc.FixedSparsityConfig(2, num_global_blocks=0),
    lambda: sc.VariableSparsityConfig(2, attention="causal"),
    lambda: sc.VariableSparsityConfig(2, local_window_blocks=[]),
    lambda: sc.VariableSparsityConfig(2, global_block_indices=[-1]),
    lambda: sc.VariableSparsityConfig(2, global_block_indices=[0, 2], global_block_end_indices=[1]),
    lambda: sc.BigBirdSparsityConfig(2, num_global_blocks=5).make_layout(64),
    lambda: sc.BSLongformerSparsityConfig(2, global_block_indices=[3], global_block_end_indices=[3]),
    lambda: sc.LocalSlidingWindowSparsityConfig(2, attention="Unidirectional"),
    lambda: sc.DenseSparsityConfig(0),
])
def test_invalid_arguments_raise_clear_errors(make):
    with pytest.raises(ValueError, match=r"SparsityConfig: .*"):
        make()


def test_public_reexports_and_defaults():
    for name in CLASSES + ["SparsityConfig"]:
        assert getattr(kernels, name) is getattr(sc, name)
    f = kernels.FixedSparsityConfig(4)
    assert (f.block, f.num_local_blocks, f.num_global_blocks, f.attention) == (16, 4, 1, "bidirectional")
    b = kernels.BigBirdSparsityConfig(4)
    assert (b.num_random_blocks, b.num_sliding_window_blocks, b.num_global_blocks) == (1, 3, 1)
    assert kernels.LocalSlidingWindowSparsityConfig(4).attention == "unidirectional"
    assert kernels.BSLongformerSparsityConfig(4).global_block_indices == [0]
