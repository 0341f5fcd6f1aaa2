"""`kvcomp bench`'s memory breakdown against the formats' sizes: the same weights for every
configuration, the KV cache scaled by bits per element, the buffer only where there is one."""

from __future__ import annotations

from pathlib import Path

import pytest

from ggml_kvcomp import bench
from ggml_kvcomp.kvtypes import BITS_PER_ELEMENT, KvConfig


def test_memory_breakdown_follows_the_types(model: Path) -> None:
    res = {c: bench.run_bench(KvConfig.parse(c), model, [0, 1024], 4, 2, 1) for c in ("f16", "kvc4", "balanced")}
    deep = {c: next(r for r in rs if r.depth == 1024) for c, rs in res.items()}
    f16, kvc4, bal = deep["f16"], deep["kvc4"], deep["balanced"]
    # weights are the model's, whatever the cache (SmolLM2-135M Q8_0: ~140 MiB)
    assert f16.weights_mib == pytest.approx(kvc4.weights_mib, abs=0.01) == pytest.approx(bal.weights_mib, abs=0.01)
    assert 0.8 * model.stat().st_size / 2**20 < f16.weights_mib < 1.2 * model.stat().st_size / 2**20
    # the main cache by bits per element (the log rounds to 0.01 MiB)
    assert kvc4.kv_main_mib == pytest.approx(f16.kv_main_mib * BITS_PER_ELEMENT["kvc4"] / 16.0, rel=0.02)
    assert f16.kv_buffer_mib == 0 and kvc4.kv_buffer_mib == 0 and bal.kv_buffer_mib > 0
    assert f16.bpe == pytest.approx(16.0) and kvc4.bpe == pytest.approx(4.5)
    assert bal.bpe > (BITS_PER_ELEMENT["kvc4"] + BITS_PER_ELEMENT["kvc3"]) / 2
    assert all(r.compute_mib > 0 and r.peak_rss_mib > r.weights_mib * 0.5 for r in deep.values())
    assert all(r.tokens_per_s > 0 for rs in res.values() for r in rs)
