"""llama-cpp-python on the kvcomp build (python/README.md): the kvc types through
llama_cpp.Llama, a mode applied and read back through our C API, run-time switches and the
monitor's snapshot. References: the same model with an f16 cache, and the C++ mode table."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ggml_kvcomp import llm
from ggml_kvcomp.capi import mode_preset

PROMPT = "The history of the lighthouse begins with fires lit on hills to guide ships at night, and"


def _logits(model: Path, type_k: str, type_v: str) -> np.ndarray[Any, np.dtype[np.float32]]:
    llama_cpp = llm.import_llama_cpp()
    m = llama_cpp.Llama(str(model), n_ctx=512, n_threads=2, n_threads_batch=2, flash_attn=True, logits_all=True,
                        type_k=llm.type_id(type_k), type_v=llm.type_id(type_v), verbose=False)
    toks = m.tokenize(PROMPT.encode())
    m.eval(toks)
    out = np.array(m.scores[: len(toks)], dtype=np.float32)
    m.close()
    return out


def _kl(ref: np.ndarray[Any, np.dtype[np.float32]], x: np.ndarray[Any, np.dtype[np.float32]]) -> float:
    def log_softmax(a: np.ndarray[Any, np.dtype[np.float32]]) -> np.ndarray[Any, np.dtype[np.float64]]:
        a64 = a.astype(np.float64)
        a64 -= a64.max(axis=-1, keepdims=True)
        return a64 - np.log(np.exp(a64).sum(axis=-1, keepdims=True))  # type: ignore[no-any-return]

    lp, lq = log_softmax(ref), log_softmax(x)
    return float((np.exp(lp) * (lp - lq)).sum(axis=-1).mean())


def test_type_ids_are_the_librarys() -> None:
    assert llm.type_name(llm.type_id("kvc4")) == "kvc4"
    assert llm.type_id("f16") == 1 and llm.type_id("q8_0") == 8
    with pytest.raises(ValueError, match="unknown tensor type"):
        llm.type_id("kvc6")


def test_llama_with_kvc_types_tracks_f16(model: Path) -> None:
    # the kvc caches through llama_cpp.Llama: logits close to an f16 cache, ordered by bits
    ref = _logits(model, "f16", "f16")
    kl8 = _kl(ref, _logits(model, "kvc8", "kvc8"))
    kl4 = _kl(ref, _logits(model, "kvc4", "kvc4"))
    kl2 = _kl(ref, _logits(model, "kvc2", "kvc2"))
    assert kl8 < kl4 < kl2
    assert kl8 < 0.01


@pytest.mark.parametrize("mode", ["low-latency", "balanced", "high-precision"])
def test_open_llama_applies_the_preset(model: Path, mode: str) -> None:
    preset = mode_preset(mode)  # type: ignore[arg-type]
    m = llm.open_llama(model, mode, n_ctx=1024)  # type: ignore[arg-type]
    cfg = llm.get_config(m)
    # K is the mode's type for the model's K statistics, which the library measures itself
    assert (cfg.mode, cfg.type_k, cfg.type_v) == (mode, preset.type_k_stats, preset.type_v)
    assert (cfg.window, cfg.sinks, cfg.merge_interval, cfg.tracker) == \
        (preset.window, preset.sinks, preset.merge_interval, preset.tracker)
    out = m(PROMPT, max_tokens=16, temperature=0.0)
    assert 0 < out["usage"]["completion_tokens"] <= 16 and out["choices"][0]["text"]  # type: ignore[index]
    m.close()


def test_knob_overrides_and_bad_knobs(model: Path) -> None:
    m = llm.open_llama(model, "balanced", n_ctx=1024, window=64, sinks=8)
    cfg = llm.get_config(m)
    assert (cfg.mode, cfg.window, cfg.sinks) == ("custom", 64, 8)
    with pytest.raises(ValueError, match="unknown knob 'windw'"):
        llm.configure(m, "balanced", windw=3)
    with pytest.raises(RuntimeError, match="llama_kvcomp_configure failed"):
        llm.configure(m, "balanced", window=-1)
    m.close()


def test_mode_switch_and_snapshot(model: Path) -> None:
    m = llm.open_llama(model, "balanced", n_ctx=1024, kstats="none")  # kvc4 K: the tracker measures its error
    first = m(PROMPT, max_tokens=24, temperature=0.0)
    assert 0 < first["usage"]["completion_tokens"] <= 24  # type: ignore[index]
    snap = llm.snapshot(m)
    assert snap["mode"] == "balanced" and len(snap["layers"]) == 30
    heads = [h for layer in snap["layers"] for h in layer["heads"]]
    assert len(heads) == 90 and all(0.0 < h["k_rmse_rel"] < 0.2 for h in heads)
    assert snap["buffer"]["used"] == llm.stats(m)["n_used"]

    llm.set_mode(m, "high-precision")
    assert llm.get_config(m).window == mode_preset("high-precision").window
    again = m(" After that,", max_tokens=8, temperature=0.0)
    assert 0 < again["usage"]["completion_tokens"] <= 8  # type: ignore[index]
    assert llm.snapshot(m)["mode"] == "high-precision"
    assert math.isfinite(llm.snapshot(m)["buffer"]["fill"])
    m.close()


@pytest.mark.parametrize("knobs", [{"sinks": 1, "window": 0}, {"window": 4}, {"window": 8, "sinks": 2}])
def test_f16_cache_is_exact_with_any_buffer(model: Path, knobs: dict[str, float]) -> None:
    """An f16 cache of 128 positions, a 7-token prompt through Llama.eval and then one token
    per step; nothing is quantized, so every buffer setting must give the plain cache's
    logits exactly."""
    def run(buffered: bool) -> np.ndarray:
        m = llm.new_llama(model, "f16", "f16", n_ctx=128)
        if buffered:
            llm.configure(m, "balanced", tracker=1, **knobs)
        toks = m.tokenize(PROMPT.encode())
        m.eval(toks[:7])
        rows = [np.array(m.scores[m.n_tokens - 1])]
        for t in toks[7:30]:
            m.eval([t])
            rows.append(np.array(m.scores[m.n_tokens - 1]))
        m.close()
        return np.stack(rows)

    assert np.array_equal(run(True), run(False))


def test_cut_back_keeps_exact_rows(model: Path) -> None:
    m = llm.open_llama(model, "balanced", n_ctx=1024)
    toks = m.tokenize(PROMPT.encode())
    m.eval(toks)
    n = m.n_tokens
    for _ in range(16):
        m.eval([int(np.argmax(m.scores[m.n_tokens - 1]))])
    # a short generation leaves the window's rows in spare slots
    assert llm.seq_rm_exact(m, 0, n - 1)
    assert llm.seq_rm_exact(m, 0, 0)
    m.close()


@pytest.mark.parametrize("keep_prompt", [True, False])
def test_keep_prompt_holds_the_prompt_through_a_generation(model: Path, keep_prompt: bool) -> None:
    # 80 generated tokens move balanced's window (56) and merge interval (8) past the prompt's
    m = llm.open_llama(model, "balanced", n_ctx=1024, keep_prompt=int(keep_prompt))
    toks = m.tokenize(PROMPT.encode())
    m.eval(toks)
    n = m.n_tokens
    first = np.array(m.scores[n - 1], dtype=np.float32)
    for _ in range(80):
        m.eval([int(np.argmax(m.scores[m.n_tokens - 1]))])
    assert llm.seq_rm_exact(m, 0, n - 1) == keep_prompt
    if keep_prompt:
        # the prompt reused: its last token decoded again reads what its first run read
        llama_cpp = llm.import_llama_cpp()
        assert llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(m.ctx), 0, n - 1, -1)
        m.n_tokens = n - 1
        m.eval(toks[-1:])
        assert np.array_equal(np.array(m.scores[n - 1], dtype=np.float32), first)
    m.close()


def _next_logits(m: Any) -> np.ndarray[Any, np.dtype[np.float32]]:
    m.eval(m.tokenize(b" the keeper", add_bos=False))
    return np.array(m.scores[m.n_tokens - 1], dtype=np.float32)


def test_damaged_state_raises_with_the_reason(model: Path, tmp_path: Path) -> None:
    # Llama.save_state/load_state (host buffers) and a session file: a changed byte is refused
    # with the library's reason and leaves the cache empty; the intact state goes on exactly
    m = llm.open_llama(model, "balanced", n_ctx=512)
    m.eval(m.tokenize(PROMPT.encode()))
    state = m.save_state()
    ref = _next_logits(m)

    llama_cpp = llm.import_llama_cpp()
    raw = bytearray(state.llama_state)
    raw[len(raw) // 2] ^= 0x04
    bad = llama_cpp.LlamaState(input_ids=state.input_ids, scores=state.scores, n_tokens=state.n_tokens,
                               llama_state=bytes(raw), llama_state_size=state.llama_state_size, seed=state.seed)
    with pytest.raises(llm.StateError, match="checksum mismatch"):
        llm.load_state(m, bad)
    assert llama_cpp.llama_memory_seq_pos_max(llama_cpp.llama_get_memory(m.ctx), 0) == -1

    llm.load_state(m, state)
    assert np.array_equal(_next_logits(m), ref)

    llm.load_state(m, state)
    path = tmp_path / "session.bin"
    toks = (llama_cpp.llama_token * state.n_tokens)(*state.input_ids[: state.n_tokens].tolist())
    assert llama_cpp.llama_state_save_file(m.ctx, str(path).encode(), toks, state.n_tokens)
    assert llm.load_session_file(m, path) == list(state.input_ids[: state.n_tokens])
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(data[: len(data) - 100]))
    with pytest.raises(llm.StateError, match="no seal"):
        llm.load_session_file(m, path)
    m.close()
