"""Drives llama-perplexity: one f16-KV base run that stores logits, then KLD runs against it."""

from __future__ import annotations

import hashlib
import math
import re
import subprocess
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .calibrate import kv_args
from .kvtypes import BITS_PER_ELEMENT, KvConfig
from .paths import binary, cache_dir, sha256_file


@dataclass(frozen=True)
class RunSettings:
    """What every run of one comparison shares: same model, text, context and threads."""

    model: Path
    corpus: Path
    ctx: int = 512
    chunks: int = 16
    threads: int = 2
    batch: int = 512
    flash_attn: bool = True  # the base run always uses it; off measures the MUL_MAT path of K
    n_gpu_layers: int = 0  # layers offloaded to a GPU (-ngl), 0 for a CPU-only run
    ctx_full: int = 0  # the model's full context, for KV memory there (0: the run's ctx)
    ubatch: int = 0  # tokens per ubatch (-ub; 0: the tool's default); 1 decodes one token at a time


@dataclass(frozen=True)
class KldResult:
    label: str
    type_k: str
    type_v: str
    bpe_k: float
    bpe_v: float
    bpe_buffer: float  # F16 slots of the residual buffer, amortized over the context
    ppl: float
    ppl_base: float
    ppl_ratio: float
    kld_mean: float
    kld_mean_err: float
    kld_p99: float
    same_top_p: float
    # K round-trip RMSE the scale tracker measured: as stored (offset and channel scales), with
    # the offset alone, and as the rows came (0: no tracker)
    k_rmse: float = 0.0
    k_rmse_offset: float = 0.0
    k_rmse_plain: float = 0.0
    # the KV cache's memory at the model's full context: main caches scaled to it, the
    # residual buffer as it is (its slots do not grow with the context)
    kv_mib_full: float = 0.0
    # the residual buffer's bits per element at the model's full context (its slots spread over
    # all the cells there)
    bpe_buffer_full: float = 0.0
    # the mean KLD with one decode per token (teacher-forced, as generation computes every
    # token; None: not run)
    kld_mean_by_token: float | None = None

    @property
    def bpe(self) -> float:
        return (self.bpe_k + self.bpe_v) / 2 + self.bpe_buffer

    @property
    def bpe_full(self) -> float:
        """Bits per element at the model's full context, the buffer counted."""
        return (self.bpe_k + self.bpe_v) / 2 + self.bpe_buffer_full

    def as_dict(self) -> dict[str, float | str]:
        d: dict[str, float | str] = asdict(self)
        d["bpe"] = self.bpe
        d["bpe_full"] = self.bpe_full
        return d


def _common_args(s: RunSettings) -> list[str]:
    return [
        "-m", str(s.model), "-f", str(s.corpus), "-c", str(s.ctx), "-b", str(s.batch),
        "--chunks", str(s.chunks), "-t", str(s.threads), "--no-warmup", "-ngl", str(s.n_gpu_layers),
        "-lv", "4",  # this level carries the KV size line and the model's dimensions
    ] + (["-ub", str(s.ubatch)] if s.ubatch else [])


def _run(args: list[str]) -> str:
    proc = subprocess.run(args, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        tail = "\n".join(out.splitlines()[-25:])
        raise RuntimeError(f"{Path(args[0]).name} failed with exit code {proc.returncode}:\n{tail}")
    return out


def base_logits(s: RunSettings) -> Path:
    """The f16-KV base logits for these settings, computed once and cached. Always batched: an
    f16 cache gives a token the same logits however its ubatches are cut."""
    s = replace(s, ubatch=0)
    key = hashlib.sha256(
        f"{s.model.stat().st_size}:{s.model.name}:{s.corpus.name}:{s.ctx}:{s.chunks}:{s.batch}:{s.n_gpu_layers}"
        .encode()
    ).hexdigest()[:16]
    out = cache_dir() / "kld-base" / f"base-{key}.bin"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".part")
        _run([str(binary("llama-perplexity")), *_common_args(s), "-fa", "on", "-ctk", "f16", "-ctv", "f16",
              "--kl-divergence-base", str(tmp)])
        tmp.rename(out)
    return out


def _number(pattern: str, text: str) -> float:
    m = re.search(pattern, text, re.MULTILINE)
    if not m:
        raise ValueError(f"llama-perplexity output lacks {pattern!r}")
    return float(m.group(1))


def parse_kv_bpe(log: str) -> tuple[float, float]:
    """Bits per element of K and V from the KV size line and the model's dimensions.

    The line rounds to 0.01 MiB, so this is a cross-check of BITS_PER_ELEMENT, not a source.
    """
    m = re.search(r"llama_kv_cache: size = .*?\(\s*(\d+) cells,\s*(\d+) layers.*?"
                  r"K \(\S+\):\s*([\d.]+) MiB, V \(\S+\):\s*([\d.]+) MiB", log)
    if not m:
        raise ValueError("llama-perplexity output lacks the llama_kv_cache size line")
    cells, layers = int(m.group(1)), int(m.group(2))
    n_k = _number(r"n_embd_k_gqa\s*=\s*(\d+)", log)
    n_v = _number(r"n_embd_v_gqa\s*=\s*(\d+)", log)
    mib = 1024.0 * 1024.0 * 8.0
    return (float(m.group(3)) * mib / (cells * layers * n_k), float(m.group(4)) * mib / (cells * layers * n_v))


def parse_bpe(log: str, type_k: str, type_v: str) -> tuple[float, float]:
    """Bits per element of K and V: the means over the layers named in the 'kvcomp: K plans of
    N layers (K types; V types)' lines of a kvct K cache (one per cache; per-layer types give
    some layers others), else type_k's and type_v's."""
    k: list[str] = []
    v: list[str] = []
    for kt, vt in re.findall(r"kvcomp: K plans of \d+ layers \(([^;)]*)(?:; V ([^)]*))?\)", log):
        k += kt.split(",")
        v += vt.split(",") if vt else []

    def mean(types: list[str], default: str) -> float:
        return sum(BITS_PER_ELEMENT[t] for t in types) / len(types) if types else BITS_PER_ELEMENT[default]

    return mean(k, type_k), mean(v, type_v)


def without_measuring(log: str) -> str:
    """The log without the library's own K-statistics run (a first use of a model with kvct K
    and no file), whose context logs a KV cache of its own."""
    return re.sub(r"kvcomp: measuring the model's K statistics.*?kvcomp: K statistics:", "kvcomp: K statistics:", log,
                  flags=re.S)


def kv_memory_mib(log: str) -> tuple[float, float]:
    """(main cache MiB, residual buffer MiB) of the configuration the run ended with, zeros
    without a 'kvcomp: KV memory' line.

    Each configuration of a cache prints the line again (a kvct K cache prints it once
    without the buffer, when its statistics arrive, and once with it), so only the last line
    of each cache counts: the last as many lines as there are caches ('llama_kv_cache: size'
    lines; two for a sliding-window model).
    """
    log = without_measuring(log)
    lines = re.findall(r"kvcomp: KV memory: main cache ([\d.]+) MiB .*?residual buffer ([\d.]+) MiB", log)
    n_caches = len(re.findall(r"llama_kv_cache: size =", log))
    last = lines[-n_caches:] if n_caches else lines
    return sum(float(m) for m, _ in last), sum(float(b) for _, b in last)


def buffer_bpe(main_mib: float, buffer_mib: float, main_bpe: float) -> float:
    """Bits per cached element that the residual buffer adds to a main cache of main_mib:
    buffer MiB over main MiB, times the main cache's bits per element."""
    return buffer_mib / main_mib * main_bpe if main_mib > 0 else 0.0


def parse_buffer_bpe(log: str, main_bpe: float) -> float:
    """The buffer's bits per element at the measured context."""
    return buffer_bpe(*kv_memory_mib(log), main_bpe)


def _pad(n: int, to: int = 256) -> int:
    return (n + to - 1) // to * to


def parse_kv_mib_full(log: str, ctx_full: int) -> float:
    """KV MiB at a context of ctx_full tokens, from one run's log: each cache's MiB per cell
    times its cells there (a sliding-window cache holds min(ctx, n_swa + n_ubatch) cells, as
    llama_kv_cache_iswa sizes it, both padded to 256), plus the residual buffer's MiB."""
    log = without_measuring(log)
    swa_m = re.search(r"n_swa\s*=\s*(\d+)", log)
    ubatch_m = re.search(r"n_ubatch\s*=\s*(\d+)", log)
    n_swa = int(swa_m.group(1)) if swa_m else 0
    n_ubatch = int(ubatch_m.group(1)) if ubatch_m else 512
    total, swa = 0.0, False
    found = False
    for line in log.splitlines():
        if "creating non-SWA KV cache" in line or "creating     SWA KV cache" in line:
            swa = "non-SWA" not in line
        m = re.search(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells", line)
        if m:
            found = True
            cells = _pad(min(ctx_full, n_swa + n_ubatch)) if swa else _pad(ctx_full)
            total += float(m.group(1)) / int(m.group(2)) * cells
            swa = False
    if not found:
        raise ValueError("llama-perplexity output lacks the llama_kv_cache size line")
    return total + kv_memory_mib(log)[1]


def parse_tracker_rmse(log: str) -> tuple[float, float, float]:
    """(as stored, offset only, plain) K RMSE over every 'kvcomp: tracker:' line (one per
    cache), weighted by the rows each measured; zeros without a tracker."""
    lines = re.findall(r"kvcomp: tracker: K rows measured = (\d+), RMSE = ([\d.]+), "
                       r"RMSE offset only = ([\d.]+), RMSE plain = ([\d.]+)", log)
    n = sum(int(line[0]) for line in lines)
    if n == 0:
        return 0.0, 0.0, 0.0

    def pooled(col: int) -> float:
        mse: float = sum(int(line[0]) * float(line[col]) ** 2 for line in lines) / n
        return math.sqrt(mse)

    return pooled(1), pooled(2), pooled(3)


def parse_kld(label: str, cfg: KvConfig, log: str, ctx_full: int) -> KldResult:
    kld = re.search(r"^Mean\s+KLD:\s*([\d.eE+-]+)\s*±\s*([\d.eE+-]+)", log, re.MULTILINE)
    if not kld:
        raise ValueError("llama-perplexity output lacks 'Mean KLD'")
    rmse = parse_tracker_rmse(log)
    bpe_k, bpe_v = parse_bpe(log, cfg.type_k, cfg.type_v)
    mib_full, buffer_mib = parse_kv_mib_full(log, ctx_full), kv_memory_mib(log)[1]
    return KldResult(
        label=label,
        type_k=cfg.type_k,
        type_v=cfg.type_v,
        bpe_k=bpe_k,
        bpe_v=bpe_v,
        bpe_buffer=parse_buffer_bpe(log, (bpe_k + bpe_v) / 2),
        ppl=_number(r"^Mean PPL\(Q\)\s*:\s*([\d.]+)", log),
        ppl_base=_number(r"^Mean PPL\(base\)\s*:\s*([\d.]+)", log),
        ppl_ratio=_number(r"^Mean PPL\(Q\)/PPL\(base\)\s*:\s*([\d.]+)", log),
        kld_mean=float(kld.group(1)),
        kld_mean_err=float(kld.group(2)),
        kld_p99=_number(r"^99\.0%\s+KLD:\s*([\d.eE+-]+)", log),
        same_top_p=_number(r"^Same top p:\s*([\d.]+)", log),
        k_rmse=rmse[0],
        k_rmse_offset=rmse[1],
        k_rmse_plain=rmse[2],
        kv_mib_full=mib_full,
        bpe_buffer_full=buffer_bpe(mib_full - buffer_mib, buffer_mib, (bpe_k + bpe_v) / 2),
    )


def run_kld(cfg: KvConfig, s: RunSettings, by_token: bool = False) -> KldResult:
    """KLD of cfg against the f16 base; with by_token, also with one decode per token (the
    tokens scored are the same, so a cache whose logits do not depend on the ubatch gives the
    same number both ways)."""
    def run(settings: RunSettings) -> str:
        fa = "on" if settings.flash_attn else "off"
        return _run([str(binary("llama-perplexity")), *_common_args(settings), "-fa", fa, *kv_args(cfg, settings.model),
                     "--kl-divergence-base", str(base_logits(settings)), "--kl-divergence"])

    out = parse_kld(cfg.label, cfg, run(s), s.ctx_full or s.ctx)
    if by_token:
        tf = parse_kld(cfg.label, cfg, run(replace(s, ubatch=1)), s.ctx_full or s.ctx)
        out = replace(out, kld_mean_by_token=tf.kld_mean)
    return out


def run_profile(s: RunSettings) -> dict[str, object]:
    """A calibration profile for the server's degrade policy (--kv-comp-baseline FILE): the
    model's perplexity on the corpus with an f16 KV cache."""
    log = _run([str(binary("llama-perplexity")), *_common_args(s), "-fa", "on", "-ctk", "f16", "-ctv", "f16"])
    return {
        "model": s.model.name,
        "model_sha256": sha256_file(s.model),
        "corpus": s.corpus.name,
        "ctx": s.ctx,
        "chunks": s.chunks,
        "kv": "f16",
        "ppl": _number(r"Final estimate: PPL = ([\d.]+)", log),
    }
