"""What one request computes must not depend on the requests around it: on a
4-slot server at temperature 0, a prompt sent alone again later gives its first answer, and
running it while the other 3 slots are busy changes it no more often than it does with
upstream's f16 cache (whose batch shapes and kernels also change with the company).

Run with the modes' default kvct K (plans from the model's K statistics, no offset) and with
kvc K (`--kv-comp-kstats none`: the scale tracker's K offset), on a split cache (each slot its
own KV stream, with its own K offset from the first 32 positions of the sequence that starts
it; docs/design-tracker-modes.md, "Isolation") and on a unified one (`--kv-unified`: the slots
share one stream and its cells, whose keys then take no offset). Not in the default run
(KVCOMP_ISOLATION=1 runs it: a few minutes per layout on 2 cores), as test-kvc-llama checks
the same property on the C API in seconds."""

from __future__ import annotations

import concurrent.futures
import os
from pathlib import Path

import pytest

from .server import post, server

PROMPTS = [
    "Write a short story about a lighthouse keeper named Ada:",
    "List three facts about the moons of Jupiter:",
    "Explain in two sentences how a bicycle stays upright:",
    "Describe the smell of rain on a summer afternoon:",
    "Give a recipe for a simple tomato soup:",
]
BUSY = ["Tell a long tale about a dragon and a baker.", "Write a poem about winter roads.",
        "Describe a busy harbour at dawn in detail."]
REQ = {"temperature": 0, "n_predict": 64, "cache_prompt": False}


def _run(url: str, prompt: str) -> str:
    return str(post(f"{url}/completion", {"prompt": prompt, **REQ})["content"])


def _changes(bins: Path, model: Path, *args: str) -> tuple[int, int]:
    """(answers that changed when sent alone again later, answers that changed beside 3 busy slots)"""
    with server(bins, model, "-np", "4", "-c", "4096", *args) as url:
        first = [_run(url, p) for p in PROMPTS]
        later = [_run(url, p) for p in reversed(PROMPTS)][::-1]
        busy = []
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            for p in PROMPTS:
                others = [pool.submit(post, f"{url}/completion", {"prompt": b, **REQ, "n_predict": 160}) for b in BUSY]
                busy.append(_run(url, p))
                for o in others:
                    o.result()
    return sum(a != b for a, b in zip(first, later, strict=True)), sum(a != b for a, b in zip(first, busy, strict=True))


@pytest.mark.skipif(os.environ.get("KVCOMP_ISOLATION") != "1", reason="several minutes: KVCOMP_ISOLATION=1 runs it")
@pytest.mark.parametrize("layout", ["--no-kv-unified", "--kv-unified"])
@pytest.mark.parametrize("mode", ["low-latency", "balanced", "low-latency --kv-comp-kstats none",
                                  "balanced --kv-comp-kstats none"])
def test_requests_are_isolated(bins: Path, model: Path, mode: str, layout: str) -> None:
    f16_later, f16_busy = _changes(bins, model, layout, "--kv-comp", "off", "-fa", "on")
    later, busy = _changes(bins, model, layout, "--kv-comp", *mode.split())
    print(f"changed answers of {len(PROMPTS)}: f16 later {f16_later} busy {f16_busy}; {mode} later {later} busy {busy}")
    assert f16_later == 0
    assert later == 0, f"{mode}: {later} of {len(PROMPTS)} answers changed when sent alone again"
    assert busy <= f16_busy, f"{mode}: {busy} of {len(PROMPTS)} answers changed beside busy slots, f16 {f16_busy}"
