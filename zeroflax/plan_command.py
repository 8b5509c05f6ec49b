"""`zeroflax plan`: its flags (the search space, the memory budgets in bytes such as 80GB or 16MiB, the
rates of the cost model), the search of plan.py on --devices simulated CPU devices, its table, and the
winner written as a gin file (--out) and every candidate as JSON (--json). Its --help is plan.py's
docstring.
"""
from __future__ import annotations

import argparse
import json
import re
import sys

from zeroflax.axes import DATA_AXIS
from zeroflax import plan
from zeroflax.command_flags import add_gin_flags, force_cpu_devices, int_list, parse_gin
from zeroflax.config import ConfigError
from zeroflax.cost import DISK_BANDWIDTH, Rates

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str, flag: str) -> float:
    """'80GB' (powers of 1000), '80GiB' (powers of 1024), or a plain number of bytes."""
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not found or found.group(2).upper() not in _UNITS:
        raise ConfigError(flag, f"cannot read {text!r} as a size", "write e.g. 80GB, 80GiB or 16MiB")
    value = float(found.group(1)) * _UNITS[found.group(2).upper()]
    if value <= 0:
        raise ConfigError(flag, f"must be positive, got {text!r}")
    return value


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("plan", help="search ZeRO stage, offload, remat, micro-batching and mesh for the "
                                           "cheapest GPT configuration that fits (compile-only)",
                              description=plan.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_gin_flags(p)
    p.add_argument("--devices", type=int, default=8, help="devices (simulated CPU devices here; default 8)")
    p.add_argument("--device-memory", required=True, help="per-device budget, e.g. 80GB, 80GiB, 16MiB")
    p.add_argument("--host-memory", default=None, help="host memory budget (one host), e.g. 512GB")
    p.add_argument("--disk-memory", default=None, help="disk budget for 'nvme' candidates' state files (one host), "
                   "e.g. 2TB")
    p.add_argument("--bandwidth", type=float, default=100e9, help="collective bytes/s per device (default 100e9)")
    p.add_argument("--host-bandwidth", type=float, default=25e9, help="host<->device bytes/s (default 25e9)")
    p.add_argument("--flops", type=float, default=400e12, help="FLOP/s per device (default 400e12)")
    p.add_argument("--disk-bandwidth", type=float, default=DISK_BANDWIDTH,
                   help=f"'nvme': the state file's bytes read + written per second per device (default "
                        f"{DISK_BANDWIDTH:g}, one NVMe SSD's sequential rate)")
    p.add_argument("--stages", default="0,1,2,3", help="ZeRO stages to search (default 0,1,2,3)")
    p.add_argument("--offload", default=",".join(plan.OFFLOADS),
                   help=f"offload modes, of {','.join(plan.OFFLOAD_MODES)} (default {','.join(plan.OFFLOADS)}; "
                        "'nvme' needs --nvme-path)")
    p.add_argument("--nvme-path", default=None, help="the state's directory for 'nvme' candidates (written into "
                   "the winner's gin file; planning writes nothing there). Default: the gin config's "
                   "OffloadOptimizerConfig.nvme_path")
    p.add_argument("--remat", default=None, help="remat policies (default: all of Config.remat's)")
    p.add_argument("--micro-batches", default=None, help="micro-batch sizes (default: every divisor)")
    p.add_argument("--tensor", default=None, help="tensor sizes (default: divisors of devices and heads)")
    p.add_argument("--pipe", default="1", help="pipe sizes, e.g. 1,2,4 (default 1: no pipeline; docs/plan.md)")
    p.add_argument("--sequence", default="1", help="sequence axis sizes, e.g. 1,8,64 (default 1: no split of the "
                   "sequence; attention by Config.sequence_attention; docs/parallelism.md)")
    p.add_argument("--tie", type=float, default=0.0,
                   help="bounds within this share of the best cost count as no cheaper (default 0: strict)")
    p.add_argument("--max-compiles", type=int, default=None, help="stop compiling after this many")
    p.add_argument("--out", default=None, help="write the winner as this gin file")
    p.add_argument("--json", default=None, help="write every candidate as JSON to this file")
    p.add_argument("--show", choices=("all", "compiled"), default="all", help="table rows (default all)")
    p.add_argument("--no_progress", action="store_true")
    p.set_defaults(run=cmd_plan)


def space_from_args(args) -> plan.Space:
    from zeroflax.config import REMAT_POLICIES
    stages = int_list(args.stages, "--stages")
    if not set(stages) <= {0, 1, 2, 3}:
        raise ConfigError("--stages", f"ZeRO stages are 0-3, got {args.stages!r}")
    offloads = tuple(v.strip() for v in args.offload.split(",") if v.strip())
    if not offloads or not set(offloads) <= set(plan.OFFLOAD_MODES):
        raise ConfigError("--offload", f"must list some of {', '.join(plan.OFFLOAD_MODES)}, got {args.offload!r}")
    remats = None
    if args.remat:
        remats = tuple(v.strip() for v in args.remat.split(",") if v.strip())
        if not remats or not set(remats) <= set(REMAT_POLICIES):
            raise ConfigError("--remat", f"must list some of {', '.join(REMAT_POLICIES)}, got {args.remat!r}")
    lists = {}
    for key, flag in (("micro_batches", "--micro-batches"), ("tensor", "--tensor"), ("pipe", "--pipe"),
                      ("sequence", "--sequence")):
        text = getattr(args, key)
        lists[key] = tuple(int_list(text, flag)) if text else None
        if lists[key] and min(lists[key]) < 1:
            raise ConfigError(flag, f"sizes must be >= 1, got {text!r}")
    return plan.Space(tuple(stages), offloads, remats, **lists, nvme_path=args.nvme_path or "")


def global_batch_of(config, devices: int) -> int:
    """The fixed global batch: Config.train_batch_size, or what the input config's factors give."""
    if config.train_batch_size is not None:
        return config.train_batch_size
    sizes = config.mesh.resolve(devices)
    return config.micro_batch_size * config.grad_accum_steps * sizes[DATA_AXIS]


def cmd_plan(args) -> int:
    if args.devices < 1:
        raise ConfigError("--devices", f"must be >= 1, got {args.devices}")
    for flag, value in (("--bandwidth", args.bandwidth), ("--host-bandwidth", args.host_bandwidth),
                        ("--flops", args.flops), ("--disk-bandwidth", args.disk_bandwidth), ("--tie", args.tie + 1)):
        if not value > 0:
            raise ConfigError(flag, f"must be positive, got {value!r}")
    budget = parse_bytes(args.device_memory, "--device-memory")
    host_budget = parse_bytes(args.host_memory, "--host-memory") if args.host_memory else None
    disk_budget = parse_bytes(args.disk_memory, "--disk-memory") if args.disk_memory else None
    space = space_from_args(args)
    force_cpu_devices(args.devices)
    parse_gin(args.gin_file, args.gin_param)
    from zeroflax.config import Config
    from zeroflax.models.gpt import GPTConfig
    from zeroflax.train import TrainConfig

    base, gpt, tc = Config(), GPTConfig(), TrainConfig()
    if "nvme" in space.offloads:
        # The path goes into the winner's gin file, so a placeholder would write a job that trains nowhere.
        space.nvme_path = space.nvme_path or base.offload_optimizer.nvme_path
        if not space.nvme_path:
            raise ConfigError("--nvme-path", "--offload lists 'nvme', whose candidates keep their state in a file, "
                              "but no directory is given", "pass --nvme-path /local_nvme/zeroflax (nothing is "
                              "written there while planning), or bind OffloadOptimizerConfig.nvme_path in the gin config")
    global_batch = global_batch_of(base, args.devices)
    planner = plan.Planner(gpt, base, tc, args.devices)
    rates = Rates(args.bandwidth, args.host_bandwidth, args.flops, args.disk_bandwidth)
    result = plan.search(planner, space, budget, rates, host_budget=host_budget, global_batch=global_batch,
                         tie=args.tie, progress=not args.no_progress, max_compiles=args.max_compiles,
                         disk_budget=disk_budget)
    nvme = "nvme" in space.offloads
    print(f"zeroflax plan: GPT ({planner.spec.num_params:,} parameters), global batch {global_batch} x "
          f"{tc.seq_len} tokens, {args.devices} devices, budget {plan.format_bytes(budget)} per device"
          + (f", host {plan.format_bytes(host_budget)}" if host_budget else "")
          + (f", disk {plan.format_bytes(disk_budget)}" if disk_budget else "")
          + f"; rates: {args.bandwidth:.3g} B/s collectives, {args.host_bandwidth:.3g} B/s host, "
          + (f"{args.disk_bandwidth:.3g} B/s disk, " if nvme else "") + f"{args.flops:.3g} FLOP/s")
    print("bound: analytic lower bound of the step time; compiled: from the compiled program; args: device "
          "arguments at rest (analytic); peak model: estimate.gpt_peak; compiled: memory_analysis peak less host states")
    print(plan.format_table(result, args.show))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_dict(), f, indent=1)
    if result.winner is None:
        raise ConfigError("--device-memory", f"no candidate fits {plan.format_bytes(budget)} per device",
                          "raise the budget or widen the search (--stages, --offload, --remat, --micro-batches)")
    if args.out:
        command = "zeroflax plan " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["plan"] else "zeroflax plan"
        with open(args.out, "w") as f:
            f.write(plan.gin_text(result, base, args.gin_file, args.gin_param, command))
        print(f"wrote {args.out}: zeroflax train --gin_file {args.out}")
    return 0
