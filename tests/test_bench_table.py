"""The bench table: decode and prefill columns per depth, each value from its own row; with
--rounds, the configurations interleaved and compared round by round."""

from __future__ import annotations

from dataclasses import asdict, replace

import pytest

from ggml_kvcomp.bench import BenchResult, bench_table, round_ratios, rounds_table, run_rounds
from ggml_kvcomp.cli import main as kvcomp_main
from ggml_kvcomp.kvtypes import KvConfig
from ggml_kvcomp.plots import decode_speeds


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


def test_rounds_interleave_the_configurations() -> None:
    # every configuration once a round, in the given order, each result tagged with its round
    calls: list[str] = []

    def run(cfg: KvConfig) -> list[BenchResult]:
        calls.append(cfg.label)
        return [_row(cfg.label, 0, 100.0)]

    out = run_rounds([KvConfig.parse("f16"), KvConfig.parse("kvc4")], 3, run)
    assert calls == ["f16", "kvc4"] * 3
    assert [(r.label, r.round) for r in out] == [(lbl, i) for i in range(3) for lbl in ("f16", "kvc4")]


@pytest.mark.parametrize("drift", [[1.0, 1.0, 1.0], [1.0, 0.7, 1.3]])
def test_round_ratios_cancel_the_machine_s_drift(drift: list[float]) -> None:
    # a configuration 1.2x f16 at depth 0 and 0.9x at 4096, on a machine whose speed moves by
    # `drift` between rounds: each round's ratio is the configuration's own, while its spread
    # of t/s follows the machine
    rows = []
    for i, m in enumerate(drift):
        for label, k0, k1 in (("f16", 1.0, 1.0), ("kvc4", 1.2, 0.9)):
            rows += [replace(_row(label, 0, 100.0 * k0 * m), round=i),
                     replace(_row(label, 4096, 40.0 * k1 * m), round=i)]
    ratios = round_ratios(rows)
    assert ratios[("kvc4", 0, False)] == pytest.approx((1.2, 1.2))
    assert ratios[("kvc4", 4096, False)] == pytest.approx((0.9, 0.9))
    assert ratios[("f16", 0, False)] == pytest.approx((1.0, 1.0))
    table = rounds_table(rows)
    lo, hi = 120.0 * min(drift), 120.0 * max(drift)
    assert f"| kvc4 | {lo:.1f}-{hi:.1f} (1.20-1.20x) |" in table
    assert "(1.00-1.00x)" not in table and "3 rounds" in table


def test_rounds_and_parallel_are_refused_together(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvcomp_main(["bench", "--model", "smollm2-135m", "--parallel", "4", "--rounds", "2"]) == 1
    assert "--rounds" in capsys.readouterr().err


def test_report_averages_rounds_and_leaves_prefill_out() -> None:
    # kvcomp report's speed plot and table from a --rounds --n-prompt JSON: one point per
    # configuration and depth, the mean of its rounds' decode speeds
    rows = [asdict(replace(_row(lbl, d, ts, pp), round=i))
            for i, k in enumerate((1.0, 2.0))
            for lbl, d, ts, pp in (("f16", 0, 100.0 * k, 0), ("f16", 4096, 40.0 * k, 0), ("f16", 0, 900.0, 512),
                                   ("kvc4", 0, 90.0 * k, 0))]
    assert decode_speeds(rows) == {"f16": [(0, 150.0), (4096, 60.0)], "kvc4": [(0, 135.0)]}
