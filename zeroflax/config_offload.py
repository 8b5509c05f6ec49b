"""ZeRO-Offload's settings: where the optimizer state and (at ZeRO-3) the parameters live.

OffloadOptimizerConfig is DeepSpeed's zero_optimization.offload_optimizer, OffloadParamConfig its
offload_param; Config holds one of each (Config.offload_optimizer, Config.offload_param) and checks how
they combine with the ZeRO stage and with each other. `zeroflax.config` re-exports both classes.
"""
from __future__ import annotations

import dataclasses

from zeroflax.config_checks import configurable, is_int, require

OFFLOAD_DEVICES = ("none", "cpu")
DELAYED_PREDICTIONS = ("linear", "extrapolate", "none")
OFFLOAD_UPDATES = ("host", "device")


def _check_offload_device(prefix: str, device, pin_memory) -> None:
    """The checks both offload blocks share: their `device` and `pin_memory` keys."""
    require(device != "nvme", prefix + "device", "'nvme' (ZeRO-Infinity) is not supported: JAX has no NVMe "
            "memory kind", "use 'cpu'")
    require(device in OFFLOAD_DEVICES, prefix + "device", f"unknown device {device!r}",
            f"use one of {', '.join(OFFLOAD_DEVICES)}")
    require(isinstance(pin_memory, bool), prefix + "pin_memory", f"must be True or False, got {pin_memory!r}")


@configurable
@dataclasses.dataclass(frozen=True)
class OffloadOptimizerConfig:
    """ZeRO-Offload of the optimizer (DeepSpeed's zero_optimization.offload_optimizer), stages 1-3.

    device: 'none', or 'cpu': the fp32 master weights and the optimizer state live in host memory,
        partitioned over the data axis (12 bytes per parameter / N); the device keeps a compute-dtype
        copy of the parameters (whole at stages 1-2, a shard at stage 3).
    pin_memory: page-locked host memory (memory kind 'pinned_host', which the device reads directly);
        False uses 'unpinned_host'.
    update: where the optimizer step runs: 'host' (jax's compute_on('device_host'): only gradients go
        down and compute-dtype parameters come back) or 'device' (the master weights and optimizer state
        come to the device for the update and go back).
    delayed_update: ZeRO-Offload's delayed parameter update (DPU): the host update of step t's gradient
        runs beside step t+1's forward and backward, which use parameters one step stale. Off by default;
        see docs/offload.md for its effect on the loss.
    delayed_update_start: the first step whose update is delayed; the steps before it update at once
        (ZeRO-Offload's paper turns DPU on after the first few tens of iterations, when the gradients
        change fastest: from step 0 the main job ends far worse, docs/offload.md).
    delayed_update_prediction: where each delayed step's gradient is taken, since it is applied one
        update later. 'none': at the stale master P_t (DeepSpeed's DPU as published). 'extrapolate': at
        P_t plus the last update, a guess that the next update repeats it (no device cost). 'linear'
        (default): at the parameters the next update will give: the host sends P_t + c and a slope s
        (bf16), c + s g being the optimizer's next update as an affine function of the next gradient g
        (the secant through +-(the gradient just applied)), and the device adds s times the gradient it
        has just computed (clipped). This assumes an elementwise optimizer (Adam, AdamW, SGD); it costs 2
        bytes per parameter more host->device per step and two more update evaluations on the host. 'extrapolate' and 'linear' are ours, not ZeRO-Offload's
        (docs/offload.md measures all three). The compute copy then cannot be remade from the master
        weights, so checkpoints store it.
    """

    device: str = "none"
    pin_memory: bool = True
    update: str = "host"
    delayed_update: bool = False
    delayed_update_start: int = 50
    delayed_update_prediction: str = "linear"

    def __post_init__(self):
        k = "OffloadOptimizerConfig."
        _check_offload_device(k, self.device, self.pin_memory)
        require(self.update in OFFLOAD_UPDATES, k + "update", f"unknown update place {self.update!r}",
                f"use one of {', '.join(OFFLOAD_UPDATES)}")
        require(isinstance(self.delayed_update, bool), k + "delayed_update",
                f"must be True or False, got {self.delayed_update!r}")
        require(is_int(self.delayed_update_start) and self.delayed_update_start >= 0, k + "delayed_update_start",
                f"must be an integer >= 0, got {self.delayed_update_start!r}")
        require(self.delayed_update_prediction in DELAYED_PREDICTIONS, k + "delayed_update_prediction",
                f"unknown prediction {self.delayed_update_prediction!r}",
                f"use one of {', '.join(map(repr, DELAYED_PREDICTIONS))}")
        require(not (self.delayed_update and self.update != "host"), k + "delayed_update",
                "overlaps the host update with the next step's forward and backward, but update is "
                f"{self.update!r}", "set update='host', or delayed_update False")
        require(not (self.device == "none" and (self.delayed_update or self.update != "host")), k + "device",
                "is 'none', so update and delayed_update have nothing to act on", "set device='cpu'")

    @property
    def enabled(self) -> bool:
        return self.device == "cpu"

    @property
    def predicts(self) -> bool:
        """Whether delayed steps take their gradients at predicted parameters."""
        return self.delayed_update and self.delayed_update_prediction != "none"


@configurable
@dataclasses.dataclass(frozen=True)
class OffloadParamConfig:
    """ZeRO-3's parameter offload (DeepSpeed's zero_optimization.offload_param).

    device: 'none', or 'cpu': the device keeps no copy of the ZeRO-partitioned parameters; each layer's
        shard of the fp32 master weights comes from host memory where it is gathered (forward, and again
        in the backward pass), next to the all-gather. Needs zero_stage 3 and offload_optimizer on 'cpu'.
        Leaves below persistence_threshold stay on the device, as DeepSpeed's persistent parameters do.
    pin_memory: as for OffloadOptimizerConfig; the master weights' memory kind is the optimizer's.
    """

    device: str = "none"
    pin_memory: bool = True

    def __post_init__(self):
        _check_offload_device("OffloadParamConfig.", self.device, self.pin_memory)

    @property
    def enabled(self) -> bool:
        return self.device == "cpu"
