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


def marked(text: str, name: str) -> str | None:
    """The block between <!-- name:begin --> and <!-- name:end -->, markers included."""
    m = re.search(rf"<!-- {re.escape(name)}:begin -->.*?<!-- {re.escape(name)}:end -->", text, re.DOTALL)
    return m.group(0) if m else None


def replace_block(text: str, name: str, body: str, append: bool = False) -> str:
    """text with its <!-- name:begin/end --> block holding body; a missing block is appended
    with append, an error without."""
    block = f"<!-- {name}:begin -->\n{body.rstrip()}\n<!-- {name}:end -->"
    old = marked(text, name)
    if old is not None:
        return text.replace(old, block)
    if not append:
        raise ValueError(f"no <!-- {name}:begin --> ... <!-- {name}:end --> block to rewrite")
    return text.rstrip() + "\n\n" + block + "\n"


def replace_section(path: Path, name: str, body: str) -> None:
    """Rewrites a section of a markdown file (created if absent), appending it if absent."""
    text = path.read_text(encoding="utf-8") if path.exists() else "# Results\n"
    path.write_text(replace_block(text, name, body, append=True), encoding="utf-8")
