"""The `kvcomp` command: side-by-side KLD and decode-speed runs on a packaged model."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import (
    bench,
    calibrate,
    corpus,
    export,
    layers,
    models,
    needle,
    paths,
    perplexity,
    plots,
    regress,
    report,
    reportdata,
    reportgen,
    steps,
)
from .kvtypes import DEFAULT_CONFIGS, KvConfig


def _configs(spec: str | None) -> list[KvConfig]:
    if not spec:
        return list(DEFAULT_CONFIGS)
    return [KvConfig.parse(s) for s in spec.split(",") if s]


def _depths(spec: str) -> list[int]:
    try:
        depths = [int(d) for d in spec.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"depths must be comma-separated integers, got {spec!r}") from None
    if any(d < 0 for d in depths):
        raise argparse.ArgumentTypeError("depths must be >= 0")
    return depths


def _positive(v: str) -> int:
    n = int(v)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return n


def _command_line(argv: Sequence[str]) -> str:
    return "kvcomp " + " ".join(shlex.quote(a) for a in argv)


def _cpu_lib() -> Path | None:
    """The CPU backend the tools load, where it is there."""
    lib = paths.bin_dir() / "libggml-cpu.so"
    return lib if lib.exists() else None


def _cpu() -> str:
    """The CPU's name and the SIMD level the tools run at (the CPU's widest, or a build's below it)."""
    m = reportdata.this_machine(_cpu_lib())
    return f"{m.cpu}, {m.simd}"


def _machine() -> str:
    day = datetime.date.today().isoformat()
    return f"{day}, {_cpu()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def _emit(args: argparse.Namespace, argv: Sequence[str], table: str, rows: list[dict[str, Any]],
          section: str, heading: str, context: str) -> None:
    """Prints the table and writes the JSON file and the results section the user asked for."""
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    _write_section(args, argv, table, section, heading, context)


def _write_section(args: argparse.Namespace, argv: Sequence[str], table: str, section: str, heading: str,
                   context: str) -> None:
    """Rewrites this run's section of the markdown file given with --results, if any."""
    if args.results:
        body = f"### {heading}\n\nCommand: `{_command_line(argv)}` ({context}{_machine()}).\n\n{table}\n"
        report.replace_section(Path(args.results), section, body)


def _section_suffix(configs: Sequence[KvConfig]) -> str:
    """Runs of modes or the tracker, of the buffer, and of plain types keep separate sections."""
    if any(c.mode is not None or c.tracker for c in configs):
        return "-modes"
    return "-buffer" if any(c.buffered for c in configs) else ""


# named context sizes of `kvcomp ppl/kld --ctx`
CONTEXTS = {"short": 512, "medium": 2048, "long": 8192}


def _contexts(spec: str) -> list[int]:
    out = []
    for part in spec.split(","):
        part = part.strip()
        value = CONTEXTS.get(part) or (int(part) if part.isdigit() else 0)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"a context is short, medium, long or a positive number, got {part!r}")
        out.append(value)
    return out


def _progress(command: str, i: int, n: int, what: str) -> None:
    width = 20
    done = width * i // n
    print(f"kvcomp {command}: [{'#' * done}{'.' * (width - done)}] {i + 1}/{n} {what} ...", file=sys.stderr,
          flush=True)


def _run_kld_all(args: argparse.Namespace, argv: Sequence[str], ppl_only: bool) -> int:
    model = models.MODELS[args.model]
    contexts = [c for c in args.ctx if c <= model.ctx_train]
    for c in args.ctx:
        if c > model.ctx_train:
            print(f"kvcomp: skipping ctx {c}: {args.model} was trained for {model.ctx_train}", file=sys.stderr)
    configs = _configs(args.configs)
    rows: list[dict[str, Any]] = []
    tables = []
    n, i = len(contexts) * len(configs), 0
    for ctx in contexts:
        settings = perplexity.RunSettings(
            model=models.fetch_model(args.model), corpus=corpus.corpus_file(heldout=args.heldout),
            ctx=ctx, chunks=args.chunks, threads=args.threads, n_gpu_layers=args.ngl, ctx_full=model.ctx_train,
        )
        results = []
        for cfg in configs:
            _progress(args.command, i, n, f"ctx {ctx} {cfg.label}")
            i += 1
            results.append(perplexity.run_kld(cfg, settings, by_token=not ppl_only and args.by_token))
        rows += [{"ctx": ctx, **r.as_dict()} for r in results]
        table = report.ppl_table(results) if ppl_only else report.kld_table(results)
        what = "Perplexity with each KV cache" if ppl_only else "KLD vs f16 KV"
        offload = f", -ngl {args.ngl}" if args.ngl else ""
        text = ", held-out text" if args.heldout else ""
        heading = f"{what}, {args.model}, ctx {ctx}, {args.chunks} chunks, {args.threads} threads{offload}{text}"
        section = args.section or f"{args.command}-{args.model}-ctx{ctx}" + ("-heldout" if args.heldout else "") + \
            _section_suffix(configs)
        _write_section(args, argv, table, section, heading, f"corpus `{settings.corpus.name}`, ")
        tables.append(f"### {heading}\n\n{table}")
    print("\n\n".join(tables))
    if not ppl_only and args.frontier and rows:
        last = [r for r in rows if r["ctx"] == contexts[-1]]
        plots.frontier(last, Path(args.frontier), f"{args.model}, ctx {contexts[-1]}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


def cmd_kld(args: argparse.Namespace, argv: Sequence[str]) -> int:
    return _run_kld_all(args, argv, ppl_only=False)


def cmd_ppl(args: argparse.Namespace, argv: Sequence[str]) -> int:
    return _run_kld_all(args, argv, ppl_only=True)


def cmd_bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if args.parallel and args.rounds > 1:
        raise ValueError("--rounds runs llama-bench; --parallel runs llama-batched-bench once a configuration")
    if args.parallel:
        return _bench_parallel(args, argv)
    model = models.fetch_model(args.model)
    configs = _configs(args.configs)
    depths = args.depths or [0, 4096]

    def run(cfg: KvConfig) -> list[bench.BenchResult]:
        print(f"kvcomp bench: {cfg.label} ...", file=sys.stderr, flush=True)
        return bench.run_bench(cfg, model, depths, args.n_gen, args.threads, args.reps, args.n_prompt, args.ngl)

    results = bench.run_rounds(configs, args.rounds, run)
    prefill = f" -p {args.n_prompt}" if args.n_prompt else ""
    offload = f", -ngl {args.ngl}" if args.ngl else ""
    heading = (f"Decode speed, {args.model}, llama-bench -fa 1 -n {args.n_gen}{prefill}, {args.threads} threads"
               f"{offload}")
    section = f"bench-{args.model}" + _section_suffix(configs)
    table = bench.rounds_table(results) if args.rounds > 1 else bench.bench_table(results)
    _emit(args, argv, table, [asdict(r) for r in results], section, heading, "")
    return 0


def _bench_parallel(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """`kvcomp bench --parallel N`: N sequences decoding together (llama-batched-bench)."""
    if args.n_prompt:
        raise ValueError("--n-prompt does not apply with --parallel: its prompt column is the fill to each depth")
    depths = args.depths or [2048, 4096]
    if min(depths) < 1:
        raise ValueError("--parallel decodes after a prompt: give --depths of 1 or more (e.g. 2048,4096)")
    model = models.fetch_model(args.model)
    configs = _configs(args.configs)
    results = []
    for cfg in configs:
        print(f"kvcomp bench: {cfg.label}, {args.parallel} sequences ...", file=sys.stderr, flush=True)
        results.extend(bench.run_parallel(cfg, model, depths, args.n_gen, args.parallel, args.threads, args.ngl))
    offload = f", -ngl {args.ngl}" if args.ngl else ""
    n_ctx = bench.parallel_ctx(depths, args.n_gen, args.parallel)
    heading = (f"Parallel decode, {args.model}, {args.parallel} sequences, llama-batched-bench -pps -fa on "
               f"-c {n_ctx} -ntg {args.n_gen}, {args.threads} threads{offload}")
    section = f"bench-parallel{args.parallel}-{args.model}" + _section_suffix(configs)
    _emit(args, argv, bench.parallel_table(results), [asdict(r) for r in results], section, heading, "")
    return 0


def cmd_steps(args: argparse.Namespace, argv: Sequence[str]) -> int:
    model = models.fetch_model(args.model)
    results = []
    configs = _configs(args.configs)
    for cfg in configs:
        print(f"kvcomp steps: {cfg.label} ...", file=sys.stderr, flush=True)
        results.append(steps.run_steps(cfg, model, args.depth, args.n_gen, args.threads, ops=args.ops))
    heading = (f"Per-step decode latency, {args.model}, depth ~{args.depth}, {args.n_gen} steps, "
               f"{args.threads} threads" + (", every node timed on its own" if args.ops else ""))
    _emit(args, argv, steps.steps_table(results), [asdict(r) for r in results],
          f"steps-{args.model}" + _section_suffix(configs), heading, "")
    return 0


def cmd_profile(args: argparse.Namespace, argv: Sequence[str]) -> int:
    settings = perplexity.RunSettings(
        model=models.fetch_model(args.model), corpus=corpus.corpus_file(),
        ctx=args.ctx, chunks=args.chunks, threads=args.threads,
    )
    profile = perplexity.run_profile(settings)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(profile, indent=2) + "\n")
    print(f"kvcomp profile: {args.model}: f16-KV perplexity {profile['ppl']} -> {out}")
    return 0


def cmd_calibrate(args: argparse.Namespace, argv: Sequence[str]) -> int:
    model = Path(args.model_file) if args.model_file else models.fetch_model(args.model)
    if not model.is_file():
        raise FileNotFoundError(f"{model}: no such model file")
    out = Path(args.out) if args.out else calibrate.kstats_path(model)
    text = Path(args.text) if args.text else None
    calibrate.calibrate(model, out, ctx=args.ctx, chunks=args.chunks, threads=args.threads, text=text)
    print(f"kvcomp calibrate: {model.name}: K statistics -> {out} (load with --kv-comp-kstats {out})")
    if args.layers is not None:
        prof = Path(args.layers) if args.layers else layers.profile_path(model)
        costs = layers.measure(model, text, threads=args.threads)
        k_down, v_up = layers.write(prof, costs)
        if not costs.additive:
            print(f"kvcomp calibrate: {model.name}: the single-layer costs do not add up (sums "
                  f"{costs.k_sum_ratio:.2f}x and {costs.v_sum_ratio:.2f}x the whole for K and V): the profile takes "
                  "the fixed rule's layers")
        print(f"kvcomp calibrate: {model.name}: kvct3 K in layers {k_down}, kvc4 V in layers {v_up} -> {prof} "
              f"(load with --kv-comp-layers {prof})")
    return 0


def cmd_regress(args: argparse.Namespace, argv: Sequence[str]) -> int:
    path = Path(args.baseline)
    if args.write:
        labels = [c.label for c in _configs(args.configs)]
        results = regress.measure(args.model, args.ctx, args.chunks, labels, args.threads)
        regress.write_baseline(path, args.model, args.ctx, args.chunks, results, args.tolerance)
        print(f"kvcomp regress: wrote {len(labels)} limits for {args.model} ctx {args.ctx} to {path}")
        return 0
    checks = regress.check(regress.load(path), args.threads)
    print(regress.table(checks))
    bad = [c for c in checks if not c.ok]
    for c in bad:
        print(f"kvcomp regress: REGRESSED: {c.model} ctx {c.ctx} {c.config}: {c.metric} {c.value:.6f} > limit "
              f"{c.limit:.6f}", file=sys.stderr)
    return 1 if bad else 0


def cmd_export(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if (args.url is None) == (args.snapshot is None):
        raise ValueError("give one source: --url of a llama-server with --metrics, or --snapshot FILE.json")
    if args.url:
        text = export.fetch(args.url, "prometheus" if args.format == "prometheus" else "json")
        out = text if args.format == "prometheus" else export.convert(text, args.format)
    else:
        out = export.convert(Path(args.snapshot).read_text(), args.format)
    if args.out:
        Path(args.out).write_text(out)
    else:
        sys.stdout.write(out)
    return 0


def cmd_report(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if args.data:
        readme = None if args.readme == "" else Path(args.readme)
        reportgen.write(reportdata.load_all(Path(args.data)), Path(args.results), readme)
        print(f"kvcomp report: {args.results}" + (f", {readme}" if readme else ""))
        return 0
    if not args.out:
        raise ValueError("give --out FOLDER (plots of --kld/--bench/--snapshot) or --data FOLDER (docs/results.md)")

    def path(p: str | None) -> Path | None:
        return Path(p) if p else None

    out = plots.write_report(Path(args.out), path(args.kld), path(args.bench), path(args.snapshot))
    print(f"kvcomp report: {out}")
    return 0


def cmd_record(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Runs one `kvcomp kld/bench/needle` command and keeps its rows as a report record."""
    inner = list(args.kvcomp)
    if inner[:1] == ["--"]:
        inner = inner[1:]
    threads = int(build_parser().parse_args(inner).threads)
    rec = reportdata.measure(args.name, inner, threads, args.quick, _command_line(inner), main, _cpu_lib())
    print(f"kvcomp record: {reportdata.save(rec, Path(args.data))} ({rec.seconds:.0f} s)")
    return 0


def _fractions(spec: str) -> list[float]:
    try:
        values = [float(x) for x in spec.split(",")]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected fractions like 0.1,0.5,0.9, got {spec!r}") from e
    if not values or any(not 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"depths are fractions of the context in [0, 1], got {spec!r}")
    return values


def cmd_needle(args: argparse.Namespace, argv: Sequence[str]) -> int:
    model = models.fetch_model(args.model)
    filler = corpus.corpus_file().read_text(encoding="utf-8")
    results = []
    for cfg in _configs(args.configs):
        print(f"kvcomp needle: {cfg.label} ...", file=sys.stderr, flush=True)
        results.extend(needle.run_needle(cfg, model, filler, args.ctx, args.depths, args.threads))
    heading = f"Needle retrieval, {args.model}, ctx {args.ctx}, greedy, exact match"
    _emit(args, argv, needle.needle_table(results), [asdict(r) for r in results],
          f"needle-{args.model}-ctx{args.ctx}", heading, "")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvcomp", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--model", default=models.DEFAULT_MODEL, choices=sorted(models.MODELS))
        sp.add_argument("--configs", help="comma-separated K/V types, 'k/v' for a mixed pair, or a mode "
                        "(off, low-latency, balanced, high-precision); knobs as ':w32' window, ':s4' sinks, "
                        "':n8' merge interval, ':p0.1' pin threshold, ':b2' pin budget (%%), ':t1' scale tracker, "
                        "':m0' monitor off, with a mode ':k1' the model's K statistics measured on the corpus (':k2' "
                        "and its layer profile, ':k3' the ones the library measures itself, as `--kv-comp MODE` runs), "
                        "':l0'/':l1' the per-layer K rule same/edges "
                        "(default: f16,q8_0,q4_0,iq4_nl,kvc8,kvc4,kvc3,kvc2,kvc8/kvc4)")
        sp.add_argument("--threads", type=_positive, default=2)
        sp.add_argument("--ngl", type=int, default=0, help="layers to offload to a GPU (-ngl; 0: CPU only)")
        sp.add_argument("--json", help="also write the results as JSON to this file")
        sp.add_argument("--results", help="rewrite this run's section of a markdown file (docs/results.md)")

    for name, func, text in (("kld", cmd_kld, "PPL ratio, KLD and same-top-p against an f16-KV base run"),
                             ("ppl", cmd_ppl, "perplexity and its ratio to the f16-KV run, per configuration")):
        sp = sub.add_parser(name, help=text)
        common(sp)
        sp.add_argument("--ctx", type=_contexts, default=[512],
                        help="context sizes: short (512), medium (2048), long (8192) or numbers, comma-separated; "
                             "sizes beyond the model's training context are skipped")
        sp.add_argument("--chunks", type=_positive, default=16)
        sp.add_argument("--heldout", action="store_true",
                        help="measure on the held-out text (standard-library modules the corpus does not read) "
                             "instead of the corpus")
        sp.add_argument("--section", help="with --results: the name of the section to rewrite (default: by command, "
                        "model, context and whether modes, the buffer or plain types were run)")
        if name == "kld":
            sp.add_argument("--frontier", metavar="PNG",
                            help="also plot KLD against bpe (the last context) to this file")
            sp.add_argument("--by-token", action="store_true",
                            help="also run every configuration with one decode per token (-ub 1, teacher-forced, as "
                                 "generation computes each token) and report that KLD beside the batched one")
        sp.set_defaults(func=func)

    bn = sub.add_parser("bench", help="llama-bench decode speed at several depths; --parallel: N sequences together")
    common(bn)
    bn.add_argument("--depths", type=_depths, help="default 0,4096 (with --parallel 2048,4096)")
    bn.add_argument("--n-gen", type=_positive, default=32, help="tokens generated (per sequence with --parallel)")
    bn.add_argument("--n-prompt", type=int, default=0, help="also measure prefill of this many tokens (pp)")
    bn.add_argument("--reps", type=_positive, default=2, help="llama-bench repetitions (one run with --parallel)")
    bn.add_argument("--rounds", type=_positive, default=1,
                    help="run every configuration once a round, this many rounds, and give each one's per-round "
                         "speed ratio to the first configuration (for machines whose speed drifts)")
    bn.add_argument("--parallel", type=_positive, default=0, metavar="N",
                    help="N sequences decoding together after a prompt of each depth, each in its own stream of "
                         "a split cache, as a server batches its slots (llama-batched-bench -pps -npl N)")
    bn.set_defaults(func=cmd_bench)

    st = sub.add_parser("steps", help="per-step decode latency, steps with and without a residual-buffer merge")
    common(st)
    st.add_argument("--depth", type=_positive, default=4096)
    st.add_argument("--n-gen", type=_positive, default=64)
    st.add_argument("--ops", action="store_true",
                    help="also time each graph node on its own (slower steps; the attention node's own time)")
    st.set_defaults(func=cmd_steps)

    nd = sub.add_parser("needle", help="a fact hidden at several depths of filler text, exact-match retrieval")
    common(nd)
    nd.add_argument("--ctx", type=_positive, default=2048)
    nd.add_argument("--depths", type=_fractions, default=[0.1, 0.5, 0.9])
    nd.set_defaults(func=cmd_needle)

    rg = sub.add_parser("regress", help="compare KLD and PPL ratio with a committed baseline; exit 1 on regression")
    rg.add_argument("--baseline", default="regress/baseline.json")
    rg.add_argument("--threads", type=_positive, default=2)
    rg.add_argument("--write", action="store_true", help="measure and (re)write this model and context's limits")
    rg.add_argument("--model", default=models.DEFAULT_MODEL, choices=sorted(models.MODELS))
    rg.add_argument("--configs", help="with --write: the configurations to gate (as for kld)")
    rg.add_argument("--ctx", type=_positive, default=512)
    rg.add_argument("--chunks", type=_positive, default=4)
    rg.add_argument("--tolerance", type=float, default=regress.DEFAULT_TOLERANCE)
    rg.set_defaults(func=cmd_regress)

    ex = sub.add_parser("export", help="a monitor snapshot to JSON, CSV or Prometheus text")
    ex.add_argument("--url", help="a llama-server started with --metrics (reads its /kvcomp)")
    ex.add_argument("--snapshot", help="a JSON snapshot saved earlier")
    ex.add_argument("--format", choices=export.FORMATS, default="json")
    ex.add_argument("--out", help="file to write (default: standard output)")
    ex.set_defaults(func=cmd_export)

    rp = sub.add_parser("report", help="markdown report with PNG plots from kld/bench JSON and a monitor snapshot")
    rp.add_argument("--kld", help="JSON of `kvcomp kld --json` (KLD vs bpe frontier)")
    rp.add_argument("--bench", help="JSON of `kvcomp bench --json` (decode t/s vs depth)")
    rp.add_argument("--snapshot", help="a monitor snapshot (per-layer K RMSE heatmap)")
    rp.add_argument("--out", help="folder for report.md and the PNGs")
    rp.add_argument("--data", help="render docs/results.md from the records in this folder (`kvcomp record`) "
                    "instead")
    rp.add_argument("--results", default="docs/results.md", help="with --data: the report to (re)write")
    rp.add_argument("--readme", default="README.md",
                    help="with --data: the file whose mode-table block to rewrite ('': none)")
    rp.set_defaults(func=cmd_report)

    rc = sub.add_parser("record", help="run `kvcomp kld/bench/needle ...` and keep its rows, command, date and "
                        "machine as a record for `kvcomp report --data`")
    rc.add_argument("--name", required=True, help="the record's name (its table in the report)")
    rc.add_argument("--data", default="docs/results-data", help="the folder of records")
    rc.add_argument("--quick", action="store_true", help="mark the record as measured by a quick run")
    rc.add_argument("kvcomp", nargs=argparse.REMAINDER, help="-- then the kvcomp command line, e.g. -- kld ...")
    rc.set_defaults(func=cmd_record)

    pr = sub.add_parser("profile", help="calibration profile (f16-KV perplexity) for llama-server --kv-comp-baseline")
    pr.add_argument("--model", default=models.DEFAULT_MODEL, choices=sorted(models.MODELS))
    pr.add_argument("--threads", type=_positive, default=2)
    pr.add_argument("--ctx", type=_positive, default=512)
    pr.add_argument("--chunks", type=_positive, default=8)
    pr.add_argument("--out", required=True, help="the JSON file to write")
    pr.set_defaults(func=cmd_profile)

    ca = sub.add_parser("calibrate", help="K statistics of a model for the kvct K types (--kv-comp-kstats FILE)")
    ca.add_argument("--model", default=models.DEFAULT_MODEL, choices=sorted(models.MODELS))
    ca.add_argument("-m", "--model-file", help="a GGUF file instead of a bundled model")
    ca.add_argument("--text", help="text to measure on (default: the end of the bundled corpus)")
    ca.add_argument("--threads", type=_positive, default=2)
    ca.add_argument("--ctx", type=_positive, default=512)
    ca.add_argument("--chunks", type=_positive, default=24)
    ca.add_argument("--out", help="the GGUF file to write (default: the cache, where kvcomp kld/bench find it)")
    ca.add_argument("--layers", nargs="?", const="", default=None, metavar="FILE",
                    help="also measure each layer's cost of a K bit and saving of a V bit (llama-kvcomp-ksim, about "
                         "4 minutes for a 135M model) and write the per-layer profile (--kv-comp-layers; default: "
                         "the cache, where kvcomp kld/bench find it for ':k2')")
    ca.set_defaults(func=cmd_calibrate)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args, argv))
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        print(f"kvcomp: error: {e}", file=sys.stderr)
        return 1
