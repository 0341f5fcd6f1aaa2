"""ctypes bindings of our C API (cpp/llama-kvcomp/llama-kvcomp.h) in the built libllama."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Literal, get_args

from .paths import bin_dir

ModeName = Literal["off", "low-latency", "balanced", "high-precision"]
MODE_NAMES: tuple[str, ...] = get_args(ModeName)
# per-layer K rules (enum llama_kvcomp_k_layers), in its order
KLayersName = Literal["same", "edges"]
K_LAYERS_NAMES: tuple[str, ...] = get_args(KLayersName)


class LlamaKvcompParams(ctypes.Structure):
    """struct llama_kvcomp_params"""

    _fields_ = [
        ("mode", ctypes.c_int32),
        ("window", ctypes.c_int32),
        ("sinks", ctypes.c_int32),
        ("merge_interval", ctypes.c_int32),
        ("merge_at", ctypes.c_float),
        ("pin_threshold", ctypes.c_float),
        ("pin_budget", ctypes.c_float),
        ("tracker", ctypes.c_int32),
        ("ema_shallow", ctypes.c_float),
        ("ema_deep", ctypes.c_float),
        ("keep_prompt", ctypes.c_int32),
    ]


class LlamaKvcompMonitorParams(ctypes.Structure):
    """struct llama_kvcomp_monitor_params"""

    _fields_ = [
        ("enabled", ctypes.c_int32),
        ("ppl_window", ctypes.c_int32),
        ("degrade_ratio", ctypes.c_float),
        ("degrade_windows", ctypes.c_int32),
        ("baseline_ppl", ctypes.c_float),
        ("fill_warn", ctypes.c_float),
        ("l2_jump", ctypes.c_float),
        ("refresh", ctypes.c_int32),
    ]


class LlamaKvcompStats(ctypes.Structure):
    """struct llama_kvcomp_stats"""

    _fields_ = [
        ("n_slots", ctypes.c_int32),
        ("n_used", ctypes.c_int32),
        ("n_pinned", ctypes.c_int32),
        ("n_pin_budget", ctypes.c_int32),
        ("n_merges", ctypes.c_int64),
        ("n_released", ctypes.c_int64),
        ("n_overflow", ctypes.c_int64),
        ("pin_err_min", ctypes.c_float),
        ("evicted_err_max", ctypes.c_float),
    ]


LLAMA_KVCOMP_FORMAT_JSON = 0
LLAMA_KVCOMP_FORMAT_PROMETHEUS = 1


@dataclass(frozen=True)
class ModePreset:
    """One row of the C++ mode table, or what a context runs with (mode "custom" when its
    knobs were set one by one)."""

    mode: str
    type_k: str
    type_v: str
    window: int
    sinks: int
    merge_interval: int
    pin_threshold: float
    pin_budget: float
    tracker: bool
    type_k_stats: str = ""  # K when the model's K statistics are loaded ("" for a running context)
    k_layers: str = "same"  # the per-layer K rule with them (K_LAYERS_NAMES)


@cache
def _libs() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    base = ctypes.CDLL(str(bin_dir() / "libggml-base.so"))
    llama = ctypes.CDLL(str(bin_dir() / "libllama.so"))
    # int32_t llama_kvcomp_mode_from_name(const char * name);
    llama.llama_kvcomp_mode_from_name.argtypes = [ctypes.c_char_p]
    llama.llama_kvcomp_mode_from_name.restype = ctypes.c_int32
    # int32_t llama_kvcomp_mode_preset(int32_t mode, struct llama_kvcomp_params * params,
    #                                  enum ggml_type * type_k, enum ggml_type * type_v);
    llama.llama_kvcomp_mode_preset.argtypes = [
        ctypes.c_int32, ctypes.POINTER(LlamaKvcompParams), ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
    llama.llama_kvcomp_mode_preset.restype = ctypes.c_int32
    # int32_t llama_kvcomp_set_k_stats(struct llama_context * ctx, const char * path);
    llama.llama_kvcomp_set_k_stats.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    llama.llama_kvcomp_set_k_stats.restype = ctypes.c_int32
    # int32_t llama_kvcomp_set_k_stats_auto(struct llama_context * ctx, const char * cache_dir,
    #                                       llama_progress_callback progress, void * user_data);
    llama.llama_kvcomp_set_k_stats_auto.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p]
    llama.llama_kvcomp_set_k_stats_auto.restype = ctypes.c_int32
    # const char * llama_kvcomp_k_stats_source(void);
    llama.llama_kvcomp_k_stats_source.argtypes = []
    llama.llama_kvcomp_k_stats_source.restype = ctypes.c_char_p
    # int32_t llama_kvcomp_mode_type_k_stats(int32_t mode);
    llama.llama_kvcomp_mode_type_k_stats.argtypes = [ctypes.c_int32]
    llama.llama_kvcomp_mode_type_k_stats.restype = ctypes.c_int32
    # int32_t llama_kvcomp_mode_k_layers(int32_t mode);
    llama.llama_kvcomp_mode_k_layers.argtypes = [ctypes.c_int32]
    llama.llama_kvcomp_mode_k_layers.restype = ctypes.c_int32
    # int32_t llama_kvcomp_set_k_layers(int32_t rule); int32_t llama_kvcomp_get_k_layers(void);
    llama.llama_kvcomp_set_k_layers.argtypes = [ctypes.c_int32]
    llama.llama_kvcomp_set_k_layers.restype = ctypes.c_int32
    llama.llama_kvcomp_get_k_layers.argtypes = []
    llama.llama_kvcomp_get_k_layers.restype = ctypes.c_int32
    # enum ggml_type llama_kvcomp_layer_type_k(int32_t rule, int32_t il, int32_t n_layer, enum ggml_type type_k);
    llama.llama_kvcomp_layer_type_k.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, ctypes.c_int]
    llama.llama_kvcomp_layer_type_k.restype = ctypes.c_int
    # int32_t llama_kvcomp_load_layers(const char * path);
    llama.llama_kvcomp_load_layers.argtypes = [ctypes.c_char_p]
    llama.llama_kvcomp_load_layers.restype = ctypes.c_int32
    # const char * ggml_type_name(enum ggml_type type);
    base.ggml_type_name.argtypes = [ctypes.c_int]
    base.ggml_type_name.restype = ctypes.c_char_p
    # int32_t llama_kvcomp_type_from_name(const char * name);
    llama.llama_kvcomp_type_from_name.argtypes = [ctypes.c_char_p]
    llama.llama_kvcomp_type_from_name.restype = ctypes.c_int32
    # int32_t llama_kvcomp_configure(struct llama_context * ctx, const struct llama_kvcomp_params * params);
    llama.llama_kvcomp_configure.argtypes = [ctypes.c_void_p, ctypes.POINTER(LlamaKvcompParams)]
    llama.llama_kvcomp_configure.restype = ctypes.c_int32
    # int32_t llama_kvcomp_get_config(struct llama_context * ctx, struct llama_kvcomp_params * params);
    llama.llama_kvcomp_get_config.argtypes = [ctypes.c_void_p, ctypes.POINTER(LlamaKvcompParams)]
    llama.llama_kvcomp_get_config.restype = ctypes.c_int32
    # int32_t llama_kvcomp_set_mode(struct llama_context * ctx, int32_t mode);
    llama.llama_kvcomp_set_mode.argtypes = [ctypes.c_void_p, ctypes.c_int32]
    llama.llama_kvcomp_set_mode.restype = ctypes.c_int32
    # const char * llama_kvcomp_mode_name(int32_t mode);
    llama.llama_kvcomp_mode_name.argtypes = [ctypes.c_int32]
    llama.llama_kvcomp_mode_name.restype = ctypes.c_char_p
    # int32_t llama_kvcomp_get_cache_types(struct llama_context * ctx,
    #                                      enum ggml_type * type_k, enum ggml_type * type_v);
    llama.llama_kvcomp_get_cache_types.argtypes = [
        ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
    llama.llama_kvcomp_get_cache_types.restype = ctypes.c_int32
    # int32_t llama_kvcomp_get_stats(struct llama_context * ctx, struct llama_kvcomp_stats * stats);
    llama.llama_kvcomp_get_stats.argtypes = [ctypes.c_void_p, ctypes.POINTER(LlamaKvcompStats)]
    llama.llama_kvcomp_get_stats.restype = ctypes.c_int32
    # int32_t llama_kvcomp_seq_rm_exact(struct llama_context * ctx, llama_seq_id seq_id, llama_pos p0, llama_pos p1);
    llama.llama_kvcomp_seq_rm_exact.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32]
    llama.llama_kvcomp_seq_rm_exact.restype = ctypes.c_int32
    # int32_t llama_kvcomp_set_monitor(struct llama_context * ctx, const struct llama_kvcomp_monitor_params * params);
    llama.llama_kvcomp_set_monitor.argtypes = [ctypes.c_void_p, ctypes.POINTER(LlamaKvcompMonitorParams)]
    llama.llama_kvcomp_set_monitor.restype = ctypes.c_int32
    # struct llama_kvcomp_monitor_params llama_kvcomp_monitor_default_params(void);
    llama.llama_kvcomp_monitor_default_params.argtypes = []
    llama.llama_kvcomp_monitor_default_params.restype = LlamaKvcompMonitorParams
    # int32_t llama_kvcomp_monitor_refresh(struct llama_context * ctx);
    llama.llama_kvcomp_monitor_refresh.argtypes = [ctypes.c_void_p]
    llama.llama_kvcomp_monitor_refresh.restype = ctypes.c_int32
    # int32_t llama_kvcomp_observe(struct llama_context * ctx, llama_seq_id seq_id, int32_t i, llama_token token);
    llama.llama_kvcomp_observe.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32]
    llama.llama_kvcomp_observe.restype = ctypes.c_int32
    # int64_t llama_kvcomp_snapshot_text(struct llama_context * ctx, int32_t format, int32_t layer,
    #                                    char * buf, size_t size);
    llama.llama_kvcomp_snapshot_text.argtypes = [
        ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_char_p, ctypes.c_size_t]
    llama.llama_kvcomp_snapshot_text.restype = ctypes.c_int64
    # const char * llama_kvcomp_last_error(void);
    llama.llama_kvcomp_last_error.argtypes = []
    llama.llama_kvcomp_last_error.restype = ctypes.c_char_p
    return base, llama


def last_error() -> str | None:
    """Why the last failed state load, llama_kvcomp_configure or set_mode on this thread failed."""
    why: bytes | None = _libs()[1].llama_kvcomp_last_error()
    return why.decode() if why else None


def type_id(name: str) -> int:
    """The ggml_type id of a tensor type name ('kvc4', 'q8_0', 'f16', ...), for
    llama_cpp.Llama(type_k=..., type_v=...)."""
    t = int(_libs()[1].llama_kvcomp_type_from_name(name.encode()))
    if t < 0:
        raise ValueError(f"unknown tensor type {name!r}")
    return t


def type_name(type_id: int) -> str:
    base, _ = _libs()
    return str(base.ggml_type_name(type_id).decode())


def mode_id(mode: ModeName) -> int:
    if mode not in MODE_NAMES:
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODE_NAMES)}")
    _, llama = _libs()
    return int(llama.llama_kvcomp_mode_from_name(mode.encode()))


def mode_name(mode: int) -> str:
    _, llama = _libs()
    name = llama.llama_kvcomp_mode_name(mode)
    if name is None:
        raise ValueError(f"unknown mode id {mode}")
    return str(name.decode())


def lib() -> ctypes.CDLL:
    """The built libllama with our functions typed."""
    return _libs()[1]


def mode_preset(mode: ModeName) -> ModePreset:
    """The preset of a mode, read from the built library's table."""
    m = mode_id(mode)
    p = LlamaKvcompParams()
    tk, tv = ctypes.c_int(), ctypes.c_int()
    if m < 0 or lib().llama_kvcomp_mode_preset(m, ctypes.byref(p), ctypes.byref(tk), ctypes.byref(tv)) != 0:
        raise RuntimeError(f"the built library does not know mode {mode!r}")
    return ModePreset(
        mode=mode, type_k=type_name(tk.value), type_v=type_name(tv.value),
        window=p.window, sinks=p.sinks, merge_interval=p.merge_interval, pin_threshold=round(p.pin_threshold, 6),
        pin_budget=round(p.pin_budget, 6), tracker=bool(p.tracker),
        type_k_stats=type_name(lib().llama_kvcomp_mode_type_k_stats(m)),
        k_layers=K_LAYERS_NAMES[lib().llama_kvcomp_mode_k_layers(m)])


def set_k_layers(rule: KLayersName) -> None:
    """Sets the per-layer K rule of the contexts created from now on (process-wide)."""
    if rule not in K_LAYERS_NAMES or lib().llama_kvcomp_set_k_layers(K_LAYERS_NAMES.index(rule)) != 0:
        raise ValueError(f"unknown per-layer K rule {rule!r}; known: {', '.join(K_LAYERS_NAMES)}")


def get_k_layers() -> KLayersName:
    """The per-layer K rule that a context created now gets."""
    name: KLayersName = K_LAYERS_NAMES[lib().llama_kvcomp_get_k_layers()]
    return name


def load_layers(path: str | Path | None) -> None:
    """Loads a per-layer profile for the contexts created from now on (process-wide; None
    unloads it); ValueError with the library's reason for a bad file."""
    if lib().llama_kvcomp_load_layers(None if path is None else str(path).encode()) != 0:
        raise ValueError(last_error() or f"cannot load the layer profile {path}")


def layer_types_k(rule: KLayersName, n_layer: int, type_k: str) -> list[str]:
    """The K type of each of n_layer layers under rule in a context whose K type is type_k."""
    r = K_LAYERS_NAMES.index(rule)
    return [type_name(lib().llama_kvcomp_layer_type_k(r, il, n_layer, type_id(type_k))) for il in range(n_layer)]
