"""llama-kvcomp-rows and scripts/kv_rows_gain.py (docs/kv-rows.md): the dump holds K before
and after RoPE as the graph computed them, and the coding-gain math matches its closed form."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str) -> ModuleType:
    # the scripts import each other by name, as they do when run from scripts/
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _gain_script() -> ModuleType:
    return _script("kv_rows_gain")


def _pair_norms(k: np.ndarray) -> np.ndarray:
    norms: np.ndarray = np.hypot(k[..., 0::2], k[..., 1::2])
    return norms


def test_dump_is_rope_of_its_input(bins: Path, model: Path, text: Path, tmp_path: Path) -> None:
    prefix = tmp_path / "rows"
    proc = subprocess.run([str(bins / "llama-kvcomp-rows"), "-m", str(model), "-f", str(text), "-c", "512",
                           "-ub", "256", "-b", "256", "-t", "2", "-o", str(prefix)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    meta = json.loads(Path(f"{prefix}.json").read_text())
    assert (meta["n_layer"], meta["n_head"], meta["n_head_kv"], meta["head_dim"]) == (30, 9, 3, 64)
    gain = _gain_script()
    kpre = gain.load(prefix, "kpre", meta["n_head_kv"], meta)
    kpost = gain.load(prefix, "kpost", meta["n_head_kv"], meta)
    qpost = gain.load(prefix, "qpost", meta["n_head"], meta)
    assert kpre.shape == kpost.shape == (30, 3, 512, 64) and qpost.shape == (30, 9, 512, 64)
    # position 0 is RoPE's identity; later positions turn each pair of channels (llama's
    # adjacent pairs) without changing its length, so K must differ but keep pair norms
    np.testing.assert_allclose(kpost[:, :, 0], kpre[:, :, 0], rtol=1e-6, atol=1e-6)
    assert np.abs(kpost[:, :, 1:] - kpre[:, :, 1:]).max() > 1e-2 * np.abs(kpre).max()
    np.testing.assert_allclose(_pair_norms(kpost), _pair_norms(kpre), rtol=1e-4, atol=1e-4 * np.abs(kpre).max())
    assert np.isfinite(qpost).all() and np.abs(qpost).max() > 0


@pytest.mark.parametrize("bits", [2.0, 4.0])
def test_water_filling_closed_form(bits: float) -> None:
    # every variance above the water level: D = d * geomean(lam) * 2^(-2R)
    gain = _gain_script()
    lam = np.array([4.0, 2.0, 1.0, 0.5])
    expected = len(lam) * np.exp(np.log(lam).mean()) * 2.0 ** (-2 * bits)
    assert gain.water_filling(lam, bits) == pytest.approx(expected, rel=1e-6)


def test_head_gains_see_structure() -> None:
    # white K and white Q: no gain; K with one strong direction read by Q along it: a gain
    gain = _gain_script()
    rng = np.random.default_rng(0)
    white = rng.standard_normal((20000, 8))
    ck, cq = gain.covariance(white), gain.second_moment(rng.standard_normal((20000, 8)))
    gk, gw = gain.k_gain(ck, 4.0), gain.weighted_gain_vs_post(ck, cq, ck, cq, 4.0)
    assert gk == pytest.approx(1.0, rel=0.05) and gw == pytest.approx(1.0, rel=0.1)
    strong = white * np.array([10.0, 1, 1, 1, 1, 1, 1, 1])
    ck, cq = gain.covariance(strong), gain.second_moment(white * np.array([10.0, 1, 1, 1, 1, 1, 1, 1]))
    gk, gw = gain.k_gain(ck, 4.0), gain.weighted_gain_vs_post(ck, cq, ck, cq, 4.0)
    assert gk > 2.0 and gw > gk


def _rope(x: np.ndarray, pairs: np.ndarray, pos: np.ndarray) -> np.ndarray:
    theta = 10000.0 ** (-np.arange(len(pairs)) / len(pairs))
    a = pos[:, None] * theta[None, :]
    out = x.copy()
    x0, x1 = x[:, pairs[:, 0]], x[:, pairs[:, 1]]
    out[:, pairs[:, 0]] = x0 * np.cos(a) - x1 * np.sin(a)
    out[:, pairs[:, 1]] = x0 * np.sin(a) + x1 * np.cos(a)
    return out


@pytest.mark.parametrize("neox", [False, True])
def test_pre_rope_weight(neox: bool) -> None:
    # the pairing is told from the data, W keeps C_q's trace (rotations), and without
    # rotation (position 0) W is C_q itself
    gain = _gain_script()
    rng = np.random.default_rng(1)
    d = 16
    pairs = np.stack([np.arange(d // 2), np.arange(d // 2) + d // 2], 1) if neox else np.arange(d).reshape(-1, 2)
    kpre = rng.standard_normal((400, d)) * np.linspace(3.0, 0.2, d)
    kpost = _rope(kpre, pairs, np.arange(400, dtype=float))
    np.testing.assert_array_equal(gain.rope_pairs(kpre, kpost), pairs)
    q = rng.standard_normal((800, d)) * np.linspace(0.5, 2.0, d)
    cq = gain.second_moment(q)
    w = gain.pre_rope_weight(kpre, kpost, cq, pairs)
    assert np.trace(w) == pytest.approx(np.trace(cq), rel=1e-9)
    np.testing.assert_allclose(gain.pre_rope_weight(kpre, kpre, cq, pairs), cq, rtol=1e-9, atol=1e-12)
    # turned over many positions, a pair's weight is its two channels' mean
    for a, b in pairs[:3]:
        assert w[a, a] == pytest.approx(w[b, b], rel=0.1)
        assert w[a, a] == pytest.approx(0.5 * (cq[a, a] + cq[b, b]), rel=0.1)


@pytest.mark.parametrize(("bits", "distortion"), [(1, 0.3634), (2, 0.1175), (3, 0.03454), (4, 0.009497)])
def test_lloyd_max_matches_the_gaussian_table(bits: int, distortion: float) -> None:
    # Max (1960)'s optimal quantizers of a unit Gaussian
    proto = _script("kv_transform_proto")
    assert proto.lloyd_max(bits)[1] == pytest.approx(distortion, rel=2e-3)


def test_allocation_spends_the_budget_where_the_variance_is() -> None:
    proto = _script("kv_transform_proto")
    var = np.array([100.0, 10.0, 1.0, 0.1, 0.001])
    bits = proto.allocate(var, 12)
    assert bits.sum() == 12 and list(bits) == sorted(bits, reverse=True) and bits[0] > bits[2] and bits[-1] == 0


def test_kvc4_round_trip_is_kvc4(bins: Path) -> None:
    # the prototype's baseline is the real quantizer: 4.5 bpe on Gaussian rows, NMSE about
    # 0.005 (docs/formats.md), and idempotent on its own output
    proto = _script("kv_transform_proto")
    x = np.random.default_rng(2).standard_normal((64, 128))
    y = proto.kvc4_round_trip(x)
    assert 0.003 < ((x - y) ** 2).sum() / (x**2).sum() < 0.008
    np.testing.assert_allclose(proto.kvc4_round_trip(y), y, rtol=1e-6, atol=1e-6)


def test_lloyd_max_header_is_current() -> None:
    # the C tables (cpp/ggml-kvcomp/kvc-lloyd-max.h) are what the generator writes now
    gen = _script("gen_lloyd_max")
    assert (ROOT / "cpp/ggml-kvcomp/kvc-lloyd-max.h").read_text() == gen.header()


@pytest.mark.parametrize("space", ["pre-pairs", "post-pairs"])
def test_c_reference_codes_as_the_prototype(bins: Path, space: str) -> None:
    # Gaussian pairs of falling energy: the C reference (kvc_t_*, with its row scale search)
    # is at least as accurate as the numpy coder (RMS scale) and within 2x of its error
    proto = _script("kv_transform_proto")
    rng = np.random.default_rng(5)
    d, n = 64, 600
    pairs = np.stack([np.arange(0, d, 2), np.arange(1, d, 2)], 1)
    scale = np.repeat(2.0 ** (-np.arange(d // 2) / 6.0), 2) * np.tile([1.0, 0.3], d // 2)
    x = rng.standard_normal((n, d)) * scale
    calib, later = x[:300], x[300:]
    y = proto.kvct_round_trip(later, proto.pair_stats(calib, np.eye(d), pairs), pairs, space, round(4.5 * d))
    err_c = float(((later - y) ** 2).sum())
    # the numpy coder, through code_head's K error gain over kvc4 on the same rows
    _, gain_np = proto.code_head(x, x, pairs, x[:300], x[300:], 300, 4.5, space)
    _, gain_c = proto.code_head(x, x, pairs, x[:300], x[300:], 300, 4.5, space, reference=True)
    assert err_c > 0 and gain_c >= 0.95 * gain_np and gain_c <= 2.0 * gain_np


@pytest.mark.parametrize(("neox", "n_kv"), [(False, 2), (True, 2), (True, 1)])
def test_shipped_plans_are_read_from_the_statistics_file(bins: Path, tmp_path: Path, neox: bool, n_kv: int) -> None:
    # --kstats: a calibration file's per-pair values land on the channels of each pair, and
    # rows coded under them are those coded under the same statistics given directly
    from ggml_kvcomp.synth import gguf_module

    proto = _script("kv_transform_proto")
    rng = np.random.default_rng(7)
    d = 64
    pairs = np.stack([np.arange(d // 2), np.arange(d // 2) + d // 2], 1) if neox else np.arange(d).reshape(-1, 2)
    x = np.zeros((n_kv, d // 2, 8), dtype=np.float32)
    x[..., 0:2] = rng.standard_normal((n_kv, d // 2, 2))
    e = 2.0 ** (-np.arange(d // 2) / 5.0)
    x[..., 2], x[..., 3], x[..., 4] = e, 0.2 * e, 0.6 * e
    x[..., 5], x[..., 7] = 1.0, 1.0
    w = gguf_module().GGUFWriter(str(tmp_path / "k.gguf"), "test")
    w.add_tensor("kvcomp.kstats.3", x)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    st = proto.file_stats(tmp_path / "k.gguf", pairs)
    assert sorted(st) == [(3, h) for h in range(n_kv)]
    # rows of a model with more layers or heads than the file are refused, not fitted to
    assert proto.uncovered(st, 4, n_kv) == [(il, h) for il in range(3) for h in range(n_kv)]
    assert proto.uncovered(st, 4, n_kv + 1)[-1] == (3, n_kv)
    h = n_kv - 1
    s = st[(3, h)]
    np.testing.assert_array_equal(s.mean[pairs[:, 0]], x[h, :, 0])
    np.testing.assert_array_equal(s.mean[pairs[:, 1]], x[h, :, 1])
    np.testing.assert_array_equal(s.k2, x[h, :, 2:5])
    np.testing.assert_array_equal(s.w, x[h, :, 5:8])
    rows = s.mean + rng.standard_normal((50, d)) * np.sqrt(np.repeat(e, 2))[np.argsort(pairs.reshape(-1))]
    direct = proto.PairStats(s.mean.copy(), x[h, :, 2:5].astype(np.float64), x[h, :, 5:8].astype(np.float64))
    y = proto.kvct_round_trip(rows, s, pairs, "pre-pairs", round(4.5 * d))
    np.testing.assert_array_equal(y, proto.kvct_round_trip(rows, direct, pairs, "pre-pairs", round(4.5 * d)))
    assert ((rows - y) ** 2).sum() < 0.05 * ((rows - s.mean) ** 2).sum()


def test_ksim_measures_k_and_v_coding(bins: Path, text: Path) -> None:
    # llama-kvcomp-ksim: the exact coder changes nothing (KLD 0 exactly: the harness adds no
    # noise of its own), and the transform coder at kvc4's 4.5 bpe has at most half of kvc4's
    # KLD on K (docs/kv-rows.md measured a fifth at ctx 2048); V coded by kvc4 costs KLD, and
    # by kvc3 more; a bad coder name is refused, and so is the post-RoPE coder for V
    from ggml_kvcomp import models

    f32 = models.fetch_model("smollm2-135m-f32")
    args = [str(bins / "llama-kvcomp-ksim"), "-m", str(f32), "-f", str(text), "-c", "512", "--chunks", "1", "-t", "2"]
    out = subprocess.run([*args, "--kcode", "f16,kvc4,pre-pairs:4.5", "--vcode", "f16,kvc4,kvc3"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [r.split("|") for r in out.stdout.splitlines() if r.startswith("| ") and "KLD" not in r]
    kld = {(r[1].strip(), r[2].strip()): float(r[4]) for r in rows}
    assert kld["K", "f16"] == 0.0 and kld["V", "f16"] == 0.0
    assert 0.0 < kld["K", "pre-pairs:4.5"] <= 0.5 * kld["K", "kvc4"]
    assert 0.0 < kld["V", "kvc4"] < kld["V", "kvc3"]
    bad = subprocess.run([*args, "--kcode", "kvc6"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "unknown K coder 'kvc6'" in bad.stderr
    bad = subprocess.run([*args, "--vcode", "post-pairs:4.5"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "unknown V coder 'post-pairs:4.5'" in bad.stderr
    # per-layer bits need their list, and a list of bits per value in range
    bad = subprocess.run([*args, "--kcode", "pre-pairs:per-layer"], capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "unknown K coder 'pre-pairs:per-layer'" in bad.stderr
    bad = subprocess.run([*args, "--layer-bpe", "4,9", "--kcode", "pre-pairs:per-layer"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "--layer-bpe wants" in bad.stderr
