"""Generate fp16 loss-scale traces by running DeepSpeed's own `DynamicLossScaler`.

Usage (outside the repository's venv: DeepSpeed's files need torch and pydantic, zeroflax does not)::

    python3 -m venv /tmp/dsvenv_scaler && /tmp/dsvenv_scaler/bin/pip install torch==2.13.0 numpy pydantic
    /tmp/dsvenv_scaler/bin/python tools/gen_loss_scale_traces.py \
        --deepspeed /work/.mirror/deepspeedai+DeepSpeed/repo --rev HEAD --out tests/data/loss_scale_traces.json

`--deepspeed` is a DeepSpeed git directory (a bare mirror is enough): three files are read from it with
`git show <rev>:<path>` at generation time and executed, never copied into this repository:
deepspeed/runtime/config_utils.py, deepspeed/runtime/precision_config.py (the JSON `fp16` block's
pydantic model) and deepspeed/runtime/fp16/loss_scaler.py (the scaler). Only `deepspeed.comm`
(get_rank() -> 0) and `deepspeed.utils` (a logger) are stand-ins; the package modules above them are empty.

Each trace is a JSON `fp16` block and a scripted sequence of overflow flags. The scaler is built the way
DeepSpeed's ZeRO optimizers (stage_1_and_2.py, stage3.py) build it: `get_float16_config({"fp16": block})`,
then `CreateLossScaler(dtype=torch.half, static_loss_scale=cfg.loss_scale,
dynamic_scaling=cfg.loss_scale == 0, dynamic_loss_args=cfg.dynamic_loss_scale_args())`, then
`update_scale(flag)` once per step. That scaler raises when an overflow comes at the minimum scale with the
hysteresis spent (`raise_error_at_min_scale` is left at its default, True: no caller passes it), and the
run ends there. To also pin down what comes after such a step, every trace is replayed by a second scaler
with the same arguments and `raise_error_at_min_scale=False`, which goes on (the scale stays at the
minimum); before each of its steps a deep copy with the flag set back to True is stepped to learn whether
DeepSpeed's engine would raise there. The generator checks that the two scalers agree on every step
before the engine's first exception.

Output (JSON): `source` (repository, commit, commit date, files), `engine_scaler` (the class and the
`raise_error_at_min_scale` the engine's construction gives), `fp16_defaults` (DeepSpeed's defaults for
the scaler keys of the `fp16` block), and `traces`, each with
    name, what          what the trace exercises
    fp16                the JSON `fp16` block (keys as in DeepSpeed's config)
    initial             {"scale", "hysteresis"} before the first step
    overflow            per step: 1 if that step's gradients overflowed
    scale, hysteresis   per step: the scaler's values after the step (hysteresis is null for a static
                        scale: DeepSpeed's static LossScaler has none)
    raises_at           the steps at which the engine-built scaler raises from the state before the step
                        (the first one ends a DeepSpeed run; scale/hysteresis there and after are the
                        raise_error_at_min_scale=False scaler's)
    exception           the exception DeepSpeed raised at raises_at[0] ("Type: message"), or null
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import logging
import subprocess
import sys
import types

FILES = {
    "deepspeed.runtime.config_utils": "deepspeed/runtime/config_utils.py",
    "deepspeed.runtime.fp16.loss_scaler": "deepspeed/runtime/fp16/loss_scaler.py",
    "deepspeed.runtime.precision_config": "deepspeed/runtime/precision_config.py",
}
SCALER_KEYS = ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
               "min_loss_scale")


def git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True, text=True).stdout


def load_deepspeed(repo: str, rev: str) -> dict[str, types.ModuleType]:
    """Execute DeepSpeed's files as the modules they are, under stand-ins for what they import."""
    def package(name):
        module = types.ModuleType(name)
        module.__path__ = []  # a package: submodules are found in sys.modules
        sys.modules[name] = module
        return module

    root = package("deepspeed")
    for name in ("deepspeed.runtime", "deepspeed.runtime.fp16"):
        package(name)
    comm = types.ModuleType("deepspeed.comm")
    comm.get_rank = lambda: 0  # one process: rank 0, which is the rank that logs
    utils = types.ModuleType("deepspeed.utils")
    utils.logger = logging.getLogger("deepspeed")
    root.comm, root.utils = comm, utils
    sys.modules.update({"deepspeed.comm": comm, "deepspeed.utils": utils})

    modules = {}
    for name, path in FILES.items():  # in dependency order
        source = git(repo, "show", f"{rev}:{path}")
        module = types.ModuleType(name)
        module.__package__ = name.rsplit(".", 1)[0]
        module.__file__ = f"{rev}:{path}"
        sys.modules[name] = module
        exec(compile(source, f"<DeepSpeed {path}>", "exec"), module.__dict__)
        modules[name] = module
    return modules


def flags(pattern: str) -> list[int]:
    """'G3 O2 G1' -> three good steps, two overflows, one good step."""
    out = []
    for run in pattern.split():
        kind, count = run[0], int(run[1:] or 1)
        out += [1 if kind == "O" else 0] * count
    return out


def block(power=8, window=3, hysteresis=2, consecutive=False, min_scale=1, loss_scale=0):
    return dict(loss_scale=loss_scale, initial_scale_power=power, loss_scale_window=window, hysteresis=hysteresis,
                consecutive_hysteresis=consecutive, min_loss_scale=min_scale)


def scripted():
    """(name, what, fp16 block, overflow flags): each aimed at one rule."""
    yield ("growth_timing_w3", "no overflow: the scale doubles after 3, 6, 9 good steps counted from the step after "
           "the (virtual) last overflow at -1, i.e. at steps 3, 6, 9", block(window=3), flags("G12"))
    yield ("growth_timing_w1", "window 1: every good step but the first after an overflow doubles",
           block(power=4, window=1, hysteresis=1), flags("G6 O G6 O2 G3"))
    yield ("overflow_at_step_0", "an overflow before any good step", block(window=1, hysteresis=2),
           flags("O G5 O O G4"))
    yield ("overflow_right_after_growth", "overflows on the step after a doubling",
           block(window=3, hysteresis=2), flags("G4 O G4 O O G5 O G8"))
    yield ("overflow_on_growth_step", "an overflow where the window would have closed restarts the count",
           block(window=3, hysteresis=2), flags("O G3 O G4 O G2 O G7"))
    yield ("bursts_h3", "overflow bursts of 1-4 steps, hysteresis 3, refilled only at a doubling",
           block(window=2, hysteresis=3), flags("G3 O G1 O G1 O G1 O G5 O3 G2 O4 G6"))
    yield ("bursts_h3_consecutive", "the same bursts, hysteresis refilled by every good step",
           block(window=2, hysteresis=3, consecutive=True), flags("G3 O G1 O G1 O G1 O G5 O3 G2 O4 G6"))
    yield ("refill_at_growth_only", "hysteresis spent by two overflows is not refilled by a good step, only by "
           "a doubling", block(window=2, hysteresis=3), flags("O2 G1 O G3 O3 G1 O G4 O2"))
    yield ("consecutive_refill", "single overflows between good steps never halve with consecutive hysteresis",
           block(window=5, hysteresis=2, consecutive=True), flags("O G O G O G O O G8 O G O"))
    yield ("alternating_h2", "single overflows between good steps halve every second time without it",
           block(window=2, hysteresis=2), flags("O G O G O G O O G8 O G O"))
    yield ("long_run_w2", "40 good steps cross 19 windows, then again after an overflow",
           block(power=4, window=2, hysteresis=2), flags("G40 O G25 O2 G9"))
    yield ("long_run_w5", "long good runs across many windows of 5",
           block(power=10, window=5, hysteresis=1), flags("O G60 O2 G31"))
    yield ("reach_min_h1", "halving down to the minimum 1, then overflows there (DeepSpeed raises)",
           block(power=5, window=3, hysteresis=1), flags("O5 G1 O2 G4 O G2 O3 G5"))
    yield ("reach_min_h2", "down to the minimum 2 with hysteresis 2",
           block(power=4, window=2, hysteresis=2, min_scale=2), flags("O3 G1 O O G3 O3 G2 O2 G4 O"))
    yield ("reach_min_h2_consecutive", "the same with consecutive hysteresis",
           block(power=4, window=2, hysteresis=2, consecutive=True, min_scale=2),
           flags("O3 G1 O O G3 O3 G2 O2 G4 O"))
    yield ("min_not_power_of_two", "minimum 3: 16, 8, 4, then max(2, 3) = 3; doubling from 3 gives 6, 12",
           block(power=4, window=2, hysteresis=1, min_scale=3), flags("O3 G1 O G3 O O2 G6 O4 G3"))
    yield ("initial_below_min", "initial scale 1 below the minimum 4: the first overflow raises the scale to 4, "
           "without an exception (the scale was not equal to the minimum)",
           block(power=0, window=2, hysteresis=1, min_scale=4), flags("G2 O G3 O2 G1 O"))
    yield ("initial_equals_min", "an overflow on the first step at the minimum scale",
           block(power=0, window=1, hysteresis=1, min_scale=1), flags("O G3 O"))
    yield ("min_h3_consecutive", "at the minimum, hysteresis 3 refilled by good steps: only a third overflow in "
           "a row raises", block(power=3, window=1, hysteresis=3, consecutive=True, min_scale=8),
           flags("O2 G O2 G O3 G2 O"))
    yield ("static_scale", "a fixed loss_scale: DeepSpeed's static LossScaler, nothing changes",
           block(loss_scale=128, window=2, hysteresis=2), flags("G3 O2 G3 O"))
    yield ("deepspeed_defaults", "the fp16 block with no scaler keys: DeepSpeed's defaults (2**16, window 1000, "
           "hysteresis 2, min 1), across two windows of 1000", {}, flags("G1001 O2 G1002 O G3"))


def random_runs():
    """Every window x hysteresis x consecutive: runs of good steps and overflow bursts of seeded random
    lengths (recorded in the data, so the tests stay deterministic), sized so that windows close, hysteresis
    is used up, and the minimum is reached."""
    import numpy as np
    for i, (window, hysteresis, consecutive) in enumerate(itertools.product((1, 2, 3, 5), (1, 2, 3), (False, True))):
        rng = np.random.default_rng(1000 + i)
        seq = []
        while len(seq) < 90:
            seq += [0] * int(rng.integers(0, 3 * window + 3)) + [1] * int(rng.integers(1, hysteresis + 2))
        name = f"random_w{window}_h{hysteresis}" + ("_consecutive" if consecutive else "")
        yield (name, f"seeded random runs (numpy seed {1000 + i})",
               block(power=6, window=window, hysteresis=hysteresis, consecutive=consecutive, min_scale=2), seq[:90])


def run_trace(ds, torch, name, what, fp16, overflow):
    precision = ds["deepspeed.runtime.precision_config"]
    scaler_module = ds["deepspeed.runtime.fp16.loss_scaler"]
    config = precision.get_float16_config({"fp16": dict(enabled=True, **fp16)})
    dynamic = config.loss_scale == 0  # DeepSpeedEngine.dynamic_loss_scale()
    args = config.dynamic_loss_scale_args()
    engine = scaler_module.CreateLossScaler(dtype=torch.half, static_loss_scale=config.loss_scale,
                                            dynamic_scaling=dynamic, dynamic_loss_args=args)
    going_on = (scaler_module.DynamicLossScaler(dtype=torch.half, raise_error_at_min_scale=False, **args)
                if dynamic else copy.deepcopy(engine))

    def hysteresis(scaler):
        return getattr(scaler, "cur_hysteresis", None)

    trace = dict(name=name, what=what, fp16={k: getattr(config, k) for k in SCALER_KEYS},
                 initial=dict(scale=float(engine.cur_scale), hysteresis=hysteresis(engine)),
                 overflow=list(overflow), scale=[], hysteresis=[], raises_at=[], exception=None)
    engine_alive = True
    for step, flag in enumerate(overflow):
        probe = copy.deepcopy(going_on)
        if dynamic:
            probe.raise_error_at_min_scale = True  # as the engine builds it
        try:
            probe.update_scale(bool(flag))
        except Exception:
            trace["raises_at"].append(step)
        going_on.update_scale(bool(flag))
        if engine_alive:
            try:
                engine.update_scale(bool(flag))
            except Exception as error:  # DeepSpeed's run ends here
                engine_alive = False
                trace["exception"] = f"{type(error).__name__}: {error}"
                assert trace["raises_at"] and trace["raises_at"][0] == step, (name, step)
            else:
                same = (engine.cur_scale, hysteresis(engine)) == (going_on.cur_scale, hysteresis(going_on))
                assert same, (name, step)  # the two scalers differ only from the engine's exception on
        scale = float(going_on.cur_scale)
        assert 0 < scale < 2.0 ** 100, (name, step, scale)  # exact in float32 (zeroflax's scale dtype)
        trace["scale"].append(scale)
        trace["hysteresis"].append(hysteresis(going_on))
    assert engine_alive == (not trace["raises_at"]), name
    return trace, engine


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--deepspeed", required=True, help="a DeepSpeed git directory (bare is fine)")
    ap.add_argument("--rev", default="HEAD")
    ap.add_argument("--out", default="tests/data/loss_scale_traces.json")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)  # the scaler's per-overflow info lines stay quiet

    commit = git(args.deepspeed, "rev-parse", f"{args.rev}^{{commit}}").strip()
    date = git(args.deepspeed, "show", "-s", "--format=%cI", commit).strip()
    ds = load_deepspeed(args.deepspeed, commit)
    import torch

    traces, engine_raise = [], None
    for case in itertools.chain(scripted(), random_runs()):
        trace, engine = run_trace(ds, torch, *case)
        traces.append(trace)
        if hasattr(engine, "raise_error_at_min_scale"):
            engine_raise = engine.raise_error_at_min_scale
    names = [t["name"] for t in traces]
    assert len(set(names)) == len(names)
    defaults = ds["deepspeed.runtime.precision_config"].DeepSpeedFP16Config()
    data = dict(
        source=dict(repository="deepspeedai/DeepSpeed", commit=commit, commit_date=date, files=sorted(FILES.values())),
        generator="tools/gen_loss_scale_traces.py", torch=torch.__version__,
        engine_scaler=dict(cls="DynamicLossScaler via CreateLossScaler (ZeRO stages 1-3)",
                           raise_error_at_min_scale=engine_raise),
        fp16_defaults={k: getattr(defaults, k) for k in SCALER_KEYS},
        traces=traces)
    with open(args.out, "w") as f:  # one line per field of a trace: readable, and a diff shows what moved
        head = [f' {json.dumps(k)}: {json.dumps(v)}' for k, v in data.items() if k != "traces"]
        body = ["  {" + ",\n   ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in t.items()) + "}" for t in traces]
        f.write("{\n" + ",\n".join(head) + ',\n "traces": [\n' + ",\n".join(body) + "\n ]\n}\n")
    steps = sum(len(t["overflow"]) for t in traces)
    raising = sum(bool(t["raises_at"]) for t in traces)
    print(f"wrote {args.out}: {len(traces)} traces, {steps} steps, {raising} traces reach DeepSpeed's min-scale "
          f"exception; DeepSpeed {commit[:12]} ({date})")


if __name__ == "__main__":
    main()
