"""Runs the C++ tests (cpp/tests) and requires every check in them to pass; test-kvc-llama gets SmolLM2."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest


@pytest.mark.parametrize("name", ["test-kvc-quants", "test-kvc-ops", "test-kvc-llama"])
def test_cpp(bins: Path, model: Path, name: str) -> None:
    args = [str(bins / name)] + ([str(model)] if name == "test-kvc-llama" else [])
    proc = subprocess.run(args, capture_output=True, text=True, timeout=1200)
    m = re.search(r"(\d+) passed, (\d+) failed", proc.stdout)
    assert m, proc.stdout[-2000:] + proc.stderr[-2000:]
    failed = [line for line in proc.stdout.splitlines() if "[FAIL]" in line]
    assert proc.returncode == 0 and int(m.group(2)) == 0, "\n".join(failed)
    assert int(m.group(1)) > 0
