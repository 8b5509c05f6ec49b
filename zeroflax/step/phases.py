"""The step's phases: programs of one step that differ in what one part does, picked on the host.

A part with more than one program declares them (`phases`, its steady state last) and how the host picks
one for a step (`Phased`): offload's delayed update runs 'exact' before `delayed_update_start`, then
'steady'; 1-bit Adam's sync runs 'warmup', then 'first' (stages 1-2) and 'compressed'. Every part gets
its own phase (`PhaseClock.of`), so no part reads another's names. At most one part of a step is phased
(the combinations that would make two are refused when the parts are built).
"""
from __future__ import annotations

from typing import Any, Protocol

STEADY = "steady"


class Phased(Protocol):
    phases: tuple[str, ...]  # the part's programs, its steady state last

    def host_view(self, state) -> Any:
        """What picking needs from a state this engine did not make (read from the device once)."""

    def pick(self, step: int, view) -> str:
        """The program of step number `step`."""

    def after(self, step: int, phase: str, view) -> Any:
        """The view after step `step` ran `phase`."""

    # Optional: `rereads` True when the view after a step depends on the device (an fp16 step skipped on
    # overflow changes no state): the clock then reads it from every state, waiting for the step before.


class PhaseClock:
    """Follows the step number on the host, so that picking a program never waits for the device: the
    number is read once from a state the engine did not return itself (a fresh or restored one)."""

    def __init__(self, parts):
        phased = [part for part in parts if len(getattr(part, "phases", (STEADY,))) > 1]
        if len(phased) > 1:
            raise ValueError(f"two phased parts in one step ({[type(p).__name__ for p in phased]}): not built")
        self.part = phased[0] if phased else None
        self.phases: tuple[str, ...] = self.part.phases if self.part is not None else (STEADY,)
        self._count: int | None = None
        self._last = None  # the step array of the state the engine returned last, to recognise it
        self._view = None

    def of(self, part, phase: str) -> str:
        """`part`'s own phase in the step program `phase`."""
        return phase if part is self.part else STEADY

    def phase(self, state) -> str:
        if self.part is None:
            return STEADY
        if state.step is not self._last or getattr(self.part, "rereads", False):
            self._count = int(state.step)
            self._view = self.part.host_view(state)
        return self.part.pick(self._count, self._view)

    def advance(self, new_state, phase: str) -> None:
        if self.part is None:
            return
        self._view = self.part.after(self._count, phase, self._view)
        self._last, self._count = new_state.step, self._count + 1
