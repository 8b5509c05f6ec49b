"""Optimizers and the update's parts: the loss scaler, ZeRO-Offload's update, 1-bit Adam, 1-bit LAMB, 0/1 Adam,
DeepSpeed's LAMB."""
from zeroflax.optim.lamb import deepspeed_lamb
from zeroflax.optim.onebit import OneBitAdamState, onebit_adam
from zeroflax.optim.onebit_lamb import OneBitLambState, onebit_lamb
from zeroflax.optim.zero_one_adam import ZeroOneAdamState, zero_one_adam

__all__ = ["OneBitAdamState", "OneBitLambState", "ZeroOneAdamState", "deepspeed_lamb", "onebit_adam", "onebit_lamb",
           "zero_one_adam"]
