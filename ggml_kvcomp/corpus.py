"""An offline perplexity corpus built from the docstrings of Python's standard library.

The text is English technical prose that exists on every machine with Python. It is built
deterministically from a fixed module list (the same Python version gives the same bytes),
and the sha256 of the result is recorded next to each measurement.
"""

from __future__ import annotations

import ast
import hashlib
import sysconfig
from pathlib import Path

from .paths import cache_dir

# Modules with long, prose-like docstrings; order matters for determinism.
MODULES: tuple[str, ...] = (
    "argparse", "asyncio/events", "asyncio/tasks", "base64", "bisect", "calendar", "codecs",
    "collections/__init__", "configparser", "contextlib", "csv", "dataclasses", "datetime",
    "decimal", "difflib", "doctest", "email/message", "enum", "fractions", "ftplib",
    "functools", "getopt", "gettext", "heapq", "http/client", "http/cookiejar", "imaplib",
    "inspect", "ipaddress", "json/__init__", "logging/__init__", "mailbox", "nntplib",
    "optparse", "os", "pathlib", "pickle", "pprint", "pydoc", "queue", "random", "re/__init__",
    "sched", "secrets", "selectors", "shlex", "shutil", "smtplib", "socket", "statistics",
    "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "tokenize", "trace", "turtle", "typing", "unittest/case", "urllib/parse", "uuid", "warnings",
    "wave", "weakref", "zipfile",
)


def _docstrings(source: str) -> list[str]:
    tree = ast.parse(source)
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 200:
                out.append(doc)
    return out


# Held-out text: modules the corpus does not read, for checking that what was tuned on the
# corpus (and what the K statistics were measured on) holds on text neither has seen.
HELDOUT_MODULES: tuple[str, ...] = (
    "ast", "bz2", "cmd", "code", "concurrent/futures/_base", "dis", "email/headerregistry", "email/utils", "fnmatch",
    "glob", "gzip", "hashlib", "hmac", "html/parser", "http/server", "importlib/metadata/__init__", "locale",
    "logging/handlers", "lzma", "mimetypes", "multiprocessing/managers", "multiprocessing/pool", "numbers", "operator",
    "pdb", "pickletools", "pkgutil", "platform", "plistlib", "runpy", "signal", "ssl", "struct", "sysconfig",
    "traceback", "types", "xml/dom/minidom", "xml/etree/ElementTree", "zipapp", "zipimport", "zoneinfo/_zoneinfo",
)


def build_text(modules: tuple[str, ...] = MODULES) -> str:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    parts: list[str] = []
    for mod in modules:
        path = stdlib / f"{mod}.py"
        if path.exists():
            parts.extend(_docstrings(path.read_text(encoding="utf-8", errors="replace")))
    return "\n\n".join(parts) + "\n"


def corpus_file(heldout: bool = False) -> Path:
    """Writes the corpus (or the held-out text) into the cache (once per content) and returns
    its path."""
    text = build_text(HELDOUT_MODULES if heldout else MODULES)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    out = cache_dir() / "corpus" / f"stdlib-{'heldout' if heldout else 'docs'}-{digest}.txt"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
    return out
