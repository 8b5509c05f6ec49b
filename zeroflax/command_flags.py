"""The flags the `zeroflax` commands share, each read one way: --gin_file/--gin_param into gin (`parse_gin`,
which refuses gin `import` statements and names the flag at fault), the simulated CPU device count, set
before jax creates its CPU backend (`force_cpu_devices`), and comma-separated integer lists such as
--stages (`int_list`).

cli.py and the commands it registers (estimate, plan, explain) import this module; it imports none of them.
"""
from __future__ import annotations

import os
import tokenize

from zeroflax.config import ConfigError


def force_cpu_devices(count: int) -> None:
    """Simulated CPU devices; must happen before jax creates its CPU backend."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={count}"])


def add_gin_flags(parser, file_help: str = "gin config file (repeatable)",
                  param_help: str = "gin binding (repeatable)") -> None:
    """--gin_file and --gin_param, as every command that reads the GPT's gin config takes them."""
    parser.add_argument("--gin_file", action="append", default=[], help=file_help)
    parser.add_argument("--gin_param", action="append", default=[], help=param_help)


def parse_gin(files, bindings):
    import gin

    # Importing these registers their configurables with gin.
    import zeroflax.train  # noqa: F401
    import zeroflax.models.gpt  # noqa: F401

    for path in files:
        if not os.path.isfile(path):
            raise ConfigError("--gin_file", f"{path} does not exist")
    for flag, text, where in ([("--gin_file", open(path).read(), path) for path in files]
                              + [("--gin_param", binding, repr(binding)) for binding in bindings]):
        try:
            imports = _gin_imports(text, where, set())
        except _MissingInclude as error:
            raise ConfigError(flag, str(error), "gin includes are relative to the directory zeroflax runs in") from None
        if imports:
            raise ConfigError(flag, f"{imports[0]}: gin import statements are refused (an import runs the module's "
                              "code; a gin file is configuration)", "zeroflax's configurables need no import: "
                              "remove the line, or import the module in your own Python code")
    # Files, then bindings (gin's own order), parsed apart so an error names the flag at fault.
    for flag, args, where in (("--gin_file", (files, None), files), ("--gin_param", (None, bindings), bindings)):
        try:
            gin.parse_config_files_and_bindings(*args, finalize_config=flag == "--gin_param")
        except (ValueError, SyntaxError, tokenize.TokenError) as error:  # malformed gin, unknown names
            first = " ".join(str(error).split("\n")[0:1])
            located = any(os.path.basename(str(w)) in first for w in where)
            raise ConfigError(flag, f"gin: {first}" + ("" if located else f" (in {', '.join(map(str, where))})")) from error


def _gin_imports(text: str, where: str, seen: set) -> list[str]:
    """The `import` statements of gin text and of the files it includes ('where: import module'); an
    include of a missing file raises _MissingInclude. Text gin cannot parse yields none here: gin's own
    parse then reports the error."""
    import gin
    from gin import config_parser

    found = []
    try:
        for statement in config_parser.ConfigParser(text, gin.config.ParserDelegate(skip_unknown=True)):
            if isinstance(statement, config_parser.ImportStatement):
                found.append(f"{where}: import {statement.module}")
            elif isinstance(statement, config_parser.IncludeStatement) and statement.filename not in seen:
                seen.add(statement.filename)
                if not os.path.isfile(statement.filename):  # gin itself fails on it with a TypeError
                    raise _MissingInclude(f"{where}: include '{statement.filename}': no such file")
                with open(statement.filename) as f:
                    found += _gin_imports(f.read(), statement.filename, seen)
    except _MissingInclude:
        raise
    except Exception:  # noqa: BLE001 (malformed gin: the real parse below says what is wrong)
        return found
    return found


class _MissingInclude(Exception):
    """A gin `include` that names no file (gin itself fails on it with a TypeError)."""


def int_list(text: str, flag: str) -> list[int]:
    """A comma-separated list of integers >= 0 (at least one) given to `flag`, e.g. --stages 0,1,2,3."""
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ConfigError(flag, f"must be a comma-separated list of integers, got {text!r}") from None
    if not values or min(values) < 0:
        raise ConfigError(flag, f"must list integers >= 0, got {text!r}")
    return values
