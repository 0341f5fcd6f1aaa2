"""Drives llama-bench for decode speed at several depths, one process per KV configuration."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .kvtypes import BITS_PER_ELEMENT, KvConfig
from .paths import binary


@dataclass(frozen=True)
class Memory:
    """Where a llama-bench process's memory went, from its log (MiB) and the kernel (peak RSS).
    The KV and compute figures are those of the context for the deepest depth."""

    weights_mib: float
    kv_main_mib: float
    kv_buffer_mib: float
    compute_mib: float
    peak_rss_mib: float


@dataclass(frozen=True)
class BenchResult:
    label: str
    depth: int
    n_gen: int
    tokens_per_s: float
    stddev: float
    bpe: float  # bits per KV element: main cache + residual buffer at the deepest depth's context
    weights_mib: float
    kv_main_mib: float
    kv_buffer_mib: float
    compute_mib: float
    peak_rss_mib: float
    n_prompt: int = 0  # a prefill row (pp) when > 0, else a decode row (tg, n_gen tokens)


def _sum(pattern: str, text: str) -> float:
    return sum(float(m) for m in re.findall(pattern, text))


def parse_memory(log: str, peak_rss_mib: float) -> Memory:
    """llama-bench -v creates one context per depth; the last one logged is the deepest."""
    weights = _sum(r"load_tensors:\s+\S+ model buffer size =\s+([\d.]+) MiB", log)
    last = log.rsplit("llama_context: n_ctx ", 1)[-1]
    return Memory(
        weights_mib=weights,
        kv_main_mib=_sum(r"llama_kv_cache: size =\s+([\d.]+) MiB", last),
        kv_buffer_mib=_sum(r"kvcomp: KV memory: .*?residual buffer ([\d.]+) MiB", last),
        compute_mib=_sum(r"sched_reserve:\s+\S+ compute buffer size =\s+([\d.]+) MiB", last),
        peak_rss_mib=peak_rss_mib,
    )


def run_bench(cfg: KvConfig, model: Path, depths: Sequence[int], n_gen: int, threads: int,
              reps: int, n_prompt: int = 0, n_gpu_layers: int = 0) -> list[BenchResult]:
    """Decode (tg, n_gen tokens) and, with n_prompt > 0, prefill (pp) speed after each depth;
    n_gpu_layers > 0 offloads that many layers (llama-bench -ngl)."""
    args = [
        str(binary("llama-bench")), "-m", str(model), "-fa", "1", "-p", str(n_prompt), "-n", str(n_gen),
        "-d", ",".join(str(d) for d in sorted(depths)), "-t", str(threads), "-r", str(reps),
        "-ngl", str(n_gpu_layers), *cfg.tool_args(), "-o", "json", "-v",
    ]
    with tempfile.TemporaryFile("w+") as fout, tempfile.TemporaryFile("w+") as ferr:
        proc = subprocess.Popen(args, stdout=fout, stderr=ferr, text=True)
        # reaped here rather than by Popen, for this child's own peak RSS (KiB on Linux)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        fout.seek(0)
        ferr.seek(0)
        out, err = fout.read(), ferr.read()
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed for {cfg.label}:\n{err[-2000:]}")
    rss = usage.ru_maxrss / 1024.0
    mem = parse_memory(err, rss)
    main_bpe = (BITS_PER_ELEMENT[cfg.type_k] + BITS_PER_ELEMENT[cfg.type_v]) / 2
    bpe = main_bpe * (1 + mem.kv_buffer_mib / mem.kv_main_mib) if mem.kv_main_mib > 0 else main_bpe
    return [
        BenchResult(cfg.label, int(r["n_depth"]), int(r["n_gen"]), float(r["avg_ts"]), float(r["stddev_ts"]),
                    bpe, mem.weights_mib, mem.kv_main_mib, mem.kv_buffer_mib, mem.compute_mib, mem.peak_rss_mib,
                    int(r["n_prompt"]) if int(r["n_gen"]) == 0 else 0)
        for r in json.loads(out)
    ]


def bench_table(results: Sequence[BenchResult]) -> str:
    depths = sorted({r.depth for r in results})
    labels = list(dict.fromkeys(r.label for r in results))
    by_key = {(r.label, r.depth, r.n_prompt > 0): r for r in results}
    kinds = [(False, "tg")] + ([(True, "pp")] if any(r.n_prompt > 0 for r in results) else [])
    cols = [(pp, name, d) for pp, name in kinds for d in depths]
    rows = [
        "| K/V | " + " | ".join(f"{name} t/s @ d={d}" for _, name, d in cols)
        + f" | bpe | weights MiB | KV main MiB | KV buffer MiB | compute MiB | peak RSS MiB (d={depths[-1]}) |",
        "|---|" + "---:|" * (len(cols) + 6),
    ]
    for label in labels:
        cells = [f"{by_key[(label, d, pp)].tokens_per_s:.1f} ± {by_key[(label, d, pp)].stddev:.1f}"
                 for pp, _, d in cols]
        m = by_key[(label, depths[-1], False)]
        cells += [f"{m.bpe:.2f}", f"{m.weights_mib:.1f}", f"{m.kv_main_mib:.2f}", f"{m.kv_buffer_mib:.2f}",
                  f"{m.compute_mib:.1f}", f"{m.peak_rss_mib:.0f}"]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
