"""K statistics for the kvct cache types: `kvcomp calibrate` and the file a kvct run loads.

A kvct K cache fits a plan per layer and KV head (bits and scale per coefficient) from the
model's K statistics, measured once per model by llama-kvcomp-calibrate with an exact cache.
They are measured on the end of the bundled corpus, which the KLD and perplexity runs (from
its start) do not reach, so a run never scores the text its plans were fitted on.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from .corpus import corpus_file
from .kvtypes import KvConfig
from .paths import binary, cache_dir

# The share of the corpus, from its end, that calibration reads.
TAIL_FRACTION = 0.25


def calibration_text() -> Path:
    """The last quarter of the corpus, in the cache."""
    corpus = corpus_file()
    out = cache_dir() / "corpus" / f"{corpus.stem}-tail.txt"
    if not out.exists():
        text = corpus.read_text(encoding="utf-8")
        start = text.find("\n", int(len(text) * (1.0 - TAIL_FRACTION))) + 1
        out.write_text(text[start:], encoding="utf-8")
    return out


# The statistics' version llama-kvcomp-calibrate writes (4: sealed with a checksum and bound
# to the model's token embeddings); a file of an older version is measured again rather than
# reused.
KSTATS_VERSION = 4


def kstats_path(model: Path) -> Path:
    """Where a model's statistics are kept: named by the file, its size and the version."""
    return cache_dir() / "kstats" / f"{model.stem}-{model.stat().st_size}-v{KSTATS_VERSION}.kstats.gguf"


def calibrate(model: Path, out: Path, ctx: int = 512, chunks: int = 24, threads: int = 2,
              text: Path | None = None) -> Path:
    """Runs llama-kvcomp-calibrate and returns the file it wrote."""
    out.parent.mkdir(parents=True, exist_ok=True)
    args = [str(binary("llama-kvcomp-calibrate")), "-m", str(model), "-f", str(text or calibration_text()),
            "-c", str(ctx), "--chunks", str(chunks), "-t", str(threads), "-o", str(out)]
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        raise RuntimeError(f"llama-kvcomp-calibrate failed for {model.name}:\n{tail}")
    return out


def ensure_kstats(model: Path) -> Path:
    """The model's statistics, measured on first use."""
    path = kstats_path(model)
    return path if path.exists() else calibrate(model, path)


def kstats_files(cfg: KvConfig, model: Path) -> tuple[Path | None, Path | None]:
    """The K statistics file and the layer profile cfg loads on model: the corpus file where a
    kvct K cache needs one (':k3' has the library measure its own), the profile for ':k2'."""
    from .layers import ensure_profile  # layers measures with calibration_text, defined here

    return (ensure_kstats(model) if cfg.needs_kstats else None,
            ensure_profile(model) if cfg.kstats == 2 else None)


def kv_args(cfg: KvConfig, model: Path) -> list[str]:
    """The tools' KV flags for cfg on model: its own, the statistics a kvct K cache loads, and
    the model's layer profile for ':k2'."""
    stats, profile = kstats_files(cfg, model)
    args = cfg.tool_args()
    if stats is not None:
        args += ["--kv-comp-kstats", str(stats)]
    if profile is not None:
        args += ["--kv-comp-layers", str(profile)]
    return args
