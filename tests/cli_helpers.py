"""Running `python -m zeroflax ...` in a subprocess, as a user would."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "experiments", "gpt_tiny_zero3.gin")


def tiny_bindings(workdir, steps=6, **extra):
    """A GPT small enough to compile in seconds; every step logged, checkpoints every 2 steps."""
    bindings = {
        "GPTConfig.num_layers": 2, "GPTConfig.d_model": 32, "GPTConfig.num_heads": 2, "GPTConfig.max_len": 32,
        "TrainConfig.seq_len": 32, "TrainConfig.steps": steps, "TrainConfig.warmup_steps": 1,
        "TrainConfig.log_every": 1, "TrainConfig.eval_every": 0, "TrainConfig.eval_batches": 1,
        "TrainConfig.checkpoint_every": 2, "TrainConfig.sample_length": 0, "TrainConfig.tensorboard": False,
        "TrainConfig.workdir": repr(str(workdir)), "Config.micro_batch_size": 1, "Config.persistence_threshold": 0,
    }
    bindings.update(extra)
    args = []
    for key, value in bindings.items():
        args += ["--gin_param", f"{key} = {value}"]
    return args


# LLVM -O0 for the suite's own compilations (tests/conftest.py says why); subprocesses get it too.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def xla_flags_without_device_count() -> str:
    """XLA_FLAGS for a subprocess that sets its own device count: the suite's flags and the user's (an
    instruction-set cap such as --xla_cpu_max_isa=SSE4_2 must reach every process of a run), less the
    simulated device count."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    if TEST_XLA_FLAGS not in flags:
        flags.append(TEST_XLA_FLAGS)
    return " ".join(f for f in flags if "xla_force_host_platform_device_count" not in f)


def env_without_device_flags():
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags_without_device_count()  # the CLI sets its own device count
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def zeroflax(*args, timeout=300, **kwargs):
    return subprocess.run([sys.executable, "-m", "zeroflax", *args], capture_output=True, text=True,
                          timeout=timeout, env=env_without_device_flags(), cwd=ROOT, **kwargs)


def losses(workdir):
    import json
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}
