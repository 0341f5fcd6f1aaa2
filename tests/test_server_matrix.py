"""llama-server with kvcomp under the features its users reach for: every mode and a
kvc4 cache with a window and sinks, on a unified and on a split cache of 2 slots, each taking
plain completions, backend sampling, n_probs, a context shift, slot save/restore, a reused
prompt, speculative decoding with a draft model and an embeddings request. The server must
stay up through all of them and give the documented answers."""

from __future__ import annotations

import re
import subprocess
import time
import urllib.error
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .server import get, post, server

CONFIGS = {
    "low-latency": ("--kv-comp", "low-latency"),
    "balanced": ("--kv-comp", "balanced"),
    "high-precision": ("--kv-comp", "high-precision"),
    "kvc4-w32-s4": ("-fa", "on", "-ctk", "kvc4", "-ctv", "kvc4", "--kv-comp-window", "32", "--kv-comp-sinks", "4"),
}
LAYOUTS = {"unified": ("--kv-unified",), "split": ("--no-kv-unified",)}
PROMPT = "The lighthouse keeper counted the ships that passed in the night, and"


def _post_status(url: str, body: dict[str, object]) -> tuple[int, dict[str, object] | None]:
    try:
        return 200, post(url, body)
    except urllib.error.HTTPError as e:
        return e.code, None


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("config", CONFIGS)
def test_server_features(bins: Path, model: Path, tmp_path: Path, config: str, layout: str) -> None:
    # 2 slots of 256 positions: a 200-token request overflows its slot, so the context shifts
    args = (*CONFIGS[config], *LAYOUTS[layout], "-np", "2", "-c", "512", "--context-shift",
            "--slot-save-path", str(tmp_path), "-md", str(model), "--spec-draft-n-max", "4")
    # the lengths below are what the features need (a shift past 256 positions), whatever text comes
    greedy = {"temperature": 0, "n_predict": 16, "ignore_eos": True}
    log = tmp_path / "server.log"
    with server(bins, model, *args, log=log) as url:
        plain = post(f"{url}/completion", {"prompt": PROMPT, **greedy, "cache_prompt": False})
        assert plain["tokens_predicted"] == 16

        # the abort came with the request after a backend-sampled one
        for body in ({"backend_sampling": True}, {}):
            r = post(f"{url}/completion", {"prompt": PROMPT, **greedy, **body})
            assert r["tokens_predicted"] == 16

        probs = post(f"{url}/completion", {"prompt": PROMPT, **greedy, "n_probs": 3})
        top = probs["completion_probabilities"]
        assert isinstance(top, list) and len(top) == 16 and all(len(t["top_logprobs"]) == 3 for t in top)

        shifted = post(f"{url}/completion", {"prompt": PROMPT, **greedy, "n_predict": 300, "id_slot": 0})
        assert shifted["tokens_predicted"] == 300

        # slot 1 keeps a generation, is saved, overwritten and restored
        post(f"{url}/completion", {"prompt": PROMPT, **greedy, "id_slot": 1})
        saved = post(f"{url}/slots/1?action=save", {"filename": "slot1.bin"})
        assert int(saved["n_saved"]) > 0  # type: ignore[call-overload]
        post(f"{url}/completion", {"prompt": "Another text entirely, about rivers.", **greedy, "id_slot": 1})
        restored = post(f"{url}/slots/1?action=restore", {"filename": "slot1.bin"})
        assert restored["n_restored"] == saved["n_saved"]

        # The same prompt again on the same slot reuses its cache: cut back to the prompt, its
        # last token decoded again, with the window's exact rows (test-kvc-llama holds that
        # bit for bit against a fresh run; here a fresh prompt takes another attention kernel,
        # whose rounding the Q4_1 weights amplify, so reuse is held against reuse).
        post(f"{url}/completion", {"prompt": PROMPT, **greedy, "id_slot": 0, "cache_prompt": False})
        reused = post(f"{url}/completion", {"prompt": PROMPT, **greedy, "id_slot": 0, "cache_prompt": True})
        again = post(f"{url}/completion", {"prompt": PROMPT, **greedy, "id_slot": 0, "cache_prompt": True})
        assert int(reused["tokens_cached"]) > 0 and int(again["tokens_cached"]) > 0  # type: ignore[call-overload]
        assert reused["content"] == again["content"]

        # speculative decoding ran (a draft model is loaded for every request)
        assert "draft" in log.read_text()

        # embeddings are not served without --embeddings: a clean refusal
        status, _ = _post_status(f"{url}/embeddings", {"content": PROMPT})
        assert status in (400, 501)

        status, _ = get(f"{url}/health")
        assert status == 200


def test_metrics_survive_sleep(bins: Path, model: Path, tmp_path: Path) -> None:
    """A sleeping server has freed its context; /metrics keeps the kvcomp series, and the
    counters never go back, before or after waking."""

    def counters(url: str) -> dict[str, float]:
        status, text = get(f"{url}/metrics")
        assert status == 200
        return {f"{s.name}{sorted(s.labels.items())}": s.value for f in text_string_to_metric_families(text)
                if f.name.startswith("llamacpp:kvcomp_") and f.type == "counter" for s in f.samples}

    log = tmp_path / "server.log"
    with server(bins, model, "--kv-comp", "balanced", "--metrics", "--sleep-idle-seconds", "2", log=log) as url:
        post(f"{url}/completion", {"prompt": PROMPT, "temperature": 0, "n_predict": 40})
        awake = counters(url)
        assert awake and any(v > 0 for v in awake.values())
        deadline = time.time() + 30
        while "entering sleeping state" not in log.read_text():
            assert time.time() < deadline, "the server did not go to sleep"
            time.sleep(0.5)
        asleep = counters(url)
        assert set(asleep) == set(awake) and all(asleep[k] >= awake[k] for k in awake)
        post(f"{url}/completion", {"prompt": PROMPT, "temperature": 0, "n_predict": 40})
        woken = counters(url)
        assert set(asleep) <= set(woken) and all(woken[k] >= asleep[k] for k in asleep)
        assert woken["llamacpp:kvcomp_ubatches_total[]"] > asleep["llamacpp:kvcomp_ubatches_total[]"]


@pytest.mark.parametrize("tool", ["llama-server", "llama-perplexity"])
def test_mode_with_fa_off_names_the_fix(bins: Path, model: Path, tool: str) -> None:
    proc = subprocess.run([str(bins / tool), "-m", str(model), "--kv-comp", "balanced", "-fa", "off", "-c", "256"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    want = r"--kv-comp balanced stores V as kvc3, which needs flash attention.*drop -fa off"
    assert re.search(want, proc.stdout + proc.stderr)


def _prompt_cache_run(bins: Path, model: Path, log: Path, *extra: str) -> tuple[list[dict[str, object]], str]:
    """A long prompt reused after a generation of 80 tokens on its slot, then restored from the
    RAM prompt cache (with its 80 generated tokens) after another prompt took the slot, then
    sent fresh: the three responses and the server's log."""
    prompt = PROMPT * 20
    greedy = {"temperature": 0, "n_predict": 16, "cache_prompt": True}
    long = {**greedy, "n_predict": 80, "ignore_eos": True}
    with server(bins, model, *extra, "-np", "1", "-c", "1024", "--cache-ram", "64", log=log) as url:
        post(f"{url}/completion", {"prompt": prompt, **long})
        reused = post(f"{url}/completion", {"prompt": prompt, **greedy})
        post(f"{url}/completion", {"prompt": prompt, **long})
        post(f"{url}/completion", {"prompt": "Another text entirely, about rivers.", **greedy})
        restored = post(f"{url}/completion", {"prompt": prompt, **greedy})
        fresh = post(f"{url}/completion", {"prompt": prompt, **greedy, "cache_prompt": False})
    return [reused, restored, fresh], log.read_text()


@pytest.mark.parametrize("keep_prompt", ["on", "off"])
def test_reused_prompt_after_a_long_generation(bins: Path, model: Path, tmp_path: Path, keep_prompt: str) -> None:
    """80 generated tokens move balanced's window (56) and merge interval (8) past the prompt.
    With --kv-comp-keep-prompt (llama-server's default) the prompt's exact rows are still there:
    reused or restored, it costs what it costs on an f16 cache (the same timings), and gives a
    fresh request's answer. Without, the server decodes the prompt again, and says so."""
    (f16_reused, f16_restored, _), _ = _prompt_cache_run(bins, model, tmp_path / "f16.log")
    (reused, restored, fresh), log = _prompt_cache_run(bins, model, tmp_path / "kvc.log", "--kv-comp", "balanced",
                                                       "--kv-comp-keep-prompt", keep_prompt)
    n_prompt = _cached(fresh)[1]
    # the f16 run is the reference: both are cache hits there
    assert [_cached(f16_reused), _cached(f16_restored)] == [(n_prompt - 1, 1)] * 2
    assert reused["content"] == fresh["content"] and restored["content"] == fresh["content"]
    decoded_again = "the cut-back would lose exact rows, the prompt is decoded again" in log
    assert decoded_again == (keep_prompt == "off")
    if keep_prompt == "on":
        assert [_cached(reused), _cached(restored)] == [_cached(f16_reused), _cached(f16_restored)]


def _cached(response: dict[str, object]) -> tuple[int, int]:
    """A response's tokens taken from the cache and tokens of the prompt decoded."""
    timings = response["timings"]
    assert isinstance(timings, dict)
    return int(timings["cache_n"]), int(timings["prompt_n"])


@pytest.mark.parametrize("mode", ["balanced", "high-precision"])
def test_reused_and_restored_prompts_cost_a_cache_hit(bins: Path, model: Path, tmp_path: Path, mode: str) -> None:
    """A prompt cached as it was evaluated (n_predict 1 stores no generated token), sent again
    or restored from the RAM prompt cache after another prompt took its slot, is cut back by
    its last token, which is decoded again with every exact row of its window (the row before
    the window included): the answer of a fresh request, and the timings of a cache hit. The
    prompt is longer than high-precision's window of 32."""
    greedy = {"temperature": 0, "n_predict": 16}
    prompt = PROMPT * 3
    with server(bins, model, "--kv-comp", mode, "-np", "1", "-c", "1024", "--cache-ram", "64") as url:
        fresh = post(f"{url}/completion", {"prompt": prompt, **greedy, "cache_prompt": False})
        n_prompt = int(fresh["timings"]["prompt_n"])  # type: ignore[index]
        assert n_prompt > 32
        post(f"{url}/completion", {"prompt": prompt, **greedy, "n_predict": 1, "cache_prompt": True})
        reused = post(f"{url}/completion", {"prompt": prompt, **greedy, "cache_prompt": True})
        post(f"{url}/completion", {"prompt": prompt, **greedy, "n_predict": 1, "cache_prompt": True})
        post(f"{url}/completion", {"prompt": "Another text entirely, about rivers and their bridges.", **greedy,
                                   "cache_prompt": True})
        restored = post(f"{url}/completion", {"prompt": prompt, **greedy, "cache_prompt": True})
        for r in (reused, restored):
            assert r["content"] == fresh["content"]
            assert (r["timings"]["cache_n"], r["timings"]["prompt_n"]) == (n_prompt - 1, 1)  # type: ignore[index]
