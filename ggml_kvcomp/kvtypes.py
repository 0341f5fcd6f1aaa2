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
    """One KV cache configuration to measure: K and V types and the residual buffer knobs."""

    type_k: str
    type_v: str
    window: int = 0  # --kv-comp-window
    sinks: int = 0  # --kv-comp-sinks

    def __post_init__(self) -> None:
        for t in (self.type_k, self.type_v):
            if t not in ALL_TYPES:
                raise ValueError(f"unknown KV cache type {t!r}; known: {', '.join(ALL_TYPES)}")
        if self.window < 0 or self.sinks < 0:
            raise ValueError("window and sinks must be >= 0")

    @property
    def label(self) -> str:
        base = self.type_k if self.type_k == self.type_v else f"{self.type_k}/{self.type_v}"
        return base + (f":w{self.window}" if self.window else "") + (f":s{self.sinks}" if self.sinks else "")

    @property
    def buffered(self) -> bool:
        return self.window > 0 or self.sinks > 0

    def tool_args(self) -> list[str]:
        args = ["-ctk", self.type_k, "-ctv", self.type_v]
        if self.buffered:
            args += ["--kv-comp-window", str(self.window), "--kv-comp-sinks", str(self.sinks)]
        return args

    @classmethod
    def parse(cls, spec: str) -> KvConfig:
        """'kvc4' means K and V kvc4; 'kvc8/kvc4' means K kvc8, V kvc4; ':w32' adds a 32-position
        exact window and ':s4' four exact sink positions, e.g. 'kvc4:w32:s4'."""
        types, *knobs = spec.split(":")
        k, _, v = types.partition("/")
        window = sinks = 0
        for knob in knobs:
            if len(knob) < 2 or knob[0] not in "ws" or not knob[1:].isdigit():
                raise ValueError(f"bad knob {knob!r} in {spec!r}: expected w<N> or s<N>")
            if knob[0] == "w":
                window = int(knob[1:])
            else:
                sinks = int(knob[1:])
        return cls(k, v or k, window, sinks)


# The side-by-side set of the foundation run: upstream references first.
DEFAULT_CONFIGS: tuple[KvConfig, ...] = tuple(KvConfig.parse(s) for s in (
    "f16", "q8_0", "q4_0", "iq4_nl", "kvc8", "kvc4", "kvc3", "kvc2", "kvc8/kvc4",
))
