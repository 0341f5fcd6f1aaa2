"""`kvcomp needle`: a fact hidden at several depths of filler text, asked for at the end, with
an exact-match answer. Perplexity averages over every token and can hide damage to the few
keys a retrieval needs; this checks them directly. Runs through llama-cpp-python on the
kvcomp build (ggml_kvcomp.llm)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from . import llm
from .capi import K_LAYERS_NAMES, KLayersName
from .kvtypes import KNOBS, KvConfig

QUESTION = "\n\nQuestion: What is the secret passphrase mentioned in the text above?\nAnswer: The secret passphrase is"
WORDS = ("amber", "falcon", "harbor", "juniper", "lantern", "meadow", "orchid", "quartz", "saffron", "tundra")


@dataclass(frozen=True)
class NeedleResult:
    label: str
    ctx: int
    depth: float
    expected: str
    answer: str
    found: bool


def passphrase(depth: float) -> str:
    """A passphrase fixed by the depth, so every configuration looks for the same one."""
    rng = random.Random(int(depth * 1000))
    return f"{rng.choice(WORDS)}-{rng.randint(100, 999)}"


def prompt(filler: str, depth: float, n_chars: int) -> str:
    """Filler text of about n_chars with the needle sentence at `depth` (0..1) of it."""
    text = (filler * (n_chars // max(1, len(filler)) + 1))[:n_chars]
    cut = text.rfind(". ", 0, int(depth * len(text))) + 2 if depth > 0 else 0
    needle = f" The secret passphrase is {passphrase(depth)}. Remember it. "
    return text[:cut] + needle + text[cut:] + QUESTION


def _open(cfg: KvConfig, model: Path, n_ctx: int, threads: int) -> Any:
    # the monitor, the per-layer K rule and the K statistics are no knobs of llama_kvcomp_configure
    knobs = {KNOBS[letter][0]: value for letter, _, value in cfg._knobs()
             if KNOBS[letter][0] not in ("monitor", "k_layers", "kstats")}
    if cfg.mode is not None and cfg.kstats:
        # a mode with the model's K statistics, as `--kv-comp MODE` (':k3') or kvcomp kld (':k1', ':k2') runs it
        from .calibrate import kstats_files

        stats, profile = kstats_files(cfg, model)
        return llm.open_llama(model, cfg.mode, n_ctx=n_ctx, n_threads=threads, kstats=stats or "auto",
                              k_layers=cast(KLayersName, K_LAYERS_NAMES[cfg.k_layers]), layers=profile, **knobs)
    m = llm.new_llama(model, cfg.type_k, cfg.type_v, n_ctx=n_ctx, n_threads=threads)
    if cfg.mode is not None or knobs:
        llm.configure(m, cfg.mode or "off", **knobs)
    return m


def run_needle(cfg: KvConfig, model: Path, filler: str, ctx: int, depths: Sequence[float],
               threads: int = 2) -> list[NeedleResult]:
    m = _open(cfg, model, ctx + 64, threads)
    out: list[NeedleResult] = []
    try:
        for depth in depths:
            # fill the context: about 4 characters per token, then trimmed to fit
            n_chars = ctx * 4
            while True:
                text = prompt(filler, depth, n_chars)
                if len(m.tokenize(text.encode())) <= ctx - 16:
                    break
                n_chars = int(n_chars * 0.9)
            m.reset()
            r = m(text, max_tokens=12, temperature=0.0)
            answer = str(r["choices"][0]["text"]).strip()
            want = passphrase(depth)
            out.append(NeedleResult(cfg.label, ctx, depth, want, answer, want in answer))
    finally:
        m.close()
    return out


def needle_table(results: Sequence[NeedleResult]) -> str:
    depths = sorted({r.depth for r in results})
    labels = list(dict.fromkeys(r.label for r in results))
    by_key = {(r.label, r.depth): r for r in results}
    rows = ["| K/V | " + " | ".join(f"depth {d:.0%}" for d in depths) + " | found |",
            "|---|" + "---|" * len(depths) + "---:|"]
    for label in labels:
        cells = [("yes" if by_key[(label, d)].found else f"no (`{by_key[(label, d)].answer[:24]}`)") for d in depths]
        n = sum(by_key[(label, d)].found for d in depths)
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {n}/{len(depths)} |")
    return "\n".join(rows)
