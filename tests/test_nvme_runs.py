"""`zeroflax train` with the state on disk (NVMe offload): a kill never leaves a checkpoint that restores to a
mixed state, and two processes each stream their own shards.

`zeroflax train` (the tiny GPT, ZeRO-3, 8 simulated devices, a checkpoint every step) is killed with SIGKILL
inside a step's update (the file half rewritten) and inside a checkpoint's snapshot (the copy made, not yet
renamed): tests/nvme_kill_worker.py slows those operations so that the kill lands in them. The killed run
then resumes with --resume and must end exactly where an uninterrupted run ends: the same loss at every
step, and a final checkpoint whose file is byte for byte the uninterrupted run's. Two processes of 4
devices (jax.distributed, gloo) each keep their devices' shards in a file of their own and match one process
of 8 to float32 rounding.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from cli_helpers import ROOT, TINY, env_without_device_flags, losses, tiny_bindings, zeroflax
from tolerance import at_most

pytestmark = pytest.mark.slow
STEPS = 5


def train_args(workdir, resume=False):
    nvme = repr(str(workdir / "nvme"))
    args = ["train", "--gin_file", TINY] + tiny_bindings(
        workdir, steps=STEPS, **{"TrainConfig.checkpoint_every": 1, "TrainConfig.async_checkpointing": False,
                                 "Config.offload_optimizer": "@OffloadOptimizerConfig()",
                                 "OffloadOptimizerConfig.device": "'nvme'", "OffloadOptimizerConfig.nvme_path": nvme,
                                 "OffloadOptimizerConfig.buffer_size": 64})
    return args + (["--resume"] if resume else [])


def worker(mode, args, **kwargs):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "nvme_kill_worker.py"), mode, *args],
                            env=env_without_device_flags(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **kwargs)


def kill_when(process, seen, timeout=240.0):
    """SIGKILL `process` as soon as `seen()` is true; the output it printed."""
    deadline = time.monotonic() + timeout
    while not seen():
        assert process.poll() is None, "the run ended before the kill:\n" + process.stdout.read()
        assert time.monotonic() < deadline, "the window never opened"
        time.sleep(0.002)
    process.send_signal(signal.SIGKILL)
    out, _ = process.communicate(timeout=60)
    return out


def final_file(workdir):
    with open(workdir / "checkpoints" / f"nvme_{STEPS}" / "process_0" / "state.bin", "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("uninterrupted")
    run = worker("none", train_args(workdir))
    out, _ = run.communicate(timeout=600)
    assert run.returncode == 0, out
    return workdir


def updating_step(workdir):
    try:
        with open(workdir / "nvme" / "process_0" / "UPDATING") as f:
            return int(f.read().strip() or -1)
    except (FileNotFoundError, ValueError):
        return -1


def resume_and_compare(workdir, uninterrupted):
    run = worker("none", train_args(workdir, resume=True))
    out, _ = run.communicate(timeout=600)
    assert run.returncode == 0, out
    assert "resumed from step" in out
    assert losses(workdir) == losses(uninterrupted)  # every step, bitwise (floats from the same JSON writer)
    assert final_file(workdir) == final_file(uninterrupted)
    return out


def test_a_kill_inside_an_update_resumes_from_the_last_checkpoint(tmp_path, uninterrupted):
    run = worker("update", train_args(tmp_path))
    kill_when(run, lambda: updating_step(tmp_path) >= 3)
    # The live file is a mix of steps 2 and 3 and says so; the newest checkpoint (step 2) has its own copy.
    assert updating_step(tmp_path) >= 3
    steps = sorted(int(n) for n in os.listdir(tmp_path / "checkpoints") if n.isdigit())
    assert steps and all(os.path.isdir(tmp_path / "checkpoints" / f"nvme_{s}") for s in steps)
    out = resume_and_compare(tmp_path, uninterrupted)
    assert f"resumed from step {steps[-1]}" in out


def test_a_kill_inside_a_snapshot_leaves_the_previous_checkpoint(tmp_path, uninterrupted):
    run = worker("snapshot", train_args(tmp_path))
    snapshots = tmp_path / "checkpoints"
    kill_when(run, lambda: os.path.isdir(snapshots / "nvme_3" / "process_0.tmp"))
    # The unfinished snapshot has no checkpoint (orbax's is begun only after it is renamed into place).
    assert not os.path.exists(snapshots / "3") and not os.path.exists(snapshots / "nvme_3" / "process_0")
    out = resume_and_compare(tmp_path, uninterrupted)
    assert "resumed from step 2" in out
    assert not os.path.exists(snapshots / "nvme_3" / "process_0.tmp")  # removed when step 3's snapshot was taken again


def test_two_processes_each_stream_their_own_shards(tmp_path, uninterrupted):
    two = zeroflax("launch", "--nproc", "2", "--devices_per_process", "4", "--", sys.executable, "-m", "zeroflax",
                   *train_args(tmp_path), "--no_progress", timeout=600)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "in 2 process(es)" in two.stdout
    multi, single = losses(tmp_path), losses(uninterrupted)
    assert sorted(multi) == sorted(single)
    for step in single:
        at_most(abs(multi[step] - single[step]) / abs(single[step]), 1e-5, "2 processes' loss against 1's",
                f"(step {step})")
    # Each process wrote only its devices' shards: the two files hold what one process's file holds (each
    # record rounded to whole 4096-byte blocks, so within a block per chunk).
    sizes = [os.path.getsize(tmp_path / "nvme" / f"process_{i}" / "state.bin") for i in (0, 1)]
    whole = os.path.getsize(uninterrupted / "nvme" / "process_0" / "state.bin")
    assert sizes[0] > 0 and sizes[1] > 0 and abs(sum(sizes) - whole) <= whole * 0.2, (sizes, whole)
    for i in (0, 1):  # and each snapshotted its own file into the checkpoint
        assert os.path.isfile(tmp_path / "checkpoints" / f"nvme_{STEPS}" / f"process_{i}" / "state.bin")
