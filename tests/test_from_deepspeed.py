"""zeroflax.from_deepspeed: real DeepSpeed configs train the tiny GPT with DeepSpeed's hyper-parameters and
DeepSpeed's learning rate at every step; malformed configs give one-line errors keyed by their JSON path.

Expected learning rates come from DeepSpeed's own lr_schedules.py (tests/data/deepspeed_schedule_traces.json,
made by tools/gen_deepspeed_schedule_traces.py); the other expected values are read from the JSON files
(tests/data/deepspeed_configs/, copied verbatim: sources in its README.md) or are DeepSpeed's defaults where
a file leaves a key out (cited where used).
"""
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflax
from cli_helpers import ROOT, zeroflax as run_cli
from zeroflax import ConfigError
from zeroflax.deepspeed_config import from_deepspeed
from zeroflax.deepspeed_keys import render_markdown
from zeroflax.models.gpt import GPT, GPTConfig, next_token_loss
from zeroflax.train import TrainConfig, deepspeed_job
from tolerance import at_most, close

DATA = os.path.join(ROOT, "tests", "data")
CONFIGS = os.path.join(DATA, "deepspeed_configs")
with open(os.path.join(DATA, "deepspeed_schedule_traces.json")) as f:
    TRACES = {case["name"]: case for case in json.load(f)["cases"]}

# DeepSpeed's defaults where a file leaves a key out: FusedAdam's betas and eps (deepspeed/ops/adam/fused_adam.py)
# and OnebitAdam's (deepspeed/runtime/fp16/onebit/adam.py) are the same; gradient_clipping's is 1.0
# (GRADIENT_CLIPPING_DEFAULT in deepspeed/runtime/constants.py); initial_scale_power's 16 (precision_config.py).
DS_BETAS, DS_EPS, DS_WEIGHT_DECAY, DS_CLIP, DS_SCALE_POWER = (0.9, 0.999), 1e-8, 0.0, 1.0, 16
MODEL = GPTConfig(vocab_size=64, num_layers=1, d_model=16, num_heads=4, max_len=8)  # 4 heads: autotp_size 4
STEPS = 3


@pytest.fixture(scope="module")
def params():
    """The tiny GPT's parameters (with their logical-axis boxes), made once from the abstract shapes: handing
    initialize a pytree instead of an init function saves compiling the model's init for each config, and
    compiling it even once costs more than the values matter here (any non-degenerate weights train)."""
    tokens = jnp.zeros((1, MODEL.max_len), jnp.int32)
    abstract = jax.eval_shape(GPT(MODEL).init, jax.random.PRNGKey(0), tokens)["params"]
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: (0.2 * rng.standard_normal(s.shape)).astype(s.dtype), abstract)


def load(name):
    with open(os.path.join(CONFIGS, name)) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------------- schedules
# The schedules run in float32, DeepSpeed in float64. Most lrs are a few float32 roundings (2^-24 each) off,
# 2e-6 relative at most. Late in a cosine decay the lr is min + (peak - min)(1 + cos(pi t)) / 2, a
# difference of two numbers of the peak's size, so its error is a fraction of an ulp of the peak, not of
# itself: cosine_linear's step 19 (lr 4.9e-4, peak 1.95e-2) is 8.4e-10 off, 1.7e-6 of itself and 0.36 ulp
# of the peak, on SSE4.2 and AVX2 alike. Bound: LR_RTOL of the lr plus LR_ULPS ulps of the peak.
LR_RTOL = 2e-6
LR_ULPS = 2


def lr_close(ours, expected, trace_lrs, what):
    close(ours, expected, rtol=LR_RTOL, atol=LR_ULPS * 2.0 ** -23 * max(trace_lrs), what=what)


@pytest.mark.parametrize("name", sorted(n for n, c in TRACES.items() if c["type"] and not c["error"]))
def test_schedule_equals_deepspeeds_at_every_recorded_step(name):
    """Every recorded optimizer step (dense from 0, and around warmup_num_steps / total_num_steps) runs at
    DeepSpeed's lr, within LR_RTOL and LR_ULPS float32 ulps of the trace's peak lr (lr_close)."""
    case = TRACES[name]
    ds = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": case["optimizer_lr"]}},
          "scheduler": {"type": case["type"], "params": case["params"]}}
    schedule = from_deepspeed(ds, world_size=8).schedule
    ours = np.asarray(jax.jit(jax.vmap(schedule))(jnp.asarray(case["counts"])), np.float64)
    lr_close(ours, case["lrs"], case["lrs"], "the schedule's lr against DeepSpeed's")


@pytest.mark.parametrize("name", sorted(n for n, c in TRACES.items() if c.get("betas")))
def test_one_cycle_momentum_equals_deepspeeds_at_every_recorded_step(name):
    """OneCycle also sets Adam's betas each step: the optimizer's own hyperparameters at every recorded update
    (beta1 cycled, beta2 0.99; the JSON's betas without cycle_momentum) are DeepSpeed's."""
    case = TRACES[name]
    ds = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": case["optimizer_lr"]}},
          "scheduler": {"type": case["type"], "params": case["params"]}}
    optimizer, params = from_deepspeed(ds, world_size=8).optimizer, jnp.zeros(3)

    def step(state, _):
        _, state = optimizer.update(jnp.ones(3), state, params)
        return state, jnp.stack([state.hyperparams["b1"], state.hyperparams["b2"]])

    _, betas = jax.jit(lambda: jax.lax.scan(step, optimizer.init(params), None, length=case["counts"][-1] + 1))()
    close(np.asarray(betas, np.float64)[case["counts"]], case["betas"], rtol=2e-6, what="OneCycle's betas against DeepSpeed's")


@pytest.mark.parametrize("name", sorted(n for n, c in TRACES.items() if c["error"]))
def test_scheduler_params_deepspeed_refuses_are_refused(name):
    case = TRACES[name]
    ds = {"train_batch_size": 8, "scheduler": {"type": case["type"], "params": case["params"]}}
    with pytest.raises(ConfigError) as error:
        from_deepspeed(ds, world_size=8, learning_rate=case["optimizer_lr"])
    assert error.value.key.startswith("scheduler.params.")


# ------------------------------------------------------------------------ real configs train the tiny GPT
def _client(lr):
    """The optimizer a DeepSpeed user passes to deepspeed.initialize when the JSON has no optimizer block
    (Megatron's Adam); inject_hyperparams exposes the lr it used."""
    return lambda schedule: optax.inject_hyperparams(optax.adamw)(
        learning_rate=schedule if schedule is not None else lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01)


HF_AUTO = TRACES["hf_tensor_parallel.json"]["auto"]  # the keyword values the trace was recorded with
# (file, world_size, (train_batch_size, micro, accumulation) by DeepSpeed's rule from the file, edit, kwargs)
REAL = [
    # train_batch_size 4, accumulation 1, 4 GPUs -> micro 1; no optimizer block: a client AdamW
    ("megatron_gpt2_func_scheduler.json", 4, (4, 1, 1), None, dict(default_optimizer=_client(None))),
    # micro 1, accumulation 1, 8 GPUs -> 8
    ("sdma_allgather_zero3.json", 8, (8, 1, 1), None, {}),
    # train_batch_size 8, accumulation 1, 8 GPUs -> micro 1; deprecated cpu_offload; client optimizer, constant lr
    ("megatron_gpt2_func_bs8_zero2_offload.json", 8, (8, 1, 1), None, dict(default_optimizer=_client(2e-3))),
    # train_batch_size 24, micro 3, 8 GPUs -> accumulation 1
    ("bing_bert_squad_bsz24_fp16.json", 8, (24, 3, 1), None, {}),
    # train_batch_size 96, micro 3, 8 GPUs -> accumulation 4; fp16, as every 1-bit Adam config of DeepSpeed's
    ("bing_bert_squad_onebitadam_bsz96_nccl.json", 8, (96, 3, 4), None, {}),
    # every batch key "auto": micro and accumulation from the base Config (1, 1), 2 data x 4 tensor devices -> 2
    ("hf_tensor_parallel.json", 2, (2, 1, 1), None, dict(
        base=zeroflax.Config(precision="bf16", grad_clip=0.5), learning_rate=HF_AUTO["warmup_max_lr"],
        warmup_steps=HF_AUTO["warmup_num_steps"], total_steps=HF_AUTO["total_num_steps"], betas=(0.9, 0.95),
        eps=1e-6, weight_decay=0.1)),
]


def _lr_used(imported, opt_state, count):
    """The lr the update just applied used: inject_hyperparams records it; 1-bit Adam evaluates its
    schedule at the count before the update (optim/onebit.py)."""
    if hasattr(opt_state, "hyperparams"):
        return float(opt_state.hyperparams["learning_rate"])
    assert int(opt_state.count) == count + 1
    lr = imported.optimizer.settings.learning_rate
    return float(lr(count) if callable(lr) else lr)


def _adam_direction(before, after, lr, weight_decay):
    """Median over parameters of |update| / lr with the decoupled weight decay taken out."""
    ratios = [np.abs(np.asarray(a, np.float64) - b + lr * weight_decay * b).ravel() / lr
              for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before))]
    ratios = np.concatenate(ratios)
    return float(np.median(ratios[ratios > 0]))


@pytest.mark.parametrize("name,world,batch,edit,kwargs", [
    pytest.param(*r, id=r[0], marks=[pytest.mark.fp16] if load(r[0]).get("fp16", {}).get("enabled") is True else [])
    for r in REAL])
def test_real_config_trains_with_deepspeeds_hyper_parameters(name, world, batch, edit, kwargs, params):
    ds = load(name) if edit is None else edit(load(name))
    imported = from_deepspeed(ds, world_size=world, **kwargs)
    config, optimizer = imported
    auto = ds.get("gradient_clipping") == "auto"

    # What the JSON says (DeepSpeed's defaults where it is silent; "auto" as resolved by the keywords).
    zero = ds.get("zero_optimization", {})
    assert config.zero_stage == zero.get("stage", 0)
    fp16, bf16 = ds.get("fp16", {}).get("enabled"), ds.get("bf16", {}).get("enabled")
    assert config.precision == ("fp16" if fp16 is True else "bf16" if bf16 in (True, "auto") else "fp32")
    assert config.grad_clip == (kwargs["base"].grad_clip if auto else ds.get("gradient_clipping", DS_CLIP))
    assert (config.train_batch_size, config.micro_batch_size, config.grad_accum_steps) == batch
    assert imported.data_parallel_size == world
    if config.precision == "fp16":
        block = ds["fp16"]
        for key in ("loss_scale", "loss_scale_window", "hysteresis", "min_loss_scale"):
            if key in block:
                assert getattr(config.loss_scale, key) == block[key], key
        assert config.loss_scale.initial_scale_power == block.get("initial_scale_power", DS_SCALE_POWER)
        if "onebit" in name:  # DeepSpeed's FP16_Optimizer around OnebitAdam halves on every overflow
            assert config.loss_scale.hysteresis == 1
    assert config.offload_optimizer.enabled == bool(zero.get("cpu_offload") or zero.get("offload_optimizer"))
    checkpointing = ds.get("activation_checkpointing")  # None: Config.remat as is
    assert imported.remat == (None if checkpointing is None else
                              "offload_full" if checkpointing.get("cpu_checkpointing") else "full")
    if "tensor_parallel" in ds:
        assert config.mesh.axes == {"data": world, "tensor": ds["tensor_parallel"]["autotp_size"]}

    given = ds.get("optimizer", {}).get("params", {})
    resolved = {"lr": kwargs.get("learning_rate"), "betas": kwargs.get("betas"), "eps": kwargs.get("eps"),
                "weight_decay": kwargs.get("weight_decay")}
    expect = {k: resolved[k] if given.get(k) == "auto" else given.get(k) for k in resolved}
    b1, b2 = expect["betas"] or DS_BETAS
    eps, weight_decay = expect["eps"] or DS_EPS, expect["weight_decay"] or DS_WEIGHT_DECAY
    if "optimizer" not in ds:  # the client optimizer's (see _client)
        b1, b2, eps, weight_decay = 0.9, 0.999, 1e-8, 0.01
    trace = TRACES.get(name)
    if trace is not None and trace["type"] is not None:
        expected_lrs = trace["lrs"]
    else:  # no scheduler: DeepSpeed leaves the optimizer's lr alone
        expected_lrs = [given.get("lr", 2e-3)] * STEPS

    model = GPT(imported.model_config(MODEL))
    tokens = np.random.default_rng(0).integers(0, MODEL.vocab_size, (config.train_batch_size, MODEL.max_len + 1))
    batch_ = {"tokens": tokens.astype(np.int32)}
    engine, state = zeroflax.initialize(
        next_token_loss(model), params, optimizer, config, devices=jax.devices()[:imported.num_devices])
    assert engine.train_batch_size == config.train_batch_size
    applied, checked_direction = 0, False
    for _ in range(STEPS):
        before = jax.device_get(engine.model_params(state))
        state, metrics = engine.step(state, batch_)
        if bool(metrics["skipped"]):  # fp16 overflow: DeepSpeed does not step its scheduler either
            continue
        lr = _lr_used(imported, state.opt_state, applied)
        lr_close(lr, expected_lrs[applied], expected_lrs, "the lr an update used against DeepSpeed's")
        applied += 1
        hyper = getattr(state.opt_state, "hyperparams", None)
        if hyper is not None:
            for key, value in (("b1", b1), ("b2", b2), ("eps", eps), ("weight_decay", weight_decay)):
                close(float(hyper[key]), value, rtol=1e-6, what=f"the optimizer's {key}")
        else:
            settings = optimizer.settings
            assert (settings.b1, settings.b2, settings.eps, settings.weight_decay) == (b1, b2, eps, weight_decay)
            assert settings.freeze_step == given["freeze_step"]
        if lr > 0 and not checked_direction:
            # Every earlier update had lr 0, so the gradient was the same at each: Adam's bias-corrected
            # direction m/sqrt(v) is then sign(g) (ratio 1); without bias correction (BingBertSquad's
            # bias_correction false, and 1-bit Adam) it is (1 - b1^c) / sqrt(1 - b2^c).
            corrected = given.get("bias_correction", True) and "onebit" not in name
            expected = 1.0 if corrected else (1 - b1 ** applied) / math.sqrt(1 - b2 ** applied)
            ratio = _adam_direction(before, jax.device_get(engine.model_params(state)), lr, weight_decay)
            at_most(abs(ratio - expected) / expected, 0.01, "Adam's first direction against its theory",
                    f"({ratio} vs {expected})")
            checked_direction = True
    assert applied >= 2 and checked_direction


# -------------------------------------------------------------------------------------- the other mappings
def test_real_sparse_attention_block_maps_to_deepspeeds_layout_class():
    """bing_bert's Lamb config has a 'fixed' sparse_attention block: the same class
    and arguments; missing keys take DeepSpeed's reader defaults (BigBird's num_random_blocks 0, not the
    class's 1)."""
    block = load("bing_bert_lamb_bsz64k_seq128.json")["sparse_attention"]
    imported = from_deepspeed({"train_batch_size": 8, "sparse_attention": block}, world_size=8)
    sparsity = imported.sparsity(num_heads=16)
    assert type(sparsity).__name__ == "FixedSparsityConfig"
    for key, value in block.items():
        if key != "mode":
            assert getattr(sparsity, key) == value, key
    bigbird = from_deepspeed({"train_batch_size": 8, "sparse_attention": {"mode": "bigbird", "block": 8}}, world_size=8)
    assert (type(bigbird.sparsity(4)).__name__, bigbird.sparsity(4).num_random_blocks, bigbird.sparsity(4).block) == (
        "BigBirdSparsityConfig", 0, 8)
    gpt = bigbird.model_config(MODEL)
    assert gpt.attention == "sparse" and gpt.sparsity.num_heads == MODEL.num_heads


def test_adam_modes_and_torch_defaults():
    """'Adam' is AdamW unless adam_w_mode is false (then L2 weight decay); torch_adam's AdamW defaults its
    weight decay to torch's 0.01 (deepspeed/runtime/engine.py, _configure_basic_optimizer)."""
    def hyper(params, kind="Adam"):
        ds = {"train_batch_size": 8, "optimizer": {"type": kind, "params": params}}
        return from_deepspeed(ds, world_size=8).hyperparameters
    assert hyper({})["decoupled"] and hyper({}, "adamw")["decoupled"]
    assert not hyper({"adam_w_mode": False, "weight_decay": 0.1})["decoupled"]
    assert hyper({"adam_w_mode": False}, "AdamW")["decoupled"]  # AdamW is always decoupled
    assert hyper({"torch_adam": True})["weight_decay"] == 0.01
    assert hyper({"torch_adam": True, "adam_w_mode": False})["weight_decay"] == 0.0


def test_moot_keys_become_notes_and_docs_show_the_tables():
    imported = from_deepspeed(os.path.join(CONFIGS, "sdma_allgather_zero3.json"), world_size=8)
    for key in ("overlap_comm", "reduce_bucket_size", "allgather_bucket_size", "contiguous_gradients"):
        assert any(note.startswith(f"zero_optimization.{key}: accepted") for note in imported.notes), key
    with open(os.path.join(ROOT, "docs", "from_deepspeed.md")) as f:
        assert render_markdown() in f.read()  # regenerate with: python -c "...render_markdown()"


def test_auto_resolution_and_gin_bindings():
    hf = load("hf_tensor_parallel.json")
    # Only the run's length is unknown without keywords: one error, naming it (and every other such key).
    with pytest.raises(ConfigError) as error:
        from_deepspeed(hf, world_size=2)
    assert error.value.key == "scheduler.params.total_num_steps" and "total_steps=" in str(error.value)
    two = {**hf, "optimizer": {"type": "OneBitAdam", "params": {"freeze_step": "auto", "lr": "auto"}}}
    with pytest.raises(ConfigError, match=r"total_num_steps \(.*; optimizer\.params\.freeze_step \(nothing fills it"):
        from_deepspeed(two, world_size=2)
    # Everything else takes Hugging Face's TrainingArguments defaults, listed in one note with its source.
    imported = from_deepspeed(hf, world_size=2, total_steps=100)
    config, hyper = imported.config, imported.hyperparameters
    assert (config.micro_batch_size, config.grad_accum_steps, config.train_batch_size) == (8, 1, 16)
    assert (config.grad_clip, config.precision) == (1.0, "fp32")
    assert (hyper["lr"], hyper["b1"], hyper["b2"], hyper["eps"], hyper["weight_decay"]) == (5e-5, 0.9, 0.999, 1e-8, 0.0)
    assert float(imported.schedule(1)) == 0.0  # 2-step warm-up
    close(float(imported.schedule(2)), 5e-5, rtol=1e-6, what="the warm-up's second lr")
    (note,) = [n for n in imported.notes if n.startswith("auto:")]
    assert note.startswith("auto: 13 values filled: ")
    for piece in ("train_micro_batch_size_per_gpu = 8 (Hugging Face's default TrainingArguments.per_device_train",
                  "gradient_clipping = 1.0 (Hugging Face's default TrainingArguments.max_grad_norm)",
                  "train_batch_size = 16 (micro-batch x accumulation x 2", "scheduler.params.total_num_steps = 100 "
                  "(total_steps=)", "optimizer.params.betas = [0.9, 0.999] (Hugging Face's default"):
        assert piece in note, piece
    # gin first, then the keywords, then the base Config; the CLI's base fills nothing (base_fills_auto=False).
    imported = from_deepspeed(hf, world_size=2, total_steps=100, learning_rate=1e-3, base=zeroflax.Config(
        grad_clip=0.5, micro_batch_size=2), bound={"Config.micro_batch_size": 4})
    assert (imported.config.micro_batch_size, imported.config.grad_clip, imported.hyperparameters["lr"]) == (4, 0.5, 1e-3)
    assert "train_micro_batch_size_per_gpu = 4 (gin's Config.micro_batch_size)" in imported.notes[0]
    zero = {"train_batch_size": 8, "zero_optimization": {"stage": 3, "stage3_max_live_parameters": "auto",
                                                          "offload_optimizer": {"device": "auto"}}}
    filled = from_deepspeed(zero, world_size=8, bound={"Config.max_live_parameters": 7,
                                                       "OffloadOptimizerConfig.device": "cpu"})
    assert (filled.config.max_live_parameters, filled.config.offload_optimizer.device) == (7, "cpu")
    unused = from_deepspeed(hf, world_size=2, total_steps=100, base=zeroflax.Config(grad_clip=0.5), base_fills_auto=False)
    assert unused.config.grad_clip == 1.0
    # No batch key at all (transformers' own ZeRO-3 test config; accelerate fills it): as for "auto".
    template = from_deepspeed(load("autotuning_template_zero3.json"), world_size=8)
    assert (template.config.micro_batch_size, template.config.grad_accum_steps, template.config.train_batch_size) == (
        8, 1, 64)
    assert "absent from the JSON" in template.notes[0]
    assert from_deepspeed({"gradient_accumulation_steps": 2}, world_size=8).config.train_batch_size == 128
    # A missing gradient_clipping is DeepSpeed's 1.0, said in a note (older DeepSpeed did not clip).
    assert any(n.startswith("gradient_clipping: absent, so 1.0") for n in template.notes)

    # Gin's bindings fill what the JSON leaves out (the ZeRO-3 sizes here) and may not contradict what it writes.
    ds = load("torch_compile_z3.json")
    bound = {"Config.persistence_threshold": 0, "Config.max_live_parameters": 0}
    config = from_deepspeed(ds, world_size=8, bound=bound).config
    assert (config.persistence_threshold, config.max_live_parameters, config.zero_stage) == (0, 0, 3)
    with pytest.raises(ConfigError) as error:
        from_deepspeed(ds, world_size=8, bound={"Config.zero_stage": 2})
    assert error.value.key == "zero_optimization.stage" and "Config.zero_stage" in str(error.value)
    # The main job's rule: a JSON sparse_attention block and gin's GPTConfig.sparsity are refused together.
    with pytest.raises(ConfigError) as error:
        deepspeed_job({"train_batch_size": 8, "sparse_attention": {"mode": "dense"}}, TrainConfig(),
                      zeroflax.Config(), MODEL, bound={"GPTConfig.sparsity": None})
    assert error.value.key == "sparse_attention"


# --------------------------------------------------------------------------------------- one-line errors
def _with(name, edit):
    ds = load(name)
    edit(ds)
    return ds


BAD = [  # (JSON path of the error, config, keywords)
    ("zero_optimization.stage3_prefetch_bucket_sise",
     _with("sdma_allgather_zero3.json", lambda d: d["zero_optimization"].update(stage3_prefetch_bucket_sise=5)), {}),
    ("gradient_clip", {"train_batch_size": 8, "gradient_clip": 1.0}, {}),
    ("zero_optimization.stage", {"train_batch_size": 8, "zero_optimization": {"stage": 4}}, {}),
    ("zero_optimization.stage", {"train_batch_size": 8, "zero_optimization": {"stage": "two"}}, {}),
    ("bf16.enabled", {"train_batch_size": 8, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, {}),
    ("train_batch_size", {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 3,
                          "gradient_accumulation_steps": 1}, {}),
    ("train_batch_size", load("megatron_gpt2_func_scheduler.json"), {}),  # 4 over 8 devices
    ("optimizer.type", {"train_batch_size": 8, "optimizer": {"type": "Muon", "params": {"lr": 1e-3}}}, {}),
    ("optimizer.type", {"train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, {}),
    # OneCycle cycles beta1: not with a client optimizer, nor a compressed one
    ("scheduler.params.cycle_momentum", {"train_batch_size": 8, "scheduler": {"type": "OneCycle", "params": {
        "cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}}, {}),
    ("scheduler.params.cycle_momentum", {"train_batch_size": 8, "optimizer": {"type": "OneBitAdam"}, "scheduler": {
        "type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}}, {}),
    ("scheduler.params.cycle_max_lr", {"train_batch_size": 8, "optimizer": {"type": "Adam"}, "scheduler": {
        "type": "OneCycle", "params": {"cycle_min_lr": 1e-4}}}, {}),
    ("scheduler.type", {"train_batch_size": 8, "scheduler": {"type": "StepLR", "params": {}}}, {}),
    ("zero_optimization.offload_optimizer.nvme_path", {"train_batch_size": 8, "zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "nvme"}}}, {}),
    ("zero_optimization.offload_param.device", {"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}}, {}),
    ("optimizer.params.max_grad_norm", {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {
        "lr": 1e-3, "max_grad_norm": 1.0}}}, {}),
    ("optimizer.params.betas", {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {
        "betas": [0.9]}}}, {}),
    ("scheduler.params.warmup_type", {"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_max_lr": 1e-3, "warmup_type": "exp"}}}, {}),
    ("scheduler.params.warmup_max_lr", {"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {}}}, {}),
    ("bf16.bf16_master_weights_and_grads", load("bf16_master_weight_full.json"), {}),  # its autocast maps
    ("torch_autocast.dtype", {"train_batch_size": 8, "torch_autocast": {"enabled": True}}, {}),
    ("torch_autocast.dtype", {"train_batch_size": 8, "fp16": {"enabled": True},
                              "torch_autocast": {"enabled": True, "dtype": "bfloat16"}}, {}),
    ("data_types.param_dtype", {"train_batch_size": 8, "data_types": {"param_dtype": "bf16"}}, {}),
    ("zero_optimization.zero_quantized_gradients", {"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "zero_quantized_gradients": True}}, {}),
    ("zero_optimization.zero_quantized_weights", {"train_batch_size": 8, "zero_optimization": {
        "stage": 2, "zero_quantized_weights": True}}, {}),
    ("sparse_attention.mode", {"train_batch_size": 8, "sparse_attention": {"mode": "strided"}}, {}),
    ("sparse_attention.num_local_blocks", {"train_batch_size": 8, "sparse_attention": {
        "mode": "fixed", "num_local_blocks": 4, "num_global_blocks": 3}}, {}),
    ("sparse_attention.horizontal_global_attention", {"train_batch_size": 8, "sparse_attention": {
        "mode": "variable", "attention": "unidirectional", "horizontal_global_attention": True}}, {}),
    ("sparse_attention.num_sliding_window_block", {"train_batch_size": 8, "sparse_attention": {
        "mode": "bigbird", "num_sliding_window_block": 3}}, {}),
    ("gradient_clipping", {"train_batch_size": 8, "gradient_clipping": -1.0}, {}),
    ("activation_checkpointing.cpu_checkpointing", {"train_batch_size": 8, "activation_checkpointing": {
        "partition_activations": True, "cpu_checkpointing": "true"}}, {}),
    ("scheduler.params.warmup_max_lr", {"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_max_lr": [1e-3, 2e-3]}}}, {}),
    ("scheduler.params.last_batch_iteration", {"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_max_lr": 1e-3, "last_batch_iteration": 99}}}, {}),
    ("scheduler.params.total_num_steps", load("hf_tensor_parallel.json"), dict(world_size=2, base=zeroflax.Config(
        precision="bf16"))),
    ("gradient_accumulation_steps", {"train_batch_size": "auto", "gradient_accumulation_steps": {}}, {}),
    ("scheduler.params.warmup_min_lr", {"train_batch_size": 8, "scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": None, "warmup_max_lr": 1e-3}}}, {}),
    ("optimizer.params.freeze_step", {"train_batch_size": 8, "optimizer": {"type": "OneBitAdam", "params": {
        "freeze_step": "auto"}}}, {}),
]


@pytest.mark.parametrize("path,ds,kwargs", BAD, ids=[f"{i}-{b[0]}" for i, b in enumerate(BAD)])
def test_bad_config_is_one_line_error_keyed_by_its_json_path(path, ds, kwargs):
    kwargs = {"world_size": 8, **kwargs}
    with pytest.raises(ConfigError) as error:
        from_deepspeed(ds, **kwargs)
    message = str(error.value)
    assert error.value.key == path and message.startswith(path + ": ") and "\n" not in message, message


def test_unknown_key_names_the_nearest_known_key(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(BAD[0][1]))
    with pytest.raises(ConfigError, match=r"nearest known key is zero_optimization\.stage3_prefetch_bucket_size"):
        from_deepspeed(str(path), world_size=8)


def test_an_unknown_key_unlike_any_known_one_lists_its_blocks_keys():
    """trlx's GPT-J config carries Apex's fp16.opt_level: naming loss_scale as its typo would mislead."""
    path = os.path.join(DATA, "deepspeed_corpus", "CarperAI__trlx", "examples__summarize_rlhf__sft__ds_config_gptj.json")
    with pytest.raises(ConfigError, match=r"^fp16\.opt_level: unknown DeepSpeed key \(remove it; fp16 takes auto_cast, "):
        from_deepspeed(path, world_size=8)


def test_cpu_checkpointing_keeps_the_checkpointed_layers_inputs_on_the_host():
    """DeepSpeedExamples' Megatron ZeRO-Offload config (in the corpus): remat 'offload_full'."""
    path = os.path.join(DATA, "deepspeed_corpus", "deepspeedai__DeepSpeedExamples",
                        "megatron__Megatron-LM__scripts__ds_zero-offload_config.json")
    imported = from_deepspeed(path, world_size=8)
    assert imported.remat == imported.config.remat == "offload_full"
    assert from_deepspeed({"train_batch_size": 8, "activation_checkpointing": {"cpu_checkpointing": False}},
                          world_size=8).remat == "full"


# --------------------------------------------------------------------------------------------- the CLI
@pytest.mark.fp16
def test_cli_trains_with_a_deepspeed_config(tmp_path):
    """`zeroflax train --deepspeed_config`: Megatron's scheduler test config (fp16, ZeRO-2, WarmupLR, batch 4)
    on 4 devices; TrainConfig's AdamW is the client optimizer and every step's lr is DeepSpeed's."""
    name = "megatron_gpt2_func_scheduler.json"
    workdir = tmp_path / "run"
    bindings = {"GPTConfig.num_layers": 1, "GPTConfig.d_model": 16, "GPTConfig.num_heads": 2,
                "GPTConfig.max_len": 8, "TrainConfig.seq_len": 8, "TrainConfig.steps": STEPS,
                "TrainConfig.warmup_steps": 1, "TrainConfig.log_every": 1, "TrainConfig.eval_batches": 1,
                "TrainConfig.checkpoint_every": STEPS, "TrainConfig.sample_length": 0,
                "TrainConfig.tensorboard": False, "TrainConfig.workdir": repr(str(workdir))}
    args = [a for k, v in bindings.items() for a in ("--gin_param", f"{k} = {v}")]
    result = run_cli("train", *args, "--cpu_devices", "4", "--no_progress", "--deepspeed_config",
                     os.path.join(CONFIGS, name))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ZeRO stage 2, fp16" in result.stdout and "4 x 8 tokens per step" in result.stdout
    assert "zero_optimization.reduce_bucket_size: accepted" not in result.stdout  # this file has none
    with open(workdir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if '"loss"' in line]
    lrs, applied = TRACES[name]["lrs"], 0
    for row in rows:
        lr_close(row["lr"], lrs[applied], lrs, "the CLI's logged lr against DeepSpeed's")
        applied += not row["skipped"]
    assert len(rows) == STEPS


def test_param_offload_without_optimizer_offload_holds_deepspeeds_device_bytes(params):
    """Stage 3 with offload_param 'cpu' and no offload_optimizer: DeepSpeed keeps the fp32 master shards and
    Adam's state on the GPU and moves its 16-bit copy of the shards to the host (zero/stage3.py); zeroflax keeps
    no 16-bit copy at all, so the import moves nothing and each device holds DeepSpeed's bytes: 4 + 8 bytes per
    parameter over N, measured from the compiled step (the leaves under the persistence threshold whole)."""
    ds = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "offload_param": {"device": "cpu"}, "stage3_param_persistence_threshold": 0}}
    imported = from_deepspeed(ds, world_size=8)
    assert not imported.config.offload_param.enabled and not imported.config.offload_optimizer.enabled
    assert any("offload_param: 'cpu' without offload_optimizer" in n for n in imported.notes)
    tokens = np.zeros((imported.config.train_batch_size, MODEL.max_len + 1), np.int32)
    engine, state = zeroflax.initialize(next_token_loss(GPT(MODEL)), params, imported.optimizer or optax.adamw(1e-3),
                                        imported.config, abstract=True)
    memory = zeroflax.memory_report(engine, state, {"tokens": tokens})
    psi = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    stored = memory.params + memory.opt_state
    print(f"at rest {stored} B per device, 12 Psi / N = {psi * 12 / 8:.0f} B")  # 6604 against 6600
    assert psi * 12 / 8 <= stored <= psi * 12 / 8 + 4, (stored, psi)  # + Adam's int32 step count, held whole
    real = from_deepspeed(load("sglang_offload_cpu.json"), world_size=1)  # the same, in a real file
    assert real.config.zero_stage == 3 and not real.config.offload_param.enabled
    # With offload_optimizer too, both offloads are built: the master shards and the state go to the host.
    both = from_deepspeed({**ds, "zero_optimization": {**ds["zero_optimization"], "offload_optimizer": {
        "device": "cpu"}}}, world_size=8)
    assert both.config.offload_param.enabled and both.config.offload_optimizer.enabled
