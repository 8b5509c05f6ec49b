"""Ring attention and blockwise attention (zeroflax/sharding/ring_attention.py) against dense attention on the
whole sequence, in one tile or several; the ring's collective-permutes against the documented communication,
the residuals, the per-device work in tiles, and memory linear in the sequence."""

import collections
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zeroflax.comm import parse_collectives
from zeroflax.hlo import split_computations
from zeroflax.sharding.ring_attention import (blockwise_attention, ring_attention, tile_size, zigzag_indices,
                                              zigzag_positions)
from tolerance import at_most

SEQ = "sequence"
B, H, D, C = 2, 2, 8, 2  # global batch, heads, head_dim, tokens per zigzag chunk (t_local = 2C)


def _mesh(data, seq, tensor=1):
    devices = np.array(jax.devices()[:data * seq * tensor])
    if tensor == 1:
        return Mesh(devices.reshape(data, seq), ("data", SEQ))
    return Mesh(devices.reshape(data, seq, tensor), ("data", SEQ, "tensor"))


def _sharded(mesh, causal, check_vma=False, block=512):
    """ring_attention in a shard_map manual over data and sequence (as zeroflax calls shard_map); the
    global [B, T, H, D] arrays it takes and returns are in zigzag order."""
    spec = P("data", SEQ)
    return jax.shard_map(functools.partial(ring_attention, axis_name=SEQ, causal=causal, block=block), mesh=mesh,
                         in_specs=(spec,) * 3, out_specs=spec, axis_names={"data", SEQ}, check_vma=check_vma)


def _with_vjp(fn):
    """(out, dq, dk, dv) of the loss sum(out * w)."""
    def run(q, k, v, w):
        out, vjp = jax.vjp(fn, q, k, v)
        return (out,) + vjp(w.astype(out.dtype))
    return run


def _dense(q, k, v, causal):
    """Attention on the whole sequence in float32."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * q.shape[-1] ** -0.5
    if causal:
        positions = jnp.arange(q.shape[1])
        s = jnp.where(positions[:, None] >= positions[None, :], s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v, precision="highest")


def _inputs(T, dtype, seed=0, batch=B):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    return [np.asarray(jax.random.normal(key, (batch, T, H, D), jnp.float32).astype(dtype)) for key in keys]


def _assert_close(got, want, dtype):
    """(out, dq, dk, dv) against the float32 reference."""
    if dtype == jnp.float32:
        for name, g, r in zip(("out", "dq", "dk", "dv"), got, want):
            at_most(np.abs(np.asarray(g, np.float32) - np.asarray(r)).max(), 1e-5, "ring attention fp32: max |diff|",
                    name)
    else:
        # bf16 inputs (the reference takes the same bf16 values in float32): the probabilities meet v, and
        # the score gradients k and q, in bf16, and the results are rounded to bf16. bf16 keeps 8 bits, so
        # one rounding is up to 2^-9 = 2e-3 relative and these products of two or three rounded factors land
        # near one ulp (2^-8 = 3.9e-3): 3.5e-3 measured on SSE4.2 and AVX2. Bounds: 2e-2, about 5 ulps.
        for name, g, r in zip(("out", "dq", "dk", "dv"), got, want):
            g, r = np.asarray(g, np.float32), np.asarray(r)
            at_most(np.abs(g - r).max() / max(1.0, np.abs(r).max()), 2e-2, "ring attention bf16: max |diff| / max |r|",
                    name)
            at_most(np.linalg.norm(g - r) / np.linalg.norm(r), 2e-2, "ring attention bf16: relative error", name)


def _permutes(hlo_text, mesh):
    """(collective-permute executions, their bytes per device) of a compiled program, which must hold no
    other collective and no loop of unknown trip count."""
    collectives, unknown_trip = parse_collectives(hlo_text, mesh.size, dict(mesh.shape))
    assert not unknown_trip
    assert {c.kind for c in collectives} <= {"collective-permute"}, {c.kind for c in collectives}
    assert all(c.axes == (SEQ,) for c in collectives), [c.axes for c in collectives]
    return sum(c.trip_count for c in collectives), sum(c.bytes_per_step for c in collectives)


def _permutes_in_loops(hlo_text) -> int:
    """How many collective-permutes a compiled program holds inside a loop's body (or what it calls): none,
    or XLA:CPU from jaxlib 0.11 on may pair them with the collectives beside the loop
    (zeroflax/sharding/ring_attention.py, `_ring_steps`)."""
    body, _ = split_computations(hlo_text)
    todo = [m for lines in body.values() for line in lines for m in re.findall(r"\bbody=%?([\w.\-]+)", line)]
    seen = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in body:
            continue
        seen.add(name)
        todo += [m for line in body[name]
                 for m in re.findall(r"(?:body|condition|calls|branch_computations)=\{?%?([\w.\-]+)", line)]
    return sum("collective-permute" in line for name in seen for line in body[name])


def test_zigzag_layout():
    np.testing.assert_array_equal(zigzag_indices(8, 2), [[0, 1, 6, 7], [2, 3, 4, 5]])
    order = zigzag_indices(16, 4)
    assert order.shape == (4, 4) and sorted(order.ravel()) == list(range(16))
    np.testing.assert_array_equal(order[3], [6, 7, 8, 9])
    with pytest.raises(ValueError):
        zigzag_indices(12, 4)
    mesh = _mesh(2, 4)
    positions = jax.jit(jax.shard_map(lambda x: zigzag_positions(x.shape[1], SEQ)[None], mesh=mesh,
                                      in_specs=P("data", SEQ), out_specs=P("data", SEQ), check_vma=False))
    got = np.asarray(positions(np.zeros((2, 16))))
    np.testing.assert_array_equal(got, np.stack([order.ravel()] * 2))


# (data, sequence, tensor, causal, dtype, check_vma). tensor > 1: the shard_map is manual over data and
# sequence only, and XLA slices the heads over `tensor` (partially manual, as the engine's step is).
# check_vma=False is zeroflax's form; one case checks the varying-axes typing too.
CASES = [
    (2, 4, 1, True, jnp.float32, False),
    (2, 4, 1, False, jnp.float32, False),
    (2, 2, 1, True, jnp.float32, False),
    (1, 8, 1, True, jnp.float32, False),
    (1, 8, 1, False, jnp.float32, False),
    (2, 1, 1, True, jnp.float32, False),
    (2, 2, 2, True, jnp.float32, False),
    (2, 4, 1, True, jnp.float32, True),
    (2, 4, 1, True, jnp.bfloat16, False),
]


@pytest.mark.parametrize("data,seq,tensor,causal,dtype,check_vma", CASES)
def test_matches_dense_attention(data, seq, tensor, causal, dtype, check_vma):
    _check_ring(data, seq, tensor, causal, dtype, check_vma)


# (data, sequence, chunk c, block, causal, dtype): several tiles per step. c = 16, block 4: tiles of 4, 4 per
# chunk; block 6 does not divide c = 16 (tiles of 4); c = 12, block 5: tiles of 4, 3 per chunk; S = 1: the
# diagonal step alone, tiled.
TILED_CASES = [
    (1, 4, 16, 4, True, jnp.float32),
    (1, 4, 16, 6, False, jnp.float32),
    (2, 2, 12, 5, True, jnp.float32),
    (2, 1, 12, 5, True, jnp.float32),
    (1, 4, 16, 6, True, jnp.bfloat16),
]


@pytest.mark.parametrize("data,seq,c,block,causal,dtype", TILED_CASES)
def test_tiled_matches_dense_attention(data, seq, c, block, causal, dtype):
    assert tile_size(c, block) < c
    _check_ring(data, seq, 1, causal, dtype, False, c=c, block=block)


def _check_ring(data, seq, tensor, causal, dtype, check_vma, c=C, block=512):
    """Values and gradients against dense attention, and the collective-permutes against the theory."""
    mesh = _mesh(data, seq, tensor)
    T = 2 * seq * c
    order = zigzag_indices(T, seq).reshape(-1)
    inverse = np.argsort(order)
    q, k, v, w = _inputs(T, dtype)
    sharding = NamedSharding(mesh, P("data", SEQ, "tensor") if tensor > 1 else P("data", SEQ))
    args = [jax.device_put(x[:, order], sharding) for x in (q, k, v, w)]
    lowered = jax.jit(_with_vjp(_sharded(mesh, causal, check_vma, block))).lower(*args)
    compiled = lowered.compile()
    got = [np.asarray(x, np.float32)[:, inverse] for x in compiled(*args)]
    want = jax.jit(_with_vjp(functools.partial(_dense, causal=causal)))(*(x.astype(np.float32) for x in (q, k, v, w)))
    _assert_close(got, want, dtype)

    # Forward and backward's collective-permutes, against the module docstring's theory, with
    # N = batch x t_local x heads x head_dim per device: forward 2 (S-1) N elements of k/v (k and v
    # separately, 2 (S-1) permutes), backward 2 (S-1) N of k/v (stacked, S-1 permutes) and the float32
    # dk/dv accumulators 2 S N (stacked, S permutes). The tiles change none of it.
    S = seq
    N = (B // data) * 2 * c * (H // tensor) * D
    count, sent = _permutes(compiled.as_text(), mesh)
    assert count == 2 * (S - 1) + (S - 1) + (S if S > 1 else 0)
    assert _permutes_in_loops(compiled.as_text()) == 0
    if dtype == jnp.float32:
        theory = 2 * (S - 1) * N * 4 + 2 * (S - 1) * N * 4 + (2 * S * N * 4 if S > 1 else 0)
        assert theory / 1.1 <= sent <= theory * 1.1, (sent, theory)
    else:
        # XLA:CPU sends bf16 arrays as float32 (its compiled permutes are f32), so the dtypes are read
        # from the program jax hands it: k and v travel in bf16, the accumulators in float32.
        # The CPU program's permutes (its ring steps unrolled): the forward's k and v at each of the S-1
        # steps, [B/data, 2c, H, D] bf16; the backward's stacked k and v at each step, [2, B/data, 2c, H, D]
        # bf16, and its stacked accumulators before the first step and after each, float32.
        types = collections.Counter(re.findall(r"collective_permute.*-> tensor<([0-9x]+)x(bf16|f32)>",
                                               lowered.as_text()))
        local = f"{B // data}x{2 * c}x{H}x{D}"
        assert types == {(local, "bf16"): 2 * (S - 1), ("2x" + local, "bf16"): S - 1, ("2x" + local, "f32"): S}, types
        theory = 2 * (S - 1) * N * 4 + 2 * (S - 1) * N * 4 + 2 * S * N * 4  # as XLA:CPU sends them
        assert theory / 1.1 <= sent <= theory * 1.1, (sent, theory)


# (T, block, causal, dtype): tiles of 4 (block 5: 6 tiles a side), of 6 (T = 30, block 8), one tile (block
# larger than T), and bf16.
BLOCKWISE_CASES = [
    (24, 5, True, jnp.float32),
    (24, 5, False, jnp.float32),
    (30, 8, True, jnp.float32),
    (24, 512, True, jnp.float32),
    (24, 6, True, jnp.bfloat16),
    (24, 6, False, jnp.bfloat16),
]


@pytest.mark.parametrize("T,block,causal,dtype", BLOCKWISE_CASES)
def test_blockwise_matches_dense_attention(T, block, causal, dtype):
    """blockwise_attention under a plain jit on one device (no shard_map, no axis)."""
    q, k, v, w = _inputs(T, dtype, seed=1)
    fn = functools.partial(blockwise_attention, causal=causal, block=block)
    got = jax.jit(_with_vjp(fn))(q, k, v, w)
    assert got[0].dtype == dtype and got[0].shape == q.shape
    want = jax.jit(_with_vjp(functools.partial(_dense, causal=causal)))(*(x.astype(np.float32) for x in (q, k, v, w)))
    _assert_close(got, want, dtype)


@pytest.mark.parametrize("causal", [True, False])
def test_blockwise_in_shard_map(causal):
    """blockwise_attention per device inside a shard_map (the batch split over `data`; the varying axes
    checked): each device attends over its own whole sequence."""
    mesh = _mesh(2, 1)
    T = 20
    q, k, v, w = _inputs(T, jnp.float32, seed=2)
    fn = jax.shard_map(functools.partial(blockwise_attention, causal=causal, block=4), mesh=mesh,
                       in_specs=(P("data"),) * 3, out_specs=P("data"), check_vma=True)
    args = [jax.device_put(x, NamedSharding(mesh, P("data"))) for x in (q, k, v, w)]
    got = jax.jit(_with_vjp(fn))(*args)
    want = jax.jit(_with_vjp(functools.partial(_dense, causal=causal)))(q, k, v, w)
    _assert_close(got, want, jnp.float32)


def test_tile_size():
    assert tile_size(16, 4) == 4 and tile_size(16, 6) == 4 and tile_size(12, 5) == 4 and tile_size(30, 8) == 6
    assert tile_size(8, 512) == 8 and tile_size(7, 4) == 1
    with pytest.raises(ValueError):
        tile_size(8, 0)


@pytest.mark.parametrize("data,seq", [(2, 4), (1, 8)])
def test_forward_permutes(data, seq):
    mesh = _mesh(data, seq)
    x = jax.ShapeDtypeStruct((B, 2 * seq * C, H, D), jnp.float32, sharding=NamedSharding(mesh, P("data", SEQ)))
    text = jax.jit(_sharded(mesh, causal=True)).lower(x, x, x).compile().as_text()
    count, sent = _permutes(text, mesh)
    N = (B // data) * 2 * C * H * D
    assert count == 2 * (seq - 1)
    assert _permutes_in_loops(text) == 0
    theory = 2 * (seq - 1) * N * 4
    assert theory / 1.1 <= sent <= theory * 1.1, (sent, theory)


def test_ring_is_a_loop_on_gpus_and_unrolled_on_the_cpu():
    """The ring's middle steps (`_ring_steps`): one loop in the program lowered for CUDA (k and v sent before
    it and once in its body, whatever the ring's size), S-1 transfers each of k and v written out in the
    program lowered for the CPU, whose runtime may pair a transfer inside a loop with a collective beside
    it (docs/perf.md)."""
    seq = 8
    mesh = _mesh(1, seq)
    x = jax.ShapeDtypeStruct((B, 2 * seq * C, H, D), jnp.float32, sharding=NamedSharding(mesh, P("data", SEQ)))
    for platform, permutes in (("cuda", 2 + 2), ("cpu", 2 * (seq - 1))):
        text = jax.export.export(jax.jit(_sharded(mesh, causal=True)), platforms=(platform,))(x, x, x).mlir_module()
        assert text.count("collective_permute") == permutes, platform


def test_residuals_are_local():
    """The forward saves q, k, v, the output and the float32 log-sum-exp per row and head: the same for
    every ring size at a fixed t_local, nothing per step."""
    saved = {}
    for seq in (2, 4, 8):
        mesh = _mesh(1, seq)

        def local(q, k, v, seq=seq):
            out, vjp_fn = jax.vjp(functools.partial(ring_attention, axis_name=SEQ), q, k, v)
            saved[seq] = [(x.shape, jnp.dtype(x.dtype)) for x in jax.tree.leaves(vjp_fn)]
            return out

        fn = jax.shard_map(local, mesh=mesh, in_specs=(P("data", SEQ),) * 3, out_specs=P("data", SEQ),
                           check_vma=False)
        x = jax.ShapeDtypeStruct((B, 2 * seq * C, H, D), jnp.bfloat16)
        jax.eval_shape(fn, x, x, x)
    local_shape = (B, 2 * C, H, D)
    want = sorted([(local_shape, jnp.dtype(jnp.bfloat16))] * 4 + [((B, H, 2 * C), jnp.dtype(jnp.float32))],
                  key=str)
    for seq, leaves in saved.items():
        assert sorted(leaves, key=str) == want, (seq, leaves)


@pytest.mark.parametrize("block", [512, 4])
def test_blockwise_residuals(block):
    """blockwise_attention saves the same: q, k, v, the output and the log-sum-exp, whatever the tiles."""
    T = 16
    x = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16)
    saved = []

    def fn(q, k, v):
        out, vjp_fn = jax.vjp(functools.partial(blockwise_attention, block=block), q, k, v)
        saved.extend((y.shape, jnp.dtype(y.dtype)) for y in jax.tree.leaves(vjp_fn))
        return out

    jax.eval_shape(fn, x, x, x)
    want = sorted([((B, T, H, D), jnp.dtype(jnp.bfloat16))] * 4 + [((B, H, T), jnp.dtype(jnp.float32))], key=str)
    assert sorted(saved, key=str) == want, saved


def _subjaxprs(params):
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(item, "eqns") or hasattr(getattr(item, "jaxpr", None), "eqns"):
                yield item


def _attention_flops(jaxpr, shapes=None):
    """Per-device FLOPs of the attention matmuls (the 4-d dot_generals) in a jaxpr: a scan's body times its
    length, a cond's branches once (they must cost the same: the causal ring's balance). `shapes`: a set
    that collects the matmuls' output shapes."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (contracting, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            out = eqn.outvars[0].aval.shape
            if len(out) == 4:
                total += 2 * math.prod(out) * math.prod(lhs[d] for d in contracting)
                if shapes is not None:
                    shapes.add(tuple(out))
        elif name == "cond":
            costs = {_attention_flops(branch, shapes) for branch in eqn.params["branches"]}
            assert len(costs) == 1, costs
            total += costs.pop()
        else:
            assert name != "while", "a loop of unknown trip count"
            inner = sum(_attention_flops(sub, shapes) for sub in _subjaxprs(eqn.params))
            total += inner * (eqn.params["length"] if name == "scan" else 1)
    return total


@pytest.mark.parametrize("causal,c,block", [(True, C, 512), (False, C, 512), (True, 8, 2), (False, 8, 2)])
def test_work_per_device(causal, c, block):
    """In tiles of t = tile_size(c, block), n = 2c / t a side of the local block. Causal: the n (n + 1) / 2
    tiles on and below the diagonal of the diagonal step, and half the block's tiles per other step (never a
    masked tile computed and dropped); without the mask, S n^2 tiles. Forward 2 matmuls per tile (scores,
    probabilities x v), backward 5 (the scores again, dv, dp, dq, dk); every matmul one tile wide (no score
    block larger than [batch, heads, t, t])."""
    seq, data = 4, 2
    mesh = _mesh(data, seq)
    x = jax.ShapeDtypeStruct((B, 2 * seq * c, H, D), jnp.float32)
    t = tile_size(c, block)
    n = 2 * c // t
    tile = 2 * (B // data) * H * D * t ** 2  # one matmul over one tile
    tiles = n * (n + 1) // 2 + (seq - 1) * n * n // 2 if causal else seq * n * n
    fn = _sharded(mesh, causal, block=block)
    shapes = set()
    assert _attention_flops(jax.make_jaxpr(fn)(x, x, x), shapes) == 2 * tile * tiles
    assert _attention_flops(jax.make_jaxpr(_with_vjp(fn))(x, x, x, x), shapes) == 7 * tile * tiles
    assert (B // data, H, t, t) in shapes  # the scores of one tile
    assert max(math.prod(shape) for shape in shapes) <= (B // data) * H * t * max(t, D), shapes


def _temp_bytes(fn, T, sharding=None):
    """Temporary bytes (per device) of the compiled forward + backward of fn at [1, T, 2, 32] float32."""
    x = jax.ShapeDtypeStruct((1, T, 2, 32), jnp.float32, sharding=sharding)
    return jax.jit(_with_vjp(fn)).lower(x, x, x, x).compile().memory_analysis().temp_size_in_bytes


def test_memory_is_linear():
    """Doubling the sequence doubles the tiled attention's working memory (at most 2.5x: linear) where
    dense attention's quadruples: blockwise attention at T = 4096 -> 8192, and ring attention over 4
    devices (t_local 1024 -> 2048), block 256, forward and backward, compiled only."""
    blockwise = functools.partial(blockwise_attention, block=256)
    small, large = _temp_bytes(blockwise, 4096), _temp_bytes(blockwise, 8192)
    dense_small, dense_large = (_temp_bytes(functools.partial(_dense, causal=True), T) for T in (4096, 8192))
    assert large <= 2.5 * small, (small, large)
    assert dense_large >= 3.5 * dense_small, (dense_small, dense_large)
    assert large <= dense_large / 50, (large, dense_large)  # ~6 MiB against 2 GiB of T x T scores

    mesh = _mesh(1, 4)
    ring = jax.shard_map(functools.partial(ring_attention, axis_name=SEQ, block=256), mesh=mesh,
                         in_specs=(P("data", SEQ),) * 3, out_specs=P("data", SEQ), check_vma=False)
    sharding = NamedSharding(mesh, P("data", SEQ))
    small, large = _temp_bytes(ring, 4096, sharding), _temp_bytes(ring, 8192, sharding)
    assert large <= 2.5 * small, (small, large)
