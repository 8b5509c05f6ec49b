"""What the machine's XLA backend can compile, asked of the backend itself.

float16 on an x86-64 CPU without the F16C instructions: XLA's CPU backend lowers a float16 conversion to
calls of compiler-rt's `__extendhfsf2` / `__truncsfhf2`, which jaxlib's JIT does not provide, so every
program that touches float16 fails to compile ("Failed to materialize symbols: convert_convert_fusion").
Such CPUs are virtual ones (VirtualBox, x86-64 emulated on ARM) and any run with
`XLA_FLAGS=--xla_cpu_max_isa=SSE4_2` (the test suite's narrow instruction set, docs/tolerances.md).
`Config.precision='fp16'` is refused there with a ConfigError naming the key, instead of XLA's message
halfway through compiling the step.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from zeroflax.config_checks import ConfigError

# Words of XLA:CPU's error when a float16 conversion cannot be linked (the symbol or the JIT's complaint).
_UNLINKABLE = ("materialize symbols", "__extendhfsf2", "__truncsfhf2")


@functools.cache
def float16_compiles(platform: str) -> bool:
    """Whether `platform`'s XLA compiles a float32 -> float16 -> float32 round trip (compiled, not run)."""
    if platform != "cpu":  # GPUs convert float16 natively
        return True
    device = jax.devices(platform)[0]
    argument = jax.ShapeDtypeStruct((8,), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))
    try:
        jax.jit(lambda x: x.astype(jnp.float16).astype(jnp.float32) * 2).lower(argument).compile()
    except Exception as error:  # jaxlib's error type differs between versions; its text does not
        if any(word in str(error) for word in _UNLINKABLE):
            return False
        raise
    return True


def check_precision(precision: str, devices) -> None:
    """ConfigError naming Config.precision if 'fp16' cannot compile on `devices`' backend."""
    if precision != "fp16":
        return
    for platform in sorted({d.platform for d in devices}):
        if not float16_compiles(platform):
            raise ConfigError(
                "Config.precision",
                f"'fp16' cannot compile on this machine's {platform.upper()}: XLA converts float16 there with "
                "runtime functions jaxlib does not link (an x86-64 CPU without F16C, or XLA_FLAGS capping "
                "--xla_cpu_max_isa below AVX; docs/tolerances.md)",
                "use 'bf16' (DeepSpeed's bf16 block) or 'fp32', or a CPU with F16C")
