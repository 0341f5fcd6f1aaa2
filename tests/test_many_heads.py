"""Every KV head in the monitor's exports: the public layer stats hold the scales of
the first LLAMA_KVCOMP_MAX_HEADS (16) KV heads, and the monitor exports the others too, not
0. A tiny random llama with 32 KV heads (tests/tiny_model.py) behind llama-server.

Reference: the heads of a random model are alike, so the scales of heads 16-31 must be of the
size of heads 0-15's (which the capped struct always carried), within a factor of 2 of their
median; a head exported as 0 or as garbage fails that.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .server import get, post, server
from .tiny_model import write_tiny_llama

N_LAYER, N_HEAD_KV = 2, 32
MAX_HEADS = 16  # LLAMA_KVCOMP_MAX_HEADS
PER_HEAD = ("llamacpp:kvcomp_k_rmse", "llamacpp:kvcomp_k_rmse_relative", "llamacpp:kvcomp_k_scale",
            "llamacpp:kvcomp_v_scale")


@pytest.fixture(scope="module")
def many_heads(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Path:
    # head size 64 (kvc blocks are 32 wide), a narrow model so that 32 heads stay small
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-kv32.gguf", model, 64, n_head=N_HEAD_KV,
                            n_head_kv=N_HEAD_KV, n_layer=N_LAYER, n_embd=256)


def _per_head(text: str) -> dict[str, dict[tuple[int, int], float]]:
    out: dict[str, dict[tuple[int, int], float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "head" in s.labels:
                name = s.name + (f"_{s.labels['tensor']}" if "tensor" in s.labels else "")
                out.setdefault(name, {})[(int(s.labels["layer"]), int(s.labels["head"]))] = s.value
    return out


def test_every_kv_head_is_exported(bins: Path, many_heads: Path) -> None:
    with server(bins, many_heads, "-c", "256", "-np", "1", "--metrics", "--kv-comp", "low-latency",
                "--kv-comp-kstats", "none") as url:
        done = post(f"{url}/completion", {"prompt": "The lighthouse keeper counted the ships", "n_predict": 32,
                                          "temperature": 0, "ignore_eos": True, "cache_prompt": False})
        assert done["tokens_predicted"] == 32
        status, text = get(f"{url}/metrics")
        assert status == 200
        series = _per_head(text)
        status, body = get(f"{url}/kvcomp")
        assert status == 200
        snap = json.loads(body)

    want = {(il, h) for il in range(N_LAYER) for h in range(N_HEAD_KV)}
    for name in (*PER_HEAD, "llamacpp:kvcomp_buffer_l2_k", "llamacpp:kvcomp_buffer_l2_v"):
        assert set(series[name]) == want, name
        assert all(math.isfinite(v) for v in series[name].values()), name
    # kvc4 K as stored: a few per cent of the rows' RMS on every head
    assert all(0.0 < v < 0.2 for v in series["llamacpp:kvcomp_k_rmse_relative"].values())
    for name in ("llamacpp:kvcomp_k_scale", "llamacpp:kvcomp_v_scale"):
        for il in range(N_LAYER):
            low = [series[name][(il, h)] for h in range(MAX_HEADS)]
            ref = statistics.median(low)
            assert ref > 0.0, name
            high = [series[name][(il, h)] for h in range(MAX_HEADS, N_HEAD_KV)]
            assert all(0.5 * ref <= v <= 2.0 * ref for v in high), (name, il, ref, high)

    # the JSON snapshot has the same heads and numbers
    assert [len(layer["heads"]) for layer in snap["layers"]] == [N_HEAD_KV] * N_LAYER
    for layer in snap["layers"]:
        for head in layer["heads"]:
            key = (layer["layer"], head["head"])
            assert head["k_scale"] == pytest.approx(series["llamacpp:kvcomp_k_scale"][key], rel=1e-6)
            assert head["v_scale"] == pytest.approx(series["llamacpp:kvcomp_v_scale"][key], rel=1e-6)
    assert snap["nonfinite"] == 0
