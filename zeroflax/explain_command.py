"""`zeroflax explain`: the layer report of explain.py for the GPT of the gin files at each ZeRO stage in
--stages, compiled (never run) on --devices simulated CPU devices from abstract inputs
(`plan.abstract_gpt_engine`): one table per stage, and optionally the figure (--png) and the reports as
JSON (--json). Its --help is explain.py's docstring.
"""
from __future__ import annotations

import argparse
import json

from zeroflax import explain
from zeroflax.command_flags import add_gin_flags, force_cpu_devices, int_list, parse_gin
from zeroflax.config import ConfigError


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "explain", help="where the memory goes: every byte of the GPT's compiled step per layer and category, "
                        "per ZeRO stage (compile-only), as a table and a figure",
        description=explain.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_gin_flags(p)
    p.add_argument("--devices", type=int, default=8, help="devices (simulated CPU devices here; default 8)")
    p.add_argument("--stages", default="0,1,2,3", help="ZeRO stages, one panel each (default 0,1,2,3)")
    p.add_argument("--png", default=None, help="write the figure here (needs matplotlib)")
    p.add_argument("--json", default=None, help="write the reports here as JSON")
    p.set_defaults(run=cmd_explain)


def cmd_explain(args) -> int:
    stages = int_list(args.stages, "--stages")
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise ConfigError("--stages", f"ZeRO stages are 0-3, got {args.stages!r}")
    if args.devices < 1:
        raise ConfigError("--devices", f"must be >= 1, got {args.devices}")
    force_cpu_devices(args.devices)
    parse_gin(args.gin_file, args.gin_param)
    from zeroflax.config import Config
    from zeroflax.models.gpt import GPTConfig
    from zeroflax.plan import abstract_gpt_engine
    from zeroflax.train import TrainConfig, make_optimizer

    base, gpt, tc = Config(), GPTConfig(), TrainConfig()
    reports = []
    for stage in stages:
        try:
            engine, state, batch = abstract_gpt_engine(gpt, base.replace(zero_stage=stage), make_optimizer(tc),
                                                       tc.seq_len)
        except ConfigError as error:  # e.g. 1-bit Adam at stage 3: the other stages still say something
            if len(stages) == 1:
                raise
            print(f"ZeRO stage {stage}: refused by this configuration: {str(error).splitlines()[0]}\n", flush=True)
            continue
        reports.append(explain.layer_report(engine, state, batch))
        print(reports[-1], "\n", flush=True)
    if not reports:
        raise ConfigError("--stages", f"this configuration refuses every stage in {args.stages!r}")
    if args.png:
        explain.plot_layers(reports, args.png, f"GPT ({gpt.num_layers} layers, d_model {gpt.d_model}), "
                                               f"{args.devices} devices: memory per device by layer")
        print(f"wrote {args.png}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.to_dict() for r in reports], f, indent=1)
        print(f"wrote {args.json}")
    return 0
