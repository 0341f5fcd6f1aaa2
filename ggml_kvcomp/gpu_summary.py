"""summary.md and summary.json of a scripts/gpu-check.sh run, from the files it left in its folder.

Also judges the GPU speed targets on the bench rows: decode at the deepest depth with
`balanced` at least 1.2x f16's tokens/s and at least q4_0's, prefill at least 0.9x f16's.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _rc(folder: Path, stage: str) -> int | None:
    text = _read(folder / f"{stage}.rc").strip()
    return int(text) if text else None


def backend_counts(log: str) -> tuple[int, int] | None:
    m = re.search(r"^test-kvc-backend: (\d+) passed, (\d+) failed", log, re.MULTILINE)
    return (int(m.group(1)), int(m.group(2))) if m else None


def speed_targets(bench: list[dict[str, Any]], mode: str = "balanced") -> list[dict[str, Any]]:
    """Each target with the two numbers it compares and whether it holds."""
    def ts(label: str, depth: int, prefill: bool) -> float | None:
        for r in bench:
            if r["label"] == label and r["depth"] == depth and (r.get("n_prompt", 0) > 0) == prefill:
                return float(r["tokens_per_s"])
        return None

    if not bench:
        return []
    deepest = max(r["depth"] for r in bench)
    checks = []
    for name, prefill, ref, factor in (("decode vs f16", False, "f16", 1.2), ("decode vs q4_0", False, "q4_0", 1.0),
                                       ("prefill vs f16", True, "f16", 0.9)):
        got, base = ts(mode, deepest, prefill), ts(ref, deepest, prefill)
        if got is None or base is None:
            continue
        checks.append({"target": f"{mode} {name} at depth {deepest}: >= {factor}x {ref}", "value": got,
                       "reference": base, "ratio": got / base, "holds": got >= factor * base})
    return checks


def summarize(folder: Path) -> dict[str, Any]:
    counts = backend_counts(_read(folder / "backend.log"))
    kld = json.loads(_read(folder / "kld.json") or "[]")
    bench = json.loads(_read(folder / "bench.json") or "[]")
    return {
        "gpu": _read(folder / "gpu.txt").strip(),
        "model": _read(folder / "model.txt").strip(),
        "backend_test": {"exit": _rc(folder, "backend"), "passed": counts[0] if counts else None,
                         "failed": counts[1] if counts else None},
        "kld": {"exit": _rc(folder, "kld"), "rows": kld},
        "bench": {"exit": _rc(folder, "bench"), "rows": bench},
        "targets": speed_targets(bench),
    }


def markdown(folder: Path, s: dict[str, Any]) -> str:
    bt = s["backend_test"]
    failures = [line.strip() for line in _read(folder / "backend.log").splitlines() if "[FAIL]" in line]
    parts = [
        f"## GPU check, {s['model'] or 'unknown model'}",
        f"GPU: {s['gpu'] or 'unknown'}",
        f"### Backend ops vs CPU (test-kvc-backend)\n\nexit {bt['exit']}: {bt['passed']} passed, {bt['failed']} failed"
        + "".join(f"\n- {f}" for f in failures),
        f"### KLD vs f16 KV, all layers on the GPU (exit {s['kld']['exit']})\n\n{_read(folder / 'kld.md').strip()}",
        f"### Speed, all layers on the GPU (exit {s['bench']['exit']})\n\n{_read(folder / 'bench.md').strip()}",
        "### Targets\n\n| target | value t/s | reference t/s | ratio | holds |\n|---|---:|---:|---:|---|\n"
        + "\n".join(f"| {t['target']} | {t['value']:.1f} | {t['reference']:.1f} | {t['ratio']:.2f} | "
                    f"{'yes' if t['holds'] else 'no'} |" for t in s["targets"]),
    ]
    return "\n\n".join(parts) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m ggml_kvcomp.gpu_summary FOLDER", file=sys.stderr)
        return 2
    folder = Path(argv[0])
    s = summarize(folder)
    (folder / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
    md = markdown(folder, s)
    (folder / "summary.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
