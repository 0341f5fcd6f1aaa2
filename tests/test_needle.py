"""`kvcomp needle`: the prompt builder places one needle where asked, and retrieval on
SmolLM2 with an f16 cache (the reference) succeeds, and kvc8 matches it."""

from __future__ import annotations

from pathlib import Path

import pytest

from ggml_kvcomp import corpus, needle
from ggml_kvcomp.kvtypes import KvConfig


@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9])
def test_prompt_places_one_needle(depth: float) -> None:
    filler = "Alpha beta gamma delta. " * 50
    text = needle.prompt(filler, depth, 4000)
    sentence = f"The secret passphrase is {needle.passphrase(depth)}."
    assert text.count("secret passphrase is") == 2  # the needle and the question
    at = text.index(sentence) / len(text)
    assert abs(at - depth) < 0.05
    assert text.endswith(needle.QUESTION)
    assert needle.passphrase(depth) == needle.passphrase(depth)


def test_retrieval_f16_reference_and_kvc8(model: Path) -> None:
    filler = corpus.corpus_file().read_text(encoding="utf-8")
    depths = [0.1, 0.5, 0.9]
    ref = needle.run_needle(KvConfig.parse("f16"), model, filler, 1024, depths)
    kvc8 = needle.run_needle(KvConfig.parse("kvc8"), model, filler, 1024, depths)
    assert sum(r.found for r in ref) >= 2, needle.needle_table(ref)
    assert [r.found for r in kvc8] == [r.found for r in ref], needle.needle_table(ref + kvc8)
    assert "| f16 |" in needle.needle_table(ref + kvc8)
