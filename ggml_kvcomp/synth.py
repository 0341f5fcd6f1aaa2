"""A synthetic random-weight llama GGUF whose decode steps are bound by KV reads.

SmolLM2 and Gemma-3-270M are weight-bound: at depth 4096 their KV reads are a small part of
a step. This model has the per-layer attention geometry of a 7-8B model (32 query heads,
8 KV heads of 128, RoPE base 500000, as Llama-3-8B) around a small width, FFN and layer
count, with Q8_0 weights, so that at long context the KV cache is several times the bytes
of the weights, as it is for deployed models (DESIGN.md §11). It is written offline with
upstream's gguf-py from a fixed seed (the same file on every machine) and takes its tokenizer
from the packaged SmolLM2, so every llama.cpp tool can load and tokenize for it. Its outputs
mean nothing: it measures speed and memory, never quality.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import upstream

# bumped whenever the writer below changes the file it makes for a given shape
GENERATOR_VERSION = 1


@dataclass(frozen=True)
class SynthShape:
    """The synthetic model's hyperparameters; each maps to one GGUF key."""

    n_layer: int = 4  # block_count: few, so a depth-4096 fill takes seconds on 2 cores
    n_head: int = 32  # head_count: query heads
    n_head_kv: int = 8  # head_count_kv: 4 query heads per KV head, as Llama-3-8B
    head_dim: int = 128  # key_length = value_length = rope dimension
    n_embd: int = 256  # embedding_length: small, so the projections stay small
    n_ff: int = 512  # feed_forward_length
    ctx_train: int = 32768  # context_length
    rope_base: float = 500000.0  # rope.freq_base
    weights: str = "q8_0"  # matrices in q8_0 or f16; norms stay F32
    seed: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's K and V over all layers in an f16 cache."""
        return self.n_layer * 2 * self.n_head_kv * self.head_dim * 2


def gguf_module() -> Any:
    """Upstream's gguf-py from the prepared tree (it is not a dependency of this package)."""
    path = str(upstream.prepare() / "vendor" / "llama.cpp" / "gguf-py")
    if path not in sys.path:
        sys.path.insert(0, path)
    import gguf  # type: ignore[import-not-found]  # upstream gguf-py, put on the path above

    return gguf


def copy_tokenizer(reader: Any, writer: Any) -> int:
    """Copies the tokenizer.* keys of a GGUFReader into a GGUFWriter; returns the vocabulary size
    (0 when the source has no token list)."""
    n_vocab = 0
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            value = field.contents()
            sub_type = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(field.name, value, field.types[0], sub_type)
            if field.name == "tokenizer.ggml.tokens":
                n_vocab = len(value)
    return n_vocab


def _spec(shape: SynthShape, tokenizer_source: Path) -> str:
    return json.dumps({"generator": GENERATOR_VERSION, "tokenizer": tokenizer_source.name, **asdict(shape)},
                      sort_keys=True) + "\n"


def write_synthetic(out: Path, tokenizer_source: Path, shape: SynthShape = SynthShape()) -> Path:
    """Writes the model to out (always); the same shape and seed give the same bytes."""
    gguf = gguf_module()
    qtypes = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "f16": gguf.GGMLQuantizationType.F16}
    ftypes = {"q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "f16": gguf.LlamaFileType.MOSTLY_F16}
    if shape.weights not in qtypes:
        raise ValueError(f"synthetic weights are {' or '.join(qtypes)}, got {shape.weights!r}")
    rng = np.random.default_rng(shape.seed)
    reader = gguf.GGUFReader(tokenizer_source)
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name(f"kvcomp synthetic {shape.n_layer}L {shape.n_head}/{shape.n_head_kv}x{shape.head_dim}")
    w.add_context_length(shape.ctx_train)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_key_length(shape.head_dim)
    w.add_value_length(shape.head_dim)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(ftypes[shape.weights])
    n_vocab = copy_tokenizer(reader, w)
    if n_vocab == 0:
        raise ValueError(f"{tokenizer_source} has no tokenizer.ggml.tokens")

    def matrix(name: str, rows: int, cols: int) -> None:
        # N(0, 1/cols): activations keep their scale through each product
        data = (rng.standard_normal((rows, cols), dtype=np.float32) / np.sqrt(cols)).astype(np.float32)
        qtype = qtypes[shape.weights]
        w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    e, q, kv = shape.n_embd, shape.n_head * shape.head_dim, shape.n_head_kv * shape.head_dim
    matrix("token_embd.weight", n_vocab, e)  # also the output matrix (no output.weight: tied)
    w.add_tensor("output_norm.weight", np.ones(e, dtype=np.float32))
    for il in range(shape.n_layer):
        w.add_tensor(f"blk.{il}.attn_norm.weight", np.ones(e, dtype=np.float32))
        matrix(f"blk.{il}.attn_q.weight", q, e)
        matrix(f"blk.{il}.attn_k.weight", kv, e)
        matrix(f"blk.{il}.attn_v.weight", kv, e)
        matrix(f"blk.{il}.attn_output.weight", e, q)
        w.add_tensor(f"blk.{il}.ffn_norm.weight", np.ones(e, dtype=np.float32))
        matrix(f"blk.{il}.ffn_gate.weight", shape.n_ff, e)
        matrix(f"blk.{il}.ffn_up.weight", shape.n_ff, e)
        matrix(f"blk.{il}.ffn_down.weight", e, shape.n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def build(out: Path, tokenizer_source: Path, shape: SynthShape = SynthShape()) -> Path:
    """The cached model at out, (re)written when the shape, the seed or this writer changed
    (recorded in out + '.spec')."""
    stamp = out.with_name(out.name + ".spec")
    spec = _spec(shape, tokenizer_source)
    if out.exists() and stamp.exists() and stamp.read_text() == spec:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".part")
    try:
        write_synthetic(tmp, tokenizer_source, shape)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    tmp.rename(out)
    stamp.write_text(spec)
    return out
