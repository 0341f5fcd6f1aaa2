"""The pinned upstream: fetch the llama-cpp-python sdist, verify it, patch it.

The patched tree is cached outside the clone under $KVCOMP_CACHE (default ~/.cache/kvcomp),
keyed by the pin and the hash of cpp/patches/*.patch, and reused while both are unchanged.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from .paths import REPO_ROOT, cache_dir, sha256_file

PIN_NAME = "llama-cpp-python"
PIN_VERSION = "0.3.36"
PIN_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
SDIST = f"llama_cpp_python-{PIN_VERSION}"

PATCH_DIR = REPO_ROOT / "cpp" / "patches"


def patches() -> list[Path]:
    return sorted(PATCH_DIR.glob("*.patch"))


def tree_key() -> str:
    h = hashlib.sha256(PIN_SHA256.encode())
    for p in patches():
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def fetch_sdist(dl: Path) -> Path:
    tarball = dl / f"{SDIST}.tar.gz"
    if tarball.exists() and sha256_file(tarball) == PIN_SHA256:
        return tarball
    dl.mkdir(parents=True, exist_ok=True)
    tarball.unlink(missing_ok=True)
    # --no-build-isolation: pip only reads the metadata, and an isolated build env would
    # try to build cmake from source under --no-binary :all:.
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
         "--no-build-isolation", f"{PIN_NAME}=={PIN_VERSION}", "-d", str(dl)],
        check=True, stdout=sys.stderr,
    )
    got = sha256_file(tarball)
    if got != PIN_SHA256:
        tarball.unlink()
        sys.exit(f"prepare_upstream: sha256 mismatch for {tarball.name}: got {got}, want {PIN_SHA256}")
    return tarball


def apply_patches(llama_dir: Path, series: list[Path]) -> None:
    """Applies the series in order; stops with the name of the first patch that does not apply."""
    for p in series:
        for extra in (["--dry-run"], []):
            r = subprocess.run(
                ["patch", "-p1", "--batch", "--forward", "--silent", *extra, "-i", str(p)],
                cwd=llama_dir, capture_output=True, text=True,
            )
            if r.returncode != 0:
                sys.exit(f"prepare_upstream: patch {p.name} failed to apply:\n{r.stdout}{r.stderr}")


def prepare() -> Path:
    """Returns the prepared sdist root (it holds vendor/llama.cpp and llama_cpp/)."""
    base = cache_dir()
    final = base / f"upstream-{tree_key()}"
    stamp = final / ".kvcomp-ready"
    if stamp.exists():
        return final / SDIST

    tarball = fetch_sdist(base / "dl")
    tmp = Path(tempfile.mkdtemp(prefix="upstream-", dir=base))
    try:
        with tarfile.open(tarball) as tf:
            tf.extractall(tmp, filter="data")
        llama_dir = tmp / SDIST / "vendor" / "llama.cpp"
        # the sdist keeps a submodule pointer that would make git-aware tools look elsewhere
        (llama_dir / ".git").unlink(missing_ok=True)
        apply_patches(llama_dir, patches())
        (tmp / ".kvcomp-ready").write_text(tree_key() + "\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final / SDIST


def unpatched_rpc_server() -> Path:
    """Upstream's own ggml-rpc-server, built from the pinned sdist without the patch series
    (ggml only, cached): what a host without the kvc types runs, for tests/test_rpc.py."""
    base = cache_dir() / f"upstream-rpc-server-{PIN_VERSION}"
    binary = base / "build" / "bin" / "ggml-rpc-server"
    if binary.exists():
        return binary
    tarball = fetch_sdist(cache_dir() / "dl")
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    with tarfile.open(tarball) as tf:
        tf.extractall(base, filter="data")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    launcher = (["-DCMAKE_C_COMPILER_LAUNCHER=ccache", "-DCMAKE_CXX_COMPILER_LAUNCHER=ccache"]
                if shutil.which("ccache") else [])
    subprocess.run(
        ["cmake", "-S", str(base / SDIST / "vendor" / "llama.cpp"), "-B", str(base / "build"), *generator, *launcher,
         "-DCMAKE_BUILD_TYPE=Release", "-DGGML_RPC=ON", "-DGGML_RPC_RDMA=OFF", "-DLLAMA_BUILD_TESTS=OFF",
         "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF"],
        check=True, stdout=sys.stderr,
    )
    jobs = os.environ.get("KVCOMP_JOBS", "2")
    subprocess.run(["cmake", "--build", str(base / "build"), "--target", "ggml-rpc-server", "--parallel", jobs],
                   check=True, stdout=sys.stderr)
    return binary
