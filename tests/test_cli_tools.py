"""`kvcomp regress` against the committed baseline and a doctored copy, and `kvcomp export`
from a real llama-server."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ggml_kvcomp import cli, export, regress
from ggml_kvcomp.paths import REPO_ROOT

from .server import post, server

BASELINE = REPO_ROOT / "regress" / "baseline.json"


def _subset(labels: tuple[str, ...]) -> dict[str, object]:
    run = next(r for r in regress.load(BASELINE) if r["model"] == "smollm2-135m")
    return {"runs": [{**run, "configs": {k: run["configs"][k] for k in labels}}]}


def test_regress_passes_on_the_baseline_and_fails_on_a_doctored_one(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    real = _subset(("kvc4", "balanced"))
    good = tmp_path / "good.json"
    good.write_text(json.dumps(real))
    assert cli.main(["regress", "--baseline", str(good)]) == 0
    assert "REGRESSED" not in capsys.readouterr().out

    # the same run against a limit below what it measures
    doctored = json.loads(json.dumps(real))
    lim = doctored["runs"][0]["configs"]["kvc4"]
    lim["kld_max"] = lim["kld"] * 0.5
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doctored))
    assert cli.main(["regress", "--baseline", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "REGRESSED: smollm2-135m ctx 512 kvc4: KLD" in err
    assert "balanced" not in err


def test_regress_refuses_a_broken_baseline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"runs": [{"model": "smollm2-135m", "ctx": 512, "chunks": 4,
                                            "configs": {"kvc4": {"kld_max": 0.1}}}]}))
    assert cli.main(["regress", "--baseline", str(broken)]) == 1
    assert "kvc4 lacks kld_max or ppl_ratio_max" in capsys.readouterr().err


def test_export_from_a_server(bins: Path, model: Path, tmp_path: Path) -> None:
    with server(bins, model, "-c", "1024", "-np", "1", "--metrics", "--kv-comp", "balanced",
                "--kv-comp-kstats", "none") as url:
        post(f"{url}/completion", {"prompt": "A lighthouse", "n_predict": 16, "temperature": 0})
        snap = json.loads(export.fetch(url))
        out = tmp_path / "heads.csv"
        assert cli.main(["export", "--url", url, "--format", "csv", "--out", str(out)]) == 0
        prom = tmp_path / "kvcomp.prom"
        assert cli.main(["export", "--url", url, "--format", "prometheus", "--out", str(prom)]) == 0
    rows = list(csv.DictReader(io.StringIO(out.read_text())))
    assert len(rows) == 90
    first = snap["layers"][0]["heads"][0]
    assert float(rows[0]["k_rmse"]) == pytest.approx(first["k_rmse"], rel=1e-6)
    names = {f.name for f in text_string_to_metric_families(prom.read_text())}
    assert {"llamacpp:kvcomp_k_rmse", "llamacpp:kvcomp_buffer_l2", "llamacpp:kvcomp_degrade_steps"} <= names

    # a saved JSON snapshot converts to the same CSV; Prometheus needs a live source
    saved = tmp_path / "snap.json"
    saved.write_text(json.dumps(snap))
    again = tmp_path / "again.csv"
    assert cli.main(["export", "--snapshot", str(saved), "--format", "csv", "--out", str(again)]) == 0
    assert again.read_text() == out.read_text()
    assert cli.main(["export", "--snapshot", str(saved), "--format", "prometheus"]) == 1


def test_kld_command_numbers_are_ordered(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "kld.json"
    png = tmp_path / "frontier.png"
    assert cli.main(["kld", "--ctx", "short", "--chunks", "2", "--configs", "f16,kvc8,kvc4", "--json", str(out),
                     "--frontier", str(png)]) == 0
    rows = {r["label"]: r for r in json.loads(out.read_text())}
    assert all(r["ctx"] == 512 for r in rows.values())
    assert png.read_bytes().startswith(b"\x89PNG")
    # KV memory at SmolLM2's 8192 positions: 30 layers x 192 K and 192 V values per position
    assert rows["f16"]["kv_mib_full"] == pytest.approx(30 * 8192 * 384 * 2 / 2**20, abs=0.2)
    assert rows["kvc4"]["kv_mib_full"] / rows["f16"]["kv_mib_full"] == pytest.approx(4.5 / 16, rel=0.01)
    assert abs(rows["f16"]["kld_mean"]) < 1e-4 < rows["kvc8"]["kld_mean"] < rows["kvc4"]["kld_mean"]
    assert rows["f16"]["ppl_ratio"] == pytest.approx(1.0, abs=1e-3)
    assert rows["f16"]["ppl_ratio"] < rows["kvc4"]["ppl_ratio"]
    printed = capsys.readouterr()
    assert "| kvc4 |" in printed.out and "[####" in printed.err  # the table, and the progress on stderr
    # ppl: same runs, the perplexity view; a context beyond the model's training is skipped
    assert cli.main(["ppl", "--ctx", "512,16384", "--chunks", "2", "--configs", "f16,kvc4"]) == 0
    printed = capsys.readouterr()
    assert "| PPL (f16 KV) |" in printed.out and "skipping ctx 16384" in printed.err
