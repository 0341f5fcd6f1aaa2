"""The upstream tools with the kvc types on the real SmolLM2 model.

Each test compares against upstream types in the same process or run: KLD ordering against
an f16 base, the KV size line against the formats' sizes, and the refusals upstream gives
for unsupported combinations.
"""

from __future__ import annotations

import concurrent.futures
import functools
import json
import subprocess
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from ggml_kvcomp import models, perplexity, steps
from ggml_kvcomp.capi import MODE_NAMES, mode_preset
from ggml_kvcomp.kvtypes import BITS_PER_ELEMENT, KNOBS, KVC_TYPES, KvConfig

from .server import post, server


def _ppl_args(bins: Path, model: Path, text: Path, *extra: str) -> list[str]:
    return [str(bins / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", "512", "-b", "512",
            "--chunks", "1", "-t", "2", "--no-warmup", "-lv", "4", *extra]


@pytest.mark.parametrize("kv", KVC_TYPES)
def test_kv_size_line_matches_format(bins: Path, model: Path, text: Path, kv: str) -> None:
    proc = subprocess.run(_ppl_args(bins, model, text, "-fa", "on", "-ctk", kv, "-ctv", kv),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = proc.stdout + proc.stderr
    bpe_k, bpe_v = perplexity.parse_kv_bpe(log)
    assert bpe_k == pytest.approx(BITS_PER_ELEMENT[kv], abs=0.02)
    assert bpe_v == pytest.approx(BITS_PER_ELEMENT[kv], abs=0.02)
    assert "attn_rot_k = 1" in log and "attn_rot_v = 1" in log
    assert "Final estimate: PPL" in log


def test_kld_ordering(bins: Path, model: Path, text: Path) -> None:
    settings = perplexity.RunSettings(model=model, corpus=text, ctx=512, chunks=3, threads=2)
    res = {c: perplexity.run_kld(KvConfig.parse(c), settings) for c in ("f16", "q4_0", "kvc8", "kvc5", "kvc4", "kvc2")}
    assert abs(res["f16"].kld_mean) < 1e-4
    assert res["f16"].ppl_ratio == pytest.approx(1.0, abs=1e-3)
    assert res["kvc8"].kld_mean < res["kvc5"].kld_mean < res["kvc4"].kld_mean < res["kvc2"].kld_mean
    # the 4.5-bpe format must keep its lead over upstream's 4.5-bpe q4_0 on real rows
    assert res["kvc4"].kld_mean < res["q4_0"].kld_mean
    assert res["kvc8"].kld_mean < 0.01
    assert res["kvc4"].same_top_p > res["kvc2"].same_top_p


def test_k_only_without_flash_attention(model: Path, text: Path) -> None:
    # K goes through MUL_MAT instead of FLASH_ATTN_EXT; V stays f16 as upstream requires
    settings = perplexity.RunSettings(model=model, corpus=text, ctx=512, chunks=3, flash_attn=False)
    kld = {k: perplexity.run_kld(KvConfig(k, "f16"), settings).kld_mean for k in ("f16", "q4_0", "kvc8", "kvc4")}
    assert kld["f16"] < kld["kvc8"] < kld["kvc4"] < kld["q4_0"]


def test_quantized_v_without_flash_attention_is_refused(bins: Path, model: Path, text: Path) -> None:
    proc = subprocess.run(_ppl_args(bins, model, text, "-fa", "off", "-ctk", "kvc4", "-ctv", "kvc4"),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "quantized V cache requires flash_attn" in proc.stdout + proc.stderr


@pytest.mark.parametrize("tool", ["llama-perplexity", "llama-cli", "llama-server"])
def test_unknown_cache_type_is_refused(bins: Path, model: Path, tool: str) -> None:
    proc = subprocess.run([str(bins / tool), "-m", str(model), "-ctk", "kvc6"], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "kvc6" in out and "kvc4" in out  # names the bad value and lists the allowed ones


def test_llama_bench_accepts_kvc_types(bins: Path, model: Path) -> None:
    proc = subprocess.run([str(bins / "llama-bench"), "-m", str(model), "-fa", "1", "-p", "0", "-n", "4", "-r", "1",
                           "-t", "2", "-ctk", "kvc3", "-ctv", "kvc3", "-o", "json"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    assert rows[0]["type_k"] == "kvc3" and rows[0]["type_v"] == "kvc3"
    assert rows[0]["avg_ts"] > 0


@pytest.mark.parametrize(("extra", "reason"), [
    (["-fa", "0", "-ctk", "kvc4", "-ctv", "kvc4"], "-ctv kvc4 needs flash attention"),
    (["-fa", "1", "-ctk", "kvct4", "-ctv", "kvc4", "--kv-comp-kstats", "none"], "needs the model's K statistics"),
])
def test_llama_bench_names_why_it_refuses(bins: Path, model: Path, extra: list[str], reason: str) -> None:
    # llama-bench keeps libllama's log quiet: the reason is its own line, as the other tools give it
    proc = subprocess.run([str(bins / "llama-bench"), "-m", str(model), "-p", "0", "-n", "4", "-r", "1", "-t", "2",
                           *extra], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert reason in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-1500:]


@pytest.mark.parametrize("tool", ["llama-cli", "llama-server", "llama-perplexity", "llama-bench"])
def test_every_tool_lists_the_buffer_flags(bins: Path, tool: str) -> None:
    proc = subprocess.run([str(bins / tool), "--help"], capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    for flag in [knob[1] for knob in KNOBS.values()] + ["--kv-comp-merge-at", "--kv-comp ", "--kv-comp-ema",
                                                     "--kv-comp-baseline", "--kv-comp-degrade-windows"]:
        assert flag in out, f"{tool} --help lacks {flag}"


def test_llama_bench_runs_the_residual_buffer(bins: Path, model: Path) -> None:
    base = [str(bins / "llama-bench"), "-m", str(model), "-fa", "1", "-p", "0", "-n", "4", "-r", "1", "-t", "2",
            "-ctk", "kvc4", "-ctv", "kvc4", "-o", "json"]
    proc = subprocess.run([*base, "-v", "--kv-comp-window", "16", "--kv-comp-sinks", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "kvcomp: window         = 16 (flag)" in proc.stderr and "kvcomp: sinks          = 2 (flag)" in proc.stderr
    assert json.loads(proc.stdout)[0]["avg_ts"] > 0
    bad = subprocess.run([*base, "--kv-comp-window", "-3"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0
    assert "--kv-comp-window: the window must be >= 0" in bad.stderr + bad.stdout


def test_server_generates_with_kvc_cache(bins: Path, model: Path) -> None:
    with server(bins, model, "-c", "1024", "-np", "2", "-fa", "on", "-ctk", "kvc8", "-ctv", "kvc4") as url:
        body = post(f"{url}/completion", {"prompt": "The capital of France is", "n_predict": 8, "temperature": 0})
        assert body["tokens_predicted"] == 8
        assert isinstance(body["content"], str) and body["content"]


@pytest.mark.parametrize("kv", ["--kv-unified", "--no-kv-unified"])
def test_server_residual_buffer_parallel_slots_and_slot_files(bins: Path, model: Path, tmp_path: Path, kv: str) -> None:
    prompts = [f"Write a short note about the number {i} and why it is interesting:" for i in range(4)]
    request = {"n_predict": 24, "temperature": 0, "cache_prompt": False}
    with server(bins, model, "-c", "2048", "-np", "4", kv, "-fa", "on", "-ctk", "kvc4", "-ctv", "kvc4",
                 "--kv-comp-window", "8", "--kv-comp-sinks", "2", "--slot-save-path", str(tmp_path)) as url:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda p: post(f"{url}/completion", {"prompt": p, **request}), prompts))
        assert all(r["tokens_predicted"] == 24 and r["content"] for r in together)
        # (exact isolation of sequences is checked in test-kvc-llama; here the kernels differ
        # between 4 slots at once and 1, so greedy text may too)
        alone = post(f"{url}/completion", {"prompt": prompts[2], **request, "id_slot": 0})

        saved = post(f"{url}/slots/0?action=save", {"filename": "slot0.bin"})
        assert saved["n_saved"] == alone["tokens_evaluated"] + 23  # type: ignore[operator]
        restored = post(f"{url}/slots/1?action=restore", {"filename": "slot0.bin"})
        assert restored["n_restored"] == saved["n_saved"]
        # damaged files are refused, and the client is told why (docs/state.md)
        data = (tmp_path / "slot0.bin").read_bytes()
        flipped = bytearray(data)
        flipped[len(data) // 2] ^= 0x01
        for name, content, reason in (("cut.bin", data[:-7], "no seal"),
                                      ("flipped.bin", bytes(flipped), "checksum mismatch")):
            (tmp_path / name).write_bytes(content)
            with pytest.raises(urllib.error.HTTPError) as err:
                post(f"{url}/slots/2?action=restore", {"filename": name})
            assert err.value.code == 400 and reason in err.value.read().decode()
        # the server survives the bad file and still answers
        again = post(f"{url}/completion", {"prompt": prompts[1], **request, "id_slot": 1})
        assert again["tokens_predicted"] == 24


def test_residual_buffer_lowers_kld(model: Path, text: Path) -> None:
    settings = perplexity.RunSettings(model=model, corpus=text, ctx=512, chunks=3, threads=2)
    plain = perplexity.run_kld(KvConfig.parse("kvc4"), settings)
    buffered = perplexity.run_kld(KvConfig.parse("kvc4:w32:s4"), settings)
    # the window holds the keys attention weighs most; measured ~4x lower on 16 chunks
    assert buffered.kld_mean < 0.5 * plain.kld_mean
    # slots: the window and sinks, held once (a ubatch's rows take the slots of the rows only
    # its own queries still read), and the row before the window (a cut-back by one token);
    # one more row per stream is scratch, and the MiB figures are rounded
    assert buffered.bpe_buffer == pytest.approx(16.0 * (32 + 4 + 1 + 1) / 512, rel=0.02)


@pytest.mark.parametrize(("extra", "message"), [
    (["-fa", "on", "--kv-comp-window", "-1"], "--kv-comp-window: the window must be >= 0"),
    (["-fa", "on", "--kv-comp-merge", "0"], "--kv-comp-merge: the merge interval must be >= 1"),
    (["-fa", "on", "--kv-comp-pin-budget", "150"], "--kv-comp-pin-budget: the pin budget must be a percentage"),
    (["-fa", "on", "--kv-comp-pin-threshold", "abc"], "--kv-comp-pin-threshold: not a number"),
    (["-fa", "off", "-ctk", "kvc4", "--kv-comp-window", "32"], "needs flash attention"),
])
def test_residual_buffer_bad_flags_are_refused(bins: Path, model: Path, text: Path, extra: list[str],
                                               message: str) -> None:
    proc = subprocess.run(_ppl_args(bins, model, text, *extra), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert message in proc.stdout + proc.stderr


def test_steps_tool_sorts_steps_by_merges(model: Path) -> None:
    plain = steps.run_steps(KvConfig.parse("kvc4"), model, depth=200, n_gen=16, threads=2)
    assert plain.slots == 0 and plain.n_merge_steps == 0 and plain.max_ms_no_merge > 0
    # merges every 4 ubatches: some steps merge, the others do not
    buffered = steps.run_steps(KvConfig.parse("kvc4:w8:n4"), model, depth=200, n_gen=16, threads=2)
    assert buffered.slots > 0
    assert 0 < buffered.n_merge_steps < 16
    assert buffered.max_ms_merge > 0 and buffered.max_ms_no_merge > 0


@pytest.mark.parametrize("config", ["f16", "low-latency", "balanced"])
def test_steps_reuse_the_graph(model: Path, config: str) -> None:
    # every decode step after the first reuses its graph: a mode's inputs change, not its graph
    r = steps.run_steps(KvConfig.parse(config), model, depth=200, n_gen=12, threads=2)
    assert r.n_reused >= r.n_gen - 1


@pytest.mark.parametrize("config", ["f16", "kvc4"])
def test_steps_tool_times_each_op(model: Path, config: str) -> None:
    r = steps.run_steps(KvConfig.parse(config), model, depth=200, n_gen=8, threads=2, ops=True)
    attn = r.op(steps.ATTENTION_OP)
    assert attn is not None and attn.us_per_node > 0
    # one attention node per layer, every step alike
    assert attn.nodes_per_step >= 1 and attn.nodes_per_step == round(attn.nodes_per_step)
    # the nodes' times lie inside the steps' own
    assert sum(o.us_per_step for o in r.ops) <= r.mean_ms * 1000
    assert "| attention µs/node |" in steps.steps_table([r])


def _log(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("mode", MODE_NAMES)
def test_mode_sets_types_and_knobs(bins: Path, model: Path, text: Path, mode: str) -> None:
    preset = mode_preset(mode)  # type: ignore[arg-type]
    proc = subprocess.run(_ppl_args(bins, model, text, "--kv-comp", mode), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = _log(proc)
    assert f"kvcomp: mode           = {mode}" in log
    # K is the mode's type for the model's K statistics, which the library measures itself
    assert f"kvcomp: type_k         = {preset.type_k_stats}" in log
    assert f"kvcomp: type_v         = {preset.type_v}" in log
    assert f"kvcomp: window         = {preset.window} ({mode})" in log
    assert f"kvcomp: tracker        = {'on' if preset.tracker else 'off'} ({mode})" in log
    if preset.tracker or preset.window:
        # the memory line splits main cache and buffer
        # (a kvct cache logs it when its plans arrive, then with the buffer: the last line counts)
        memory = [line for line in log.splitlines() if "kvcomp: KV memory: main cache" in line]
        assert memory and ("residual buffer 0.00 MiB" in memory[-1]) == (preset.window == 0)


@pytest.mark.parametrize(("args", "expect"), [
    # an explicit knob wins whatever its place on the command line
    (["--kv-comp-window", "64", "--kv-comp", "balanced"], "kvcomp: window         = 64 (flag)"),
    (["--kv-comp", "balanced", "--kv-comp-window", "64"], "kvcomp: window         = 64 (flag)"),
    # so does an explicit cache type
    (["-ctk", "q8_0", "--kv-comp", "low-latency"], "kvcomp: type_k         = q8_0"),
    (["--kv-comp", "low-latency", "-ctk", "q8_0"], "kvcomp: type_k         = q8_0"),
    (["--kv-comp", "low-latency", "--kv-comp-tracker", "off"], "kvcomp: tracker        = off (flag)"),
    (["--kv-comp", "high-precision", "--kv-comp-ema", "0.3"], "kvcomp: ema            = 0.300,0.300 (flag)"),
])
def test_mode_precedence(bins: Path, model: Path, text: Path, args: list[str], expect: str) -> None:
    proc = subprocess.run(_ppl_args(bins, model, text, *args), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert expect in _log(proc)


@pytest.mark.parametrize(("extra", "message"), [
    (["--kv-comp", "fast"], "--kv-comp: unknown mode 'fast'"),
    (["--kv-comp", "custom"], "--kv-comp: unknown mode 'custom'"),
    (["--kv-comp", "balanced", "--kv-comp-ema", "0"], "--kv-comp-ema: the EMA weights must be in (0, 1]"),
    (["--kv-comp", "balanced", "--kv-comp-ema", "0.1,1.5"], "--kv-comp-ema: the EMA weights must be in (0, 1]"),
    (["--kv-comp-tracker", "maybe"], "--kv-comp-tracker: expected on or off"),
    (["--kv-comp", "balanced", "-fa", "off"], "flash"),
])
def test_mode_bad_combinations_are_refused(bins: Path, model: Path, text: Path, extra: list[str], message: str) -> None:
    proc = subprocess.run(_ppl_args(bins, model, text, *extra), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert message in _log(proc)


def test_llama_bench_mode_needs_its_types(bins: Path, model: Path) -> None:
    base = [str(bins / "llama-bench"), "-m", str(model), "-fa", "1", "-p", "0", "-n", "4", "-r", "1", "-t", "2",
            "-o", "json"]
    ok = subprocess.run([*base, *KvConfig.parse("balanced").tool_args()], capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert json.loads(ok.stdout)[0]["avg_ts"] > 0
    bad = subprocess.run([*base, "--kv-comp", "balanced"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0
    assert "--kv-comp balanced runs on -ctk kvc4 -ctv kvc3" in _log(bad)


def test_modes_on_a_sliding_window_model(text: Path) -> None:
    # Gemma 3 keeps two caches (full and sliding-window layers): both get the buffer and the tracker
    settings = perplexity.RunSettings(model=models.fetch_model("gemma3-270m"), corpus=text, ctx=512, chunks=2)
    plain = perplexity.run_kld(KvConfig.parse("kvc4"), settings)
    balanced = perplexity.run_kld(KvConfig.parse("balanced"), settings)
    low = perplexity.run_kld(KvConfig.parse("low-latency"), settings)
    assert balanced.bpe_buffer > 0 and low.bpe_buffer == 0
    assert low.k_rmse < low.k_rmse_plain
    assert balanced.kld_mean < plain.kld_mean


def test_sequence_state_past_the_sliding_window(bins: Path) -> None:
    # llama-bench saves the depth prefill as a sequence state and restores it for the next
    # repetition; upstream leaves out the cells the sliding window hides, so must the buffer
    # (this failed with "residual buffer section is corrupted" before)
    gemma = models.fetch_model("gemma3-270m")
    proc = subprocess.run([str(bins / "llama-bench"), "-m", str(gemma), "-fa", "1", "-p", "0", "-n", "8", "-d", "1024",
                           "-r", "2", "-t", "2", "-o", "json", *KvConfig.parse("balanced").tool_args()],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, _log(proc)[-2000:]
    assert "corrupted" not in _log(proc)
    runs = json.loads(proc.stdout)
    assert len(runs[0]["samples_ts"]) == 2 and min(runs[0]["samples_ts"]) > 0


def _floor_settings(name: str, text: Path) -> perplexity.RunSettings:
    return perplexity.RunSettings(model=models.fetch_model(name), corpus=text, ctx=256, chunks=2)


@functools.cache
def _f16_without_fa(name: str, text: Path) -> perplexity.KldResult:
    """f16 K/V through -fa off against the flash-attention base: the same numbers up to the
    order of sums and one f16 rounding (shared by the two tests below)."""
    return perplexity.run_kld(KvConfig.parse("f16"), replace(_floor_settings(name, text), flash_attn=False))


@pytest.mark.parametrize(("name", "floor"), [("smollm2-135m", True), ("smollm2-135m-f32", False)])
def test_kld_noise_floor(text: Path, name: str, floor: bool) -> None:
    # The Q4_1 model rounds every matrix product's input to 8 bits, which grows the kernel
    # change into a KLD near q8_0's; its F32 copy keeps it far below, and so tells KV formats
    # apart (docs/tools.md, "Measuring").
    path = _f16_without_fa(name, text)
    q8 = perplexity.run_kld(KvConfig.parse("q8_0"), _floor_settings(name, text))
    if floor:
        assert path.kld_mean > 0.5 * q8.kld_mean, (path.kld_mean, q8.kld_mean)
    else:
        assert path.kld_mean < 0.05 * q8.kld_mean, (path.kld_mean, q8.kld_mean)


def test_dequantized_model_is_its_source(text: Path) -> None:
    # the base of those runs is f16 with flash attention, the cache as llama.cpp runs it
    ppl = {name: _f16_without_fa(name, text).ppl_base for name in ("smollm2-135m", "smollm2-135m-f32")}
    assert abs(ppl["smollm2-135m-f32"] / ppl["smollm2-135m"] - 1) < 0.05, ppl
