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


def head_gains(k: np.ndarray, q: np.ndarray, bits: float) -> tuple[float, float]:
    """(K squared-error gain, query-weighted gain) of the transform coder for one head."""
    d = k.shape[1]
    x = k - k.mean(0)
    ck = x.T @ x / len(x)
    lam = np.linalg.eigvalsh(ck)
    equal = lam.sum() * 2.0 ** (-2 * bits)
    cq = q.T @ q / len(q)
    w, v = np.linalg.eigh(cq)
    root = v @ np.diag(np.sqrt(np.maximum(w, 0.0))) @ v.T
    equal_w = np.trace(cq) * lam.sum() / d * 2.0 ** (-2 * bits)
    return equal / water_filling(lam, bits), equal_w / water_filling(np.linalg.eigvalsh(root @ ck @ root), bits)


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
    rows = {kind: load(args.prefix, kind, n_kv, meta) for kind in ("kpre", "kpost")}
    qpost = load(args.prefix, "qpost", n_q, meta)
    print("| K | bits | K error gain: geo mean / min / max | query-weighted gain: geo mean / min / max |")
    print("|---|---:|---|---|")
    for bits in args.bits:
        for kind, label in (("kpost", "after RoPE"), ("kpre", "before RoPE")):
            gk, gw = [], []
            for il in range(meta["n_layer"]):
                for h in range(n_kv):
                    q = qpost[il, h * group : (h + 1) * group].reshape(-1, meta["head_dim"])
                    a, b = head_gains(rows[kind][il, h], q, bits)
                    gk.append(a)
                    gw.append(b)
            # the queries are after RoPE, so they weigh only the keys after RoPE
            weighted = summary(np.array(gw)) if kind == "kpost" else "-"
            print(f"| {label} | {bits:g} | {summary(np.array(gk))} | {weighted} |")


if __name__ == "__main__":
    main()
