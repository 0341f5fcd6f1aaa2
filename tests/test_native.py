"""Runs the C++ tests (cpp/tests) and requires every check in them to pass. test-kvc-llama gets
SmolLM2, test-kvc-batch SmolLM2 and its K statistics; the differential fuzzer test-kvc-fuzz
gets its F32 copy (on the Q4_1 file any kernel change is a fresh draw of quantization noise,
which would hide what the buffer does) and 120 s; the state-file fuzzer test-kvc-state gets
SmolLM2 and 40 s, and writes its slot files in a temporary folder; test-kvc-plans gets
SmolLM2 and its K statistics (`kvcomp calibrate`)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from ggml_kvcomp import calibrate, models

# test: (model, its arguments after the model's path, whether the model's K statistics follow)
MODELS: dict[str, tuple[str, list[str], bool]] = {
    "test-kvc-llama": ("smollm2-135m", [], False),
    "test-kvc-batch": ("smollm2-135m", [], True),
    "test-kvc-fuzz": ("smollm2-135m-f32", ["120"], False),
    "test-kvc-state": ("smollm2-135m", ["40"], False),
    "test-kvc-plans": ("smollm2-135m", [], True),
}


@pytest.mark.parametrize("name", ["test-kvc-quants", "test-kvc-ops", "test-kvc-transform", "test-kvc-kvct",
                                  "test-kvc-window", "test-kvc-llama", "test-kvc-batch", "test-kvc-fuzz",
                                  "test-kvc-state", "test-kvc-plans"])
def test_cpp(bins: Path, name: str, tmp_path: Path) -> None:
    args = [str(bins / name)]
    if name in MODELS:
        model, extra, kstats = MODELS[name]
        path = models.fetch_model(model)
        args += [str(path), *extra] + ([str(calibrate.ensure_kstats(path))] if kstats else [])
    _check(subprocess.run(args, capture_output=True, text=True, timeout=1200, cwd=tmp_path))


@pytest.mark.parametrize(("test", "isa"), [("kvct", "x86-64"), ("kvct", "avx2"), ("kvct", "avx512"),
                                           ("kvct", "avx512vbmi"), ("quants", "x86-64"), ("quants", "avx2"),
                                           ("quants", "avx512")])
def test_cpu_paths_isa(bins: Path, test: str, isa: str) -> None:
    """kvct's CPU row decoder and coder (test-kvc-kvct-isa.cpp) and the kvc quantizers' search
    (test-kvc-quants-isa.cpp) built at each x86 level, so that the portable and AVX2 paths
    are tested on a machine whose own build takes the AVX-512 ones."""
    exe = bins / f"test-kvc-{test}-isa-{isa}"
    if not exe.exists():
        pytest.skip("built on x86 with GCC or Clang only")
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    if proc.returncode == 77:
        pytest.skip(proc.stdout.strip())
    _check(proc)


def _check(proc: subprocess.CompletedProcess[str]) -> None:
    m = re.search(r"(\d+) passed, (\d+) failed", proc.stdout)
    assert m, proc.stdout[-2000:] + proc.stderr[-2000:]
    failed = [line for line in proc.stdout.splitlines() if "[FAIL]" in line]
    assert proc.returncode == 0 and int(m.group(2)) == 0, "\n".join(failed)
    assert int(m.group(1)) > 0
