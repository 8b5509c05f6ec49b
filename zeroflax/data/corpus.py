"""Token sources: a built-in English corpus that needs no download, text files and ``.npy`` token files.

Everything here is numpy-only on purpose: data loading runs before (and independently of) any
accelerator setup, so it must not import jax.
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys
import warnings

import numpy as np

__all__ = ["DataError", "builtin_corpus", "load_text_file", "load_token_file", "load_tokens"]


class DataError(ValueError):
    """A data source is missing, empty or malformed; the message names the path/source and the fix.

    Subclasses ValueError so callers that already catch bad-argument errors keep working.
    """


# Modules whose docstrings make up the second part of the built-in corpus. Fixed and sorted so the
# corpus is the same bytes everywhere; chosen to be pure stdlib that imports on every CPython build
# and defines the same public names on every platform (os, socket, subprocess, selectors, locale,
# ssl-dependent modules and modules with C/Python fallbacks such as decimal are left out for that reason).
_DOC_MODULES = (
    "abc", "argparse", "ast", "asyncio.base_events", "asyncio.events", "asyncio.futures", "asyncio.locks",
    "asyncio.protocols", "asyncio.queues", "asyncio.streams", "asyncio.subprocess", "asyncio.tasks",
    "asyncio.transports", "base64", "bdb", "bisect", "builtins", "calendar", "cmd", "code", "codecs", "codeop",
    "collections", "collections.abc", "colorsys", "compileall", "concurrent.futures._base",
    "concurrent.futures.process", "concurrent.futures.thread", "configparser", "contextlib", "contextvars",
    "copy", "copyreg", "csv", "dataclasses", "datetime", "difflib", "dis", "doctest", "email.feedparser",
    "email.headerregistry", "email.message", "email.policy", "email.utils", "enum", "filecmp", "fileinput",
    "fnmatch", "fractions", "functools", "getopt", "gettext", "glob", "graphlib", "gzip", "heapq", "hmac",
    "html.parser", "http.cookiejar", "http.cookies", "http.server", "importlib.abc", "inspect", "io",
    "ipaddress", "itertools", "json", "json.decoder", "json.encoder", "linecache", "logging", "logging.config",
    "logging.handlers", "mailbox", "math", "modulefinder", "netrc", "ntpath", "numbers", "operator", "optparse",
    "pathlib", "pdb", "pickle", "pkgutil", "platform", "plistlib", "posixpath", "pprint", "profile", "pstats",
    "py_compile", "pyclbr", "queue", "quopri", "random", "re", "reprlib", "runpy", "sched", "secrets", "shelve",
    "shlex", "shutil", "socketserver", "stat", "statistics", "string", "struct", "symtable", "tabnanny",
    "tarfile", "tempfile", "textwrap", "threading", "timeit", "token", "tokenize", "trace", "traceback",
    "types", "typing", "unittest.case", "unittest.loader", "unittest.mock", "unittest.result",
    "unittest.runner", "unittest.suite", "urllib.parse", "uuid", "warnings", "weakref", "wsgiref.handlers",
    "xml.dom.minidom", "xml.dom.pulldom", "xml.etree.ElementTree", "xml.sax.handler", "xml.sax.saxutils",
    "xmlrpc.client", "xmlrpc.server", "zipapp", "zipfile", "zipimport",
)
_SEPARATOR = "\n\n"
_MIN_DOC_CHARS = 40  # shorter docstrings are mostly "Return self.x." boilerplate, not prose

_BUILTIN_CACHE: bytes | None = None


def _module_docstrings() -> list[str]:
    """Docstrings of _DOC_MODULES in a fixed order: module, then its public classes (with their public
    members) and functions in sorted name order.

    Only objects whose ``__module__`` is the module itself are used, so the result does not depend on
    which other modules happen to be imported or re-exported. Exact repeats (inherited docstrings) are
    kept once.
    """
    seen: set[str] = set()
    docs: list[str] = []

    def add(obj) -> None:
        doc = inspect.getdoc(obj)
        if not doc:
            return
        doc = doc.strip()
        if len(doc) >= _MIN_DOC_CHARS and doc not in seen:
            seen.add(doc)
            docs.append(doc)

    with warnings.catch_warnings():
        # Touching deprecated attributes (typing.io, ...) warns; under -W error that would break the corpus.
        warnings.simplefilter("ignore")
        for mod_name in _DOC_MODULES:
            try:
                module = importlib.import_module(mod_name)
            except ImportError as exc:
                raise DataError(
                    f"builtin corpus: stdlib module {mod_name!r} cannot be imported ({exc}); this Python "
                    "installation is incomplete. Pass a text file or .npy token file as the data source instead."
                ) from exc
            add(module)
            namespace = vars(module)
            for name in sorted(namespace):
                obj = namespace[name]
                if name.startswith("_") or getattr(obj, "__module__", None) != mod_name:
                    continue
                if inspect.isclass(obj):
                    add(obj)
                    members = vars(obj)
                    for member_name in sorted(members):
                        if member_name.startswith("_"):
                            continue
                        member = members[member_name]
                        if isinstance(member, (classmethod, staticmethod)):
                            member = member.__func__
                        if _added_by_third_party(member):
                            continue
                        if inspect.isroutine(member) or isinstance(member, property):
                            add(member)
                elif inspect.isroutine(obj):
                    add(obj)
    return docs


def _added_by_third_party(member) -> bool:
    """Whether a class member was set by a package outside the standard library (transformers adds
    `warning_once` to `logging.Logger` when imported): such members would make the corpus depend on what
    the process imported before building it."""
    origin = getattr(getattr(member, "fget", member), "__module__", None)
    return isinstance(origin, str) and origin.split(".")[0] not in sys.stdlib_module_names


def builtin_corpus() -> bytes:
    """About 1.2 MB of English text (UTF-8) taken from the running Python installation itself.

    Why: examples and tests need real prose to train a byte-level model on, on machines without network
    access. Python's help topics (``pydoc_data.topics``, ~465 KB, joined in sorted-key order) plus the
    docstrings of a fixed list of stdlib modules are always there and are the same bytes for the same
    Python version, in every process. Built once per process, then cached.
    """
    global _BUILTIN_CACHE
    if _BUILTIN_CACHE is None:
        if sys.flags.optimize >= 2:
            raise DataError(
                "builtin corpus: Python runs with -OO (or PYTHONOPTIMIZE=2), which strips the stdlib "
                "docstrings the corpus is made of, so it would differ from other processes. Run without -OO, "
                "or pass a text file or .npy token file as the data source."
            )
        try:
            from pydoc_data.topics import topics
        except ImportError as exc:
            raise DataError(
                "builtin corpus: pydoc_data.topics is missing from this Python installation; pass a text file "
                "or .npy token file as the data source instead."
            ) from exc
        parts = [topics[key].strip() for key in sorted(topics)]
        parts.extend(_module_docstrings())
        _BUILTIN_CACHE = _SEPARATOR.join(parts).encode("utf-8")
    return _BUILTIN_CACHE


def _check_file(path, kind: str, fix: str) -> str:
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"{kind} {path!r} does not exist; {fix}")
    if os.path.isdir(path):
        raise DataError(f"{kind} {path!r} is a directory, not a file; {fix}")
    return path


def load_text_file(path) -> bytes:
    """Raw bytes of a text file (a byte-level model needs no decoding). DataError if missing, a directory or
    empty, because training on nothing would otherwise fail much later with an unhelpful shape error."""
    fix = "pass an existing, non-empty text file, a .npy token file, or 'builtin'"
    path = _check_file(path, "text file", fix)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise DataError(f"text file {path!r} cannot be read ({exc}); {fix}") from exc
    if not data:
        raise DataError(f"text file {path!r} is empty; {fix}")
    return data


def load_token_file(path) -> np.ndarray:
    """A 1-D array of non-negative integer tokens from a ``.npy`` file, as uint8 (kept as is) or int32.

    Tokens end up as int32 batches, so wider dtypes are checked to fit and narrowed here, once, rather
    than wrapping silently per batch. Pickled/object arrays are refused (``allow_pickle=False``): a
    token file must never execute code.
    """
    fix = "pass a .npy file holding a non-empty 1-D integer array (e.g. np.save(path, tokens.astype(np.int32)))"
    path = _check_file(path, ".npy token file", fix)
    try:
        tokens = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise DataError(f".npy token file {path!r} cannot be read as a .npy array ({exc}); {fix}") from exc
    if not isinstance(tokens, np.ndarray):
        raise DataError(f".npy token file {path!r} holds an archive, not one array; {fix}")
    if tokens.ndim != 1:
        raise DataError(f".npy token file {path!r} has shape {tokens.shape}, expected 1-D; {fix}")
    if not np.issubdtype(tokens.dtype, np.integer):
        raise DataError(f".npy token file {path!r} has dtype {tokens.dtype}, expected an integer dtype; {fix}")
    if tokens.size == 0:
        raise DataError(f".npy token file {path!r} is empty (0 tokens); {fix}")
    if tokens.dtype == np.uint8:
        return tokens
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi > np.iinfo(np.int32).max:
        raise DataError(
            f".npy token file {path!r} has token ids in [{lo}, {hi}], outside [0, 2**31 - 1]; {fix}"
        )
    return tokens.astype(np.int32, copy=False)


def load_tokens(source) -> np.ndarray:
    """Resolve a data source string to a 1-D token array (uint8 for bytes, else int32).

    ``'builtin'`` is the built-in corpus (use ``'./builtin'`` for a file of that name); a path ending in
    ``.npy`` is a token file; any other path is a text file tokenized as raw bytes.
    """
    if isinstance(source, str) and source == "builtin":
        return np.frombuffer(builtin_corpus(), dtype=np.uint8)
    try:
        path = os.fspath(source)
    except TypeError:
        raise DataError(
            f"data source {source!r} is not a path; pass 'builtin', a text file path or a .npy token file path"
        ) from None
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    if path.lower().endswith(".npy"):
        return load_token_file(path)
    return np.frombuffer(load_text_file(path), dtype=np.uint8)
