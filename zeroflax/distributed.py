"""Multi-process runs on JAX's own distributed runtime.

`zeroflax launch --nproc N -- zeroflax train ...` starts N local processes and tells each, through
environment variables, where the coordinator is and which process it is. Under SLURM or Open MPI
the same `zeroflax train` command works unchanged: `jax.distributed.initialize()` reads the
cluster's own variables. On the CPU, processes talk through gloo collectives; on GPUs through NCCL.
"""
from __future__ import annotations

import os

COORDINATOR = "ZEROFLAX_COORDINATOR"
NUM_PROCESSES = "ZEROFLAX_NUM_PROCESSES"
PROCESS_ID = "ZEROFLAX_PROCESS_ID"


def _cluster_size() -> int:
    for variable in ("SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        if variable in os.environ:
            return int(os.environ[variable])
    return 1


def maybe_initialize() -> bool:
    """Join the distributed runtime when launched as one of several processes; True if so."""
    import jax

    if COORDINATOR in os.environ:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=os.environ[COORDINATOR],
                                   num_processes=int(os.environ[NUM_PROCESSES]),
                                   process_id=int(os.environ[PROCESS_ID]))
        return True
    if _cluster_size() > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize()
        return True
    return False


def launch_env(process_id: int, num_processes: int, port: int, devices_per_process: int | None) -> dict:
    env = dict(os.environ)
    env.update({COORDINATOR: f"127.0.0.1:{port}", NUM_PROCESSES: str(num_processes), PROCESS_ID: str(process_id)})
    if devices_per_process:
        env[DEVICES_ENV] = str(devices_per_process)
    return env


# Simulated CPU devices per process (the CLI turns it into XLA_FLAGS before jax is imported).
DEVICES_ENV = "ZEROFLAX_CPU_DEVICES"
