"""ZeRO-Offload's settings: where the optimizer state and (at ZeRO-3) the parameters live.

OffloadOptimizerConfig is DeepSpeed's zero_optimization.offload_optimizer, OffloadParamConfig its
offload_param; Config holds one of each (Config.offload_optimizer, Config.offload_param) and checks how
they combine with the ZeRO stage and with each other. `zeroflax.config` re-exports both classes.
"""
from __future__ import annotations

import dataclasses

from zeroflax.config_checks import configurable, is_int, require

OFFLOAD_DEVICES = ("none", "cpu", "nvme")
DELAYED_PREDICTIONS = ("linear", "extrapolate", "none")
OFFLOAD_UPDATES = ("host", "device")


def _check_offload_device(prefix: str, device, pin_memory) -> None:
    """The checks both offload blocks share: their `device` and `pin_memory` keys."""
    require(device in OFFLOAD_DEVICES, prefix + "device", f"unknown device {device!r}",
            f"use one of {', '.join(OFFLOAD_DEVICES)}")
    require(isinstance(pin_memory, bool), prefix + "pin_memory", f"must be True or False, got {pin_memory!r}")


@configurable
@dataclasses.dataclass(frozen=True)
class OffloadOptimizerConfig:
    """ZeRO-Offload of the optimizer (DeepSpeed's zero_optimization.offload_optimizer), stages 1-3.

    device: 'none', or 'cpu': the fp32 master weights and the optimizer state live in host memory,
        partitioned over the data axis (12 bytes per parameter / N); the device keeps a compute-dtype
        copy of the parameters (whole at stages 1-2, a shard at stage 3). 'nvme' (ZeRO-Infinity): they
        live in a file under `nvme_path` instead, and each step streams them through `buffer_count`
        host buffers of `buffer_size` elements (read a chunk, update it on the host, write it back, the
        next one read ahead: `zeroflax/step/streamed_update.py`, docs/offload.md "NVMe"). The optimizer
        must act on each element alone (Adam, AdamW, SGD, Lion: checked when the engine is built).
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
    nvme_path: with device 'nvme', the directory of the state's file (DeepSpeed's nvme_path); each
        process of a run keeps its own shards in `<nvme_path>/process_<i>`.
    buffer_count: with 'nvme', the host buffers the stream cycles through (>= 2; one is updated while
        the others are read ahead or written behind). DeepSpeed's offload_optimizer.buffer_count.
    buffer_size: with 'nvme', the parameter elements of one chunk: a buffer holds a chunk's master
        weights and optimizer state (Adam: 12 bytes per element), so host memory holds about
        buffer_count x buffer_size x 12 bytes. A chunk is rows of one device's shard of one leaf (at least
        one row).
    io_threads: with 'nvme', the threads that read and write the file (DeepSpeed's aio.thread_count).
    direct_io: with 'nvme', open the file with O_DIRECT (DeepSpeed's aio does) so that nothing is held
        in the page cache; where the filesystem refuses it (tmpfs), buffered I/O whose pages are dropped.
    """

    device: str = "none"
    pin_memory: bool = True
    update: str = "host"
    nvme_path: str = ""
    buffer_count: int = 4
    buffer_size: int = 10_000_000
    io_threads: int = 2
    direct_io: bool = True
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
        require(isinstance(self.nvme_path, str), k + "nvme_path", f"must be a path, got {self.nvme_path!r}")
        for key, low in (("buffer_count", 2), ("buffer_size", 1), ("io_threads", 1)):
            value = getattr(self, key)
            require(is_int(value) and value >= low, k + key, f"must be an integer >= {low}, got {value!r}")
        require(isinstance(self.direct_io, bool), k + "direct_io", f"must be True or False, got {self.direct_io!r}")
        if self.device == "nvme":
            require(bool(self.nvme_path), k + "nvme_path", "device is 'nvme', so the state needs a directory on a "
                    "local disk", "set nvme_path, e.g. '/local_nvme/zeroflax'")
            require(self.update == "host", k + "update", "with device 'nvme' the update runs on the host, chunk by "
                    f"chunk, as it streams; got {self.update!r}", "set update='host'")
            require(not self.delayed_update, k + "delayed_update", "the delayed update with device 'nvme' is not built",
                    "set delayed_update False, or device='cpu'")
        else:
            require(not self.nvme_path, k + "nvme_path", f"is set, but device is {self.device!r}",
                    "set device='nvme', or remove nvme_path")

    @property
    def enabled(self) -> bool:
        """The master weights and optimizer state are off the device (in host memory, or on disk)."""
        return self.device in ("cpu", "nvme")

    @property
    def on_disk(self) -> bool:
        """They live in a file (ZeRO-Infinity), streamed through host buffers."""
        return self.device == "nvme"

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
        # Streaming each layer's shard from a file into the compiled forward and backward passes would need a
        # host callback per layer inside the step; not built (the master weights can be on disk through
        # offload_optimizer 'nvme', with the device keeping its compute-dtype shard).
        require(self.device != "nvme", "OffloadParamConfig.device", "'nvme' (parameters streamed from disk into "
                "the forward pass) is not built", "use OffloadOptimizerConfig.device='nvme': the fp32 master weights "
                "and optimizer state go to disk, the device keeps a compute-dtype shard (stage 3: 1/N)")

    @property
    def enabled(self) -> bool:
        return self.device == "cpu"
