"""The runs behind docs/results.md: one JSON record per table, holding a `kvcomp` command's
`--json` rows with the command line, date, machine and wall time that the report prints
beside the table. Records are kept in docs/results-data/, so a partial run (`scripts/report.sh
--quick`) replaces only its own tables and the others keep their own date and command."""

from __future__ import annotations

import ctypes
import datetime
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Machine:
    """Where a record was measured: what a reader needs to compare speed ratios."""

    cpu: str  # /proc/cpuinfo's model name
    simd: str  # the widest SIMD level the CPU offers, or "<level> build" for a build below it
    cores: int


@dataclass(frozen=True)
class Record:
    name: str  # the file's stem; the report looks records up by it
    kind: str  # kld, bench, parallel or needle: the shape of `rows`
    command: str  # the command line, as a user would type it
    date: str  # ISO day of the run
    machine: Machine
    threads: int
    seconds: float  # wall time of the command
    quick: bool  # measured by `scripts/report.sh --quick` (fewer chunks, configurations, depths)
    rows: list[dict[str, Any]] = field(default_factory=list)


# narrowest first
SIMD_LEVELS = ("no AVX2", "AVX2", "AVX-512", "AVX-512 VBMI")


def simd_level(flags: set[str]) -> str:
    if "avx512vbmi" in flags:
        return "AVX-512 VBMI"
    if "avx512f" in flags:
        return "AVX-512"
    return "AVX2" if "avx2" in flags else "no AVX2"


def parse_cpuinfo(text: str, cores: int) -> Machine:
    def first(key: str) -> str:
        return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith(key)), "")

    return Machine(cpu=first("model name") or platform.machine(), simd=simd_level(set(first("flags").split())),
                   cores=cores)


def build_simd_level(cpu_lib: Path) -> str | None:
    """The widest SIMD level a CPU backend library was compiled for (its ggml_cpu_has_*
    functions report the compiler's flags); None where it cannot be loaded."""
    try:
        lib = ctypes.CDLL(str(cpu_lib))
    except OSError:
        return None
    for fn, level in (("ggml_cpu_has_avx512_vbmi", "AVX-512 VBMI"), ("ggml_cpu_has_avx512", "AVX-512"),
                      ("ggml_cpu_has_avx2", "AVX2")):
        if getattr(lib, fn)():
            return level
    return SIMD_LEVELS[0]


def with_build(m: Machine, built: str | None) -> Machine:
    """The machine as a build below the CPU's own level runs it: speed is the build's."""
    if built is None or m.simd not in SIMD_LEVELS or SIMD_LEVELS.index(built) >= SIMD_LEVELS.index(m.simd):
        return m
    return replace(m, simd=f"{built} build")


def this_machine(cpu_lib: Path | None = None) -> Machine:
    """This machine; with cpu_lib (the CPU backend the tools load), the SIMD level they run at."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    m = parse_cpuinfo(text, os.cpu_count() or 0)
    return with_build(m, build_simd_level(cpu_lib) if cpu_lib is not None else None)


def kind_of(argv: Sequence[str]) -> str:
    """The record kind of a `kvcomp` command line: its subcommand, `parallel` for bench --parallel."""
    kind = argv[0] if argv else ""
    if kind not in ("kld", "bench", "needle"):
        raise ValueError(f"a report record runs `kvcomp kld`, `bench` or `needle`, got {kind!r}")
    return "parallel" if kind == "bench" and "--parallel" in argv else kind


def measure(name: str, argv: Sequence[str], threads: int, quick: bool, command: str,
            run: Callable[[list[str]], int], cpu_lib: Path | None = None) -> Record:
    """Runs a `kvcomp` command (run: the CLI's main) with --json into a temporary file and
    wraps its rows into a record (the SIMD level that of cpu_lib's build, where given)."""
    kind = kind_of(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        start = time.monotonic()
        rc = run([*argv, "--json", str(out)])
        seconds = time.monotonic() - start
        if rc != 0 or not out.exists():
            raise RuntimeError(f"{command} failed (exit {rc})")
        rows = json.loads(out.read_text())
    return Record(name=name, kind=kind, command=command, date=datetime.date.today().isoformat(),
                  machine=this_machine(cpu_lib), threads=threads, seconds=round(seconds, 1), quick=quick, rows=rows)


def save(record: Record, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{record.name}.json"
    path.write_text(json.dumps(asdict(record), indent=1) + "\n")
    return path


def from_dict(d: dict[str, Any]) -> Record:
    return Record(**{**d, "machine": Machine(**d["machine"])})


def load_all(folder: Path) -> dict[str, Record]:
    """Every record in the folder by name (none when the folder is absent)."""
    if not folder.is_dir():
        return {}
    return {p.stem: from_dict(json.loads(p.read_text())) for p in sorted(folder.glob("*.json"))}
