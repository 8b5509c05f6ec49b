"""The main job: train the byte-level GPT on real text with the ZeRO engine.

Progress bar (tqdm) with loss, tokens/s and ETA; metrics to `metrics.jsonl` and TensorBoard;
validation bits per byte before, during and after; asynchronous orbax checkpoints with the data
loader's position, so `resume=True` continues exactly; a sample of generated text at the end.
Configured with gin (`TrainConfig`, `GPTConfig`, `Config`, `MeshConfig`, `LossScaleConfig`).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from zeroflax import workdir
from zeroflax import checkpoint
from zeroflax.checkpoint import Checkpointer, CheckpointError, SaveError, true_shapes
from zeroflax.config import Config, ConfigError, configurable
from zeroflax.data import DataError, TokenLoader, load_tokens, train_val_split, validation_batches
from zeroflax.engine import initialize
from zeroflax.generate import generate_text
from zeroflax.memory import memory_report
from zeroflax.models.gpt import GPT, GPTConfig, next_token_loss
from zeroflax.optim.clipping import all_finite
from zeroflax.optim.onebit import onebit_adam
from zeroflax.optim.onebit_lamb import onebit_lamb
from zeroflax.optim.zero_one_adam import zero_one_adam

OPTIMIZERS = ("adamw", "onebit_adam", "onebit_lamb", "zero_one_adam")
ADAM_BETAS = (0.9, 0.95)  # the main job's Adam betas and eps (also "auto" in a DeepSpeed JSON's optimizer)
ADAM_EPS = 1e-8
# 1-bit LAMB's own: DeepSpeed's default b2 and the max_coeff of DeepSpeedExamples' 1-bit LAMB configs. With
# max_coeff 10 the main job diverged in the compressed phase (lr 1e-2 and 3e-2, b2 0.95 or 0.999); with these
# two it ends level with AdamW (docs/onebit_adam.md, "1-bit LAMB": the runs).
LAMB_B2 = 0.999
LAMB_MAX_COEFF = 0.3


@configurable
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """workdir: checkpoints, metrics.jsonl and TensorBoard events go here.
    data: 'builtin' (English text shipped with Python), a text file, or a .npy file of tokens.
    steps: optimizer steps in total (the learning-rate schedule spans them).
    checkpoint_every / keep_checkpoints: save every K steps, keep the newest N (and always the last).
    eval_every: validation every K steps (0: only before and after); eval_batches: batches per validation.
    optimizer: 'adamw', 'onebit_adam', 'onebit_lamb' or 'zero_one_adam' (zeroflax.optim.onebit_adam /
        onebit_lamb / zero_one_adam with the same betas, learning-rate schedule and weight decay; 1-bit LAMB
        takes b2 0.999 and max_coeff 0.3 (LAMB_B2, LAMB_MAX_COEFF), and its learning rate is the step relative
        to each layer's weight norm, so it wants its own: 3e-2 in the main job) whose warm-up lasts
        `freeze_step` steps (0/1 Adam: var_freeze_step; its other intervals DeepSpeed's defaults);
        `onebit_local_clip` gives them DeepSpeed's clipping in the compressed phase (each device clips its
        local gradient) instead of one factor from the mean gradient's sketched norm (docs/onebit_adam.md).
    init_from: a safetensors file (`zeroflax export`) the run's parameters start from; the optimizer state
        starts fresh. A resumed run continues from its checkpoint (which started from the same file); resuming
        one that started from another file, or from none, is refused as ambiguous (docs/export.md).
    """

    workdir: str = "runs/gpt_tiny"
    data: str = "builtin"
    val_fraction: float = 0.05
    seq_len: int = 128
    steps: int = 500
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.1
    optimizer: str = "adamw"
    freeze_step: int = 75
    onebit_local_clip: bool = False
    log_every: int = 10
    eval_every: int = 0
    eval_batches: int = 8
    checkpoint_every: int = 100
    keep_checkpoints: int = 3
    async_checkpointing: bool = True
    tensorboard: bool = True
    sample_prompt: str = "The "
    sample_length: int = 200
    sample_temperature: float = 0.7
    init_from: str = ""

    def __post_init__(self):
        positive = ("seq_len", "steps", "log_every", "eval_batches", "checkpoint_every", "keep_checkpoints")
        for key in positive:
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"TrainConfig.{key}", f"must be a positive integer, got {value!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError("TrainConfig.optimizer", f"unknown optimizer {self.optimizer!r}",
                              f"use one of {', '.join(OPTIMIZERS)}")
        if not isinstance(self.onebit_local_clip, bool):
            raise ConfigError("TrainConfig.onebit_local_clip", f"must be True or False, got {self.onebit_local_clip!r}")
        for key in ("warmup_steps", "eval_every", "sample_length", "freeze_step"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"TrainConfig.{key}", f"must be an integer >= 0, got {value!r}")
        if not (isinstance(self.learning_rate, (int, float)) and self.learning_rate > 0):
            raise ConfigError("TrainConfig.learning_rate", f"must be > 0, got {self.learning_rate!r}")
        if not (isinstance(self.val_fraction, float) and 0 < self.val_fraction <= 0.5):
            raise ConfigError("TrainConfig.val_fraction", f"must be in (0, 0.5], got {self.val_fraction!r}")
        if self.init_from and not os.path.isfile(self.init_from):
            raise ConfigError("TrainConfig.init_from", f"{self.init_from} does not exist", "give a safetensors file "
                              "written by zeroflax export")
        if self.warmup_steps >= self.steps:
            raise ConfigError("TrainConfig.warmup_steps", f"{self.warmup_steps} must be below steps ({self.steps})")


def make_schedule(tc: TrainConfig):
    """The main job's learning rate: linear warm-up to TrainConfig.learning_rate, cosine decay to a tenth."""
    return optax.warmup_cosine_decay_schedule(0.0, tc.learning_rate, tc.warmup_steps, tc.steps,
                                              end_value=tc.learning_rate * 0.1)


def make_optimizer(tc: TrainConfig, schedule=None) -> optax.GradientTransformation:
    """TrainConfig's optimizer; `schedule` (a number or an optax schedule) replaces make_schedule(tc)."""
    schedule = make_schedule(tc) if schedule is None else schedule
    b1, b2 = ADAM_BETAS
    if tc.optimizer == "onebit_adam":
        return onebit_adam(schedule, b1=b1, b2=b2, eps=ADAM_EPS, weight_decay=tc.weight_decay,
                           freeze_step=tc.freeze_step, local_clip=tc.onebit_local_clip)
    if tc.optimizer == "onebit_lamb":
        return onebit_lamb(schedule, b1=b1, b2=LAMB_B2, eps=ADAM_EPS, weight_decay=tc.weight_decay,
                           freeze_step=tc.freeze_step, max_coeff=LAMB_MAX_COEFF, local_clip=tc.onebit_local_clip)
    if tc.optimizer == "zero_one_adam":
        return zero_one_adam(schedule, b1=b1, b2=b2, eps=ADAM_EPS, weight_decay=tc.weight_decay,
                             var_freeze_step=tc.freeze_step, local_clip=tc.onebit_local_clip)
    return optax.adamw(schedule, b1=b1, b2=b2, eps=ADAM_EPS, weight_decay=tc.weight_decay)


class DeepSpeedJob(NamedTuple):
    config: Config
    model_config: GPTConfig
    optimizer: optax.GradientTransformation
    schedule: Any


# How the notes of `zeroflax train --deepspeed_config` name the source of an "auto" that TrainConfig fills.
KEYWORD_LABELS = {"learning_rate": "TrainConfig.learning_rate", "weight_decay": "TrainConfig.weight_decay",
                  "betas": "the main job's Adam betas", "eps": "the main job's Adam eps",
                  "warmup_steps": "TrainConfig.warmup_steps", "total_steps": "TrainConfig.steps",
                  "hidden_size": "GPTConfig.d_model"}


def deepspeed_job(path: str, tc: TrainConfig, config: Config, model_config: GPTConfig,
                  bound: dict | None = None) -> DeepSpeedJob:
    """The main job with a DeepSpeed JSON (`zeroflax train --deepspeed_config`), docs/from_deepspeed.md.

    `config` (gin's Config) keeps what the JSON does not decide (mesh, seed, pipeline, ...); `bound` (gin's
    explicit bindings) fills keys the JSON leaves out or sets to "auto" and must agree with keys it writes;
    an "auto" neither gin nor TrainConfig fills takes Hugging Face's default (deepspeed_auto.py), not Config's.
    TrainConfig plays Hugging Face's TrainingArguments: its learning_rate, weight_decay, warmup_steps and steps
    are the values of "auto", and its optimizer is the client optimizer when the JSON has no optimizer block
    (then with the JSON's schedule, or without a scheduler block its own warm-up and cosine decay).
    """
    from zeroflax.deepspeed_config import from_deepspeed, load_json

    bound = dict(bound or {})
    ds, _ = load_json(path)
    gpt_bound = [name for name in ("GPTConfig.attention", "GPTConfig.sparsity") if name in bound]
    if "sparse_attention" in ds and gpt_bound:
        raise ConfigError("sparse_attention", f"sets the model's attention, which gin binds too ({gpt_bound[0]})",
                          "remove one of the two")
    imported = from_deepspeed(
        ds, base=config, bound=bound, learning_rate=tc.learning_rate, weight_decay=tc.weight_decay, betas=ADAM_BETAS,
        eps=ADAM_EPS, warmup_steps=tc.warmup_steps, total_steps=tc.steps, hidden_size=model_config.d_model,
        default_optimizer=lambda schedule: make_optimizer(tc, schedule), base_fills_auto=False,
        keyword_labels=KEYWORD_LABELS)
    schedule = imported.schedule if imported.schedule is not None else make_schedule(tc)
    if jax.process_index() == 0:
        print(f"--deepspeed_config {path}:")
        ignored = [k for k, block in (("learning_rate, weight_decay, optimizer", "optimizer"),
                                      ("warmup_steps", "scheduler")) if block in ds]
        for note in list(imported.notes) + [f"TrainConfig.{k}: used only where the JSON says 'auto'" for k in ignored]:
            print(f"  {note}")
    return DeepSpeedJob(imported.config, imported.model_config(model_config), imported.optimizer, schedule)


def applied_updates(state, default: int):
    """The optimizer's update count (every optax `count` in its state advances on applied updates only)."""
    from optax import tree_utils
    counts = tree_utils.tree_get_all_with_path(state.opt_state, "count")
    return jax.numpy.asarray(int(counts[0][1]) if counts else default, jax.numpy.int32)  # int(): it may be on the host


class NonFiniteError(RuntimeError):
    """Training stopped at a non-finite step (Config.nonfinite = 'error'); the message names the step."""


class MetricsLog:
    """metrics.jsonl (one JSON object per line, flushed) and, if tensorboardX is present, TensorBoard."""

    def __init__(self, workdir: str, tensorboard: bool, enabled: bool):
        self.enabled = enabled
        self.file = open(os.path.join(workdir, "metrics.jsonl"), "a") if enabled else None
        self.writer = None
        if enabled and tensorboard:
            try:
                from tensorboardX import SummaryWriter
                self.writer = SummaryWriter(os.path.join(workdir, "tensorboard"))
            except ImportError:
                print("tensorboardX is not installed: metrics go to metrics.jsonl only", file=sys.stderr)

    def write(self, step: int, **values) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()
        if self.writer is not None:
            for name, value in values.items():
                if isinstance(value, (int, float)):
                    self.writer.add_scalar(name, value, step)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.writer:
            self.writer.close()


def validation_bits_per_byte(engine, state, val_tokens, tc: TrainConfig) -> float:
    index, count = engine.batch_share()
    losses = [float(engine.evaluate(state, batch)) for batch in validation_batches(
        val_tokens, tc.seq_len, engine.train_batch_size, max_batches=tc.eval_batches,
        process_index=index, process_count=count)]
    return float(np.mean(losses)) / math.log(2)  # nats per byte -> bits per byte


def train(tc: TrainConfig | None = None, config: Config | None = None, model_config: GPTConfig | None = None, *,
          resume: bool = False, stop_at: int | None = None, progress: bool = True,
          optimizer: optax.GradientTransformation | None = None, schedule=None, overwrite: bool = False) -> dict:
    """Run (or resume) training; returns a summary (validation bits per byte, final loss, sample).

    resume: continue the run in `tc.workdir` from its newest checkpoint; overwrite: remove an earlier run
        there first. Without either, a workdir holding a run is refused (zeroflax/workdir.py).

    optimizer: replaces make_optimizer(tc), e.g. the one `zeroflax.from_deepspeed` imported.
    schedule: the learning rate as a function of the applied-update count; each metrics row then has the
        "lr" its step used (a step skipped on an fp16 overflow does not advance it, as in DeepSpeed).
    """
    tc, config, model_config = tc or TrainConfig(), config or Config(), model_config or GPTConfig()
    is_main = jax.process_index() == 0
    say = print if is_main else (lambda *a, **k: None)
    if model_config.max_len < tc.seq_len:
        raise ConfigError("GPTConfig.max_len", f"{model_config.max_len} is shorter than TrainConfig.seq_len "
                          f"{tc.seq_len}", "raise max_len or lower seq_len")
    # One run per workdir (a lock the kernel drops when the process ends), and an earlier run is
    # continued only with --resume, replaced only with --overwrite (zeroflax/workdir.py).
    if resume and overwrite:
        raise ConfigError("--overwrite", "contradicts --resume", "pass one of them")
    with workdir.WorkdirLock(tc.workdir, jax.process_index()):
        try:
            return _train_in(tc, config, model_config, resume=resume, overwrite=overwrite, stop_at=stop_at,
                             progress=progress, optimizer=optimizer, schedule=schedule, is_main=is_main, say=say)
        except (SaveError, OSError) as error:
            if isinstance(error, OSError) and not checkpoint.is_disk_full(error):
                raise
            _stopped_by_a_failed_write(error, tc.workdir)


def _stopped_by_a_failed_write(error, workdir_path: str):
    """A write failed (docs/reliability.md, "A full disk"): the run stops rather than train on with nothing
    saved. The complete checkpoints are kept; the unfinished save's temporary directory is removed by orbax
    when the run resumes."""
    directory = os.path.join(os.path.abspath(workdir_path), "checkpoints")
    steps = checkpoint.complete_steps(directory)
    what = str(error) if isinstance(error, SaveError) else f"{error.filename or workdir_path}: {error.strerror}"
    raise SaveError(what + ". " + (f"The newest complete checkpoint, step {steps[-1]}, is intact: free space "
                                   "and continue with --resume" if steps else
                                   "No checkpoint was complete: free space and start again")) from error


def _train_in(tc, config, model_config, *, resume, overwrite, stop_at, progress, optimizer, schedule, is_main,
              say) -> dict:
    """`train`, in a workdir it holds."""
    from tqdm.auto import tqdm

    tokens = load_tokens(tc.data)
    if int(tokens.max()) >= model_config.vocab_size:
        raise ConfigError("GPTConfig.vocab_size", f"the data holds token id {int(tokens.max())}, but the vocabulary "
                          f"has {model_config.vocab_size} entries")
    try:
        train_tokens, val_tokens = train_val_split(tokens, tc.val_fraction, min_tokens=tc.seq_len + 1)
    except DataError as error:
        raise DataError(f"TrainConfig.data {tc.data!r}: {error}") from error
    if tc.init_from:  # readable, before --overwrite removes anything
        from zeroflax.export import check_safetensors
        check_safetensors(tc.init_from, "TrainConfig.init_from")
    # The inputs are good: now an earlier run may be refused, or removed for --overwrite.
    workdir.prepare(tc.workdir, resume, overwrite, is_main)
    if overwrite and jax.process_count() > 1:  # the others wait until the main process has removed it
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices("zeroflax: earlier run removed")

    model = GPT(model_config)
    sample = {"tokens": np.zeros((1, tc.seq_len + 1), np.int32)}
    engine, state = initialize(next_token_loss(model),
                                        lambda rng, b: model.init(rng, b["tokens"][:, :-1])["params"],
                                        optimizer if optimizer is not None else make_optimizer(tc), config,
                                        sample_batch=sample)
    # The rows this process's devices hold: its block of the batch, or all of it when only `pipe` spans hosts.
    index, count = engine.batch_share()
    loader = TokenLoader(train_tokens, tc.seq_len, engine.train_batch_size, seed=config.seed,
                         process_index=index, process_count=count)
    checkpoints = Checkpointer(os.path.join(tc.workdir, "checkpoints"), every=tc.checkpoint_every,
                               keep=tc.keep_checkpoints, asynchronous=tc.async_checkpointing)
    meta = {"model": model_config.to_dict(), "train": dataclasses.asdict(tc),
            "config": json.loads(json.dumps(config.to_dict(), default=str))}
    latest = checkpoints.latest_step()
    # The true shapes of what is saved (a leaf stored padded is written with its padding: sharding.padding).
    shapes = true_shapes(engine.abstract_state(stored=False))
    if resume and latest is not None:
        state, data_state, old_meta = checkpoints.restore(
            latest, engine.model_order(state), engine.state_shardings, compute_copy=config.offload_optimizer.predicts,
            true_state=engine.abstract_state(stored=False), files=engine.state_files)
        if int(state.step) != latest:
            raise CheckpointError(f"checkpoint {checkpoints.directory}/{latest} holds step {int(state.step)}: its "
                                  "directory was renamed or its contents replaced; resume from an intact checkpoint")
        started_from = old_meta.get("train", {}).get("init_from", "")
        if tc.init_from and started_from != tc.init_from:  # which parameters would the user mean?
            raise ConfigError("TrainConfig.init_from", f"the run in {tc.workdir} started from "
                              f"{started_from or 'its own initialisation'}, not {tc.init_from}",
                              "drop init_from to resume it, or choose another workdir")
        state = engine.storage_order(state)  # checkpoints hold the layers in model order
        loader.restore(data_state)
        say(f"resumed from step {latest} in {checkpoints.directory}")
        for note in checkpoints.notes:
            say(note)
    elif resume and not tc.init_from:
        say(f"no checkpoint in {checkpoints.directory}: starting from scratch")
    if resume and is_main:  # restored (or none to restore): the steps after it run again, logged once
        workdir.truncate_metrics(tc.workdir, latest if latest is not None else -1)
    if tc.init_from and not (resume and latest is not None):  # a resumed run's checkpoint already holds them
        from zeroflax.export import initialize_from_safetensors
        state = initialize_from_safetensors(engine, state, tc.init_from)
        say(f"parameters from {tc.init_from} (optimizer state fresh)")
    start = int(state.step)

    num_params = sum(x.size for x in jax.tree.leaves(engine.abstract_params))
    say(f"zeroflax: GPT with {num_params:,} parameters, ZeRO stage {config.zero_stage}, {config.precision}, "
        f"mesh {dict(engine.mesh.shape)} over {jax.device_count()} devices in {jax.process_count()} process(es); "
        f"{engine.train_batch_size} x {tc.seq_len} tokens per step; {train_tokens.size:,} training bytes ({tc.data})")
    first_batch = loader.next_batch()
    # Every process compiles the report's step, though only the main one prints it: with jax 0.12 a program
    # compiled by some processes only puts their collectives out of step with the others', and the first
    # step never completes (docs/multihost.md, "Every process compiles the same programs").
    report = memory_report(engine, state, first_batch)
    if is_main:
        print(report)
    metrics_log = MetricsLog(tc.workdir, tc.tensorboard, is_main)
    bpb_before = validation_bits_per_byte(engine, state, val_tokens, tc)
    say(f"validation: {bpb_before:.3f} bits per byte at step {start}")
    metrics_log.write(start, val_bits_per_byte=bpb_before)

    end = tc.steps if stop_at is None else min(stop_at, tc.steps)
    tokens_per_step = engine.train_batch_size * tc.seq_len
    bar = tqdm(total=tc.steps, initial=start, disable=not (is_main and progress), unit="step", dynamic_ncols=True)
    last_time, last_step, batch, loss = time.perf_counter(), start, first_batch, float("nan")
    # With a schedule to log: the applied updates so far (a device scalar, so counting costs no wait), which is
    # the schedule's count: the optimizer state's own count, which skipped fp16 steps leave alone.
    applied = applied_updates(state, start) if schedule is not None else None
    warned_min_scale = False
    # fp32/bf16 (Config.nonfinite): the first step with a non-finite gradient and the steps skipped, counted
    # on the device (no wait); fp16's skipped steps are its loss scaler's business.
    watch = config.precision != "fp16"
    first_bad = skipped_steps = jax.numpy.zeros((), jax.numpy.int32)
    finite_params = jax.jit(all_finite)
    for step in range(start, end):
        if batch is None:
            batch = loader.next_batch()
        state, metrics = engine.step(state, batch)
        batch = None
        done = step + 1
        if schedule is not None:
            count, applied = applied, applied + (~metrics["skipped"]).astype(jax.numpy.int32)
        logging_now = done % tc.log_every == 0 or done == end
        saving_now = done % tc.checkpoint_every == 0 or done == end
        if watch:
            skipped_steps = skipped_steps + metrics["skipped"].astype(jax.numpy.int32)
            first_bad = jax.numpy.where((first_bad == 0) & metrics["nonfinite"], done, first_bad)
            # Checked where the loop waits anyway: at log points and before a checkpoint. A checkpoint is
            # never written with non-finite parameters (an update that overflowed on finite gradients).
            problem = None
            if config.nonfinite == "error" and (logging_now or saving_now) and int(first_bad):
                problem = (f"step {int(first_bad)}: the gradients are not finite (NaN or inf), and training stopped "
                           "(Config.nonfinite = 'error')")
            # (With the master weights in a file, NVMe offload, their compute copy is what is at hand.)
            elif saving_now and not bool(finite_params(state.params if state.params is not None else state.compute_params)):
                problem = f"step {done}: the updated parameters are not finite (NaN or inf), so they are not saved"
            if problem:
                bar.close()
                checkpoints.close()  # an earlier step's save in flight completes
                metrics_log.close()
                newest = checkpoints.latest_step()
                raise NonFiniteError(
                    problem + ". " + (f"The newest checkpoint, step {newest}, is as it was. " if newest is not None
                                      else "No checkpoint was written. ")
                    + "Lower the learning rate, look for bad values in the data, or set Config.nonfinite = 'skip' "
                    "to step over such batches")
        if logging_now:
            loss = float(metrics["loss"])  # waits for the step
            now = time.perf_counter()
            tokens_per_s = (done - last_step) * tokens_per_step / (now - last_time)
            last_time, last_step = now, done
            extra = {} if schedule is None else {"lr": float(schedule(count))}
            if watch:
                extra.update(nonfinite=bool(metrics["nonfinite"]), skipped_steps=int(skipped_steps))
            metrics_log.write(done, loss=loss, grad_norm=float(metrics["grad_norm"]),
                              loss_scale=float(metrics["loss_scale"]), skipped=bool(metrics["skipped"]),
                              tokens_per_s=tokens_per_s, **extra)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}")
            if not warned_min_scale and int(state.loss_scale.min_scale_overflows):
                warned_min_scale = True  # DeepSpeed would have stopped here; say so once, and go on
                bar.write(f"step {done}: warning: an fp16 overflow at the minimum loss scale "
                          f"(LossScaleConfig.min_loss_scale = {config.loss_scale.min_loss_scale}) was skipped; DeepSpeed "
                          "stops a run there. The loss has likely diverged: lower the learning rate or use bf16")
        if tc.eval_every and done % tc.eval_every == 0 and done != end:
            bpb = validation_bits_per_byte(engine, state, val_tokens, tc)
            metrics_log.write(done, val_bits_per_byte=bpb)
            bar.write(f"step {done}: validation {bpb:.3f} bits per byte")
        checkpoints.save(done, state, loader.state(), meta, force=done == end, view=engine.model_order,
                         shapes=shapes, files=engine.state_files)
        bar.update(1)
    bar.close()
    checkpoints.close()
    bpb_after = validation_bits_per_byte(engine, state, val_tokens, tc)
    metrics_log.write(end, val_bits_per_byte=bpb_after)
    metrics_log.close()
    say(f"validation: {bpb_after:.3f} bits per byte at step {end} (was {bpb_before:.3f}); "
        f"checkpoint in {checkpoints.directory}")
    text = ""
    if tc.sample_length:  # every process takes part in bringing the parameters whole to the host
        from jax.experimental import multihost_utils
        params = multihost_utils.process_allgather(engine.model_params(state), tiled=True)
    if is_main and tc.sample_length:
        text = generate_text(model_config, params, tc.sample_prompt, tc.sample_length, tc.sample_temperature)
        print("sample:\n" + text)
    return {"val_bpb_before": bpb_before, "val_bpb_after": bpb_after, "final_loss": loss, "steps": end,
            "sample": text, "workdir": tc.workdir}
