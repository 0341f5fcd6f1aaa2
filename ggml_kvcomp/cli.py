"""The `kvcomp` command: side-by-side KLD and decode-speed runs on a packaged model."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import bench, corpus, models, perplexity, report, steps
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


def _machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def _emit(args: argparse.Namespace, argv: Sequence[str], table: str, rows: list[dict[str, Any]],
          section: str, heading: str, context: str) -> None:
    """Prints the table and writes the JSON file and the results section the user asked for."""
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    if args.results:
        body = f"### {heading}\n\nCommand: `{_command_line(argv)}` ({context}{_machine()}).\n\n{table}\n"
        report.replace_section(Path(args.results), section, body)


def _section_suffix(configs: Sequence[KvConfig]) -> str:
    """Runs of modes or the tracker, of the buffer, and of plain types keep separate sections."""
    if any(c.mode is not None or c.tracker for c in configs):
        return "-modes"
    return "-buffer" if any(c.buffered for c in configs) else ""


def cmd_kld(args: argparse.Namespace, argv: Sequence[str]) -> int:
    settings = perplexity.RunSettings(
        model=models.fetch_model(args.model), corpus=corpus.corpus_file(),
        ctx=args.ctx, chunks=args.chunks, threads=args.threads,
    )
    configs = _configs(args.configs)
    results = []
    for cfg in configs:
        print(f"kvcomp kld: {cfg.label} ...", file=sys.stderr, flush=True)
        results.append(perplexity.run_kld(cfg, settings))
    heading = f"KLD vs f16 KV, {args.model}, ctx {args.ctx}, {args.chunks} chunks, {args.threads} threads"
    section = f"kld-{args.model}-ctx{args.ctx}" + _section_suffix(configs)
    _emit(args, argv, report.kld_table(results), [r.as_dict() for r in results],
          section, heading, f"corpus `{settings.corpus.name}`, ")
    return 0


def cmd_bench(args: argparse.Namespace, argv: Sequence[str]) -> int:
    model = models.fetch_model(args.model)
    results = []
    configs = _configs(args.configs)
    for cfg in configs:
        print(f"kvcomp bench: {cfg.label} ...", file=sys.stderr, flush=True)
        results.extend(bench.run_bench(cfg, model, args.depths, args.n_gen, args.threads, args.reps))
    heading = f"Decode speed, {args.model}, llama-bench -fa 1 -n {args.n_gen}, {args.threads} threads"
    section = f"bench-{args.model}" + _section_suffix(configs)
    _emit(args, argv, bench.bench_table(results), [asdict(r) for r in results], section, heading, "")
    return 0


def cmd_steps(args: argparse.Namespace, argv: Sequence[str]) -> int:
    model = models.fetch_model(args.model)
    results = []
    configs = _configs(args.configs)
    for cfg in configs:
        print(f"kvcomp steps: {cfg.label} ...", file=sys.stderr, flush=True)
        results.append(steps.run_steps(cfg, model, args.depth, args.n_gen, args.threads))
    heading = (f"Per-step decode latency, {args.model}, depth ~{args.depth}, {args.n_gen} steps, "
               f"{args.threads} threads")
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvcomp", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--model", default=models.DEFAULT_MODEL, choices=sorted(models.MODELS))
        sp.add_argument("--configs", help="comma-separated K/V types, 'k/v' for a mixed pair, or a mode "
                        "(off, low-latency, balanced, high-precision); knobs as ':w32' window, ':s4' sinks, "
                        "':n8' merge interval, ':p0.1' pin threshold, ':b2' pin budget (%%), ':t1' scale tracker, "
                        "':m0' monitor off "
                        "(default: f16,q8_0,q4_0,iq4_nl,kvc8,kvc4,kvc3,kvc2,kvc8/kvc4)")
        sp.add_argument("--threads", type=_positive, default=2)
        sp.add_argument("--json", help="also write the results as JSON to this file")
        sp.add_argument("--results", help="rewrite this run's section of a markdown file (docs/results.md)")

    kld = sub.add_parser("kld", help="PPL ratio, KLD and same-top-p against an f16-KV base run")
    common(kld)
    kld.add_argument("--ctx", type=_positive, default=512)
    kld.add_argument("--chunks", type=_positive, default=16)
    kld.set_defaults(func=cmd_kld)

    bn = sub.add_parser("bench", help="llama-bench decode speed at several depths")
    common(bn)
    bn.add_argument("--depths", type=_depths, default=[0, 4096])
    bn.add_argument("--n-gen", type=_positive, default=32)
    bn.add_argument("--reps", type=_positive, default=2)
    bn.set_defaults(func=cmd_bench)

    st = sub.add_parser("steps", help="per-step decode latency, steps with and without a residual-buffer merge")
    common(st)
    st.add_argument("--depth", type=_positive, default=4096)
    st.add_argument("--n-gen", type=_positive, default=64)
    st.set_defaults(func=cmd_steps)

    pr = sub.add_parser("profile", help="calibration profile (f16-KV perplexity) for llama-server --kv-comp-baseline")
    pr.add_argument("--model", default=models.DEFAULT_MODEL, choices=sorted(models.MODELS))
    pr.add_argument("--threads", type=_positive, default=2)
    pr.add_argument("--ctx", type=_positive, default=512)
    pr.add_argument("--chunks", type=_positive, default=8)
    pr.add_argument("--out", required=True, help="the JSON file to write")
    pr.set_defaults(func=cmd_profile)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args, argv))
    except (RuntimeError, ValueError, FileNotFoundError) as e:
        print(f"kvcomp: error: {e}", file=sys.stderr)
        return 1
