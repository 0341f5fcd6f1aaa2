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


@pytest.mark.parametrize("spec", ["kvc6", "q4_0/kvc1", "", "KVC4"])
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


_KV_LINE = ("llama_kv_cache: size = {mib:7.2f} MiB ({cells:6d} cells,  30 layers,  1/1 seqs), "
            "K (f16): 1.00 MiB, V (f16): 1.00 MiB")


@pytest.mark.parametrize(("log", "bpe"), [
    ("kvcomp: KV memory: main cache 6.75 MiB (4.00 bpe), residual buffer 0.75 MiB (0.44 bpe, 1 streams of 99 slots), "
     "total 4.44 bpe", 4.0 * 0.75 / 6.75),
    # a sliding-window model: two caches, the buffer counted over both
    ("kvcomp: KV memory: main cache 6.00 MiB (4.00 bpe), residual buffer 1.00 MiB (0.67 bpe, 1 streams of 99 slots), "
     "total 4.67 bpe\nkvcomp: KV memory: main cache 2.00 MiB (4.00 bpe), residual buffer 1.00 MiB (2.00 bpe, 1 streams "
     "of 99 slots), total 6.00 bpe", 4.0 * 2.0 / 8.0),
    # a kvct K cache configured twice (its statistics, then the buffer): the last line counts
    (f"{_KV_LINE.format(mib=6.75, cells=512)}\n"
     "kvcomp: KV memory: main cache 6.75 MiB (4.00 bpe), residual buffer 0.00 MiB (0.00 bpe, 1 streams of 0 slots), "
     "total 4.00 bpe\nkvcomp: KV memory: main cache 6.75 MiB (4.00 bpe), residual buffer 0.75 MiB (0.44 bpe, 1 "
     "streams of 99 slots), total 4.44 bpe", 4.0 * 0.75 / 6.75),
    ("no buffer here", 0.0),
])
def test_buffer_bpe_counts_every_cache(log: str, bpe: float) -> None:
    assert perplexity.parse_buffer_bpe(f"llama_context: ...\n{log}\n", 4.0) == pytest.approx(bpe)


@pytest.mark.parametrize(("log", "ctx_full", "mib"), [
    # one cache: 16 times the cells at 8192
    (f"print_info: n_swa = 0\nllama_context: n_ubatch = 512\n{_KV_LINE.format(mib=11.25, cells=512)}", 8192, 180.0),
    # the residual buffer does not grow with the context
    (f"{_KV_LINE.format(mib=11.25, cells=512)}\nkvcomp: KV memory: main cache 11.25 MiB (16.00 bpe), residual "
     "buffer 0.75 MiB (1.07 bpe, 1 streams of 99 slots), total 17.07 bpe", 8192, 180.75),
    # a sliding-window model: the window's cache stays at n_swa + n_ubatch cells, padded to 256
    ("print_info: n_swa            = 512\nllama_context: n_ubatch      = 512\n"
     "llama_kv_cache_iswa: creating non-SWA KV cache, size = 512 cells\n" + _KV_LINE.format(mib=3.0, cells=512)
     + "\nllama_kv_cache_iswa: creating     SWA KV cache, size = 1024 cells\n" + _KV_LINE.format(mib=15.0, cells=1024),
     32768, 192.0 + 15.0),
    # a context past the model's (the run's own): unchanged
    (_KV_LINE.format(mib=11.25, cells=512), 512, 11.25),
])
def test_kv_mib_at_full_context(log: str, ctx_full: int, mib: float) -> None:
    assert perplexity.parse_kv_mib_full(log, ctx_full) == pytest.approx(mib, rel=1e-6)


def test_kv_mib_needs_the_size_line() -> None:
    with pytest.raises(ValueError, match="size line"):
        perplexity.parse_kv_mib_full("no cache here", 8192)


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
