"""The bench table: decode and prefill columns per depth, each value from its own row."""

from __future__ import annotations

from ggml_kvcomp.bench import BenchResult, bench_table


def _row(label: str, depth: int, ts: float, n_prompt: int = 0) -> BenchResult:
    return BenchResult(label, depth, 0 if n_prompt else 64, ts, 1.0, 4.5, 100.0, 10.0, 0.0, 50.0, 400.0, n_prompt)


def test_decode_and_prefill_columns() -> None:
    rows = [_row("kvc4", d, 100.0 + d / 1000) for d in (0, 4096)]
    rows += [_row("kvc4", d, 5000.0 + d / 1000, 512) for d in (0, 4096)]
    lines = bench_table(rows).splitlines()
    assert lines[0].startswith("| K/V | tg t/s @ d=0 | tg t/s @ d=4096 | pp t/s @ d=0 | pp t/s @ d=4096 |")
    cells = [c.strip() for c in lines[2].split("|")[2:6]]
    assert cells == ["100.0 ± 1.0", "104.1 ± 1.0", "5000.0 ± 1.0", "5004.1 ± 1.0"]


def test_decode_only_has_no_prefill_columns() -> None:
    table = bench_table([_row("f16", 0, 50.0), _row("f16", 4096, 40.0)])
    assert "pp t/s" not in table
    assert "| f16 | 50.0 ± 1.0 | 40.0 ± 1.0 |" in table
