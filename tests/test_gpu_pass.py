"""The GPU pass (benchmarks/gpu/pass.sh) at SMOKE=1 on the CPU, run once for the module with part (c) made
to fail on purpose (PASS_FAIL=c) and gin-config and tensorboardX blocked (the GPU image lacks both): every
part reports, the failure stays in its row and its log and takes nothing from the others, summary.md has
every part's table, and the numbers are sane. A second, cheap run checks a part's timeout and a budget
running out (PASS_HANG)."""
import json
import math
import os
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PASS = os.path.join(ROOT, "benchmarks", "gpu", "pass.sh")
PARTS = ("a", "b", "c", "d", "e", "f")
FAILED = "c"


def _pass_env(tmp, out, **extra):
    """The pass's own environment: none of the suite's (its 8 simulated devices, JAX_PLATFORMS) or the
    caller's pass settings, and a PYTHONPATH where `import gin` and `import tensorboardX` fail."""
    blockers = tmp / "blockers"
    for module in ("gin", "tensorboardX"):
        (blockers / module).mkdir(parents=True, exist_ok=True)
        (blockers / module / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named {module!r} (blocked by tests/test_gpu_pass.py)\", "
            f"name={module!r})\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PASS_") and k not in ("OUT", "SMOKE", "XLA_FLAGS", "JAX_PLATFORMS", "PYTHONPATH")}
    env.update(PYTHON=sys.executable, SMOKE="1", PASS_OUT=str(out), PYTHONPATH=str(blockers), **extra)
    return env


def _run(env, timeout):
    t = time.perf_counter()
    proc = subprocess.run(["bash", PASS], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return proc, time.perf_counter() - t


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_pass")
    out = tmp / "out"
    proc, seconds = _run(_pass_env(tmp, out, PASS_FAIL=FAILED), timeout=600)
    assert (out / "results.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "results.json") as f:
        results = json.load(f)
    summary = (out / "summary.md").read_text()
    return dict(proc=proc, seconds=seconds, out=out, results=results, summary=summary)


def _finite_positive(x):
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_every_part_reported_and_the_failure_kept_apart(smoke):
    proc, results, out = smoke["proc"], smoke["results"], smoke["out"]
    assert proc.returncode == 1, proc.stdout[-3000:]  # a part failed
    parts = results["parts"]
    assert list(parts) == list(PARTS)
    assert results["meta"]["finished"] and results["meta"]["smoke"]
    for letter, entry in parts.items():
        log = out / entry["log"]
        assert log.exists(), letter
        if letter == FAILED:
            assert entry["status"] == "failed" and entry["rc"] == 1, entry
            assert "PASS_FAIL=c" in entry["error"] and entry["error"].startswith("RuntimeError")
            assert "PASS_FAIL=c" in entry["stderr_tail"] and "Traceback" in log.read_text()
            assert entry["result"] is None
        else:
            assert entry["status"] == "ok", (letter, entry.get("error"), entry.get("stderr_tail"))
            assert entry["result"] and entry["error"] is None, letter
            assert 0 < entry["elapsed_s"] <= entry["timeout_s"], letter
    # the run tool brings back at most 8 files
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= 8, files
    # the commit, read from .git without a git binary (HEAD may have moved since: others commit meanwhile)
    if os.path.exists(os.path.join(ROOT, ".git")):
        for commit in (results["meta"]["commit"], parts["a"]["result"]["meta"]["commit"]):
            assert len(commit) == 40 and int(commit, 16) >= 0, commit


def _passlib():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "gpu"))
    try:
        import passlib
    finally:
        sys.path.pop(0)
    return passlib


# The reference is git's own answer: without a git binary or a .git folder (a source tarball) there is
# nothing to compare with; CI runs in a git clone, where this runs.
@pytest.mark.skipif(not shutil.which("git") or not os.path.exists(os.path.join(ROOT, ".git")), reason="no git")
def test_commit_without_git_is_heads():
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert _passlib().read_commit(ROOT)[0] == head


def test_commit_from_packed_refs_a_worktree_file_and_env(tmp_path, monkeypatch):
    read_commit = _passlib().read_commit
    sha, other = "1234567890abcdef1234567890abcdef12345678", "fedcba0987654321fedcba0987654321fedcba09"
    gitdir = tmp_path / "repo.git"
    gitdir.mkdir()
    (gitdir / "HEAD").write_text("ref: refs/heads/work\n")
    (gitdir / "packed-refs").write_text(f"# pack-refs with: peeled\n{other} refs/heads/main\n{sha} refs/heads/work\n")
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / ".git").write_text(f"gitdir: {gitdir}\n")
    assert read_commit(str(checkout)) == (sha, ".git packed-refs (refs/heads/work)")
    (gitdir / "refs" / "heads").mkdir(parents=True)
    (gitdir / "refs" / "heads" / "work").write_text(other + "\n")  # a loose ref wins over packed-refs
    assert read_commit(str(checkout))[0] == other
    bare = tmp_path / "no_git"
    bare.mkdir()
    monkeypatch.delenv("COMMIT", raising=False)
    assert read_commit(str(bare))[0] == "unknown"
    monkeypatch.setenv("COMMIT", "abc1234")
    assert read_commit(str(bare)) == ("abc1234", "env COMMIT")


def test_summary_has_every_table_and_the_error(smoke):
    summary = smoke["summary"]
    assert "SMOKE=1" in summary
    for letter in PARTS:
        assert f"## ({letter}) " in summary, letter
        assert f"| ({letter}) |" in summary, letter  # its row in the status table
    assert "| (c) | host_bandwidth | **failed** |" in summary
    assert "RuntimeError: PASS_FAIL=c" in summary
    # the goals table: each goal with a verdict from the parts that ran (smoke figures miss them all)
    for goal in ("GPT MFU >= 55%", "sparse attention at ~10% density >= 5x", "1-bit kernels >= 70%"):
        row = next(line for line in summary.splitlines() if line.startswith(f"| {goal}"))
        assert "not measured" not in row and ("missed" in row or " of " in row), row
    for header in ("| ceiling | measured |", "| R x C | kernel | impl |", "| head_dim | L | layout | density |",
                   "| model | params | batch x seq | attention |", "| config | params | batch x seq |"):
        assert header in summary, header
    assert "| host memory | MiB | direction |" not in summary  # (c) measured nothing


def test_numbers_are_sane(smoke):
    parts = smoke["results"]["parts"]
    probe = parts["a"]["result"]
    assert _finite_positive(probe["ceilings"]["matmul_tflops"]) and _finite_positive(probe["ceilings"]["copy_gbs"])
    assert probe["meta"]["device_count"] == 1 and probe["meta"]["versions"]["jax"]

    onebit = parts["b"]["result"]
    assert onebit["checks"] and all(c["all_equal"] for c in onebit["checks"])
    assert all(all(c["bitwise_equal"].values()) for c in onebit["checks"])
    assert len(onebit["rows"]) == 6
    for row in onebit["rows"]:
        assert _finite_positive(row["gbs"]) and _finite_positive(row["of_copy_ceiling"]), row

    sparse = parts["d"]["result"]
    assert sparse["meta"]["check"]["passed"] is True
    kinds = [r["kind"] for r in sparse["rows"]]
    assert kinds[0] == "dense (xla)" and "bigbird" in kinds and any(k.startswith("window") for k in kinds)
    for row in sparse["rows"]:
        for key in ("fwd_s", "fwdbwd_s", "fwd_tflops", "fwdbwd_tflops"):
            assert _finite_positive(row[key]), row
        if not row["kind"].startswith("dense"):
            assert _finite_positive(row["fwdbwd_speedup_vs_dense"]) and 0 < row["density"] < 1

    mfu = parts["e"]["result"]["rows"]
    assert mfu and all(_finite_positive(r[k]) for r in mfu for k in ("tokens_per_s", "tflops", "mfu_datasheet",
                                                                       "mfu_measured_ceiling"))

    offload = [r for r in parts["f"]["result"]["rows"] if r.get("phase") == "ratio"]
    assert [r["mode"] for r in offload][:2] == ["no offload", "offload"]
    assert all(_finite_positive(r["median_step_s"]) for r in offload)
    assert all(_finite_positive(r["ratio_to_no_offload"]) for r in offload[1:])

    # The GPU image has neither gin-config nor tensorboardX: blocked here, and no part imported them.
    for letter in ("a", "b", "d"):
        assert parts[letter]["result"]["meta"]["imported_gin_or_tensorboardx"] == []
    for letter in ("e", "f"):
        assert parts[letter]["result"]["meta"]["gin_or_tensorboardx_imported"] == []


def test_a_part_that_hangs_is_killed_and_the_budget_runs_out(tmp_path):
    """PASS_HANG=a with an 8 s budget: (a) times out at 8 - 3 (reserve) = 5 s and is killed; (b) is not started."""
    out = tmp_path / "out"
    proc, seconds = _run(_pass_env(tmp_path, out, PASS_PARTS="a,onebit", PASS_HANG="a", PASS_BUDGET_S="8"),
                         timeout=120)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert seconds < 30
    results = json.loads((out / "results.json").read_text())
    a, b = results["parts"]["a"], results["parts"]["b"]
    assert a["status"] == "timeout" and "killed" in a["error"] and 4 <= a["elapsed_s"] < 15, a
    assert b["status"] == "skipped" and "budget exhausted" in b["error"], b
    assert list(results["parts"]) == ["a", "b"] and results["meta"]["parts_selected"] == ["a", "b"]
    summary = (out / "summary.md").read_text()
    assert "| (a) | probe | **timeout** |" in summary and "| (b) | onebit | **skipped** |" in summary
    assert "PASS_HANG=a" in (out / "logs" / "a_probe.log").read_text()
