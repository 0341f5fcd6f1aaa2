"""The release gate: KLD and PPL ratio per model and configuration against committed limits.

A baseline file (regress/baseline.json) holds runs, one per model and context:

    {"runs": [{"model": "smollm2-135m", "ctx": 512, "chunks": 4,
               "configs": {"kvc4": {"kld": 0.039, "ppl_ratio": 1.02, "kld_max": 0.043, "ppl_ratio_max": 1.03}}}]}

`kld` and `ppl_ratio` are what the baseline run measured; the `_max` values are the limits a
new run must stay within. `write_baseline` sets them from a run: the KLD and the PPL ratio's
excess over 1 may grow by a relative tolerance, plus a small absolute floor (values near 0
are noise between builds).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import corpus, models, perplexity
from .kvtypes import KvConfig

DEFAULT_TOLERANCE = 0.10
KLD_FLOOR = 2e-4
PPL_RATIO_FLOOR = 2e-3


@dataclass(frozen=True)
class Check:
    model: str
    ctx: int
    config: str
    metric: str
    value: float
    limit: float

    @property
    def ok(self) -> bool:
        return self.value <= self.limit


def load(path: Path) -> list[dict[str, Any]]:
    data = json.loads(path.read_text())
    runs = data.get("runs") if isinstance(data, dict) else None
    if not isinstance(runs, list) or not runs:
        raise ValueError(f"{path}: a baseline holds a non-empty 'runs' list")
    for run in runs:
        for key in ("model", "ctx", "chunks", "configs"):
            if key not in run:
                raise ValueError(f"{path}: a run lacks {key!r}")
        if run["model"] not in models.MODELS:
            raise ValueError(f"{path}: unknown model {run['model']!r}")
        for label, lim in run["configs"].items():
            KvConfig.parse(label)
            if not {"kld_max", "ppl_ratio_max"} <= set(lim):
                raise ValueError(f"{path}: {run['model']} {label} lacks kld_max or ppl_ratio_max")
    return list(runs)


Measure = Callable[[str, int, int, Sequence[str], int], dict[str, perplexity.KldResult]]


def measure(model: str, ctx: int, chunks: int, labels: Sequence[str], threads: int) -> dict[str, perplexity.KldResult]:
    settings = perplexity.RunSettings(model=models.fetch_model(model), corpus=corpus.corpus_file(), ctx=ctx,
                                      chunks=chunks, threads=threads)
    return {label: perplexity.run_kld(KvConfig.parse(label), settings) for label in labels}


def check(runs: list[dict[str, Any]], threads: int, run: Measure = measure) -> list[Check]:
    out: list[Check] = []
    for r in runs:
        results = run(r["model"], int(r["ctx"]), int(r["chunks"]), list(r["configs"]), threads)
        for label, lim in r["configs"].items():
            res = results[label]
            out.append(Check(r["model"], int(r["ctx"]), label, "KLD", res.kld_mean, float(lim["kld_max"])))
            out.append(Check(r["model"], int(r["ctx"]), label, "PPL ratio", res.ppl_ratio, float(lim["ppl_ratio_max"])))
    return out


def table(checks: Sequence[Check]) -> str:
    rows = ["| model | ctx | config | metric | value | limit | |", "|---|---:|---|---|---:|---:|---|"]
    for c in checks:
        rows.append(f"| {c.model} | {c.ctx} | {c.config} | {c.metric} | {c.value:.6f} | {c.limit:.6f} | "
                    f"{'ok' if c.ok else '**REGRESSED**'} |")
    return "\n".join(rows)


def write_baseline(path: Path, model: str, ctx: int, chunks: int, results: dict[str, perplexity.KldResult],
                   tolerance: float = DEFAULT_TOLERANCE) -> None:
    """Adds (or replaces) the run of this model and context in the baseline file."""
    configs = {
        label: {
            "kld": round(r.kld_mean, 6),
            "ppl_ratio": round(r.ppl_ratio, 6),
            "kld_max": round(max(r.kld_mean, 0.0) * (1 + tolerance) + KLD_FLOOR, 6),
            "ppl_ratio_max": round(1 + max(r.ppl_ratio - 1, 0.0) * (1 + tolerance) + PPL_RATIO_FLOOR, 6),
        }
        for label, r in results.items()
    }
    runs = load(path) if path.exists() else []
    runs = [r for r in runs if not (r["model"] == model and int(r["ctx"]) == ctx)]
    runs.append({"model": model, "ctx": ctx, "chunks": chunks, "configs": configs})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"runs": runs}, indent=2) + "\n")
