"""docs/results.md and README's mode table, rendered from the records of `scripts/report.sh`
(ggml_kvcomp/reportdata.py). Every table prints the records it comes from; a table whose
records are missing is named as such. The main job's section (`kld-main`, written by
scripts/main-job.sh) is carried over from the file being replaced."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .report import marked, replace_block
from .reportdata import Record

MODEL_NAMES = {"smollm2-135m-f32": "SmolLM2-135M F32", "gemma3-270m": "Gemma-3-270M Q4_K_M",
               "smollm2-135m": "SmolLM2-135M Q4_1", "synth-kv8x128": "synth-kv8x128 (KV-bound, random weights)"}
QUALITY = (("smollm2-135m-f32", 2048), ("smollm2-135m-f32", 8192), ("gemma3-270m", 2048), ("gemma3-270m", 8192))
LONG_MODEL, LONG_CTX = "gemma3-270m", (16384, 32768)
SPEED = ("speed-smollm2-135m", "speed-smollm2-135m-d16384")
# builds below this machine's level (scripts/build-isa.sh): name, level, CPUs, models measured
ISA_BUILDS = (("avx2", "AVX2", "AVX2 (AMD Zen 1-3, most Intel desktop CPUs)",
               ("smollm2-135m", "gemma3-270m", "synth-kv8x128")),
              ("avx512", "AVX-512", "AVX-512 without VBMI (Intel Skylake-X, Cascade Lake)", ("smollm2-135m",)))
PARALLEL = "parallel-synth-kv8x128"
MAIN_SECTION = "kld-main"
README_BLOCK = "mode-table"
README_DEPTH = 4096  # the decode depth README's table quotes
NONE = "-"  # a cell without a measurement

# README's modes: the label their records carry (as `--kv-comp MODE` runs them), the cache in
# words and when to pick it; the upstream rows stand for comparison
MODES: tuple[tuple[str, str, str, str], ...] = (
    ("`off`", "f16", "f16 / f16", "you want upstream's cache"),
    ("`high-precision`", "high-precision", "kvc8 / kvc8, 32-row window, 4 sinks",
     "the cache must stay indistinguishable from f16"),
    ("`balanced`", "balanced:k3", "kvct4 (kvct3 on the edge layers) / kvc3, 56-row window, 4 sinks",
     "the default: a quarter of f16's memory"),
    ("`low-latency`", "low-latency:k3", "kvct4 / kvc4, no window", "no per-step window work"),
    ("*q8_0 (upstream)*", "q8_0", "q8_0 / q8_0", ""),
    ("*q4_0 (upstream)*", "q4_0", "q4_0 / q4_0", ""),
)


def quality_name(model: str, ctx: int) -> str:
    return f"quality-{model}-ctx{ctx}"


def long_name(kind: str, ctx: int) -> str:
    return f"{kind}-{LONG_MODEL}-ctx{ctx}"


def isa_speed_name(isa: str, model: str) -> str:
    return f"speed-{isa}-{model}"


def provenance(rec: Record) -> str:
    m = rec.machine
    quick = "; `scripts/report.sh --quick` subset" if rec.quick else ""
    return (f"`{rec.command}` ({rec.date}, {m.cpu}, {m.simd}, {m.cores} cores, {rec.threads} threads, "
            f"{rec.seconds:.0f} s{quick})")


def _sources(records: Sequence[Record]) -> str:
    return "\n".join(f"- {provenance(r)}" for r in records)


def _labels(rows: Sequence[dict[str, Any]]) -> list[str]:
    return list(dict.fromkeys(str(r["label"]) for r in rows))


def _row(rec: Record | None, label: str) -> dict[str, Any] | None:
    return next((r for r in rec.rows if r["label"] == label), None) if rec else None


def _full_ctx(model: str) -> int:
    from .models import MODELS

    return MODELS[model].ctx_train


def _kld(row: dict[str, Any]) -> str:
    """A mean KLD to six places; f16 against itself comes out as a rounding's -0.000000."""
    kld = float(row["kld_mean"])
    return f"{kld if kld > 0 else 0.0:.6f}"


def quality_table(rows: Sequence[dict[str, Any]], ctx_full: int) -> str:
    out = [f"| K/V | bpe | bpe at {ctx_full} | mean KLD | KLD p99 | same top p | PPL ratio |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    out += [f"| {r['label']} | {r['bpe']:.2f} | {r['bpe_full']:.2f} | {_kld(r)} ± {r['kld_mean_err']:.6f} "
            f"| {r['kld_p99']:.5f} | {r['same_top_p']:.2f}% | {r['ppl_ratio']:.5f} |" for r in rows]
    return "\n".join(out)


def _needle_cell(rows: Sequence[dict[str, Any]], label: str) -> str:
    mine = sorted((r for r in rows if r["label"] == label), key=lambda r: float(r["depth"]))
    if not mine:
        return NONE
    found = sum(bool(r["found"]) for r in mine)
    return " ".join("✓" if r["found"] else "✗" for r in mine) + f" ({found}/{len(mine)})"


def long_table(kld: dict[int, Record], needle: dict[int, Record]) -> str:
    """KLD and needle retrieval per configuration at each long context (columns of the
    contexts that have a record)."""
    ctxs = sorted(set(kld) | set(needle))
    labels = _labels([r for ctx in ctxs for rec in (kld.get(ctx), needle.get(ctx)) if rec for r in rec.rows])
    depths = sorted({float(r["depth"]) for rec in needle.values() for r in rec.rows})
    depth_text = "/".join(f"{d:.0%}" for d in depths)
    head = [f"mean KLD, ctx {c}" for c in ctxs if c in kld] + [f"needle {depth_text}, ctx {c}" for c in ctxs
                                                               if c in needle]
    out = ["| K/V | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
    for label in labels:
        cells = []
        for c in (c for c in ctxs if c in kld):
            row = _row(kld[c], label)
            cells.append(_kld(row) if row else NONE)
        cells += [_needle_cell(needle[c].rows, label) for c in ctxs if c in needle]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


# a speed cell: configuration, depth, prefill (pp) rather than decode (tg)
SpeedKey = tuple[str, int, bool]


def speeds(rows: Sequence[dict[str, Any]]) -> dict[SpeedKey, float]:
    """Mean tokens/s per configuration, depth and kind over a bench record's rounds."""
    acc: dict[SpeedKey, list[float]] = {}
    for r in rows:
        acc.setdefault((str(r["label"]), int(r["depth"]), int(r.get("n_prompt", 0)) > 0), []).append(
            float(r["tokens_per_s"]))
    return {k: sum(v) / len(v) for k, v in acc.items()}


def ratio_cell(ts: float | None, base: float | None) -> str:
    if ts is None:
        return NONE
    return f"{ts:.1f}" + (f" ({ts / base:.2f}x)" if base else "")


def speed_table(records: Sequence[Record], base: str = "f16") -> str:
    """Decode at every depth, then prefill, of one or more bench records; each ratio is to
    `base` in the same record (the same run)."""
    cols: list[tuple[int, SpeedKey]] = []  # (record index, key without the label)
    per = [speeds(rec.rows) for rec in records]
    for i, sp in enumerate(per):
        cols += sorted({(i, ("", d, pp)) for (_, d, pp) in sp}, key=lambda c: (c[1][2], c[1][1]))
    n_prompt = max((int(r.get("n_prompt", 0)) for rec in records for r in rec.rows), default=0)
    head = [f"pp{n_prompt} t/s @ d={k[1]}" if k[2] else f"tg t/s @ d={k[1]}" for _, k in cols]
    out = ["| K/V | " + " | ".join(head) + " |", "|---|" + "---:|" * len(head)]
    for label in _labels([r for rec in records for r in rec.rows]):
        cells = [ratio_cell(per[i].get((label, d, pp)), per[i].get((base, d, pp)) if label != base else None)
                 for i, (_, d, pp) in cols]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def parallel_table(rec: Record, base: str = "f16") -> str:
    by = {(str(r["label"]), int(r["depth"])): r for r in rec.rows}
    depths = sorted({d for _, d in by})
    n = rec.rows[0]["n_parallel"] if rec.rows else 0
    head = [f"decode t/s, {n} seqs @ d={d}" for d in depths] + [f"prompt 0→{d} t/s" for d in depths]
    out = ["| K/V | " + " | ".join(head) + " | bpe | KV MiB (main + buffer) |", "|---|" + "---:|" * (len(head) + 2)]
    for label in _labels(rec.rows):
        cells = []
        for key in ("decode_tokens_per_s", "prompt_tokens_per_s"):
            for d in depths:
                b = by.get((base, d))
                cells.append(ratio_cell(float(by[(label, d)][key]),
                                        float(b[key]) if b is not None and label != base else None))
        last = by[(label, depths[-1])]
        cells += [f"{last['bpe']:.2f}", f"{last['kv_main_mib'] + last['kv_buffer_mib']:.1f}"]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def memory_table(by_model: dict[str, Record]) -> str:
    """KV MiB and bits per value at each model's full context, from its quality record (the
    main caches scaled to that context, the residual buffer as it is)."""
    models = list(by_model)
    head = [f"{MODEL_NAMES[m]}: KV MiB at {_full_ctx(m)} | bpe" for m in models]
    out = ["| K/V | " + " | ".join(head) + " |", "|---|" + "---:|---:|" * len(models)]
    for label in _labels([r for rec in by_model.values() for r in rec.rows]):
        cells = []
        for m in models:
            row = _row(by_model[m], label)
            cells.append(f"{row['kv_mib_full']:.1f} | {row['bpe_full']:.2f}" if row else f"{NONE} | {NONE}")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def bpe_at(row: dict[str, Any], ctx: int, ctx_full: int) -> float:
    """Bits per value at ctx tokens from a quality row: the main cache's bits plus the residual
    buffer's fixed slots spread over ctx cells (the row gives them spread over ctx_full)."""
    return (float(row["bpe_k"]) + float(row["bpe_v"])) / 2 + float(row["bpe_buffer_full"]) * ctx_full / ctx


def mode_table(records: dict[str, Record]) -> str:
    """README's "Choose a mode" block: the table and the lines that say where its numbers come from."""
    smol, gemma = records.get(quality_name("smollm2-135m-f32", 2048)), records.get(quality_name("gemma3-270m", 2048))
    speed = records.get(SPEED[0])
    sp = speeds(speed.rows) if speed else {}
    full = _full_ctx("smollm2-135m-f32")
    out = ["| mode | K / V | bits per value, 8K | bits per value, 32K | KLD vs f16, SmolLM2-F32 "
           f"| KLD vs f16, Gemma-3-270M | decode vs f16, depth {README_DEPTH} | pick it when |",
           "|---|---|---:|---:|---:|---:|---:|---|"]
    for name, label, cache, when in MODES:
        row = _row(smol, label)
        bits = [f"{bpe_at(row, c, full):.2f}" if row else NONE for c in (8192, 32768)]
        klds = [_kld(r) if r else NONE for r in (row, _row(gemma, label))]
        ts, base = sp.get((label, README_DEPTH, False)), sp.get(("f16", README_DEPTH, False))
        ratio = f"{ts / base:.2f}x" if ts and base else NONE
        out.append(f"| {name} | {cache} | {bits[0]} | {bits[1]} | {klds[0]} | {klds[1]} | {ratio} | {when} |")
    used = [r for r in (smol, gemma, speed) if r]
    out += ["", "Bits per value count every byte (codes, scales, the window's F16 rows spread over the context; "
            "SmolLM2's cache). KLD against an f16 cache at ctx 2048 on the project's corpus; decode speed of "
            "SmolLM2-135M Q4_1 in one llama-bench run beside f16. Gemma-3-270M is a Q4_K_M file, whose own "
            "rounding puts even q8_0 far above SmolLM2-F32's. Generated by `scripts/report.sh` from:",
            "", _sources(used) if used else "- no records yet: run `scripts/report.sh`",
            "", "Every table: [docs/results.md](docs/results.md)."]
    return "\n".join(out)


def _section(title: str, intro: str, records: Sequence[Record | None], table: str | None, missing: str) -> str:
    present = [r for r in records if r is not None]
    if table is None or not present:
        return f"### {title}\n\nNot measured yet: `scripts/report.sh` runs {missing}.\n"
    lead = f"{intro}\n\n" if intro else ""
    return f"### {title}\n\n{lead}{table}\n\nFrom:\n\n{_sources(present)}\n"


INTRO = """# Results

Generated by `scripts/report.sh` (`--quick` for a subset) from the JSON records in
[results-data/](results-data/), one per table, each holding a `kvcomp` command's rows and
the command line, date, CPU, SIMD level and threads it ran with, printed under its table.
A quick run replaces the records it measures (fewer chunks, configurations and depths,
marked "quick subset"); the other tables keep their own records, dates and commands from the
last run that measured them. Edit nothing here by hand: the next run rewrites the file, the
main job's section included (carried over as `scripts/main-job.sh` last wrote it).

Text: the offline corpus built from CPython's standard-library docstrings
(`ggml_kvcomp/corpus.py`). KLD is measured against an f16-KV run of the same build
(`llama-perplexity --kl-divergence-base`) over the second half of each chunk; bpe counts every
byte of the cache (codes, scales, the residual buffer's F16 slots spread over the context).
The modes run as `--kv-comp MODE` runs them (`:k3`: kvct K from the statistics the library
measures itself; `:k1`: from a statistics file calibrated on the corpus). Speed ratios are to
f16 in the same run; absolute t/s hold for that machine and load only ([tools.md](tools.md),
"Measuring").
"""


def _isa_sections(records: dict[str, Record]) -> list[str]:
    """One speed table per model for each build below the measuring machine's level."""
    out = []
    for isa, short, what, models in ISA_BUILDS:
        for i, model in enumerate(models):
            rec = records.get(isa_speed_name(isa, model))
            intro = (f"The CPU backend built for {what} on the same machine (`scripts/build-isa.sh {isa}`), "
                     "where kvct rows are decoded without VBMI; ratios to f16 of the same build and run."
                     if i == 0 else "")
            out.append(_section(f"{MODEL_NAMES[model]}, {short} build", intro, [rec],
                                speed_table([rec]) if rec else None, f"`{isa_speed_name(isa, model)}`"))
    return out


def render(records: dict[str, Record], main_section: str | None) -> str:
    parts = [INTRO, "## Quality\n",
             "Mean KLD, its 99th percentile, how often the top token agrees with the f16 run, and the\n"
             "perplexity ratio, per KV configuration; bpe at the measured context and at the model's\n"
             "full context.\n"]
    for model, ctx in QUALITY:
        rec = records.get(quality_name(model, ctx))
        parts.append(_section(f"{MODEL_NAMES[model]}, ctx {ctx}", "", [rec],
                              quality_table(rec.rows, _full_ctx(model)) if rec else None,
                              f"`{quality_name(model, ctx)}`"))
    parts += ["### The main job's table\n",
              "`scripts/main-job.sh` rewrites this block and [frontier.png](frontier.png) (KLD against bpe).\n",
              (main_section or "Not measured yet: run `scripts/main-job.sh`.") + "\n"]
    kld = {c: r for c in LONG_CTX if (r := records.get(long_name("long", c)))}
    needle = {c: r for c in LONG_CTX if (r := records.get(long_name("needle", c)))}
    parts += ["## Long context\n",
              _section(f"{MODEL_NAMES[LONG_MODEL]}, ctx {' and '.join(map(str, LONG_CTX))}",
                       "Mean KLD over one chunk of each context, and a passphrase hidden at 10%, 50% and 90% "
                       "of the context, asked for at the end (greedy, exact match; ✓ found).",
                       [*kld.values(), *needle.values()], long_table(kld, needle) if kld or needle else None,
                       ", ".join(f"`{long_name(k, c)}`" for k in ("long", "needle") for c in LONG_CTX))]
    sp = [r for n in SPEED if (r := records.get(n))]
    par = records.get(PARALLEL)
    parts += ["## Speed\n",
              _section(f"Decode and prompt, {MODEL_NAMES['smollm2-135m']}",
                       "llama-bench tokens/s: decode (tg) at each depth and a 512-token prompt at depth 4096, "
                       "in parentheses the ratio to f16 in the same run.",
                       sp, speed_table(sp) if sp else None, ", ".join(f"`{n}`" for n in SPEED)),
              *_isa_sections(records),
              _section(f"Parallel decode, {MODEL_NAMES['synth-kv8x128']}",
                       "A 7-8B model's attention (8 KV heads of 128) in 4 small layers, so that KV reads bound "
                       "a step: sequences decoding together after a shared prompt, each in its own stream "
                       "(llama-batched-bench -pps), ratios to f16 in the same run.",
                       [par], parallel_table(par) if par else None, f"`{PARALLEL}`")]
    def largest(model: str) -> Record | None:  # any context's run gives the full context's MiB
        ctxs = sorted((c for m, c in QUALITY if m == model), reverse=True)
        return next((rec for c in ctxs if (rec := records.get(quality_name(model, c)))), None)

    by_model = {m: rec for m in dict.fromkeys(m for m, _ in QUALITY) if (rec := largest(m))}
    parts += ["## Memory at full context\n",
              _section("KV cache per configuration",
                       "The main caches scaled to the model's full context, the residual buffer as it is "
                       "(its slots do not grow with the context), from the quality runs' logs.",
                       list(by_model.values()), memory_table(by_model) if by_model else None,
                       "the quality steps")]
    return "\n".join(parts).rstrip() + "\n"


def write(records: dict[str, Record], results: Path, readme: Path | None) -> None:
    old = results.read_text(encoding="utf-8") if results.exists() else ""
    results.write_text(render(records, marked(old, MAIN_SECTION)), encoding="utf-8")
    if readme is not None:
        readme.write_text(replace_block(readme.read_text(encoding="utf-8"), README_BLOCK, mode_table(records)),
                          encoding="utf-8")
