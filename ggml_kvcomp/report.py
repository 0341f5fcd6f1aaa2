"""Markdown tables and the marked sections of docs/results.md that runs rewrite."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from .perplexity import KldResult


def kld_table(results: Sequence[KldResult]) -> str:
    by_token = any(r.kld_mean_by_token is not None for r in results)
    rows = [
        "| K/V | bpe K | bpe V | bpe buffer | bpe total | bpe, full ctx | PPL | PPL ratio | mean KLD | KLD p99 "
        "| same top p | K RMSE: stored / offset only / plain | KV MiB, full ctx |"
        + (" mean KLD, one decode per token |" if by_token else ""),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if by_token else ""),
    ]
    for r in results:
        tf = "" if not by_token else " - |" if r.kld_mean_by_token is None else f" {r.kld_mean_by_token:.6f} |"
        rows.append(
            f"| {r.label} | {r.bpe_k:.2f} | {r.bpe_v:.2f} | {r.bpe_buffer:.2f} | {r.bpe:.2f} | {r.bpe_full:.2f} "
            f"| {r.ppl:.4f} | {r.ppl_ratio:.5f} "
            f"| {max(r.kld_mean, 0.0) + 0.0:.6f} ± {r.kld_mean_err:.6f} | {r.kld_p99:.5f} | {r.same_top_p:.2f}% "
            + (f"| {r.k_rmse:.4f} / {r.k_rmse_offset:.4f} / {r.k_rmse_plain:.4f} " if r.k_rmse_plain > 0 else "| - ")
            + f"| {r.kv_mib_full:.1f} |" + tf
        )
    return "\n".join(rows)


def ppl_table(results: Sequence[KldResult]) -> str:
    rows = ["| K/V | bpe total | PPL | PPL (f16 KV) | PPL ratio |", "|---|---:|---:|---:|---:|"]
    rows += [f"| {r.label} | {r.bpe:.2f} | {r.ppl:.4f} | {r.ppl_base:.4f} | {r.ppl_ratio:.5f} |" for r in results]
    return "\n".join(rows)


def replace_section(path: Path, name: str, body: str) -> None:
    """Replaces the text between <!-- name:begin --> and <!-- name:end -->, appending if absent."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{body.rstrip()}\n{end}"
    text = path.read_text(encoding="utf-8") if path.exists() else "# Results\n"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text, encoding="utf-8")
