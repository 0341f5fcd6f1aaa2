"""What `kvcomp kld` measures is what generation gets: the same tokens scored with one decode
per token (-ub 1, teacher-forced) and batched give the same KLD against f16 where a token's
logits do not depend on its ubatch. Two chunks run as two sequences of one batch, so every
by-token ubatch of that split cache holds more tokens than n_ubatch (one per sequence)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from ggml_kvcomp.kvtypes import KvConfig
from ggml_kvcomp.perplexity import RunSettings, run_kld

# Without the scale tracker; upstream's q8_0 is the reference that the property holds upstream.
EXACT = ["q8_0", "kvc4", "kvc8/kvc4", "kvc4:w32:s4", "balanced:k1"]


def _settings(model: Path, text: Path) -> RunSettings:
    return RunSettings(model=model, corpus=text, ctx=128, chunks=2, batch=256)


@pytest.mark.parametrize("spec", EXACT)
def test_by_token_kld_equals_batched(bins: Path, model: Path, text: Path, spec: str) -> None:
    r = run_kld(KvConfig.parse(spec), _settings(model, text), by_token=True)
    assert r.kld_mean_by_token == r.kld_mean, (r.kld_mean_by_token, r.kld_mean)


@pytest.mark.parametrize("spec", ["low-latency", "balanced", "high-precision"])
def test_tracker_modes_run_one_token_a_ubatch(bins: Path, model: Path, text: Path, spec: str) -> None:
    # The tracker and the buffer size their inputs for ubatches larger than n_ubatch; they
    # sized them by n_ubatch and the first two-sequence ubatch wrote past the end (abort).
    r = run_kld(KvConfig.parse(spec), _settings(model, text), by_token=True)
    assert r.kld_mean_by_token is not None and math.isfinite(r.kld_mean_by_token) and r.kld_mean_by_token < 1.0
