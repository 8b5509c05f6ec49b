"""safetensors export (zeroflax.export, `zeroflax export`) and starting a run from the file (TrainConfig.init_from)."""
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file, save_file

import zeroflax
from cli_helpers import env_without_device_flags, zeroflax as run_cli
from zeroflax.checkpoint import Checkpointer, CheckpointError
from zeroflax.config import ConfigError
from zeroflax.export import (export_safetensors, gpt_abstract_params, initialize_from_safetensors, load_safetensors,
                             to_tensors)
from zeroflax.models.gpt import GPT, GPTConfig, next_token_loss
from zeroflax.train import TrainConfig
from tolerance import at_least, at_most

STACKED = ["b_in", "b_out", "ln1_bias", "ln1_scale", "ln2_bias", "ln2_scale", "w_in", "w_o", "w_out", "w_qkv"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A stage-3 checkpoint from 8 devices after one step, with every parameter really partitioned
    (persistence_threshold=0), written as `zeroflax train` writes it (workdir/checkpoints), and its fp32 export."""
    workdir = tmp_path_factory.mktemp("run")
    model = GPT(GPTConfig(num_layers=2, d_model=32, num_heads=2, max_len=16))
    batch = {"tokens": np.random.default_rng(3).integers(0, 256, (16, 17)).astype(np.int32)}
    init = lambda rng, b: model.init(rng, b["tokens"][:, :-1])["params"]
    config = zeroflax.Config(zero_stage=3, micro_batch_size=2, persistence_threshold=0)
    engine, state = zeroflax.initialize(next_token_loss(model), init, optax.adamw(1e-3), config, sample_batch=batch)
    state, _ = engine.step(state, batch)
    assert engine.mesh.size == 8 and all("data" in s.spec for s in jax.tree.leaves(engine.plan.params))
    checkpoints = Checkpointer(str(workdir / "checkpoints"), every=1)
    checkpoints.save(1, state, {"epoch": 0}, {"model": model.config.to_dict()})
    checkpoints.close()
    out = str(workdir / "fp32.safetensors")
    summary = export_safetensors(str(workdir), out)
    return dict(workdir=workdir, model=model, batch=batch, init=init, engine=engine, state=state,
                params=jax.device_get(engine.model_params(state)), file=out, summary=summary)


def test_export_equals_the_consolidated_parameters_bitwise(run):
    tensors, params = load_file(run["file"]), run["params"]
    expected = {}
    for name, value in params.items():  # the naming scheme, spelled out independently of to_tensors
        if name in STACKED:
            expected.update({f"layers.{i}.{name}": value[i] for i in range(value.shape[0])})
        else:
            expected[name] = value
    assert sorted(tensors) == sorted(expected) and "layers.1.w_qkv" in tensors
    for name, value in expected.items():
        assert tensors[name].dtype == np.float32
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)
    assert run["summary"]["step"] == 1 and run["summary"]["bytes"] == sum(v.nbytes for v in expected.values())
    from safetensors import safe_open
    with safe_open(run["file"], "np") as f:
        meta = f.metadata()
    assert json.loads(meta["zeroflax.model"]) == run["model"].config.to_dict()
    assert meta["zeroflax.step"] == "1" and meta["zeroflax.version"] == zeroflax.__version__
    assert sorted(json.loads(meta["zeroflax.stacked"])) == STACKED
    # and load_safetensors re-stacks them into the tree
    loaded = load_safetensors(run["file"], gpt_abstract_params(run["model"].config)[0])
    for name, value in params.items():
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)


def test_one_device_engine_from_the_file_has_the_8_device_loss(run):
    """The loss of the same parameters on the same batch: 8 devices under ZeRO-3 vs one device. They differ
    only by the reduction order of fp32 sums (measured 0 to ~1e-7 relative); 1e-6 is a 10x margin, while
    the fresh engine's own initialisation (another rng) is far off, so a file that changed nothing fails."""
    engine, state = run["engine"], run["state"]
    loss8 = float(engine.evaluate(state, run["batch"]))
    config = zeroflax.Config(zero_stage=0, micro_batch_size=16)
    engine1, state1 = zeroflax.initialize(next_token_loss(run["model"]), run["init"], optax.adamw(1e-3), config,
                                          sample_batch=run["batch"], devices=jax.devices()[:1],
                                          rng=jax.random.PRNGKey(7))
    fresh = float(engine1.evaluate(state1, run["batch"]))
    state1 = initialize_from_safetensors(engine1, state1, run["file"])
    loss1 = float(engine1.evaluate(state1, run["batch"]))
    print(f"loss 8 devices {loss8!r}, 1 device from the file {loss1!r}, relative {abs(loss1 - loss8) / loss8:.2e}")
    assert engine1.mesh.size == 1
    at_most(abs(loss1 - loss8) / abs(loss8), 1e-6, "the exported parameters' loss on 1 device against 8's")
    at_least(abs(fresh - loss8) / abs(loss8), 1e-4, "a fresh initialisation's loss against the trained one's")
    for name, value in run["params"].items():
        np.testing.assert_array_equal(np.asarray(state1.params[name]), value, err_msg=name)
    # the fresh optimizer state (Adam's zero moments) is kept, not the checkpoint's
    assert all(not np.any(np.asarray(x)) for x in jax.tree.leaves(state1.opt_state[0].mu))


def test_a_reader_with_only_numpy_and_safetensors_loads_it(run):
    script = (
        "import sys, json; from safetensors.numpy import load_file; t = load_file(sys.argv[1]);"
        "expected = json.loads(sys.argv[2]);"
        "assert {k: list(v.shape) for k, v in t.items()} == expected, 'names or shapes differ';"
        "assert all(str(v.dtype) == 'float32' for v in t.values());"
        "assert 'jax' not in sys.modules and 'zeroflax' not in sys.modules, 'imported jax or zeroflax';"
        "print(len(t))")
    expected = {k: list(shape) for k, (shape, _) in run["summary"]["tensors"].items()}
    result = subprocess.run([sys.executable, "-c", script, run["file"], json.dumps(expected)], capture_output=True,
                            text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})  # no PYTHONPATH: zeroflax absent
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) == len(expected) == 4 + 2 * len(STACKED)


def test_bf16_export_holds_the_rounded_parameters(run, tmp_path):
    out = str(tmp_path / "bf16.safetensors")
    export_safetensors(str(run["workdir"] / "checkpoints"), out, dtype="bf16")  # the checkpoints/ directory itself
    tensors = load_file(out)
    assert {v.dtype for v in tensors.values()} == {np.dtype(ml_dtypes.bfloat16)}
    for name, value in run["params"].items():
        rounded = np.asarray(jnp.asarray(value).astype(jnp.bfloat16))  # XLA's rounding, not the exporter's numpy
        got = np.stack([tensors[f"layers.{i}.{name}"] for i in range(2)]) if name in STACKED else tensors[name]
        np.testing.assert_array_equal(got.view(np.uint16), rounded.view(np.uint16), err_msg=name)
    assert not all(np.array_equal(np.asarray(v, np.float32), run["params"][k]) for k, v in tensors.items()
                   if k in run["params"])  # rounding changed something: the comparison above is not fp32's
    abstract = gpt_abstract_params(run["model"].config)[0]
    with pytest.raises(CheckpointError, match="has dtype bfloat16, the model expects float32"):
        load_safetensors(out, abstract)
    widened = load_safetensors(out, abstract, cast=True)
    assert widened["w_qkv"].dtype == np.float32
    with pytest.raises(ConfigError, match="--dtype"):
        export_safetensors(str(run["workdir"]), str(tmp_path / "x.safetensors"), dtype="bf8")


def test_load_errors_name_the_tensor(run, tmp_path):
    abstract = gpt_abstract_params(run["model"].config)[0]
    tensors = to_tensors(run["params"], STACKED)
    metadata = {"zeroflax.stacked": json.dumps(STACKED)}
    cases = {
        "missing": ({k: v for k, v in tensors.items() if k != "layers.1.w_o"}, "tensor 'layers.1.w_o' is missing"),
        "shape": (dict(tensors, embed=tensors["embed"][:100]), "tensor 'embed' has shape (100, 32), the model expects "
                                                               "(256, 32)"),
        "extra": (dict(tensors, **{"layers.2.w_o": tensors["layers.1.w_o"]}), "tensor 'layers.2.w_o' is not a parameter"),
    }
    for case, (bad, message) in cases.items():
        path = str(tmp_path / f"{case}.safetensors")
        save_file(bad, path, metadata=metadata)
        with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_safetensors(path, abstract)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_safetensors(str(tmp_path / "absent.safetensors"), abstract)


def test_train_config_init_from_is_checked():
    with pytest.raises(ConfigError, match="TrainConfig.init_from"):
        TrainConfig(init_from="/nonexistent/model.safetensors")


def test_cli_export_and_a_bad_input(run, tmp_path):
    result = run_cli("export", "--checkpoint", str(run["workdir"]), "--format", "safetensors", "--dtype", "fp16")
    assert result.returncode == 0, result.stderr
    out = run["workdir"] / "model_step1.safetensors"  # the default: beside checkpoints/
    assert f"wrote {out}" in result.stdout and "2 layers" in result.stdout
    tensors = load_file(str(out))
    for name, value in run["params"].items():
        got = np.stack([tensors[f"layers.{i}.{name}"] for i in range(2)]) if name in STACKED else tensors[name]
        np.testing.assert_array_equal(got, value.astype(np.float16), err_msg=name)
    bad = run_cli("export", "--checkpoint", str(tmp_path / "missing"))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    errors = [line for line in bad.stderr.splitlines() if line.startswith("zeroflax: error:")]
    assert len(errors) == 1 and "does not exist" in errors[0], bad.stderr


def test_main_job_starts_from_init_from_and_refuses_an_ambiguous_resume(run, tmp_path):
    """train() with TrainConfig.init_from: its first validation is the exported parameters' (evaluated on the
    same validation batches by the 8-device engine that wrote them: 1e-6 relative, as above); resuming that
    run with another file is refused (which parameters would be meant?)."""
    from zeroflax.data import load_tokens, train_val_split
    from zeroflax.train import train, validation_bits_per_byte
    tc = TrainConfig(workdir=str(tmp_path / "job"), seq_len=16, steps=2, warmup_steps=1, log_every=1, eval_batches=1,
                     checkpoint_every=1, sample_length=0, tensorboard=False, init_from=run["file"])
    config = zeroflax.Config(zero_stage=3, micro_batch_size=2, persistence_threshold=0)
    summary = train(tc, config, run["model"].config, stop_at=1, progress=False)
    tokens = load_tokens(tc.data)
    _, val_tokens = train_val_split(tokens, tc.val_fraction, min_tokens=tc.seq_len + 1)
    expected = validation_bits_per_byte(run["engine"], run["state"], val_tokens, tc)
    print(f"init_from validation {summary['val_bpb_before']!r} bits per byte, the exported parameters' {expected!r}")
    at_most(abs(summary["val_bpb_before"] - expected) / expected, 1e-6,
            "init_from's validation bits per byte against the exported parameters'")
    other = tmp_path / "other.safetensors"
    other.write_bytes(open(run["file"], "rb").read())
    with pytest.raises(ConfigError, match="TrainConfig.init_from: the run in .* started from"):
        train(TrainConfig(**{**tc.__dict__, "init_from": str(other)}), config, run["model"].config, resume=True,
              progress=False)
