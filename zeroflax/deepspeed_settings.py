"""The zeroflax settings a DeepSpeed JSON decides ("auto" is resolved before, in deepspeed_auto.py).

The reader of each DeepSpeed block records what it decides in one `Settings`, by gin-style name
('Config.zero_stage'); from_deepspeed (deepspeed_config.py) builds the Config from them.
"""
from __future__ import annotations

from typing import Any, Mapping

from zeroflax.config import ConfigError


class Settings:
    """The zeroflax settings the JSON decides, by gin-style name ('Config.zero_stage'), and where each came
    from. `bound` values (gin) win over DeepSpeed's defaults and "auto"; a value the JSON writes must equal them."""

    def __init__(self, bound: Mapping[str, Any]):
        self.bound = dict(bound or {})
        self.values: dict[str, Any] = {}

    def set(self, name: str, value, path: str, written: bool = True):
        if name in self.bound:
            if written and self.bound[name] != value:
                raise ConfigError(path, f"gives {value!r} but {name} is bound to {self.bound[name]!r} elsewhere "
                                  "(gin)", f"remove one of the two, or make them agree")
            value = self.bound[name]
        self.values[name] = value
        return value
