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
the head: E[(q.e)^2] = e' C_q e; before RoPE an error is turned by its key's rotation R_n on
the way, so the weight is the mean of R_n' C_q R_n over the keys. Both are bounds for
Gaussian rows with that covariance;
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


def rope_pairs(kpre: np.ndarray, kpost: np.ndarray) -> np.ndarray:
    """The dimension pairs RoPE rotates, [pair, 2], told by the data: a rotation keeps each
    pair's norm. Upstream pairs (2i, 2i+1) (normal) or (i, i + d/2) (NEOX)."""
    d = kpre.shape[-1]
    best: tuple[float, np.ndarray] | None = None
    for pairs in (np.arange(d).reshape(-1, 2), np.stack([np.arange(d // 2), np.arange(d // 2) + d // 2], 1)):
        npre = np.hypot(kpre[..., pairs[:, 0]], kpre[..., pairs[:, 1]])
        npost = np.hypot(kpost[..., pairs[:, 0]], kpost[..., pairs[:, 1]])
        err = float(np.abs(npre - npost).max() / max(float(npre.max()), 1e-30))
        if best is None or err < best[0]:
            best = (err, pairs)
    assert best is not None and best[0] < 1e-3, f"no RoPE pairing keeps the norms (best {best[0] if best else None})"
    return best[1]


def rope_cos_sin(kpre: np.ndarray, kpost: np.ndarray, pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of the angle RoPE turned each row's pairs by, [token, pair], read off the
    rows before and after it."""
    def angle(x: np.ndarray) -> np.ndarray:
        out: np.ndarray = np.arctan2(x[:, pairs[:, 1]], x[:, pairs[:, 0]])
        return out

    a = angle(kpost) - angle(kpre)
    return np.cos(a), np.sin(a)


def pre_rope_weight(kpre: np.ndarray, kpost: np.ndarray, q_second_moment: np.ndarray, pairs: np.ndarray) -> np.ndarray:
    """W = mean over the keys' positions n of R_n' C_q R_n: an error e on a key before RoPE
    reaches a query as q.(R_n e), so E[(q.R_n e)^2] = e' W e. R_n's angles are read off each
    key (the angle its RoPE turned every pair by); rows [token, dim]."""
    c, s = rope_cos_sin(kpre, kpost, pairs)
    rot = np.stack([np.stack([c, -s], -1), np.stack([s, c], -1)], -2)  # [n, pair, 2, 2]: R maps pre to post
    order = pairs.reshape(-1)
    cq = q_second_moment[np.ix_(order, order)].reshape(len(pairs), 2, len(pairs), 2)
    w = np.einsum("nixa,ixjy,njyb->iajb", rot, cq, rot, optimize=True) / len(kpre)
    out = np.empty_like(q_second_moment)
    out[np.ix_(order, order)] = w.reshape(len(order), len(order))
    return out


def weighted_gain_vs_post(ck: np.ndarray, weight: np.ndarray, ck_post: np.ndarray, cq_post: np.ndarray,
                          bits: float) -> float:
    """The gain in K's error weighted by the queries: the transform coder of rows with
    covariance ck under the error weight `weight` (E[(q.e)^2] = e' weight e), against equal
    bits on the rows after RoPE read by queries with second moment cq_post (what the kvc
    types do). After RoPE the weight is C_q = E[q q'] (not centred: a query's mean does
    weigh the error)."""
    w, v = np.linalg.eigh(weight)
    root = v @ np.diag(np.sqrt(np.maximum(w, 0.0))) @ v.T
    equal = np.trace(cq_post) * np.trace(ck_post) / len(ck_post) * 2.0 ** (-2 * bits)
    return float(equal / water_filling(np.linalg.eigvalsh(root @ ck @ root), bits))


def pair_gain_vs_post(ck: np.ndarray, weight: np.ndarray, pairs: np.ndarray, ck_post: np.ndarray,
                      cq_post: np.ndarray, bits: float) -> float:
    """As weighted_gain_vs_post for rows before RoPE, with the basis kept within each RoPE
    pair (a 2x2 rotation per pair commutes with RoPE, so a kernel turns the query once per
    key instead of multiplying by a d x d basis per key): each pair's two variances along
    its own axes, weighted by the pair's mean weight, then bits by reverse water-filling."""
    lam = []
    for a, b in pairs:
        block = ck[np.ix_([a, b], [a, b])]
        lam.extend(np.linalg.eigvalsh(block) * 0.5 * (weight[a, a] + weight[b, b]))
    equal = np.trace(cq_post) * np.trace(ck_post) / len(ck_post) * 2.0 ** (-2 * bits)
    return float(equal / water_filling(np.array(lam), bits))


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
    rows = {kind: load(args.prefix, kind, n_kv, meta) for kind in ("kpost", "kpre")}
    ck = {kind: [[covariance(k[il, h]) for h in range(n_kv)] for il in range(meta["n_layer"])]
          for kind, k in rows.items()}
    # the queries' weight on a key's error before RoPE, through each key's own rotation
    pairs = rope_pairs(rows["kpre"], rows["kpost"])
    cw = {"kpost": cq,
          "kpre": [[pre_rope_weight(rows["kpre"][il, h], rows["kpost"][il, h], cq[il][h], pairs) for h in range(n_kv)]
                   for il in range(meta["n_layer"])]}
    print("| K | bits | K error gain: geo mean / min / max | query-weighted gain: geo mean / min / max |")
    print("|---|---:|---|---|")
    for bits in args.bits:
        for kind, label in (("kpost", "after RoPE"), ("kpre", "before RoPE")):
            heads = [(il, h) for il in range(meta["n_layer"]) for h in range(n_kv)]
            gk = np.array([k_gain(ck[kind][il][h], bits) for il, h in heads])
            # both against equal bits on the rows after RoPE, as the kvc types code them
            gw = np.array([weighted_gain_vs_post(ck[kind][il][h], cw[kind][il][h], ck["kpost"][il][h], cq[il][h], bits)
                           for il, h in heads])
            print(f"| {label} | {bits:g} | {summary(gk)} | {summary(gw)} |")
        gp = np.array([pair_gain_vs_post(ck["kpre"][il][h], cw["kpre"][il][h], pairs, ck["kpost"][il][h], cq[il][h],
                                         bits) for il in range(meta["n_layer"]) for h in range(n_kv)])
        print(f"| before RoPE, basis within RoPE pairs | {bits:g} | - | {summary(gp)} |")


if __name__ == "__main__":
    main()
