"""Where the package finds libllama and the tools (paths.bin_dir): KVCOMP_BIN_DIR, else the
checkout's build/bin, else the installed wheel's llama_cpp/lib; and importing ggml_kvcomp
points llama_cpp there."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from importlib.machinery import ModuleSpec
from pathlib import Path

import pytest

from ggml_kvcomp import paths


@pytest.fixture
def layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A checkout without a build and a site folder whose llama_cpp holds a library."""
    monkeypatch.delenv("KVCOMP_BIN_DIR", raising=False)
    monkeypatch.setattr(paths, "REPO_ROOT", tmp_path / "checkout")
    lib = tmp_path / "site" / "llama_cpp" / "lib"
    lib.mkdir(parents=True)
    (lib / "libllama.so").write_bytes(b"")
    # the installed llama_cpp as import finds it (an editable install's finder would claim the
    # name before sys.path is searched)
    spec = ModuleSpec("llama_cpp", None, is_package=True)
    spec.submodule_search_locations = [str(lib.parent)]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: spec if name == "llama_cpp" else real(name, *a))
    return tmp_path


def test_wheel_lib_dir_when_there_is_no_build(layout: Path) -> None:
    assert paths.bin_dir() == layout / "site" / "llama_cpp" / "lib"


def test_checkout_build_wins_over_the_wheel(layout: Path) -> None:
    build = layout / "checkout" / "build" / "bin"
    build.mkdir(parents=True)
    assert paths.bin_dir() == build


def test_override_wins_over_both(layout: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (layout / "checkout" / "build" / "bin").mkdir(parents=True)
    monkeypatch.setenv("KVCOMP_BIN_DIR", str(layout / "elsewhere"))
    assert paths.bin_dir() == layout / "elsewhere"


def test_no_library_anywhere_names_the_build(layout: Path) -> None:
    (layout / "site" / "llama_cpp" / "lib" / "libllama.so").unlink()
    assert paths.bin_dir() == layout / "checkout" / "build" / "bin"
    with pytest.raises(FileNotFoundError, match=r"scripts/build\.sh"):
        paths.binary("llama-server")


def test_import_points_llama_cpp_at_the_library(tmp_path: Path) -> None:
    env = {**os.environ, "KVCOMP_BIN_DIR": str(tmp_path)}
    script = "import os, ggml_kvcomp; print(os.environ['LLAMA_CPP_LIB_PATH'], os.environ['MTMD_CPP_LIB'])"
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True,
                       cwd=paths.REPO_ROOT)
    assert r.stdout.split() == [str(tmp_path)] * 2
