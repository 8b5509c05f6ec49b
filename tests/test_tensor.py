"""Tensor slicing on data 4 x tensor 2: Megatron's communication at every ZeRO stage, a vocab-parallel
cross-entropy that never forms the whole logits, sequence parallelism's all-gathers and reduce-scatters.

Compile-only (the reports run nothing); the equivalence of these meshes with a single-device optax loop
is in test_equivalence.py (data x tensor) and test_pipeline.py (data x pipe x tensor, sequence
parallelism included).
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflax
from zeroflax.models.gpt import GPT, GPTConfig, next_token_loss

MESH = zeroflax.MeshConfig({"data": 4, "tensor": 2})
BATCH, SEQ, VOCAB = 2, 32, 256  # per device and micro-batch


@pytest.fixture(scope="module")
def gpt():
    model = GPT(GPTConfig(num_layers=4, d_model=64, num_heads=4, max_len=SEQ, vocab_size=VOCAB))
    batch = {"tokens": np.zeros((4 * BATCH, SEQ + 1), np.int32)}
    return model, model.init(jax.random.PRNGKey(0), batch["tokens"][:, :-1])["params"], batch


def reports(gpt, stage, **overrides):
    model, boxed, batch = gpt
    # fp32: XLA:CPU carries 16-bit all-reduces in fp32, which would double the measured bytes.
    config = zeroflax.Config(mesh=MESH, zero_stage=stage, micro_batch_size=BATCH, persistence_threshold=0,
                             **overrides)
    engine, state = zeroflax.initialize(next_token_loss(model), boxed, optax.adam(1e-3), config)
    return engine, zeroflax.comm_report(engine, state, batch), engine.compile(state, batch).as_text()


def tensor_bytes_by_kind(comm) -> dict:
    out = {}
    for c in comm.collectives:
        if tuple(c["axes"]) == ("tensor",):
            out[c["kind"]] = out.get(c["kind"], 0.0) + c["bytes_per_step"]
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_megatrons_volume_at_every_zero_stage(gpt, stage):
    """The tensor axis moves Megatron's activation all-reduces (2 + 2 per layer, 1 more per recomputed
    forward, the embedding's and the head's) and no weights: before ZeRO's collectives ran on tensor
    slices, the tensor axis carried 2.2x these bytes at stage 1 and 2.8x at stage 3 (every layer's
    weights all-gathered over `tensor`, whole weights on every tensor device). The data axis moves
    ZeRO's volume of this device's slices."""
    engine, comm, hlo = reports(gpt, stage)
    print(comm)
    tensor, data = comm.by_axis["tensor"], comm.by_axis["data"]
    assert 0.98 <= tensor / comm.theory_by_axis["tensor"] <= 1.05, comm
    assert 0.95 <= data / comm.theory_by_axis["data"] <= 1.02, comm
    kinds = tensor_bytes_by_kind(comm)
    assert kinds.get("all-reduce", 0.0) >= 0.99 * tensor, kinds  # activations, not gathered weights
    assert not [c for c in comm.collectives if len(c["axes"]) > 1 and c["bytes_per_step"] > 1024]
    # The vocab-parallel cross-entropy: logits exist only as this device's half of the vocabulary.
    assert not re.search(rf"\[{BATCH},{SEQ},{VOCAB}\]", hlo)
    assert re.search(rf"\[{BATCH},{SEQ},{VOCAB // 2}\]", hlo)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_sequence_parallelism_gathers_and_scatters(gpt, remat):
    """Config.sequence_parallel: the layers' tensor traffic becomes all-gathers and reduce-scatters (of
    half an activation each) with Megatron's bytes; the residual stream is split along the sequence."""
    engine, comm, hlo = reports(gpt, 1, sequence_parallel=True, remat=remat)
    print(comm)
    kinds = tensor_bytes_by_kind(comm)
    assert 0.95 <= comm.by_axis["tensor"] / comm.theory_by_axis["tensor"] <= 1.1, comm
    assert kinds["reduce-scatter"] + kinds["all-gather"] >= 0.85 * comm.by_axis["tensor"], kinds
    half = f"[{BATCH},{SEQ // 2},64]"  # one device's sequence slice of the residual stream
    assert any(half in line and "reduce-scatter(" in line for line in hlo.splitlines())


def test_sequence_parallel_without_a_split_warns():
    """A loss that never calls zeroflax.sequence_split gets a warning, not a silent no-op."""
    params = {"w": jnp.ones((8, 16)), "v": jnp.ones((16, 8))}
    loss = lambda p, b, r: jnp.mean(jax.nn.relu(b["x"] @ p["w"]) @ p["v"])
    config = zeroflax.Config(mesh=MESH, sequence_parallel=True, remat="none")
    engine, state = zeroflax.initialize(loss, params, optax.sgd(0.1), config,
                                        logical_axes={"w": ("embed", "mlp"), "v": ("mlp", "embed")})
    with pytest.warns(UserWarning, match=r"Config.sequence_parallel=True applies to nothing"):
        engine.step(state, {"x": np.ones((4, 8), np.float32)})


def test_sequence_split_and_tensor_parallel_are_plain_calls_outside_the_engine():
    x, w = jnp.arange(24.0).reshape(1, 4, 6), jnp.ones((6, 6))
    assert jnp.array_equal(zeroflax.sequence_split(x), x)
    pair = zeroflax.tensor_parallel(lambda h, w: h @ w, ("embed", "mlp"))
    assert jnp.array_equal(pair(x, w), x @ w)
