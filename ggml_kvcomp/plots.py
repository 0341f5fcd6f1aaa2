"""`kvcomp report`: a markdown report with PNG plots from the JSON the other commands write
(`kvcomp kld --json`, `kvcomp bench --json`, a monitor snapshot)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .kvtypes import UPSTREAM_TYPES


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def frontier(rows: Sequence[dict[str, Any]], out: Path, what: str = "") -> None:
    """Mean KLD against bits per element; upstream types are the reference points."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    # configurations of one size (kvc4, q4_0, iq4_nl, low-latency) get their labels stacked
    # down from the highest KLD, so that none covers another
    seen: dict[float, int] = {}
    for r in sorted(rows, key=lambda r: -float(r["kld_mean"])):
        kld = max(float(r["kld_mean"]), 1e-6)  # f16 against itself is ~0 on a log axis
        upstream = r["label"] in UPSTREAM_TYPES
        ax.scatter(r["bpe"], kld, marker="s" if upstream else "o", color="tab:gray" if upstream else "tab:blue")
        n = seen.get(round(float(r["bpe"]), 1), 0)
        seen[round(float(r["bpe"]), 1)] = n + 1
        ax.annotate(r["label"], (r["bpe"], kld), textcoords="offset points", xytext=(6, 4 - 10 * n), fontsize=8)
    ax.set_xlabel("bits per KV element at the measured context (main cache + residual buffer)")
    ax.set_ylabel("mean KLD vs f16 KV")
    ax.set_yscale("log")
    ax.set_title("Quality vs memory (squares: upstream types)" + (f", {what}" if what else ""))
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def decode_speeds(rows: Sequence[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Per configuration, (depth, decode tokens/s) by depth from `kvcomp bench --json` rows:
    the mean over its rounds (`--rounds`), prefill rows (`--n-prompt`) left out."""
    sums: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        if int(r.get("n_prompt", 0)) == 0:
            sums.setdefault((r["label"], int(r["depth"])), []).append(float(r["tokens_per_s"]))
    out: dict[str, list[tuple[int, float]]] = {}
    for (label, depth), ts in sorted(sums.items(), key=lambda kv: kv[0][1]):
        out.setdefault(label, []).append((depth, sum(ts) / len(ts)))
    return {label: out[label] for label in dict.fromkeys(r["label"] for r in rows) if label in out}


def speed(rows: Sequence[dict[str, Any]], out: Path) -> None:
    """Decode tokens/s against depth, one line per configuration."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in decode_speeds(rows).items():
        ax.plot([d for d, _ in pts], [t for _, t in pts], marker="o", label=label)
    ax.set_xlabel("depth (tokens in the cache)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("Decode speed vs depth")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def heatmap(snapshot: dict[str, Any], out: Path) -> None:
    """Relative K RMSE per layer (rows) and KV head (columns) from a monitor snapshot."""
    plt = _pyplot()
    layers = snapshot["layers"]
    n_head = max(len(layer["heads"]) for layer in layers)
    grid = [[float("nan")] * n_head for _ in layers]
    for i, layer in enumerate(layers):
        for h in layer["heads"]:
            # null: not measured (no tracker follows the layer), left blank
            if h["k_rmse_rel"] is not None:
                grid[i][h["head"]] = 100.0 * float(h["k_rmse_rel"])
    fig, ax = plt.subplots(figsize=(2.5 + 0.6 * n_head, 1.5 + 0.18 * len(layers)))
    im = ax.imshow(grid, aspect="auto", cmap="viridis")
    ax.set_xlabel("KV head")
    ax.set_ylabel("layer")
    ax.set_yticks(range(len(layers)), [str(layer["layer"]) for layer in layers], fontsize=6)
    ax.set_title(f"K RMSE, % of row RMS ({snapshot['mode']})")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def write_report(out_dir: Path, kld: Path | None, bench_json: Path | None, snapshot: Path | None) -> Path:
    """Writes report.md and its plots into out_dir; returns the report's path."""
    if not (kld or bench_json or snapshot):
        raise ValueError("give at least one of --kld, --bench, --snapshot")
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = ["# kvcomp report", ""]
    if kld:
        rows = json.loads(kld.read_text())
        frontier(rows, out_dir / "kld-frontier.png")
        parts += ["## KLD vs bits per element", "", f"From `{kld.name}`.", "", "![](kld-frontier.png)", "",
                  "| config | bpe | mean KLD | PPL ratio |", "|---|---:|---:|---:|"]
        parts += [f"| {r['label']} | {r['bpe']:.2f} | {r['kld_mean']:.6f} | {r['ppl_ratio']:.5f} |" for r in rows]
        parts.append("")
    if bench_json:
        rows = json.loads(bench_json.read_text())
        speed(rows, out_dir / "decode-speed.png")
        parts += ["## Decode speed vs depth", "", f"From `{bench_json.name}`.", "", "![](decode-speed.png)", "",
                  "| config | depth | decode tokens/s |", "|---|---:|---:|"]
        parts += [f"| {label} | {d} | {t:.1f} |" for label, pts in decode_speeds(rows).items() for d, t in pts]
        parts.append("")
    if snapshot:
        snap = json.loads(snapshot.read_text())
        heatmap(snap, out_dir / "k-rmse-heatmap.png")
        parts += ["## Per-layer K error", "", f"From `{snapshot.name}` (mode {snap['mode']}).", "",
                  "![](k-rmse-heatmap.png)", ""]
    report = out_dir / "report.md"
    report.write_text("\n".join(parts))
    return report
