"""KV cache type names accepted by -ctk/-ctv: upstream's and ours."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, get_args

from .capi import K_LAYERS_NAMES, MODE_NAMES, ModeName, mode_preset

UpstreamType = Literal["f16", "q8_0", "q4_0", "iq4_nl"]
KvcType = Literal["kvc8", "kvc5", "kvc4", "kvc3", "kvc2"]
# transform-coded K rows, plans fitted from the model's K statistics (K only)
KvctType = Literal["kvct5", "kvct4", "kvct3", "kvct2"]

UPSTREAM_TYPES: tuple[str, ...] = get_args(UpstreamType)
KVC_TYPES: tuple[str, ...] = get_args(KvcType)
KVCT_TYPES: tuple[str, ...] = get_args(KvctType)
ALL_TYPES: tuple[str, ...] = UPSTREAM_TYPES + KVC_TYPES + KVCT_TYPES

# Bits per element from each type's block: (block bytes * 8) / block values.
BITS_PER_ELEMENT: dict[str, float] = {
    "f16": 16.0, "q8_0": 8.5, "q4_0": 4.5, "iq4_nl": 4.5,
    "kvc8": 8.5, "kvc5": 5.5, "kvc4": 4.5, "kvc3": 3.5, "kvc2": 2.5,
    "kvct5": 5.5, "kvct4": 4.5, "kvct3": 3.5, "kvct2": 2.25,
}


# Residual buffer knobs in a config spec: letter -> (field, flag).
KNOBS: dict[str, tuple[str, str]] = {
    "w": ("window", "--kv-comp-window"),
    "s": ("sinks", "--kv-comp-sinks"),
    "n": ("merge_interval", "--kv-comp-merge"),
    "p": ("pin_threshold", "--kv-comp-pin-threshold"),
    "b": ("pin_budget", "--kv-comp-pin-budget"),
    "t": ("tracker", "--kv-comp-tracker"),
    "m": ("monitor", "--kv-comp-monitor"),
    # 1: the model's K statistics measured on the corpus loaded (--kv-comp-kstats FILE), a mode's K its type
    # for them; 2: also the model's measured per-layer profile (--kv-comp-layers, `kvcomp calibrate --layers`);
    # 3: the statistics the library measures itself on its built-in text (what `--kv-comp MODE` alone runs)
    "k": ("kstats", ""),
    "l": ("k_layers", "--kv-comp-k-layers"),  # per-layer K rule: 0 same, 1 edges (K_LAYERS_NAMES)
}


@dataclass(frozen=True)
class KvConfig:
    """One KV cache configuration to measure: K and V types and the residual buffer knobs."""

    type_k: str
    type_v: str
    window: int = 0  # --kv-comp-window
    sinks: int = 0  # --kv-comp-sinks
    merge_interval: int = 1  # --kv-comp-merge
    pin_threshold: float = 0.0  # --kv-comp-pin-threshold
    pin_budget: float = 1.0  # --kv-comp-pin-budget (per cent of cells)
    tracker: int = 0  # --kv-comp-tracker (1 on)
    mode: ModeName | None = None  # --kv-comp; the knobs above then start from its preset
    monitor: int = 1  # --kv-comp-monitor (on with kvcomp; 0 off)
    kstats: int = 0  # a mode with the model's K statistics, K its type for them: 1 corpus file, 2 + profile, 3 auto
    k_layers: int = 0  # --kv-comp-k-layers: index in K_LAYERS_NAMES (a mode with kstats: its rule)

    def __post_init__(self) -> None:
        for t in (self.type_k, self.type_v):
            if t not in ALL_TYPES:
                raise ValueError(f"unknown KV cache type {t!r}; known: {', '.join(ALL_TYPES)}")
        if self.type_v in KVCT_TYPES:
            raise ValueError(f"V cannot be {self.type_v}: the kvct types code K rows only")
        if self.window < 0 or self.sinks < 0:
            raise ValueError("window and sinks must be >= 0")
        if self.merge_interval < 1:
            raise ValueError("the merge interval must be >= 1")
        if self.pin_threshold < 0 or not 0 <= self.pin_budget <= 100:
            raise ValueError("the pin threshold must be >= 0 and the pin budget in [0, 100]")
        if self.k_layers not in range(len(K_LAYERS_NAMES)):
            rules = ", ".join(f"{i} ({n})" for i, n in enumerate(K_LAYERS_NAMES))
            raise ValueError(f"the per-layer K rule is one of {rules}")
        if self.tracker not in (0, 1) or self.monitor not in (0, 1):
            raise ValueError("the tracker and the monitor are 1 (on) or 0 (off)")
        if self.kstats not in (0, 1, 2, 3):
            raise ValueError("the K statistics are 0 (off), 1 (measured on the corpus), 2 (1 with the model's layer "
                             "profile) or 3 (measured by the library on its built-in text)")
        if self.kstats and self.mode is None:
            raise ValueError(f"':k{self.kstats}' goes with a mode (e.g. 'balanced:k1'); a plain pair names its K type "
                             "(kvct4/kvc3)")
        if self.mode is not None and self.mode not in MODE_NAMES:
            raise ValueError(f"unknown mode {self.mode!r}; known: {', '.join(MODE_NAMES)}")

    def _base(self) -> KvConfig:
        """What the knobs are measured against: the mode's preset, or everything off."""
        if self.mode is None:
            return KvConfig(self.type_k, self.type_v)
        p = mode_preset(self.mode)
        return KvConfig(p.type_k, p.type_v, p.window, p.sinks, p.merge_interval, p.pin_threshold, p.pin_budget,
                        int(p.tracker), self.mode, k_layers=K_LAYERS_NAMES.index(p.k_layers) if self.kstats else 0)

    def _knobs(self) -> list[tuple[str, str, float]]:
        """(letter, flag, value) of every knob that differs from its base."""
        base = self._base()
        return [(letter, flag, getattr(self, field)) for letter, (field, flag) in KNOBS.items()
                if getattr(self, field) != getattr(base, field)]

    @property
    def label(self) -> str:
        base: str = self.type_k if self.type_k == self.type_v else f"{self.type_k}/{self.type_v}"
        if self.mode is not None:
            base = self.mode
        return base + "".join(f":{letter}{value:g}" for letter, _, value in self._knobs())

    @property
    def needs_kstats(self) -> bool:
        """Whether K is a kvct type that loads the model's K statistics from the corpus file (with
        ':k3' the library measures its own)."""
        return self.type_k in KVCT_TYPES and self.kstats != 3

    @property
    def buffered(self) -> bool:
        return self.window > 0 or self.sinks > 0 or self.pin_threshold > 0

    def tool_args(self) -> list[str]:
        # llama-bench takes cache types from -ctk/-ctv only, so a mode's are passed as well
        args = ["-ctk", self.type_k, "-ctv", self.type_v]
        if self.mode is not None:
            args += ["--kv-comp", self.mode]
        for _, flag, value in self._knobs():
            if flag:
                args += [flag, f"{value:g}"]
        return args

    @classmethod
    def parse(cls, spec: str) -> KvConfig:
        """'kvc4' means K and V kvc4; 'kvc8/kvc4' means K kvc8, V kvc4; a mode name
        ('balanced') means its preset. Knobs follow as ':<letter><value>': w window, s sinks,
        n merge interval, p pin threshold, b pin budget (per cent), t tracker (0/1), k K
        statistics (with a mode: its K type for them; 1 the corpus file, 3 the library's own),
        e.g. 'kvc4:w32:s4', 'kvc4:w32:p0.2:b2', 'balanced:w64' or 'balanced:k1'."""
        types, *knobs = spec.split(":")
        k, _, v = types.partition("/")
        base = cls(k, v or k) if k not in MODE_NAMES else cls("f16", "f16", mode=k)._base()  # type: ignore[arg-type]
        values: dict[str, float] = {}
        for knob in knobs:
            letter, text = knob[:1], knob[1:]
            try:
                value = float(text)
            except ValueError:
                value = float("nan")
            if letter not in KNOBS or value != value:
                raise ValueError(f"bad knob {knob!r} in {spec!r}: expected one of "
                                 f"{', '.join(letter + '<N>' for letter in KNOBS)}")
            field = KNOBS[letter][0]
            if field in ("window", "sinks", "merge_interval", "tracker", "monitor", "kstats", "k_layers"):
                if not text.isdigit():
                    raise ValueError(f"bad knob {knob!r} in {spec!r}: {field} takes a whole number")
                values[field] = int(text)
            else:
                values[field] = value
        cfg = replace(base, **values)  # type: ignore[arg-type]
        if cfg.kstats and cfg.mode is not None:
            p = mode_preset(cfg.mode)
            rule = int(values.get("k_layers", K_LAYERS_NAMES.index(p.k_layers)))
            cfg = replace(cfg, type_k=p.type_k_stats, k_layers=rule)
        return cfg


# The side-by-side set of the foundation run: upstream references first.
DEFAULT_CONFIGS: tuple[KvConfig, ...] = tuple(KvConfig.parse(s) for s in (
    "f16", "q8_0", "q4_0", "iq4_nl", "kvc8", "kvc4", "kvc3", "kvc2", "kvc8/kvc4",
))
