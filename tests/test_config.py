"""Every invalid configuration raises ConfigError naming the key at fault."""
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeroflax
from zeroflax import Config, ConfigError, LossScaleConfig, MeshConfig
from zeroflax.train import TrainConfig


def loss_fn(params, batch, rng):
    return jnp.mean((batch["x"] @ params["w"]) ** 2)


PARAMS = {"w": jnp.ones((4, 8))}

# (what is built, the key the message must name). Built lazily so each raises inside the test.
INVALID = {
    "stage 5": (lambda: Config(zero_stage=5), "Config.zero_stage"),
    "stage as string": (lambda: Config(zero_stage="3"), "Config.zero_stage"),
    "unknown precision": (lambda: Config(precision="fp8"), "Config.precision"),
    "accumulation 0": (lambda: Config(grad_accum_steps=0), "Config.grad_accum_steps"),
    "micro batch 0": (lambda: Config(micro_batch_size=0), "Config.micro_batch_size"),
    "negative clipping": (lambda: Config(grad_clip=-1.0), "Config.grad_clip"),
    "infinite clipping": (lambda: Config(grad_clip=float("inf")), "Config.grad_clip"),
    "negative threshold": (lambda: Config(persistence_threshold=-1), "Config.persistence_threshold"),
    "unknown remat": (lambda: Config(remat="sometimes"), "Config.remat"),
    "no remat under ZeRO-3": (lambda: Config(zero_stage=3, remat="none"), "Config.remat"),
    "layer inputs offloaded under a pipeline": (
        lambda: Config(remat="offload_full", mesh=MeshConfig(axes={"pipe": 2, "data": -1, "tensor": 1}),
                       grad_accum_steps=2),
        "Config.remat"),
    "negative bucket": (lambda: Config(prefetch_bucket_size=-1), "Config.prefetch_bucket_size"),
    "negative live parameters": (lambda: Config(max_live_parameters=-5), "Config.max_live_parameters"),
    "quantized as string": (lambda: Config(zero_stage=3, quantized_weights="yes"), "Config.quantized_weights"),
    "quantized below stage 3": (lambda: Config(zero_stage=2, quantized_weights=True), "Config.quantized_weights"),
    "quantization block 8": (lambda: Config(quantization_block=8), "Config.quantization_block"),
    "rule to unknown axis": (lambda: Config(logical_rules=(("mlp", "model"),)), "Config.logical_rules"),
    "rule to data axis": (lambda: Config(logical_rules=(("mlp", "data"),)), "Config.logical_rules"),
    "mesh without tensor": (lambda: MeshConfig({"data": 8}), "MeshConfig.axes"),
    "mesh size 0": (lambda: MeshConfig({"data": 0, "tensor": 1}), "MeshConfig.axes['data']"),
    "two -1 axes": (lambda: MeshConfig({"data": -1, "tensor": -1}), "MeshConfig.axes"),
    "negative loss scale": (lambda: LossScaleConfig(loss_scale=-2.0), "LossScaleConfig.loss_scale"),
    "hysteresis 0": (lambda: LossScaleConfig(hysteresis=0), "LossScaleConfig.hysteresis"),
    "window 0": (lambda: LossScaleConfig(loss_scale_window=0), "LossScaleConfig.loss_scale_window"),
    "min scale 0": (lambda: LossScaleConfig(min_loss_scale=0), "LossScaleConfig.min_loss_scale"),
    "mesh larger than devices": (
        lambda: zeroflax.initialize(loss_fn, PARAMS, optax.sgd(0.1),
                                    Config(mesh=MeshConfig({"data": 16, "tensor": 1}))), "MeshConfig.axes"),
    "mesh not using all devices": (
        lambda: zeroflax.initialize(loss_fn, PARAMS, optax.sgd(0.1),
                                    Config(mesh=MeshConfig({"data": 3, "tensor": 2}))), "MeshConfig.axes"),
    "batch not divisible": (
        lambda: zeroflax.initialize(loss_fn, PARAMS, optax.sgd(0.1),
                                    Config(micro_batch_size=4, train_batch_size=30)), "Config.train_batch_size"),
    "tensor axis does not divide a named dim": (
        lambda: zeroflax.initialize(loss_fn, {"w": jnp.ones((4, 12))}, optax.sgd(0.1),
                                    Config(mesh=MeshConfig({"data": 1, "tensor": 8})),
                                    logical_axes={"w": ("embed", "mlp")}), "MeshConfig.axes['tensor']"),
    "sequence parallel as string": (lambda: Config(sequence_parallel="yes"), "Config.sequence_parallel"),
    "sequence parallel without a tensor axis": (
        lambda: zeroflax.initialize(loss_fn, PARAMS, optax.sgd(0.1), Config(sequence_parallel=True)),
        "Config.sequence_parallel"),
    "logical name without rule": (
        lambda: zeroflax.initialize(loss_fn, PARAMS, optax.sgd(0.1), Config(),
                                    logical_axes={"w": ("embed", "experts")}), "Config.logical_rules"),
    "more logical names than dimensions": (
        lambda: zeroflax.initialize(loss_fn, PARAMS, optax.sgd(0.1), Config(),
                                    logical_axes={"w": ("embed", "mlp", "heads")}), "logical_axes"),
    "data axis alias that is a mesh axis": (lambda: Config(data_axis_aliases=("tensor",)), "Config.data_axis_aliases"),
    "data axis alias not a name": (lambda: Config(data_axis_aliases=(1,)), "Config.data_axis_aliases"),
    "1-bit Adam's clipping rule as string": (lambda: TrainConfig(onebit_local_clip="yes"),
                                             "TrainConfig.onebit_local_clip"),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_config_names_the_key(case):
    build, key = INVALID[case]
    with pytest.raises(ConfigError) as error:
        build()
    assert error.value.key == key
    assert str(error.value).startswith(key + ":")


def test_step_rejects_a_batch_of_the_wrong_size():
    engine, state = zeroflax.initialize(loss_fn, PARAMS, optax.sgd(0.1), Config(micro_batch_size=2))
    with pytest.raises(ConfigError, match="Config.train_batch_size"):
        engine.step(state, {"x": np.ones((12, 4), np.float32)})


def test_defaults_are_valid_and_derive_the_batch():
    config = Config()
    assert config.resolve_train_batch(8) == 8
    assert Config(micro_batch_size=2, grad_accum_steps=3).resolve_train_batch(4) == 24
