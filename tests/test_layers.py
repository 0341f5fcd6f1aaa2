"""Per-layer K/V profiles (`kvcomp calibrate --layers`, --kv-comp-layers): the choice against
an exhaustive one, the file's round trip through the C loader into a cache's layer types, and
bad files refused with their reason."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from ggml_kvcomp import calibrate, capi, layers, models

from .test_kvct import _perplexity


def _best_objective(costs: layers.LayerCosts) -> float:
    # every number of pairs m: the n_free + m cheapest K layers, the m V layers that save most
    k = sorted(costs.k_cost)
    v = sorted(costs.v_save, reverse=True)
    free = layers.n_free(costs.n_layer)
    return min(sum(k[:free + m]) - sum(v[:m]) for m in range(costs.n_layer - free + 1))


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("n_layer", [1, 4, 18, 30])
def test_choice_is_the_best_split(seed: int, n_layer: int) -> None:
    rng = np.random.default_rng(seed)
    costs = layers.LayerCosts("llama", tuple(rng.exponential(1.0, n_layer)), tuple(rng.exponential(2.0, n_layer)))
    k_down, v_up = layers.choose(costs)
    assert len(k_down) == len(v_up) + layers.n_free(n_layer)
    got = sum(costs.k_cost[i] for i in k_down) - sum(costs.v_save[i] for i in v_up)
    assert got == pytest.approx(_best_objective(costs), abs=1e-12)


def test_ksim_table_is_read() -> None:
    rows = [f"| K | {c}@{il} | 4.50 | {0.001 * (il + 1) * (2 if c == layers.K_DOWN else 1):.6f} | 0.000010 |"
            for il in range(3) for c in (layers.K_DOWN, layers.K_KEEP)]
    rows += [f"| V | {c}@{il} | 3.50 | {0.004 if c == layers.V_KEEP else 0.001:.6f} | 0.000010 |"
             for il in range(3) for c in (layers.V_KEEP, layers.V_UP)]
    rows += [f"| K | {layers.K_DOWN} | 3.50 | 0.010000 | 0.000010 |",
             f"| V | {layers.V_KEEP} | 3.50 | 0.012000 | 0.000010 |"]
    costs = layers.parse_ksim("\n".join(rows), "llama", 3)
    assert costs.k_cost == pytest.approx((0.001, 0.002, 0.003)) and costs.v_save == pytest.approx((0.003,) * 3)
    assert (costs.k_sum_ratio, costs.v_sum_ratio) == pytest.approx((1.2, 1.0)) and costs.additive
    with pytest.raises(ValueError, match="lacks"):
        layers.parse_ksim("\n".join(rows[1:]), "llama", 3)


@pytest.mark.parametrize("ratios", [(4.8, 1.0), (1.0, 0.5)])
def test_costs_that_do_not_add_up_give_the_rule(ratios: tuple[float, float], tmp_path: Path) -> None:
    # a file whose KLD has a floor (Gemma-3's Q4_K_M) makes single-layer costs meaningless
    n = 18
    costs = layers.LayerCosts("gemma3", tuple(1.0 for _ in range(n)), tuple(5.0 for _ in range(n)), *ratios)
    k_down, v_up = layers.choose(costs)
    assert (k_down, v_up) == ([il for il, t in enumerate(capi.layer_types_k("edges", n, "kvct4")) if t == "kvct3"], [])
    assert k_down == [0, 15, 16, 17]
    capi.load_layers(_profile(tmp_path / "rule.gguf", "gemma3", n, k_down, v_up))  # an empty list loads
    capi.load_layers(None)


def _profile(path: Path, arch: str, n_layer: int, k_down: list[int], v_up: list[int], version: int = 1) -> Path:
    w = layers.gguf_module().GGUFWriter(str(path), arch)
    w.add_uint32(layers.KEY_VER, version)
    w.add_string(layers.KEY_ARCH, arch)
    w.add_uint32(layers.KEY_N_LAYER, n_layer)
    w.add_array(layers.KEY_K_DOWN, k_down)
    w.add_array(layers.KEY_V_UP, v_up)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


def test_profile_sets_each_layers_types(bins: Path, model: Path, text: Path, tmp_path: Path) -> None:
    arch, n_layer = layers.model_shape(model)
    costs = layers.LayerCosts(arch, tuple(float(i) for i in range(n_layer)),
                              tuple(float(n_layer - i) for i in range(n_layer)))
    prof = tmp_path / "p.gguf"
    k_down, v_up = layers.write(prof, costs)
    kstats = str(calibrate.ensure_kstats(model))
    proc = _perplexity(bins, model, text, "--kv-comp", "balanced", "--kv-comp-kstats", kstats,
                       "--kv-comp-layers", str(prof))
    assert proc.returncode == 0, proc.stderr[-1500:]
    m = re.search(r"kvcomp: K plans of \d+ layers \(([^;]*); V ([^)]*)\)", proc.stderr)
    assert m, proc.stderr[-1500:]
    assert m.group(1).split(",") == ["kvct3" if il in k_down else "kvct4" for il in range(n_layer)]
    assert m.group(2).split(",") == ["kvc4" if il in v_up else "kvc3" for il in range(n_layer)]


@pytest.mark.parametrize(("make", "reason"), [
    (lambda p: p, "missing or damaged"),
    (lambda p: (p.write_bytes(b"GGUF" + bytes(range(200))), p)[1], "missing or damaged"),
    (lambda p: _profile(p, "llama", 30, [0, 30], []), "lists layer 30 of a model of 30 layers"),
    (lambda p: _profile(p, "llama", 30, [0, 0], []), "lists layer 0 twice"),
    (lambda p: _profile(p, "llama", 30, [0], [1], version=9), "profile version 9"),
    (lambda p: _profile(p, "llama", 30, [0.5], []), "no INT32 array kvcomp.layers.k_down"),
])
def test_bad_profiles_are_refused(tmp_path: Path, make: object, reason: str) -> None:
    path = make(tmp_path / "bad.gguf")  # type: ignore[operator]
    with pytest.raises(ValueError, match=reason):
        capi.load_layers(path)
    capi.load_layers(None)


def test_profile_of_another_model_is_refused(bins: Path, model: Path, text: Path, tmp_path: Path) -> None:
    other = _profile(tmp_path / "other.gguf", "gemma3", 18, [0], [1])
    kstats = str(calibrate.ensure_kstats(model))
    proc = _perplexity(bins, model, text, "--kv-comp", "balanced", "--kv-comp-kstats", kstats,
                       "--kv-comp-layers", str(other))
    assert proc.returncode != 0
    assert "measured on a gemma3 model of 18 layers" in proc.stdout + proc.stderr
    assert "Segmentation fault" not in proc.stderr and "GGML_ASSERT" not in proc.stderr
    args = [str(bins / "llama-perplexity"), "-m", str(model), "--kv-comp-layers", str(tmp_path / "none.gguf")]
    bad = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--kv-comp-layers" in bad.stdout + bad.stderr


def test_measure_reads_every_layer_from_ksim(bins: Path, text: Path, tmp_path: Path) -> None:
    # the real llama-kvcomp-ksim table on the 4-layer synthetic model (its numbers mean nothing;
    # the run's shape does): every layer's costs come back finite, and the profile loads
    synth = models.fetch_model("synth-kv8x128")
    costs = layers.measure(synth, text, ctx=128, chunks=1)
    assert (costs.arch, costs.n_layer) == layers.model_shape(synth) == ("llama", 4)
    assert all(np.isfinite(costs.k_cost)) and all(np.isfinite(costs.v_save)) and costs.k_sum_ratio > 0
    k_down, _ = layers.write(tmp_path / "synth.gguf", costs)
    assert len(k_down) >= layers.n_free(4)
    capi.load_layers(tmp_path / "synth.gguf")
    capi.load_layers(None)
