"""Does a program compiled by one process only break the next collective? (docs/reliability.md)

Two processes (gloo, one CPU device each) run one jitted sum over both devices. Before it, process 0
alone may compile something:
  none           nothing;
  other_program  another jitted function (`g.lower(x).compile()`);
  same_program   the function both are about to run (`f.lower(x).compile()`), as a report does with
                 the training step (zeroflax.memory_report compiles engine.step_function).
Each case prints whether both processes returned, or hung until the timeout.

    python benchmarks/one_process_compile.py [--timeout 40]

Measured 2026-12-06: jax 0.11.2, all three return; jax 0.12.1, same_program hangs (both processes wait in
the sum), the other two return.
"""
import argparse
import os
import socket
import subprocess
import sys
import time

CASES = ("none", "other_program", "same_program")


def worker(process_id: int, case: str, port: int) -> None:
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")),
                                               np.full((1,), process_id + 1, np.float32))
    total = jax.jit(lambda x: jnp.sum(x * 2.0), out_shardings=NamedSharding(mesh, P()))
    other = jax.jit(lambda x: jnp.max(x), out_shardings=NamedSharding(mesh, P()))
    if process_id == 0 and case == "other_program":
        other.lower(x).compile()
    if process_id == 0 and case == "same_program":
        total.lower(x).compile()
    print(f"result {float(total(x))}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_case(case: str, timeout: float) -> tuple[str, float]:
    port, start = free_port(), time.perf_counter()
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(i), case, str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for i in range(2)]
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=max(1.0, timeout - (time.perf_counter() - start)))[0])
        except subprocess.TimeoutExpired:
            outputs.append(None)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    seconds = time.perf_counter() - start
    if any(out is None for out in outputs):
        return f"hung (killed after {timeout:.0f} s)", seconds
    results = [line for out in outputs for line in out.splitlines() if line.startswith("result")]
    return ("returned: " + ", ".join(results)) if len(results) == 2 else "failed", seconds


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=40.0, help="seconds before a case counts as hung")
    args = parser.parse_args()
    import jax
    print(f"jax {jax.__version__}, Python {sys.version.split()[0]}: 2 processes x 1 CPU device, gloo")
    print("| compiled first by process 0 alone | outcome | seconds |\n|---|---|---|")
    for case in CASES:
        outcome, seconds = run_case(case, args.timeout)
        print(f"| {case} | {outcome} | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
