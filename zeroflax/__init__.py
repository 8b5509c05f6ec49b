"""zeroflax: DeepSpeed's memory-efficient training technology, natively in JAX/Flax."""
from zeroflax.config import Config, ConfigError, LossScaleConfig, MeshConfig, OffloadOptimizerConfig, OffloadParamConfig
from zeroflax.engine import Engine, TrainState, initialize
from zeroflax.sharding.groups import group
from zeroflax.sharding.layers import gather, gather_layer, scan_layers
from zeroflax.sharding.sequence import sequence_attention, sequence_slice
from zeroflax.sharding.tensor import sequence_split, tensor_parallel
from zeroflax.adapters import nnx_split, unbox
from zeroflax.deepspeed_config import from_deepspeed
from zeroflax.reports import comm_report, memory_report
from zeroflax.version import __version__

__all__ = [
    "Config", "ConfigError", "Engine", "LossScaleConfig", "MeshConfig", "OffloadOptimizerConfig", "OffloadParamConfig",
    "TrainState",
    "__version__", "comm_report", "from_deepspeed", "gather", "gather_layer", "group", "initialize", "memory_report", "nnx_split", "scan_layers", "sequence_attention", "sequence_slice", "sequence_split", "tensor_parallel", "unbox",
]
