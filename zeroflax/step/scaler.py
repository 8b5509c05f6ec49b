"""The loss scaler as a part of the step: fp16's dynamic (or static) loss scale; 1 otherwise."""
from __future__ import annotations

import dataclasses

import jax

from zeroflax.config import LossScaleConfig
from zeroflax.optim.loss_scale import LossScaleState, init_loss_scale, update_loss_scale


@dataclasses.dataclass(frozen=True)
class LossScaler:
    config: LossScaleConfig
    fp16: bool

    @property
    def dynamic(self) -> bool:
        return self.fp16 and self.config.loss_scale == 0

    def init(self) -> LossScaleState:
        return init_loss_scale(self.config, self.fp16)

    def next(self, state: LossScaleState, finite) -> LossScaleState:
        return update_loss_scale(state, ~finite, self.config, self.dynamic)
