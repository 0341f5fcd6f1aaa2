"""Where things live: the repository, the cache folder and the built binaries."""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    """The cache for downloads, models, corpora and builds (never inside the clone)."""
    return Path(os.environ.get("KVCOMP_CACHE", Path.home() / ".cache" / "kvcomp"))


# what a missing library or tool asks of the user
NO_BUILD = "build first with scripts/build.sh, or pip install the package with its native build (python/README.md)"


def wheel_lib_dir() -> Path | None:
    """The installed wheel's llama_cpp/lib, which holds libllama and the tools (python/wheel.cmake);
    None where llama_cpp came without them."""
    spec = importlib.util.find_spec("llama_cpp")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        lib = Path(folder) / "lib"
        if (lib / "libllama.so").exists():
            return lib
    return None


def bin_dir() -> Path:
    """The folder with libllama, llama-perplexity and friends: KVCOMP_BIN_DIR, else the
    checkout's build/bin (scripts/build.sh), else the installed wheel's llama_cpp/lib."""
    override = os.environ.get("KVCOMP_BIN_DIR")
    if override:
        return Path(override)
    checkout = REPO_ROOT / "build" / "bin"
    if checkout.is_dir():
        return checkout
    return wheel_lib_dir() or checkout


def binary(name: str) -> Path:
    path = bin_dir() / name
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: {NO_BUILD}")
    return path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
