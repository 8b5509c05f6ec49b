"""Every Pallas kernel of zeroflax lowered for CUDA with the Triton backend, on this CPU-only machine, at
exactly the shapes that the GPU pass runs (benchmarks/gpu/shapes.py): a kernel the pass would run cannot
stop lowering unnoticed, on either jax version.

* Block-sparse attention (zeroflax/kernels/sparse_attention_pallas.py): bf16 q, k, v of
  [SPARSE_BATCH, length, SPARSE_HEADS, head_dim], for every head_dim and (length, window) of the pass,
  with the bidirectional LocalSlidingWindow layout of that window and BigBird's default layout, each
  as one layout for all heads (as benchmarks/gpu/sparse_attention.py builds them) and as SPARSE_HEADS
  layouts. The forward alone holds one kernel; jax.grad of a loss through it holds three: the forward,
  dq and dk/dv. 48 programs, 96 kernels.
* The pass's correctness check of the sparse kernels (benchmarks/gpu/sparse_attention.py,
  correctness_check): b 2, L 256, 2 heads, d 64, block 16, BigBird per head, causal, key padding (the
  kernels' variant with a mask input), float32 and bfloat16, value and gradients: 2 programs, 6 kernels.
* 1-bit Adam's sign packing (zeroflax/kernels/onebit_pack.py): float32 ONEBIT_ROWS rows of ONEBIT_COLS
  and of ONEBIT_ALIGNED_COLS columns, pack, unpack and unpack-average in one program: 2 programs, 6
  kernels.

Each program is lowered with jax.export for platforms=("cuda",) inside zeroflax.compat.lowering_for_gpu
(jax 0.11 needs a target GPU: an abstract H200). `_assert_triton_kernels` then reads the module: every
kernel must be a Triton custom call with the expected kernel name, grid and compiler parameters, and
no kernel body may have become HLO (interpret mode). The negative cases lower the same programs with
interpret=True and check that this same function rejects them. The warnings of each lowering are
recorded and checked too: exactly jax 0.11's deprecation of the Triton backend there, none on 0.10.

Not covered: Triton's own compile of the IR to PTX/cubin, which XLA:GPU does when the program is
compiled on a GPU; only the GPU pass exercises that (and runs the kernels).
"""

from __future__ import annotations

import importlib.util
import os
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeroflax.compat import lowering_for_gpu
from zeroflax.kernels import BigBirdSparsityConfig, LocalSlidingWindowSparsityConfig
from zeroflax.kernels.onebit_pack import BLOCK_GROUPS, pack_signs, unpack_signs
from zeroflax.kernels.sparse_attention_pallas import sparse_attention_pallas


def _load_shapes():
    """benchmarks/gpu/shapes.py by its path (plain data; benchmarks/ is not a package)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gpu",
                        "shapes.py")
    spec = importlib.util.spec_from_file_location("zeroflax_gpu_shapes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


S = _load_shapes()

TRITON_CALL = "__gpu$xla.gpu.triton"
NUM_WARPS, NUM_STAGES = 4, 2  # both kernel files' plgpu.CompilerParams
# The Triton backend's deprecation came with jax 0.11 (jax/_src/pallas/triton/pallas_call_registration.py):
# every Triton lowering warns with this text; jax 0.10 does not warn. An expectation per release, so a
# version number: when a release changes it (another text, an error, the warning gone), the tests say so.
# See docs/perf.md, "Pallas on GPU: Triton or Mosaic GPU (jax 0.11)".
DEPRECATION = ("The Pallas Triton backend is deprecated and will be removed in a future JAX version. To keep "
               "using Pallas on GPU, please migrate to the Mosaic GPU backend. To keep using Triton, switch "
               "to the official Triton bindings and jax_triton.")
EXPECT_DEPRECATION = jax.__version_info__ >= (0, 11)


# ------------------------------------------------------------------------------------ lowering, checking
def _export_for_cuda(f, *avals):
    """`f` lowered for CUDA (jax.export, inspected, never serialized: hence the disabled check on the Triton
    call, which has no export-compatibility guarantee), and the warnings that lowering gave: (category, text)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with lowering_for_gpu():
            exported = jax.export.export(
                jax.jit(f), platforms=("cuda",),
                disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)])(*avals)
    return exported, [(w.category, str(w.message)) for w in caught]


_IR_BLOB = re.compile(r'\bir = "(?:[^"\\]|\\.)*"')  # the serialized Triton module: bytes, skipped


def _custom_calls(module_text):
    """(target, backend_config text without the Triton IR blob) of every custom call of a module."""
    calls = []
    for line in module_text.splitlines():
        m = re.search(r"custom_call @([\w$.]+)\(", line)
        if m:
            calls.append((m.group(1), _IR_BLOB.sub("ir = <ir>", line)))
    return calls


def _config_int(config, key):
    m = re.search(rf"\b{key} = (-?\d+) : i32", config)
    assert m, f"Triton call without {key}: {config[:300]}"
    return int(m.group(1))


def _assert_triton_kernels(exported, expected):
    """Fail unless `exported` holds exactly the Triton kernels `expected`, [(name, grid), ...] in the
    module's order (grid padded to 3 dimensions with 1s), each with the kernels' num_warps / num_stages,
    and no kernel lowered to HLO. A kernel in interpret mode has no Triton call: its grid and its loops
    are HLO while loops (none of these programs has one outside its kernels)."""
    text = exported.mlir_module()
    calls = _custom_calls(text)
    triton = [config for target, config in calls if target == TRITON_CALL]
    others = sorted({target for target, _ in calls if target != TRITON_CALL})
    loops = text.count("stablehlo.while")
    assert triton or not loops, (f"no {TRITON_CALL} custom call and {loops} HLO while loop(s): the kernels were "
                                 f"lowered in interpret mode (expected Triton kernels {expected})")
    assert not loops, f"{loops} HLO while loop(s) next to the Triton calls: a kernel in interpret mode?"
    assert not others, f"custom calls other than Triton's: {others}"
    got = []
    for config in triton:
        name = re.search(r'\bname = "([^"]*)"', config)
        assert name, f"Triton call without a kernel name: {config[:300]}"
        grid = tuple(_config_int(config, f"grid_{axis}") for axis in "xyz")
        assert (_config_int(config, "num_warps"), _config_int(config, "num_stages")) == (NUM_WARPS, NUM_STAGES), \
            config[:300]
        got.append((name.group(1), grid))
    want = [(name, tuple(grid) + (1,) * (3 - len(grid))) for name, grid in expected]
    assert got == want, f"Triton kernels {got}, expected {want}"


def _assert_warnings(caught):
    """A Triton lowering's warnings: jax 0.11's deprecation of the backend (at least once), nothing else;
    none at all on jax 0.10."""
    other = [(c.__name__, m) for c, m in caught if (c, m) != (DeprecationWarning, DEPRECATION)]
    assert not other, f"new warnings at lowering: {other}"
    assert bool(caught) == EXPECT_DEPRECATION, (
        f"jax {jax.__version__}: expected {'the' if EXPECT_DEPRECATION else 'no'} Triton deprecation warning, "
        f"got {len(caught)}")


# ------------------------------------------------------------------------------------ the programs
SPARSE_LAYOUTS = ("window", "bigbird")
# Layouts of 1 head (shared by all heads, as benchmarks/gpu/sparse_attention.py makes them) and of
# SPARSE_HEADS heads (what the configs give for num_heads=SPARSE_HEADS): the kernels' tables differ.
SPARSE_LAYOUT_HEADS = (1, S.SPARSE_HEADS)
SPARSE_CASES = [(d, length, kind, heads) for d in S.SPARSE_HEAD_DIMS for length in S.SPARSE_LENGTHS
                for kind in SPARSE_LAYOUTS for heads in SPARSE_LAYOUT_HEADS]


def _sparse_layout(kind, length, heads):
    if kind == "window":
        return LocalSlidingWindowSparsityConfig(heads, block=S.SPARSE_BLOCK, attention="bidirectional",
                                                num_sliding_window_blocks=S.SPARSE_WINDOWS[length]).make_layout(length)
    return BigBirdSparsityConfig(heads, block=S.SPARSE_BLOCK).make_layout(length)


def _sparse_program(d, length, kind, heads, backward, interpret=False):
    """(f, avals, expected kernels) of the sparse attention forward, or of the gradient of a loss through
    it (forward, dq, dk/dv), at the pass's shape, with a layout of `heads` heads."""
    layout = _sparse_layout(kind, length, heads)
    shape = (S.SPARSE_BATCH, length, S.SPARSE_HEADS, d)
    avals = (jax.ShapeDtypeStruct(shape, jnp.bfloat16),) * 3

    def attend(q, k, v):
        return sparse_attention_pallas(q, k, v, layout, causal=False, interpret=interpret)

    grid = (S.SPARSE_BATCH, S.SPARSE_HEADS, length // S.SPARSE_BLOCK)
    if not backward:
        return attend, avals, [("_fwd_kernel", grid)]

    def loss(q, k, v):
        return jnp.sum(attend(q, k, v).astype(jnp.float32))

    return jax.grad(loss, argnums=(0, 1, 2)), avals, [(n, grid) for n in ("_fwd_kernel", "_dq_kernel", "_dkv_kernel")]


def _check_program(dtype):
    """(f, avals, expected kernels) of the pass's correctness check: value and gradients of a loss through
    the kernels, causal, with key padding, as benchmarks/gpu/sparse_attention.py's correctness_check."""
    b, length, h, d, block = 2, 256, 2, 64, 16
    layout = BigBirdSparsityConfig(h, block=block, different_layout_per_head=True,
                                   attention="unidirectional").make_layout(length)
    layout[0, 5] = 0
    kpm = np.arange(length)[None] < np.array([[200], [256]])

    def loss(q, k, v):
        o = sparse_attention_pallas(q, k, v, layout, causal=True, key_padding_mask=kpm, interpret=False)
        return jnp.sum(o.astype(jnp.float32)), o

    avals = (jax.ShapeDtypeStruct((b, length, h, d), dtype),) * 3
    grid = (b, h, length // block)
    return (jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), avals,
            [(n, grid) for n in ("_fwd_kernel", "_dq_kernel", "_dkv_kernel")])


ONEBIT_COLS = tuple(dict.fromkeys((S.ONEBIT_COLS, S.ONEBIT_ALIGNED_COLS)))


def _onebit_program(cols, interpret=False):
    """(f, avals, expected kernels): pack, then unpack and unpack-average of the packed bits."""
    rows = S.ONEBIT_ROWS

    def f(x, error, scale):
        bits, new_error = pack_signs(x, error, scale, impl="pallas", interpret=interpret)
        values = unpack_signs(bits, scale, average=False, impl="pallas", interpret=interpret)
        mean = unpack_signs(bits, scale, average=True, impl="pallas", interpret=interpret)
        return bits, new_error, values, mean

    avals = (jax.ShapeDtypeStruct((rows, cols), jnp.float32),) * 2 + (jax.ShapeDtypeStruct((rows,), jnp.float32),)
    groups = cols // 8
    block = min(BLOCK_GROUPS, 1 << (groups - 1).bit_length())
    blocks = -(-groups // block)
    return f, avals, [("_pack_kernel", (rows, blocks)), ("_unpack_kernel", (rows, blocks)),
                      ("_average_kernel", (blocks,))]


# ------------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd_bwd"])
@pytest.mark.parametrize("d,length,kind,heads", SPARSE_CASES,
                         ids=[f"d{d}-L{length}-{kind}-h{heads}" for d, length, kind, heads in SPARSE_CASES])
def test_sparse_attention_lowers_for_cuda(d, length, kind, heads, backward):
    f, avals, expected = _sparse_program(d, length, kind, heads, backward)
    exported, caught = _export_for_cuda(f, *avals)
    _assert_triton_kernels(exported, expected)
    _assert_warnings(caught)
    assert [(a.shape, a.dtype) for a in exported.out_avals] == [(avals[0].shape, jnp.bfloat16)] * (
        3 if backward else 1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
def test_sparse_attention_check_lowers_for_cuda(dtype):
    f, avals, expected = _check_program(dtype)
    exported, caught = _export_for_cuda(f, *avals)
    _assert_triton_kernels(exported, expected)
    _assert_warnings(caught)
    shape = avals[0].shape
    assert [(a.shape, a.dtype) for a in exported.out_avals] == [((), jnp.float32), (shape, dtype)] + [
        (shape, dtype)] * 3


@pytest.mark.parametrize("cols", ONEBIT_COLS)
def test_onebit_pack_lowers_for_cuda(cols):
    f, avals, expected = _onebit_program(cols)
    exported, caught = _export_for_cuda(f, *avals)
    _assert_triton_kernels(exported, expected)
    _assert_warnings(caught)
    rows = S.ONEBIT_ROWS
    assert [(a.shape, a.dtype) for a in exported.out_avals] == [
        ((rows, cols // 8), jnp.uint8), ((rows, cols), jnp.float32), ((rows, cols), jnp.float32),
        ((cols,), jnp.float32)]


@pytest.mark.parametrize("program", ["sparse_fwd_bwd", "onebit"])
def test_interpret_mode_is_rejected(program):
    """The same programs with interpret=True (the kernels lowered to HLO, as `sparse_attention(
    implementation='pallas')` silently does without a GPU) fail `_assert_triton_kernels`."""
    if program == "onebit":
        f, avals, expected = _onebit_program(S.ONEBIT_COLS, interpret=True)
    else:
        f, avals, expected = _sparse_program(S.SPARSE_HEAD_DIMS[0], S.SPARSE_LENGTHS[0], "window", 1, True,
                                             interpret=True)
    exported, caught = _export_for_cuda(f, *avals)
    assert not caught  # no Triton lowering, no deprecation
    with pytest.raises(AssertionError, match="interpret mode"):
        _assert_triton_kernels(exported, expected)


def test_checker_rejects_missing_or_wrong_kernels():
    """A Triton lowering with a kernel short, or named or shaped otherwise, fails too."""
    f, avals, expected = _sparse_program(S.SPARSE_HEAD_DIMS[0], S.SPARSE_LENGTHS[0], "window", 1, True)
    exported, _ = _export_for_cuda(f, *avals)
    _assert_triton_kernels(exported, expected)
    for wrong in (expected[:2], expected + expected[:1], [("_fwd_kernel", (1, 1, 1))] + expected[1:]):
        with pytest.raises(AssertionError, match="Triton kernels"):
            _assert_triton_kernels(exported, wrong)
