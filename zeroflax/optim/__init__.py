"""Optimizers and the update's parts: the loss scaler, ZeRO-Offload's update, 1-bit Adam, DeepSpeed's LAMB."""
from zeroflax.optim.lamb import deepspeed_lamb
from zeroflax.optim.onebit import OneBitAdamState, onebit_adam

__all__ = ["OneBitAdamState", "deepspeed_lamb", "onebit_adam"]
