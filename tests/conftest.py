"""Simulate 8 CPU devices for the whole suite; must run before jax is imported anywhere."""
import gc
import os

# TEST_XLA_FLAGS: the suite's programs are tiny, so compiling them dominates its time; LLVM's -O0 compiles
# them about 30% faster. It changes no semantics (no fast math either way), and the HLO passes that
# decide sharding, collectives, fusion and buffers (what memory_analysis and the comm reports read) still run.
from cli_helpers import TEST_XLA_FLAGS  # noqa: E402

os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), TEST_XLA_FLAGS,
                                    "--xla_force_host_platform_device_count=8"]).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

assert jax.device_count() == 8, f"expected 8 simulated devices, got {jax.device_count()}"


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Free each module's compiled executables when it is done. XLA:CPU maps every executable's code
    into memory, and one process compiling a few hundred of them reached the kernel's mapping limit
    (vm.max_map_count 65530: 'LLVM compilation error: Cannot allocate memory', then a crash) in a
    soak run. Compilations are shared within a module, never across modules."""
    yield
    jax.clear_caches()
    gc.collect()
