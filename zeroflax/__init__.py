"""zeroflax: DeepSpeed's memory-efficient training technology, natively in JAX/Flax."""
from zeroflax.config import Config, ConfigError, LossScaleConfig, MeshConfig, OffloadOptimizerConfig, OffloadParamConfig
from zeroflax.engine import Engine, TrainState, initialize
from zeroflax.sharding.groups import group
from zeroflax.sharding.layers import gather, gather_layer, scan_layers
from zeroflax.sharding.tensor import sequence_split, tensor_parallel
from zeroflax.adapters import nnx_split, unbox
from zeroflax.deepspeed_config import from_deepspeed

__all__ = [
    "Config", "ConfigError", "Engine", "LossScaleConfig", "MeshConfig", "OffloadOptimizerConfig", "OffloadParamConfig",
    "TrainState",
    "from_deepspeed", "gather", "gather_layer", "group", "initialize", "nnx_split", "scan_layers", "sequence_split", "tensor_parallel", "unbox",
]
__version__ = "0.1.0"
