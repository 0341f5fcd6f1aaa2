#!/usr/bin/env python3
"""What a transform coder could gain on real K rows over equal bits on rotated rows.

Input: the dump of `llama-kvcomp-rows` (PREFIX.json and PREFIX.{kpre,kpost,qpost}.f32).
For every layer and KV head it takes the covariance of K (token mean removed, as the
tracker's offset does) and compares two ideal Gaussian coders at R bits per value:

- equal bits on rotated rows (what every kvc type does after upstream's Hadamard
  rotation): error variance tr(C) / d * 2^(-2R) on every value;
- the best transform coder (the covariance's eigenbasis, bits by reverse water-filling).

Their ratio is the gain in K's squared error. Attention sees K only through q.k, so the
gain that matters for KLD weights the error by the covariance C_q of the queries that read
the head: E[(q.e)^2] = e' C_q e. Both are bounds for Gaussian rows with that covariance;
docs/kv-rows.md has the numbers and what they mean for the 4.0-bpe target.

    python3 scripts/kv_rows_gain.py /tmp/rows/smollm2 --bits 4 3
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def load(prefix: Path, kind: str, n_head: int, meta: dict[str, int]) -> np.ndarray:
    """Rows as [layer, head, token, dim] in float64."""
    n_ub = meta["n_tokens"] // meta["n_ubatch"]
    a = np.fromfile(f"{prefix}.{kind}.f32", dtype=np.float32)
    a = a.reshape(n_ub, meta["n_layer"], meta["n_ubatch"], n_head, meta["head_dim"])
    return a.transpose(1, 3, 0, 2, 4).reshape(meta["n_layer"], n_head, meta["n_tokens"], meta["head_dim"]).astype(
        np.float64
    )


def water_filling(lam: np.ndarray, bits: float) -> float:
    """Total distortion of the ideal coder for independent Gaussians of variances lam at
    `bits` per value on average (reverse water-filling)."""
    lam = np.maximum(lam, 1e-30)
    lo, hi = 1e-30, float(lam.max())
    for _ in range(200):
        theta = np.sqrt(lo * hi)
        rate = np.maximum(0.0, 0.5 * np.log2(lam / theta)).sum()
        lo, hi = (theta, hi) if rate > bits * len(lam) else (lo, theta)
    return float(np.minimum(np.sqrt(lo * hi), lam).sum())


def second_moment(x: np.ndarray) -> np.ndarray:
    """E[x x'] over rows [token, dim]."""
    m: np.ndarray = x.T @ x / len(x)
    return m


def covariance(x: np.ndarray) -> np.ndarray:
    """Covariance of rows [token, dim] about their mean (the tracker's offset)."""
    return second_moment(x - x.mean(0))


def k_gain(ck: np.ndarray, bits: float) -> float:
    """The transform coder's gain in K's squared error, for K's covariance ck."""
    lam = np.linalg.eigvalsh(ck)
    return float(lam.sum() * 2.0 ** (-2 * bits) / water_filling(lam, bits))


def weighted_gain(ck: np.ndarray, q_second_moment: np.ndarray, bits: float) -> float:
    """The gain in K's error weighted by the queries, E[(q.e)^2] = e' C_q e (C_q = E[q q'],
    not centred: a query's mean does weigh the error)."""
    w, v = np.linalg.eigh(q_second_moment)
    root = v @ np.diag(np.sqrt(np.maximum(w, 0.0))) @ v.T
    equal = np.trace(q_second_moment) * np.trace(ck) / len(ck) * 2.0 ** (-2 * bits)
    return float(equal / water_filling(np.linalg.eigvalsh(root @ ck @ root), bits))


def summary(g: np.ndarray) -> str:
    return f"{np.exp(np.log(g).mean()):.2f} / {g.min():.2f} / {g.max():.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prefix", type=Path, help="PREFIX given to llama-kvcomp-rows -o")
    p.add_argument("--bits", type=float, nargs="+", default=[4.0])
    args = p.parse_args()
    meta = json.loads(Path(f"{args.prefix}.json").read_text())
    n_kv, n_q = meta["n_head_kv"], meta["n_head"]
    group = n_q // n_kv
    hd = meta["head_dim"]
    qpost = load(args.prefix, "qpost", n_q, meta)
    # per head: E[q q'] of the queries that read it, then K's covariance before and after RoPE
    cq = [[second_moment(qpost[il, h * group : (h + 1) * group].reshape(-1, hd)) for h in range(n_kv)]
          for il in range(meta["n_layer"])]
    ck = {}
    for kind in ("kpost", "kpre"):
        k = load(args.prefix, kind, n_kv, meta)
        ck[kind] = [[covariance(k[il, h]) for h in range(n_kv)] for il in range(meta["n_layer"])]
    print("| K | bits | K error gain: geo mean / min / max | query-weighted gain: geo mean / min / max |")
    print("|---|---:|---|---|")
    for bits in args.bits:
        for kind, label in (("kpost", "after RoPE"), ("kpre", "before RoPE")):
            heads = [(il, h) for il in range(meta["n_layer"]) for h in range(n_kv)]
            gk = np.array([k_gain(ck[kind][il][h], bits) for il, h in heads])
            # the queries are after RoPE, so they weigh only the keys after RoPE
            weighted = "-"
            if kind == "kpost":
                weighted = summary(np.array([weighted_gain(ck[kind][il][h], cq[il][h], bits) for il, h in heads]))
            print(f"| {label} | {bits:g} | {summary(gk)} | {weighted} |")


if __name__ == "__main__":
    main()
