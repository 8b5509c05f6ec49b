"""Every notebook in experiments/ runs top to bottom in a fresh kernel within its time budget, so none can rot.

The kernel inherits this process's environment (conftest.py: 8 simulated CPU devices, JAX_PLATFORMS=cpu) except
the suite's LLVM -O0 flag, and runs in a tmp_path, so whatever a notebook writes (checkpoints, exports, figures)
stays out of the repository.
"""
import glob
import os
import re
import time

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError

from cli_helpers import TEST_XLA_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "experiments", "*.ipynb")))
BUDGET_S = 120  # each notebook must finish in under 2 minutes on 2 CPU cores
STARTUP_TIMEOUT_S = 120  # the kernel's start alone; under `pytest -n 2` the two cores are busy

# (what the first code cell must do, as a pattern; as said to whoever breaks it)
ENV_DEFAULTS = [
    (re.compile(r"""os\.environ\.setdefault\(\s*["']XLA_FLAGS["']\s*,[^)]*device_count=8"""),
     'os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")'),
    (re.compile(r"""os\.environ\.setdefault\(\s*["']JAX_PLATFORMS["']\s*,\s*["']cpu["']\s*\)"""),
     'os.environ.setdefault("JAX_PLATFORMS", "cpu")'),
]
IMPORTS_JAX = re.compile(r"^\s*(import jax\b|from jax\b)", re.MULTILINE)
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # IPython colours its tracebacks; a test log wants plain text


def kernel_env() -> dict:
    """os.environ without TEST_XLA_FLAGS. -O0 pays off for the suite's many tiny compilations, but a notebook
    runs hundreds of training steps, and -O0 code made the training notebook's steps about twice as slow: its
    budget is meant for the notebook as a user runs it."""
    env = dict(os.environ)
    drop = set(TEST_XLA_FLAGS.split())
    env["XLA_FLAGS"] = " ".join(flag for flag in env.get("XLA_FLAGS", "").split() if flag not in drop)
    return env


def test_there_are_notebooks():
    # An empty glob would parametrize the test below into a silent skip.
    assert NOTEBOOKS, f"no notebooks found in {os.path.join(ROOT, 'experiments')}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_is_committed_clean(path):
    """Valid nbformat v4, no outputs (outputs in git are diffs nobody reviews, and stale the day after), and a
    first code cell that sets up the 8 CPU devices itself, so the notebook also works when opened in Jupyter."""
    name = os.path.basename(path)
    nb = nbformat.read(path, as_version=nbformat.NO_CONVERT)
    nbformat.validate(nb)
    assert nb.nbformat == 4, f"{name}: nbformat {nb.nbformat}, expected 4"
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3", f"{name}: kernelspec is not python3"
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code, f"{name} has no code cells"
    dirty = [i for i, cell in enumerate(nb.cells)
             if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None)]
    assert not dirty, (f"{name}: cells {dirty} hold outputs or execution counts; clear them before committing "
                       "(Jupyter: Edit > Clear Outputs of All Cells)")
    first = code[0].source
    for pattern, call in ENV_DEFAULTS:
        match = pattern.search(first)
        assert match, f"{name}: the first code cell must call {call} before importing jax"
        jax_import = IMPORTS_JAX.search(first)
        assert jax_import is None or jax_import.start() > match.start(), \
            f"{name}: the first code cell imports jax before setting its environment; XLA reads it only once"


@pytest.mark.slow  # multi-process or end-to-end: `make test-slow` (and CI)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_notebook_runs(path, tmp_path, record_property):
    name = os.path.basename(path)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=BUDGET_S, startup_timeout=STARTUP_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}})
    start = time.perf_counter()
    try:
        client.execute(env=kernel_env())  # passed on to the kernel manager's start_kernel
    except CellTimeoutError as error:
        pytest.fail(f"{name}: a cell ran longer than the whole notebook's budget of {BUDGET_S} s:\n"
                    f"{ANSI.sub('', str(error))}", pytrace=False)
    except CellExecutionError as error:  # its message holds the failing cell's source and traceback
        pytest.fail(f"{name} failed after {time.perf_counter() - start:.1f} s:\n{ANSI.sub('', str(error))}",
                    pytrace=False)
    elapsed = time.perf_counter() - start
    record_property("wall_time_s", round(elapsed, 1))
    print(f"{name}: {elapsed:.1f} s")
    assert elapsed <= BUDGET_S, (f"{name} took {elapsed:.1f} s, over its budget of {BUDGET_S} s on 2 CPU cores: "
                                 "cut steps or shapes")
