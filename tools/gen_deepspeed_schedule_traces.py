"""Record the learning rate every optimizer step sees under DeepSpeed's own LR schedulers.

Usage (outside the repository's venv: this needs torch, which zeroflax does not)::

    python3 -m venv /tmp/dsvenv_sched && /tmp/dsvenv_sched/bin/pip install torch==2.13.0 numpy
    mkdir -p /tmp/ds && git -C <DeepSpeed clone> show HEAD:deepspeed/runtime/lr_schedules.py > /tmp/ds/lr_schedules.py
    /tmp/dsvenv_sched/bin/python tools/gen_deepspeed_schedule_traces.py /tmp/ds/lr_schedules.py \
        --source "deepspeedai/DeepSpeed@<commit>" --out tests/data/deepspeed_schedule_traces.json

DeepSpeed's file is imported, never copied; the only stub is the tiny `deepspeed.utils.logger` it imports.
Each case builds a torch parameter, a torch.optim.AdamW over it and the scheduler with the case's params,
then follows DeepSpeed's engine: for every optimizer step it records `param_groups[0]['lr']` (the lr that
step uses; for OneCycle also `param_groups[0]['betas']`, which it cycles), runs `optimizer.step()` on a gradient, then `scheduler.step()` (deepspeed/runtime/engine.py,
`_take_model_step`, steps the scheduler after each applied optimizer step). It records the lr at `counts`
(a dense start and the neighbourhoods of warmup_num_steps and total_num_steps; every step in between is
run). A case whose construction raises stores the exception's type name: zeroflax must refuse it too.

Cases: a grid of each scheduler's parameters, and the scheduler block of every JSON file in
tests/data/deepspeed_configs/ (with "auto" values replaced as zeroflax's from_deepspeed resolves them
from the keywords in AUTO below; the case records them). A file without a scheduler block but with an
optimizer lr records that constant lr.
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import logging
import os
import sys
import types

# Values the tests pass to from_deepspeed(learning_rate=, warmup_steps=, total_steps=) for "auto" scheduler
# params; warmup_min_lr "auto" is 0 (Hugging Face's rule, which zeroflax follows).
AUTO = {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 2, "total_num_steps": 5}
CLIENT_LR = 1e-3  # the torch optimizer's lr where the JSON has no optimizer block (DeepSpeed's client optimizer)
DENSE = 40  # record every step below this count


def grid():
    """(name, scheduler type, params, optimizer lr) for the synthetic cases."""
    W, D, C, R = "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "LRRangeTest"
    yield "warmup_defaults", W, {}, 0.01  # warmup_max_lr: the optimizer's lr; 1000 log steps
    yield "warmup_one_step", W, {"warmup_num_steps": 1, "warmup_max_lr": 0.5}, 0.01  # floored to 2
    yield "warmup_log", W, {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 10}, 0.01
    yield "warmup_linear", W, {"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-3, "warmup_num_steps": 10,
                               "warmup_type": "linear"}, 0.01
    yield "warmup_linear_from_0.1", W, {"warmup_min_lr": 0.1, "warmup_max_lr": 0.2, "warmup_num_steps": 5,
                                        "warmup_type": "linear"}, 0.01
    yield "warmup_downwards", W, {"warmup_min_lr": 1e-2, "warmup_max_lr": 1e-3, "warmup_num_steps": 7}, 0.01
    yield "warmup_zero_steps", W, {"warmup_num_steps": 0}, 0.01
    yield "warmup_float_steps", W, {"warmup_num_steps": 2.5}, 0.01
    yield "decay_log", D, {"total_num_steps": 20, "warmup_num_steps": 10}, 0.01
    yield "decay_linear", D, {"total_num_steps": 20, "warmup_num_steps": 10, "warmup_type": "linear",
                              "warmup_min_lr": 1e-4, "warmup_max_lr": 2e-3}, 0.01
    yield "decay_total_below_warmup", D, {"total_num_steps": 5, "warmup_num_steps": 10}, 0.01
    yield "decay_total_equals_warmup", D, {"total_num_steps": 10, "warmup_num_steps": 10,
                                           "warmup_type": "linear"}, 0.01
    yield "decay_one_warmup_step", D, {"total_num_steps": 12, "warmup_num_steps": 1, "warmup_max_lr": 0.3}, 0.01
    yield "decay_no_total", D, {"warmup_num_steps": 10}, 0.01
    yield "cosine_log", C, {"total_num_steps": 20, "warmup_num_steps": 10}, 0.01
    yield "cosine_linear", C, {"total_num_steps": 20, "warmup_num_steps": 10, "warmup_type": "linear"}, 0.02
    yield "cosine_ratios", C, {"total_num_steps": 30, "warmup_num_steps": 5, "warmup_min_ratio": 0.1,
                               "cos_min_ratio": 0.05}, 3e-3
    yield "cosine_total_below_warmup", C, {"total_num_steps": 5, "warmup_num_steps": 10}, 0.01
    yield "cosine_total_equals_warmup", C, {"total_num_steps": 10, "warmup_num_steps": 10,
                                            "warmup_type": "linear"}, 0.01
    yield "cosine_one_warmup_step", C, {"total_num_steps": 8, "warmup_num_steps": 1}, 0.01
    yield "cosine_no_total", C, {"warmup_num_steps": 10}, 0.01
    yield "range_defaults", R, {}, 0.01
    yield "range_continuous", R, {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 3,
                                  "lr_range_test_step_rate": 0.5}, 0.01
    yield "range_staircase", R, {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 4,
                                 "lr_range_test_step_rate": 2.0, "lr_range_test_staircase": True}, 0.01
    O = "OneCycle"  # recorded with Adam's betas too: it cycles beta1 and sets beta2 to 0.99
    yield "one_cycle_symmetric", O, {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 10}, 0.01
    yield "one_cycle_asymmetric_decay", O, {"cycle_min_lr": 1e-5, "cycle_max_lr": 3e-5, "cycle_first_step_size": 12,
                                            "cycle_second_step_size": 7, "decay_step_size": 3, "decay_lr_rate": 0.5,
                                            "decay_mom_rate": 0.01, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}, 0.01
    yield "one_cycle_stairs", O, {"cycle_min_lr": 0.1, "cycle_max_lr": 0.5, "cycle_first_step_size": 12,
                                  "cycle_second_step_size": 9, "cycle_first_stair_count": 4,
                                  "cycle_second_stair_count": 3}, 0.01
    yield "one_cycle_stairs_default_second", O, {"cycle_min_lr": 0.1, "cycle_max_lr": 0.5,
                                                 "cycle_first_step_size": 8, "cycle_first_stair_count": 3}, 0.01
    yield "one_cycle_no_momentum", O, {"cycle_min_lr": 2e-4, "cycle_max_lr": 4e-4, "cycle_first_step_size": 5,
                                       "cycle_second_step_size": 0, "cycle_momentum": False, "decay_step_size": 2,
                                       "decay_lr_rate": 1.0}, 0.01
    yield "one_cycle_axolotl", O, {"cycle_min_lr": 0.00001, "cycle_max_lr": 0.00003, "cycle_first_step_size": 120}, 0.01
    yield "one_cycle_zero_first_step", O, {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 0}, 0.01


def config_cases(config_dir):
    """One case per JSON file in `config_dir` that fixes the learning rate (scheduler or optimizer lr)."""
    for path in sorted(glob.glob(os.path.join(config_dir, "*.json"))):
        with open(path) as f:
            ds = json.load(f)
        name = os.path.basename(path)
        opt_params = (ds.get("optimizer") or {}).get("params", {})
        opt_lr = opt_params.get("lr", CLIENT_LR if "optimizer" not in ds else 1e-3)
        if opt_lr == "auto":
            opt_lr = AUTO["warmup_max_lr"]
        if "scheduler" in ds:
            params = dict(ds["scheduler"].get("params", {}))
            auto = {k: AUTO[k] for k, v in params.items() if v == "auto"}
            params.update(auto)
            yield name, ds["scheduler"]["type"], params, opt_lr, auto
        elif "optimizer" in ds:
            yield name, None, {}, opt_lr, {}


def counts_for(params):
    marks = set(range(DENSE))
    if "cycle_first_step_size" in params:  # OneCycle: the cycle's end (its halves are inside the dense start
        first = params["cycle_first_step_size"]  # or listed here) and the decay after it
        marks |= set(range(first + params.get("cycle_second_step_size", first) + 25))
    for key in ("warmup_num_steps", "total_num_steps", "lr_range_test_step_size", "cycle_first_step_size"):
        n = params.get(key)
        if isinstance(n, (int, float)) and not isinstance(n, bool):
            n = int(n)
            marks |= set(range(max(0, n - 2), n + 4)) | {n + 10}
    if "warmup_num_steps" not in params and kind_uses_warmup(params):  # DeepSpeed's default warm-up, 1000 steps
        marks |= set(range(998, 1004))
    return sorted(marks)


def kind_uses_warmup(params):
    return not any(key.startswith("cycle_") for key in params)


def trace(ds_sched, torch, kind, params, optimizer_lr):
    param = torch.nn.Parameter(torch.zeros(3))
    optimizer = torch.optim.AdamW([param], lr=optimizer_lr)
    try:
        scheduler = getattr(ds_sched, kind)(optimizer, **params) if kind else None
    except Exception as e:  # recorded: zeroflax must refuse these params too
        return None, None, None, type(e).__name__
    counts = counts_for(params)
    lrs, betas = [], []
    for count in range(counts[-1] + 1):
        if count in counts:
            lrs.append(float(optimizer.param_groups[0]["lr"]))
            betas.append([float(b) for b in optimizer.param_groups[0]["betas"]])
        param.grad = torch.ones(3)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return counts, lrs, betas, None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("deepspeed_lr_schedules", help="path to DeepSpeed's deepspeed/runtime/lr_schedules.py")
    ap.add_argument("--configs", default="tests/data/deepspeed_configs")
    ap.add_argument("--out", default="tests/data/deepspeed_schedule_traces.json")
    ap.add_argument("--source", default="", help="where the DeepSpeed file came from (recorded)")
    args = ap.parse_args()

    import torch

    # lr_schedules.py imports `from deepspeed.utils import logger` only; nothing else of DeepSpeed is needed.
    stub, utils = types.ModuleType("deepspeed"), types.ModuleType("deepspeed.utils")
    utils.logger = logging.getLogger("deepspeed")
    stub.utils = utils
    sys.modules.update({"deepspeed": stub, "deepspeed.utils": utils})
    spec = importlib.util.spec_from_file_location("ds_lr_schedules", args.deepspeed_lr_schedules)
    ds_sched = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ds_sched)

    cases = []
    sources = [(name, kind, params, lr, None) for name, kind, params, lr in grid()]
    sources += [(name, kind, params, lr, auto) for name, kind, params, lr, auto in config_cases(args.configs)]
    for name, kind, params, lr, auto in sources:
        counts, lrs, betas, error = trace(ds_sched, torch, kind, params, lr)
        case = dict(name=name, type=kind, params=params, optimizer_lr=lr, counts=counts, lrs=lrs, error=error)
        if kind == "OneCycle" and betas is not None:  # the others leave torch's AdamW betas (0.9, 0.999) alone
            case["betas"] = betas
        if auto is not None:
            case.update(config=name, auto=auto)
        cases.append(case)
    meta = dict(source=args.source, generator="tools/gen_deepspeed_schedule_traces.py", torch=torch.__version__,
                protocol="lrs[i] (betas[i], OneCycle only): param_groups[0]['lr'] ('betas') before optimizer step "
                         "number counts[i] (0-based); scheduler.step() after every optimizer.step()")
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, cases=cases), f, indent=1)
        f.write("\n")
    errors = sum(c["error"] is not None for c in cases)
    print(f"wrote {args.out}: {len(cases)} cases ({errors} refused by DeepSpeed)")


if __name__ == "__main__":
    main()
