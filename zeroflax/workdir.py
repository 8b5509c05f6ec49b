"""The run directory of `zeroflax train`: one run at a time, never an earlier run overwritten by accident.

- A lock per process (`.lock.process<i>`, `fcntl.flock`): a second `zeroflax train` on a directory in use
  stops at once, naming the holder. The kernel drops the lock when its process ends, however it ends
  (SIGKILL included), so a killed run never leaves a directory locked. flock is local to one machine:
  on a network filesystem shared by several hosts it may not exclude a run on another host.
- An earlier run (checkpoints, metrics.jsonl or TensorBoard events) is continued only with `--resume`
  and replaced only with `--overwrite`, which removes those files first.
- On resume, metrics.jsonl keeps only the rows up to the checkpoint resumed from: the steps after it
  (run before a crash, never checkpointed) are run again and logged once.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket

from zeroflax.config import ConfigError

RUN_FILES = ("checkpoints", "metrics.jsonl", "tensorboard")  # what a run leaves in its workdir


class WorkdirLock:
    """An exclusive lock on `workdir` for this process of a run (module docstring). Use as a context
    manager, or call `release`."""

    def __init__(self, workdir: str, process_index: int = 0):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, f".lock.process{process_index}")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(self.fd, 256).decode(errors="replace").strip() or "another process"
            os.close(self.fd)
            raise ConfigError("TrainConfig.workdir", f"{workdir} is in use by another zeroflax run ({holder})",
                              "wait for that run to end, or choose another workdir") from None
        try:  # who holds it, for the message above; a full disk must not stop the lock itself
            os.ftruncate(self.fd, 0)
            os.write(self.fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
        except OSError:
            pass

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing drops the flock
            self.fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def earlier_run(workdir: str) -> list[str]:
    """The files of an earlier run in `workdir` (empty for a fresh directory)."""
    return [name for name in RUN_FILES if os.path.exists(os.path.join(workdir, name))]


def prepare(workdir: str, resume: bool, overwrite: bool, is_main: bool) -> None:
    """Refuse an earlier run unless resumed or overwritten; remove it for --overwrite (the main process
    only: the caller synchronises the processes after this)."""
    found = earlier_run(workdir)
    if found and not (resume or overwrite):
        raise ConfigError("TrainConfig.workdir", f"{workdir} holds an earlier run ({', '.join(found)})",
                          "pass --resume to continue it, --overwrite to replace it, or choose another workdir")
    if overwrite and is_main:
        for name in found:
            path = os.path.join(workdir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)


def truncate_metrics(workdir: str, step: int) -> int:
    """Keep metrics.jsonl's rows up to `step` (and any unreadable last line, a crash's half-written row,
    dropped); returns how many rows were dropped. The file is replaced atomically."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    kept, dropped = [], 0
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                dropped += 1
                continue
            if row.get("step", 0) <= step:
                kept.append(json.dumps(row) + "\n")
            else:
                dropped += 1
    if dropped:
        with open(path + ".tmp", "w") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
    return dropped
