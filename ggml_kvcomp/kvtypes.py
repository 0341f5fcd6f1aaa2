"""KV cache type names accepted by -ctk/-ctv: upstream's and ours."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

UpstreamType = Literal["f16", "q8_0", "q4_0", "iq4_nl"]
KvcType = Literal["kvc8", "kvc4", "kvc3", "kvc2"]

UPSTREAM_TYPES: tuple[str, ...] = get_args(UpstreamType)
KVC_TYPES: tuple[str, ...] = get_args(KvcType)
ALL_TYPES: tuple[str, ...] = UPSTREAM_TYPES + KVC_TYPES

# Bits per element from each type's block: (block bytes * 8) / block values.
BITS_PER_ELEMENT: dict[str, float] = {
    "f16": 16.0, "q8_0": 8.5, "q4_0": 4.5, "iq4_nl": 4.5,
    "kvc8": 8.5, "kvc4": 4.5, "kvc3": 3.5, "kvc2": 2.5,
}


@dataclass(frozen=True)
class KvConfig:
    """One KV cache configuration to measure: K and V types."""

    type_k: str
    type_v: str

    def __post_init__(self) -> None:
        for t in (self.type_k, self.type_v):
            if t not in ALL_TYPES:
                raise ValueError(f"unknown KV cache type {t!r}; known: {', '.join(ALL_TYPES)}")

    @property
    def label(self) -> str:
        return self.type_k if self.type_k == self.type_v else f"{self.type_k}/{self.type_v}"

    @classmethod
    def parse(cls, spec: str) -> KvConfig:
        """'kvc4' means K and V kvc4; 'kvc8/kvc4' means K kvc8, V kvc4."""
        k, _, v = spec.partition("/")
        return cls(k, v or k)


# The side-by-side set of the foundation run: upstream references first.
DEFAULT_CONFIGS: tuple[KvConfig, ...] = tuple(KvConfig.parse(s) for s in (
    "f16", "q8_0", "q4_0", "iq4_nl", "kvc8", "kvc4", "kvc3", "kvc2", "kvc8/kvc4",
))
