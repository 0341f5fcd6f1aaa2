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


Box = tuple[float, float, float, float]  # x0, y0, x1, y1 in points

# where a label may sit, from its point (points, label's lower-left corner): beside it first,
# then further out; a label placed off its first spot gets a leader line
_OFFSETS: tuple[tuple[float, float], ...] = tuple(
    (dx, dy) for r in (1, 2, 3, 4) for dx, dy in ((6, 3), (6, -11), (-6, 3), (-6, -11), (0, 12), (0, -22))
    for dx, dy in [(dx * r, dy + (r - 1) * (12 if dy > 0 else -12))]
)


def _overlaps(a: Box, b: Box) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def place_labels(points: Sequence[tuple[float, float]], sizes: Sequence[tuple[float, float]]) -> list[Box]:
    """Boxes (points) for labels of the given sizes beside points (points, display space): each
    takes the first of its candidate spots that covers no earlier label and no point, nearest
    first, so every label stays beside its own point."""
    marker = 3.0  # half a marker's size
    dots = [(x - marker, y - marker, x + marker, y + marker) for x, y in points]
    placed: list[Box] = []
    for (x, y), (w, h) in zip(points, sizes, strict=True):
        best: Box | None = None
        for dx, dy in _OFFSETS:
            x0 = x + dx if dx >= 0 else x + dx - w
            box = (x0, y + dy, x0 + w, y + dy + h)
            if not any(_overlaps(box, b) for b in placed) and not any(_overlaps(box, d) for d in dots):
                best = box
                break
        placed.append(best or (x + 6, y + 3, x + 6 + w, y + 3 + h))
    return placed


def frontier(rows: Sequence[dict[str, Any]], out: Path, what: str = "") -> None:
    """Mean KLD against bits per element; upstream types are the reference points. Labels sit
    beside their points without covering each other (place_labels)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ordered = sorted(rows, key=lambda r: -float(r["kld_mean"]))
    xs = [float(r["bpe"]) for r in ordered]
    ys = [max(float(r["kld_mean"]), 1e-6) for r in ordered]  # f16 against itself is ~0 on a log axis
    for r, x, y in zip(ordered, xs, ys, strict=True):
        upstream = r["label"] in UPSTREAM_TYPES
        ax.scatter(x, y, marker="s" if upstream else "o", color="tab:gray" if upstream else "tab:blue")
    ax.set_yscale("log")
    ax.margins(x=0.12, y=0.15)
    ax.set_xlabel("bits per KV element at the measured context (main cache + residual buffer)")
    ax.set_ylabel("mean KLD vs f16 KV")
    ax.set_title("Quality vs memory (squares: upstream types)" + (f", {what}" if what else ""), fontsize=10)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.canvas.draw()  # fixes the layout and the axes' limits, so data map to points
    to_pt = 72.0 / fig.dpi
    pts = [(float(px) * to_pt, float(py) * to_pt) for px, py in ax.transData.transform(list(zip(xs, ys, strict=True)))]
    font = 8.0
    sizes = [(0.6 * font * len(str(r["label"])), 1.2 * font) for r in ordered]
    for r, x, y, (px, py), box in zip(ordered, xs, ys, pts, place_labels(pts, sizes), strict=True):
        moved = not (box[0] == px + 6 and box[1] == py + 3)
        ax.annotate(str(r["label"]), (x, y), xytext=(box[0] - px, box[1] - py), textcoords="offset points",
                    fontsize=font, va="bottom", ha="left",
                    arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.5"} if moved else None)
    fig.savefig(out, dpi=fig.dpi)
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
