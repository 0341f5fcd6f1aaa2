"""Where things live: the repository, the cache folder and the built binaries."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    """The cache for downloads, models, corpora and builds (never inside the clone)."""
    return Path(os.environ.get("KVCOMP_CACHE", Path.home() / ".cache" / "kvcomp"))


def bin_dir() -> Path:
    """The folder with llama-perplexity and friends; KVCOMP_BIN_DIR overrides ./build/bin."""
    override = os.environ.get("KVCOMP_BIN_DIR")
    return Path(override) if override else REPO_ROOT / "build" / "bin"


def binary(name: str) -> Path:
    path = bin_dir() / name
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: build first with scripts/build.sh")
    return path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
