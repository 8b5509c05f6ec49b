"""Helpers shared by the GPU pass (benchmarks/gpu/pass.sh) and its parts.

Importing this module imports nothing outside the standard library (the pass's runner must stay free of
jax: it only starts, times and kills the parts); the timing helpers import jax when called.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))

# The pass's parts, in the order they run: letter -> (name, title).
PARTS = {
    "a": ("probe", "Probe: the machine and its two ceilings"),
    "b": ("onebit", "1-bit Adam's sign packing: Pallas kernels vs the jnp version"),
    "c": ("host_bandwidth", "Host <-> device bandwidth"),
    "d": ("sparse_attention", "Block-sparse attention at ~10% density vs cuDNN's dense attention"),
    "e": ("train_mfu", "GPT training throughput and MFU (cuDNN attention)"),
    "f": ("offload", "ZeRO-Offload: step time at 1.3B, offload variants / no offload"),
}

# The datasheet's dense bf16 rate of an H200 SXM (the same chip as an H100 SXM), TFLOP/s.
DATASHEET_BF16_TFLOPS = 989.0


# ------------------------------------------------------------------------------------------- commit
def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def read_commit(root: str = ROOT) -> tuple[str, str]:
    """(commit, where it came from), without a git binary: .git/HEAD and the ref it names (a loose ref
    file or packed-refs; a worktree's .git file and its commondir are followed), else env COMMIT, else
    'unknown'."""
    git = os.path.join(root, ".git")
    if os.path.isfile(git):  # a worktree or submodule: "gitdir: <path>"
        text = (_read(git) or "").strip()
        if text.startswith("gitdir:"):
            git = os.path.normpath(os.path.join(root, text.split(":", 1)[1].strip()))
    if os.path.isdir(git):
        head = (_read(os.path.join(git, "HEAD")) or "").strip()
        common = git
        commondir = _read(os.path.join(git, "commondir"))
        if commondir:
            common = os.path.normpath(os.path.join(git, commondir.strip()))
        if head.startswith("ref:"):
            ref = head.split(":", 1)[1].strip()
            for base in (git, common):
                sha = (_read(os.path.join(base, ref)) or "").strip()
                if sha:
                    return sha, f".git ({ref})"
            for base in (common, git):
                for line in (_read(os.path.join(base, "packed-refs")) or "").splitlines():
                    parts = line.split()
                    if len(parts) == 2 and parts[1] == ref and not line.startswith(("#", "^")):
                        return parts[0], f".git packed-refs ({ref})"
        elif len(head) >= 40:
            return head, ".git (detached HEAD)"
    if os.environ.get("COMMIT"):
        return os.environ["COMMIT"], "env COMMIT"
    return "unknown", "no .git and no env COMMIT"


# --------------------------------------------------------------------------------------------- JSON
def host_memory() -> dict:
    """The machine's memory and the container's limit (cgroup v2 or v1), in bytes, where readable, and
    the CPU count."""
    out = {}
    for line in (_read("/proc/meminfo") or "").splitlines():
        key, _, value = line.partition(":")
        if key in ("MemTotal", "MemAvailable") and value.split():
            out[key] = int(value.split()[0]) * 1024
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        text = _read(path)
        if text is None:
            continue
        text = text.strip()
        if text.isdigit() and int(text) < 2**60:
            out["cgroup_limit"] = int(text)
        break
    out["cpus"] = os.cpu_count()
    return out


def _clean(x):
    """JSON-safe: NaN and infinities become strings (json.dump would write invalid JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if hasattr(x, "item") and callable(x.item) and getattr(x, "shape", None) == ():  # numpy scalars
        return _clean(x.item())
    return x


def write_json(path: str, data) -> None:
    """Atomically (a temporary file beside it, then a rename): a reader never sees half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(_clean(data), f, indent=1)
    os.replace(tmp, path)


def write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def load_json(path: str | None):
    if not path:
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def ceilings_from_probe(path: str | None) -> dict:
    """{'matmul_tflops': ..., 'copy_gbs': ...} from the probe's JSON (part a), or {} when it is missing."""
    data = load_json(path) or {}
    out = {}
    for key in ("matmul_tflops", "copy_gbs"):
        value = (data.get("ceilings") or {}).get(key)
        if isinstance(value, (int, float)) and math.isfinite(value) and value > 0:
            out[key] = float(value)
    return out


def blocked_modules() -> list[str]:
    """Modules the GPU image lacks, if anything imported them (it must not)."""
    return sorted(m for m in sys.modules if m.split(".")[0] in ("gin", "tensorboardX"))


# ------------------------------------------------------------------------------------------- timing
class Deadline:
    """An absolute wall-clock deadline (epoch seconds; None: none), passed by the runner to a part."""

    def __init__(self, epoch: float | None):
        self.epoch = epoch

    def left(self) -> float:
        return math.inf if self.epoch is None else self.epoch - time.time()

    def allows(self, cost_s: float) -> bool:
        return self.left() > cost_s


def time_batched(fn, args, *, samples: int, min_sample_s: float, warmup: int = 2, max_calls: int = 200) -> dict:
    """Median seconds per call of ``fn(*args)``: compile, ``warmup`` calls, then ``samples`` samples of n
    back-to-back calls (dispatched asynchronously, one block_until_ready at the end of each sample),
    n chosen so that a sample lasts about ``min_sample_s`` (launch and host-sync overheads amortized).
    Returns median, min and max seconds per call, n and the compile time."""
    import jax

    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t
    single = compile_s
    for _ in range(warmup):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        single = time.perf_counter() - t
    n = 1 if min_sample_s <= 0 else max(1, min(max_calls, math.ceil(min_sample_s / max(single, 1e-7))))
    per_call = []
    for _ in range(samples):
        t = time.perf_counter()
        out = None
        for _ in range(n):
            out = fn(*args)
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - t) / n)
    return dict(median_s=statistics.median(per_call), min_s=min(per_call), max_s=max(per_call), calls_per_sample=n,
                samples=samples, first_call_s=compile_s)


def error_text(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}"
