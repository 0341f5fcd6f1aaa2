"""The pip-installed package (scripts/wheel-check.sh runs this file in a fresh virtualenv):
ggml_kvcomp, llama_cpp, libllama and the tools come from the install, and a kvc4 cache runs
through plain llama_cpp.Llama with no environment variable. Skipped on the checkout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ggml_kvcomp
from ggml_kvcomp import llm, paths

SITE = Path(ggml_kvcomp.__file__).resolve().parents[1]
TOOLS = ("llama-server", "llama-cli", "llama-perplexity", "llama-bench", "llama-kvcomp-calibrate", "ggml-rpc-server")

# a checkout (or an editable install of one) runs scripts/build.sh's library instead
pytestmark = pytest.mark.skipif((SITE / "CMakeLists.txt").exists(),
                                reason="checks an installed wheel: scripts/wheel-check.sh")


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("KVCOMP_BIN_DIR", "LLAMA_CPP_LIB_PATH", "MTMD_CPP_LIB")}


def test_library_and_tools_come_from_the_install() -> None:
    lib = SITE / "llama_cpp" / "lib"
    assert paths.bin_dir() == lib
    assert all((lib / name).is_file() for name in ("libllama.so", "libggml-base.so", *TOOLS))
    llama_cpp = llm.import_llama_cpp()
    assert Path(llama_cpp.__file__).resolve().parent == SITE / "llama_cpp"


def test_plain_llama_cpp_runs_kvc4(model: Path) -> None:
    # what a user writes: import ggml_kvcomp, then llama_cpp as usual, in a fresh process
    script = (
        "import sys, ggml_kvcomp, llama_cpp\n"
        "from ggml_kvcomp import llm\n"
        "m = llama_cpp.Llama(sys.argv[1], n_ctx=512, n_threads=2, flash_attn=True, verbose=False,\n"
        "                    type_k=llm.type_id('kvc4'), type_v=llm.type_id('kvc4'))\n"
        "out = m('The lighthouse keeper', max_tokens=8, temperature=0.0)\n"
        "cfg = llm.get_config(m)\n"
        "print(cfg.type_k, cfg.type_v, out['usage']['completion_tokens'])\n"
    )
    r = subprocess.run([sys.executable, "-c", script, str(model)], env=_clean_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    type_k, type_v, n = r.stdout.split()
    assert (type_k, type_v) == ("kvc4", "kvc4") and 0 < int(n) <= 8


def test_llama_cpp_alone_loads_the_kvcomp_library() -> None:
    # without ggml_kvcomp, llama_cpp still finds this build's libllama in its lib folder
    script = "import llama_cpp; print(hasattr(llama_cpp.llama_cpp._lib, 'llama_kvcomp_mode_preset'))"
    r = subprocess.run([sys.executable, "-c", script], env=_clean_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr[-2000:]


def test_tools_run_from_path() -> None:
    exe = Path(sys.executable).parent / "llama-server"
    r = subprocess.run([str(exe), "--version"], env=_clean_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "version" in r.stdout + r.stderr, r.stderr[-2000:]
