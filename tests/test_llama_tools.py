"""The upstream tools with the kvc types on the real SmolLM2 model.

Each test compares against upstream types in the same process or run: KLD ordering against
an f16 base, the KV size line against the formats' sizes, and the refusals upstream gives
for unsupported combinations.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from ggml_kvcomp import perplexity
from ggml_kvcomp.kvtypes import BITS_PER_ELEMENT, KVC_TYPES, KvConfig


def _ppl_args(bins: Path, model: Path, text: Path, *extra: str) -> list[str]:
    return [str(bins / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", "512", "-b", "512",
            "--chunks", "1", "-t", "2", "--no-warmup", "-lv", "4", *extra]


@pytest.mark.parametrize("kv", KVC_TYPES)
def test_kv_size_line_matches_format(bins: Path, model: Path, text: Path, kv: str) -> None:
    proc = subprocess.run(_ppl_args(bins, model, text, "-fa", "on", "-ctk", kv, "-ctv", kv),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = proc.stdout + proc.stderr
    bpe_k, bpe_v = perplexity.parse_kv_bpe(log)
    assert bpe_k == pytest.approx(BITS_PER_ELEMENT[kv], abs=0.02)
    assert bpe_v == pytest.approx(BITS_PER_ELEMENT[kv], abs=0.02)
    assert "attn_rot_k = 1" in log and "attn_rot_v = 1" in log
    assert "Final estimate: PPL" in log


def test_kld_ordering(bins: Path, model: Path, text: Path) -> None:
    settings = perplexity.RunSettings(model=model, corpus=text, ctx=512, chunks=3, threads=2)
    res = {c: perplexity.run_kld(KvConfig.parse(c), settings) for c in ("f16", "q4_0", "kvc8", "kvc4", "kvc2")}
    assert abs(res["f16"].kld_mean) < 1e-4
    assert res["f16"].ppl_ratio == pytest.approx(1.0, abs=1e-3)
    assert res["kvc8"].kld_mean < res["kvc4"].kld_mean < res["kvc2"].kld_mean
    # the 4.5-bpe format must keep its lead over upstream's 4.5-bpe q4_0 on real rows
    assert res["kvc4"].kld_mean < res["q4_0"].kld_mean
    assert res["kvc8"].kld_mean < 0.01
    assert res["kvc4"].same_top_p > res["kvc2"].same_top_p


def test_k_only_without_flash_attention(model: Path, text: Path) -> None:
    # K goes through MUL_MAT instead of FLASH_ATTN_EXT; V stays f16 as upstream requires
    settings = perplexity.RunSettings(model=model, corpus=text, ctx=512, chunks=3, flash_attn=False)
    kld = {k: perplexity.run_kld(KvConfig(k, "f16"), settings).kld_mean for k in ("f16", "q4_0", "kvc8", "kvc4")}
    assert kld["f16"] < kld["kvc8"] < kld["kvc4"] < kld["q4_0"]


def test_quantized_v_without_flash_attention_is_refused(bins: Path, model: Path, text: Path) -> None:
    proc = subprocess.run(_ppl_args(bins, model, text, "-fa", "off", "-ctk", "kvc4", "-ctv", "kvc4"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "quantized V cache requires flash_attn" in proc.stdout + proc.stderr


@pytest.mark.parametrize("tool", ["llama-perplexity", "llama-cli", "llama-server"])
def test_unknown_cache_type_is_refused(bins: Path, model: Path, tool: str) -> None:
    proc = subprocess.run([str(bins / tool), "-m", str(model), "-ctk", "kvc5"], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "kvc5" in out and "kvc4" in out  # names the bad value and lists the allowed ones


def test_llama_bench_accepts_kvc_types(bins: Path, model: Path) -> None:
    proc = subprocess.run([str(bins / "llama-bench"), "-m", str(model), "-fa", "1", "-p", "0", "-n", "4", "-r", "1",
                           "-t", "2", "-ctk", "kvc3", "-ctv", "kvc3", "-o", "json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert rows[0]["type_k"] == "kvc3" and rows[0]["type_v"] == "kvc3"
    assert rows[0]["avg_ts"] > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_server_generates_with_kvc_cache(bins: Path, model: Path) -> None:
    port = _free_port()
    proc = subprocess.Popen([str(bins / "llama-server"), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                             "-c", "1024", "-np", "2", "-t", "2", "-fa", "on", "-ctk", "kvc8", "-ctv", "kvc4"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, "llama-server exited during start-up"
            assert time.time() < deadline, "llama-server did not become healthy"
            time.sleep(0.5)
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/completion",
            data=json.dumps({"prompt": "The capital of France is", "n_predict": 8, "temperature": 0}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            body = json.loads(r.read())
        assert body["tokens_predicted"] == 8
        assert isinstance(body["content"], str) and body["content"]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_residual_buffer_lowers_kld(model: Path, text: Path) -> None:
    settings = perplexity.RunSettings(model=model, corpus=text, ctx=512, chunks=3, threads=2)
    plain = perplexity.run_kld(KvConfig.parse("kvc4"), settings)
    buffered = perplexity.run_kld(KvConfig.parse("kvc4:w32:s4"), settings)
    # the window holds the keys attention weighs most; measured ~4x lower on 16 chunks
    assert buffered.kld_mean < 0.5 * plain.kld_mean
    assert buffered.bpe_buffer == pytest.approx(16.0 * (perplexity.BUFFERED_UBATCH + 32 + 4) / 512)


@pytest.mark.parametrize(("extra", "message"), [
    (["-fa", "on", "--kv-comp-window", "-1"], "--kv-comp-window must be >= 0"),
    (["-fa", "off", "-ctk", "kvc4", "--kv-comp-window", "32"], "needs flash attention"),
])
def test_residual_buffer_bad_flags_are_refused(bins: Path, model: Path, text: Path, extra: list[str],
                                               message: str) -> None:
    proc = subprocess.run(_ppl_args(bins, model, text, *extra), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr
