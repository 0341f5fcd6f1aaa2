"""The GPU check's summary: the backend test's counts and the speed targets, on made-up runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ggml_kvcomp import gpu_summary


def _row(label: str, depth: int, ts: float, n_prompt: int = 0) -> dict[str, Any]:
    return {"label": label, "depth": depth, "n_gen": 0 if n_prompt else 64, "tokens_per_s": ts, "n_prompt": n_prompt}


@pytest.mark.parametrize(("balanced", "f16", "q4_0", "holds"), [
    (120.0, 100.0, 110.0, [True, True]),
    (119.0, 100.0, 110.0, [False, True]),
    (130.0, 100.0, 131.0, [True, False]),
])
def test_decode_targets(balanced: float, f16: float, q4_0: float, holds: list[bool]) -> None:
    rows = [_row("f16", 0, 1.0), _row("f16", 16384, f16), _row("q4_0", 16384, q4_0), _row("balanced", 16384, balanced)]
    checks = gpu_summary.speed_targets(rows)
    assert [c["holds"] for c in checks] == holds
    assert checks[0]["ratio"] == pytest.approx(balanced / f16)


def test_prefill_target_uses_prefill_rows() -> None:
    rows = [_row("f16", 4096, 50.0), _row("balanced", 4096, 70.0),
            _row("f16", 4096, 1000.0, 512), _row("balanced", 4096, 850.0, 512)]
    prefill = [c for c in gpu_summary.speed_targets(rows) if "prefill" in c["target"]]
    assert len(prefill) == 1
    assert prefill[0]["ratio"] == pytest.approx(0.85)
    assert not prefill[0]["holds"]


def test_summary_files(tmp_path: Path) -> None:
    log = "  [ok] x\n  [FAIL] FLASH_ATTN_EXT K=kvc2\ntest-kvc-backend: 170 passed, 1 failed\n"
    (tmp_path / "backend.log").write_text(log)
    (tmp_path / "backend.rc").write_text("1\n")
    (tmp_path / "bench.json").write_text(json.dumps([_row("f16", 16384, 100.0), _row("balanced", 16384, 90.0)]))
    (tmp_path / "bench.rc").write_text("0\n")
    assert gpu_summary.main([str(tmp_path)]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["backend_test"] == {"exit": 1, "passed": 170, "failed": 1}
    assert s["kld"]["exit"] is None and s["kld"]["rows"] == []
    assert s["targets"][0]["holds"] is False
    md = (tmp_path / "summary.md").read_text()
    assert "[FAIL] FLASH_ATTN_EXT K=kvc2" in md
