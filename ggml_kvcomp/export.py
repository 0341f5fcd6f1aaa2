"""Monitor snapshots (docs/monitoring.md) out to files: JSON, CSV (one row per layer and KV
head), or Prometheus text for a node-exporter textfile collector."""

from __future__ import annotations

import csv
import io
import json
import urllib.error
import urllib.request
from typing import Any, Literal, get_args

Format = Literal["json", "csv", "prometheus"]
FORMATS: tuple[str, ...] = get_args(Format)

HEAD_FIELDS = ("k_rmse", "k_rmse_rel", "k_scale", "v_scale", "buffer_l2_k", "buffer_l2_v")


def fetch(url: str, fmt: Format = "json") -> str:
    """The snapshot text a llama-server (started with --metrics) serves at /kvcomp."""
    query = "?format=prometheus" if fmt == "prometheus" else ""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/kvcomp{query}", timeout=30) as r:
            return str(r.read().decode())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{url}/kvcomp answered {e.code}: {e.read().decode()[:300]}") from e


def to_csv(snapshot: dict[str, Any]) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(["mode", "layer", "head", *HEAD_FIELDS])
    for layer in snapshot["layers"]:
        for head in layer["heads"]:
            w.writerow([snapshot["mode"], layer["layer"], head["head"], *(head[f] for f in HEAD_FIELDS)])
    return out.getvalue()


def convert(text: str, fmt: Format) -> str:
    """A JSON snapshot as `fmt`; Prometheus text only comes from a live source (fetch)."""
    if fmt == "json":
        return json.dumps(json.loads(text), indent=2) + "\n"
    if fmt == "csv":
        return to_csv(json.loads(text))
    raise ValueError("Prometheus text comes from a running server (--url) or a Llama "
                     "(ggml_kvcomp.llm.snapshot_text); a saved JSON snapshot exports to json or csv")
