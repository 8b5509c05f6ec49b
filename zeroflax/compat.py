"""Every call whose form differs between the jax versions zeroflax supports, in one place.

Tested: jax 0.10.x (Python 3.11, the default suite) and jax 0.11.x (Python 3.12, the GPU machines' image;
`.ci/run` runs the version-sensitive part of the suite there). Each helper picks its form by looking at
the API itself (a signature, an attribute), not at a version number, so a patch release that keeps the
API needs no change here.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Callable, Iterator

import jax
from jax.experimental.compute_on import compute_on as _compute_on


@functools.cache
def _compute_on_takes_function() -> bool:
    # jax <= 0.10: compute_on(compute_type) is a context manager / decorator factory.
    # jax >= 0.11: compute_on(f, *, compute_type, out_memory_spaces) wraps f and says where outputs live.
    return "out_memory_spaces" in inspect.signature(_compute_on).parameters


def on_host(f: Callable) -> Callable:
    """`f` compiled to run on the host (XLA's 'device_host' compute type) with its outputs left in host
    memory, as ZeRO-Offload's host update needs (zeroflax/step/offloaded_update.py)."""
    if _compute_on_takes_function():
        return _compute_on(f, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)
    return _compute_on("device_host")(jax.jit(f))


@functools.cache
def _triton_lowering_reads_abstract_device() -> bool:
    # jax <= 0.10: the Pallas Triton lowering takes the compute capability of the first local GPU, and
    #   without one assumes 9.0 (Hopper); lowering for CUDA on a CPU-only machine needs nothing.
    # jax >= 0.11: it takes the GPU from the context's abstract mesh (its AbstractDevice) or the local
    #   device, through get_gpu_info (exported by jax.experimental.pallas.triton from 0.11 on), and
    #   without either fails: "No supported GPU devices found, please specify an abstract GPU device".
    from jax.experimental.pallas import triton as pallas_triton

    return hasattr(pallas_triton, "get_gpu_info")


@contextlib.contextmanager
def lowering_for_gpu(mesh: jax.sharding.Mesh | None = None, *,
                     device_kind: str = "NVIDIA H200") -> Iterator[jax.sharding.Mesh | None]:
    """Lower Pallas (Triton) kernels for a GPU on a machine that has none, e.g. in CPU-only tests.

    Inside the `with`, `jax.export.export(f, platforms=("cuda",))(*shapes)` emits each kernel as a
    Triton custom call whose Triton IR targets `device_kind` (a `Device.device_kind` as jax reports
    it; the GPU machines' is "NVIDIA H200", compute capability 9.0). Needed on jax 0.11, whose
    lowering asks for the target GPU and fails without one; jax 0.10 takes the local GPU's, or 9.0
    when there is none, and ignores `device_kind`.

    Yields the mesh that the shard_maps inside `f` must use, so build `f` inside the `with`: `mesh`
    itself on jax 0.10; on jax 0.11 an AbstractMesh with `mesh`'s axes that carries the GPU (a
    shard_map over `mesh`'s CPU devices would ask the CPU for its kernels' target). None for None.
    """
    if not _triton_lowering_reads_abstract_device():
        yield mesh
        return
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    target = jax.sharding.AbstractMesh((), ()) if mesh is None else mesh.abstract_mesh
    target = target.update(abstract_device=device)
    with jax.sharding.use_abstract_mesh(target):
        yield target if mesh is not None else None


def scan_counts(params: dict) -> tuple[int, int]:
    """(constants, carried values) of a `scan` equation's inputs, which are its constants, its carry and its
    scanned inputs, in that order (zeroflax/sharding/uses.py reads them).
    jax <= 0.10: the equation's `num_consts` and `num_carry`.
    jax >= 0.11: `ft_in`, a flat tree of the three kinds (constants, carry, scanned inputs), one value per input."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].elts
    return len(list(consts.vals)), len(list(carry.vals))

