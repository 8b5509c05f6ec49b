"""`zeroflax estimate`: its flags, and the table it prints of `estimate.estimate`'s rows (DeepSpeed's
estimator beside zeroflax's placement) for a bare parameter count or the GPT of the gin files, and below it
the NVMe rows' disk and host buffers (a table of their own, so that the main one's columns stay as they
were). Its --help is estimate.py's docstring.
"""
from __future__ import annotations

import argparse
import json

from zeroflax.axes import DATA_AXIS, TENSOR_AXIS
from zeroflax import estimate
from zeroflax.command_flags import add_gin_flags, parse_gin
from zeroflax.config import ConfigError


def format_table(result: dict, unit: str = "auto") -> str:
    """The printed table of an `estimate.estimate` result, in `unit` (auto: GiB or MiB), and what its columns mean."""
    rows = result["rows"]
    values = [v for r in rows for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
              and k not in ("stage",)]
    if unit == "auto":
        unit = "GiB" if max(values, default=0) >= 2**30 else "MiB"
    scale = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}[unit]
    show = lambda v: f"{'-':>10}" if v is None else f"{v / scale:10.2f}"
    mesh = " x ".join(f"{k} {v}" for k, v in result["mesh"].items())
    lines = [f"zeroflax estimate: {result['model']}, largest layer {result['largest_layer_params']:,} parameters; "
             f"{result['devices_per_node']} devices per node x {result['nodes']} node(s); mesh {mesh}; "
             f"{result['precision']} compute"
             + (f"; persistence threshold {result['persistence_threshold']:,}" if result.get("train") else
                " (a bare count: every parameter partitioned)")]
    train = result.get("train")
    if train:
        lines.append(f"micro-batch {train['micro_batch']} x {train['accum']} accumulation steps, sequence "
                     f"{train['seq']}, remat '{train['remat']}'")
    lines += ["",
              f"{'':24}| {'DeepSpeed (estimator)':^21} | {'zeroflax (placement), per device':^43} | {'host':^21}",
              f"{'stage  offload':<24}| {'GPU':>10}{'CPU/node':>11} | {'at rest':>10}{'+ grads':>11}"
              f"{'peak':>11}{'arguments':>11} | {'per dev':>10}{'per node':>11}   ({unit})"]
    for r in rows:
        peak = show(r["peak"]) if r.get("refused") is None else f"{'refused':>10}"
        lines.append(f"{r['stage']:<7}{r['offload']:<17}| {show(r['deepspeed_gpu'])} {show(r['deepspeed_cpu_per_node'])} | "
                     f"{show(r['device_at_rest'])} {show(r['device_with_grads'])} {peak} {show(r.get('device_arguments'))} | "
                     f"{show(r['host_per_device'])} {show(r['host_per_node'])}")
    nvme = [r for r in rows if r["offload"] == "nvme"]
    if nvme:
        lines += ["",
                  f"{'NVMe (offload_optimizer nvme)':<30}| {'disk':^21} | {'host buffers':>12} | {'disk I/O per step':>17}",
                  f"{'stage  offload':<30}| {'per dev':>10}{'per node':>11} | {'per process':>12} | "
                  f"{'per dev, each way':>17}   ({unit})"]
        for r in nvme:
            refused = "   refused: " + r["refused"] if r.get("refused") else ""
            lines.append(f"{r['stage']:<7}{r['offload']:<23}| {show(r['disk_per_device'])} {show(r['disk_per_node'])} | "
                         f"{show(r['host_buffers']):>12} | {show(r['disk_per_device']):>17}{refused}")
    lines += ["",
              "DeepSpeed: its estimate_zero2/zero3_model_states_mem_needs formulas (stages 2 and 3 only; zero_init="
              f"{result['zero_init']}, additional_buffer_factor={result['buffer_factor']}): GPU = model states with "
              "gradients (and one gathered largest layer at stage 3) per GPU; CPU per node.",
              "zeroflax: its sharding policy leaf by leaf. at rest = parameters + optimizer state (+ compute copy "
              "under offload) in device memory; + grads = with the fp32 gradient buffer (the quantity DeepSpeed's GPU "
              "column describes); host = master weights + optimizer state in host memory under offload.",
              "nvme (ZeRO-Infinity; DeepSpeed's estimators have no such row): master weights + optimizer state on "
              "disk, true elements (4 + K bytes each; a leaf below the persistence threshold whole per device), read "
              "and written once per step; the device holds the compute copy and the reduced fp32 gradient shard; "
              "host memory only the stream's buffers (buffer_count x min(buffer_size, largest leaf shard) x (4 + K) "
              "bytes per process).",
              "arguments (gin configs) = device states + this device's batch rows: the step's arguments in device "
              "memory. With the host states added ('arguments' in --json) it is what XLA:CPU's "
              "compiled.memory_analysis().argument_size_in_bytes counts (tests/test_estimate.py: within 0.1%).",
              "peak (a GPT from gin; no pipe axis) = device arguments + gradients + activations kept for the "
              "backward pass + the layer being recomputed: a model of memory_analysis' argument + output + temp - "
              "alias less the host states ('peak_with_host' in --json is compared; measured error -10% to +28%, docs/plan.md)."]
    return "\n".join(lines)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("estimate", help="memory per device and per host for ZeRO stages 0-3 with and "
                                               "without offload: DeepSpeed's formulas beside zeroflax's placement",
                              description=estimate.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_gin_flags(p, file_help="gin config file (repeatable): the GPT of zeroflax train")
    p.add_argument("--params", type=float, default=None, help="a bare parameter count instead of a gin config, e.g. 1.3e9")
    p.add_argument("--largest_layer_params", type=float, default=None,
                   help="with --params: the largest layer's parameters (DeepSpeed's ZeRO-3 formula; default 0)")
    p.add_argument("--precision", choices=("fp32", "bf16", "fp16"), default=None,
                   help="with --params: the compute dtype (default bf16); a gin config has Config.precision")
    p.add_argument("--devices", type=int, default=8, help="devices per node (default 8)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--no_zero_init", action="store_true", help="DeepSpeed's zero_init=False (stage 3 CPU figure)")
    p.add_argument("--buffer_factor", type=float, default=1.5, help="DeepSpeed's additional_buffer_factor (default 1.5)")
    p.add_argument("--unit", choices=("auto", "GiB", "MiB", "KiB", "B"), default="auto")
    p.add_argument("--json", action="store_true", help="print JSON (bytes) instead of the table")
    p.set_defaults(run=cmd_estimate)


def cmd_estimate(args) -> int:
    for flag, value in (("--devices", args.devices), ("--nodes", args.nodes)):
        if value < 1:
            raise ConfigError(flag, f"must be >= 1, got {value}")
    if not args.buffer_factor > 0:
        raise ConfigError("--buffer_factor", f"must be > 0, got {args.buffer_factor}")
    devices = args.devices * args.nodes
    if args.params is not None:
        if args.gin_file or args.gin_param:
            raise ConfigError("--params", "give either --params or a gin config (--gin_file/--gin_param), not both")
        spec, config = estimate.spec_from_params(args.params, args.largest_layer_params), None
        setup = estimate.Setup({DATA_AXIS: devices, TENSOR_AXIS: 1}, args.devices, args.precision or "bf16")
        train = None
    else:
        for flag, value in (("--largest_layer_params", args.largest_layer_params), ("--precision", args.precision)):
            if value is not None:
                raise ConfigError(flag, "only goes with --params (a gin config's GPT and Config have their own)")
        parse_gin(args.gin_file, args.gin_param)
        from zeroflax.config import Config
        from zeroflax.models.gpt import GPTConfig
        from zeroflax.train import TrainConfig, make_optimizer
        config, gpt, tc = Config(), GPTConfig(), TrainConfig()
        spec = estimate.spec_from_gpt(gpt, make_optimizer(tc))
        setup = estimate.Setup(config.mesh.resolve(devices), args.devices, config.precision,
                               config.persistence_threshold, config.logical_rules)
        train = dict(micro_batch=config.micro_batch_size, accum=config.grad_accum_steps, seq=tc.seq_len,
                     remat=config.remat)
    result = estimate.estimate(spec, setup, args.nodes, zero_init=not args.no_zero_init,
                               buffer_factor=args.buffer_factor, train=train, config=config)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(format_table(result, args.unit))
    return 0
