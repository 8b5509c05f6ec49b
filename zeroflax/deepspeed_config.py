"""DeepSpeed's JSON config -> zeroflax: `config, optimizer = zeroflax.from_deepspeed("ds_config.json")`.

The result is a `DeepSpeedImport`: it unpacks as (Config, optax optimizer) and carries the learning-rate
schedule (DeepSpeed's scheduler, `zeroflax.optim.schedules`), the sparse-attention layout for
GPTConfig.sparsity, the activation-checkpointing choice, and notes on the keys accepted as moot. What each
key becomes is the table in `deepspeed_keys.py` (rendered in docs/from_deepspeed.md). Every error is a
one-line `ConfigError` whose key is the JSON path, e.g.
    zero_optimization.stage3_prefetch_bucket_sise: unknown DeepSpeed key (the nearest known key is
    zero_optimization.stage3_prefetch_bucket_size)

Three inputs besides the JSON decide what it does not say (docs/from_deepspeed.md, "Rules"):
  * `base`: a Config whose other fields (mesh, seed, pipeline, ...) are kept, and which resolves "auto"
    batch sizes, gradient_clipping and precision (as Hugging Face fills them from its TrainingArguments);
  * `bound`: zeroflax settings fixed elsewhere (the CLI passes gin's bindings, e.g. {"Config.zero_stage": 3}):
    they fill keys the JSON leaves out or sets to "auto", and must equal the values it writes;
  * keywords (learning_rate, weight_decay, betas, eps, warmup_steps, total_steps, hidden_size): the values of
    "auto" in the optimizer and scheduler blocks and ZeRO-3's bucket sizes, by Hugging Face's rules.
Batch sizes follow DeepSpeed's rule over the data-parallel size: `world_size` if given (the mesh then has
exactly that many data devices), else the data axis of `base.mesh` over all devices.

This module is the entry: loading the JSON, the result, building the Config, gin's bindings. Each block has
its reader: deepspeed_precision (fp16, bf16), deepspeed_zero (zero_optimization, its offload blocks),
deepspeed_runtime (batch sizes, gradient_clipping, activation_checkpointing, tensor_parallel),
deepspeed_optimizer, deepspeed_scheduler, deepspeed_sparse (sparse_attention); they record the settings they
decide in a deepspeed_settings.Settings.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from typing import Any, Callable, Mapping

import jax
import optax

from zeroflax.axes import DATA_AXIS
from zeroflax.config import Config, ConfigError, MeshConfig, OffloadOptimizerConfig, OffloadParamConfig
from zeroflax.deepspeed_auto import AutoSources, resolve_auto
from zeroflax.deepspeed_keys import as_int, check_block
from zeroflax.deepspeed_optimizer import build_optimizer, fp16_loss_scaling, read_optimizer
from zeroflax.deepspeed_precision import read_autocast, read_data_types, read_precision
from zeroflax.deepspeed_runtime import read_batch, read_clipping, read_remat, read_sequence_parallel, read_tensor_parallel
from zeroflax.deepspeed_scheduler import read_scheduler
from zeroflax.deepspeed_settings import Settings
from zeroflax.deepspeed_sparse import SparseAttention, make_sparsity, read_sparse_attention
from zeroflax.deepspeed_zero import read_zero
from zeroflax.optim import schedules


# ------------------------------------------------------------------------------------------------ result
@dataclasses.dataclass(frozen=True)
class DeepSpeedImport:
    """What `from_deepspeed` returns; `config, optimizer = result` unpacks the first two.

    config: the zeroflax Config. optimizer: the optax optimizer (None when the JSON has no optimizer block
    and no `default_optimizer` was given: pass your own, as to deepspeed.initialize). For Adam and AdamW it is
    `optax.inject_hyperparams`-wrapped, so `opt_state.hyperparams['learning_rate']` is the lr the last update
    used. schedule: the lr as a function of the update count (None without scheduler block and optimizer lr).
    remat: 'full' when the JSON has an activation_checkpointing block (Config.remat is set to it), else None.
    sparse_attention: the layout class and arguments; `model_config(gpt_config)` applies them.
    hyperparameters: the optimizer's settings as zeroflax applies them. notes: accepted keys that need
    nothing under XLA, "auto" values resolved, and other caveats. data_parallel_size: the world size of
    DeepSpeed's batch rule. num_devices: the devices the mesh needs when `world_size` was given, else None.
    """

    config: Config
    optimizer: optax.GradientTransformation | None
    schedule: Callable | None
    remat: str | None
    sparse_attention: SparseAttention | None
    hyperparameters: Mapping[str, Any]
    notes: tuple[str, ...]
    data_parallel_size: int
    num_devices: int | None

    def __iter__(self):
        return iter((self.config, self.optimizer))

    def sparsity(self, num_heads: int):
        """The zeroflax SparsityConfig of the sparse_attention block for a model with `num_heads` heads."""
        return None if self.sparse_attention is None else make_sparsity(self.sparse_attention, num_heads)

    def model_config(self, gpt_config):
        """`gpt_config` with the sparse_attention block applied (unchanged without one)."""
        if self.sparse_attention is None:
            return gpt_config
        return dataclasses.replace(gpt_config, attention="sparse", sparsity=self.sparsity(gpt_config.num_heads))


# ------------------------------------------------------------------------------------------------ loading
def _no_duplicates(pairs):
    out = {}
    for key, value in pairs:
        if key in out:  # DeepSpeed refuses duplicate keys too (dict_raise_error_on_duplicate_keys)
            raise ConfigError(key, "appears twice in one JSON object", "keep one")
        out[key] = value
    return out


def load_json(source) -> tuple[dict, str]:
    """(the config dict, a name for messages) from a path or a dict."""
    if isinstance(source, Mapping):
        return dict(source), "<dict>"
    path = os.fspath(source)
    if not os.path.isfile(path):
        raise ConfigError("--deepspeed_config", f"{path} does not exist")
    with open(path) as f:
        try:
            ds = json.load(f, object_pairs_hook=_no_duplicates)
        except json.JSONDecodeError as error:
            raise ConfigError(path, f"not valid JSON: {error}") from None
    if not isinstance(ds, dict):
        raise ConfigError(path, f"must hold a JSON object, got {type(ds).__name__}")
    return ds, path


# --------------------------------------------------------------------------------------------- the entry
CONFIG_KEYS = {  # zeroflax names (in Config errors) -> JSON paths, to re-key Config's own checks
    "Config.zero_stage": "zero_optimization.stage", "Config.precision": "fp16.enabled",
    "Config.micro_batch_size": "train_micro_batch_size_per_gpu", "Config.grad_accum_steps": "gradient_accumulation_steps",
    "Config.train_batch_size": "train_batch_size", "Config.grad_clip": "gradient_clipping",
    "Config.persistence_threshold": "zero_optimization.stage3_param_persistence_threshold",
    "Config.prefetch_bucket_size": "zero_optimization.stage3_prefetch_bucket_size",
    "Config.max_live_parameters": "zero_optimization.stage3_max_live_parameters",
    "Config.max_reuse_distance": "zero_optimization.stage3_max_reuse_distance",
    "Config.quantized_weights": "zero_optimization.zero_quantized_weights", "Config.remat": "activation_checkpointing",
    "OffloadOptimizerConfig.device": "zero_optimization.offload_optimizer.device",
    "OffloadOptimizerConfig.pin_memory": "zero_optimization.offload_optimizer.pin_memory",
    "OffloadOptimizerConfig.nvme_path": "zero_optimization.offload_optimizer.nvme_path",
    "OffloadOptimizerConfig.buffer_count": "zero_optimization.offload_optimizer.buffer_count",
    "OffloadOptimizerConfig.buffer_size": "zero_optimization.sub_group_size",
    "OffloadOptimizerConfig.io_threads": "aio.thread_count",
    "OffloadParamConfig.device": "zero_optimization.offload_param.device",
    "OffloadParamConfig.pin_memory": "zero_optimization.offload_param.pin_memory",
    "MeshConfig.axes": "tensor_parallel.autotp_size",
    **{f"LossScaleConfig.{f}": f"fp16.{f}" for f in ("loss_scale", "initial_scale_power", "loss_scale_window",
                                                       "hysteresis", "consecutive_hysteresis", "min_loss_scale")},
}


def _build_config(values: dict, base: Config, axes: dict) -> Config:
    def group(prefix):
        return {name.split(".", 1)[1]: v for name, v in values.items() if name.startswith(prefix + ".")}

    fields = group("Config")
    loss_scale = dataclasses.replace(base.loss_scale, **group("LossScaleConfig"))
    opt = group("OffloadOptimizerConfig")
    offload_optimizer = (dataclasses.replace(base.offload_optimizer, **opt) if opt.get("device") in ("cpu", "nvme")
                         else OffloadOptimizerConfig(**opt))
    offload_param = OffloadParamConfig(**group("OffloadParamConfig"))
    return dataclasses.replace(base, mesh=MeshConfig(axes), loss_scale=loss_scale, offload_optimizer=offload_optimizer,
                               offload_param=offload_param, **fields)


def _rekeyed(error: ConfigError) -> ConfigError:
    """A ConfigError from zeroflax's own checks, keyed and worded by JSON paths."""
    message = str(error).splitlines()[0]  # gin appends "In call to configurable ..." on a second line
    for name in sorted(CONFIG_KEYS, key=len, reverse=True):
        message = message.replace(name, CONFIG_KEYS[name])
    message = re.sub(r"\bzero_stage\b", "zero_optimization.stage", message)  # Config's checks name it bare
    key = CONFIG_KEYS.get(error.key, error.key)
    problem = message.split(": ", 1)[1] if ": " in message else message
    return ConfigError(key, problem)


def from_deepspeed(source, *, base: Config | None = None, bound: Mapping[str, Any] | None = None,
                   learning_rate: float | None = None, weight_decay: float | None = None,
                   betas: tuple[float, float] | None = None, eps: float | None = None,
                   warmup_steps: int | None = None, total_steps: int | None = None, hidden_size: int | None = None,
                   world_size: int | None = None,
                   default_optimizer: Callable[[Callable | None], optax.GradientTransformation] | None = None,
                   base_fills_auto: bool = True, keyword_labels: Mapping[str, str] | None = None,
                   ) -> DeepSpeedImport:
    """Read a DeepSpeed config (a path to its JSON, or a dict) into zeroflax objects.

    Every "auto" is resolved first, in one place (deepspeed_auto.py): from gin's `bound`, then the keywords
    below, then `base`, then Hugging Face's defaults (TrainingArguments: micro-batch 8, lr 5e-5, clipping
    1.0, ...); `result.notes` lists each value filled and where it came from, and an "auto" nothing can
    resolve (total_num_steps without total_steps=) is one error naming all of them.

    base: the Config whose fields the JSON does not decide are kept (mesh, seed, pipeline, ...); it also
        resolves "auto" for the micro-batch, accumulation, gradient_clipping, fp16/bf16 enabled and the
        ZeRO stage (Hugging Face's TrainingArguments role), unless base_fills_auto is False (the CLI: gin's
        explicit bindings, `bound`, say what the user chose; Config's own defaults are not a choice).
    bound: zeroflax settings fixed elsewhere, by gin-style name ({"Config.zero_stage": 3}); they fill what the
        JSON leaves out or sets to "auto", and a value the JSON writes must equal them.
    learning_rate, weight_decay, betas, eps, warmup_steps, total_steps: the values of "auto" in the optimizer and
        scheduler blocks (Hugging Face's rule; warmup_min_lr "auto" is 0). learning_rate is also the optimizer's
        lr that WarmupLR / WarmupCosineLR scale when the JSON has no optimizer block.
    hidden_size: the model width, for "auto" ZeRO-3 sizes (Hugging Face: prefetch 0.9 h^2, persistence 10 h).
    world_size: the data-parallel world size DeepSpeed's batch rule divides by, e.g. the GPU count the JSON
        was written for; the mesh then has that many data devices (initialize(..., devices=...) with
        result.num_devices of them). None: the data axis of base.mesh over all devices.
    default_optimizer: builds the optimizer when the JSON has no optimizer block (DeepSpeed's client
        optimizer); called with the JSON's schedule, or None without scheduler block (keep your own lr).
    keyword_labels: how the notes name the keywords' source, e.g. {"learning_rate": "TrainConfig.learning_rate"}.
    """
    ds, _ = load_json(source)
    base_given, base = base is not None, base if base is not None else Config()
    settings = Settings(bound)
    notes: list[str] = []
    kw = dict(learning_rate=learning_rate, weight_decay=weight_decay, betas=betas, eps=eps,
              warmup_steps=warmup_steps, total_steps=total_steps)

    axes = dict(settings.bound.get("MeshConfig.axes", base.mesh.axes))
    axes = read_tensor_parallel(ds, settings, axes, notes)
    axes = read_sequence_parallel(ds, settings, axes, notes)
    if world_size is not None:
        axes[DATA_AXIS] = as_int(world_size, "world_size", 1)
    try:
        mesh = MeshConfig(axes)
        data_size = world_size if world_size is not None else mesh.resolve(jax.device_count())[DATA_AXIS]
    except ConfigError as error:
        raise _rekeyed(error) from None
    sources = AutoSources(bound=settings.bound, keywords={**kw, "hidden_size": hidden_size},
                          base=base if base_given and base_fills_auto else None, labels=dict(keyword_labels or {}))
    ds, filled = resolve_auto(ds, sources, data_size)
    notes += filled
    check_block(ds, "", notes)
    read_precision(ds, settings, notes)
    precision = read_autocast(ds, settings, notes)
    stage = read_zero(ds, settings, notes)
    read_batch(ds, settings, data_size, notes)
    read_clipping(ds, settings, notes)
    read_data_types(ds, precision, notes)
    remat = read_remat(ds, settings, notes)
    sparse = read_sparse_attention(ds, notes)

    spec = read_optimizer(ds, notes)
    fp16_loss_scaling(spec, precision, settings, notes)
    build_schedule = read_scheduler(ds, kw, notes)
    # The lr a scheduler scales (WarmupCosineLR) or defaults to (WarmupLR): the optimizer block's, else the
    # client optimizer's (learning_rate=).
    optimizer_lr = spec[1]["lr"] if spec is not None else learning_rate
    schedule, beta1 = build_schedule(optimizer_lr) if build_schedule is not None else (None, None)
    optimizer, hyper = build_optimizer(spec, schedule, stage, precision, default_optimizer, notes, beta1)
    if schedule is None and spec is not None:
        schedule = schedules.constant(spec[1]["lr"])
    try:
        config = _build_config(settings.values, base, axes)
    except ConfigError as error:
        raise _rekeyed(error) from None
    num_devices = math.prod(v for v in axes.values()) if world_size is not None else None
    return DeepSpeedImport(config=config, optimizer=optimizer, schedule=schedule, remat=remat, sparse_attention=sparse,
                           hyperparameters=hyper, notes=tuple(notes), data_parallel_size=data_size,
                           num_devices=num_devices)


# ------------------------------------------------------------------------------------------ gin (the CLI)
GIN_NAMES = tuple(CONFIG_KEYS) + ("GPTConfig.attention", "GPTConfig.sparsity")


def gin_bound() -> dict[str, Any]:
    """The zeroflax settings from_deepspeed decides that gin binds explicitly (for `bound=`)."""
    import gin
    out = {}
    for name in GIN_NAMES:
        try:
            value = gin.query_parameter(name)
        except ValueError:
            continue
        # A reference (GPTConfig.sparsity = @BigBirdSparsityConfig()) only tells that gin binds the name.
        if name.startswith("GPTConfig.") or not isinstance(value, gin.config.ConfigurableReference):
            out[name] = value
    return out
