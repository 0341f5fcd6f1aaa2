#!/usr/bin/env python3
"""A transform coder of real K rows against kvc4, at equal bits (a prototype of the kvct
format).

Input: the dump of `llama-kvcomp-rows` (PREFIX.json and PREFIX.{kpost,qpost}.f32). Per
layer and KV head, the first `--calib` rows fix what the format keeps per layer (as the
tracker fixes its offset on the rows in the cache at that moment): the mean c, the basis T
(the eigenvectors of K's covariance) and an integer bit count per coefficient (greedy
allocation of the weighted distortion, each coefficient's variance times the queries'
weight on it). Every later row is coded as y = T(k - c), one 8-bit scale per row (the RMS
of y against the calibration's), each coefficient by a Lloyd-Max quantizer for a unit
Gaussian at its bit count. kvc4 is the real quantizer (libggml-base's reference) on the rows
after upstream's Hadamard rotation. The error that matters is the queries' view of it,
E[(q.e)^2] over the same later rows; the table gives kvc4's over the coder's (geometric mean
/ min / max over KV heads) and plain K error ratios.

    python3 scripts/kv_transform_proto.py /tmp/rows/smollm2 --bpe 4.5 3.5 --calib 512

With `--kstats FILE --reference --space pre-pairs` the plans are the shipped ones: fitted by
the C reference to a `kvcomp calibrate` file instead of the first rows.
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json
import math
from functools import cache
from pathlib import Path
from statistics import NormalDist
from typing import NamedTuple

import numpy as np
from kv_rows_gain import load, pre_rope_weight, rope_cos_sin, rope_pairs, summary

from ggml_kvcomp.paths import bin_dir
from ggml_kvcomp.synth import gguf_module

SCALE_BITS = 8
MAX_BITS = 8


@cache
def lloyd_max(bits: int) -> tuple[np.ndarray, float]:
    """Levels of the MSE-optimal quantizer of a unit Gaussian at `bits` and its distortion:
    Lloyd's iteration on a fine grid, from the high-rate optimum (the quantiles of a Gaussian
    of variance 3), kept symmetric, until the levels move less than 1e-8."""
    if bits == 0:
        return np.zeros(1), 1.0
    x = np.linspace(-10.0, 10.0, 200001)
    p = np.exp(-0.5 * x * x)
    p /= p.sum()
    n = 1 << bits
    inv = NormalDist(0.0, math.sqrt(3.0)).inv_cdf
    levels = np.array([inv((i + 0.5) / n) for i in range(n)])
    for _ in range(20000):
        edges = 0.5 * (levels[1:] + levels[:-1])
        cell = np.searchsorted(edges, x)
        new = np.bincount(cell, p * x, n) / np.maximum(np.bincount(cell, p, n), 1e-300)
        new = 0.5 * (new - new[::-1])
        done = float(np.abs(new - levels).max()) < 1e-8
        levels = new
        if done:
            break
    edges = 0.5 * (levels[1:] + levels[:-1])
    dist = float((p * (x - levels[np.searchsorted(edges, x)]) ** 2).sum())
    return levels, dist


def quantize(y: np.ndarray, bits: int) -> np.ndarray:
    levels, _ = lloyd_max(bits)
    if bits == 0:
        return np.zeros_like(y)
    out: np.ndarray = levels[np.searchsorted(0.5 * (levels[1:] + levels[:-1]), y)]
    return out


def allocate(weighted_var: np.ndarray, total_bits: int) -> np.ndarray:
    """Integer bits per coefficient, greedy on the largest drop of weighted distortion."""
    bits = np.zeros(len(weighted_var), dtype=int)
    dist = np.array([lloyd_max(b)[1] for b in range(MAX_BITS + 1)])
    for _ in range(total_bits):
        gain = np.where(bits < MAX_BITS, weighted_var * (dist[bits] - dist[np.minimum(bits + 1, MAX_BITS)]), -1.0)
        bits[int(np.argmax(gain))] += 1
    return bits


@cache
def ggml_base() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(bin_dir() / "libggml-base.so"))
    for name in ("quantize_row_kvc4_ref", "dequantize_row_kvc4"):
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.kvc_t_plan_fit.restype = ctypes.c_bool
    lib.kvc_t_plan_fit.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int32]
    for name in ("quantize_row_kvct_ref", "dequantize_row_kvct"):
        getattr(lib, name).restype = None
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def kvc4_round_trip(rows: np.ndarray) -> np.ndarray:
    """kvc4's reference quantizer and its dequantization (libggml-base), rows [n, d]."""
    lib = ggml_base()
    x = np.ascontiguousarray(rows, dtype=np.float32).reshape(-1)
    q = np.zeros(len(x), dtype=np.uint8)  # 18 bytes per 32 values fit
    y = np.zeros(len(x), dtype=np.float32)
    lib.quantize_row_kvc4_ref(x.ctypes.data, q.ctypes.data, len(x))
    lib.dequantize_row_kvc4(q.ctypes.data, y.ctypes.data, len(x))
    return y.reshape(rows.shape).astype(np.float64)


KVC_T_MAX_D = 256
KVC_T_BASIS = {"pre-pairs": 0, "post-pairs": 1}  # enum kvc_t_basis


class KvcTPlan(ctypes.Structure):
    """kvc_t_plan (cpp/ggml-kvcomp/kvc-transform.h)."""

    _fields_ = [
        ("d", ctypes.c_int32),
        ("row_bits", ctypes.c_int32),
        ("pair", (ctypes.c_int16 * 2) * (KVC_T_MAX_D // 2)),
        ("rot", (ctypes.c_float * 2) * (KVC_T_MAX_D // 2)),
        ("mean", ctypes.c_float * KVC_T_MAX_D),
        ("sigma", ctypes.c_float * KVC_T_MAX_D),
        ("bits", ctypes.c_uint8 * KVC_T_MAX_D),
    ]


class KvcTStats(ctypes.Structure):
    """kvc_t_stats: pointers to the arrays below, kept alive by the caller."""

    _fields_ = [("d", ctypes.c_int32), ("pair", ctypes.c_void_p), ("mean", ctypes.c_void_p),
                ("k2", ctypes.c_void_p), ("w", ctypes.c_void_p)]


class PairStats(NamedTuple):
    """What a kvct plan is fitted from (kvc_t_stats): each channel's mean, and per RoPE pair
    K's centred second moments and the queries' weights (aa, ab, bb)."""

    mean: np.ndarray
    k2: np.ndarray
    w: np.ndarray


def pair_stats(calib: np.ndarray, weight_m: np.ndarray, pairs: np.ndarray) -> PairStats:
    """The statistics of the calibration rows under the pairs' query weights."""
    mean = calib.mean(0)
    cov = np.cov((calib - mean).T, bias=True)
    a, b = pairs[:, 0], pairs[:, 1]
    return PairStats(mean, np.stack([cov[a, a], cov[a, b], cov[b, b]], 1),
                     np.stack([weight_m[a, a], weight_m[a, b], weight_m[b, b]], 1))


def file_stats(path: Path, pairs: np.ndarray) -> dict[tuple[int, int], PairStats]:
    """The statistics of a `kvcomp calibrate` file (K before RoPE), by (layer, KV head): what
    the shipped plans are fitted from."""
    reader = gguf_module().GGUFReader(path)
    out = {}
    for t in reader.tensors:
        if not t.name.rsplit(".", 1)[1].isdigit():
            continue  # the model's signature
        il = int(t.name.rsplit(".", 1)[1])
        # [n_kv, d/2, 8]; gguf-py gives a single KV head's tensor without its outer axis
        x = np.asarray(t.data, dtype=np.float64).reshape(-1, *t.data.shape[-2:])
        for h in range(x.shape[0]):
            mean = np.zeros(2 * x.shape[1])
            mean[pairs[:, 0]] = x[h, :, 0]
            mean[pairs[:, 1]] = x[h, :, 1]
            out[(il, h)] = PairStats(mean, x[h, :, 2:5], x[h, :, 5:8])
    return out


def uncovered(stats: dict[tuple[int, int], PairStats], n_layer: int, n_kv: int) -> list[tuple[int, int]]:
    """The (layer, KV head) of a model's rows that a statistics file has nothing for: their plans
    would otherwise be fitted to the rows, silently."""
    return [(il, h) for il in range(n_layer) for h in range(n_kv) if (il, h) not in stats]


def kvct_round_trip(rows: np.ndarray, st: PairStats, pairs: np.ndarray, space: str, row_bits: int) -> np.ndarray:
    """The C reference of the transform-coded row (libggml-base's kvc_t_*): a plan fitted to
    the statistics, then every row coded and decoded."""
    lib = ggml_base()
    d = rows.shape[1]
    mean = np.ascontiguousarray(st.mean, dtype=np.float32)
    k2 = np.ascontiguousarray(st.k2, dtype=np.float32)
    w = np.ascontiguousarray(st.w, dtype=np.float32)
    pr = np.ascontiguousarray(pairs, dtype=np.int16)
    stats = KvcTStats(d, pr.ctypes.data, mean.ctypes.data, k2.ctypes.data, w.ctypes.data)
    plan = KvcTPlan()
    if not lib.kvc_t_plan_fit(ctypes.byref(plan), ctypes.byref(stats), KVC_T_BASIS[space], row_bits):
        raise ValueError("kvc_t_plan_fit refused the statistics")
    x = np.ascontiguousarray(rows, dtype=np.float32)
    q = np.zeros((row_bits + 7) // 8, dtype=np.uint8)
    out = np.zeros_like(x)
    for i in range(len(x)):
        lib.quantize_row_kvct_ref(ctypes.byref(plan), x[i].ctypes.data, q.ctypes.data)
        lib.dequantize_row_kvct(ctypes.byref(plan), q.ctypes.data, out[i].ctypes.data)
    return out.astype(np.float64)


def hadamard(d: int) -> np.ndarray:
    h = np.ones((1, 1))
    while len(h) < d:
        h = np.block([[h, h], [h, -h]])
    out: np.ndarray = h / np.sqrt(d)
    return out


def rope_turn(err: np.ndarray, kpre: np.ndarray, kpost: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """Errors on keys before RoPE as the queries meet them: each row's pairs turned by the
    angles its RoPE turned that key's pairs by (read off the two dumps)."""
    c, s = rope_cos_sin(kpre, kpost, pairs)
    out = err.copy()
    e0, e1 = err[:, pairs[:, 0]], err[:, pairs[:, 1]]
    out[:, pairs[:, 0]] = e0 * c - e1 * s
    out[:, pairs[:, 1]] = e0 * s + e1 * c
    return out


def numpy_round_trip(ke: np.ndarray, c: np.ndarray, cov: np.ndarray, weight_m: np.ndarray, pairs: np.ndarray,
                     space: str, bpe: float) -> np.ndarray:
    """The numpy coder: the rows ke coded with a basis, bits and per-row scale fitted to the
    calibration's mean c, covariance and query weights (see code_head for the spaces)."""
    d = ke.shape[1]
    if space == "post-pairs":
        pooled = np.zeros(d)
        wpool = np.zeros(d)
        for a, b in pairs:
            pooled[[a, b]] = 0.5 * (cov[a, a] + cov[b, b])
            wpool[[a, b]] = 0.5 * (weight_m[a, a] + weight_m[b, b])
        cov = np.diag(pooled)
        weight_m = np.diag(wpool)
        tb = np.eye(d)
    elif space == "pre-pairs":
        tb = np.zeros((d, d))
        for a, b in pairs:
            _, v = np.linalg.eigh(cov[np.ix_([a, b], [a, b])])
            tb[np.ix_([a, b], [a, b])] = v.T
    else:
        _, vec = np.linalg.eigh(cov)
        tb = vec.T  # rows: basis vectors
    var = np.maximum(np.einsum("id,de,ie->i", tb, cov, tb), 1e-30)
    weight = np.einsum("id,de,ie->i", tb, weight_m, tb)
    bits = allocate(var * weight, round(bpe * d) - SCALE_BITS)

    y = (ke - c) @ tb.T / np.sqrt(var)
    # one scale per row, coded on a 1/8-octave grid like the kvc steps
    rms_row = np.sqrt((y[:, bits > 0] ** 2).mean(1)) if (bits > 0).any() else np.ones(len(y))
    s = 2.0 ** (np.round(8 * np.log2(np.maximum(rms_row, 1e-30))) / 8)
    yq = np.stack([quantize(y[:, i] / s, int(bits[i])) for i in range(d)], 1) * s[:, None]
    out: np.ndarray = (yq * np.sqrt(var)) @ tb + c
    return out


def code_head(kpost: np.ndarray, kpre: np.ndarray, pairs: np.ndarray, qc: np.ndarray, qe: np.ndarray, calib: int,
              bpe: float, space: str, reference: bool = False, shipped: PairStats | None = None) -> tuple[float, float]:
    """(kvc4's query-weighted error over the coder's, and the same for K's plain error) on
    the K rows after `calib`; qc: the queries of the calibration rows, qe: later queries.
    space: "post" codes K after RoPE with its eigenbasis; "post-pairs" after RoPE in its own
    channels, uncentered, with the statistics of the two channels of a RoPE pair pooled (RoPE
    keeps a pair's energy, so they do not depend on the position); "pre" codes K before RoPE
    with its eigenbasis, "pre-pairs" with a 2x2 basis per RoPE pair (errors are turned by each
    key's RoPE before the queries meet them). reference: the pair spaces are coded by the C
    reference (kvct_round_trip) instead of the numpy coder; shipped: with it, the plan is
    fitted to these statistics (a calibration file's) instead of the first `calib` rows."""
    d = kpost.shape[1]
    k = kpre if space.startswith("pre") else kpost
    kc = k[:calib]
    c = np.zeros(d) if space == "post-pairs" else kc.mean(0)
    cov = np.cov((kc - c).T, bias=True) if space != "post-pairs" else (kc.T @ kc) / len(kc)
    cq = qc.T @ qc / len(qc)
    if space.startswith("post"):
        weight_m = cq
    else:
        weight_m = pre_rope_weight(kpre[:calib], kpost[:calib], cq, pairs)
    ke = k[calib:]
    if reference:
        st = shipped if shipped is not None else pair_stats(kc, weight_m, pairs)
        rec = kvct_round_trip(ke, st, pairs, space, round(bpe * d))
    else:
        rec = numpy_round_trip(ke, c, cov, weight_m, pairs, space, bpe)
    err = ke - rec
    if space.startswith("pre"):
        err = rope_turn(err, kpre[calib:], kpost[calib:], pairs)
    h = hadamard(d)
    kpe = kpost[calib:]
    err_kvc4 = kpe - kvc4_round_trip(kpe @ h) @ h

    def weighted(e: np.ndarray) -> float:
        return float(np.mean((e @ qe.T) ** 2))

    return weighted(err_kvc4) / weighted(err), float((err_kvc4 ** 2).sum() / (err ** 2).sum())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prefix", type=Path, help="PREFIX given to llama-kvcomp-rows -o")
    p.add_argument("--bpe", type=float, nargs="+", default=[4.5])
    p.add_argument("--calib", type=int, nargs="+", default=[512])
    p.add_argument("--queries", type=int, default=512, help="later queries the weighted error averages over")
    p.add_argument("--space", nargs="+", default=["post", "pre", "pre-pairs"],
                   choices=["post", "post-pairs", "pre", "pre-pairs"])
    p.add_argument("--reference", action="store_true",
                   help="code the pair spaces with the C reference (libggml-base's kvc_t_*) instead of numpy")
    p.add_argument("--kstats", type=Path,
                   help="fit the plans to this `kvcomp calibrate` file (the shipped plans) instead of the first "
                        "--calib rows, which then only set where the scored rows start (needs --reference, pre-pairs)")
    args = p.parse_args()
    if args.reference and not set(args.space) <= set(KVC_T_BASIS):
        p.error("--reference codes the pair spaces only (pre-pairs, post-pairs)")
    if args.kstats and not (args.reference and args.space == ["pre-pairs"]):
        p.error("--kstats holds K before RoPE: use it with --reference --space pre-pairs")
    meta = json.loads(Path(f"{args.prefix}.json").read_text())
    n_kv, n_q, hd = meta["n_head_kv"], meta["n_head"], meta["head_dim"]
    group = n_q // n_kv
    kpost = load(args.prefix, "kpost", n_kv, meta)
    kpre = load(args.prefix, "kpre", n_kv, meta)
    q = load(args.prefix, "qpost", n_q, meta)
    pairs = rope_pairs(kpre, kpost)
    shipped = file_stats(args.kstats, pairs) if args.kstats else {}
    missing = uncovered(shipped, meta["n_layer"], n_kv) if args.kstats else []
    if missing:
        p.error(f"{args.kstats} has no statistics for {len(missing)} (layer, KV head) of the rows' model, "
                f"first {missing[0]}: is it the same model's file?")
    print("| K coded | bpe (scale included) | calibration rows | query-weighted gain over kvc4 "
          "| K error gain over kvc4 |")
    print("|---|---:|---:|---|---|")
    rng = np.random.default_rng(0)
    for space, calib, bpe in itertools.product(args.space, args.calib, args.bpe):
        gw, gk = [], []
        for il in range(meta["n_layer"]):
            for h in range(n_kv):
                qh = q[il, h * group:(h + 1) * group]  # [group, token, d]
                qcal = qh[:, :calib].reshape(-1, hd)
                later = qh[:, calib:].reshape(-1, hd)
                qlater = later[rng.choice(len(later), min(args.queries, len(later)), replace=False)]
                w, e = code_head(kpost[il, h], kpre[il, h], pairs, qcal, qlater, calib, bpe, space, args.reference,
                                 shipped.get((il, h)))
                gw.append(w)
                gk.append(e)
        coder = "C reference" if args.reference else "numpy"
        plans = f"{args.kstats.name} (rows from {calib})" if args.kstats else str(calib)
        print(f"| {space} ({coder}) | {bpe:g} | {plans} | {summary(np.array(gw))} | {summary(np.array(gk))} |")


if __name__ == "__main__":
    main()
