"""Kill soak (issue 13, item 1): the tiny main job SIGKILLed over and over, resumed each time with --resume.

    python benchmarks/soak.py [--kills 20] [--save-kills 20] [--seed 0] [--steps 40] [--out soak.json]

Part 1 (random kills): the tiny GPT job runs for --steps steps, with a checkpoint every 2 steps,
validation every 10 steps and a 20-byte sample at the end. It is killed at --kills moments drawn from a
seeded uniform distribution over one run's lifetime (startup and compilation, steps, asynchronous
saves, validation, sampling), and resumed after each kill. Once the kills are spent, the job runs to
the end. Its per-step losses (metrics.jsonl) and its final parameters must then equal an uninterrupted
run's, bitwise.

Part 2 (kills inside saves): the job checkpoints every step and is killed at the moment a save is
unfinished (a temporary directory exists), --save-kills times. After each kill, every complete
checkpoint must restore, and the next --resume must start from the newest one.

The seed and every kill (time, the step it reached, what the process had printed last) are printed
and written with --out. Not part of the test suite: it takes about 10 minutes on 2 cores. A short
version is tests/test_cli.py's kill tests.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "experiments", "gpt_tiny_zero3.gin")


def bindings(workdir: str, steps: int, checkpoint_every: int, **extra) -> list[str]:
    values = {"GPTConfig.num_layers": 2, "GPTConfig.d_model": 32, "GPTConfig.num_heads": 2, "GPTConfig.max_len": 32,
              "TrainConfig.seq_len": 32, "TrainConfig.steps": steps, "TrainConfig.warmup_steps": 1,
              "TrainConfig.log_every": 1, "TrainConfig.eval_every": 10, "TrainConfig.eval_batches": 1,
              "TrainConfig.checkpoint_every": checkpoint_every, "TrainConfig.keep_checkpoints": 1000,
              "TrainConfig.sample_length": 20, "TrainConfig.tensorboard": False,
              "TrainConfig.workdir": repr(workdir), "Config.micro_batch_size": 1, "Config.persistence_threshold": 0}
    values.update(extra)
    return [arg for key, value in values.items() for arg in ("--gin_param", f"{key} = {value}")]


def command(workdir: str, steps: int, checkpoint_every: int, resume: bool) -> list[str]:
    return ([sys.executable, "-m", "zeroflax", "train", "--gin_file", TINY, *bindings(workdir, steps, checkpoint_every),
             "--no_progress"] + (["--resume"] if resume else []))


def env() -> dict:
    out = dict(os.environ)
    out.pop("XLA_FLAGS", None)  # the CLI sets its own device count
    out["PYTHONUNBUFFERED"] = "1"  # each kill's last output line is what the process had really printed
    return out


def complete_steps(workdir: str) -> tuple[list[int], list[str]]:
    directory = os.path.join(workdir, "checkpoints")
    if not os.path.isdir(directory):
        return [], []
    names = os.listdir(directory)
    return sorted(int(n) for n in names if n.isdigit()), [n for n in names if "tmp" in n]


def losses(workdir: str) -> dict:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def final_params(workdir: str, step: int | None = None) -> dict:
    out = os.path.join(workdir, f"params{'' if step is None else step}.safetensors")
    args = [sys.executable, "-m", "zeroflax", "export", "--checkpoint", workdir, "--out", out]
    if step is not None:
        args += ["--step", str(step)]
    done = subprocess.run(args, capture_output=True, text=True, env=env(), cwd=ROOT)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    from safetensors.numpy import load_file
    return load_file(out)


def last_line(path: str) -> str:
    with open(path, errors="replace") as f:
        lines = [line.strip() for line in f.read().replace("\r", "\n").splitlines() if line.strip()]
    return lines[-1][:100] if lines else ""


def run_once(workdir: str, steps: int, checkpoint_every: int, resume: bool, log: str, kill_after=None,
             kill_when=None, timeout: float = 600) -> dict:
    """One process: killed after `kill_after` seconds, or when `kill_when()` is true; else to the end."""
    with open(log, "w") as out:
        started = time.time()
        process = subprocess.Popen(command(workdir, steps, checkpoint_every, resume), stdout=out, stderr=subprocess.STDOUT,
                                   env=env(), cwd=ROOT)
        killed = False
        while process.poll() is None and time.time() - started < timeout:
            if (kill_after is not None and time.time() - started >= kill_after) or (kill_when and kill_when()):
                process.kill()
                killed = True
                break
            time.sleep(0.005)
        if process.poll() is None:
            process.kill()
        code = process.wait()
    return {"killed": killed, "code": code, "seconds": round(time.time() - started, 2), "last_output": last_line(log)}


def random_kills(args, base: str) -> dict:
    reference = os.path.join(base, "reference")
    timing = run_once(reference, args.steps, 2, False, os.path.join(base, "reference.log"))
    if timing["code"]:
        raise SystemExit(f"the reference run failed: {timing['last_output']}")
    lifetime = timing["seconds"]
    rng = np.random.default_rng(args.seed)
    soak, kills = os.path.join(base, "soak"), []
    while sum(k["killed"] for k in kills) < args.kills and len(kills) < 3 * args.kills:
        at = float(rng.uniform(0.5, lifetime))
        result = run_once(soak, args.steps, 2, True, os.path.join(base, f"kill{len(kills)}.log"), kill_after=at)
        steps, _ = complete_steps(soak)
        result.update(kill_at_s=round(at, 2), newest_checkpoint=steps[-1] if steps else None)
        if not result["killed"]:  # it finished before the kill: start over from a fresh directory
            shutil.rmtree(soak)
            result["note"] = "finished before the kill; restarted from scratch"
        kills.append(result)
        landed = "" if result["killed"] else " (finished first: no kill; restarted from scratch)"
        print(f"  kill {len(kills):2d} at {at:6.2f} s{landed}: newest checkpoint {result['newest_checkpoint']}, "
              f"last output: {result['last_output']}", flush=True)
    final = run_once(soak, args.steps, 2, True, os.path.join(base, "final.log"))
    if final["code"]:
        raise SystemExit(f"the final resume failed: {final['last_output']}")
    expected, got = losses(reference), losses(soak)
    same_losses = expected == got
    ref_params, soak_params = final_params(reference), final_params(soak)
    same_params = sorted(ref_params) == sorted(soak_params) and all(
        np.array_equal(ref_params[k], soak_params[k]) for k in ref_params)
    return {"lifetime_s": lifetime, "kills": kills, "killed": sum(k["killed"] for k in kills),
            "losses_equal": same_losses, "steps_compared": len(expected), "params_equal": same_params,
            "first_difference": next((s for s in sorted(expected) if expected[s] != got.get(s)), None)}


def save_kills(args, base: str) -> dict:
    workdir, records = os.path.join(base, "saves"), []
    unreadable, resumed_from_newest = 0, 0
    for attempt in range(args.save_kills):
        before = complete_steps(workdir)[0]
        needed = len(before) + 1
        result = run_once(workdir, 400, 1, attempt > 0, os.path.join(base, f"save{attempt}.log"),
                          kill_when=lambda: (lambda s, t: len(s) >= needed and bool(t))(*complete_steps(workdir)))
        steps, temporary = complete_steps(workdir)
        result.update(complete=len(steps), temporary=len(temporary))
        # The newest complete checkpoint restores (and the next attempt resumes from it).
        for step in steps[-1:]:
            try:
                final_params(workdir, step)
            except RuntimeError as error:
                unreadable += 1
                result.setdefault("unreadable", []).append((step, str(error)[-200:]))
        records.append(result)
        print(f"  save kill {attempt + 1:2d}: killed {result['killed']} with {len(temporary)} save(s) unfinished; "
              f"{len(steps)} complete checkpoints, newest {steps[-1] if steps else None}", flush=True)
        with open(os.path.join(base, f"save{attempt}.log")) as f:
            text = f.read()
        if attempt and f"resumed from step {before[-1]}" in text:
            resumed_from_newest += 1
    return {"save_kills": records, "killed_mid_save": sum(r["killed"] and r["temporary"] > 0 for r in records),
            "unreadable_checkpoints": unreadable, "resumes_from_newest": resumed_from_newest,
            "resumes": args.save_kills - 1}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--save-kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default=None)
    parser.add_argument("--keep", default=None, help="keep the run directories here (default: a temporary one)")
    args = parser.parse_args(argv)
    base = args.keep or tempfile.mkdtemp(prefix="zeroflax-soak-")
    os.makedirs(base, exist_ok=True)
    print(f"soak: seed {args.seed}, {args.kills} random kills over a {args.steps}-step run, {args.save_kills} kills "
          f"inside saves; runs in {base}", flush=True)
    report = {"seed": args.seed, "steps": args.steps}
    report["random"] = random_kills(args, base)
    r = report["random"]
    print(f"random kills: {r['killed']} of {len(r['kills'])} landed; losses equal over {r['steps_compared']} steps: "
          f"{r['losses_equal']}; final parameters bitwise equal: {r['params_equal']}", flush=True)
    report["saves"] = save_kills(args, base)
    s = report["saves"]
    print(f"kills inside saves: {s['killed_mid_save']} of {len(s['save_kills'])}; unreadable checkpoints: "
          f"{s['unreadable_checkpoints']}; resumes from the newest complete checkpoint: {s['resumes_from_newest']} of "
          f"{s['resumes']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    ok = r["losses_equal"] and r["params_equal"] and s["unreadable_checkpoints"] == 0 and \
        s["resumes_from_newest"] == s["resumes"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
