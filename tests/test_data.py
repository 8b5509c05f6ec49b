"""zeroflax.data: built-in corpus, token files, splitting, and the deterministic, resumable, sharded loader."""
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from zeroflax.data import (
    DataError, TokenLoader, builtin_corpus, load_text_file, load_token_file, load_tokens, train_val_split,
    validation_batches,
)
from zeroflax.data import corpus as corpus_module


def _stream(n, seed=0):
    return np.random.default_rng(seed).integers(0, 256, size=n).astype(np.uint8)


def _take(loader, n):
    return [loader.next_batch()["tokens"] for _ in range(n)]


# ---- built-in corpus ----------------------------------------------------------------------------------------

def test_builtin_corpus_is_english_text():
    data = builtin_corpus()
    assert isinstance(data, bytes)
    assert len(data) >= 400_000
    arr = np.frombuffer(data, np.uint8)
    printable = ((arr >= 32) & (arr < 127)) | (arr == 10) | (arr == 9)
    assert printable.mean() > 0.99
    data.decode("utf-8")  # valid UTF-8
    for word in (b" the ", b" and ", b" of ", b" function ", b" return "):
        assert data.count(word) > 100, word


def test_builtin_corpus_deterministic_in_process_and_fresh_process():
    data = builtin_corpus()
    assert builtin_corpus() == data
    # Fresh interpreter, loading corpus.py by path so the check does not pay for importing jax, and with a
    # different set of modules already imported than this pytest process.
    code = (
        "import hashlib, importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('corpus_fresh', sys.argv[1])\n"
        "mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)\n"
        "print(hashlib.sha256(mod.builtin_corpus()).hexdigest())\n"
    )
    out = subprocess.run([sys.executable, "-c", code, corpus_module.__file__], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == hashlib.sha256(data).hexdigest()


def test_load_tokens_builtin():
    tokens = load_tokens("builtin")
    assert tokens.dtype == np.uint8 and tokens.ndim == 1
    assert tokens.tobytes() == builtin_corpus()


# ---- files --------------------------------------------------------------------------------------------------

def test_load_text_and_token_files(tmp_path):
    text = tmp_path / "a.txt"
    text.write_bytes(b"hello world\n")
    assert load_text_file(text) == b"hello world\n"
    t = load_tokens(str(text))
    assert t.dtype == np.uint8 and t.tobytes() == b"hello world\n"

    npy = tmp_path / "t.npy"
    np.save(npy, np.arange(10, dtype=np.int64))
    t = load_tokens(str(npy))
    assert t.dtype == np.int32 and t.tolist() == list(range(10))
    np.save(npy, np.arange(10, dtype=np.uint8))
    assert load_token_file(npy).dtype == np.uint8


@pytest.mark.parametrize("case", ["missing_text", "directory", "empty_text", "missing_npy", "empty_npy", "2d_npy",
                                  "float_npy", "negative_npy", "not_npy"])
def test_file_errors_name_the_path(tmp_path, case):
    if case == "missing_text":
        path, call = tmp_path / "nope.txt", load_tokens
    elif case == "directory":
        path, call = tmp_path, load_text_file
    elif case == "empty_text":
        path, call = tmp_path / "empty.txt", load_tokens
        path.write_bytes(b"")
    elif case == "missing_npy":
        path, call = tmp_path / "nope.npy", load_tokens
    else:
        path, call = tmp_path / f"{case}.npy", load_tokens
        arr = {"empty_npy": np.zeros(0, np.int32), "2d_npy": np.zeros((3, 4), np.int32),
               "float_npy": np.zeros(5, np.float32), "negative_npy": np.array([1, -2, 3])}.get(case)
        if arr is None:
            path.write_bytes(b"this is not a npy file")
        else:
            np.save(path, arr)
    with pytest.raises(DataError) as exc:
        call(str(path))
    assert str(path) in str(exc.value)
    assert isinstance(exc.value, ValueError)


# ---- split --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("frac", [0.01, 0.05, 0.1, 0.5])
def test_split_contiguous_and_disjoint(frac):
    tokens = np.arange(1000, dtype=np.int32)
    train, val = train_val_split(tokens, frac)
    assert np.array_equal(np.concatenate([train, val]), tokens)  # contiguous, covers everything, no overlap
    assert len(val) == round(1000 * frac)
    assert set(train.tolist()).isdisjoint(val.tolist())


def test_split_errors():
    with pytest.raises(DataError, match="too short"):
        train_val_split(np.arange(3), 0.05, min_tokens=3)
    with pytest.raises(DataError, match="val_fraction"):
        train_val_split(np.arange(100), 0.0)
    with pytest.raises(DataError, match="val_fraction"):
        train_val_split(np.arange(100), 0.6)


# ---- training loader ----------------------------------------------------------------------------------------

def test_window_structure_targets_are_shifted_inputs():
    tokens = np.arange(1, 2001, dtype=np.int32)  # token value = position + 1, so windows are recognisable
    loader = TokenLoader(tokens, seq_len=16, global_batch=8)
    batch = loader.next_batch()["tokens"]
    assert batch.shape == (8, 17) and batch.dtype == np.int32
    inputs, targets = batch[:, :-1], batch[:, 1:]
    assert np.array_equal(targets[:, :-1], inputs[:, 1:])
    assert np.all(np.diff(batch, axis=1) == 1)          # consecutive stream tokens
    assert np.all((batch[:, 0] - 1) % 16 == 0)          # windows start at multiples of seq_len


def test_deterministic_and_seed_dependent():
    tokens = _stream(5000)
    a = _take(TokenLoader(tokens, 32, 8, seed=3), 5)
    b = _take(TokenLoader(tokens, 32, 8, seed=3), 5)
    c = _take(TokenLoader(tokens, 32, 8, seed=4), 5)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_every_window_once_per_epoch_and_tail_dropped():
    tokens = np.arange(1001, dtype=np.int32)  # 1000 // 10 = 100 windows
    loader = TokenLoader(tokens, seq_len=10, global_batch=7, seed=1)
    assert loader.num_windows == 100 and loader.steps_per_epoch == 14  # 98 windows used, 2 dropped
    for _ in range(2):
        starts = np.concatenate([b[:, 0] for b in _take(loader, loader.steps_per_epoch)])
        assert len(starts) == 98 and len(set(starts.tolist())) == 98
        assert set(starts.tolist()) <= set(range(0, 1000, 10))
        assert loader.state()["epoch"] in (1, 2) and loader.state()["step_in_epoch"] == 0
    # different epochs use different orders
    e0 = np.random.default_rng((1, 0)).permutation(100)
    e1 = np.random.default_rng((1, 1)).permutation(100)
    assert not np.array_equal(e0, e1)


@pytest.mark.parametrize("k", [0, 3, 9, 10, 11, 23])  # steps_per_epoch = 10: covers the epoch boundary
def test_resume_exactly(k):
    tokens = _stream(4000)
    loader = TokenLoader(tokens, seq_len=25, global_batch=15, seed=7)
    assert loader.steps_per_epoch == 10
    reference = _take(TokenLoader(tokens, 25, 15, seed=7), k + 15)
    _take(loader, k)
    state = json.loads(json.dumps(loader.state()))  # survives a JSON checkpoint
    resumed = TokenLoader(tokens, 25, 15, seed=7)
    resumed.restore(state)
    for want, got in zip(reference[k:], _take(resumed, 15)):
        assert np.array_equal(want, got)


@pytest.mark.parametrize("process_count", [2, 4, 8])
def test_process_shards_concatenate_to_global_batch(process_count):
    tokens = _stream(6000)
    full = _take(TokenLoader(tokens, 20, 16, seed=2), 4)
    shards = [_take(TokenLoader(tokens, 20, 16, seed=2, process_index=p, process_count=process_count), 4)
              for p in range(process_count)]
    for step in range(4):
        parts = [shards[p][step] for p in range(process_count)]
        assert all(p.shape == (16 // process_count, 21) for p in parts)
        assert np.array_equal(np.concatenate(parts), full[step])


def test_restore_with_different_process_count():
    tokens = _stream(6000)
    single = TokenLoader(tokens, 20, 16, seed=2)
    _take(single, 5)
    state = single.state()
    want = single.next_batch()["tokens"]
    parts = []
    for p in range(4):
        loader = TokenLoader(tokens, 20, 16, seed=2, process_index=p, process_count=4)
        loader.restore(state)
        parts.append(loader.next_batch()["tokens"])
    assert np.array_equal(np.concatenate(parts), want)


def test_loader_errors_name_the_key():
    tokens = _stream(1000)
    with pytest.raises(DataError, match=r"too short for one batch of 64 windows of 33 tokens"):
        TokenLoader(tokens, 32, 64)
    with pytest.raises(DataError, match="global_batch"):
        TokenLoader(tokens, 8, 6, process_count=4)
    with pytest.raises(DataError, match="global_batch"):
        validation_batches(tokens, 8, 6, process_count=4)
    with pytest.raises(DataError, match="tokens must be a 1-D"):
        TokenLoader(np.zeros((10, 10), np.int32), 4, 2)
    loader = TokenLoader(tokens, 8, 4)
    state = loader.state()
    for key, value in (("seq_len", 16), ("seed", 1), ("global_batch", 8), ("num_windows", 5)):
        with pytest.raises(DataError, match=key):
            loader.restore({**state, key: value})
    with pytest.raises(DataError, match="seq_len"):
        TokenLoader(tokens, 16, 4).restore(state)
    with pytest.raises(DataError, match="epoch"):
        loader.restore({k: v for k, v in state.items() if k != "epoch"})


# ---- validation ---------------------------------------------------------------------------------------------

def test_validation_batches_in_order_and_sharded():
    tokens = np.arange(1001, dtype=np.int32)  # 100 windows of 11 tokens
    batches = list(validation_batches(tokens, 10, 8))
    assert len(batches) == 12  # 96 windows, last partial batch (4 windows) dropped
    starts = np.concatenate([b["tokens"][:, 0] for b in batches])
    assert starts.tolist() == list(range(0, 960, 10))
    assert all(b["tokens"].dtype == np.int32 and b["tokens"].shape == (8, 11) for b in batches)
    assert len(list(validation_batches(tokens, 10, 8, max_batches=3))) == 3
    shards = [list(validation_batches(tokens, 10, 8, process_index=p, process_count=2)) for p in range(2)]
    for i, b in enumerate(batches):
        assert np.array_equal(np.concatenate([shards[0][i]["tokens"], shards[1][i]["tokens"]]), b["tokens"])
    with pytest.raises(DataError, match="too short"):
        validation_batches(tokens[:50], 10, 8)


def test_builtin_end_to_end():
    train, val = train_val_split(load_tokens("builtin"), 0.05, min_tokens=129)
    loader = TokenLoader(train, 128, 32, seed=0)
    batch = loader.next_batch()["tokens"]
    assert batch.shape == (32, 129) and batch.max() < 256
    assert sum(1 for _ in validation_batches(val, 128, 32)) == (len(val) - 1) // 128 // 32


def test_importable_without_jax():
    # Stub the top-level package (its __init__ imports the jax engine) to check zeroflax.data alone.
    pkg_dir = os.path.dirname(os.path.dirname(corpus_module.__file__))
    code = ("import sys, types\n"
            "pkg = types.ModuleType('zeroflax'); pkg.__path__ = [sys.argv[1]]; sys.modules['zeroflax'] = pkg\n"
            "import zeroflax.data\n"
            "assert 'jax' not in sys.modules, 'zeroflax.data imported jax'\n"
            "zeroflax.data.TokenLoader(zeroflax.data.load_tokens('builtin'), 64, 4).next_batch()\n")
    subprocess.run([sys.executable, "-c", code, pkg_dir], check=True, timeout=60)
