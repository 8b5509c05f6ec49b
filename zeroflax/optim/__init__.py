"""Optimizers and the update's parts: the loss scaler, ZeRO-Offload's update, 1-bit Adam and 1-bit LAMB,
DeepSpeed's LAMB."""
from zeroflax.optim.lamb import deepspeed_lamb
from zeroflax.optim.onebit import OneBitAdamState, onebit_adam
from zeroflax.optim.onebit_lamb import OneBitLambState, onebit_lamb

__all__ = ["OneBitAdamState", "OneBitLambState", "deepspeed_lamb", "onebit_adam", "onebit_lamb"]
