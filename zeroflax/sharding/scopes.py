"""Scopes: the names the train step writes into the HLO's metadata, and the dynamic scopes tracing reads.

Named scopes (`jax.named_scope`): the compiled program keeps each operation's name stack as its
`op_name`; these scopes make the parts of the step and the model's blocks findable there: the memory
report finds ZeRO-3's gathers by group, the memory explainer charges every buffer to a layer and a part
of the step.

Dynamic scopes (`ThreadStack`): what the engine tells the code it traces (its layer context, the
pipeline's stage, the gather groups running) is set by a context manager around the trace and read
deeper in the call stack. JAX traces in the thread that called it, so each of these is a stack per
thread: two threads tracing at once each see only the scopes they entered.
"""
from __future__ import annotations

import contextlib
import re
import threading
from typing import Any, Callable, Iterator

GROUP_SCOPE, SCOPE_END = "zeroflax_group[", "]"  # + the group's module path: one gather group
LAYERS_SCOPE = "zeroflax_layers["  # + the number of stacked layers: one `scan_layers` loop
GRAD_SYNC_SCOPE = "zeroflax_grad_sync"  # the gradient synchronisation across `data`
UPDATE_SCOPE = "zeroflax_update"  # clipping, the optimizer's update and its application
GROUP_NAME = re.compile(re.escape(GROUP_SCOPE) + r"(.*?)" + re.escape(SCOPE_END))  # a group's name in an op_name


class ThreadStack:
    """A stack of values, one per thread: a dynamic scope. `push(value)` is a context manager that
    makes `value` the innermost one (`top()`) until it exits. `bottom`, when given, makes each
    thread's stack start with one value of its own (`bottom()`), never popped."""

    def __init__(self, bottom: Callable[[], Any] | None = None):
        self._local = threading.local()
        self._bottom = bottom

    def _items(self) -> list:
        items = getattr(self._local, "items", None)
        if items is None:
            items = self._local.items = [] if self._bottom is None else [self._bottom()]
        return items

    def top(self, default=None):
        """The innermost value of this thread's stack, or `default` when it is empty."""
        items = self._items()
        return items[-1] if items else default

    def set_top(self, value) -> None:
        """Replace the innermost value (a scope's own state, known only after it was entered)."""
        self._items()[-1] = value

    def __len__(self) -> int:
        return len(self._items())

    def __iter__(self) -> Iterator:
        """This thread's values, outermost first (a snapshot)."""
        return iter(tuple(self._items()))

    @contextlib.contextmanager
    def push(self, value):
        items = self._items()
        items.append(value)
        try:
            yield value
        finally:
            items.pop()
