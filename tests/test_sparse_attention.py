"""Block-sparse attention: XLA and Pallas (interpret mode) against the dense masked reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeroflax import kernels
from zeroflax.kernels import layout_table as lt
from zeroflax.kernels import sparsity_config as sc
from tolerance import at_least, at_most, claim

B, L, H, D = 2, 128, 2, 16
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}

# (name, config factory, causal). Per-head layouts wherever the class has them;
# causal pairs a unidirectional layout with the element-wise causal mask.
CONFIGS = {
    "dense": lambda att: sc.DenseSparsityConfig(H),
    "fixed": lambda att: sc.FixedSparsityConfig(H, different_layout_per_head=True, num_local_blocks=2,
                                                attention=att, num_different_global_patterns=2,
                                                horizontal_global_attention=att == "bidirectional"),
    "variable": lambda att: sc.VariableSparsityConfig(H, different_layout_per_head=True, num_random_blocks=1,
                                                      local_window_blocks=[1, 2], global_block_indices=[2],
                                                      attention=att, seed=1),
    "bigbird": lambda att: sc.BigBirdSparsityConfig(H, different_layout_per_head=True, attention=att, seed=2),
    "bslongformer": lambda att: sc.BSLongformerSparsityConfig(H, different_layout_per_head=True,
                                                              global_block_indices=[1, 5], attention=att),
    "local": lambda att: sc.LocalSlidingWindowSparsityConfig(H, attention=att),
}


def _inputs(dtype, seed=0):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    return tuple(jax.random.normal(k, (B, L, H, D), jnp.float32).astype(dtype) for k in ks)


def _layout(name, causal, empty_row=True):
    layout = CONFIGS[name]("unidirectional" if causal else "bidirectional").make_layout(L)
    if empty_row:
        layout[-1, 3, :] = 0  # a query block with no allowed key (in the last head)
    return layout


KPM = np.arange(L)[None, :] < np.array([[L - 37], [L]])  # batch 0: last 37 keys are padding


def _run(impl, q, k, v, do, layout, causal, kpm):
    def loss(q, k, v):
        out = kernels.sparse_attention(q, k, v, layout, causal=causal, key_padding_mask=kpm,
                                       implementation=impl)
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return (out,) + grads


def _rel_err(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(got).all(), "NaN/inf in the result"
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _check(impl, name, causal, dtype, kpm, empty_row=True):
    q, k, v, do = _inputs(dtype)
    layout = _layout(name, causal, empty_row)
    got = _run(impl, q, k, v, do, layout, causal, kpm)
    want = _run("reference", q, k, v, do, layout, causal, kpm)
    for what, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == dtype
        at_most(_rel_err(g, w), TOL[dtype], f"{impl} {jnp.dtype(dtype).name}: max |diff| / max |reference|",
                f"({name} causal={causal} {what})")
    if empty_row:  # the emptied query block (head H-1, block 3) gives exact zeros
        np.testing.assert_array_equal(np.asarray(got[0], np.float32)[:, 48:64, -1], 0.0)
        np.testing.assert_array_equal(np.asarray(got[1], np.float32)[:, 48:64, -1], 0.0)


@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_xla_matches_reference_f32(name, causal):
    _check("xla", name, causal, jnp.float32, KPM)


@pytest.mark.parametrize("name,causal", [("bigbird", False), ("fixed", True), ("variable", False)])
def test_xla_matches_reference_bf16_no_padding(name, causal):
    _check("xla", name, causal, jnp.bfloat16, None)


# Interpret-mode Pallas is slow: one case per class, alternating causal, all with an
# empty row, key padding on most; per-head layouts come with the configs.
PALLAS_CASES = [("dense", False, True), ("fixed", True, True), ("variable", False, False),
                ("bigbird", True, True), ("bslongformer", False, True), ("local", True, False)]


@pytest.mark.parametrize("name,causal,padded", PALLAS_CASES)
def test_pallas_interpret_matches_reference_f32(name, causal, padded):
    _check("pallas_interpret", name, causal, jnp.float32, KPM if padded else None)


def test_pallas_interpret_matches_reference_bf16():
    _check("pallas_interpret", "bslongformer", True, jnp.bfloat16, KPM)


@pytest.mark.parametrize("impl", ["xla", "pallas_interpret"])
def test_all_empty_layout_gives_zeros_not_nan(impl):
    q, k, v, do = _inputs(jnp.float32)
    layout = np.zeros((1, L // 16, L // 16), np.uint8)
    for x in _run(impl, q, k, v, do, layout, False, None):
        np.testing.assert_array_equal(np.asarray(x), 0.0)


def test_fully_padded_batch_row_gives_zeros():
    q, k, v, do = _inputs(jnp.float32)
    kpm = np.ones((B, L), bool)
    kpm[1] = False
    out, dq, dk, dv = _run("xla", q, k, v, do, _layout("bigbird", False), False, kpm)
    for x in (out, dq, dk, dv):
        np.testing.assert_array_equal(np.asarray(x[1]), 0.0)
    assert np.abs(np.asarray(out[0])).max() > 0


def test_config_as_layout_and_sm_scale():
    q, k, v, _ = _inputs(jnp.float32)
    cfg = sc.BSLongformerSparsityConfig(H)
    a = kernels.sparse_attention(q, k, v, cfg, causal=False, sm_scale=0.3, implementation="xla")
    b = kernels.sparse_attention(q, k, v, cfg.make_layout(L)[:1], causal=False, sm_scale=0.3,
                                 implementation="reference")
    at_most(_rel_err(a, b), 1e-5, "a config against its layout")
    c = kernels.sparse_attention(q, k, v, cfg, causal=False, implementation="xla")
    at_least(_rel_err(a, c), 1e-3, "another sm_scale's distance")  # the scale matters


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_xla_chunking_does_not_change_results(chunk):
    q, k, v, _ = _inputs(jnp.float32)
    layout = _layout("bslongformer", False)
    a = kernels.sparse_attention_xla(q, k, v, layout, causal=False, chunk=chunk)
    b = kernels.sparse_attention_reference(q, k, v, layout, causal=False)
    at_most(_rel_err(a, b), 1e-5, "chunked XLA against the reference")


def test_default_implementation_on_this_backend():
    expected = "pallas" if jax.default_backend() == "gpu" else "xla"
    assert kernels.default_implementation() == expected


@pytest.mark.parametrize("bad,match", [
    (np.ones((3, 8, 8)), "heads"),
    (np.ones((2, 8, 4)), "shape"),
    (np.ones((2, 7, 7)), "multiple"),
])
def test_bad_layout_raises(bad, match):
    q, k, v, _ = _inputs(jnp.float32)
    with pytest.raises(ValueError, match=match):
        kernels.sparse_attention(q, k, v, bad, causal=False, implementation="xla")


def test_unknown_implementation_raises():
    q, k, v, _ = _inputs(jnp.float32)
    with pytest.raises(ValueError, match="implementation"):
        kernels.sparse_attention(q, k, v, np.ones((8, 8)), causal=False, implementation="triton")


@pytest.mark.parametrize("causal", [False, True])
def test_tables_reconstruct_the_layout(causal):
    lay, _ = lt.normalize_layout(_layout("variable", causal), H, L)
    eff = lt.effective_layout(lay, causal)
    for transpose in (False, True):
        want = np.swapaxes(eff, -1, -2) if transpose else eff
        rt = lt.row_table(eff, transpose=transpose, pow2_width=True)
        assert rt.width & (rt.width - 1) == 0
        got = np.zeros_like(want)
        for h, i in np.ndindex(rt.counts.shape):
            got[h, i, rt.cols[h, i, :rt.counts[h, i]]] = True
        np.testing.assert_array_equal(got, want)
        st = lt.split_table(eff, 3, transpose=transpose)
        assert (np.diff(st.row, axis=-1) >= 0).all()
        got = np.zeros_like(want)
        for h in range(st.row.shape[0]):
            for r, c, m in zip(st.row[h], st.cols[h], st.valid[h]):
                got[h, r, c[m]] = True
        np.testing.assert_array_equal(got, want)
        assert st.valid.sum() == want.sum()


def _temp_bytes(fn, length, heads=1, dim=32):
    x = jax.ShapeDtypeStruct((1, length, heads, dim), jnp.float32)
    grad = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v)), argnums=(0, 1, 2))
    return jax.jit(grad).lower(x, x, x).compile().memory_analysis().temp_size_in_bytes


def test_xla_memory_grows_linearly():
    cfg = sc.BigBirdSparsityConfig(1, num_random_blocks=1, num_sliding_window_blocks=3, num_global_blocks=1)

    def sparse(length):
        return _temp_bytes(functools.partial(kernels.sparse_attention_xla, layout=cfg.make_layout(length),
                                             causal=False), length)

    s1, s2 = sparse(1024), sparse(2048)
    assert s2 <= 2.2 * s1, (s1, s2)
    dense = functools.partial(kernels.sparse_attention_reference, layout=np.ones((1, 1)), causal=False)
    assert _temp_bytes(dense, 2048) > 4 * s2


def test_gpt_with_sparse_attention_trains():
    """GPTConfig.attention = 'sparse' (a BigBird layout) trains through the ZeRO-3 engine."""
    import optax

    import zeroflax
    from zeroflax.kernels import BigBirdSparsityConfig
    from zeroflax.models.gpt import GPT, GPTConfig, next_token_loss

    sparsity = BigBirdSparsityConfig(num_heads=2, block=8, attention="unidirectional")
    config = GPTConfig(num_layers=2, d_model=32, num_heads=2, max_len=64, attention="sparse", sparsity=sparsity)
    assert GPTConfig.from_dict(config.to_dict()).sparsity.to_dict() == sparsity.to_dict()
    model = GPT(config)
    rng = np.random.default_rng(0)
    text = np.frombuffer(b"the quick brown fox jumps over the lazy dog. " * 40, np.uint8).astype(np.int32)
    starts = rng.integers(0, text.size - 65, size=16)
    batch = {"tokens": np.stack([text[s:s + 65] for s in starts])}
    engine, state = zeroflax.initialize(
        next_token_loss(model), lambda k, b: model.init(k, b["tokens"][:, :-1])["params"], optax.adam(3e-3),
        zeroflax.Config(zero_stage=3, micro_batch_size=2, persistence_threshold=0), sample_batch=batch)
    losses = []
    for _ in range(15):
        state, metrics = engine.step(state, batch)
        losses.append(float(metrics["loss"]))
    claim(losses[-1] / losses[0], 0.75, "the sparse GPT's last loss over its first")
