"""Faults and bad states: one run per workdir, earlier runs kept unless replaced on purpose, and a
non-finite step never applied (Config.nonfinite)."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest

import zeroflax
from cli_helpers import ROOT, TINY, tiny_bindings, zeroflax as run_cli
from models import MLP, linen_case
from zeroflax.config import ConfigError
from zeroflax.distributed import launched_processes
from zeroflax.workdir import WorkdirLock, earlier_run, prepare, truncate_metrics


def test_a_workdir_holds_one_run_and_a_killed_holder_frees_it(tmp_path):
    workdir = str(tmp_path / "run")
    with WorkdirLock(workdir):
        with pytest.raises(ConfigError, match=r"TrainConfig.workdir: .* is in use by another zeroflax run \(pid \d+"):
            WorkdirLock(workdir)
    WorkdirLock(workdir).release()  # released on exit from the block
    # A holder killed with SIGKILL leaves no stale lock: the kernel drops it with the process.
    holder = subprocess.Popen([sys.executable, "-c", f"from zeroflax.workdir import WorkdirLock; import time; "
                               f"lock = WorkdirLock({workdir!r}); print('held', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=f"pid {holder.pid} on"):
            WorkdirLock(workdir)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    WorkdirLock(workdir).release()


def test_an_earlier_run_is_resumed_or_overwritten_only_on_purpose(tmp_path):
    workdir = tmp_path / "run"
    (workdir / "checkpoints" / "3").mkdir(parents=True)
    rows = [{"step": 0, "val_bits_per_byte": 8.0}] + [{"step": s, "loss": 5.0 - s} for s in range(1, 6)]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "lo')
    with pytest.raises(ConfigError, match=r"holds an earlier run \(checkpoints, metrics.jsonl\).*--resume.*--overwrite"):
        prepare(str(workdir), resume=False, overwrite=False, is_main=True)
    prepare(str(workdir), resume=True, overwrite=False, is_main=True)  # resuming leaves it all in place
    assert earlier_run(str(workdir)) == ["checkpoints", "metrics.jsonl"]
    # On resume from step 3, the rows after it (and a crash's half-written line) go: they are run again.
    assert truncate_metrics(str(workdir), 3) == 3
    kept = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept] == [0, 1, 2, 3] and kept == rows[:4]
    prepare(str(workdir), resume=False, overwrite=True, is_main=True)
    assert earlier_run(str(workdir)) == [] and os.path.isdir(workdir)


def test_cli_refuses_a_workdir_in_use_and_resume_with_overwrite(tmp_path):
    workdir = tmp_path / "run"
    with WorkdirLock(str(workdir)):
        busy = run_cli("train", "--gin_file", TINY, *tiny_bindings(workdir, steps=2), "--no_progress")
    assert busy.returncode == 2 and "Traceback" not in busy.stderr, busy.stderr[-2000:]
    assert f"zeroflax: error: TrainConfig.workdir: {workdir} is in use by another zeroflax run (pid {os.getpid()}" \
        in busy.stderr
    both = run_cli("train", "--gin_file", TINY, *tiny_bindings(workdir, steps=2), "--resume", "--overwrite")
    assert both.returncode == 2 and "zeroflax: error: --overwrite: contradicts --resume" in both.stderr
    assert earlier_run(str(workdir)) == []  # neither touched the directory


# ------------------------------------------------------------------------------- non-finite steps
INIT, LOSS, MAKE = linen_case(MLP(hidden=32, out=4), (8,), 4)


def _mlp_engine(**config):
    batch = MAKE(np.random.default_rng(0), 16)
    settings = dict(micro_batch_size=2, persistence_threshold=0, mesh=zeroflax.MeshConfig({"data": -1, "tensor": 1}))
    return zeroflax.initialize(LOSS, INIT, optax.adam(1e-2), zeroflax.Config(**{**settings, **config}),
                               sample_batch=batch)


@pytest.mark.parametrize("stage,precision", [(0, "fp32"), (3, "bf16")])
def test_nonfinite_skip_never_applies_the_step(stage, precision):
    """Config.nonfinite = 'skip', a batch with a NaN: the step keeps the old parameters and optimizer state
    and says so; the run then goes on exactly as if that batch had never come (Adam's step count included)."""
    rng = np.random.default_rng(1)
    good = [MAKE(rng, 16) for _ in range(2)]
    bad = {**good[0], "x": good[0]["x"].copy()}
    bad["x"][3, 2] = np.nan
    runs = {}
    for name, batches in (("with the bad batch", [good[0], bad, good[1]]), ("without", good)):
        engine, state = _mlp_engine(zero_stage=stage, precision=precision, nonfinite="skip")
        skipped = []
        for batch in batches:
            before = jax.device_get((engine.model_params(state), state.opt_state))
            state, metrics = engine.step(state, batch)
            skipped.append(bool(metrics["skipped"]))
            if batch is bad:
                after = jax.device_get((engine.model_params(state), state.opt_state))
                jax.tree.map(np.testing.assert_array_equal, after, before)
                assert not np.isfinite(float(metrics["loss"]))
        runs[name] = jax.device_get(engine.model_params(state)), skipped
    assert runs["with the bad batch"][1] == [False, True, False] and runs["without"][1] == [False, False]
    jax.tree.map(np.testing.assert_array_equal, runs["with the bad batch"][0], runs["without"][0])


def test_nonfinite_error_reports_the_step_and_leaves_the_update_in_place():
    """'error' (the default) does not pay for a skip in the step (no second copy of the model states): the
    step says its gradient was not finite, and the train loop stops (test below)."""
    rng = np.random.default_rng(1)
    batch = MAKE(rng, 16)
    batch["x"][0, 0] = np.inf
    engine, state = _mlp_engine(zero_stage=1)
    state, metrics = engine.step(state, batch)
    assert bool(metrics["nonfinite"]) and not bool(metrics["skipped"])
    assert not all(np.isfinite(x).all() for x in jax.tree.leaves(jax.device_get(engine.model_params(state))))


def test_config_nonfinite_is_checked():
    with pytest.raises(ConfigError, match="Config.nonfinite: must be 'error' or 'skip'"):
        zeroflax.Config(nonfinite="ignore")


def _exploding_run(workdir, nonfinite):
    """The tiny GPT under SGD with a learning rate of 1e20: the first update is finite but absurd, and the
    next forward pass overflows (attention scores past float32's range), so its loss and gradients are NaN."""
    from zeroflax.models.gpt import GPTConfig
    from zeroflax.train import TrainConfig, train
    tc = TrainConfig(workdir=str(workdir), seq_len=16, steps=4, warmup_steps=1, log_every=1, eval_every=0,
                     eval_batches=1, checkpoint_every=1, sample_length=0, tensorboard=False)
    config = zeroflax.Config(zero_stage=3, micro_batch_size=1, persistence_threshold=0, nonfinite=nonfinite)
    return train(tc, config, GPTConfig(num_layers=1, d_model=32, num_heads=2, max_len=16),
                 optimizer=optax.sgd(1e20), progress=False)


def _checkpoint_params(workdir, step):
    from zeroflax.export import export_safetensors
    from safetensors.numpy import load_file
    out = os.path.join(workdir, f"step{step}.safetensors")
    export_safetensors(str(workdir), out, step=step)
    return load_file(out)


def test_an_exploding_run_stops_or_skips_and_never_saves_a_nan(tmp_path):
    from zeroflax.train import NonFiniteError
    with pytest.raises(NonFiniteError, match=r"step (\d+): the gradients are not finite \(NaN or inf\), and training "
                                             r"stopped.*The newest checkpoint, step \d+, is as it was") as stopped:
        _exploding_run(tmp_path / "error", "error")
    bad_step = int(str(stopped.value).split(":")[0].split()[1])
    checkpoints = sorted(int(d) for d in os.listdir(tmp_path / "error" / "checkpoints") if d.isdigit())
    assert bad_step >= 2 and checkpoints and max(checkpoints) == bad_step - 1  # the bad step was never saved
    assert all(np.isfinite(v).all() for v in _checkpoint_params(tmp_path / "error", max(checkpoints)).values())

    summary = _exploding_run(tmp_path / "skip", "skip")
    rows = [json.loads(line) for line in open(tmp_path / "skip" / "metrics.jsonl")]
    losses = {r["step"]: r for r in rows if "loss" in r}
    assert losses[4]["skipped_steps"] == 4 - bad_step + 1 and losses[4]["skipped"] and losses[4]["nonfinite"]
    assert summary["steps"] == 4
    assert all(np.isfinite(v).all() for v in _checkpoint_params(tmp_path / "skip", 4).values())


# ----------------------------------------------------------------------------------------- security
class _Planted:
    """Unpickling this writes a marker file: if the marker ever appears, something unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_no_data_or_checkpoint_path_unpickles(tmp_path):
    import pickle

    from zeroflax.checkpoint import CheckpointError, Checkpointer
    from zeroflax.data import DataError, load_tokens

    marker = str(tmp_path / "unpickled")
    payload = pickle.dumps(_Planted(marker))
    # A token file holding a pickled object array: refused, never unpickled.
    np.save(tmp_path / "tokens.npy", np.array([_Planted(marker)], dtype=object), allow_pickle=True)
    with pytest.raises(DataError):
        load_tokens(str(tmp_path / "tokens.npy"))
    # A checkpoint with pickles planted next to its files and in place of each of its small files.
    engine, state = _mlp_engine(zero_stage=1)
    directory = str(tmp_path / "checkpoints")
    saver = Checkpointer(directory, every=1, asynchronous=False)
    saver.save(1, state, {"epoch": 0}, {"model": "mlp"})
    saver.close()
    step_dir = os.path.join(directory, "1")
    replaced = 0
    for root, _, files in os.walk(step_dir):
        with open(os.path.join(root, "planted.pkl"), "wb") as f:
            f.write(payload)
        for name in files:
            path = os.path.join(root, name)
            if os.path.getsize(path) < 4096:  # metadata, manifests, descriptors
                with open(path, "wb") as f:
                    f.write(payload)
                replaced += 1
    assert replaced >= 3
    try:
        Checkpointer(directory, every=1).restore(1, engine.abstract_state(), engine.state_shardings)
    except CheckpointError:
        pass  # refused: what should happen to a tampered checkpoint; unpickling is what must not
    assert not os.path.exists(marker)


# ----------------------------------------------------------------------------------- lost processes
@pytest.mark.slow  # multi-process or end-to-end: `make test-slow` (and CI)
def test_a_lost_process_ends_the_job_promptly_and_the_checkpoint_resumes(tmp_path):
    """Two processes training; process 1 is SIGKILLed mid-run. `launch` names it, stops process 0 and fails
    within seconds (the issue's bound: 60), and the newest checkpoint resumes."""
    from cli_helpers import env_without_device_flags
    workdir = tmp_path / "run"
    bindings = tiny_bindings(workdir, steps=400, **{"TrainConfig.checkpoint_every": 2})
    log = open(tmp_path / "launch.log", "w+")  # a file, not a pipe: a full pipe would block the processes
    launch = subprocess.Popen([sys.executable, "-m", "zeroflax", "launch", "--nproc", "2", "--devices_per_process", "4",
                               "--", sys.executable, "-m", "zeroflax", "train", "--gin_file", TINY, *bindings,
                               "--no_progress"], cwd=ROOT, env=env_without_device_flags(), stdout=subprocess.DEVNULL,
                              stderr=log)
    checkpoints = workdir / "checkpoints"
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not (checkpoints.is_dir() and any(d.isdigit() for d in os.listdir(checkpoints))):
            assert launch.poll() is None, (tmp_path / "launch.log").read_text()[-3000:]
            time.sleep(0.2)
        children = launched_processes(launch.pid)
        assert sorted(children) == [0, 1], children
        os.kill(children[1], signal.SIGKILL)
        killed = time.time()
        code = launch.wait(timeout=120)
        took = time.time() - killed
    finally:
        if launch.poll() is None:
            launch.kill()
    stderr = (tmp_path / "launch.log").read_text()
    log.close()
    print(f"launch returned {code} {took:.1f} s after process 1 was killed")
    assert code == 128 + signal.SIGKILL and took <= 60, (code, took, stderr[-2000:])
    assert "zeroflax launch: process 1 was killed by SIGKILL; stopping the other 1" in stderr
    assert all(p not in launched_processes(launch.pid).values() for p in children.values())
    newest = max(int(d) for d in os.listdir(workdir / "checkpoints") if d.isdigit())
    resumed = run_cli("train", "--gin_file", TINY,
                      *tiny_bindings(workdir, steps=newest + 2, **{"TrainConfig.checkpoint_every": 2}),
                      "--resume", "--no_progress")
    assert resumed.returncode == 0 and "resumed from step" in resumed.stdout, resumed.stderr[-3000:]


def test_gin_imports_and_malformed_gin_are_one_line_errors(tmp_path, capsys):
    """A gin `import` runs a module's code: refused, in a file, in a file it includes, or in a binding.
    Malformed gin is one line naming the flag, not a traceback."""
    import gin

    from zeroflax.cli import main
    evil = tmp_path / "evil.gin"
    evil.write_text(f"include '{TINY}'\nimport os.path\nConfig.zero_stage = 2\n")
    outer = tmp_path / "outer.gin"
    outer.write_text(f"include '{evil}'\n")
    cases = [
        (["--gin_file", str(outer)], f"--gin_file: {evil}: import os.path: gin import statements are refused"),
        (["--gin_file", TINY, "--gin_param", "import os"], "--gin_param: 'import os': import os: gin import"),
        (["--gin_file", TINY, "--gin_param", "Config.zero_stage = ("], "--gin_param: gin: "),
        (["--gin_file", TINY, "--gin_param", "Config..x = 1"], "--gin_param: gin: Malformatted scope or selector"),
    ]
    for args, expected in cases:
        try:
            code = main(["train", *args])
        finally:
            gin.clear_config()
        err = capsys.readouterr().err
        assert code == 2 and err.count("zeroflax: error:") == 1 and expected in err, (args, err)


# Inside a private mount namespace (unshare: root in a user namespace), a tmpfs of $1 is mounted on the
# workdir $2 and `zeroflax train` run there with the rest of the arguments; then the tmpfs is enlarged and
# the run resumed. A namespace's mounts vanish with it, so everything to look at is written outside.
FULL_DISK_SCRIPT = r"""
set -u
size=$1; workdir=$2; out=$3; shift 3
mount -t tmpfs -o size=$size tmpfs "$workdir" || exit 90
"$@" > "$out/first.out" 2> "$out/first.err"; echo $? > "$out/first.rc"
ls -a "$workdir/checkpoints" > "$out/after_failure.ls"
mount -o remount,size=64m "$workdir" || exit 91
"$@" --resume > "$out/resumed.out" 2> "$out/resumed.err"; echo $? > "$out/resumed.rc"
ls -a "$workdir/checkpoints" > "$out/after_resume.ls"
"""


@pytest.mark.slow  # multi-process or end-to-end: `make test-slow` (and CI)
def test_a_full_disk_stops_the_run_and_keeps_the_newest_checkpoint(tmp_path):
    """The workdir is a 1650 KiB tmpfs; the tiny GPT's checkpoints take 650 to 900 KiB each (orbax's files
    differ from run to run: 656-896 KiB measured over 8 runs of 3 checkpoints, on SSE4.2 and AVX2 alike), so
    the second or the third save finds the disk full, never the first or the fourth. The run stops with one
    line naming that step and the cause (exit status 1), every checkpoint before it is left complete, and once
    there is space `--resume` continues from the newest and finishes (and orbax removes the unfinished save)."""
    from cli_helpers import env_without_device_flags
    workdir, out = tmp_path / "run", tmp_path / "out"
    workdir.mkdir()
    out.mkdir()
    train = [sys.executable, "-m", "zeroflax", "train", "--gin_file", TINY, "--no_progress",
             *tiny_bindings(workdir, steps=4, **{"TrainConfig.checkpoint_every": 1})]
    done = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "bash", "-c", FULL_DISK_SCRIPT,
                           "full-disk", "1650k", str(workdir), str(out), *train],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env_without_device_flags())
    if done.returncode != 0 and not (out / "first.rc").exists():  # no namespace or tmpfs here: say so
        pytest.skip(f"cannot mount a tmpfs in a private namespace (unshare/mount): {done.stderr.strip()[-300:]}")
    first_err = (out / "first.err").read_text()
    errors = [line for line in first_err.splitlines() if line.startswith("zeroflax: error:")]
    assert (out / "first.rc").read_text().strip() == "1", first_err[-3000:]
    assert len(errors) == 1, first_err[-3000:]
    failed = re.search(r"the checkpoint of step (\d+) could not be written", errors[0])
    assert failed and int(failed.group(1)) in (2, 3), errors[0]
    step = int(failed.group(1))
    assert ("No space left on device" in errors[0]
            and f"The newest complete checkpoint, step {step - 1}, is intact" in errors[0]), errors[0]
    left = (out / "after_failure.ls").read_text().split()
    assert all(str(s) in left for s in range(1, step)) and str(step) not in left and "4" not in left, left
    resumed = (out / "resumed.out").read_text()
    assert (out / "resumed.rc").read_text().strip() == "0", (out / "resumed.err").read_text()[-3000:]
    assert f"resumed from step {step - 1}" in resumed, resumed[-2000:]
    finished = (out / "after_resume.ls").read_text().split()
    assert "4" in finished and not any(".orbax-checkpoint-tmp" in name for name in finished), finished


def test_any_write_on_a_full_disk_stops_the_run_naming_the_file(tmp_path, monkeypatch):
    """A log file (metrics.jsonl, TensorBoard) that cannot be written for want of space stops the run as a failed
    save does, naming the file and the newest complete checkpoint; other OS errors are not disguised as it."""
    import errno
    import zeroflax.train as train_module
    from zeroflax.checkpoint import SaveError
    (tmp_path / "checkpoints" / "2").mkdir(parents=True)
    (tmp_path / "checkpoints" / "4.orbax-checkpoint-tmp").mkdir()  # unfinished: not a complete checkpoint
    tc = train_module.TrainConfig(workdir=str(tmp_path))
    for code, wanted in ((errno.ENOSPC, SaveError), (errno.EDQUOT, SaveError), (errno.EACCES, PermissionError)):
        def failing(*args, **kwargs):
            raise OSError(code, os.strerror(code), str(tmp_path / "metrics.jsonl"))
        monkeypatch.setattr(train_module, "_train_in", failing)
        with pytest.raises(wanted) as raised:
            train_module.train(tc)
        if wanted is SaveError:
            assert str(raised.value) == (f"{tmp_path / 'metrics.jsonl'}: {os.strerror(code)}. The newest complete "
                                         "checkpoint, step 2, is intact: free space and continue with --resume")
