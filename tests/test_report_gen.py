"""The report renderer (ggml_kvcomp/reportgen.py) on synthetic records: every number it prints
is the one in its record, ratios are to f16 of the same record, missing records are named,
and the main job's section and the rest of README survive a rewrite. No build needed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ggml_kvcomp import cli, reportdata, reportgen
from ggml_kvcomp.reportdata import Machine, Record

MACHINE = Machine(cpu="Test CPU 9000", simd="AVX2", cores=2)


def record(name: str, kind: str, rows: list[dict[str, Any]], quick: bool = False) -> Record:
    return Record(name=name, kind=kind, command=f"kvcomp {kind} --for {name}", date="2030-01-02", machine=MACHINE,
                  threads=2, seconds=12.0, quick=quick, rows=rows)


def kld_row(label: str, kld: float, bpe_k: float = 4.5, bpe_v: float = 4.5, buffer_full: float = 0.0,
            ctx: int = 2048) -> dict[str, Any]:
    return {"ctx": ctx, "label": label, "bpe_k": bpe_k, "bpe_v": bpe_v, "bpe_buffer": 2 * buffer_full,
            "bpe": (bpe_k + bpe_v) / 2 + 2 * buffer_full, "bpe_full": (bpe_k + bpe_v) / 2 + buffer_full,
            "bpe_buffer_full": buffer_full, "kld_mean": kld, "kld_mean_err": kld / 10, "kld_p99": 10 * kld,
            "same_top_p": 97.5, "ppl_ratio": 1 + kld, "kv_mib_full": 100 * bpe_k / 16}


def bench_row(label: str, depth: int, ts: float, n_prompt: int = 0, rnd: int = 0) -> dict[str, Any]:
    return {"label": label, "depth": depth, "n_gen": 0 if n_prompt else 32, "tokens_per_s": ts, "n_prompt": n_prompt,
            "round": rnd}


QUALITY_ROWS = [kld_row("f16", 0.0, 16, 16), kld_row("q4_0", 0.0561), kld_row("balanced:k3", 0.00198, 4.3, 3.5, 0.04),
                kld_row("high-precision", 0.000021, 8.5, 8.5, 0.09), kld_row("low-latency:k3", 0.0117)]


@pytest.mark.parametrize("rows", [QUALITY_ROWS, QUALITY_ROWS[:2], [kld_row("kvc3", 0.164, 3.5, 3.5)]])
def test_quality_table_prints_each_rows_numbers(rows: list[dict[str, Any]]) -> None:
    lines = reportgen.quality_table(rows, 8192).splitlines()
    assert len(lines) == 2 + len(rows)
    for row, line in zip(rows, lines[2:], strict=True):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[0] == row["label"]
        assert float(cells[1]) == pytest.approx(row["bpe"], abs=0.005)
        assert float(cells[2]) == pytest.approx(row["bpe_full"], abs=0.005)
        assert float(cells[3].split("±")[0]) == pytest.approx(row["kld_mean"], abs=5e-7)
        assert float(cells[6]) == pytest.approx(row["ppl_ratio"], abs=5e-6)


@pytest.mark.parametrize(("rounds", "depths"), [(1, (0, 4096)), (2, (0, 4096)), (3, (16384,))])
def test_speed_ratios_are_to_f16_of_the_same_record(rounds: int, depths: tuple[int, ...]) -> None:
    speed = {"f16": 100.0, "balanced:k3": 70.0, "q4_0": 50.0}
    rows = [bench_row(label, d, ts * (1 + r) / (d + 1) ** 0.1, rnd=r)
            for r in range(rounds) for label, ts in speed.items() for d in depths]
    rows += [bench_row(label, 4096, 3 * ts, n_prompt=512) for label, ts in speed.items()]
    table = reportgen.speed_table([record("speed", "bench", rows)])
    for label, ts in speed.items():
        line = next(x for x in table.splitlines() if x.startswith(f"| {label} |"))
        if label != "f16":
            assert line.count(f"({ts / speed['f16']:.2f}x)") == len(depths) + 1
        else:
            assert "x)" not in line
    assert "pp512 t/s @ d=4096" in table


@pytest.mark.parametrize("ctx", [8192, 32768])
@pytest.mark.parametrize("row", QUALITY_ROWS)
def test_bits_per_value_spread_the_buffer_over_the_context(ctx: int, row: dict[str, Any]) -> None:
    got = reportgen.bpe_at(row, ctx, 8192)
    main = (row["bpe_k"] + row["bpe_v"]) / 2
    assert got == pytest.approx(main + row["bpe_buffer_full"] * 8192 / ctx)
    assert reportgen.bpe_at(row, 8192, 8192) == pytest.approx(row["bpe_full"])


def full_records() -> dict[str, Record]:
    recs = [record(reportgen.quality_name("smollm2-135m-f32", 2048), "kld", QUALITY_ROWS),
            record(reportgen.quality_name("gemma3-270m", 2048), "kld",
                   [{**r, "kld_mean": r["kld_mean"] * 5} for r in QUALITY_ROWS]),
            record(reportgen.SPEED[0], "bench",
                   [bench_row(r["label"], d, 100.0 - 10 * i) for i, r in enumerate(QUALITY_ROWS) for d in (0, 4096)]),
            record(reportgen.long_name("needle", 16384), "needle",
                   [{"label": r["label"], "ctx": 16384, "depth": d, "found": d < 0.9} for r in QUALITY_ROWS
                    for d in (0.1, 0.5, 0.9)], quick=True)]
    return {r.name: r for r in recs}


@pytest.mark.parametrize("present", [[], [reportgen.quality_name("smollm2-135m-f32", 2048)], list(full_records())])
def test_report_names_its_sources_and_its_gaps(present: list[str]) -> None:
    records = {k: v for k, v in full_records().items() if k in present}
    text = reportgen.render(records, "<!-- kld-main:begin -->\nmain job\n<!-- kld-main:end -->")
    assert "<!-- kld-main:begin -->\nmain job\n<!-- kld-main:end -->" in text
    for name, rec in full_records().items():
        assert (rec.command in text) == (name in present)
    assert text.count("Not measured yet") >= 5 - len(present)
    if reportgen.long_name("needle", 16384) in present:
        assert "✓ ✓ ✗ (2/3)" in text and "quick subset" in text
    assert all(f"{MACHINE.cpu}, {MACHINE.simd}" in line for line in text.splitlines() if "`kvcomp " in line)


@pytest.mark.parametrize("mode", [m for m in reportgen.MODES])
def test_mode_table_quotes_the_records(mode: tuple[str, str, str, str]) -> None:
    records = full_records()
    name, label, cache, _ = mode
    line = next(x for x in reportgen.mode_table(records).splitlines() if x.startswith(f"| {name} |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    smol = next((r for r in QUALITY_ROWS if r["label"] == label), None)
    if smol is None:
        assert cells[2:6] == [reportgen.NONE] * 4
        return
    assert cells[1] == cache
    assert float(cells[2]) == pytest.approx(reportgen.bpe_at(smol, 8192, 8192), abs=0.005)
    assert float(cells[4]) == pytest.approx(smol["kld_mean"], abs=5e-7)
    assert float(cells[5]) == pytest.approx(5 * smol["kld_mean"], abs=5e-7)
    i = [r["label"] for r in QUALITY_ROWS].index(label)
    assert cells[6] == f"{(100.0 - 10 * i) / 100.0:.2f}x"


@pytest.mark.parametrize(("isa", "model"), [(i[0], m) for i in reportgen.ISA_BUILDS for m in i[3]])
def test_a_builds_speed_has_its_own_table(isa: str, model: str) -> None:
    name = reportgen.isa_speed_name(isa, model)
    rows = [bench_row(label, d, ts) for label, ts in (("f16", 50.0), ("balanced:k3", 60.0)) for d in (0, 4096)]
    text = reportgen.render({name: record(name, "bench", rows)}, None)
    short = next(i[1] for i in reportgen.ISA_BUILDS if i[0] == isa)
    section = text.split(f"### {reportgen.MODEL_NAMES[model]}, {short} build\n")[1].split("###")[0]
    assert "| balanced:k3 | 60.0 (1.20x) | 60.0 (1.20x) |" in section and record(name, "bench", rows).command in section


def test_write_keeps_the_main_section_and_the_rest_of_readme(tmp_path: Path) -> None:
    data, results, readme = tmp_path / "data", tmp_path / "results.md", tmp_path / "README.md"
    for rec in full_records().values():
        reportdata.save(rec, data)
    results.write_text("# old diary\n\n<!-- kld-main:begin -->\n| kept |\n<!-- kld-main:end -->\n\nold notes\n")
    readme.write_text("# top\n\n<!-- mode-table:begin -->\nold\n<!-- mode-table:end -->\n\n## Python\nmine\n")
    assert cli.main(["report", "--data", str(data), "--results", str(results), "--readme", str(readme)]) == 0
    text = results.read_text()
    assert "<!-- kld-main:begin -->\n| kept |\n<!-- kld-main:end -->" in text and "old notes" not in text
    new = readme.read_text()
    assert new.startswith("# top\n\n<!-- mode-table:begin -->\n| mode |") and new.endswith("## Python\nmine\n")
    assert reportdata.load_all(data) == full_records()


@pytest.mark.parametrize(("flags", "simd"), [("avx2 fma", "AVX2"), ("avx2 avx512f", "AVX-512"),
                                             ("avx2 avx512f avx512vbmi", "AVX-512 VBMI"), ("sse4_2", "no AVX2")])
def test_machine_from_cpuinfo(flags: str, simd: str) -> None:
    m = reportdata.parse_cpuinfo(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu {flags}\n", 2)
    assert (m.cpu, m.simd, m.cores) == ("Some CPU", simd, 2)


@pytest.mark.parametrize(("cpu", "built", "simd"), [("AVX-512 VBMI", "AVX2", "AVX2 build"),
                                                   ("AVX-512 VBMI", "AVX-512", "AVX-512 build"),
                                                   ("AVX-512 VBMI", "AVX-512 VBMI", "AVX-512 VBMI"),
                                                   ("AVX2", "AVX2", "AVX2"), ("AVX2", None, "AVX2")])
def test_a_build_below_the_cpu_names_its_level(cpu: str, built: str | None, simd: str) -> None:
    m = reportdata.Machine(cpu="Some CPU", simd=cpu, cores=2)
    assert reportdata.with_build(m, built).simd == simd


def test_the_native_build_reports_its_own_level(bins: Path) -> None:
    """ggml_cpu_has_* of the CPU backend the tools load: a native build is at the CPU's level."""
    assert reportdata.build_simd_level(bins / "libggml-cpu.so") == reportdata.this_machine().simd


def test_record_wraps_a_commands_rows(tmp_path: Path) -> None:
    rows = [bench_row("f16", 0, 10.0)]

    def fake(argv: list[str]) -> int:
        Path(argv[argv.index("--json") + 1]).write_text(json.dumps(rows))
        return 0

    rec = reportdata.measure("speed", ["bench", "--depths", "0"], 2, True, "kvcomp bench --depths 0", fake)
    assert (rec.kind, rec.rows, rec.quick, rec.threads) == ("bench", rows, True, 2)
    with pytest.raises(ValueError):
        reportdata.kind_of(["ppl"])
    assert reportdata.kind_of(["bench", "--parallel", "8"]) == "parallel"
