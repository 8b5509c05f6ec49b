"""The reports on a compiled step, as functions of the engine (they read `Engine.compile`; the engine
knows nothing of them): `memory_report` and `comm_report`, exported as `zeroflax.memory_report` and
`zeroflax.comm_report`."""
from __future__ import annotations

from zeroflax import comm, explain, memory


def memory_report(engine, state, batch, by: str = "category"):
    """Per-device memory of the compiled step: by category beside ZeRO's theory (`memory.py`), or
    `by="layer"`: every byte XLA reserves charged to a layer and a category (`explain.py`)."""
    if by == "layer":
        return explain.layer_report(engine, state, batch)
    if by != "category":
        raise ValueError(f"memory_report(by={by!r}): 'category' or 'layer'")
    return memory.memory_report(engine, state, batch)


def comm_report(engine, state, batch, phase: str | None = None):
    """Collective bytes of the step of `phase` (default: the steady state; `Engine.phases` lists them)."""
    return comm.comm_report(engine, state, batch, phase)
