"""K statistics without a file: `--kv-comp low-latency|balanced` alone runs kvct K, from
statistics the library measures on its built-in text on first use of a model and caches by the
model's fingerprint. What is checked: the same bytes in two processes, two tools and at two
thread counts; a second start reads the cache and gives the same result; a damaged or foreign
cached file is measured again, never used; a read-only cache still runs; `none` and a file
override."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ggml_kvcomp import calibrate, llm, models, perplexity


def _perplexity(bins: Path, model: Path, text: Path, cache: Path, *extra: str, threads: int = 2,
                mode: str = "balanced") -> subprocess.CompletedProcess[str]:
    args = [str(bins / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", "128", "--chunks", "2",
            "-t", str(threads), "-fa", "on", *(["--kv-comp", mode] if mode else []), *extra]
    env = {**os.environ, "KVCOMP_CACHE": str(cache)}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert "Segmentation fault" not in proc.stderr and "GGML_ASSERT" not in proc.stderr
    return proc


def _ppl(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-2000:]
    m = re.search(r"Final estimate: PPL = (\S+)", proc.stdout + proc.stderr)
    assert m, (proc.stdout + proc.stderr)[-2000:]
    return m.group(1)


def _cached(cache: Path) -> Path:
    files = sorted((cache / "kstats").glob("auto-*.kstats.gguf"))
    assert len(files) == 1, files
    return files[0]


def _log(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def first(bins: Path, model: Path, text: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One measuring run: its cache folder and its perplexity."""
    cache = tmp_path_factory.mktemp("cache-a")
    proc = _perplexity(bins, model, text, cache)
    log = _log(proc)
    assert "type_k         = kvct4" in log
    assert "K statistics: measured on the built-in text" in log, log[-2000:]
    return cache, _ppl(proc)


def test_a_mode_alone_runs_kvct_from_its_own_statistics(first: tuple[Path, str]) -> None:
    cache, _ = first
    assert _cached(cache).read_bytes()[:4] == b"GGUF"


def test_statistics_are_the_same_bytes_in_every_process_and_thread_count(bins: Path, model: Path, text: Path,
                                                                          first: tuple[Path, str],
                                                                          tmp_path: Path) -> None:
    want = _cached(first[0]).read_bytes()
    other = tmp_path / "b"
    _ppl(_perplexity(bins, model, text, other, threads=1))
    assert _cached(other).read_bytes() == want


def test_python_measures_the_same_bytes(model: Path, first: tuple[Path, str], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCOMP_CACHE", str(tmp_path))
    m = llm.open_llama(model, "balanced", n_ctx=256)
    assert llm.get_config(m).type_k == "kvct4"
    assert llm.k_stats_source().startswith("measured on the built-in text")
    m.close()
    assert _cached(tmp_path).read_bytes() == _cached(first[0]).read_bytes()


def test_a_second_start_reads_the_cache(bins: Path, model: Path, text: Path, first: tuple[Path, str]) -> None:
    cache, ppl = first
    before = _cached(cache).stat().st_mtime_ns
    proc = _perplexity(bins, model, text, cache)
    assert "K statistics: measured on the built-in text, read from the cache" in _log(proc)
    assert "measuring the model's K statistics" not in _log(proc)
    assert _ppl(proc) == ppl
    assert _cached(cache).stat().st_mtime_ns == before


@pytest.mark.parametrize("damage", ["flipped byte", "zeroed tail", "another model", "not gguf"])
def test_a_damaged_or_foreign_cached_file_is_measured_again(bins: Path, model: Path, text: Path,
                                                             first: tuple[Path, str], tmp_path: Path,
                                                             damage: str) -> None:
    good = _cached(first[0])
    cache = tmp_path / "c"
    (cache / "kstats").mkdir(parents=True)
    bad = cache / "kstats" / good.name
    data = bytearray(good.read_bytes())
    if damage == "flipped byte":
        data[len(data) - 100] ^= 0x10
        bad.write_bytes(bytes(data))
    elif damage == "zeroed tail":
        bad.write_bytes(bytes(data[:-4096]) + bytes(4096))
    elif damage == "another model":
        calibrate.calibrate(models.fetch_model("gemma3-270m"), bad, ctx=64, chunks=1)
    else:
        bad.write_bytes(b"not a statistics file")
    proc = _perplexity(bins, model, text, cache)
    log = _log(proc)
    assert "the cached K statistics are refused" in log, log[-2000:]
    assert "K statistics: measured on the built-in text" in log
    assert _ppl(proc) == first[1]
    assert bad.read_bytes() == good.read_bytes()


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_cache_measures_for_the_run_only(bins: Path, model: Path, text: Path, first: tuple[Path, str],
                                                     tmp_path: Path) -> None:
    cache = tmp_path / "ro"
    (cache / "kstats").mkdir(parents=True)
    (cache / "kstats").chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        proc = _perplexity(bins, model, text, cache)
    finally:
        (cache / "kstats").chmod(stat.S_IRWXU)
    assert "cannot be written" in _log(proc) and "not cached" in _log(proc)
    assert _ppl(proc) == first[1]
    assert not list((cache / "kstats").iterdir())


def test_a_cache_that_is_a_file_measures_for_the_run_only(bins: Path, model: Path, text: Path,
                                                          first: tuple[Path, str], tmp_path: Path) -> None:
    # what a read-only folder does for a user who is not root: the folder cannot be made
    cache = tmp_path / "file"
    cache.mkdir()
    (cache / "kstats").write_text("a file where the folder would be")
    proc = _perplexity(bins, model, text, cache)
    assert "cannot be written" in _log(proc) and "not cached" in _log(proc)
    assert _ppl(proc) == first[1]


def test_none_turns_kvct_off_and_a_file_overrides(bins: Path, model: Path, text: Path, tmp_path: Path) -> None:
    none = _perplexity(bins, model, text, tmp_path / "n", "--kv-comp-kstats", "none")
    assert "type_k         = kvc4" in _log(none) and "K statistics:" not in _log(none)
    _ppl(none)
    assert not (tmp_path / "n" / "kstats").exists()
    kstats = calibrate.ensure_kstats(model)
    given = _perplexity(bins, model, text, tmp_path / "f", "--kv-comp-kstats", str(kstats))
    assert f"K statistics: read from {kstats}" in _log(given)
    _ppl(given)
    assert not (tmp_path / "f" / "kstats").exists()
    refused = _perplexity(bins, model, text, tmp_path / "r", "-ctk", "kvct4", "--kv-comp-kstats", "none", mode="")
    assert refused.returncode != 0 and "--kv-comp-kstats none was given" in _log(refused)
    # an explicit -ctk after the mode stays, statistics or not
    kept = _perplexity(bins, model, text, tmp_path / "k", "-ctk", "kvc4", "--kv-comp-kstats", str(kstats))
    assert "type_k         = kvc4" in _log(kept)


def test_python_with_kstats_none_keeps_the_plain_k_type(model: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCOMP_CACHE", str(tmp_path))
    m = llm.open_llama(model, "low-latency", n_ctx=256, kstats="none")
    assert llm.get_config(m).type_k == "kvc4"
    m.eval(m.tokenize(b"The cache"))
    assert np.isfinite(np.array(m.eval_logits[-1])).all()
    m.close()
    assert not (tmp_path / "kstats").exists()


def test_the_measuring_run_is_not_counted_as_a_cache() -> None:
    # the library's own run logs a KV cache of its own after its first line and before the
    # result, in the order a first use logs them (the context exists before the progress line)
    main = ("llama_kv_cache: size =   45.00 MiB (  2048 cells,  30 layers,  1/1 seqs)\n"
            "kvcomp: KV memory: main cache 45.00 MiB (4.30 bpe), residual buffer 0.00 MiB\n")
    measuring = ("kvcomp: measuring the model's K statistics in a context of its own (512 cells)\n"
                 "llama_kv_cache: size =   30.00 MiB (   512 cells,  30 layers,  1/1 seqs)\n"
                 "kvcomp: measuring the model's K statistics on the built-in text (once per model) .......... done\n"
                 "kvcomp: K statistics: measured on the built-in text (2029 tokens, 4.9 s), cached in x\n")
    with_buffer = "kvcomp: KV memory: main cache 45.00 MiB (4.30 bpe), residual buffer 2.50 MiB\n"
    plain = main + "kvcomp: K statistics: read from the cache\n" + with_buffer
    first = main + measuring + with_buffer
    assert perplexity.parse_kv_mib_full(first, 8192) == perplexity.parse_kv_mib_full(plain, 8192) == 180.0 + 2.5
    assert perplexity.kv_memory_mib(first) == perplexity.kv_memory_mib(plain) == (45.0, 2.5)
