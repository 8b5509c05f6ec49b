"""1-bit Adam's sign packing (zeroflax/kernels/onebit_pack.py): the jnp reference against numpy, the Pallas
kernels (interpret mode) against the reference bit for bit, the round trip, the argument checks, both inside
a shard_map, and the kernels' lowering for CUDA (Triton) on this CPU-only machine."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from zeroflax.kernels.onebit_pack import pack_signs, unpack_signs

ROWS = (1, 3, 8)
COLS = (8, 24, 1000, 4104)  # 4104 = 8 * 513: more than two kernel blocks of 256 groups, padded


def _bits(a):
    """float32 as its bit pattern, so that -0.0 != +0.0 in comparisons."""
    return np.asarray(a, np.float32).view(np.uint32)


def _assert_same_bits(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    if got.dtype == np.float32:
        got, want = _bits(got), _bits(want)
    assert np.array_equal(got, want)


def _inputs(rows, cols, seed=0):
    """x, error, scale with exact zeros, +0.0 from cancellation and -0.0 (from -0.0 + -0.0) in y = x + error."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    error = (0.5 * rng.standard_normal((rows, cols))).astype(np.float32)
    x[:, 0], error[:, 0] = -0.0, -0.0   # y = -0.0: sign +1
    x[:, 1], error[:, 1] = 0.0, 0.0     # y = +0.0
    x[:, 2], error[:, 2] = 1.5, -1.5    # y = +0.0 by cancellation
    x[:, 3], error[:, 3] = -0.0, 0.0    # y = +0.0
    scale = rng.uniform(0.1, 2.0, rows).astype(np.float32)
    if rows > 1:
        scale[1] = 0.0  # a zero scale: error == y, values +-0.0
    y = x + error
    assert np.any((y == 0) & np.signbit(y)) and np.any((y == 0) & ~np.signbit(y))
    return x, error, scale


def _numpy_signs(y):
    return np.where(y >= 0, np.float32(1), np.float32(-1))


def _numpy_average(s, scale):
    """Sequential over rows from the r = 0 term, in float32; scale / R as scale * float32(1 / R)."""
    w = scale * (np.float32(1) / np.float32(len(scale)))
    acc = s[0] * w[0]
    for r in range(1, len(scale)):
        acc = acc + s[r] * w[r]
    return acc


@functools.partial(jax.jit, static_argnames=("impl", "interpret"))
def _all(x, error, scale, impl, interpret=False):
    """pack, then both unpacks of the packed bits, under one jit."""
    bits, new_error = pack_signs(x, error, scale, impl=impl, interpret=interpret)
    values = unpack_signs(bits, scale, average=False, impl=impl, interpret=interpret)
    mean = unpack_signs(bits, scale, average=True, impl=impl, interpret=interpret)
    return bits, new_error, values, mean


@pytest.mark.parametrize("cols", COLS)
@pytest.mark.parametrize("rows", ROWS)
def test_reference_matches_numpy(rows, cols):
    x, error, scale = _inputs(rows, cols)
    bits, new_error, values, mean = _all(x, error, scale, impl="xla")
    y = x + error
    s = _numpy_signs(y)
    _assert_same_bits(bits, np.packbits(y >= 0, axis=-1))
    _assert_same_bits(new_error, y - scale[:, None] * s)
    _assert_same_bits(values, scale[:, None] * s)
    _assert_same_bits(mean, _numpy_average(s, scale))


@pytest.mark.parametrize("rows,cols", [(1, 8), (3, 1000), (8, 4104)])
def test_pallas_interpret_matches_reference_bitwise(rows, cols):
    x, error, scale = _inputs(rows, cols, seed=1)
    want = _all(x, error, scale, impl="xla")
    got = _all(x, error, scale, impl="pallas", interpret=True)
    for g, w in zip(got, want):
        _assert_same_bits(g, w)
    if rows != 3:
        return
    # The unpack kernels on bits that pack did not make (every byte value, every row).
    rng = np.random.default_rng(2)
    bits = rng.integers(0, 256, (rows, cols // 8), dtype=np.uint8)
    bits[0, : min(cols // 8, 256)] = np.arange(min(cols // 8, 256))
    for average in (False, True):
        _assert_same_bits(unpack_signs(bits, scale, average=average, impl="pallas", interpret=True),
                          unpack_signs(bits, scale, average=average, impl="xla"))


def test_round_trip_and_auto():
    x, error, scale = _inputs(3, 24, seed=3)
    y = x + error
    for impl, interpret in (("xla", False), ("pallas", True), ("auto", False)):
        bits, _ = pack_signs(x, error, scale, impl=impl, interpret=interpret)
        values = unpack_signs(bits, scale, average=False, impl=impl, interpret=interpret)
        _assert_same_bits(values, scale[:, None] * _numpy_signs(y))
    # 'auto' is the jnp reference on the CPU: the jaxpr has no pallas_call.
    assert "pallas_call" not in str(jax.make_jaxpr(lambda a, b, c: pack_signs(a, b, c))(x, error, scale))


def test_argument_checks():
    x = np.zeros((2, 16), np.float32)
    scale = np.ones(2, np.float32)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_signs(np.zeros((2, 12), np.float32), np.zeros((2, 12), np.float32), scale)
    with pytest.raises(ValueError, match=r"x must be \(R, C\)"):
        pack_signs(np.zeros(16, np.float32), np.zeros(16, np.float32), scale)
    with pytest.raises(ValueError, match="error must have x's shape"):
        pack_signs(x, np.zeros((2, 24), np.float32), scale)
    with pytest.raises(ValueError, match="one scale per row"):
        pack_signs(x, x, np.ones(3, np.float32))
    with pytest.raises(ValueError, match="impl="):
        pack_signs(x, x, scale, impl="triton")
    bits = np.zeros((2, 2), np.uint8)
    with pytest.raises(ValueError, match="uint8"):
        unpack_signs(bits.astype(np.int32), scale, average=False)
    with pytest.raises(ValueError, match="one scale per row"):
        unpack_signs(bits, np.ones((2, 1), np.float32), average=True)
    with pytest.raises(ValueError, match="average must be True or False"):
        unpack_signs(bits, scale, average=None)


def _sharded(impl, interpret=False, check_vma=False):
    """pack and unpack per device in a shard_map over 'data' (4 devices): rows sharded, the pack's
    scale replicated, the average's scales all-gathered (as in the 1-bit exchange)."""
    mesh = jax.make_mesh((2, 4), ("pipe", "data"))
    rows = P("data")

    @jax.jit
    @functools.partial(jax.shard_map, mesh=mesh, in_specs=(rows, rows, P()), out_specs=(rows,) * 4,
                       check_vma=check_vma)
    def f(x, error, scale):
        bits, new_error = pack_signs(x, error, scale, impl=impl, interpret=interpret)
        values = unpack_signs(bits, scale, average=False, impl=impl, interpret=interpret)
        gathered = jax.lax.all_gather(scale[0], "data")[: scale.shape[0]]
        mean = unpack_signs(bits, gathered, average=True, impl=impl, interpret=interpret)
        return bits, new_error, values, mean[None]

    return f, jax.sharding.NamedSharding(mesh, rows), jax.sharding.NamedSharding(mesh, P())


def test_inside_shard_map():
    x, error, scale = _inputs(12, 48, seed=4)
    scale = scale[:3]
    outs = {}
    for impl, interpret in (("xla", False), ("pallas", True)):
        f, rows, replicated = _sharded(impl, interpret)
        outs[impl] = f(jax.device_put(x, rows), jax.device_put(error, rows), jax.device_put(scale, replicated))
    for g, w in zip(outs["pallas"], outs["xla"]):
        _assert_same_bits(g, w)
    f, rows, replicated = _sharded("pallas", interpret=True, check_vma=True)
    with pytest.raises(ValueError, match="interpret mode inside a shard_map"):
        f(jax.device_put(x, rows), jax.device_put(error, rows), jax.device_put(scale, replicated))


def _triton_calls(build, *spec, mesh=None):
    """The custom calls of `build(target)` lowered for CUDA, and the export. zeroflax.compat.lowering_for_gpu
    gives the target GPU that jax 0.11's Triton lowering asks for, and the mesh a shard_map inside must use
    (`mesh` on jax 0.10; its abstract twin carrying the GPU on 0.11)."""
    from zeroflax.compat import lowering_for_gpu

    # The Triton custom call has no export-compatibility guarantee, hence the disabled check (fine
    # here: the module is inspected, never serialized).
    with lowering_for_gpu(mesh) as target:
        exported = jax.export.export(
            build(target), platforms=("cuda",),
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*spec)
    return re.findall(r"custom_call @([\w$.]+)", exported.mlir_module()), exported


def test_pallas_lowers_for_cuda():
    """Pallas -> Triton IR for all three kernels, on this CPU-only machine, plainly and inside a
    shard_map with check_vma=True. (Triton's own compile to PTX happens in XLA:GPU, not covered.)
    tests/test_cuda_lowering.py lowers them at the GPU pass's shapes."""
    rows, cols = 3, 4104
    spec = (jax.ShapeDtypeStruct((rows, cols), jnp.float32),) * 2 + (jax.ShapeDtypeStruct((rows,), jnp.float32),)
    calls, exported = _triton_calls(lambda _: jax.jit(functools.partial(_all, impl="pallas")), *spec)
    assert calls == ["__gpu$xla.gpu.triton"] * 3, calls
    assert [a.shape for a in exported.out_avals] == [(rows, cols // 8), (rows, cols), (rows, cols), (cols,)]
    assert [a.dtype for a in exported.out_avals] == [jnp.uint8] + [jnp.float32] * 3

    # _sharded's program over the mesh that lowering_for_gpu gives (_sharded makes its own CPU mesh).
    mesh = jax.make_mesh((2, 4), ("pipe", "data"))
    row = P("data")

    def sharded(target):
        @jax.jit
        @functools.partial(jax.shard_map, mesh=target, in_specs=(row, row, P()), out_specs=(row,) * 4,
                           check_vma=True)
        def f(x, error, scale):
            bits, new_error = pack_signs(x, error, scale, impl="pallas")
            values = unpack_signs(bits, scale, average=False, impl="pallas")
            gathered = jax.lax.all_gather(scale[0], "data")[: scale.shape[0]]
            mean = unpack_signs(bits, gathered, average=True, impl="pallas")
            return bits, new_error, values, mean[None]
        return f

    sharded_rows, replicated = jax.sharding.NamedSharding(mesh, row), jax.sharding.NamedSharding(mesh, P())
    spec = (jax.ShapeDtypeStruct((4 * rows, cols), jnp.float32, sharding=sharded_rows),) * 2 + (
        jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=replicated),)
    calls, _ = _triton_calls(sharded, *spec, mesh=mesh)
    assert calls == ["__gpu$xla.gpu.triton"] * 3, calls
