"""Every numeric tolerance of the suite is checked here, and can be recorded with its measured value.

XLA's CPU backend vectorises a reduction according to the instruction set it compiles for (SSE4.2, AVX2,
AVX-512), so the same float32 program rounds differently on different CPUs: a bound chosen by looking at
one machine's number can fail on the next. The suite therefore compares floating-point results only
through `at_most` and `close`, which assert as a bare comparison would and, when the environment variable
ZEROFLAX_TOLERANCE_LOG names a file, also append one JSON line per check: the test, the check's name, the
measured value, its bound and the instruction set XLA was capped at. tools/tolerance_audit.py turns the
logs of runs under several instruction sets into the table of each check's smallest margin (bound over
measured value); .ci/run prints it, and a check whose margin falls under 3x on any instruction set is
one to widen with a reason, to move to the noise floor of tests/noise_floor.py, or to make less
sensitive.

Checks of quantities with no rounding in them (bytes moved, bytes at rest, counts) are plain asserts.
"""
from __future__ import annotations

import json
import os
import re
import sys

import numpy as np

LOG = os.environ.get("ZEROFLAX_TOLERANCE_LOG")


def instruction_set() -> str:
    """The instruction set XLA's CPU backend is capped at ('native' without --xla_cpu_max_isa)."""
    found = re.findall(r"--xla_cpu_max_isa=(\S+)", os.environ.get("XLA_FLAGS", ""))
    return found[-1] if found else "native"


HELPERS = {"tolerance.py", "noise_floor.py"}  # frames skipped when naming a check's site


def _site() -> str:
    """'file.py::function' of the first caller outside the helpers: stable when lines move."""
    frame = sys._getframe(1)
    while os.path.basename(frame.f_code.co_filename) in HELPERS and frame.f_back is not None:
        frame = frame.f_back
    if frame.f_code.co_filename.startswith("<"):  # a script run with -c by a test: named after that test
        return os.environ.get("PYTEST_CURRENT_TEST", "<string>").split(" ")[0].split("[")[0].rsplit("/", 1)[-1]
    return f"{os.path.basename(frame.f_code.co_filename)}::{frame.f_code.co_name}"


def record(what: str, measured: float, bound: float, kind: str = "at_most") -> None:
    """One JSON line in ZEROFLAX_TOLERANCE_LOG, if set. kind: 'at_most' (measured <= bound), 'at_least'
    (measured >= bound: a difference that must show), 'claim' (measured <= bound for a quantity that is
    not a rounding error: a loss that must fall, an estimator's spread), or 'info' (a ratio worth watching that no assert compares with `bound` directly: the error over the
    noise floor)."""
    if not LOG:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
    line = json.dumps({"site": _site(), "what": what, "test": test, "measured": float(measured),
                       "bound": float(bound), "kind": kind, "isa": instruction_set()})
    with open(LOG, "a") as f:  # one short write per line: several pytest workers may append at once
        f.write(line + "\n")


def at_most(measured: float, bound: float, what: str, detail: str = "") -> None:
    """assert measured <= bound, recorded under `what` (a fixed name: the audit groups by it); `detail`
    goes into the failure's message only. A measured value <= 0 has an unbounded margin."""
    measured = float(measured)
    record(what, measured, bound)
    assert measured <= bound, f"{what}: {measured:.3g} > {bound:.3g} {detail}".rstrip()


def at_least(measured: float, bound: float, what: str, detail: str = "") -> None:
    """assert measured >= bound, recorded: a difference that must show, a loss that must fall."""
    measured = float(measured)
    record(what, measured, bound, "at_least")
    assert measured >= bound, f"{what}: {measured:.3g} < {bound:.3g} {detail}".rstrip()


def claim(measured: float, bound: float, what: str) -> None:
    """assert measured <= bound for a quantity that is not a rounding error: a loss that must fall (last over
    first), an estimator's bias or spread. Its margin is the gap to the bound against how far the value
    moves between instruction sets, which tools/tolerance_audit.py measures from the logs of several
    (bound / measured says little here)."""
    measured = float(measured)
    record(what, measured, bound, "claim")
    assert measured <= bound, f"{what}: {measured:.3g} > {bound:.3g}"


def close(actual, desired, *, rtol: float = 0.0, atol: float = 0.0, what: str) -> None:
    """numpy's assert_allclose, recorded as the worst element's |actual - desired| / (atol + rtol |desired|):
    1 is the bound."""
    actual, desired = np.asarray(actual, np.float64), np.asarray(desired, np.float64)
    assert actual.shape == desired.shape or desired.size == 1, (what, actual.shape, desired.shape)
    allowed = atol + rtol * np.abs(desired)
    excess = np.abs(actual - desired)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(excess == 0, 0.0, excess / allowed)
    worst = float(np.max(ratio)) if ratio.size else 0.0
    record(what, worst, 1.0)
    if not worst <= 1.0:  # numpy's message shows the worst elements; a NaN fails here even where it matches
        np.testing.assert_allclose(actual, desired, rtol=rtol, atol=atol, err_msg=what, equal_nan=False)
        raise AssertionError(f"{what}: worst element {worst} of its bound")


def _norm2(x) -> float:
    return float(np.sum(np.square(np.asarray(x, np.float64))))


def relative_error(params, reference) -> float:
    """||params - reference|| / ||reference|| over the whole parameter vector (float64 sums)."""
    import jax  # here, not at the top: tests/layout_grid.py imports this module without jax

    pairs = list(zip(jax.tree.leaves(params), jax.tree.leaves(reference), strict=True))
    diff = sum(_norm2(np.asarray(a, np.float64) - np.asarray(b, np.float64)) for a, b in pairs)
    return (diff / sum(_norm2(b) for _, b in pairs)) ** 0.5


def leaf_errors(params, reference) -> list[float]:
    """Each leaf's ||a - b|| / ||b|| (a leaf that is zero in the reference: its absolute distance)."""
    import jax

    errors = []
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(reference), strict=True):
        norm = _norm2(b) ** 0.5
        errors.append(_norm2(np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 0.5 / (norm if norm else 1.0))
    return errors


def runs_agree(params, other, bound: float, what: str, leaf_bound: float = 1e-4) -> float:
    """Two zeroflax runs that sum the same partial sums (offload against none, one remat policy against
    another): the whole vector within `bound`, each leaf within `leaf_bound` (a wrong small leaf hardly
    moves the whole vector's norm). Returns the relative error."""
    errors = leaf_errors(params, other)
    worst = int(np.argmax(errors))
    at_most(errors[worst], leaf_bound, f"{what}: worst leaf's relative error", f"(leaf {worst})")
    error = relative_error(params, other)
    at_most(error, bound, f"{what}: relative error")
    return error
