from __future__ import annotations

import pytest

from ggml_kvcomp import perplexity
from ggml_kvcomp.kvtypes import ALL_TYPES, BITS_PER_ELEMENT, KvConfig


@pytest.mark.parametrize(("spec", "k", "v", "label"), [
    ("kvc4", "kvc4", "kvc4", "kvc4"),
    ("kvc8/kvc4", "kvc8", "kvc4", "kvc8/kvc4"),
    ("q8_0/q8_0", "q8_0", "q8_0", "q8_0"),
])
def test_parse(spec: str, k: str, v: str, label: str) -> None:
    cfg = KvConfig.parse(spec)
    assert (cfg.type_k, cfg.type_v, cfg.label) == (k, v, label)


@pytest.mark.parametrize("spec", ["kvc5", "q4_0/kvc1", "", "KVC4"])
def test_parse_rejects_unknown_types(spec: str) -> None:
    with pytest.raises(ValueError, match="unknown KV cache type"):
        KvConfig.parse(spec)


def test_parse_buffer_knobs() -> None:
    cfg = KvConfig.parse("kvc4:w32:s4")
    assert (cfg.window, cfg.sinks, cfg.label, cfg.buffered) == (32, 4, "kvc4:w32:s4", True)
    assert cfg.tool_args() == ["-ctk", "kvc4", "-ctv", "kvc4", "--kv-comp-window", "32", "--kv-comp-sinks", "4"]
    assert not KvConfig.parse("kvc4").buffered


def test_parse_pin_and_merge_knobs() -> None:
    cfg = KvConfig.parse("kvc3:w16:n4:p0.25:b2.5")
    assert (cfg.merge_interval, cfg.pin_threshold, cfg.pin_budget) == (4, 0.25, 2.5)
    assert cfg.label == "kvc3:w16:n4:p0.25:b2.5"
    assert cfg.tool_args()[4:] == [
        "--kv-comp-window", "16", "--kv-comp-merge", "4",
        "--kv-comp-pin-threshold", "0.25", "--kv-comp-pin-budget", "2.5",
    ]
    assert KvConfig.parse("kvc4:p0.1").buffered


@pytest.mark.parametrize("spec", ["kvc4:n0", "kvc4:b101", "kvc4:p-1"])
def test_parse_rejects_bad_knob_values(spec: str) -> None:
    with pytest.raises(ValueError):
        KvConfig.parse(spec)


@pytest.mark.parametrize("spec", ["kvc4:x3", "kvc4:w", "kvc4:w-1", "kvc4:s1.5", "kvc4:pabc"])
def test_parse_rejects_bad_knobs(spec: str) -> None:
    with pytest.raises(ValueError, match="bad knob"):
        KvConfig.parse(spec)


def test_every_type_has_a_size() -> None:
    assert set(BITS_PER_ELEMENT) == set(ALL_TYPES)


@pytest.mark.parametrize(("line", "ctx", "bpe"), [
    ("kvcomp: residual buffer: window = 32, sinks = 4, merge interval = 1, pin threshold = 0.000, "
     "pin budget = 0 cells, 1 streams of 68 slots, 2.49 MiB", 512, 16.0 * 68 / 512),
    ("kvcomp: residual buffer: window = 8, sinks = 2, merge interval = 1, pin threshold = 0.000, "
     "pin budget = 0 cells, 4 streams of 18 slots, 2.49 MiB", 2048, 16.0 * 72 / 2048),
    ("no buffer here", 512, 0.0),
])
def test_buffer_bpe_counts_every_stream(line: str, ctx: int, bpe: float) -> None:
    assert perplexity.parse_buffer_bpe(f"llama_context: ...\n{line}\n", ctx) == pytest.approx(bpe)
