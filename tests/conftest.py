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


def pytest_collection_modifyitems(config, items):
    """Tests marked fp16 are skipped, with the reason, where XLA's CPU backend cannot compile float16
    (zeroflax/platform.py): a CPU without F16C, or the suite run with XLA_FLAGS=--xla_cpu_max_isa=SSE4_2."""
    from zeroflax.platform import float16_compiles

    marked = [item for item in items if item.get_closest_marker("fp16")]
    if marked and not float16_compiles("cpu"):
        skip = pytest.mark.skip(reason="XLA's CPU backend cannot compile float16 here (no F16C instructions, or "
                                       "--xla_cpu_max_isa below AVX): Config.precision='fp16' is refused")
        for item in marked:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_code():
    """Free each module's compiled executables when it is done. XLA:CPU maps every executable's code
    into memory, and one process compiling a few hundred of them reached the kernel's mapping limit
    (vm.max_map_count 65530: 'LLVM compilation error: Cannot allocate memory', then a crash) in a
    soak run. Compilations are shared within a module, never across modules."""
    yield
    jax.clear_caches()
    gc.collect()
