from __future__ import annotations

import pytest

from ggml_kvcomp import perplexity
from ggml_kvcomp.capi import MODE_NAMES, mode_preset
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


@pytest.mark.parametrize(("log", "bpe"), [
    ("kvcomp: KV memory: main cache 6.75 MiB (4.00 bpe), residual buffer 0.75 MiB (0.44 bpe, 1 streams of 99 slots), "
     "total 4.44 bpe", 4.0 * 0.75 / 6.75),
    # a sliding-window model: two caches, the buffer counted over both
    ("kvcomp: KV memory: main cache 6.00 MiB (4.00 bpe), residual buffer 1.00 MiB (0.67 bpe, 1 streams of 99 slots), "
     "total 4.67 bpe\nkvcomp: KV memory: main cache 2.00 MiB (4.00 bpe), residual buffer 1.00 MiB (2.00 bpe, 1 streams "
     "of 99 slots), total 6.00 bpe", 4.0 * 2.0 / 8.0),
    ("no buffer here", 0.0),
])
def test_buffer_bpe_counts_every_cache(log: str, bpe: float) -> None:
    assert perplexity.parse_buffer_bpe(f"llama_context: ...\n{log}\n", 4.0) == pytest.approx(bpe)


@pytest.mark.parametrize("mode", MODE_NAMES)
def test_mode_spec_round_trip(mode: str) -> None:
    preset = mode_preset(mode)  # type: ignore[arg-type]
    cfg = KvConfig.parse(mode)
    assert cfg.label == mode
    assert (cfg.type_k, cfg.type_v, cfg.window, cfg.sinks, cfg.merge_interval, bool(cfg.tracker)) == (
        preset.type_k, preset.type_v, preset.window, preset.sinks, preset.merge_interval, preset.tracker)
    assert cfg.tool_args() == ["-ctk", preset.type_k, "-ctv", preset.type_v, "--kv-comp", mode]


def test_mode_spec_overrides() -> None:
    cfg = KvConfig.parse("balanced:w64:t0")
    assert cfg.label == "balanced:w64:t0"
    assert cfg.tool_args()[-4:] == ["--kv-comp-window", "64", "--kv-comp-tracker", "0"]
    assert KvConfig.parse("kvc4:t1").tool_args() == ["-ctk", "kvc4", "-ctv", "kvc4", "--kv-comp-tracker", "1"]


@pytest.mark.parametrize("name", ["fast", "Balanced", "custom"])
def test_unknown_mode_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="unknown"):
        mode_preset(name)  # type: ignore[arg-type]


def test_tracker_rmse_pools_every_cache() -> None:
    log = ("kvcomp: tracker: K rows measured = 100, RMSE = 0.3, RMSE offset only = 0.4, RMSE plain = 0.5, "
           "row RMS = 2.0\n"
           "kvcomp: tracker: K rows measured = 300, RMSE = 0.1, RMSE offset only = 0.2, RMSE plain = 0.3, "
           "row RMS = 2.0\n")
    stored, offset, plain = perplexity.parse_tracker_rmse(log)
    assert stored == pytest.approx(((100 * 0.09 + 300 * 0.01) / 400) ** 0.5)
    assert offset == pytest.approx(((100 * 0.16 + 300 * 0.04) / 400) ** 0.5)
    assert plain == pytest.approx(((100 * 0.25 + 300 * 0.09) / 400) ** 0.5)
    assert perplexity.parse_tracker_rmse("no tracker") == (0.0, 0.0, 0.0)
