"""`TrainState`: what one step takes and returns. Each optional part keeps its state in its own fields.

Its arrays are as the engine stores them: a leaf partitioned over a data size that divides none of its
dimensions is zero-padded (sharding/padding.py), and the interleaved pipeline keeps its layers in
pipeline order. `Engine.model_params(state)` gives the parameters as the model declares them."""
from __future__ import annotations

from typing import Any

import jax
from flax import struct

from zeroflax.optim.loss_scale import LossScaleState


@struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: optimizer steps attempted (skipped ones included)
    params: Any  # fp32 master parameters, at-rest sharding of the ZeRO stage (stored: see the module docstring)
    opt_state: Any
    loss_scale: LossScaleState  # the loss scaler's state (step/scaler.py)
    rng: jax.Array  # uint32[2] base key; step and device are folded in
    model_state: Any = None  # Flax collections besides params (e.g. batch_stats): replicated, or None
    # The update's state (offload, step/offloaded_update.py; None for the update on the device):
    compute_params: Any = None  # the device's compute-dtype copy of the parameters (a streamed leaf: None)
    pending_grads: Any = None  # the delayed update's gradients of the previous step (host)
    # The gradient sync's state: 1-bit Adam's or LAMB's error buffers and last exchanged momentum (ZeRO's sync: None).
    sync_state: Any = None
