"""DeepSpeed's LAMB (optimizer.type "Lamb"): zeroflax.optim.deepspeed_lamb against a numpy model of FusedLamb's
kernel (deepspeed/ops/lamb/fused_lamb.py and csrc/lamb/fused_lamb_cuda_kernel.cu, followed step by step:
uncorrected moments, trust ratio ||p|| / ||m / (sqrt(v) + eps) + wd p|| per tensor clipped to [min_coeff,
max_coeff] and 1 where a norm is 0, bias correction lr sqrt(1 - b2^t) / (1 - b1^t) on the whole step), the real
Lamb configs of the corpus, and ZeRO on 8 and 6 devices against the single-device optax run."""
import os

import jax
import numpy as np
import optax
import pytest

import zeroflax
from zeroflax.deepspeed_config import from_deepspeed
from zeroflax.optim import deepspeed_lamb

from models import odd_loss, odd_params
from noise_floor import assert_matches
from test_equivalence import reference_and_floor
from tolerance import close

CORPUS = os.path.join(os.path.dirname(__file__), "data", "deepspeed_corpus")


def fused_lamb_numpy(params, grads_per_step, lr, b1, b2, eps, wd, bias_correction, eps_inside_sqrt, max_coeff,
                     min_coeff):
    """FusedLamb's kernel for each tensor, in float64 (the kernel accumulates in float32)."""
    params = [np.asarray(p, np.float64) for p in params]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    for t, grads in enumerate(grads_per_step, start=1):
        step_size = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t) if bias_correction else lr
        for i, g in enumerate(grads):
            g = np.asarray(g, np.float64)
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            denom = np.sqrt(v[i] + eps) if eps_inside_sqrt else np.sqrt(v[i]) + eps
            u = m[i] / denom + wd * params[i]
            w_norm, u_norm = np.linalg.norm(params[i]), np.linalg.norm(u)
            coeff = 1.0
            if w_norm != 0 and u_norm != 0:
                coeff = min(max(w_norm / u_norm, min_coeff), max_coeff)
            params[i] = params[i] - step_size * coeff * u
    return params


@pytest.mark.parametrize("bias_correction,eps_inside_sqrt,wd,max_coeff,min_coeff", [
    (True, False, 0.01, 10.0, 0.01),   # FusedLamb's defaults, with weight decay
    (False, False, 0.01, 0.3, 0.01),   # bing_bert's settings: max_coeff clips
    (True, True, 0.0, 10.0, 2.0),      # eps inside the root; min_coeff clips
])
def test_equals_fused_lamb_step_by_step(bias_correction, eps_inside_sqrt, wd, max_coeff, min_coeff):
    rng = np.random.default_rng(0)
    shapes = [(5, 7), (3,), (4,)]
    params = [rng.normal(size=s).astype(np.float32) for s in shapes]
    params[2][:] = 0  # a zero tensor: the ratio is 1, unclipped (min_coeff 2 would change it)
    grads = [[rng.normal(size=s).astype(np.float32) for s in shapes] for _ in range(6)]
    settings = dict(b1=0.9, b2=0.999, eps=1e-6, wd=wd, bias_correction=bias_correction,
                    eps_inside_sqrt=eps_inside_sqrt, max_coeff=max_coeff, min_coeff=min_coeff)
    expected = fused_lamb_numpy(params, grads, lr=1e-2, **settings)
    opt = deepspeed_lamb(1e-2, b1=0.9, b2=0.999, eps=1e-6, weight_decay=wd, bias_correction=bias_correction,
                         eps_inside_sqrt=eps_inside_sqrt, max_coeff=max_coeff, min_coeff=min_coeff)
    ours, state = [jax.numpy.asarray(p) for p in params], None
    state = opt.init(ours)
    for g in grads:
        updates, state = opt.update([jax.numpy.asarray(x) for x in g], state, ours)
        ours = optax.apply_updates(ours, updates)
    # float32 against float64: 6 steps of up to lr x max_coeff x |u| ~ 0.3 each, with float32 norms in every
    # trust ratio, leave O(1) parameters a dozen float32 ulps (1.2e-7 each) off: 1.4e-6 measured on SSE4.2.
    # Bound 5e-6 + 5e-6 |p|: about 40 ulps; a wrong moment, bias correction or clip is off by percents.
    for a, b in zip(ours, expected):
        close(a, b, rtol=5e-6, atol=5e-6, what="deepspeed_lamb against FusedLamb in float64")
    assert np.any(np.asarray(ours[2]) != 0)  # the zero tensor moved (by wd 0: its gradient's direction)


def test_real_lamb_configs_import_with_their_settings():
    name = "deepspeedai__DeepSpeedExamples/bing_bert__deepspeed_bsz64k_lamb_config_seq128.json"
    imported = from_deepspeed(os.path.join(CORPUS, name), world_size=8, total_steps=1000)
    hyper = imported.hyperparameters
    assert (hyper["type"], hyper["lr"], hyper["weight_decay"], hyper["bias_correction"], hyper["max_coeff"],
            hyper["min_coeff"], hyper["eps_inside_sqrt"]) == ("Lamb", 0.011, 0.01, False, 0.3, 0.01, False)
    assert any("hidden step" in n for n in imported.notes)  # the file is fp16
    # DeepSpeed refuses optimizer.params.max_grad_norm for every optimizer; so does zeroflax.
    with pytest.raises(zeroflax.ConfigError, match="^optimizer.params.max_grad_norm: "):
        from_deepspeed(os.path.join(CORPUS, "deepspeedai__DeepSpeedExamples/bing_bert__deepspeed_bsz16K_lamb_config."
                                    "json"), world_size=8)
    with pytest.raises(zeroflax.ConfigError, match="^fp16.loss_scale: "):
        from_deepspeed({"train_batch_size": 8, "fp16": {"enabled": True, "loss_scale": 128},
                        "optimizer": {"type": "Lamb"}}, world_size=8)


@pytest.mark.parametrize("stage,n", [(2, 8), (3, 6)])
def test_zero_matches_the_single_device_run(stage, n):
    """The trust ratio is a norm over each whole leaf: the partitioned (and, on 6 devices, padded) leaves give the
    single-device optax run's parameters."""
    rng = np.random.default_rng(1)
    params = odd_params(jax.random.PRNGKey(0))
    batches = [{"x": rng.normal(size=(24, 7)).astype(np.float32), "y": rng.normal(size=(24, 3)).astype(np.float32)}
               for _ in range(4)]
    opt = deepspeed_lamb(1e-2, weight_decay=0.01, max_coeff=0.3)
    reference, floor = reference_and_floor(odd_loss, zeroflax.unbox(params)[0], opt, batches)
    config = zeroflax.Config(zero_stage=stage, micro_batch_size=24 // n, persistence_threshold=0, grad_clip=0.0,
                             remat="dots" if stage == 3 else "none")
    engine, state = zeroflax.initialize(odd_loss, params, opt, config, devices=jax.devices()[:n])
    for batch in batches:
        state, _ = engine.step(state, batch)
    assert_matches(jax.device_get(engine.model_params(state)), reference, floor, f"lamb stage {stage} on {n} devices")
