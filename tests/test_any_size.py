"""ZeRO on any number of devices (docs/design.md, "Padding"): a leaf that the data size does not divide is
stored zero-padded and partitioned anyway; the model, the optimizer, norms, checkpoints and what users
read see its true shape.

Data size 6 runs on 6 of the suite's 8 simulated devices; 12 in a subprocess with 12 devices."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

import zeroflax
from zeroflax.checkpoint import CheckpointError, Checkpointer, true_shapes
from zeroflax.sharding.policy import zero_placement

from models import MLP, linen_case, odd_loss, odd_params
from cli_helpers import xla_flags_without_device_count
from noise_floor import assert_matches
from test_equivalence import adamw, reference_and_floor

STEPS = 4
CLIP = 0.5  # below the gradients' norm at the first steps: clipping acts
# A LLaMA-7B layer's two large matrices, and dimensions no cluster size of 3 x 2^k divides.
LLAMA = [(4096, 4096), (4096, 11008)]


@pytest.mark.parametrize("n", [6, 12, 24, 48, 96])
def test_every_leaf_is_partitioned_with_the_least_padding(n):
    for shape in LLAMA + [(7, 13), (13,), (3, 4096, 5)]:
        dim, pad = zero_placement(shape, (None,) * len(shape), n, 0, False)
        assert dim is not None and pad < n and (shape[dim] + pad) % n == 0, (shape, n, dim, pad)
        added = pad * int(np.prod(shape)) // shape[dim]
        for d in range(len(shape)):  # no other dimension would pad with fewer zeros
            assert added <= (-shape[d] % n) * int(np.prod(shape)) // shape[d]
    # A dimension the data size divides is taken as before (largest; no padding).
    assert zero_placement((4096, 11008), (None, None), 8, 0, False) == (1, 0)
    assert zero_placement((4096, 11008), (None, None), 6, 0, False) == (1, 2)  # 2 columns of 4096: 0.02%
    # Below the persistence threshold, or with every dimension sliced otherwise: whole.
    assert zero_placement((7, 13), (None, None), n, 100, False) == (None, 0)
    assert zero_placement((7, 13), ("tensor", "tensor"), n, 0, False) == (None, 0)


def _case(name, seed=0, rows=12):
    rng = np.random.default_rng(seed)
    if name == "odd":
        params, loss = odd_params(jax.random.PRNGKey(seed)), odd_loss
        make = lambda n: {"x": rng.normal(size=(n, 7)).astype(np.float32), "y": rng.normal(size=(n, 3)).astype(np.float32)}
        return params, loss, [make(rows) for _ in range(STEPS)]
    init, loss, make = linen_case(MLP(hidden=37, out=5), (13,), 5)  # Flax modules: gathered where used
    batches = [make(rng, rows) for _ in range(STEPS)]
    return init(jax.random.PRNGKey(seed), batches[0]), loss, batches


def _remat(model, stage):
    """The odd model has no module to checkpoint; stage 3 refuses 'none' (it would keep every gather)."""
    return "full" if model == "flax" else "dots" if stage == 3 else "none"


def _run(params, loss, batches, config, devices):
    engine, state = zeroflax.initialize(loss, params, adamw(weight_decay=0.1), config, devices=devices)
    for batch in batches:
        state, metrics = engine.step(state, batch)
        assert np.isfinite(float(metrics["loss"]))
    return engine, state


@pytest.mark.parametrize("model", ["odd", "flax"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_six_devices_match_optax(model, stage):
    params, loss, batches = _case(model)
    clipped = optax.chain(optax.clip_by_global_norm(CLIP), adamw(weight_decay=0.1))  # the norm sees no padding
    reference, floor = reference_and_floor(loss, zeroflax.unbox(params)[0], clipped, batches)
    config = zeroflax.Config(zero_stage=stage, micro_batch_size=1, grad_accum_steps=2, persistence_threshold=0,
                             grad_clip=CLIP, remat=_remat(model, stage))
    engine, state = _run(params, loss, batches, config, jax.devices()[:6])
    assert engine.data_size == 6
    if stage:
        assert engine.plan.padded and all(p.zero_dim is not None for p in jax.tree.leaves(
            engine.plan.placements, is_leaf=lambda x: hasattr(x, "zero_dim")))
    if stage == 3 and model == "flax":
        assert engine.gathered_on_entry() == []  # padded leaves are gathered per module too
    stored = jax.tree.leaves(state.opt_state if stage < 3 else state.params)
    true = jax.tree.leaves(engine.plan.abstract_opt_state if stage < 3 else engine.plan.abstract_params)
    for x, t in zip(stored, true):  # the padding is zero at rest, after the updates
        x = np.array(x)
        if x.shape != t.shape:
            x[tuple(slice(0, n) for n in t.shape)] = 0
            assert not np.any(x), "a padded element is not zero"
    model_params = jax.device_get(engine.model_params(state))
    assert jax.tree.map(np.shape, model_params) == jax.tree.map(np.shape, reference)
    assert_matches(model_params, reference, floor, f"{model} stage {stage} on 6 devices")


TWELVE = r"""
import os, sys, json
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=12"
sys.path.insert(0, sys.argv[1])
import jax, optax, zeroflax
from test_any_size import _case, _remat, _run, STEPS
from noise_floor import assert_matches
from test_equivalence import adamw, reference_and_floor
out = {}
for model, stage in [("flax", 1), ("flax", 3)]:
    params, loss, batches = _case(model)
    reference, floor = reference_and_floor(loss, zeroflax.unbox(params)[0], optax.chain(
        optax.clip_by_global_norm(0.5), adamw(weight_decay=0.1)), batches)
    config = zeroflax.Config(zero_stage=stage, micro_batch_size=1, persistence_threshold=0, grad_clip=0.5,
                             remat=_remat(model, stage))
    engine, state = _run(params, loss, batches, config, None)
    assert engine.data_size == 12 and engine.plan.padded
    out[f"{model}-{stage}"] = assert_matches(jax.device_get(engine.model_params(state)), reference, floor,
                                             f"{model} stage {stage} on 12 devices")
print(json.dumps(out))
"""


def test_twelve_devices_match_optax():
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "XLA_FLAGS": xla_flags_without_device_count()}  # the script sets its own count
    done = subprocess.run([sys.executable, "-c", TWELVE, here], capture_output=True, text=True, timeout=600, env=env,
                          cwd=os.path.dirname(here))
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(errors) == {"flax-1", "flax-3"}, errors  # each within its noise floor's bound (the script asserts)


def _saved(engine, state, directory):
    checkpoints = Checkpointer(directory, asynchronous=False)
    checkpoints.save(int(state.step), state, {}, {}, force=True, view=engine.model_order,
                     shapes=true_shapes(engine.abstract_state(stored=False)))
    checkpoints.close()


def _restored(engine, directory):
    template = engine.abstract_state()
    checkpoints = Checkpointer(directory)
    state, _, _ = checkpoints.restore(None, template, engine.state_shardings,
                                      true_state=engine.abstract_state(stored=False))
    checkpoints.close()
    return engine.storage_order(state)


def _true_state(engine, state):
    """(params, optimizer state) in their true shapes, on the host."""
    opt = jax.tree.map(lambda x, a: np.asarray(x)[tuple(slice(0, n) for n in a.shape)], jax.device_get(state.opt_state),
                       engine.plan.abstract_opt_state)
    return jax.device_get(engine.model_params(state)), opt


def _config(n, stage=3):
    """Stage 3 on n devices, for 24-row batches."""
    return zeroflax.Config(zero_stage=stage, micro_batch_size=24 // n, persistence_threshold=0,
                           remat=_remat("odd", stage))


@pytest.mark.parametrize("first, then", [(6, (8, 1)), (8, (6, 1)), (1, (6,))])
def test_checkpoint_restores_on_any_size_bitwise(tmp_path, first, then):
    """Written at 6 devices, restored at 8 (other paddings) and 1 (none), and the other way round (8 -> 6 and
    1 -> 6): the parameters and the optimizer state are the same bits, and the run goes on."""
    params, loss, batches = _case("odd", rows=24)
    engine, state = _run(params, loss, batches[:2], _config(first), jax.devices()[:first])
    assert engine.plan.padded == (first > 1)  # at 8 too: the odd model's (3,) and (13, 5) leaves
    _saved(engine, state, str(tmp_path / "ckpt"))
    expected = _true_state(engine, state)
    for n in then:
        other, _ = zeroflax.initialize(loss, params, adamw(weight_decay=0.1), _config(n), devices=jax.devices()[:n],
                                       abstract=True)
        restored = _restored(other, str(tmp_path / "ckpt"))
        assert int(restored.step) == 2
        got = _true_state(other, restored)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
            np.testing.assert_array_equal(a, b)
        # ... and it trains on from there as the original would.
        restored, _ = other.step(restored, batches[2])
        assert np.isfinite(float(jax.device_get(jax.tree.leaves(restored.params)[0]).sum()))


def test_checkpoint_of_another_model_is_refused(tmp_path):
    params, loss, batches = _case("odd", rows=24)
    config = _config(6)
    engine, state = _run(params, loss, batches[:1], config, jax.devices()[:6])
    _saved(engine, state, str(tmp_path / "ckpt"))
    wider = dict(params, w3=jax.numpy.zeros((13, 6)), b3=jax.numpy.zeros((6,)))  # one output more: pads of 6 hide it
    other, _ = zeroflax.initialize(odd_loss, wider, adamw(weight_decay=0.1), config, devices=jax.devices()[:6],
                                   abstract=True)
    with pytest.raises(CheckpointError, match=r"another model: \['params'\]\['b3'\] is \[5\] in the checkpoint, "
                                              r"\[6\] here"):
        _restored(other, str(tmp_path / "ckpt"))


def test_export_and_init_from_a_padded_checkpoint(tmp_path):
    """A GPT trained on 6 devices (every leaf padded: 6 divides no power of two) exports its true shapes bit
    for bit, and a run on 6 devices starts from the export with the same parameters."""
    from zeroflax.export import export_safetensors, initialize_from_safetensors
    from zeroflax.models.gpt import GPT, GPTConfig, next_token_loss
    model = GPT(GPTConfig(num_layers=2, d_model=32, num_heads=2, max_len=16))
    batch = {"tokens": np.random.default_rng(3).integers(0, 256, (12, 17)).astype(np.int32)}
    init = lambda rng, b: model.init(rng, b["tokens"][:, :-1])["params"]
    config = zeroflax.Config(zero_stage=3, micro_batch_size=2, persistence_threshold=0)
    engine, state = zeroflax.initialize(next_token_loss(model), init, optax.adamw(1e-3), config, sample_batch=batch,
                                        devices=jax.devices()[:6])
    state, _ = engine.step(state, batch)
    assert engine.plan.padded
    checkpoints = Checkpointer(str(tmp_path / "checkpoints"), every=1, asynchronous=False)
    checkpoints.save(1, state, {}, {"model": model.config.to_dict()}, view=engine.model_order,
                     shapes=true_shapes(engine.abstract_state(stored=False)))
    checkpoints.close()
    out = str(tmp_path / "fp32.safetensors")
    export_safetensors(str(tmp_path), out)
    params = jax.device_get(engine.model_params(state))
    fresh_engine, fresh = zeroflax.initialize(next_token_loss(model), init, optax.adamw(1e-3), config,
                                              sample_batch=batch, devices=jax.devices()[:6], rng=jax.random.PRNGKey(7))
    started = initialize_from_safetensors(fresh_engine, fresh, out)
    for a, b in zip(jax.tree.leaves(jax.device_get(fresh_engine.model_params(started))), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
    stored, true = jax.tree.leaves(jax.device_get(started.params)), jax.tree.leaves(fresh_engine.abstract_params)
    assert any(x.shape != t.shape for x, t in zip(stored, true))  # placed padded, with zeros
    fresh_engine.step(started, batch)


@pytest.mark.slow  # multi-process or end-to-end: `make test-slow` (and CI)
def test_train_on_six_devices_resumes_on_eight(tmp_path):
    """`zeroflax train` writes its checkpoints padded on 6 devices; `--resume` on 8 restores them (the true
    shapes checked, the padding cut) and trains on with the same global batch."""
    from cli_helpers import losses, tiny_bindings, zeroflax as run_cli
    workdir = tmp_path / "run"
    first = run_cli("train", "--gin_file", "experiments/gpt_tiny_zero3.gin", "--cpu_devices", "6", "--stop_at", "2",
                    "--no_progress", *tiny_bindings(workdir, steps=4, **{"Config.micro_batch_size": 4}))
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_cli("train", "--gin_file", "experiments/gpt_tiny_zero3.gin", "--cpu_devices", "8", "--resume",
                     "--no_progress", *tiny_bindings(workdir, steps=4, **{"Config.micro_batch_size": 3}))
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from step 2" in second.stdout + second.stderr
    logged = losses(workdir)
    assert sorted(logged) == [1, 2, 3, 4] and all(np.isfinite(v) for v in logged.values())


def test_restore_without_the_true_shapes_still_refuses_what_does_not_fit(tmp_path):
    """Checkpointer.restore called without `true_state` (the API as before) cannot tell a model that differs
    only inside the padding, but refuses any array whose true shape does not pad to the target's (orbax's
    non-strict restore would otherwise cut or pad it silently)."""
    params, loss, batches = _case("odd", rows=24)
    engine, state = _run(params, loss, batches[:1], _config(6), jax.devices()[:6])
    _saved(engine, state, str(tmp_path / "ckpt"))
    other_params = dict(params, w2=jax.numpy.zeros((24, 14)), w3=jax.numpy.zeros((14, 5)))
    other, _ = zeroflax.initialize(odd_loss, other_params, adamw(weight_decay=0.1), _config(6),
                                   devices=jax.devices()[:6], abstract=True)
    checkpoints = Checkpointer(str(tmp_path / "ckpt"))
    with pytest.raises(CheckpointError, match=r"another model: \['params'\]\['w2'\] is \[24, 13\] in the checkpoint"):
        checkpoints.restore(None, other.abstract_state(), other.state_shardings)
    restored, _, _ = checkpoints.restore(None, engine.abstract_state(), engine.state_shardings)  # the same model: fine
    checkpoints.close()
    assert int(restored.step) == 1
