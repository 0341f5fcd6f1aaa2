"""`kvcomp report` on real (tiny) kld and bench runs and a real monitor snapshot: the
markdown names every configuration and each plot is a valid PNG of the expected size."""

from __future__ import annotations

import json
from pathlib import Path

from PIL import Image

from ggml_kvcomp import cli, llm


def test_report_writes_valid_pngs(model: Path, tmp_path: Path) -> None:
    kld, bench, snap = tmp_path / "kld.json", tmp_path / "bench.json", tmp_path / "snap.json"
    assert cli.main(["kld", "--ctx", "256", "--chunks", "1", "--configs", "f16,q4_0,kvc4", "--json", str(kld)]) == 0
    assert cli.main(["bench", "--depths", "0,256", "--n-gen", "4", "--reps", "1", "--configs", "f16,kvc4",
                     "--json", str(bench)]) == 0
    m = llm.open_llama(model, "balanced", n_ctx=512)
    m("The lighthouse keeper", max_tokens=8, temperature=0.0)
    snap.write_text(json.dumps(llm.snapshot(m)))
    m.close()

    out = tmp_path / "report"
    assert cli.main(["report", "--kld", str(kld), "--bench", str(bench), "--snapshot", str(snap),
                     "--out", str(out)]) == 0
    text = (out / "report.md").read_text()
    for label in ("f16", "q4_0", "kvc4"):
        assert f"| {label} |" in text
    for png in ("kld-frontier.png", "decode-speed.png", "k-rmse-heatmap.png"):
        assert f"]({png})" in text
        with Image.open(out / png) as im:
            im.verify()
        with Image.open(out / png) as im:
            assert im.format == "PNG" and im.size[0] >= 300 and im.size[1] >= 200
    assert cli.main(["report", "--out", str(out)]) == 1
