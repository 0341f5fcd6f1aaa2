"""`kvcomp bench --parallel`: llama-batched-bench's command line, its JSONL rows, and a tiny
real run of two sequences in a split cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from ggml_kvcomp import bench
from ggml_kvcomp.kvtypes import KvConfig

# SmolLM2-135M: 30 layers, K and V of 3 heads x 64, f16
SMOLLM2_F16_BYTES_PER_CELL = 30 * 2 * 3 * 64 * 2


@pytest.mark.parametrize("depths, n_gen, n_parallel, want", [
    ([2048, 4096], 32, 8, 8 * 4352),  # each stream padded to 256 cells
    ([4096], 32, 1, 4352),
    ([64], 4, 2, 2 * 256),
    ([256], 1, 2, 2 * 512),
])
def test_context_holds_every_stream(depths: list[int], n_gen: int, n_parallel: int, want: int) -> None:
    assert bench.parallel_ctx(depths, n_gen, n_parallel) == want


@pytest.mark.parametrize("spec, tail", [
    ("f16", ["-ctk", "f16", "-ctv", "f16"]),
    ("kvc4", ["-ctk", "kvc4", "-ctv", "kvc4"]),
    ("kvc8/kvc4", ["-ctk", "kvc8", "-ctv", "kvc4"]),
    ("balanced", ["--kv-comp", "balanced"]),
    ("balanced:w64", ["--kv-comp", "balanced", "--kv-comp-window", "64"]),
])
def test_command_line(bins: Path, spec: str, tail: list[str]) -> None:
    args = bench.parallel_args(KvConfig.parse(spec), Path("m.gguf"), [128, 64], 4, 2, 3)
    assert Path(args[0]).name == "llama-batched-bench"

    def value(flag: str) -> str:
        return args[args.index(flag) + 1]

    got = (value("-m"), value("-npp"), value("-ntg"), value("-npl"), value("-t"))
    assert got == ("m.gguf", "64,128", "4", "2", "3")
    assert value("-c") == str(2 * 256) and value("-fa") == "on" and value("--output-format") == "jsonl"
    assert "-pps" in args and "--kv-unified" not in args  # shared prompt, split cache
    joined = " ".join(args)
    assert " ".join(tail) in joined


@pytest.mark.parametrize("depths", [[0], [0, 2048], []])
def test_depth_zero_refused(bins: Path, depths: list[int]) -> None:
    with pytest.raises(ValueError, match="depths must be >= 1"):
        bench.parallel_args(KvConfig.parse("f16"), Path("m.gguf"), depths, 4, 2, 2)


SAMPLE = """
main: n_kv_max = 1024, n_batch = 2048
{"pp": 64, "tg": 4, "pl": 2, "n_kv": 136, "t_pp": 0.1, "speed_pp": 640.0, "t_tg": 0.2, "speed_tg": 40.0}
{"pp": 64, "tg": 4, "pl": 1, "n_kv": 68, "t_pp": 0.1, "speed_pp": 600.0, "t_tg": 0.1, "speed_tg": 39.0}
{"pp": 128, "tg": 4, "pl": 2, "n_kv": 264, "t_pp": 0.3, "speed_pp": 426.7, "t_tg": 0.25, "speed_tg": 32.0}
"""


def test_parse_rows() -> None:
    rows = bench.parse_parallel(SAMPLE, [64, 128], 4, 2)
    assert sorted(rows) == [64, 128]
    assert (rows[64]["speed_tg"], rows[64]["speed_pp"], rows[128]["speed_tg"]) == (40.0, 640.0, 32.0)


@pytest.mark.parametrize("depths, n_gen, n_parallel", [([256], 4, 2), ([64, 128], 8, 2), ([64], 4, 4)])
def test_parse_missing_row_is_an_error(depths: list[int], n_gen: int, n_parallel: int) -> None:
    with pytest.raises(RuntimeError, match="no row"):
        bench.parse_parallel(SAMPLE, depths, n_gen, n_parallel)


@pytest.mark.parametrize("log, want", [
    ("llama_kv_cache: size =   11.25 MiB (   256 cells,  30 layers,  2/2 seqs), K (f16): 5.62 MiB", (2, 256)),
    ("llama_kv_cache: size =   22.50 MiB (   512 cells,  30 layers,  2/1 seqs), K (f16): 11.25 MiB", (1, 512)),
])
def test_parse_streams(log: str, want: tuple[int, int]) -> None:
    assert bench.parse_streams(log) == want


def test_parallel_table() -> None:
    rows = [bench.ParallelResult(label, 8, d, 32, 10.0 + d / 1000, 300.0, 4.5, 8, 4352, 39.0, 100.0, 0.0, 20.0,
                                 21.5, 400.0) for label in ("f16", "kvc4") for d in (2048, 4096)]
    lines = bench.parallel_table(rows).splitlines()
    assert lines[0].startswith("| K/V | decode t/s, 8 seqs @ d=2048 | decode t/s, 8 seqs @ d=4096 | "
                               "prompt 0→2048 t/s |")
    assert lines[3] == "| kvc4 | 12.0 | 14.1 | 300 | 300 | 4.50 | 8 x 4352 | 39.0 | 100.00 | 0.00 | 20.0, 21.5 | 400 |"


_RUNS: dict[str, list[bench.ParallelResult]] = {}

def tiny_run(model: Path, spec: str) -> bench.ParallelResult:
    """Two sequences at depth 64, 4 tokens each, run once per configuration."""
    if spec not in _RUNS:
        _RUNS[spec] = bench.run_parallel(KvConfig.parse(spec), model, [64], 4, 2, 2)
    (r,) = _RUNS[spec]
    return r


@pytest.mark.parametrize("spec", ["f16", "kvc4", "balanced"])
def test_tiny_run(model: Path, spec: str) -> None:
    r = tiny_run(model, spec)
    assert (r.label, r.n_parallel, r.depth, r.n_gen) == (spec, 2, 64, 4)
    assert r.decode_tokens_per_s > 0 and r.prompt_tokens_per_s > 0
    assert (r.kv_streams, r.kv_cells) == (2, 256)  # split: one stream of 256 cells per sequence
    assert r.weights_mib > 50 and r.compute_mib > 0 and r.compute_end_mib >= r.compute_mib
    assert r.peak_rss_mib > r.weights_mib * 0.5


@pytest.mark.parametrize("spec, bpe", [("f16", 16.0), ("kvc4", 4.5)])
def test_tiny_run_memory(model: Path, spec: str, bpe: float) -> None:
    r = tiny_run(model, spec)
    assert r.kv_main_mib == pytest.approx(2 * 256 * SMOLLM2_F16_BYTES_PER_CELL / 2**20 * bpe / 16, rel=0.01)
    assert r.kv_buffer_mib == 0 and r.bpe == pytest.approx(bpe)


def test_tiny_run_buffer(model: Path) -> None:
    """balanced: kvc4/kvc3 main cells and a residual buffer per stream, counted in bpe."""
    r, f16 = tiny_run(model, "balanced"), tiny_run(model, "f16")
    assert r.kv_main_mib == pytest.approx(f16.kv_main_mib * 4.0 / 16, rel=0.01) and r.kv_buffer_mib > 0
    assert r.bpe == pytest.approx(4.0 * (1 + r.kv_buffer_mib / r.kv_main_mib))
