#pragma once

// The tracker's window over one layer's K or V rows: per channel, the q-quantile from the top
// and from the bottom of the last n_window updates' rows. With q = 0.999 and at most
// n_window * max_rows = 1024 rows that is the most extreme value, or the second most extreme
// from 1000 rows on; so the window keeps, per channel, its two most extreme values each way.
//
// It keeps them per group of n_group consecutive updates, the quantiles being asked for when
// a group is complete: a decode step updates a few KiB that stay in cache, and the quantiles
// read n_window / n_group groups, not every update's values. Kept per update, they would be
// read from memory after the model's weights went through the cache: a tenth of a small
// model's decode step.

#include <cstddef>
#include <cstdint>
#include <vector>

struct kvcomp_window {
    kvcomp_window() = default;
    // max_rows: the most rows one update folds
    kvcomp_window(int64_t n_embd, uint32_t n_window, uint32_t n_group, uint32_t max_rows, double q);

    // update u's n_rows rows of n_embd values, values that are not finite left out (no rows:
    // it counts, adding nothing); updates come in order, u % n_group == 0 starting a group
    void fold(uint64_t u, const float * rows, uint32_t n_rows);

    // per channel, the (floor((1 - q) n) + 1)-th most extreme value of the window's n rows
    // each way (the least extreme there is when fewer, 0 when none); once a group is complete
    void quantiles(std::vector<float> & hi, std::vector<float> & lo) const;

    uint64_t n_rows() const;

private:
    struct group {
        uint64_t n = 0;
        // per channel, the two most extreme values each way (infinities where there are fewer)
        std::vector<float> hi1, hi2, lo1, lo2;
    };

    int64_t  n_embd  = 0;
    uint32_t n_group = 1;
    double   q       = 0.0;
    std::vector<group> groups;

    size_t cap(uint64_t n) const;
};
