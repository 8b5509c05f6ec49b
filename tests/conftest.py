"""Simulate 8 CPU devices for the whole suite; must run before jax is imported anywhere."""
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

assert jax.device_count() == 8, f"expected 8 simulated devices, got {jax.device_count()}"
