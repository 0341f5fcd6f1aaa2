"""Drives llama-kvcomp-steps: per-step decode latency, split by whether the residual buffer
ran a merge pass in the step (issue 3: no step with a merge may take over 1.5x one without)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .calibrate import kv_args
from .kvtypes import KvConfig
from .paths import binary


@dataclass(frozen=True)
class StepResult:
    label: str
    depth: int
    n_gen: int
    slots: int
    mean_ms: float
    max_ms: float
    n_merge_steps: int
    max_ms_merge: float
    max_ms_no_merge: float


def run_steps(cfg: KvConfig, model: Path, depth: int, n_gen: int, threads: int) -> StepResult:
    args = [str(binary("llama-kvcomp-steps")), "-m", str(model), "-c", str(depth + n_gen + 1), "-n", str(n_gen),
            "-t", str(threads), "-fa", "on", *kv_args(cfg, model)]
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-kvcomp-steps failed for {cfg.label}:\n{proc.stderr[-2000:]}")
    r = json.loads(proc.stdout)
    return StepResult(cfg.label, int(r["depth"]), int(r["n_gen"]), int(r["slots"]), float(r["mean_ms"]),
                      float(r["max_ms"]), int(r["n_merge_steps"]), float(r["max_ms_merge"]),
                      float(r["max_ms_no_merge"]))


def steps_table(results: Sequence[StepResult]) -> str:
    rows = [
        "| K/V | depth | slots | mean ms/step | worst step ms | merge steps | worst with merge | worst without |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        rows.append(f"| {r.label} | {r.depth} | {r.slots} | {r.mean_ms:.2f} | {r.max_ms:.2f} | {r.n_merge_steps} "
                    f"| {r.max_ms_merge:.2f} | {r.max_ms_no_merge:.2f} |")
    return "\n".join(rows)
