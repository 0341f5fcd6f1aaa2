"""The synthetic KV-bound model (ggml_kvcomp/synth.py): a 7-8B model's attention geometry in
small layers, written the same on every machine, and loaded by llama as that shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ggml_kvcomp import bench, models, synth
from ggml_kvcomp.kvtypes import KvConfig
from ggml_kvcomp.paths import sha256_file

NAME = "synth-kv8x128"
_SPEC = models.MODELS[NAME]
assert isinstance(_SPEC, models.SyntheticModel)
SPEC: models.SyntheticModel = _SPEC
SHAPE = SPEC.shape


@pytest.fixture(scope="module")
def synth_model() -> Path:
    return models.fetch_model(NAME)


@pytest.fixture(scope="module")
def reader(synth_model: Path) -> Any:
    return synth.gguf_module().GGUFReader(synth_model)


# the attention of Llama-3-8B: 32 query heads, 8 KV heads of 128, RoPE base 500000
@pytest.mark.parametrize("key, want", [
    ("general.architecture", "llama"),
    ("llama.attention.head_count", 32),
    ("llama.attention.head_count_kv", 8),
    ("llama.attention.key_length", 128),
    ("llama.attention.value_length", 128),
    ("llama.rope.dimension_count", 128),
    ("llama.rope.freq_base", 500000.0),
    ("llama.block_count", SHAPE.n_layer),
    ("llama.embedding_length", SHAPE.n_embd),
    ("llama.feed_forward_length", SHAPE.n_ff),
    ("llama.context_length", SHAPE.ctx_train),
])
def test_gguf_keys(reader: Any, key: str, want: object) -> None:
    assert reader.fields[key].contents() == want


# GGUF shapes list ne0 (a row's length) first
@pytest.mark.parametrize("name, shape", [
    ("blk.0.attn_q.weight", [SHAPE.n_embd, 32 * 128]),
    ("blk.0.attn_k.weight", [SHAPE.n_embd, 8 * 128]),
    ("blk.0.attn_v.weight", [SHAPE.n_embd, 8 * 128]),
    ("blk.0.attn_output.weight", [32 * 128, SHAPE.n_embd]),
    ("blk.0.ffn_up.weight", [SHAPE.n_embd, SHAPE.n_ff]),
    ("blk.0.ffn_down.weight", [SHAPE.n_ff, SHAPE.n_embd]),
    (f"blk.{SHAPE.n_layer - 1}.attn_k.weight", [SHAPE.n_embd, 8 * 128]),
    ("token_embd.weight", [SHAPE.n_embd, 49152]),  # SmolLM2's vocabulary, tied output
])
def test_tensor_shapes(reader: Any, name: str, shape: list[int]) -> None:
    t = {t.name: t for t in reader.tensors}[name]
    assert [int(n) for n in t.shape] == shape
    assert t.tensor_type.name == SHAPE.weights.upper()


def test_kv_dominates_weights_at_depth(reader: Any) -> None:
    """One sequence's f16 KV cache at depth 4096 outweighs all the weights (KV-bound)."""
    weights = sum(int(t.n_bytes) for t in reader.tensors)
    assert 4096 * SHAPE.kv_bytes_per_token > 2 * weights
    assert len([t for t in reader.tensors if t.name.endswith("attn_k.weight")]) == SHAPE.n_layer


def test_deterministic(synth_model: Path, tmp_path: Path) -> None:
    again = synth.write_synthetic(tmp_path / "again.gguf", models.fetch_model(SPEC.tokenizer_from), SHAPE)
    assert sha256_file(again) == sha256_file(synth_model)


def test_cache_follows_the_shape(tmp_path: Path) -> None:
    src = models.fetch_model(SPEC.tokenizer_from)
    out = tmp_path / "m.gguf"
    gguf = synth.gguf_module()
    for n_layer in (1, 2):
        synth.build(out, src, synth.SynthShape(n_layer=n_layer, n_embd=32, n_ff=32))
        assert gguf.GGUFReader(out).fields["llama.block_count"].contents() == n_layer
    mtime = out.stat().st_mtime_ns
    synth.build(out, src, synth.SynthShape(n_layer=2, n_embd=32, n_ff=32))
    assert out.stat().st_mtime_ns == mtime  # same shape: the cached file


def test_llama_loads_the_shape(synth_model: Path, reader: Any) -> None:
    """llama-bench runs it, and its f16 cache is 8 KV heads x 128 x n_layer per cell
    (llama-bench's contexts here have 256 cells)."""
    res = bench.run_bench(KvConfig.parse("f16"), synth_model, [0], 4, 2, 1, n_prompt=16)
    assert {r.n_prompt for r in res} == {0, 16} and all(r.tokens_per_s > 0 for r in res)
    assert res[0].kv_main_mib == pytest.approx(256 * SHAPE.kv_bytes_per_token / 2**20, abs=0.01)
    assert res[0].weights_mib == pytest.approx(sum(int(t.n_bytes) for t in reader.tensors) / 2**20, rel=0.01)
