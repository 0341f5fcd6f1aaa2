"""The frontier plot's labels: beside their own points, none covering another label or a point."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ggml_kvcomp import plots


def _dist(box: plots.Box, p: tuple[float, float]) -> float:
    dx = max(box[0] - p[0], 0.0, p[0] - box[2])
    dy = max(box[1] - p[1], 0.0, p[1] - box[3])
    return math.hypot(dx, dy)


@pytest.mark.parametrize("points", [
    [(100.0, 100.0)] * 5,                                          # one size, one KLD: a stack
    [(100.0, 100.0 + 4 * i) for i in range(6)],                    # one size, close KLDs
    [(100.0 + 3 * i, 200.0 - 5 * i) for i in range(8)],            # a dense diagonal
    [(50.0, 50.0), (300.0, 200.0), (52.0, 60.0), (305.0, 190.0)],  # two clusters
])
def test_labels_do_not_collide_and_stay_beside_their_points(points: list[tuple[float, float]]) -> None:
    sizes = [(60.0, 9.6)] * len(points)
    boxes = plots.place_labels(points, sizes)
    for i, a in enumerate(boxes):
        assert a[2] - a[0] == pytest.approx(sizes[i][0]) and a[3] - a[1] == pytest.approx(sizes[i][1])
        assert _dist(a, points[i]) <= 60.0, (i, a, points[i])
        for b in boxes[:i]:
            assert not plots._overlaps(a, b), (a, b)
        for x, y in points:
            assert not plots._overlaps(a, (x - 3.0, y - 3.0, x + 3.0, y + 3.0)), (a, (x, y))


def test_frontier_writes_a_png(tmp_path: Path) -> None:
    rows = [{"label": name, "bpe": bpe, "kld_mean": kld} for name, bpe, kld in (
        ("f16", 16.0, 0.0), ("q8_0", 8.5, 2.6e-4), ("q4_0", 4.5, 0.056), ("kvc4", 4.5, 0.037),
        ("low-latency", 4.5, 0.033), ("low-latency:k3", 4.5, 0.0116), ("balanced", 4.54, 0.0055),
        ("balanced:k3", 4.44, 0.0022))]
    out = tmp_path / "f.png"
    plots.frontier(rows, out, "test")
    assert out.read_bytes()[:4] == b"\x89PNG"
