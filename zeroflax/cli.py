"""`zeroflax` command line: train (gin-configured, or from a DeepSpeed JSON), generate, launch, estimate, plan.

    zeroflax train --gin_file experiments/gpt_tiny_zero3.gin --gin_param 'Config.zero_stage = 2'
    zeroflax train --gin_file experiments/gpt_tiny_zero3.gin --resume
    zeroflax generate --checkpoint runs/gpt_tiny --prompt "The "
    zeroflax launch --nproc 2 -- zeroflax train --gin_file experiments/gpt_tiny_zero3.gin
    zeroflax train --deepspeed_config ds_config.json --gin_param 'TrainConfig.steps = 600'
    zeroflax estimate --params 1.3e9 --devices 8          # DeepSpeed's estimator beside zeroflax's
    zeroflax plan --devices 8 --device-memory 16MiB --gin_file experiments/gpt_tiny_zero3.gin --out plan.gin
    zeroflax export --checkpoint runs/gpt_tiny --format safetensors --dtype bf16   # docs/export.md

Errors in the user's input (config, gin, data, checkpoints, mesh) print one line and exit with 2.
"""
from __future__ import annotations

import argparse
import os
import socket
import sys

from zeroflax import estimate_command, explain_command, export, plan_command
from zeroflax.command_flags import add_gin_flags, force_cpu_devices, parse_gin
from zeroflax.distributed import DEVICES_ENV, env_int, run_processes

EXIT_USAGE = 2


def cmd_train(args) -> int:
    if args.cpu_devices < 1:
        from zeroflax.config import ConfigError
        raise ConfigError("--cpu_devices", f"must be at least 1, got {args.cpu_devices}")
    force_cpu_devices(env_int(DEVICES_ENV, 1, args.cpu_devices))
    from zeroflax.distributed import maybe_initialize
    parse_gin(args.gin_file, args.gin_param)
    maybe_initialize()
    from zeroflax.config import Config
    from zeroflax.models.gpt import GPTConfig
    from zeroflax.train import TrainConfig, deepspeed_job, train
    tc, config, model_config, imported = TrainConfig(), Config(), GPTConfig(), {}
    if args.deepspeed_config:  # docs/from_deepspeed.md: gin keeps what the JSON leaves; conflicts are errors
        from zeroflax.deepspeed_config import gin_bound
        job = deepspeed_job(args.deepspeed_config, tc, config, model_config, gin_bound())
        config, model_config = job.config, job.model_config
        imported = {"optimizer": job.optimizer, "schedule": job.schedule}
    train(tc, config, model_config, resume=args.resume, stop_at=args.stop_at, progress=not args.no_progress,
          overwrite=args.overwrite, **imported)
    return 0


def cmd_generate(args) -> int:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    from zeroflax.checkpoint import read_meta, restore_params
    from zeroflax.generate import generate_text
    from zeroflax.models.gpt import GPT, GPTConfig

    directory = args.checkpoint
    if os.path.isdir(os.path.join(directory, "checkpoints")):
        directory = os.path.join(directory, "checkpoints")  # a training workdir was given
    step, meta = read_meta(directory, args.step)
    model_config = GPTConfig.from_dict(meta["model"])
    model = GPT(model_config)
    from zeroflax.adapters import unbox
    abstract, _ = unbox(jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), jax.numpy.zeros((1, model_config.max_len), "int32"))["params"]))
    device = jax.devices("cpu")[0]
    params = restore_params(directory, abstract, jax.sharding.SingleDeviceSharding(device), step)
    print(generate_text(model_config, params, args.prompt, args.length, args.temperature, args.seed))
    return 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cmd_launch(args) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        from zeroflax.config import ConfigError
        raise ConfigError("zeroflax launch", "give the command after --, e.g. zeroflax launch --nproc 2 -- zeroflax "
                          "train ...")
    return run_processes(command, args.nproc, args.port or _free_port(), args.devices_per_process)


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad flag reported as every other input error: one line, exit status 2."""

    def error(self, message):
        self.exit(EXIT_USAGE, f"zeroflax: error: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="zeroflax", description="DeepSpeed's ZeRO training, natively in JAX.")
    sub = parser.add_subparsers(dest="command_name", required=True)

    train = sub.add_parser("train", help="train the GPT from gin configs")
    add_gin_flags(train, param_help="gin binding, e.g. 'Config.zero_stage = 2'")
    train.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    train.add_argument("--overwrite", action="store_true",
                       help="remove an earlier run in the workdir (checkpoints, metrics, TensorBoard) and start anew")
    train.add_argument("--stop_at", type=int, default=None, help="stop (with a checkpoint) after this step")
    train.add_argument("--cpu_devices", type=int, default=8, help="simulated CPU devices per process (default 8)")
    train.add_argument("--no_progress", action="store_true", help="no progress bar")
    train.add_argument("--deepspeed_config", default=None,
                       help="a DeepSpeed JSON config: ZeRO, precision, batch, optimizer and LR schedule")
    train.set_defaults(run=cmd_train)

    gen = sub.add_parser("generate", help="sample text from a checkpoint on one CPU device")
    gen.add_argument("--checkpoint", required=True, help="a training workdir or its checkpoints/ directory")
    gen.add_argument("--prompt", default="The ")
    gen.add_argument("--length", type=int, default=200)
    gen.add_argument("--temperature", type=float, default=0.7)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    gen.set_defaults(run=cmd_generate)

    launch = sub.add_parser("launch", help="run a command as N local processes of one distributed job")
    launch.add_argument("--nproc", type=int, required=True)
    launch.add_argument("--devices_per_process", type=int, default=None,
                        help="simulated CPU devices per process (default: 8 / nproc)")
    launch.add_argument("--port", type=int, default=None)
    launch.add_argument("command", nargs=argparse.REMAINDER)
    launch.set_defaults(run=cmd_launch)
    estimate_command.add_parser(sub)
    plan_command.add_parser(sub)
    export.add_parser(sub)
    explain_command.add_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command_name == "launch" and args.devices_per_process is None:
        args.devices_per_process = max(1, 8 // args.nproc)
    from zeroflax.checkpoint import CheckpointError, SaveError
    from zeroflax.config import ConfigError
    from zeroflax.data import DataError
    from zeroflax.train import NonFiniteError
    try:
        return args.run(args)
    except (ConfigError, DataError, CheckpointError) as error:
        print(f"zeroflax: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except NonFiniteError as error:  # the run, not its input: its own status
        print(f"zeroflax: error: {error}", file=sys.stderr)
        return 1
    except SaveError as error:
        # orbax's save threads may still be printing their reports of the failed writes: one write, on a line
        # of its own, so that theirs cannot split it.
        sys.stderr.write(f"\nzeroflax: error: {error}\n")
        sys.stderr.flush()
        return 1
    except KeyboardInterrupt:
        print("zeroflax: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
