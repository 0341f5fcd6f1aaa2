"""llama-cpp-python on the kvcomp build: a Llama with a mode, its configuration, run-time mode
switches and the monitor's snapshot (python/README.md).

llama_cpp (llama-cpp-python's package, which the wheel carries) loads the libraries of
paths.bin_dir(), so one patched tree serves the tools and Python.
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .capi import (
    LLAMA_KVCOMP_FORMAT_JSON,
    LLAMA_KVCOMP_FORMAT_PROMETHEUS,
    KLayersName,
    LlamaKvcompParams,
    LlamaKvcompStats,
    ModeName,
    ModePreset,
    get_k_layers,
    last_error,
    lib,
    load_layers,
    mode_id,
    mode_name,
    mode_preset,
    set_k_layers,
    type_id,
    type_name,
)
from .kvtypes import KVCT_TYPES
from .paths import NO_BUILD, bin_dir

if TYPE_CHECKING:
    import llama_cpp

__all__ = [
    "Config", "StateError", "configure", "get_config", "import_llama_cpp", "k_stats_source", "load_session_file",
    "load_state", "new_llama", "open_llama", "set_k_stats", "set_mode", "snapshot", "snapshot_text", "stats", "type_id",
    "type_name",
]


class StateError(RuntimeError):
    """A saved state the library refused (damaged, another model or cache, rows out of range)."""



def import_llama_cpp() -> Any:
    """llama_cpp, bound to the kvcomp build's libllama (importing ggml_kvcomp pointed it there)."""
    want = bin_dir()
    if not (want / "libllama.so").exists():
        raise FileNotFoundError(f"{want}/libllama.so not found: {NO_BUILD}")
    import llama_cpp

    loaded = Path(llama_cpp.llama_cpp._lib._name).resolve()
    if loaded != (want / "libllama.so").resolve():
        raise RuntimeError(f"llama_cpp loaded {loaded}, not {want}/libllama.so: import ggml_kvcomp before "
                           "llama_cpp, or set KVCOMP_BIN_DIR to the folder llama_cpp loads from")
    return llama_cpp


# what a context runs with, read back through the C API
Config = ModePreset


def _ctx(llm: llama_cpp.Llama) -> int:
    ctx = llm.ctx
    if ctx is None:
        raise ValueError("the Llama has no context")
    return int(ctypes.cast(ctx, ctypes.c_void_p).value or 0)


def new_llama(model: str | Path, type_k: str, type_v: str, *, n_ctx: int = 2048, n_threads: int = 2) -> llama_cpp.Llama:
    """A llama_cpp.Llama with these K/V cache types and flash attention (which quantized V
    and the residual buffer need), nothing configured yet."""
    lc = import_llama_cpp()
    llm: llama_cpp.Llama = lc.Llama(str(model), n_ctx=n_ctx, n_threads=n_threads, n_threads_batch=n_threads,
                                    flash_attn=True, type_k=type_id(type_k), type_v=type_id(type_v), verbose=False)
    return llm


def open_llama(model: str | Path, mode: ModeName = "balanced", *, n_ctx: int = 2048, n_threads: int = 2,
               kstats: str | Path | None = "auto", k_layers: KLayersName | None = None,
               layers: str | Path | None = None, **knobs: float) -> llama_cpp.Llama:
    """A llama_cpp.Llama whose KV cache runs `mode`: its K/V types, flash attention, and its
    knobs, of which `knobs` (window, sinks, merge_interval, merge_at, pin_threshold,
    pin_budget, tracker) override single ones; keep_prompt=1 (not part of a mode) keeps the
    exact rows a prompt's last token read through the generation that follows (a window more
    of buffer), so that prompt reused after it, its last token decoded again, finds them
    (without, seq_rm_exact says the prompt must be decoded again). K takes the mode's type for the model's K
    statistics (kvct4 for low-latency and balanced) and the mode's per-layer K rule (balanced:
    "edges"), or `k_layers`. The statistics are `kstats`: "auto" (measured by the library on
    first use of the model and cached, as the tools do), a file from `kvcomp calibrate`, or
    "none"/None (the mode's plain K type). `layers`, a profile from `kvcomp calibrate
    --layers`, replaces the rule (both are read when the context is made, and hold for this
    context only)."""
    preset = mode_preset(mode)
    with_stats = kstats is not None and str(kstats) != "none"
    type_k = preset.type_k_stats if with_stats else preset.type_k
    rule: KLayersName = k_layers or (preset.k_layers if with_stats else "same")  # type: ignore[assignment]
    # the rule is process-wide and read when the context is made: set for this one only
    before = get_k_layers()
    set_k_layers(rule)
    try:
        if layers is not None:
            load_layers(layers)
        llm = new_llama(model, type_k, preset.type_v, n_ctx=n_ctx, n_threads=n_threads)
    finally:
        set_k_layers(before)
        if layers is not None:
            load_layers(None)
    if with_stats and type_k in KVCT_TYPES:
        set_k_stats(llm, kstats)  # type: ignore[arg-type]
    configure(llm, mode, **knobs)
    return llm


def set_k_stats(llm: llama_cpp.Llama, path: str | Path) -> None:
    """Loads the model's K statistics into an open Llama whose K cache is kvct4/kvct3 (before
    its first token; another K type ignores them): a file, or "auto" for the ones the library
    measures itself (cached per model)."""
    c = lib()
    auto = str(path) == "auto"
    if auto:
        rc = c.llama_kvcomp_set_k_stats_auto(_ctx(llm), None, None, None)
    else:
        rc = c.llama_kvcomp_set_k_stats(_ctx(llm), str(path).encode())
    if rc != 0:
        name = "llama_kvcomp_set_k_stats_auto" if auto else "llama_kvcomp_set_k_stats"
        raise RuntimeError(f"{name} failed ({rc}): {last_error() or 'see the log'}")


def k_stats_source() -> str:
    """Where the K statistics this thread last applied came from (a file, the cache, a fresh
    measuring run), in words."""
    src: bytes | None = lib().llama_kvcomp_k_stats_source()
    return src.decode() if src else ""


def configure(llm: llama_cpp.Llama, mode: ModeName, **knobs: float) -> None:
    """Applies a mode's knobs (and overrides, keep_prompt among them) to an open Llama; its
    K/V types stay."""
    p = LlamaKvcompParams()
    c = lib()
    if c.llama_kvcomp_mode_preset(mode_id(mode), ctypes.byref(p), None, None) != 0:
        raise ValueError(f"unknown mode {mode!r}")
    fields = {f[0] for f in LlamaKvcompParams._fields_} - {"mode"}
    for k, v in knobs.items():
        if k not in fields:
            raise ValueError(f"unknown knob {k!r}; known: {', '.join(sorted(fields))}")
        setattr(p, k, v)
    if set(knobs) - {"keep_prompt"}:
        # the preset no longer holds as is
        p.mode = c.llama_kvcomp_mode_from_name(b"custom")
    rc = c.llama_kvcomp_configure(_ctx(llm), ctypes.byref(p))
    if rc != 0:
        raise RuntimeError(f"llama_kvcomp_configure failed ({rc}): {last_error() or 'see the log'}")


def get_config(llm: llama_cpp.Llama) -> Config:
    p = LlamaKvcompParams()
    c = lib()
    tk, tv = ctypes.c_int(), ctypes.c_int()
    if c.llama_kvcomp_get_config(_ctx(llm), ctypes.byref(p)) != 0 or \
            c.llama_kvcomp_get_cache_types(_ctx(llm), ctypes.byref(tk), ctypes.byref(tv)) != 0:
        raise RuntimeError("the context has no KV cache to read")
    return Config(mode=mode_name(p.mode), type_k=type_name(tk.value), type_v=type_name(tv.value), window=p.window,
                  sinks=p.sinks, merge_interval=p.merge_interval, pin_threshold=round(p.pin_threshold, 6),
                  pin_budget=round(p.pin_budget, 6), tracker=bool(p.tracker))


def set_mode(llm: llama_cpp.Llama, mode: ModeName) -> None:
    """Switches the mode at run time: new tokens follow it (logged by the library)."""
    rc = lib().llama_kvcomp_set_mode(_ctx(llm), mode_id(mode))
    if rc != 0:
        raise RuntimeError(f"llama_kvcomp_set_mode failed ({rc}): {last_error() or 'see the log'}")


def load_state(llm: llama_cpp.Llama, state: llama_cpp.LlamaState) -> None:
    """Llama.load_state, raising StateError with the library's reason when the state is refused
    (docs/state.md). Llama.load_state has taken the state's tokens before the library refuses
    it, so a refused state leaves the Llama reset and its cache empty, the two in agreement."""
    try:
        llm.load_state(state)
    except RuntimeError:
        why = last_error() or "the state was refused (see the log)"
        llama_cpp = import_llama_cpp()
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(llm.ctx), True)
        llm.reset()  # type: ignore[no-untyped-call]
        raise StateError(why) from None


def load_session_file(llm: llama_cpp.Llama, path: str | Path) -> list[int]:
    """Restores a file written by llama_state_save_file (a whole context) and returns its tokens;
    StateError with the reason when it is refused."""
    llama_cpp = import_llama_cpp()
    cap = llm.n_ctx()
    tokens = (llama_cpp.llama_token * cap)()
    n = ctypes.c_size_t(0)
    if not llama_cpp.llama_state_load_file(llm.ctx, str(path).encode(), tokens, cap, ctypes.byref(n)):
        raise StateError(last_error() or "the state file was refused (see the log)")
    return list(tokens[: n.value])


def stats(llm: llama_cpp.Llama) -> dict[str, float]:
    """The residual buffer's counters (empty without a buffer)."""
    st = LlamaKvcompStats()
    if lib().llama_kvcomp_get_stats(_ctx(llm), ctypes.byref(st)) != 0:
        return {}
    return {f[0]: getattr(st, f[0]) for f in LlamaKvcompStats._fields_}


def seq_rm_exact(llm: llama_cpp.Llama, seq_id: int, p0: int, p1: int = -1) -> bool:
    """Whether removing positions [p0, p1) of seq_id keeps the exact rows that its next token
    sees exactly. When it does not, a result that must match a fresh run clears the sequence
    and decodes it again (llama_cpp.Llama.reset() before the next eval)."""
    rc = lib().llama_kvcomp_seq_rm_exact(_ctx(llm), seq_id, p0, p1)
    if rc < 0:
        raise RuntimeError("llama_kvcomp_seq_rm_exact: no context")
    return bool(rc)


def snapshot_text(llm: llama_cpp.Llama, prometheus: bool = False, refresh: bool = True) -> str:
    """The monitor's snapshot (docs/monitoring.md) as JSON or Prometheus text, as llama-server
    serves it at /kvcomp."""
    c = lib()
    if refresh and c.llama_kvcomp_monitor_refresh(_ctx(llm)) != 0:
        raise RuntimeError("the context has no kvcomp monitor (open it with open_llama)")
    fmt = LLAMA_KVCOMP_FORMAT_PROMETHEUS if prometheus else LLAMA_KVCOMP_FORMAT_JSON
    n = c.llama_kvcomp_snapshot_text(_ctx(llm), fmt, -1, None, 0)
    if n < 0:
        raise RuntimeError("the context has no kvcomp monitor")
    buf = ctypes.create_string_buffer(n + 1)
    c.llama_kvcomp_snapshot_text(_ctx(llm), fmt, -1, buf, n + 1)
    return str(buf.value.decode())


def snapshot(llm: llama_cpp.Llama, refresh: bool = True) -> dict[str, Any]:
    """The snapshot as a dict (see snapshot_text)."""
    result: dict[str, Any] = json.loads(snapshot_text(llm, refresh=refresh))
    return result
