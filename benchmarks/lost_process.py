"""A lost process never hangs the others (issue 13, item 2): seconds from SIGKILLing one process of a
running multi-process job until the rest have exited, for 2 and 4 processes.

    python benchmarks/lost_process.py [--processes 2,4] [--out lost_process.json]

Each job trains the tiny GPT (8 simulated CPU devices split over the processes, gloo collectives) and
the last process is killed after the first checkpoint. Two ways of running the job:
  - under `zeroflax launch`, which notices the death, stops the others and returns non-zero;
  - started directly, as SLURM or Open MPI would, where only jax's distributed runtime (its heartbeat,
    zeroflax's ZEROFLAX_HEARTBEAT_TIMEOUT, 30 s) can end the survivors.
Not part of the test suite (about 3 minutes on 2 cores); the 2-process launch case is a test
(tests/test_reliability.py).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.soak import TINY, bindings, env  # noqa: E402
from zeroflax.distributed import launch_env, launched_processes  # noqa: E402


def train_args(workdir: str) -> list[str]:
    return ["-m", "zeroflax", "train", "--gin_file", TINY, *bindings(workdir, 400, 2), "--no_progress"]


def wait_for_checkpoint(workdir: str, alive, timeout: float = 300) -> None:
    directory = os.path.join(workdir, "checkpoints")
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.isdir(directory) and any(d.isdigit() for d in os.listdir(directory)):
            return
        if not alive():
            raise SystemExit("the job ended before its first checkpoint")
        time.sleep(0.1)
    raise SystemExit("no checkpoint within the timeout")


def under_launch(n: int, base: str) -> dict:
    workdir, log = os.path.join(base, f"launch{n}"), open(os.path.join(base, f"launch{n}.log"), "w+")
    launch = subprocess.Popen([sys.executable, "-m", "zeroflax", "launch", "--nproc", str(n), "--devices_per_process",
                               str(8 // n), "--", sys.executable, *train_args(workdir)], cwd=ROOT, env=env(),
                              stdout=subprocess.DEVNULL, stderr=log)
    wait_for_checkpoint(workdir, lambda: launch.poll() is None)
    victim = launched_processes(launch.pid)[n - 1]
    os.kill(victim, signal.SIGKILL)
    killed = time.time()
    code = launch.wait(timeout=300)
    seconds = time.time() - killed
    log.seek(0)
    line = next((l.strip() for l in log.read().splitlines() if l.startswith("zeroflax launch:")), "")
    return {"processes": n, "mode": "zeroflax launch", "seconds": round(seconds, 1), "status": code, "message": line}


def direct(n: int, base: str) -> dict:
    workdir = os.path.join(base, f"direct{n}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logs = [open(os.path.join(base, f"direct{n}-{i}.log"), "w+") for i in range(n)]
    processes = [subprocess.Popen([sys.executable, *train_args(workdir)], cwd=ROOT, stdout=subprocess.DEVNULL,
                                  stderr=logs[i], env={**env(), **launch_env(i, n, port, 8 // n)})
                 for i in range(n)]
    wait_for_checkpoint(workdir, lambda: all(p.poll() is None for p in processes))
    processes[-1].kill()
    killed = time.time()
    ends = []
    for p in processes[:-1]:
        try:
            p.wait(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        ends.append(time.time() - killed)
    lasts = []
    for log in logs[:-1]:
        log.seek(0)
        lines = [l.strip() for l in log.read().splitlines() if l.strip()]
        lasts.append(lines[-1][:160] if lines else "")
    return {"processes": n, "mode": "direct (jax heartbeat)", "seconds": round(max(ends), 1),
            "status": [p.returncode for p in processes[:-1]], "message": lasts[0] if lasts else ""}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", default="2,4")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    base = tempfile.mkdtemp(prefix="zeroflax-lost-")
    rows = []
    for n in (int(x) for x in args.processes.split(",")):
        for measure in (under_launch, direct):
            rows.append(measure(n, base))
            r = rows[-1]
            print(f"{r['processes']} processes, {r['mode']}: the others gone {r['seconds']} s after the kill, "
                  f"status {r['status']}; {r['message']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    shutil.rmtree(base, ignore_errors=True)
    return 0 if all(r["seconds"] <= 60 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
