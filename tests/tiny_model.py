"""Tiny random llama models with a chosen head size and head counts, written with upstream's
gguf-py.

Only the attention shapes matter to these tests; the tokenizer is copied from the packaged
SmolLM2 so the tools can tokenize the corpus.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ggml_kvcomp import synth


def write_tiny_llama(out: Path, tokenizer_source: Path, head_dim: int, n_head: int = 2, n_head_kv: int = 1,
                     n_layer: int = 2, seed: int = 0, n_embd: int | None = None) -> Path:
    """n_embd: the model width (default n_head * head_dim); a smaller one keeps a model with
    many heads small (Q/K/V project to n_head * head_dim and back)."""
    gguf = synth.gguf_module()
    rng = np.random.default_rng(seed)
    n_embd = n_embd or n_head * head_dim
    n_ff = 2 * n_embd

    reader = gguf.GGUFReader(tokenizer_source)
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(2048)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    n_vocab = synth.copy_tokenizer(reader, w)

    def rand(*shape: int) -> np.ndarray[Any, Any]:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(n_vocab, n_embd).astype(np.float16))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    for il in range(n_layer):
        w.add_tensor(f"blk.{il}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{il}.attn_q.weight", rand(n_head * head_dim, n_embd))
        w.add_tensor(f"blk.{il}.attn_k.weight", rand(n_head_kv * head_dim, n_embd))
        w.add_tensor(f"blk.{il}.attn_v.weight", rand(n_head_kv * head_dim, n_embd))
        w.add_tensor(f"blk.{il}.attn_output.weight", rand(n_embd, n_head * head_dim))
        w.add_tensor(f"blk.{il}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor(f"blk.{il}.ffn_gate.weight", rand(n_ff, n_embd))
        w.add_tensor(f"blk.{il}.ffn_up.weight", rand(n_ff, n_embd))
        w.add_tensor(f"blk.{il}.ffn_down.weight", rand(n_embd, n_ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
