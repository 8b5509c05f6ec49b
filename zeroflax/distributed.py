"""Multi-process runs on JAX's own distributed runtime.

`zeroflax launch --nproc N -- zeroflax train ...` starts N local processes and tells each, through
environment variables, where the coordinator is and which process it is. Under SLURM or Open MPI
the same `zeroflax train` command works unchanged: `jax.distributed.initialize()` reads the
cluster's own variables. On the CPU, processes talk through gloo collectives; on GPUs through NCCL.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

COORDINATOR = "ZEROFLAX_COORDINATOR"
NUM_PROCESSES = "ZEROFLAX_NUM_PROCESSES"
PROCESS_ID = "ZEROFLAX_PROCESS_ID"
# Seconds without a heartbeat before jax's distributed runtime declares a process lost and ends the
# others (jax's own default is 100): a dead peer never leaves the rest waiting in a collective.
HEARTBEAT_ENV = "ZEROFLAX_HEARTBEAT_TIMEOUT"
DEFAULT_HEARTBEAT_S = 30
# Seconds a process waits for the coordinator at start (jax's default: 300).
INIT_TIMEOUT_ENV = "ZEROFLAX_INIT_TIMEOUT"
DEFAULT_INIT_TIMEOUT_S = 300


def _cluster_size() -> int:
    for variable in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if variable in os.environ:
            return int(os.environ[variable])
    return 1


def maybe_initialize() -> bool:
    """Join the distributed runtime when launched as one of several processes; True if so."""
    import jax

    if COORDINATOR in os.environ:
        address = os.environ[COORDINATOR]
        num_processes, process_id = env_int(NUM_PROCESSES, 1), env_int(PROCESS_ID, 0)
        if process_id >= num_processes:
            from zeroflax.config import ConfigError
            raise ConfigError(PROCESS_ID, f"{process_id} is not below {NUM_PROCESSES} = {num_processes}")
        heartbeat, init_timeout = heartbeat_timeout(), env_int(INIT_TIMEOUT_ENV, 1, DEFAULT_INIT_TIMEOUT_S)
        # jax's runtime aborts the process (no exception) when it cannot listen or reach the coordinator:
        # checked here first, so that either is one line naming the variable.
        _check_coordinator(address, process_id == 0, init_timeout)
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # The coordinator listens on the address it was given (127.0.0.1 from `zeroflax launch`), not on
        # every interface, jax's default: a local job is not reachable from the network.
        jax.distributed.initialize(coordinator_address=address, coordinator_bind_address=address,
                                   num_processes=num_processes, process_id=process_id,
                                   initialization_timeout=init_timeout, heartbeat_timeout_seconds=heartbeat)
        return True
    if _cluster_size() > 1:
        heartbeat = heartbeat_timeout()
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat)
        return True
    return False


def env_int(name: str, minimum: int, default: int | None = None) -> int:
    """An integer environment variable of at least `minimum`; a ConfigError naming it otherwise."""
    from zeroflax.config import ConfigError
    value = os.environ.get(name, None if default is None else str(default))
    if value is None or not value.strip().isdigit() or int(value) < minimum:
        raise ConfigError(name, f"must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_coordinator(address: str, listens_here: bool, timeout_s: float) -> None:
    """Process 0 must be able to listen on `address`; every other process must reach it within `timeout_s`
    (process 0 may start later: it is retried)."""
    from zeroflax.config import ConfigError
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(COORDINATOR, f"{address!r} is not host:port")
    host = host.strip("[]")  # an IPv6 address in brackets
    if listens_here:
        try:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
                probe.bind((host, int(port)))
        except OSError as error:
            raise ConfigError(COORDINATOR, f"process 0 cannot listen on {address}: {error.strerror}",
                              "choose another port (zeroflax launch --port) or end what holds it") from None
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as error:
            if time.monotonic() >= deadline:
                raise ConfigError(COORDINATOR, f"the coordinator at {address} (process 0) did not answer within "
                                  f"{timeout_s:g} s: {error.strerror or error}",
                                  f"start process 0, check the address, or raise {INIT_TIMEOUT_ENV}") from None
            time.sleep(0.2)
def launch_env(process_id: int, num_processes: int, port: int, devices_per_process: int | None) -> dict:
    env = dict(os.environ)
    env.update({COORDINATOR: f"127.0.0.1:{port}", NUM_PROCESSES: str(num_processes), PROCESS_ID: str(process_id)})
    if devices_per_process:
        env[DEVICES_ENV] = str(devices_per_process)
    return env


# Simulated CPU devices per process (the CLI turns it into XLA_FLAGS before jax is imported).
DEVICES_ENV = "ZEROFLAX_CPU_DEVICES"


def heartbeat_timeout() -> int:
    return env_int(HEARTBEAT_ENV, 1, DEFAULT_HEARTBEAT_S)


def run_processes(command: list, num_processes: int, port: int, devices_per_process: int | None,
                  grace_s: float = 10.0, poll_s: float = 0.2) -> int:
    """`zeroflax launch`: run `command` as processes 0..N-1 of one job and wait for them. When one fails,
    the others are stopped (SIGTERM, SIGKILL after `grace_s`) rather than left waiting for it, and its
    status is returned (128 + the signal for a killed process, as shells report it); 0 when all succeed."""
    processes = [subprocess.Popen(command, env=launch_env(i, num_processes, port, devices_per_process))
                 for i in range(num_processes)]
    try:
        while True:
            codes = [p.poll() for p in processes]
            failed = [(i, code) for i, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                index, code = failed[0]
                how = (f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}")
                running = sum(c is None for c in codes)
                print(f"zeroflax launch: process {index} {how}"
                      + (f"; stopping the other {running}" if running else ""), file=sys.stderr, flush=True)
                _stop(processes, grace_s)
                return 128 - code if code < 0 else code
            if all(code == 0 for code in codes):
                return 0
            time.sleep(poll_s)
    except BaseException:  # Ctrl-C, or launch itself killed by an exception: take the job down with it
        _stop(processes, grace_s)
        raise


def _stop(processes, grace_s: float) -> None:
    for p in processes:
        if p.poll() is None:
            p.terminate()
    deadline = time.time() + grace_s
    for p in processes:
        try:
            p.wait(timeout=max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def launched_processes(launch_pid: int) -> dict[int, int]:
    """{process index: pid} of the processes a `zeroflax launch` (pid `launch_pid`) started, read from
    Linux's /proc (their ZEROFLAX_PROCESS_ID): for tools and tests that kill one on purpose."""
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != launch_pid:
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                variables = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            found[int(variables[PROCESS_ID.encode()])] = int(entry)
        except (OSError, KeyError, ValueError, IndexError):  # gone meanwhile, or not ours
            continue
    return found
