// Tests of the transform-coded K row's reference (kvc-transform.c):
// - the plan's transform is orthogonal (T T' = I within 1e-6) and attention over rows and a
//   query both sent through it equals attention without it (within 1e-5);
// - on Gaussian rows of a known covariance, the coder's mean squared error lies between
//   Shannon's bound at the row's bits (reverse water-filling with real rates; for the
//   Gaussian rows, not the turned ones of the pooled basis) and 1.5x what
//   Lloyd-Max quantizers at the plan's bits predict (sum of variance x distortion; the row
//   scale's search takes it below that prediction when a few coefficients dominate), for both
//   bases; and it is below half of kvc4's error at the same 4.5 bits per value on the same
//   rows after a Hadamard rotation (the equal-bits coder);
// - the bit budget is spent exactly; a zero row and non-finite values follow the documented
//   rules; bad statistics and damaged plans are refused;
// - every code is the level nearest to its coefficient at the row's scale.

#include "kvc-test-util.h"
#include "kvc-transform.h"
#include "kvc-common.h"

#include <algorithm>
#include <cstring>

using namespace kvc_test;

namespace {

struct ellipse_rows {
    int d;
    std::vector<int16_t> pairs;  // 2 per pair
    std::vector<float>   mean;
    std::vector<float>   k2;     // centred moments, 3 per pair
    std::vector<float>   x;      // n rows
    int n;
};

// Each pair (a, b) holds a Gaussian ellipse: axes sigma1 >= sigma2 at angle th around a mean.
// Energies fall across the pairs, as in real K heads; one channel in eight has a mean of 3
// sigma1. turn: each row's pairs are turned by a random angle afterwards (K after RoPE at
// random positions), and the moments returned are those of the turned rows.
ellipse_rows make_ellipses(int d, bool half_pairs, int n, bool turn, uint32_t seed) {
    ellipse_rows r;
    r.d = d;
    r.n = n;
    std::mt19937 rng(seed);
    std::normal_distribution<double> z(0.0, 1.0);
    std::uniform_real_distribution<double> ang(0.0, 2.0 * M_PI);
    std::vector<double> s1(d / 2), s2(d / 2), th(d / 2);
    for (int p = 0; p < d / 2; ++p) {
        const int a = half_pairs ? p : 2 * p;
        const int b = half_pairs ? p + d / 2 : 2 * p + 1;
        r.pairs.push_back((int16_t) a);
        r.pairs.push_back((int16_t) b);
        s1[p] = 4.0 * std::pow(2.0, -p / 5.0);
        s2[p] = s1[p] * (0.15 + 0.85 * ((p * 5) % 7) / 6.0);
        th[p] = 0.7 * p;
    }
    r.mean.assign(d, 0.0f);
    for (int p = 0; p < d / 2; p += 8) {
        r.mean[r.pairs[2 * p]] = (float) (3.0 * s1[p]);
    }
    std::vector<double> acc((size_t) 3 * d / 2, 0.0), m(d, 0.0);
    r.x.resize((size_t) n * d);
    for (int i = 0; i < n; ++i) {
        float * row = r.x.data() + (size_t) i * d;
        for (int p = 0; p < d / 2; ++p) {
            const int a = r.pairs[2 * p], b = r.pairs[2 * p + 1];
            const double u = s1[p] * z(rng), v = s2[p] * z(rng);
            double ka = std::cos(th[p]) * u - std::sin(th[p]) * v + r.mean[a];
            double kb = std::sin(th[p]) * u + std::cos(th[p]) * v + r.mean[b];
            if (turn) {
                const double t = ang(rng);
                const double ta = std::cos(t) * ka - std::sin(t) * kb;
                kb = std::sin(t) * ka + std::cos(t) * kb;
                ka = ta;
            }
            row[a] = (float) ka;
            row[b] = (float) kb;
        }
    }
    if (!turn) {
        // the known covariance
        for (int p = 0; p < d / 2; ++p) {
            const double c = std::cos(th[p]), s = std::sin(th[p]);
            r.k2.push_back((float) (c * c * s1[p] * s1[p] + s * s * s2[p] * s2[p]));
            r.k2.push_back((float) (c * s * (s1[p] * s1[p] - s2[p] * s2[p])));
            r.k2.push_back((float) (s * s * s1[p] * s1[p] + c * c * s2[p] * s2[p]));
        }
        return r;
    }
    // turned rows: their mean is 0 and each pair's moments are isotropic, (E|k|^2 / 2) I
    std::fill(r.mean.begin(), r.mean.end(), 0.0f);
    for (int p = 0; p < d / 2; ++p) {
        const int a = r.pairs[2 * p], b = r.pairs[2 * p + 1];
        double e = 0.0;
        for (int i = 0; i < n; ++i) {
            e += (double) r.x[(size_t) i * d + a] * r.x[(size_t) i * d + a] + (double) r.x[(size_t) i * d + b] * r.x[(size_t) i * d + b];
        }
        e /= 2.0 * n;
        r.k2.push_back((float) e);
        r.k2.push_back(0.0f);
        r.k2.push_back((float) e);
    }
    return r;
}

kvc_t_stats stats_of(const ellipse_rows & r, const std::vector<float> & w) {
    kvc_t_stats st;
    st.d    = r.d;
    st.pair = (const int16_t (*)[2]) r.pairs.data();
    st.mean = r.mean.data();
    st.k2   = (const float (*)[3]) r.k2.data();
    st.w    = (const float (*)[3]) w.data();
    return st;
}

std::vector<float> identity_weights(int d) {
    std::vector<float> w;
    for (int p = 0; p < d / 2; ++p) {
        w.insert(w.end(), { 1.0f, 0.0f, 1.0f });
    }
    return w;
}

std::vector<float> hadamard(int d) {
    std::vector<float> h((size_t) d * d);
    for (int i = 0; i < d; ++i) {
        for (int j = 0; j < d; ++j) {
            h[(size_t) i * d + j] = (__builtin_popcount(i & j) % 2 ? -1.0f : 1.0f) / std::sqrt((float) d);
        }
    }
    return h;
}

std::vector<float> mat_rows(const std::vector<float> & x, const std::vector<float> & h, int d) {
    std::vector<float> y(x.size(), 0.0f);
    for (size_t r = 0; r < x.size() / d; ++r) {
        for (int i = 0; i < d; ++i) {
            double s = 0.0;
            for (int j = 0; j < d; ++j) {
                s += (double) h[(size_t) i * d + j] * x[r * d + j];
            }
            y[r * d + i] = (float) s;
        }
    }
    return y;
}

double mse_rows(const std::vector<float> & a, const std::vector<float> & b, int n) {
    double s = 0.0;
    for (size_t i = 0; i < a.size(); ++i) {
        s += ((double) a[i] - b[i]) * ((double) a[i] - b[i]);
    }
    return s / n;
}

void test_orthogonal(report & rep, int d, bool half) {
    const ellipse_rows r = make_ellipses(d, half, 8, false, 1);
    const std::vector<float> w = identity_weights(d);
    const kvc_t_stats st = stats_of(r, w);
    kvc_t_plan plan;
    rep.check(kvc_t_plan_fit(&plan, &st, KVC_T_BASIS_PAIR_AXES, 4 * d + 8), "d=%d: plan fitted", d);
    kvc_t_plan rot = plan;
    std::fill(std::begin(rot.mean), std::end(rot.mean), 0.0f);
    std::vector<float> cols((size_t) d * d);
    for (int i = 0; i < d; ++i) {
        std::vector<float> e(d, 0.0f);
        e[i] = 1.0f;
        kvc_t_forward(&rot, e.data(), cols.data() + (size_t) i * d);
    }
    double worst = 0.0;
    for (int i = 0; i < d; ++i) {
        for (int j = 0; j < d; ++j) {
            double s = 0.0;
            for (int k = 0; k < d; ++k) {
                s += (double) cols[(size_t) i * d + k] * cols[(size_t) j * d + k];
            }
            worst = std::max(worst, std::fabs(s - (i == j ? 1.0 : 0.0)));
        }
    }
    rep.check(worst <= 1e-6, "d=%d %s pairs: T T' = I within %.1e <= 1e-6", d, half ? "(i, i+d/2)" : "(2i, 2i+1)", worst);

    // attention of one query over 64 keys, with and without the transform (mean included:
    // q.k = Tq . T(k - mean) + q.mean)
    const auto q = make_rows(dist::gaussian, 1, d, 7);
    const auto v = make_rows(dist::gaussian, 64, d, 8);
    const ellipse_rows keys = make_ellipses(d, half, 64, false, 9);
    std::vector<float> tq(d), tk(d);
    kvc_t_forward(&rot, q.data(), tq.data());
    double qm = 0.0;
    for (int i = 0; i < d; ++i) {
        qm += (double) q[i] * plan.mean[i];
    }
    std::vector<double> s0(64), s1(64);
    for (int j = 0; j < 64; ++j) {
        const float * k = keys.x.data() + (size_t) j * d;
        kvc_t_forward(&plan, k, tk.data());
        double a = 0.0, b = qm;
        for (int i = 0; i < d; ++i) {
            a += (double) q[i] * k[i];
            b += (double) tq[i] * tk[i];
        }
        s0[j] = a / std::sqrt((double) d);
        s1[j] = b / std::sqrt((double) d);
    }
    auto attend = [&](const std::vector<double> & s) {
        const double m = *std::max_element(s.begin(), s.end());
        std::vector<double> out(d, 0.0);
        double sum = 0.0;
        for (int j = 0; j < 64; ++j) {
            const double p = std::exp(s[j] - m);
            sum += p;
            for (int i = 0; i < d; ++i) {
                out[i] += p * v[(size_t) j * d + i];
            }
        }
        for (double & o : out) {
            o /= sum;
        }
        return out;
    };
    const auto o0 = attend(s0), o1 = attend(s1);
    double diff = 0.0;
    for (int i = 0; i < d; ++i) {
        diff = std::max(diff, std::fabs(o0[i] - o1[i]));
    }
    rep.check(diff <= 1e-5, "d=%d: attention with T on Q and K equals attention without it: max diff %.1e <= 1e-5", d, diff);
}

// The coder's error against reverse water-filling's prediction and against kvc4 at equal bits.
void test_water_filling(report & rep, int d, bool half, kvc_t_basis basis) {
    const bool turn = basis == KVC_T_BASIS_POOLED;
    const int n = 4000;
    const ellipse_rows r = make_ellipses(d, half, n, turn, 11 + d);
    const std::vector<float> w = identity_weights(d);
    const kvc_t_stats st = stats_of(r, w);
    const int32_t row_bits = 9 * d / 2; // 4.5 bits per value, the scale included
    kvc_t_plan plan;
    const bool ok = kvc_t_plan_fit(&plan, &st, basis, row_bits);
    rep.check(ok && kvc_t_plan_valid(&plan), "d=%d %s: plan of %d bits fitted and valid", d, turn ? "pooled" : "pair axes", row_bits);
    if (!ok) {
        return;
    }
    int sum = 8, n_zero = 0, n_high = 0;
    double predicted = 0.0;
    for (int j = 0; j < d; ++j) {
        sum += plan.bits[j];
        n_zero += plan.bits[j] == 0;
        n_high += plan.bits[j] >= 6;
        predicted += (double) plan.sigma[j] * plan.sigma[j] * kvc_t_lloyd_max_dist(plan.bits[j]);
    }
    rep.check(sum == row_bits && kvc_t_row_size(row_bits) == (size_t) (row_bits + 7) / 8,
        "d=%d: the bits spend the budget exactly (%d = %d; %d coefficients at 0 bits, %d at 6 or more)", d, sum, row_bits, n_zero, n_high);

    std::vector<uint8_t> q(kvc_t_row_size(row_bits));
    std::vector<float> y(r.x.size());
    for (int i = 0; i < n; ++i) {
        quantize_row_kvct_ref(&plan, r.x.data() + (size_t) i * d, q.data());
        dequantize_row_kvct(&plan, q.data(), y.data() + (size_t) i * d);
    }
    const double measured = mse_rows(y, r.x, n);
    // Shannon's bound for these variances at the row's bits: reverse water-filling with real
    // rates, D = sum min(theta, var) where sum max(0, log2(var / theta) / 2) = row_bits
    double lo = 1e-12, hi = 1e6;
    for (int it = 0; it < 200; ++it) {
        const double th = std::sqrt(lo * hi);
        double rate = 0.0;
        for (int j = 0; j < d; ++j) {
            rate += std::max(0.0, 0.5 * std::log2((double) plan.sigma[j] * plan.sigma[j] / th));
        }
        (rate > row_bits ? lo : hi) = th;
    }
    double shannon = 0.0;
    for (int j = 0; j < d; ++j) {
        shannon += std::min(hi, (double) plan.sigma[j] * plan.sigma[j]);
    }
    // (a bound for the Gaussian rows only: the turned rows are a Gaussian scale mixture)
    rep.check((turn || measured >= shannon) && measured <= 1.5 * predicted,
        "d=%d %s: error %.4g %s Shannon's bound %.4g and at most 1.5x the plan's Lloyd-Max prediction %.4g (x %.3f of it)",
        d, turn ? "pooled" : "pair axes", measured, turn ? "(not Gaussian: no lower bound; Gaussian's would be)" : "above",
        shannon, predicted, measured / predicted);

    const std::vector<float> h = hadamard(d);
    const std::vector<float> xh = mat_rows(r.x, h, d);
    const std::vector<float> yh = mat_rows(round_trip(GGML_TYPE_KVC4, xh, d), h, d); // H is its own inverse
    const double e_kvc4 = mse_rows(yh, r.x, n);
    rep.check(measured * 2.0 <= e_kvc4, "d=%d %s: error %.4g is below half of kvc4's %.4g at 4.5 bpe (gain %.2fx)",
        d, turn ? "pooled" : "pair axes", measured, e_kvc4, e_kvc4 / measured);
}

void test_rows_and_bad_input(report & rep) {
    const int d = 64;
    const ellipse_rows r = make_ellipses(d, false, 4, false, 21);
    const std::vector<float> w = identity_weights(d);
    const kvc_t_stats st = stats_of(r, w);
    kvc_t_plan plan;
    kvc_t_plan_fit(&plan, &st, KVC_T_BASIS_PAIR_AXES, 4 * d + 8);
    std::vector<uint8_t> q(kvc_t_row_size(plan.row_bits)), q2(q.size());
    std::vector<float> y(d);

    // a row at the mean codes as scale 0 and decodes to the mean exactly
    quantize_row_kvct_ref(&plan, plan.mean, q.data());
    dequantize_row_kvct(&plan, q.data(), y.data());
    rep.check(q[0] == 0 && std::memcmp(y.data(), plan.mean, d * sizeof(float)) == 0, "a row at the plan's mean decodes to it exactly");

    // a non-finite value is the mean of its channel
    std::vector<float> x(r.x.begin(), r.x.begin() + d);
    std::vector<float> xm = x;
    xm[5] = plan.mean[5];
    x[5] = NAN;
    quantize_row_kvct_ref(&plan, x.data(), q.data());
    quantize_row_kvct_ref(&plan, xm.data(), q2.data());
    dequantize_row_kvct(&plan, q.data(), y.data());
    bool finite = true;
    for (float v : y) {
        finite &= std::isfinite(v);
    }
    rep.check(q == q2 && finite, "a NaN is coded as its channel's mean (same bytes, finite row)");
    x[5] = INFINITY;
    quantize_row_kvct_ref(&plan, x.data(), q.data());
    rep.check(q == q2, "an Inf is coded as its channel's mean");

    kvc_t_plan untouched;
    std::memset(&untouched, 0x5a, sizeof(untouched));
    kvc_t_plan p = untouched;
    kvc_t_stats bad = st;
    bad.d = 63;
    rep.check(!kvc_t_plan_fit(&p, &bad, KVC_T_BASIS_PAIR_AXES, 300), "an odd head size is refused");
    bad.d = 2 * KVC_T_MAX_D;
    rep.check(!kvc_t_plan_fit(&p, &bad, KVC_T_BASIS_PAIR_AXES, 300), "a head size above %d is refused", KVC_T_MAX_D);
    rep.check(!kvc_t_plan_fit(&p, &st, KVC_T_BASIS_PAIR_AXES, 7) && !kvc_t_plan_fit(&p, &st, KVC_T_BASIS_PAIR_AXES, 8 + 8 * d + 1),
        "budgets below 8 bits or above 8 per coefficient are refused");
    std::vector<int16_t> dup = r.pairs;
    dup[3] = dup[0];
    bad = st;
    bad.pair = (const int16_t (*)[2]) dup.data();
    rep.check(!kvc_t_plan_fit(&p, &bad, KVC_T_BASIS_PAIR_AXES, 300), "pairs naming a channel twice are refused");
    std::vector<float> k2 = r.k2;
    k2[4] = NAN;
    bad = st;
    bad.k2 = (const float (*)[3]) k2.data();
    rep.check(!kvc_t_plan_fit(&p, &bad, KVC_T_BASIS_PAIR_AXES, 300), "non-finite statistics are refused");
    k2 = r.k2;
    k2[3] = -1.0f;
    bad.k2 = (const float (*)[3]) k2.data();
    rep.check(!kvc_t_plan_fit(&p, &bad, KVC_T_BASIS_PAIR_AXES, 300), "a negative variance is refused");
    rep.check(std::memcmp(&p, &untouched, sizeof(p)) == 0, "a refused fit leaves the plan untouched");

    kvc_t_plan broken = plan;
    broken.bits[3]++;
    rep.check(!kvc_t_plan_valid(&broken), "a plan whose bits do not sum to its row is invalid");
    broken = plan;
    broken.sigma[7] = 0.0f;
    rep.check(!kvc_t_plan_valid(&broken), "a plan with a zero scale is invalid");
    broken = plan;
    broken.rot[2][0] = 2.0f;
    rep.check(!kvc_t_plan_valid(&broken), "a plan with a rotation that is not a rotation is invalid");
    broken = plan;
    broken.pair[1][1] = broken.pair[0][0];
    rep.check(!kvc_t_plan_valid(&broken), "a plan whose pairs repeat a channel is invalid");
    broken = plan;
    broken.bits[0] = 9;
    broken.row_bits += 9 - plan.bits[0];
    rep.check(!kvc_t_plan_valid(&broken), "a plan with 9 bits on a coefficient is invalid");
}

// Every coded coefficient is the level nearest to it at the row's scale: its code is the number
// of midpoints between neighbouring levels (taken here in float from kvc_t_levels_of) below it,
// counted one by one, on rows of plans whose budgets give coefficients 1 to 8 bits.
void test_codes_nearest(report & rep) {
    const int d = 64;
    const ellipse_rows r = make_ellipses(d, false, 300, false, 33);
    const std::vector<float> w = identity_weights(d);
    const kvc_t_stats st = stats_of(r, w);
    bool seen[KVC_T_MAX_BITS + 1] = {};
    int64_t n_codes = 0, n_wrong = 0;
    for (int bits : { 2, 4, 7 }) {
        kvc_t_plan plan;
        GGML_ASSERT(kvc_t_plan_fit(&plan, &st, KVC_T_BASIS_PAIR_AXES, bits * d + 8));
        std::vector<uint8_t> q(kvc_t_row_size(plan.row_bits));
        std::vector<float> u(d);
        for (int i = 0; i < r.n; ++i) {
            const float * x = &r.x[(size_t) i * d];
            quantize_row_kvct_ref(&plan, x, q.data());
            if (q[0] == 0) {
                continue;
            }
            kvc_t_forward(&plan, x, u.data());
            const float inv = 1.0f / kvc_e8_to_fp32(q[0]);
            int pos = 8;
            for (int j = 0; j < d; ++j) {
                const int b = plan.bits[j];
                seen[b] = true;
                if (b == 0) {
                    continue;
                }
                int code = 0;
                for (int k = 0; k < b; ++k, ++pos) {
                    code |= ((q[pos / 8] >> (pos % 8)) & 1) << k;
                }
                const float v = (u[j] / plan.sigma[j]) * inv;
                const float * lv = kvc_t_levels_of(b);
                int below = 0;
                for (int k = 0; k + 1 < (1 << b); ++k) {
                    below += v > 0.5f * (lv[k] + lv[k + 1]);
                }
                n_codes++;
                n_wrong += code != below;
            }
        }
    }
    rep.check(std::all_of(seen + 1, seen + KVC_T_MAX_BITS + 1, [](bool b) { return b; }), "the plans give coefficients 1 to 8 bits");
    rep.check(n_codes > 0 && n_wrong == 0, "every code is its coefficient's nearest level: %lld of %lld differ", (long long) n_wrong,
              (long long) n_codes);
}

} // namespace

int main() {
    report rep;
    for (int d : { 64, 128 }) {
        test_orthogonal(rep, d, d == 128);
        test_water_filling(rep, d, d == 128, KVC_T_BASIS_PAIR_AXES);
        test_water_filling(rep, d, d == 128, KVC_T_BASIS_POOLED);
    }
    test_rows_and_bad_input(rep);
    test_codes_nearest(rep);
    return rep.finish("test-kvc-transform");
}
