"""Head sizes at model level: 64/128/256 run with every kvc type, 80 is refused cleanly.

Tiny random llama models (tests/tiny_model.py) stand in for architectures we have no
packaged model of; Gemma-3-270M (one KV head of 256, sliding-window attention) is the
real-model check of head size 256.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ggml_kvcomp import models, perplexity
from ggml_kvcomp.kvtypes import KvConfig

from .tiny_model import write_tiny_llama


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory, model: Path) -> dict[int, Path]:
    d = tmp_path_factory.mktemp("tiny")
    return {hd: write_tiny_llama(d / f"tiny-hd{hd}.gguf", model, hd) for hd in (64, 80, 128, 256)}


def _ppl(bins: Path, model: Path, text: Path, *extra: str) -> tuple[int, str, float]:
    proc = subprocess.run(
        [str(bins / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", "256", "-b", "256",
         "--chunks", "2", "-t", "2", "--no-warmup", *extra],
        capture_output=True, text=True, timeout=600,
    )
    out = proc.stdout + proc.stderr
    ppl = float(out.split("Final estimate: PPL = ")[1].split()[0]) if "Final estimate" in out else float("nan")
    return proc.returncode, out, ppl


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("kv", ["kvc8", "kvc5", "kvc4", "kvc3", "kvc2"])
def test_supported_head_sizes(bins: Path, text: Path, tiny_models: dict[int, Path], head_dim: int, kv: str) -> None:
    m = tiny_models[head_dim]
    rc, out, ref = _ppl(bins, m, text, "-fa", "on")
    assert rc == 0, out[-2000:]
    rc, out, got = _ppl(bins, m, text, "-fa", "on", "-ctk", kv, "-ctv", kv)
    assert rc == 0, out[-2000:]
    # a random model's PPL barely depends on attention details; a broken cache shows as NaN or a jump
    assert got == pytest.approx(ref, rel=0.05)
    rc, out, got_k = _ppl(bins, m, text, "-fa", "off", "-ctk", kv)
    assert rc == 0, out[-2000:]
    assert got_k == pytest.approx(ref, rel=0.05)


@pytest.mark.parametrize("fa", ["on", "off"])
def test_head_size_80_is_refused(bins: Path, text: Path, tiny_models: dict[int, Path], fa: str) -> None:
    rc, out, _ = _ppl(bins, tiny_models[80], text, "-fa", fa, "-ctk", "kvc4")
    assert rc != 0
    assert "K cache type kvc4 with block size 32 does not divide n_embd_head_k=80" in out
    rc, out, _ = _ppl(bins, tiny_models[80], text, "-fa", fa)
    assert rc == 0, out[-2000:]  # the same model runs with the default f16 cache


def test_gemma3_head_256(text: Path) -> None:
    settings = perplexity.RunSettings(model=models.fetch_model("gemma3-270m"), corpus=text, ctx=256, chunks=3)
    kld = {c: perplexity.run_kld(KvConfig.parse(c), settings).kld_mean for c in ("q8_0", "kvc8", "q4_0", "kvc4")}
    # same-size upstream types on the same run are the reference; kvc8 >= q8_0's accuracy per block
    # leaves only run noise, kvc4's lead over q4_0 is large
    assert kld["kvc8"] <= 1.25 * kld["q8_0"]
    assert kld["kvc4"] < kld["q4_0"]
    assert kld["kvc8"] < kld["kvc4"]
