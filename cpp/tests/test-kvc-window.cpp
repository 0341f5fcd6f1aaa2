// The tracker's window (kvcomp-window.h) against a selection over every value it was given:
// per channel, the (floor((1 - q) n) + 1)-th largest and smallest finite value of the last
// 32 updates' n rows, through prompt-sized updates (the second extreme), decode steps (the
// extreme), updates of no rows, values that are not finite and channels with none finite.

#include "kvc-test-util.h"
#include "kvcomp-window.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <stdexcept>

using namespace kvc_test;

namespace {

constexpr uint32_t N_WINDOW = 32;
constexpr uint32_t N_GROUP  = 8;
constexpr uint32_t MAX_ROWS = 32;
constexpr double   Q        = 0.999;
constexpr int64_t  N_EMBD   = 40;

struct update {
    uint32_t n_rows;
    std::vector<float> rows;
};

// the selection over the window's values, one channel at a time
void reference(const std::deque<update> & win, std::vector<float> & hi, std::vector<float> & lo) {
    uint64_t n = 0;
    for (const update & u : win) {
        n += u.n_rows;
    }
    const size_t cap = (size_t) std::floor((1.0 - Q) * (double) n) + 1;
    hi.assign(N_EMBD, 0.0f);
    lo.assign(N_EMBD, 0.0f);
    for (int64_t i = 0; i < N_EMBD; ++i) {
        std::vector<float> v;
        for (const update & u : win) {
            for (uint32_t r = 0; r < u.n_rows; ++r) {
                const float x = u.rows[(size_t) r * N_EMBD + i];
                if (std::isfinite(x)) {
                    v.push_back(x);
                }
            }
        }
        if (v.empty()) {
            continue;
        }
        std::sort(v.begin(), v.end());
        const size_t k = std::min(cap, v.size());
        hi[i] = v[v.size() - k];
        lo[i] = v[k - 1];
    }
}

} // namespace

int main() {
    report rep;
    kvcomp_window win(N_EMBD, N_WINDOW, N_GROUP, MAX_ROWS, Q);
    std::deque<update> last;
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    // a prompt long enough to fill the window with full updates (1024 rows: the second
    // extreme), then decode steps, with updates of no rows among them
    int n_checks = 0, n_second = 0, n_same = 0;
    for (uint64_t u = 0; u < 160; ++u) {
        update up;
        up.n_rows = u < 48 ? MAX_ROWS : (u % 11 == 3 ? 0 : (u % 13 == 5 ? 3 : 1));
        up.rows.resize((size_t) up.n_rows * N_EMBD);
        for (float & x : up.rows) {
            x = normal(rng);
        }
        for (uint32_t r = 0; r < up.n_rows; ++r) {
            float * x = up.rows.data() + (size_t) r * N_EMBD;
            // channel 0 never finite, channel 1 now and then, channel 2 with ties
            x[0] = u % 2 ? NAN : INFINITY;
            x[1] = (u + r) % 3 == 0 ? -INFINITY : x[1];
            x[2] = std::round(x[2]);
        }
        win.fold(u, up.rows.data(), up.n_rows);
        last.push_back(up);
        if (last.size() > N_WINDOW) {
            last.pop_front();
        }
        if ((u + 1) % N_GROUP != 0) {
            continue;
        }
        std::vector<float> hi, lo, rhi, rlo;
        win.quantiles(hi, lo);
        reference(last, rhi, rlo);
        ++n_checks;
        n_second += win.n_rows() >= 1000;
        n_same += hi == rhi && lo == rlo;
        if (hi != rhi || lo != rlo) {
            rep.check(false, "update %llu: the window's quantiles equal the selection over its %llu rows",
                (unsigned long long) u, (unsigned long long) win.n_rows());
        }
    }
    rep.check(n_same == n_checks && n_second >= 2,
        "the window's quantiles equal the selection over its rows after each of %d groups (%d of them the second extreme)",
        n_checks, n_second);

    bool threw = false;
    try {
        kvcomp_window too_deep(N_EMBD, N_WINDOW, N_GROUP, 64, Q);
    } catch (const std::invalid_argument &) {
        threw = true;
    }
    rep.check(threw, "a window whose quantile could ask for a channel's third extreme is refused");
    return rep.finish("test-kvc-window");
}
