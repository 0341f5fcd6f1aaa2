"""Fixtures shared by the suite: the built binaries, the packaged model and the corpus."""

from __future__ import annotations

from pathlib import Path

import pytest

from ggml_kvcomp import corpus, models
from ggml_kvcomp.paths import bin_dir


@pytest.fixture(scope="session")
def bins() -> Path:
    d = bin_dir()
    if not (d / "llama-perplexity").exists():
        pytest.fail(f"{d} has no llama-perplexity: run scripts/build.sh first")
    return d


@pytest.fixture(scope="session")
def model() -> Path:
    return models.fetch_model()


@pytest.fixture(scope="session")
def text() -> Path:
    return corpus.corpus_file()
