"""An Equinox model at ZeRO-3 (issue 42): written as Equinox's documentation writes one, with no zeroflax
call in it. Its layers are built by `eqx.filter_vmap` (a stack) and run by a plain `jax.lax.scan` over
the stack's arrays, `eqx.nn.Embedding` looks the tokens up and the head is the embedding's `.weight.T`.
The user hands zeroflax the arrays of `eqx.partition` and recombines them in the loss.

At stage 3 nothing is gathered on entry: each scan iteration gathers its own layer where the body uses
it, the embedding is gathered at the lookup and at the head; at stages 0-3 training equals a plain optax
loop within its noise floor (tests/noise_floor.py).
"""
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflax
from noise_floor import assert_matches
from test_zero3_models import STEPS, reference_and_floor

D, VOCAB, LAYERS = 32, 64, 6


class Block(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(D, 4 * D, use_bias=False, key=k1)
        self.down = eqx.nn.Linear(4 * D, D, key=k2)

    def __call__(self, h):  # one token's vector, as eqx.nn.Linear takes it
        return h + self.down(jnp.tanh(self.up(h)))


class TinyLM(eqx.Module):
    embedding: eqx.nn.Embedding
    blocks: Block  # every leaf stacked along a first dimension of LAYERS
    norm: eqx.nn.LayerNorm

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        # Scaled as language models initialise a tied embedding (Equinox's default is N(0, 1)).
        self.embedding = eqx.nn.Embedding(weight=jax.random.normal(k1, (VOCAB, D)) * 0.2)
        self.blocks = eqx.filter_vmap(Block)(jax.random.split(k2, LAYERS))
        self.norm = eqx.nn.LayerNorm(D)

    def __call__(self, ids):  # one sequence of token ids
        h = jax.vmap(self.embedding)(ids)
        arrays, static = eqx.partition(self.blocks, eqx.is_array)

        def layer(h, block_arrays):
            block = eqx.combine(block_arrays, static)
            return jax.vmap(block)(h), None

        h, _ = jax.lax.scan(layer, h, arrays)
        h = jax.vmap(self.norm)(h)
        return h @ self.embedding.weight.T


def model_and_loss():
    model = TinyLM(jax.random.PRNGKey(0))
    params, static = eqx.partition(model, eqx.is_array)

    def loss(params, batch, rng):
        logits = jax.vmap(eqx.combine(params, static))(batch["ids"]).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["ids"][..., None], -1))

    return params, loss


def batches():
    rng = np.random.default_rng(11)
    return [{"ids": rng.integers(0, VOCAB, (16, 8)).astype(np.int32)} for _ in range(STEPS)]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_equinox_model_matches_optax(stage):
    params, loss = model_and_loss()
    config = zeroflax.Config(zero_stage=stage, micro_batch_size=2, persistence_threshold=0)
    engine, state = zeroflax.initialize(loss, params, optax.adamw(1e-3, eps=1e-6), config)
    data = batches()
    for batch in data:
        state, _ = engine.step(state, batch)
    if stage == 3:
        assert engine.gathered_on_entry_reasons() == {}
        groups = list(engine.trace.gather_usage.groups)
        # The stack's uses run inside the scan's body, each on one layer's slice; the embedding is used at
        # the lookup and at the head.
        assert any(g.endswith("blocks/up/weight") for g in groups), groups
        embedding = next(i for i, path in engine.trace.leaf_paths().items() if path == "embedding/weight")
        calls = engine.trace.gather_usage.group_calls
        assert sum(embedding in leaves for _, _, leaves in calls) == 2, calls
        # At most two layers' weights gathered at once (fp32), never the stack of six.
        memory = zeroflax.memory_report(engine, state, data[0])
        layer = 2 * 4 * D * D * 4
        assert 0 < memory.gathered_peak <= 2 * layer < LAYERS * layer, (memory.gathered_peak, memory.gathered_by_group)
    assert_matches(jax.device_get(engine.model_params(state)), *reference_and_floor(params, loss, data),
                   f"Equinox stage {stage}")
