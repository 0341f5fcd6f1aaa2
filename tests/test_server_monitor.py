"""The monitor behind a real llama-server (docs/monitoring.md): /metrics in Prometheus text,
the JSON snapshot at /kvcomp, the degrade ladder, and clean errors for bad requests."""

from __future__ import annotations

import concurrent.futures
import json
import math
import re
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ggml_kvcomp import cli, perplexity
from ggml_kvcomp.kvtypes import KvConfig

from .server import get, post, server

N_LAYER, N_HEAD_KV = 30, 3  # SmolLM2-135M


def _families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _samples(fams: dict[str, object], name: str) -> dict[tuple[tuple[str, str], ...], float]:
    fam = fams[name]
    return {tuple(sorted(s.labels.items())): s.value for s in fam.samples}  # type: ignore[attr-defined]


def test_metrics_and_snapshot_with_two_slots(bins: Path, model: Path) -> None:
    prompts = [f"Write a short story about a lighthouse keeper named {n}:" for n in ("Ada", "Bo")]
    request = {"n_predict": 48, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    with server(bins, model, "-c", "2048", "-np", "2", "--metrics", "--kv-comp", "balanced", "--kv-comp-kstats", "none",
                "--kv-comp-ppl-window", "16", "--kv-comp-degrade-windows", "0") as url:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            done = list(pool.map(lambda p: post(f"{url}/completion", {"prompt": p, **request}), prompts))
        assert all(r["tokens_predicted"] == 48 for r in done)

        status, text = get(f"{url}/metrics")
        assert status == 200
        fams = _families(text)
        # upstream's series are still there, ours beside them with the right types
        assert "llamacpp:prompt_tokens" in fams
        assert fams["llamacpp:kvcomp_k_rmse"].type == "gauge"  # type: ignore[attr-defined]
        assert fams["llamacpp:kvcomp_merges"].type == "counter"  # type: ignore[attr-defined]
        assert fams["llamacpp:kvcomp_generated_tokens"].type == "counter"  # type: ignore[attr-defined]

        mode = _samples(fams, "llamacpp:kvcomp_mode")
        assert mode == {(("mode", "balanced"),): 2.0}
        rmse = _samples(fams, "llamacpp:kvcomp_k_rmse")
        rel = _samples(fams, "llamacpp:kvcomp_k_rmse_relative")
        want = {(("head", str(h)), ("layer", str(il)),) for il in range(N_LAYER) for h in range(N_HEAD_KV)}
        assert set(rmse) == want and set(rel) == want
        # kvc4 K as stored: a few per cent of the rows' RMS, never zero once measured
        assert all(0.0 < v < 0.2 for v in rel.values())
        l2 = _samples(fams, "llamacpp:kvcomp_buffer_l2")
        assert len(l2) == 2 * len(want) and all(math.isfinite(v) and v >= 0 for v in l2.values())
        fill = _samples(fams, "llamacpp:kvcomp_buffer_fill_ratio")[()]
        assert 0.0 <= fill <= 1.0
        gen = _samples(fams, "llamacpp:kvcomp_generated_tokens")
        assert gen == {(("slot", "0"),): 48.0, (("slot", "1"),): 48.0}
        ppl = _samples(fams, "llamacpp:kvcomp_window_perplexity")
        assert len(ppl) == 2 and all(1.0 <= v < 1000.0 for v in ppl.values())

        # the JSON snapshot holds the same numbers (no decode ran in between)
        status, body = get(f"{url}/kvcomp")
        assert status == 200
        snap = json.loads(body)
        assert snap["mode"] == "balanced" and len(snap["layers"]) == N_LAYER
        for layer in snap["layers"]:
            for head in layer["heads"]:
                key = (("head", str(head["head"])), ("layer", str(layer["layer"])))
                assert head["k_rmse"] == pytest.approx(rmse[key], rel=1e-6)
        seqs = {s["seq_id"]: s for s in snap["sequences"]}
        assert {k: v["tokens"] for k, v in seqs.items()} == {0: 48, 1: 48}
        assert seqs[0]["ppl_last"] == pytest.approx(ppl[(("slot", "0"),)], rel=1e-6)

        status, body = get(f"{url}/kvcomp?layer=3")
        assert status == 200 and [layer["layer"] for layer in json.loads(body)["layers"]] == [3]
        status, body = get(f"{url}/kvcomp?format=prometheus")
        assert status == 200 and "llamacpp:kvcomp_k_rmse{" in body
        # layer applies to the Prometheus text too: that layer's per-head series only
        status, body = get(f"{url}/kvcomp?layer=3&format=prometheus")
        assert status == 200
        one = _samples(_families(body), "llamacpp:kvcomp_k_rmse")
        assert set(one) == {(("head", str(h)), ("layer", "3")) for h in range(N_HEAD_KV)}
        # nothing non-finite met, and the counter says so in both forms
        assert _samples(fams, "llamacpp:kvcomp_nonfinite") == {(): 0.0}
        assert snap["nonfinite"] == 0


@pytest.fixture(scope="module")
def low_latency_url(bins: Path, model: Path) -> Iterator[str]:
    """One server for the request checks below (they decode nothing)."""
    with server(bins, model, "-c", "512", "--metrics", "--kv-comp", "low-latency") as url:
        yield url


# the rules of docs/monitoring.md ("Surfaces"): known parameters, each at most once (an exact
# repeat such as layer=3&layer=3 is dropped by the HTTP library before the handler), a layer
# that is a whole number below the layer count, a format among two
@pytest.mark.parametrize(("query", "message"), [
    ("?layer=abc", "layer must be a whole number in [0, 30), got 'abc'"),
    ("?layer=30", "layer must be a whole number in [0, 30), got '30'"),
    ("?layer=-1", "layer must be a whole number in [0, 30), got '-1'"),
    ("?layer=", "layer must be a whole number in [0, 30), got ''"),
    ("?layer", "layer must be a whole number in [0, 30), got ''"),
    ("?layer=%2B3", "layer must be a whole number in [0, 30), got '+3'"),
    ("?layer=%203", "layer must be a whole number in [0, 30), got ' 3'"),
    ("?layer=3.0", "layer must be a whole number in [0, 30), got '3.0'"),
    ("?layer=99999999999999999999", "layer must be a whole number in [0, 30)"),
    ("?layer=0&layer=1", "query parameter 'layer' given 2 times (at most once)"),
    ("?format=json&layer=2&format=prometheus", "query parameter 'format' given 2 times (at most once)"),
    ("?format=xml", "format must be json or prometheus, got 'xml'"),
    ("?format=", "format must be json or prometheus, got ''"),
    ("?verbose=1", "unknown query parameter 'verbose' (layer, format)"),
    ("?layer=1&Layer=1", "unknown query parameter 'Layer' (layer, format)"),
])
def test_bad_requests_get_clean_errors(low_latency_url: str, query: str, message: str) -> None:
    url = low_latency_url
    status, body = get(f"{url}/kvcomp{query}")
    assert status == 400
    assert message in json.loads(body)["error"]["message"]
    # a method the endpoint does not take, then the server still answers
    req = urllib.request.Request(f"{url}/kvcomp", data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code in (404, 405)
    assert get(f"{url}/kvcomp")[0] == 200


@pytest.mark.parametrize("query", ["", "?layer=0", "?layer=29", "?format=json", "?format=prometheus&layer=7"])
def test_good_requests_are_answered(low_latency_url: str, query: str) -> None:
    status, body = get(f"{low_latency_url}/kvcomp{query}")
    assert status == 200 and body


def test_endpoint_off_with_the_monitor_off(bins: Path, model: Path) -> None:
    # the monitor exists but collects nothing: no snapshot to serve, no series to add
    with server(bins, model, "-c", "512", "--metrics", "--kv-comp", "balanced", "--kv-comp-monitor", "off") as url:
        post(f"{url}/completion", {"prompt": "Once upon a time", "n_predict": 4, "temperature": 0})
        status, body = get(f"{url}/kvcomp")
        assert status == 501 and "kvcomp monitoring is off" in json.loads(body)["error"]["message"]
        status, text = get(f"{url}/metrics")
        assert status == 200 and "llamacpp:prompt_tokens" in text and "llamacpp:kvcomp_" not in text


def test_endpoint_off_without_metrics_flag(bins: Path, model: Path) -> None:
    with server(bins, model, "-c", "512", "--kv-comp", "low-latency") as url:
        status, body = get(f"{url}/kvcomp")
        assert status == 501 and "--metrics" in json.loads(body)["error"]["message"]
        assert get(f"{url}/metrics")[0] == 501  # upstream's answer, unchanged


def test_degrade_ladder_from_a_forced_low_baseline(bins: Path, model: Path, tmp_path: Path) -> None:
    # a calibration profile whose perplexity no text reaches: every window is "above"
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"model": "smollm2-135m", "ppl": 0.5}))
    log = tmp_path / "server.log"
    with server(bins, model, "-c", "1024", "-np", "1", "--metrics", "--kv-comp", "high-precision",
                "--kv-comp-ppl-window", "8", "--kv-comp-degrade-windows", "1", "--kv-comp-baseline", str(profile),
                log=log) as url:
        first = post(f"{url}/completion", {"prompt": "Once upon a time", "n_predict": 40, "temperature": 0})
        assert first["tokens_predicted"] == 40
        snap = json.loads(get(f"{url}/kvcomp")[1])
        steps = [(e["from"], e["to"]) for e in snap["degrade_log"]]
        assert steps == [("high-precision", "balanced"), ("balanced", "low-latency"), ("low-latency", "off")]
        assert snap["mode"] == "off" and snap["degrade_steps"] == 3
        assert all(e["seq_id"] == 0 and e["ppl"] > 1.2 * 0.5 and e["ppl_baseline"] == 0.5 for e in snap["degrade_log"])
        fams = _families(get(f"{url}/metrics")[1])
        assert _samples(fams, "llamacpp:kvcomp_degrade_steps") == {(): 3.0}
        assert _samples(fams, "llamacpp:kvcomp_mode") == {(("mode", "off"),): 0.0}
        # generation goes on at the bottom of the ladder
        again = post(f"{url}/completion", {"prompt": "The lighthouse", "n_predict": 16, "temperature": 0})
        assert again["tokens_predicted"] == 16
    lines = [ln for ln in log.read_text().splitlines() if "kvcomp: degrade:" in ln]
    assert len(lines) == 3
    assert all(re.search(r"seq 0: window perplexity [\d.]+ above 1\.20 x baseline 0\.500", ln) for ln in lines)
    assert "mode high-precision -> balanced" in lines[0] and "mode low-latency -> off" in lines[2]


@pytest.mark.parametrize(("extra", "message"), [
    (["--kv-comp-baseline", "/nonexistent/profile.json"], "--kv-comp-baseline: neither a number nor a readable file"),
    (["--kv-comp-degrade-ratio", "0.9"], "--kv-comp-degrade-ratio: the degrade ratio must be a finite value >= 1"),
    (["--kv-comp-ppl-window", "0"], "--kv-comp-ppl-window: the perplexity window must be >= 1"),
    (["--kv-comp-monitor", "maybe"], "--kv-comp-monitor: expected on or off"),
])
def test_bad_monitor_flags_are_refused(bins: Path, model: Path, extra: list[str], message: str) -> None:
    proc = subprocess.run([str(bins / "llama-server"), "-m", str(model), "--kv-comp", "balanced", *extra],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr


def test_profile_is_the_f16_perplexity_and_the_server_takes_it(bins: Path, model: Path, text: Path,
                                                                tmp_path: Path) -> None:
    out = tmp_path / "smollm2.json"
    assert cli.main(["profile", "--ctx", "512", "--chunks", "2", "--out", str(out)]) == 0
    profile = json.loads(out.read_text())
    f16 = perplexity.run_kld(KvConfig.parse("f16"),
                             perplexity.RunSettings(model=model, corpus=text, ctx=512, chunks=2, threads=2))
    assert profile["ppl"] == pytest.approx(f16.ppl_base, rel=1e-3)
    with server(bins, model, "-c", "512", "--metrics", "--kv-comp", "balanced", "--kv-comp-baseline", str(out)) as url:
        snap = json.loads(get(f"{url}/kvcomp")[1])
        assert snap["monitor"]["baseline_ppl"] == pytest.approx(profile["ppl"], rel=1e-6)


def test_a_broken_profile_is_refused(bins: Path, model: Path, tmp_path: Path) -> None:
    broken = tmp_path / "profile.json"
    broken.write_text('{"model": "smollm2-135m", "perplexity": 8.1}')  # no "ppl"
    proc = subprocess.run([str(bins / "llama-server"), "-m", str(model), "--kv-comp", "balanced",
                           "--kv-comp-baseline", str(broken)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "is not a calibration profile (JSON with \"ppl\")" in proc.stdout + proc.stderr
