"""The main job's command line: exact resume, restore elsewhere, multi-process, crash safety, bad input."""
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

import zeroflax
from cli_helpers import ROOT, TINY, env_without_device_flags, losses, tiny_bindings, zeroflax as run_cli
from tolerance import at_most
from zeroflax.checkpoint import Checkpointer, restore_params
from zeroflax.models.gpt import GPT, GPTConfig, next_token_loss


@pytest.mark.slow  # multi-process or end-to-end: `make test-slow` (and CI)
def test_resume_is_bitwise_exact_and_two_processes_match_one(tmp_path):
    """Stopped at step 3 and resumed, the main job equals the uninterrupted run bitwise; two processes of
    4 devices (the same 6-step schedule, stopped at 3) match it to float32 rounding; the checkpoint
    generates on one plain CPU device (the sparse job's: test_generate_runs_on_one_cpu_device)."""
    whole, parts, multi = tmp_path / "whole", tmp_path / "parts", tmp_path / "multi"
    result = run_cli("train", "--gin_file", TINY, *tiny_bindings(whole, steps=6), "--no_progress")
    assert result.returncode == 0, result.stderr
    stopped = run_cli("train", "--gin_file", TINY, *tiny_bindings(parts, steps=6), "--stop_at", "3", "--no_progress")
    assert stopped.returncode == 0, stopped.stderr
    resumed = run_cli("train", "--gin_file", TINY, *tiny_bindings(parts, steps=6), "--resume", "--no_progress")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from step 3" in resumed.stdout
    uninterrupted, interrupted = losses(whole), losses(parts)
    assert sorted(uninterrupted) == sorted(interrupted) == list(range(1, 7))
    assert interrupted == uninterrupted  # bitwise: the JSON holds the exact float32 values

    two = run_cli("launch", "--nproc", "2", "--devices_per_process", "4", "--", sys.executable, "-m", "zeroflax",
                  "train", "--gin_file", TINY, *tiny_bindings(multi, steps=6), "--stop_at", "3", "--no_progress",
                  timeout=400)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "in 2 process(es)" in two.stdout
    _match_to_rounding(losses(multi), uninterrupted, [1, 2, 3])

    generated = run_cli("generate", "--checkpoint", str(whole), "--prompt", "The ", "--length", "20")
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.startswith("The ") and len(generated.stdout) >= 20


def _match_to_rounding(multi, single, steps):
    assert sorted(multi) == steps
    for step in steps:
        at_most(abs(multi[step] - single[step]) / abs(single[step]), 1e-5, "2 processes' loss against 1's",
                f"(step {step})")


def test_checkpoint_restores_at_another_stage_and_device_count(tmp_path):
    model = GPT(GPTConfig(num_layers=2, d_model=32, num_heads=2, max_len=16))
    batch = {"tokens": np.random.default_rng(3).integers(0, 256, (16, 17)).astype(np.int32)}
    init = lambda rng, b: model.init(rng, b["tokens"][:, :-1])["params"]
    optimizer = optax.adamw(1e-3)
    config3 = zeroflax.Config(zero_stage=3, micro_batch_size=2, persistence_threshold=0)
    engine, state = zeroflax.initialize(next_token_loss(model), init, optimizer, config3, sample_batch=batch)
    state, _ = engine.step(state, batch)
    assert any("data" in s.spec for s in jax.tree.leaves(engine.plan.params))
    saved = jax.device_get(engine.model_params(state))
    checkpoints = Checkpointer(str(tmp_path / "ckpt"), every=1)
    checkpoints.save(1, state, {"epoch": 0}, {"model": model.config.to_dict()})
    checkpoints.close()

    # ZeRO-1 on 4 of the 8 devices.
    config1 = zeroflax.Config(zero_stage=1, micro_batch_size=4, persistence_threshold=0)
    engine1, state1 = zeroflax.initialize(next_token_loss(model), init, optimizer, config1, sample_batch=batch,
                                          devices=jax.devices()[:4], rng=jax.random.PRNGKey(7))
    state1, data_state, meta = Checkpointer(str(tmp_path / "ckpt")).restore(None, state1, engine1.state_shardings)
    assert engine1.mesh.size == 4 and data_state == {"epoch": 0}
    for a, b in zip(jax.tree.leaves(jax.device_get(state1.params)), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(a, b)
    state1, metrics = engine1.step(state1, batch)  # and training goes on there
    assert np.isfinite(float(metrics["loss"]))

    # One plain CPU device, in a fresh process without simulated devices (as `zeroflax generate` runs).
    script = (
        "import sys, jax, numpy as np; from zeroflax.checkpoint import restore_params; import zeroflax;"
        "from zeroflax.models.gpt import GPT, GPTConfig;"
        "m = GPT(GPTConfig(num_layers=2, d_model=32, num_heads=2, max_len=16));"
        "a = zeroflax.unbox(jax.eval_shape(lambda: m.init(jax.random.PRNGKey(0), jax.numpy.zeros((1, 4), 'int32'))['params']))[0];"
        "p = restore_params(sys.argv[1], a, jax.sharding.SingleDeviceSharding(jax.devices('cpu')[0]));"
        "assert jax.device_count() == 1;"
        "np.savez(sys.argv[2], **{k: np.asarray(v) for k, v in p.items()})")
    out = tmp_path / "one_device.npz"
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ckpt"), str(out)], capture_output=True,
                            text=True, env=env_without_device_flags(), timeout=120)
    assert result.returncode == 0, result.stderr
    one_device = dict(np.load(out))
    for name, value in saved.items():
        np.testing.assert_array_equal(one_device[name], value)


SPARSE = {"GPTConfig.attention": "'sparse'", "GPTConfig.sparsity": "@BigBirdSparsityConfig()",
          "BigBirdSparsityConfig.num_heads": 2, "BigBirdSparsityConfig.block": 8,
          "BigBirdSparsityConfig.attention": "'unidirectional'"}


def test_generate_runs_on_one_cpu_device(tmp_path):
    """Sparse attention's main job, with the progress bar and TensorBoard on (test_resume_is_bitwise_exact
    generates from the dense one)."""
    workdir = tmp_path / "run"
    extra = dict(SPARSE, **{"TrainConfig.tensorboard": True})
    result = run_cli("train", "--gin_file", TINY, *tiny_bindings(workdir, steps=2, **extra))
    assert result.returncode == 0, result.stderr
    assert "step/s" in result.stderr or "s/step" in result.stderr  # the progress bar
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(workdir / "tensorboard"))
    assert sorted(losses(workdir)) == [1, 2]
    generated = run_cli("generate", "--checkpoint", str(workdir), "--prompt", "The ", "--length", "20")
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.startswith("The ") and len(generated.stdout) >= 20


THREE_D = os.path.join(ROOT, "experiments", "gpt_3d.gin")


@pytest.mark.slow  # multi-process or end-to-end: `make test-slow` (and CI)
def test_3d_main_job_resumes_exactly_restores_elsewhere_and_runs_in_two_processes(tmp_path):
    """gpt_3d.gin (pipe 2 x data 2 x tensor 2): stopped and resumed it equals the uninterrupted run
    bitwise; two processes of 4 devices, each holding one pipeline stage (pipe is the outermost mesh
    axis, so both feed the whole batch), match it to float32 rounding; its checkpoint resumes on data 8
    (no pipeline, no tensor slicing) and generates on one plain CPU device."""
    whole, parts, multi = tmp_path / "whole", tmp_path / "parts", tmp_path / "multi"
    result = run_cli("train", "--gin_file", THREE_D, *tiny_bindings(whole, steps=4), "--no_progress")
    assert result.returncode == 0, result.stderr
    assert "'pipe': 2, 'data': 2, 'tensor': 2" in result.stdout and "pipeline bubble" in result.stdout
    stopped = run_cli("train", "--gin_file", THREE_D, *tiny_bindings(parts, steps=4), "--stop_at", "2", "--no_progress")
    assert stopped.returncode == 0, stopped.stderr
    resumed = run_cli("train", "--gin_file", THREE_D, *tiny_bindings(parts, steps=4), "--resume", "--no_progress")
    assert resumed.returncode == 0, resumed.stderr
    assert losses(parts) == losses(whole) and sorted(losses(whole)) == [1, 2, 3, 4]

    two = run_cli("launch", "--nproc", "2", "--devices_per_process", "4", "--", sys.executable, "-m", "zeroflax",
                  "train", "--gin_file", THREE_D, *tiny_bindings(multi, steps=4), "--stop_at", "3", "--no_progress",
                  timeout=400)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "in 2 process(es)" in two.stdout
    _match_to_rounding(losses(multi), losses(whole), [1, 2, 3])

    flat = {"MeshConfig.axes": "{'data': -1, 'tensor': 1}", "Config.grad_accum_steps": 1}  # same 8-row batch
    elsewhere = run_cli("train", "--gin_file", THREE_D, *tiny_bindings(parts, steps=6, **flat), "--resume",
                        "--no_progress")
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert "resumed from step 4" in elsewhere.stdout and "'data': 8" in elsewhere.stdout
    assert sorted(losses(parts)) == [1, 2, 3, 4, 5, 6] and all(np.isfinite(list(losses(parts).values())))

    generated = run_cli("generate", "--checkpoint", str(whole), "--prompt", "The ", "--length", "10")
    assert generated.returncode == 0, generated.stderr
    assert generated.stdout.startswith("The ")


def _complete_steps(directory):
    if not os.path.isdir(directory):
        return [], []
    names = os.listdir(directory)
    return sorted(int(n) for n in names if n.isdigit()), [n for n in names if "tmp" in n]


def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path):
    workdir = tmp_path / "run"
    checkpoints = workdir / "checkpoints"
    command = [sys.executable, "-m", "zeroflax", "train", "--gin_file", TINY,
               *tiny_bindings(workdir, steps=400, **{"TrainConfig.checkpoint_every": 1,
                                                      "TrainConfig.keep_checkpoints": 50}), "--no_progress"]
    killed_mid_save = False
    for attempt in range(20):  # kill until the kill lands while a save is unfinished
        process = subprocess.Popen(command + (["--resume"] if attempt else []), cwd=ROOT, env=env_without_device_flags(),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline and process.poll() is None:
            steps, temporary = _complete_steps(checkpoints)
            if len(steps) >= 2 + attempt and temporary:
                process.send_signal(signal.SIGKILL)
                killed_mid_save = True
                break
            time.sleep(0.005)
        process.kill()
        process.wait()
        if killed_mid_save:
            break
    assert killed_mid_save, "never caught a save in progress"
    steps, temporary = _complete_steps(checkpoints)
    newest = steps[-1]
    resumed = run_cli("train", "--gin_file", TINY,
                      *tiny_bindings(workdir, steps=newest + 1, **{"TrainConfig.checkpoint_every": 1,
                                                                    "TrainConfig.keep_checkpoints": 50}),
                      "--resume", "--no_progress")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from step {newest}" in resumed.stdout


def _one_line_error(result, expected):
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("zeroflax: error:")]
    assert len(errors) == 1 and expected in errors[0], result.stderr[-2000:]


def test_bad_input_gives_one_line_errors(tmp_path):
    _one_line_error(run_cli("train", "--gin_file", str(tmp_path / "missing.gin")), "--gin_file")
    _one_line_error(run_cli("train", "--gin_file", TINY, "--gin_param", "Config.zero_stag = 2"), "zero_stag")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _one_line_error(run_cli("train", "--gin_file", TINY, *tiny_bindings(tmp_path / "e"),
                            "--gin_param", f"TrainConfig.data = '{empty}'"), str(empty))
    _one_line_error(run_cli("train", "--gin_file", TINY, *tiny_bindings(tmp_path / "m"),
                            "--gin_param", "MeshConfig.axes = {'data': 16, 'tensor': 1}"), "MeshConfig.axes")
    corrupt = tmp_path / "corrupt" / "checkpoints" / "4"
    corrupt.mkdir(parents=True)
    (corrupt / "params").write_text("not a checkpoint")
    _one_line_error(run_cli("generate", "--checkpoint", str(tmp_path / "corrupt")), "corrupt")
    _one_line_error(run_cli("train", "--gin_file", TINY, *tiny_bindings(tmp_path / "corrupt"), "--resume"),
                    "checkpoint")
