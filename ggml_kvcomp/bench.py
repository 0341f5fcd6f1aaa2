"""Drives llama-bench for decode speed at several depths, one process per KV configuration."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .kvtypes import KvConfig
from .paths import binary


@dataclass(frozen=True)
class BenchResult:
    label: str
    depth: int
    n_gen: int
    tokens_per_s: float
    stddev: float


def run_bench(cfg: KvConfig, model: Path, depths: Sequence[int], n_gen: int, threads: int,
              reps: int) -> list[BenchResult]:
    args = [
        str(binary("llama-bench")), "-m", str(model), "-fa", "1", "-p", "0", "-n", str(n_gen),
        "-d", ",".join(str(d) for d in depths), "-t", str(threads), "-r", str(reps),
        *cfg.tool_args(), "-o", "json",
    ]
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench failed for {cfg.label}:\n{proc.stderr[-2000:]}")
    return [
        BenchResult(cfg.label, int(r["n_depth"]), int(r["n_gen"]), float(r["avg_ts"]), float(r["stddev_ts"]))
        for r in json.loads(proc.stdout)
    ]


def bench_table(results: Sequence[BenchResult]) -> str:
    depths = sorted({r.depth for r in results})
    labels = list(dict.fromkeys(r.label for r in results))
    by_key = {(r.label, r.depth): r for r in results}
    rows = [
        "| K/V | " + " | ".join(f"tg t/s @ d={d}" for d in depths) + " |",
        "|---|" + "---:|" * len(depths),
    ]
    for label in labels:
        cells = [f"{by_key[(label, d)].tokens_per_s:.1f} ± {by_key[(label, d)].stddev:.1f}" for d in depths]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(rows)
