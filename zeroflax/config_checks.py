"""What zeroflax's config dataclasses are built with.

`ConfigError`: the message names the key (as a gin file writes it, e.g. `Config.zero_stage`) and what would
fix it. `require` and `is_int`: the checks each dataclass's `__post_init__` makes with it. `configurable`:
gin's decorator, or the identity where gin-config is not installed.

`zeroflax.config` re-exports ConfigError and configurable; import them from there.
"""
from __future__ import annotations

from typing import Any

try:
    import gin
    configurable = gin.configurable
except ImportError:  # e.g. a GPU image without gin-config: the Python API works, only the CLI needs gin
    def configurable(cls):
        return cls


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the key and how to fix it."""

    def __init__(self, key: str, problem: str, fix: str | None = None):
        self.key = key
        message = f"{key}: {problem}"
        if fix:
            message += f" ({fix})"
        super().__init__(message)


def require(ok: bool, key: str, problem: str, fix: str | None = None) -> None:
    """Raise ConfigError(key, problem, fix) unless `ok`."""
    if not ok:
        raise ConfigError(key, problem, fix)


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)
