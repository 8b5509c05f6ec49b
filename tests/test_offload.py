"""ZeRO-Offload (Config.offload_optimizer / offload_param): the same training as without it, with the
master weights and optimizer state in host memory, at the placement and traffic of the theory.

Numerics: fp32, 5 adamw steps on 8 simulated devices, with 2 micro-batches per step. An offloaded run
applies the same operations to the same values as the run without offload (the compute copy of fp32
parameters is the master itself), so it must match to 1e-6 relative, and bitwise where the update runs
on the device. Each model meets every stage and both update places somewhere in the grid below; each
cell's baseline is the same engine without offload, which tests/test_equivalence.py ties to optax.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflax
from zeroflax import Config, ConfigError, MeshConfig, OffloadOptimizerConfig, OffloadParamConfig
from zeroflax.checkpoint import Checkpointer
from zeroflax.comm import host_transfers
from zeroflax.memory import state_bytes_by_memory
from zeroflax.models.gpt import GPT, GPTConfig, next_token_loss
from test_equivalence import adamw, engine_run, make_case, reference_run
from tolerance import at_least, at_most, relative_error, runs_agree

HOST, DEVICE = OffloadOptimizerConfig("cpu"), OffloadOptimizerConfig("cpu", update="device")
PARAM = OffloadParamConfig("cpu")

# (model, stage, offload_optimizer, offload_param): every model at every stage, both update places.
GRID = [
    ("mlp", 1, HOST, False), ("mlp", 2, DEVICE, False), ("mlp", 3, HOST, False), ("mlp", 3, DEVICE, True),
    ("conv", 1, DEVICE, False), ("conv", 2, HOST, False), ("conv", 3, HOST, False), ("conv", 3, HOST, True),
    ("gpt", 1, HOST, False), ("gpt", 2, HOST, False), ("gpt", 3, DEVICE, False), ("gpt", 3, HOST, True),
]


def base_config(stage, **changes):
    return Config(zero_stage=stage, micro_batch_size=2, grad_accum_steps=2, persistence_threshold=0, **changes)


@functools.lru_cache(maxsize=None)
def baseline(model, stage):
    boxed, loss, batches = make_case(model, 0)
    params, _ = engine_run(loss, boxed, adamw(weight_decay=0.1), batches, base_config(stage))
    return params


@pytest.mark.parametrize("model,stage,offload,stream", GRID,
                         ids=[f"{m}-stage{s}-{o.update}{'-param' if p else ''}" for m, s, o, p in GRID])
def test_offload_trains_as_without(model, stage, offload, stream):
    boxed, loss, batches = make_case(model, 0)
    config = base_config(stage, offload_optimizer=offload, offload_param=PARAM if stream else OffloadParamConfig())
    params, engine = engine_run(loss, boxed, adamw(weight_decay=0.1), batches, config)
    kinds = {s.memory_kind for s in jax.tree.leaves((engine.plan.params, engine.plan.opt_state))}
    assert kinds == {"pinned_host"}
    expected = baseline(model, stage)
    runs_agree(params, expected, 1e-6, "offloaded against on the device")
    if offload.update == "device" and jax.__version_info__ < (0, 12):
        # The same update on the same device: bitwise on jax 0.10 and 0.11. jax 0.12.0.1's XLA compiles
        # the update with the state brought from the host differently (mlp at stage 2: 4 of 8 elements
        # of one leaf off by 1 ulp, 2.7e-7 relative), so there the bound above is the claim.
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(expected)):
            np.testing.assert_array_equal(a, b)


COMPOSED = {  # the composition grid (docs/design.md section 10): offload beside the step's other parts, 32 rows a batch
    "tensor2-stage3-param": dict(mesh=MeshConfig({"data": 4, "tensor": 2}), zero_stage=3, micro_batch_size=4),
    "pipe2-gpipe-stage1": dict(mesh=MeshConfig({"pipe": 2, "data": 4, "tensor": 1}), zero_stage=1,
                               pipeline_schedule="gpipe", micro_batch_size=4),
    "fp16-stage2": dict(zero_stage=2, precision="fp16", micro_batch_size=2),
}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.fp16) if "fp16" in n else n for n in COMPOSED])
def test_offload_composes_with_tensor_slicing_pipelines_and_fp16(name):
    boxed, loss, batches = make_case("gpt", 0)
    changes = COMPOSED[name]
    config = Config(persistence_threshold=0, grad_accum_steps=2, **changes)
    expected, _ = engine_run(loss, boxed, adamw(), batches[:2], config)
    offloaded = config.replace(offload_optimizer=HOST, offload_param=PARAM if "param" in name else OffloadParamConfig())
    params, _ = engine_run(loss, boxed, adamw(), batches[:2], offloaded)
    runs_agree(params, expected, 1e-6, f"offloaded against on the device, {name}")


def gpt_engine(stage, precision="bf16", **changes):
    model = GPT(GPTConfig(num_layers=4, d_model=64, num_heads=2, max_len=32))
    batch = {"tokens": np.random.default_rng(0).integers(0, 256, size=(16, 33)).astype(np.int32)}
    init = lambda k, b: model.init(k, b["tokens"][:, :-1])["params"]
    config = Config(zero_stage=stage, micro_batch_size=1, grad_accum_steps=2, precision=precision,
                    persistence_threshold=0, **changes)
    engine, state = zeroflax.initialize(next_token_loss(model), init, optax.adamw(1e-3), config, sample_batch=batch)
    return engine, state, batch, model, init


# Stage 3 without offload_param sits between these two (benchmarks/offload.py measures all of them).
@pytest.mark.parametrize("stage,stream", [(2, False), (3, True)], ids=["stage2", "stage3-param"])
def test_placement_and_traffic_meet_the_theory(stage, stream):
    engine, state, batch, _, _ = gpt_engine(stage, offload_optimizer=HOST,
                                            offload_param=PARAM if stream else OffloadParamConfig())
    num_params = sum(x.size for x in jax.tree.leaves(engine.abstract_params))
    N = engine.data_size
    live = state_bytes_by_memory(state)  # the live arrays' memory kinds
    model_states = ("params", "opt_state", "compute_params")
    device = sum(live[k].get("device", 0) for k in model_states)
    host = sum(live[k].get("pinned_host", 0) for k in model_states)
    if stage < 3:
        assert device <= 1.05 * 2 * num_params  # only the bf16 compute copy
    else:  # offload_param: only the leaves below the persistence threshold (none here) stay
        placements = jax.tree.leaves(engine.plan.placements, is_leaf=lambda x: hasattr(x, "zero_dim"))
        persistent = 2 * sum(int(np.prod(p.shape)) for p in placements if p.zero_dim is None)
        assert device <= 1.05 * persistent
    assert abs(host / (12 * num_params / N) - 1) <= 0.05
    report = zeroflax.memory_report(engine, state, batch)
    assert report.host_at_rest == host and report.device_at_rest == device
    assert "host at rest" in str(report)
    comm = zeroflax.comm_report(engine, state, batch)
    for measured, theory in ((comm.host_to_device, comm.host_to_device_theory),
                             (comm.device_to_host, comm.device_to_host_theory)):
        assert theory > 0 and 1 / 1.1 <= measured / theory <= 1.1
    if stream:  # the stream: every layer's shard twice per micro-batch, far above the compute copy's
        assert comm.host_to_device > 4 * comm.device_to_host / 2
    assert 0.95 <= comm.ratio <= 1.05  # the data axis still at ZeRO's volume (compute copy gathered in bf16)


@pytest.mark.parametrize("start,predict,clip", [(0, "none", 0.0), (2, "none", 0.0), (0, "extrapolate", 0.0),
                                                (2, "linear", 0.0), (2, "linear", 0.05)])
def test_delayed_update_applies_the_previous_gradient(start, predict, clip):
    """DPU: from step `start` on, step t's gradient is computed with parameters that do not include step
    t-1's update (one step stale) and is applied by step t+1; step `start` applies nothing, the steps
    before it update at once. 'extrapolate' takes the gradient at the parameters plus the last update;
    'linear' at the parameters plus the next update to first order in the gradient just computed (U(0) +
    dU/dg g, the slope in bf16, g clipped as the update will clip it)."""
    boxed, loss, batches = make_case("mlp", 0)
    optimizer = adamw(weight_decay=0.1)
    offload = OffloadOptimizerConfig("cpu", delayed_update=True, delayed_update_start=start,
                                     delayed_update_prediction=predict)
    engine, state = zeroflax.initialize(loss, boxed, optimizer, base_config(1, offload_optimizer=offload, grad_clip=clip))
    for batch in batches:
        state, _ = engine.step(state, batch)
    params, compute = jax.device_get((engine.model_params(state), state.compute_params))
    clipped = lambda g: optax.clip_by_global_norm(clip).update(g, None)[0] if clip else g  # noqa: E731

    def apply(grads, reference, state):
        updates, state = optimizer.update(clipped(grads), state, reference)
        return optax.apply_updates(reference, updates), state

    def delayed_loop(slope_counts=True):
        reference = zeroflax.unbox(boxed)[0]
        state, pending, guess = optimizer.init(reference), None, None
        for step, batch in enumerate(batches):
            at = reference if guess is None else guess
            grads = jax.grad(loss)(at, batch, None)
            if step < start:
                reference, state = apply(grads, reference, state)
                continue
            before, applied = reference, None
            if step > start:
                reference, state = apply(pending, reference, state)
                applied = pending
            pending = grads
            if predict == "extrapolate":
                guess = jax.tree.map(lambda new, old: new + (new - old), reference, before)
            elif predict == "linear":  # the secant of the next update through +-(the gradient just applied)
                probe = clipped(applied) if applied is not None else jax.tree.map(jnp.zeros_like, grads)
                up = optimizer.update(probe, state, reference)[0]
                down = optimizer.update(jax.tree.map(jnp.negative, probe), state, reference)[0]
                slope = jax.tree.map(lambda a, b, h: jnp.where(h != 0, (a - b) / jnp.where(h != 0, 2 * h, 1), 0),
                                     up, down, probe)
                slope = slope if slope_counts else jax.tree.map(jnp.zeros_like, slope)
                guess = jax.tree.map(lambda p, a, b, d, g: p + (a + b) / 2 + d.astype(jnp.bfloat16).astype(jnp.float32) * g,
                                     reference, up, down, slope, clipped(grads))
        return reference, guess

    reference, guess = delayed_loop()
    at_most(relative_error(params, reference), 1e-5, "delayed update against its single-device loop")
    if predict != "none":  # the device's copy is the prediction (the next gradient is taken there)
        at_most(relative_error(compute, guess), 1e-5, "the device's predicted copy against the loop's")
    if predict == "linear":  # the slope's bf16 bytes come to the device too, as comm_report's theory says
        comm = zeroflax.comm_report(engine, state, batches[0])
        assert comm.host_to_device_theory > 0 and 1 / 1.1 <= comm.host_to_device / comm.host_to_device_theory <= 1.1
    if predict == "linear":  # the slope's part counts: without it the copy is far away (13% on a bias)
        unsloped = delayed_loop(slope_counts=False)[1]
        at_least(max(float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
                     for a, b in zip(jax.tree.leaves(compute), jax.tree.leaves(unsloped))), 1e-2,
                 "the slope's part of the predicted copy")
    exact = reference_run(loss, zeroflax.unbox(boxed)[0], optimizer, batches)  # the undelayed run differs
    at_least(max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(exact))),
             1e-4, "the delayed run's distance from the undelayed one")


@pytest.mark.parametrize("prediction", ["linear", "extrapolate"])
def test_a_predicted_run_resumes_bitwise(tmp_path, prediction):
    """The predicted compute copy cannot be remade from the master weights, so checkpoints hold it: a run
    saved after 3 steps and restored in a new engine goes on exactly as if uninterrupted. A checkpoint
    without it (written without the prediction) restores with the copy remade, and says so."""
    boxed, loss, batches = make_case("mlp", 0)
    offload = OffloadOptimizerConfig("cpu", delayed_update=True, delayed_update_start=1,
                                     delayed_update_prediction=prediction)
    config = base_config(2, offload_optimizer=offload)
    engine, state = zeroflax.initialize(loss, boxed, adamw(), config)
    for batch in batches[:3]:
        state, _ = engine.step(state, batch)
    checkpoints = Checkpointer(str(tmp_path / "run"), every=1, asynchronous=False)
    checkpoints.save(3, state, {}, {}, view=engine.model_order)
    checkpoints.close()
    for batch in batches[3:]:
        state, _ = engine.step(state, batch)

    again, fresh = zeroflax.initialize(loss, boxed, adamw(), config)
    restorer = Checkpointer(str(tmp_path / "run"))
    restored, _, _ = restorer.restore(None, fresh, again.state_shardings, compute_copy=True)
    assert restorer.notes == [] and restored.compute_params is not None
    restored = again.storage_order(restored)
    for batch in batches[3:]:
        restored, _ = again.step(restored, batch)
    for a, b in zip(jax.tree.leaves(jax.device_get(state)), jax.tree.leaves(jax.device_get(restored))):
        np.testing.assert_array_equal(a, b)

    plain = OffloadOptimizerConfig("cpu", delayed_update=True, delayed_update_start=1, delayed_update_prediction="none")
    unpredicted, unpredicted_state = zeroflax.initialize(loss, boxed, adamw(), base_config(2, offload_optimizer=plain))
    checkpoints = Checkpointer(str(tmp_path / "plain"), every=1, asynchronous=False)
    checkpoints.save(0, unpredicted_state, {}, {}, view=unpredicted.model_order)
    checkpoints.close()
    restorer = Checkpointer(str(tmp_path / "plain"))
    restored, _, _ = restorer.restore(None, fresh, again.state_shardings, compute_copy=True)
    assert restored.compute_params is None and "compute copy was remade" in restorer.notes[0]


def test_checkpoint_restores_across_offload(tmp_path):
    """Saved with offload (both kinds), restored without it, saved again and restored with it: the state is
    the same bit for bit each time, and so is the next step."""
    with_offload = dict(offload_optimizer=HOST, offload_param=PARAM)
    offloaded, state, batch, _, _ = gpt_engine(3, "fp32", **with_offload)
    plain, plain_state, _, _, _ = gpt_engine(3, "fp32")
    state, _ = offloaded.step(state, batch)

    def round_trip(name, engine, state, other, template):
        checkpoints = Checkpointer(str(tmp_path / name), every=1, asynchronous=False)
        checkpoints.save(1, state, {"epoch": 0}, {})
        checkpoints.close()
        restored, _, _ = Checkpointer(str(tmp_path / name)).restore(None, template, other.state_shardings)
        restored = other.storage_order(restored)
        for a, b in zip(jax.tree.leaves(jax.device_get((restored.params, restored.opt_state))),
                        jax.tree.leaves(jax.device_get((state.params, state.opt_state)))):
            np.testing.assert_array_equal(a, b)
        return restored

    restored = round_trip("to-plain", offloaded, state, plain, plain_state)
    state, metrics = offloaded.step(state, batch)
    restored, restored_metrics = plain.step(restored, batch)
    assert float(metrics["loss"]) == float(restored_metrics["loss"])
    back = round_trip("to-offload", plain, restored, offloaded, state)
    for a, b in zip(jax.tree.leaves(jax.device_get(back.compute_params)), jax.tree.leaves(jax.device_get(restored.params))):
        np.testing.assert_array_equal(a, b)  # the compute copy is remade from the restored master


def test_activation_offload_policy_moves_saved_matmuls_to_the_host():
    """On the scanned layers of the GPT (zeroflax.scan_layers)."""
    boxed, loss, batches = make_case("gpt", 0)
    batches = batches[:2]
    runs = {}
    for remat in ("dots_no_batch", "offload_dots_no_batch"):
        engine, state = zeroflax.initialize(loss, boxed, adamw(), base_config(2, remat=remat))
        batch = engine.put_batch(batches[0])
        jaxpr = jax.make_jaxpr(engine.step_function(batch))(state, batch).jaxpr
        runs[remat] = host_transfers(jaxpr), engine_run(loss, boxed, adamw(), batches, base_config(2, remat=remat))[0]
    (to_device, to_host), params = runs["offload_dots_no_batch"]
    assert to_device > 0 and to_device == to_host  # what goes to the host comes back for the backward pass
    assert runs["dots_no_batch"][0] == (0.0, 0.0)
    runs_agree(params, runs["dots_no_batch"][1], 1e-6, "offloaded activations against kept ones")


def test_offload_full_keeps_each_layers_input_on_the_host():
    """DeepSpeed's cpu_checkpointing: remat 'full', with the scanned layers' inputs (and the stack's output,
    from which the head is recomputed) in host memory between the forward and the backward pass."""
    boxed, loss, batches = make_case("gpt", 0)
    config = base_config(2, remat="offload_full")
    engine, state = zeroflax.initialize(loss, boxed, adamw(weight_decay=0.1), config)
    batch = engine.put_batch(batches[0])
    to_device, to_host = host_transfers(jax.make_jaxpr(engine.step_function(batch))(state, batch).jaxpr)
    layers, carry = 2, config.micro_batch_size * 16 * 32 * 4  # one device's [micro-batch, seq, d_model] float32
    assert to_host == to_device == config.grad_accum_steps * (layers + 1) * carry
    params, _ = engine_run(loss, boxed, adamw(weight_decay=0.1), batches, config)
    runs_agree(params, baseline("gpt", 2), 1e-6, "offload_full against remat 'full'")
    for model, stage in (("mlp", 1), ("conv", 3)):  # Linen modules run as gather groups: their inputs move too
        boxed, loss, batches = make_case(model, 0)
        engine, state = zeroflax.initialize(loss, boxed, adamw(), base_config(stage, remat="offload_full"))
        batch = engine.put_batch(batches[0])
        to_device, to_host = host_transfers(jax.make_jaxpr(engine.step_function(batch))(state, batch).jaxpr)
        assert to_host == to_device > 0, model


def test_an_optimizer_that_cannot_run_on_the_host_is_a_config_error():
    boxed, loss, batches = make_case("mlp", 0)
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    engine, state = zeroflax.initialize(loss, boxed, clipped, base_config(2, offload_optimizer=HOST))
    with pytest.raises(ConfigError, match="OffloadOptimizerConfig.update"):
        engine.step(state, batches[0])
    params, _ = engine_run(loss, boxed, clipped, batches[:2], base_config(2, offload_optimizer=DEVICE))
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))


@pytest.mark.parametrize("changes,key", [
    (dict(zero_stage=0, offload_optimizer=HOST), "OffloadOptimizerConfig.device"),
    (dict(zero_stage=2, offload_optimizer=HOST, offload_param=PARAM), "OffloadParamConfig.device"),
    (dict(zero_stage=3, offload_param=PARAM), "OffloadParamConfig.device"),
    (dict(zero_stage=3, offload_optimizer=HOST, offload_param=OffloadParamConfig("cpu", pin_memory=False)),
     "OffloadParamConfig.pin_memory"),
    (dict(zero_stage=3, offload_optimizer=OffloadOptimizerConfig("cpu", delayed_update=True), offload_param=PARAM),
     "OffloadOptimizerConfig.delayed_update_prediction"),
])
def test_invalid_offload_combinations_name_the_key(changes, key):
    with pytest.raises(ConfigError, match=key):
        Config(**changes)


@pytest.mark.parametrize("kwargs,key", [
    (dict(device="nvme"), "OffloadOptimizerConfig.nvme_path"),  # tests/test_nvme.py has the rest of 'nvme'
    (dict(device="disk"), "OffloadOptimizerConfig.device"),
    (dict(device="cpu", update="gpu"), "OffloadOptimizerConfig.update"),
    (dict(device="cpu", update="device", delayed_update=True), "OffloadOptimizerConfig.delayed_update"),
    (dict(delayed_update=True), "OffloadOptimizerConfig.device"),
    (dict(device="cpu", delayed_update=True, delayed_update_start=-1), "OffloadOptimizerConfig.delayed_update_start"),
    (dict(device="cpu", delayed_update=True, delayed_update_prediction=1), "OffloadOptimizerConfig.delayed_update_prediction"),
    (dict(device="cpu", delayed_update=True, delayed_update_prediction=True),
     "OffloadOptimizerConfig.delayed_update_prediction"),
])
def test_invalid_offload_settings_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        OffloadOptimizerConfig(**kwargs)
