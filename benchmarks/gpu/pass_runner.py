"""The GPU pass's runner: starts each part (pass_parts.py) in its own process under its own timeout inside
one global budget, and rewrites results.json and summary.md after every part. The design, the budget
rules and how to run it: benchmarks/gpu/pass.sh's header (run the pass through pass.sh, which sets the
environment; this file reads it).

Only the standard library: the runner never imports jax, so nothing a part does (a crash, a hang in a
CUDA call, an out-of-memory) can take the runner or what it has written with it.
"""
from __future__ import annotations

import datetime
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)

import passlib  # noqa: E402
import pass_summary  # noqa: E402

# Each part's cap (seconds, its process's wall time, start-up included). The expected H200 times, from the
# shapes and the ceilings (~790 TFLOP/s bf16, ~4.3 TB/s), are in pass.sh's header.
CAPS = {"a": 45, "b": 60, "c": 45, "d": 130, "e": 130, "f": 240}
RESERVE_S = 3.0     # kept back from every part's timeout, for killing it and writing the summary
MIN_START_S = 3.0   # a part whose timeout would be shorter is not started (status 'skipped')
GRACE_S = 3.0       # SIGTERM to the part's process group, then SIGKILL after this
LOG_CAP = 4 * 2**20  # bytes of each stream kept in a part's log (the tail)
STDERR_TAIL_LINES = 40


class Interrupted(Exception):
    pass


def _on_signal(signum, frame):
    raise Interrupted(signal.Signals(signum).name)


def env_list(name: str) -> list[str]:
    return [p.strip() for p in os.environ.get(name, "").replace(" ", ",").split(",") if p.strip()]


def selected_parts() -> list[str]:
    names = {name: letter for letter, (name, _) in passlib.PARTS.items()}
    wanted = env_list("PASS_PARTS")
    if not wanted:
        return list(passlib.PARTS)
    letters = set()
    for w in wanted:
        letter = w.lower() if w.lower() in passlib.PARTS else names.get(w)
        if letter is None:
            sys.exit(f"PASS_PARTS: unknown part {w!r}; choose from {', '.join(passlib.PARTS)} or "
                     f"{', '.join(names)}")
        letters.add(letter)
    return [p for p in passlib.PARTS if p in letters]  # always in the pass's order


def caps() -> dict:
    out = dict(CAPS)
    for item in env_list("PASS_CAPS"):
        key, _, value = item.partition("=")
        if key in out and value:
            out[key] = float(value)
    return out


def tail_text(path: str, limit: int) -> tuple[str, bool]:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as fh:
            if size > limit:
                fh.seek(size - limit)
            return fh.read().decode("utf-8", "replace"), size > limit
    except OSError:
        return "", False


_EXC = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure|Fault)|Killed|Segmentation fault)\b.*")


def error_line(stderr: str) -> str | None:
    """The last line of stderr that looks like an exception ('RuntimeError: ...')."""
    for line in reversed(stderr.splitlines()):
        if _EXC.match(line.strip()):
            return line.strip()[:400]
    return None


def main() -> int:
    start = time.monotonic()
    smoke = os.environ.get("SMOKE", "") not in ("", "0", "false", "no")
    out = os.environ.get("OUT") or os.environ.get("PASS_OUT") or "gpu_pass_out"
    out = os.path.abspath(out)
    budget = float(os.environ.get("PASS_BUDGET_S") or 480)
    parts = selected_parts()
    part_caps = caps()
    python = sys.executable
    os.makedirs(os.path.join(out, "logs"), exist_ok=True)
    work = tempfile.mkdtemp(prefix="gpu_pass_")
    commit, commit_source = passlib.read_commit(ROOT)
    env_shown = {k: v for k, v in os.environ.items()
                 if k.startswith("PASS_") or k in ("SMOKE", "OUT", "PYTHON", "JAX_PLATFORMS", "XLA_FLAGS", "COMMIT",
                                                    "XLA_PYTHON_CLIENT_MEM_FRACTION")}
    results = dict(meta=dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), smoke=smoke,
        command="bash benchmarks/gpu/pass.sh" + "".join(f" {k}={v}" for k, v in sorted(env_shown.items())
                                                         if k.startswith("PASS_") or k == "SMOKE"),
        env=env_shown, python=python, python_version=platform.python_version(), host=platform.node(),
        commit=commit, commit_source=commit_source, budget_s=budget, caps_s=part_caps, reserve_s=RESERVE_S,
        min_start_s=MIN_START_S, parts_selected=parts, out=out, elapsed_s=0.0, finished=False), parts={})
    results_path, summary_path = os.path.join(out, "results.json"), os.path.join(out, "summary.md")

    def save():
        results["meta"]["elapsed_s"] = time.monotonic() - start
        passlib.write_json(results_path, results)
        passlib.write_text(summary_path, pass_summary.render(results))

    def say(text):
        print(f"[pass {time.monotonic() - start:6.1f} s] {text}", flush=True)

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    say(f"{len(parts)} part(s) {','.join(parts)}, budget {budget:.0f} s, smoke={smoke}, python {python}, out {out}")
    save()
    proc = interrupted = None
    exit_code = 0
    try:
        for letter in parts:
            name, title = passlib.PARTS[letter]
            remaining = budget - (time.monotonic() - start)
            timeout = min(part_caps[letter], remaining - RESERVE_S)
            entry = dict(part=letter, name=name, title=title, cap_s=part_caps[letter], timeout_s=max(timeout, 0.0))
            results["parts"][letter] = entry
            if timeout < MIN_START_S:
                entry.update(status="skipped", error=f"budget exhausted: {remaining:.0f} s of {budget:.0f} s left, "
                                                     f"{RESERVE_S:.0f} s reserved; not started")
                say(f"({letter}) {name}: skipped ({entry['error']})")
                save()
                continue
            json_path = os.path.join(work, f"{letter}.json")
            probe_json = os.path.join(work, "a.json")
            margin = max(2.0, 0.05 * timeout)  # the part's deadline: done a little before it is killed
            cmd = [python, os.path.join(HERE, "pass_parts.py"), letter, "--json", json_path,
                   "--deadline", f"{time.time() + timeout - margin:.1f}"]
            if os.path.exists(probe_json):
                cmd += ["--probe-json", probe_json]
            if smoke:
                cmd.append("--smoke")
            entry.update(status="running", command=" ".join(cmd))
            save()
            say(f"({letter}) {name}: started, timeout {timeout:.0f} s")
            out_path, err_path = os.path.join(work, f"{letter}.out"), os.path.join(work, f"{letter}.err")
            t0 = time.monotonic()
            with open(out_path, "wb") as fo, open(err_path, "wb") as fe:
                proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, stdin=subprocess.DEVNULL, cwd=ROOT,
                                        start_new_session=True)
                try:
                    rc = proc.wait(timeout=timeout)
                    status = "ok" if rc == 0 else "failed"
                except subprocess.TimeoutExpired:
                    kill(proc)
                    rc, status = None, "timeout"
                except Interrupted as e:  # collect what the part wrote, then stop the pass
                    kill(proc)
                    rc, status, interrupted = None, "interrupted", e
                finally:
                    proc = None
            elapsed = time.monotonic() - t0
            stdout, cut_out = tail_text(out_path, LOG_CAP)
            stderr, cut_err = tail_text(err_path, LOG_CAP)
            data = passlib.load_json(json_path)
            error = None
            if status == "interrupted":
                error = f"the pass got {interrupted} while this part ran: killed"
            elif status == "timeout":
                error = f"timed out after {elapsed:.0f} s (timeout {timeout:.0f} s): killed"
            elif status == "failed":
                error = error_line(stderr) or f"exit code {rc}"
                if rc is not None and rc < 0:
                    error = f"killed by signal {-rc}" + (f"; {error}" if error else "")
            elif data is None:
                status, error = "failed", "exited 0 but wrote no JSON"
            log_rel = os.path.join("logs", f"{letter}_{name}.log")
            entry.update(status=status, rc=rc, elapsed_s=elapsed, error=error, log=log_rel, result=data,
                         stderr_tail="\n".join(stderr.splitlines()[-STDERR_TAIL_LINES:])[-8000:])
            with open(os.path.join(out, log_rel), "w") as log:
                log.write(f"# part ({letter}) {name}: {status}, rc {rc}, {elapsed:.1f} s of a {timeout:.0f} s "
                          f"timeout\n# command: {' '.join(cmd)}\n"
                          + (f"# error: {error}\n" if error else "")
                          + f"\n===== stdout{' (last ' + str(LOG_CAP) + ' bytes)' if cut_out else ''} =====\n"
                          + stdout
                          + f"\n===== stderr{' (last ' + str(LOG_CAP) + ' bytes)' if cut_err else ''} =====\n"
                          + stderr)
            if data is not None and letter != "a":  # now in results.json; the probe's stays for later parts
                os.remove(json_path)
            say(f"({letter}) {name}: {status} in {elapsed:.1f} s" + (f": {error}" if error else ""))
            save()
            if status == "interrupted":
                raise interrupted
            if status != "ok":
                exit_code = 1
    except Interrupted as e:
        if proc is not None:
            kill(proc)
        for letter in parts:
            entry = results["parts"].get(letter)
            if entry and entry.get("status") == "running":
                entry.update(status="interrupted", error=f"the pass got {e} while this part ran")
        say(f"interrupted ({e}): results so far saved")
        exit_code = 2
    finally:
        results["meta"]["finished"] = exit_code != 2
        results["meta"]["interrupted"] = exit_code == 2
        save()
        shutil.rmtree(work, ignore_errors=True)
    print()
    with open(summary_path) as fh:
        print(fh.read())
    say(f"wrote {summary_path} and {results_path}")
    return exit_code


def kill(proc):
    """SIGTERM to the part's process group (it was started in its own session), SIGKILL after GRACE_S."""
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


if __name__ == "__main__":
    sys.exit(main())
