"""Runs cpp/tests/test-kvc-monitor on SmolLM2 and requires every check in it to pass: a token
whose input embedding is NaN, beside a sequence being generated, is kept out of the monitor's
statistics and exports, counted in `nonfinite_total`, and the statistics after it equal those
of the same run without it (the C++ file says why that route and which bounds)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path


def test_monitor_keeps_nonfinite_values_out(bins: Path, model: Path) -> None:
    proc = subprocess.run([str(bins / "test-kvc-monitor"), str(model)], capture_output=True, text=True, timeout=600)
    m = re.search(r"test-kvc-monitor: (\d+) passed, (\d+) failed", proc.stdout)
    assert m, proc.stdout[-2000:] + proc.stderr[-2000:]
    failed = [line for line in proc.stdout.splitlines() if "[FAIL]" in line]
    assert proc.returncode == 0 and int(m.group(2)) == 0, "\n".join(failed)
    assert int(m.group(1)) >= 13  # 1 + 6 checks per configuration, two configurations
