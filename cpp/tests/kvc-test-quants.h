#pragma once

// The inputs the kvc quantizers' SIMD paths are held to the reference's bytes on
// (test-kvc-quants, test-kvc-quants-isa).

#include "kvc-common.h"
#include "kvc-test-util.h"

#include <algorithm>
#include <vector>

namespace kvc_test {

// What a quantizer is held to the reference's bytes on: rows of n values of every
// distribution, then some at magnitudes near both ends of the step codes and past them
// (1e30: every candidate's error overflows), non-finite values and a zero sub-block.
inline std::vector<float> quantizer_inputs(int n) {
    std::vector<float> x;
    for (dist d : { dist::gaussian, dist::student_t3, dist::outlier_channels }) {
        const auto r = make_rows(d, 64, n, 123 + (uint32_t) d);
        x.insert(x.end(), r.begin(), r.end());
    }
    const size_t n_base = x.size();
    for (float scale : { 1e-6f, 3e-5f, 40.0f, 3000.0f, 1e30f }) {
        for (size_t i = 0; i < (size_t) 4 * n; ++i) {
            x.push_back(x[i] * scale);
        }
    }
    x[n_base + 3] = NAN;
    x[n_base + 70] = INFINITY;
    std::fill(x.begin() + 5 * n, x.begin() + 5 * n + 16, 0.0f);
    // sub-blocks of values on a type's thresholds: with the largest at 127 s, s a power of
    // two, the matching step is s, so each value scaled by it is a threshold exactly (a tie,
    // which goes to the lower level)
    const int8_t * tables[] = { kvalues_kvc5, kvalues_kvc4, kvalues_kvc3, kvalues_kvc2 };
    const int      sizes[]  = { 32, 16, 8, 4 };
    std::vector<float> ties;
    for (float s : { 0.125f, 1.0f, 64.0f }) {
        for (int t = 0; t < 4; ++t) {
            for (int part = 0; part < 2; ++part) {
                ties.push_back(127.0f * s);
                for (int i = 1; i < 16; ++i) {
                    const int j = (part * 15 + i - 1) % (sizes[t] - 1);
                    ties.push_back(0.5f * (float) (tables[t][j] + tables[t][j + 1]) * s);
                }
            }
        }
    }
    ties.resize((ties.size() + n - 1) / n * n, 0.0f);
    x.insert(x.end(), ties.begin(), ties.end());
    return x;
}

} // namespace kvc_test
