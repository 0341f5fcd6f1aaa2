"""ctypes bindings of our C API (cpp/llama-kvcomp/llama-kvcomp.h) in the built libllama."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from typing import Literal, get_args

from .paths import bin_dir

ModeName = Literal["off", "low-latency", "balanced", "high-precision"]
MODE_NAMES: tuple[str, ...] = get_args(ModeName)


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
    ]


@dataclass(frozen=True)
class ModePreset:
    """One row of the C++ mode table."""

    mode: ModeName
    type_k: str
    type_v: str
    window: int
    sinks: int
    merge_interval: int
    pin_threshold: float
    pin_budget: float
    tracker: bool


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
    # const char * ggml_type_name(enum ggml_type type);
    base.ggml_type_name.argtypes = [ctypes.c_int]
    base.ggml_type_name.restype = ctypes.c_char_p
    return base, llama


def mode_preset(mode: ModeName) -> ModePreset:
    """The preset of a mode, read from the built library's table."""
    if mode not in MODE_NAMES:
        raise ValueError(f"unknown mode {mode!r}; known: {', '.join(MODE_NAMES)}")
    base, llama = _libs()
    m = llama.llama_kvcomp_mode_from_name(mode.encode())
    p = LlamaKvcompParams()
    tk, tv = ctypes.c_int(), ctypes.c_int()
    if m < 0 or llama.llama_kvcomp_mode_preset(m, ctypes.byref(p), ctypes.byref(tk), ctypes.byref(tv)) != 0:
        raise RuntimeError(f"the built library does not know mode {mode!r}")
    return ModePreset(
        mode=mode, type_k=base.ggml_type_name(tk.value).decode(), type_v=base.ggml_type_name(tv.value).decode(),
        window=p.window, sinks=p.sinks, merge_interval=p.merge_interval, pin_threshold=round(p.pin_threshold, 6),
        pin_budget=round(p.pin_budget, 6), tracker=bool(p.tracker))
