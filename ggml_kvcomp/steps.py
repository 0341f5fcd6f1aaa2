"""Drives llama-kvcomp-steps: per-step decode latency, split by whether the residual buffer
ran a merge pass in the step (the target: no step with a merge takes over 1.5x one without),
and, with ops, the time of each kind of graph node inside the steps (a kernel inside a model,
its rows read cold)."""

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
class OpTime:
    op: str
    us_per_step: float
    us_per_node: float
    nodes_per_step: float


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
    ops: tuple[OpTime, ...] = ()
    # steps that reused the previous step's graph (building one costs more than a small step)
    n_reused: int = 0

    def op(self, name: str) -> OpTime | None:
        return next((o for o in self.ops if o.op == name), None)


def run_steps(cfg: KvConfig, model: Path, depth: int, n_gen: int, threads: int, ops: bool = False) -> StepResult:
    args = [str(binary("llama-kvcomp-steps")), "-m", str(model), "-c", str(depth + n_gen + 1), "-n", str(n_gen),
            "-t", str(threads), "-fa", "on", *kv_args(cfg, model), *(["--ops"] if ops else [])]
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-kvcomp-steps failed for {cfg.label}:\n{proc.stderr[-2000:]}")
    r = json.loads(proc.stdout)
    return StepResult(cfg.label, int(r["depth"]), int(r["n_gen"]), int(r["slots"]), float(r["mean_ms"]),
                      float(r["max_ms"]), int(r["n_merge_steps"]), float(r["max_ms_merge"]),
                      float(r["max_ms_no_merge"]),
                      tuple(OpTime(name, float(t["us_per_step"]), float(t["us_per_node"]), float(t["nodes_per_step"]))
                            for name, t in r.get("ops", {}).items()),
                      int(r["n_reused"]))


ATTENTION_OP = "FLASH_ATTN_EXT"


def steps_table(results: Sequence[StepResult]) -> str:
    timed = any(r.ops for r in results)
    head = "| K/V | depth | slots | mean ms/step | worst step ms | merge steps | worst with merge | worst without |"
    rows = [
        head + (" attention µs/node | attention ms/step |" if timed else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if timed else ""),
    ]
    for r in results:
        row = (f"| {r.label} | {r.depth} | {r.slots} | {r.mean_ms:.2f} | {r.max_ms:.2f} | {r.n_merge_steps} "
               f"| {r.max_ms_merge:.2f} | {r.max_ms_no_merge:.2f} |")
        if timed:
            a = r.op(ATTENTION_OP)
            row += f" {a.us_per_node:.1f} | {a.us_per_step / 1000:.2f} |" if a else " - | - |"
        rows.append(row)
    return "\n".join(rows)
