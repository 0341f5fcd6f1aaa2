"""kvcomp: compensated low-bit KV cache for llama.cpp — Python tooling."""

__version__ = "0.1.0"
