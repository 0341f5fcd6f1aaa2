#include "kvcomp-window.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

kvcomp_window::kvcomp_window(int64_t n_embd, uint32_t n_window, uint32_t n_group, uint32_t max_rows, double q)
    : n_embd(n_embd), n_group(n_group), q(q) {
    if (n_embd <= 0 || n_group == 0 || n_window % n_group != 0) {
        throw std::invalid_argument("kvcomp_window: bad shape");
    }
    const uint64_t n_max = (uint64_t) n_window * max_rows;
    if (cap(n_max) > 2) {
        throw std::invalid_argument("kvcomp_window: a quantile over " + std::to_string(n_max) +
                                    " rows asks for more than a channel's two extremes");
    }
    groups.resize(n_window / n_group);
}

size_t kvcomp_window::cap(uint64_t n) const {
    return (size_t) std::floor((1.0 - q) * (double) n) + 1;
}

uint64_t kvcomp_window::n_rows() const {
    uint64_t n = 0;
    for (const group & g : groups) {
        n += g.n;
    }
    return n;
}

void kvcomp_window::fold(uint64_t u, const float * rows, uint32_t n_rows) {
    group & g = groups[(u / n_group) % groups.size()];
    if (u % n_group == 0) {
        g.n = 0;
        g.hi1.assign(n_embd, -INFINITY);
        g.hi2.assign(n_embd, -INFINITY);
        g.lo1.assign(n_embd, INFINITY);
        g.lo2.assign(n_embd, INFINITY);
    }
    g.n += n_rows;
    float * hi1 = g.hi1.data();
    float * hi2 = g.hi2.data();
    float * lo1 = g.lo1.data();
    float * lo2 = g.lo2.data();
    for (uint32_t r = 0; r < n_rows; ++r) {
        const float * x = rows + (size_t) r * n_embd;
        // min and max in place of branches, so a row's channels go side by side; x - x is 0
        // for a finite x only (std::isfinite does not vectorize)
        for (int64_t i = 0; i < n_embd; ++i) {
            const bool  ok = x[i] - x[i] == 0.0f;
            const float h  = ok ? x[i] : -INFINITY;
            const float l  = ok ? x[i] : INFINITY;
            hi2[i] = std::max(hi2[i], std::min(hi1[i], h));
            hi1[i] = std::max(hi1[i], h);
            lo2[i] = std::min(lo2[i], std::max(lo1[i], l));
            lo1[i] = std::min(lo1[i], l);
        }
    }
}

void kvcomp_window::quantiles(std::vector<float> & hi, std::vector<float> & lo) const {
    hi.assign(n_embd, -INFINITY);
    lo.assign(n_embd, INFINITY);
    // the quantile is the extreme itself (fewer than 1000 rows, a window of decode steps), or
    // the second extreme, the larger of each group's second and every other group's first
    const bool second = cap(n_rows()) == 2;
    std::vector<float> hi_2, lo_2;
    if (second) {
        hi_2.assign(n_embd, -INFINITY);
        lo_2.assign(n_embd, INFINITY);
    }
    for (const group & g : groups) {
        if (g.n == 0) {
            continue;
        }
        for (int64_t i = 0; i < n_embd; ++i) {
            if (second) {
                hi_2[i] = std::max({ hi_2[i], g.hi2[i], std::min(hi[i], g.hi1[i]) });
                lo_2[i] = std::min({ lo_2[i], g.lo2[i], std::max(lo[i], g.lo1[i]) });
            }
            hi[i] = std::max(hi[i], g.hi1[i]);
            lo[i] = std::min(lo[i], g.lo1[i]);
        }
    }
    for (int64_t i = 0; i < n_embd; ++i) {
        // fewer values than asked for: the least extreme of them
        if (second && std::isfinite(hi_2[i])) {
            hi[i] = hi_2[i];
        }
        if (second && std::isfinite(lo_2[i])) {
            lo[i] = lo_2[i];
        }
        hi[i] = std::isfinite(hi[i]) ? hi[i] : 0.0f;
        lo[i] = std::isfinite(lo[i]) ? lo[i] : 0.0f;
    }
}
