"""Runs the C++ tests (cpp/tests) and requires every check in them to pass."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest


@pytest.mark.parametrize("name", ["test-kvc-quants", "test-kvc-ops"])
def test_cpp(bins: Path, name: str) -> None:
    proc = subprocess.run([str(bins / name)], capture_output=True, text=True, timeout=300)
    m = re.search(r"(\d+) passed, (\d+) failed", proc.stdout)
    assert m, proc.stdout[-2000:] + proc.stderr[-2000:]
    failed = [line for line in proc.stdout.splitlines() if "[FAIL]" in line]
    assert proc.returncode == 0 and int(m.group(2)) == 0, "\n".join(failed)
    assert int(m.group(1)) > 0
