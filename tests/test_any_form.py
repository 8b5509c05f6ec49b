"""ZeRO-3 on models in the forms users write them (issue 42, item 2), none of them aware of zeroflax:
Linen with `setup` and a tied `attend` head, `nn.remat` and `nn.vmap` of any name, an `nn.scan` not
named 'layers', and NNX used through `nnx.split`/`nnx.merge` with a method other than `__call__`.

Each trains at stages 0-3 equal to a one-device optax loop (within its noise floor, tests/noise_floor.py),
at stage 3 with nothing gathered on entry: the module interceptor places what it sees, the placement pass
(zeroflax/sharding/relocate.py) the rest.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import zeroflax
from noise_floor import assert_matches
from test_zero3_models import STEPS, reference_and_floor

D, VOCAB = 32, 64


class SetupTied(nn.Module):
    """Submodules made in `setup`; the head is the embedding's `attend`."""

    def setup(self):
        self.embed = nn.Embed(VOCAB, D, embedding_init=nn.initializers.normal(0.2))
        self.hidden = nn.Dense(4 * D)
        self.out = nn.Dense(D)

    def __call__(self, ids):
        h = self.embed(ids)
        h = h + self.out(jnp.tanh(self.hidden(h)))
        return self.embed.attend(h)


class _Block(nn.Module):
    @nn.compact
    def __call__(self, h):
        return h + nn.Dense(D)(jnp.tanh(nn.Dense(4 * D)(h)))


class RematBlocks(nn.Module):
    """Blocks under `nn.remat`, named as the model likes."""

    @nn.compact
    def __call__(self, ids):
        h = nn.Embed(VOCAB, D, embedding_init=nn.initializers.normal(0.2))(ids)
        for i in range(2):
            h = nn.remat(_Block)(name=f"stage_{i}")(h)
        return nn.Dense(VOCAB)(h)


class VmapHeads(nn.Module):
    """An ensemble of heads by `nn.vmap` (their parameters stacked, no logical names), averaged."""

    @nn.compact
    def __call__(self, ids):
        h = nn.Embed(VOCAB, D, embedding_init=nn.initializers.normal(0.2))(ids)
        heads = nn.vmap(nn.Dense, variable_axes={"params": 0}, split_rngs={"params": True}, in_axes=None,
                        out_axes=0, axis_size=3)(VOCAB, name="ensemble")
        return jnp.mean(heads(jnp.tanh(h)), axis=0)


class _ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        return h + nn.Dense(D)(jnp.tanh(nn.Dense(4 * D)(h))), None


class UnnamedScan(nn.Module):
    """Four blocks by `nn.scan`, named 'trunk', no logical names; the head is the embedding's `attend`."""

    @nn.compact
    def __call__(self, ids):
        embed = nn.Embed(VOCAB, D, embedding_init=nn.initializers.normal(0.2))
        stack = nn.scan(_ScanBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=4)
        h, _ = stack(name="trunk")(embed(ids), None)
        return embed.attend(h)


class EncodeDecode(nnx.Module):
    """NNX, trained through `nnx.split`/`nnx.merge` by the user's own loss, which calls `encode` and
    `decode` (a tied head by `@ embedding.T`), never `__call__`."""

    def __init__(self, rngs):
        self.embedding = nnx.Param(jax.random.normal(rngs.params(), (VOCAB, D)) * 0.2)
        self.mix = nnx.Linear(D, D, rngs=rngs)

    def encode(self, ids):
        return jnp.tanh(self.mix(self.embedding[...][ids]))

    def decode(self, h):
        return h @ self.embedding[...].T


def _linen(model):
    ids = jnp.zeros((1, 8), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), ids)["params"]
    return params, lambda p, ids: model.apply({"params": p}, ids)


def _nnx():
    graphdef, state = nnx.split(EncodeDecode(nnx.Rngs(0)))

    def apply(state, ids):
        model = nnx.merge(graphdef, state)
        return model.decode(model.encode(ids))

    return state, apply


FORMS = {"linen setup, tied attend": lambda: _linen(SetupTied()), "nn.remat any name": lambda: _linen(RematBlocks()),
         "nn.vmap heads": lambda: _linen(VmapHeads()), "nn.scan unnamed, tied attend": lambda: _linen(UnnamedScan()),
         "nnx split/merge, methods": _nnx}


@functools.cache
def case(form):
    """(params, loss, batches, the reference's parameters and noise floor) of a form, built once."""
    params, apply = FORMS[form]()

    def loss(p, batch, rng):
        logits = apply(p, batch["ids"]).astype(jnp.float32)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["ids"][..., None], -1))

    rng = np.random.default_rng(5)
    batches = [{"ids": rng.integers(0, VOCAB, (16, 8)).astype(np.int32)} for _ in range(STEPS)]
    return params, loss, batches, reference_and_floor(params, loss, batches)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("form", list(FORMS))
def test_places_every_gather_and_matches_optax(form, stage):
    params, loss, batches, (reference, floor) = case(form)
    # The setup model's embedding is two module calls (`embed`, `embed.attend`): a parameter shared by
    # groups within Config.max_reuse_distance (DeepSpeed's meaning, default 1e9 elements) is gathered at
    # its first use and kept for the later ones, not on entry (docs/zero3.md).
    config = zeroflax.Config(zero_stage=stage, micro_batch_size=2, persistence_threshold=0)
    engine, state = zeroflax.initialize(loss, params, optax.adamw(1e-3, eps=1e-6), config)
    for batch in batches:
        state, _ = engine.step(state, batch)
    if stage == 3:
        assert engine.gathered_on_entry_reasons() == {}, engine.gathered_on_entry_reasons()
        assert engine.trace.gather_usage.groups, "gathered in groups"
        print(f"{form}: groups {list(engine.trace.gather_usage.groups)}")
    assert_matches(jax.device_get(engine.model_params(state)), reference, floor, f"{form} at stage {stage}")
