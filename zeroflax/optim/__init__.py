"""Optimizers and the update's parts: the loss scaler, ZeRO-Offload's update, 1-bit Adam."""
from zeroflax.optim.onebit import OneBitAdamState, onebit_adam

__all__ = ["OneBitAdamState", "onebit_adam"]
