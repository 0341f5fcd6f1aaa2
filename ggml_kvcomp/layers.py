"""Per-layer K/V budgets measured on the model: `kvcomp calibrate --layers`.

One budget, two places to spend it. A bit taken from K costs up to 50x more KLD in some layers
than in others, and a bit given to V saves up to 7x more in some layers than in others, not
the same ones (docs/kv-rows.md, "Bits per layer"). The profile lists the layers whose kvct4 K is stored as
kvct3 and those whose kvc3 V is stored as kvc4, from each layer's own cost measured by
llama-kvcomp-ksim (that layer coded, the rest exact). It saves as many bits as the fixed rule
(`--kv-comp-k-layers edges`: the first layer and the last sixth) and spends the rest where
V's saving exceeds K's cost.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from . import capi
from .calibrate import calibration_text
from .paths import binary, cache_dir
from .synth import gguf_module

# what llama-kvcomp-ksim codes for a layer: K at kvct3's and kvct4's bits (before RoPE, one
# rotation per RoPE pair, as the cache codes it) and V as kvc3 and kvc4
K_DOWN, K_KEEP = "pre-pairs:3.5", "pre-pairs:4.5"
V_KEEP, V_UP = "kvc3", "kvc4"

# the profile's GGUF keys (cpp/llama-kvcomp/kvcomp-layers.h)
KEY_VER = "kvcomp.layers.version"
KEY_ARCH = "kvcomp.layers.architecture"
KEY_N_LAYER = "kvcomp.layers.n_layer"
KEY_K_DOWN = "kvcomp.layers.k_down"
KEY_V_UP = "kvcomp.layers.v_up"
VERSION = 1


@dataclass(frozen=True)
class LayerCosts:
    """Per layer: the KLD a K bit costs (kvct3 against kvct4) and a V bit saves (kvc4 against kvc3)."""

    arch: str
    k_cost: tuple[float, ...]
    v_save: tuple[float, ...]
    # the single layers' KLDs at kvct3 K (kvc3 V) summed, over the KLD with every layer so
    # coded: near 1 when the layers' costs add up, so that they can be compared
    k_sum_ratio: float = 1.0
    v_sum_ratio: float = 1.0

    @property
    def n_layer(self) -> int:
        return len(self.k_cost)

    @property
    def additive(self) -> bool:
        return all(1 / MAX_SUM_RATIO <= r <= MAX_SUM_RATIO for r in (self.k_sum_ratio, self.v_sum_ratio))


# How far the single-layer costs may be from adding up before they are not trusted. SmolLM2-F32
# measured 1.02 (K) and 0.89 (V); the quantized files, whose KLD has a floor of its own under
# any change of K or V, 4.95 / 4.74 (Gemma-3 Q4_K_M) and 5.87 / 5.43 (SmolLM2 Q4_1).
MAX_SUM_RATIO = 1.5


def rule_layers(n_layer: int) -> list[int]:
    """The layers whose kvct4 K the fixed rule ('edges', the library's) stores as kvct3."""
    return [il for il, t in enumerate(capi.layer_types_k("edges", n_layer, "kvct4")) if t == "kvct3"]


def n_free(n_layer: int) -> int:
    """The K bits the fixed rule saves, one per layer it moves down."""
    return len(rule_layers(n_layer))


def choose(costs: LayerCosts) -> tuple[list[int], list[int]]:
    """(K down, V up): the n_free cheapest K layers, then pairs (the next cheapest K layer, the
    V layer that saves most) while the saving exceeds the cost. Costs that do not add up give
    the fixed rule's layers and no V up: what they would choose is noise."""
    if not costs.additive:
        return rule_layers(costs.n_layer), []
    k_order = sorted(range(costs.n_layer), key=lambda il: costs.k_cost[il])
    v_order = sorted(range(costs.n_layer), key=lambda il: -costs.v_save[il])
    free = n_free(costs.n_layer)
    k_down, v_up = k_order[:free], []
    for k, v in zip(k_order[free:], v_order, strict=False):
        if costs.v_save[v] <= costs.k_cost[k]:
            break
        k_down.append(k)
        v_up.append(v)
    return sorted(k_down), sorted(v_up)


def parse_ksim(out: str, arch: str, n_layer: int) -> LayerCosts:
    """The single-layer costs from llama-kvcomp-ksim's table."""
    kld: dict[tuple[str, str], float] = {}
    for part, coder, value in re.findall(r"^\| ([KV]) \| (\S+) \| [\d.]+ \| ([\d.eE+-]+) \|", out, re.MULTILINE):
        kld[(part, coder)] = float(value)
    try:
        k_cost = tuple(kld[("K", f"{K_DOWN}@{il}")] - kld[("K", f"{K_KEEP}@{il}")] for il in range(n_layer))
        v_save = tuple(kld[("V", f"{V_KEEP}@{il}")] - kld[("V", f"{V_UP}@{il}")] for il in range(n_layer))
        k_sum = sum(kld[("K", f"{K_DOWN}@{il}")] for il in range(n_layer)) / max(kld[("K", K_DOWN)], 1e-12)
        v_sum = sum(kld[("V", f"{V_KEEP}@{il}")] for il in range(n_layer)) / max(kld[("V", V_KEEP)], 1e-12)
    except KeyError as e:
        raise ValueError(f"llama-kvcomp-ksim's table lacks {e.args[0]}") from None
    return LayerCosts(arch, k_cost, v_save, k_sum, v_sum)


def model_shape(model: Path) -> tuple[str, int]:
    """The model's architecture and layer count, from its GGUF header."""
    reader = gguf_module().GGUFReader(model)

    def field(name: str) -> object:
        f = reader.fields.get(name)
        if f is None:
            raise ValueError(f"{model.name}: no {name}")
        return f.parts[f.data[0]]

    arch = bytes(field("general.architecture")).decode("utf-8")  # type: ignore[call-overload]
    return arch, int(field(f"{arch}.block_count")[0])  # type: ignore[index]


def measure(model: Path, text: Path | None = None, ctx: int = 1024, chunks: int = 1, threads: int = 2) -> LayerCosts:
    """Each layer's costs, from one llama-kvcomp-ksim run (the first 4 positions exact, as
    balanced's sinks keep them)."""
    arch, n_layer = model_shape(model)
    kcode = ",".join([K_DOWN] + [f"{c}@{il}" for il in range(n_layer) for c in (K_DOWN, K_KEEP)])
    vcode = ",".join([V_KEEP] + [f"{c}@{il}" for il in range(n_layer) for c in (V_KEEP, V_UP)])
    args = [str(binary("llama-kvcomp-ksim")), "-m", str(model), "-f", str(text or calibration_text()), "-c", str(ctx),
            "--chunks", str(chunks), "-t", str(threads), "--exact-first", "4", "--kcode", kcode, "--vcode", vcode]
    proc = subprocess.run(args, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-kvcomp-ksim failed for {model.name}:\n{proc.stderr[-2000:]}")
    return parse_ksim(proc.stdout, arch, n_layer)


def write(path: Path, costs: LayerCosts) -> tuple[list[int], list[int]]:
    """Writes the profile chosen from costs (and the costs, for the record); returns its lists."""
    k_down, v_up = choose(costs)
    gguf = gguf_module()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    w = gguf.GGUFWriter(str(tmp), costs.arch)
    w.add_uint32(KEY_VER, VERSION)
    w.add_string(KEY_ARCH, costs.arch)
    w.add_uint32(KEY_N_LAYER, costs.n_layer)
    w.add_array(KEY_K_DOWN, k_down)
    w.add_array(KEY_V_UP, v_up)
    w.add_array("kvcomp.layers.k_cost", [float(c) for c in costs.k_cost])
    w.add_array("kvcomp.layers.v_save", [float(s) for s in costs.v_save])
    w.add_array("kvcomp.layers.sum_ratio", [float(costs.k_sum_ratio), float(costs.v_sum_ratio)])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    tmp.rename(path)
    return k_down, v_up


def profile_path(model: Path) -> Path:
    """Where a model's profile is kept: named by the file, its size and the version."""
    return cache_dir() / "kstats" / f"{model.stem}-{model.stat().st_size}-v{VERSION}.layers.gguf"


def ensure_profile(model: Path) -> Path:
    """The model's profile, measured on first use."""
    path = profile_path(model)
    if not path.exists():
        write(path, measure(model))
    return path
