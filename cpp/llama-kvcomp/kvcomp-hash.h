#pragma once

// The digest that seals the files kvcomp writes (states, K statistics): a change to any byte
// of what it covers changes it. Not cryptographic: it tells damage apart, not tampering.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

// Four lanes over 32-byte stripes: each step of a lane is a bijection of the lane for a given
// word, so a change to any one word always changes the digest.
struct kvcomp_hasher {
    static constexpr uint64_t K0 = 0x9e3779b97f4a7c15ull;
    static constexpr uint64_t K1 = 0xc2b2ae3d27d4eb4full;

    uint64_t lane[4] = { K0, K1, ~K0, ~K1 };
    uint8_t  pending[32];
    size_t   n_pending = 0;
    uint64_t n_total   = 0;

    static uint64_t step(uint64_t h, uint64_t w) {
        h = (h ^ w) * K1;
        return h ^ (h >> 29);
    }

    void stripe(const uint8_t * p) {
        for (int i = 0; i < 4; ++i) {
            uint64_t w;
            std::memcpy(&w, p + 8 * i, sizeof(w));
            lane[i] = step(lane[i], w);
        }
    }

    void update(const void * data, size_t n) {
        const uint8_t * p = (const uint8_t *) data;
        n_total += n;
        if (n_pending > 0) {
            const size_t take = std::min(n, sizeof(pending) - n_pending);
            std::memcpy(pending + n_pending, p, take);
            n_pending += take;
            p += take;
            n -= take;
            if (n_pending < sizeof(pending)) {
                return;
            }
            stripe(pending);
            n_pending = 0;
        }
        for (; n >= sizeof(pending); p += sizeof(pending), n -= sizeof(pending)) {
            stripe(p);
        }
        std::memcpy(pending, p, n);
        n_pending = n;
    }

    uint64_t digest() const {
        uint8_t last[32] = {};
        std::memcpy(last, pending, n_pending);
        uint64_t l[4] = { lane[0], lane[1], lane[2], lane[3] };
        for (int i = 0; i < 4; ++i) {
            uint64_t w;
            std::memcpy(&w, last + 8 * i, sizeof(w));
            l[i] = step(l[i], w);
        }
        uint64_t h = n_total * K0;
        for (int i = 0; i < 4; ++i) {
            h = step(h + ((l[i] << (7 * i + 1)) | (l[i] >> (63 - 7 * i))), K0);
        }
        return h ^ (h >> 32);
    }
};
