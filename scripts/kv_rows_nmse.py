#!/usr/bin/env python3
"""Round-trip error of every KV type on dumped K/V rows, with and without the token mean.

Input: float32 files of rows in write order, one file for K and one for V, from a
llama-perplexity run with one 512-token ubatch per chunk and one thread, so that row r
belongs to layer (r // 512) % n_layer. docs/kv-rows.md says how the rows were dumped.

    python3 scripts/kv_rows_nmse.py /tmp/k.bin /tmp/v.bin --layers 30 --width 192
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import numpy as np

from ggml_kvcomp.paths import bin_dir

TYPE_IDS = {"q8_0": 8, "q4_0": 2, "iq4_nl": 20, "kvc8": 43, "kvc4": 44, "kvc3": 45, "kvc2": 46}
ROW_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


class TypeTraits(ctypes.Structure):
    # struct ggml_type_traits, ggml.h
    _fields_ = [
        ("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


def round_trip(lib: ctypes.CDLL, name: str, x: np.ndarray) -> np.ndarray:
    tt = lib.ggml_get_type_traits(TYPE_IDS[name]).contents
    assert tt.type_name.decode() == name, "type ids out of sync with ggml.h"
    rows = np.ascontiguousarray(x, dtype=np.float32)
    buf = ctypes.create_string_buffer(rows.size // tt.blck_size * tt.type_size)
    out = np.empty_like(rows)
    ROW_FN(tt.from_float_ref)(rows.ctypes.data, buf, rows.size)
    ROW_FN(tt.to_float)(buf, out.ctypes.data, rows.size)
    return out


def nmse(a: np.ndarray, ref: np.ndarray) -> float:
    return float(((a - ref) ** 2).sum() / (ref**2).sum())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("k", type=Path)
    p.add_argument("v", type=Path)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--width", type=int, default=192, help="values per row (n_embd_k_gqa)")
    p.add_argument("--tokens", type=int, default=512)
    args = p.parse_args()

    lib = ctypes.CDLL(str(bin_dir() / "libggml-base.so"))
    lib.ggml_get_type_traits.restype = ctypes.POINTER(TypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]

    print("| rows | type | NMSE | NMSE, token mean removed |")
    print("|---|---|---:|---:|")
    for label, path in (("K", args.k), ("V", args.v)):
        x = np.fromfile(path, dtype=np.float32)[: args.layers * args.tokens * args.width]
        x = x.reshape(args.layers, args.tokens, args.width)
        mean = x.mean(axis=1, keepdims=True)
        share = float((mean**2).sum() * args.tokens / (x**2).sum())
        for t in TYPE_IDS:
            plain = nmse(round_trip(lib, t, x), x)
            centred = nmse(round_trip(lib, t, x - mean) + mean, x)
            print(f"| {label} (mean = {share:.0%} of energy) | {t} | {plain:.5f} | {centred:.5f} |")


if __name__ == "__main__":
    main()
