// The q8_0 one-row product's inner loop (src/moekit/ops/csrc/q8.cpp's rows_lanes: 16 weight rows in
// the lanes against one x row rounded to int16) on one core: ns a 34-byte weight block with the
// weight in L2 (256 rows of 512 inputs, 139 KB), where memory does not bound it, and from memory
// (128 MB of distinct rows a pass), for the operator's form against other ways of forming the same
// floats (every variant's floats are checked equal to the operator form's):
//   - how the 16 rows' float16 scales of a block are read (a gather, or scalar loads),
//   - the software prefetch: along each row (the operator's form before), or the 16 rows' run of
//     bytes as one stream ("linear", the operator's form now: 16 KB ahead into L2), its distance
//     and cache level.
// A core streams ~15 GB/s from memory here: ~2.3 ns a block keeps up with it. In L2 every form
// takes ~1 ns a block: from memory (~4 ns a block before) the product waited on memory, not on its
// arithmetic.
//
//   g++ -O3 -march=native -o /tmp/q8_block benchmarks/q8_block.cpp && taskset -c 0 /tmp/q8_block
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <ctime>
#include <vector>

// The thread's CPU time: a loaded machine's waits for a core do not count.
static double now() {
    timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

// Lane i of the result = the sum of v[i]'s lanes (q8.cpp's lane_sums).
static inline __m512i lane_sums(__m512i* v) {
    __m512i t[8], u[4], w[2];
    for (int i = 0; i < 8; ++i)
        t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)
        u[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
    for (int i = 0; i < 2; ++i)
        w[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_i32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
static inline __m512i block_lanes(const uint8_t* codes, const int16_t* q) {
    return _mm512_madd_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes))), _mm512_loadu_si512(q));
}
static inline __m512 gather_scales(const uint8_t* w, int64_t row_bytes) {
    const __m512i at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32((int)row_bytes));
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(at, w, 1)));
}
static inline __m512 scalar_scales(const uint8_t* w, int64_t row_bytes) {
    alignas(32) uint16_t h[16];
    for (int i = 0; i < 16; ++i) std::memcpy(h + i, w + i * row_bytes, 2);
    return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(h)));
}

enum Scales { GATHER, SCALAR };
// 16 rows against one x row (q int16 [nb * 32], s [nb]); prefetch PF bytes ahead every EVERY blocks.
template <Scales S, int PF, int EVERY>
static inline void rows16(const uint8_t* w, int64_t row_bytes, const int16_t* q, const float* s, int64_t nb, float* out) {
    __m512 acc = _mm512_setzero_ps();
    __m512i part[16];
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + b * 34;
        for (int i = 0; i < 16; ++i) {
            if (PF > 0 && b % EVERY == 0) _mm_prefetch(reinterpret_cast<const char*>(blk + i * row_bytes) + PF, _MM_HINT_T0);
            part[i] = block_lanes(blk + i * row_bytes + 2, q + b * 32);
        }
        const __m512 d = S == GATHER ? gather_scales(blk, row_bytes) : scalar_scales(blk, row_bytes);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lane_sums(part)), _mm512_mul_ps(d, _mm512_set1_ps(s[b])), acc);
    }
    _mm512_storeu_ps(out, acc);
}

// The 16 rows' scales read once for the whole row set, before the codes (scalar loads, 16 a block).
template <int PF, int EVERY>
static inline void rows16_prepass(const uint8_t* w, int64_t row_bytes, const int16_t* q, const float* s, int64_t nb, float* out) {
    alignas(64) uint16_t h[16 * 512];
    for (int64_t b = 0; b < nb; ++b)
        for (int i = 0; i < 16; ++i) std::memcpy(h + b * 16 + i, w + i * row_bytes + b * 34, 2);
    __m512 acc = _mm512_setzero_ps();
    __m512i part[16];
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + b * 34;
        for (int i = 0; i < 16; ++i) {
            if (PF > 0 && b % EVERY == 0) _mm_prefetch(reinterpret_cast<const char*>(blk + i * row_bytes) + PF, _MM_HINT_T0);
            part[i] = block_lanes(blk + i * row_bytes + 2, q + b * 32);
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(h + b * 16)));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lane_sums(part)), _mm512_mul_ps(d, _mm512_set1_ps(s[b])), acc);
    }
    _mm512_storeu_ps(out, acc);
}

// The row set (16 rows, 16 * row_bytes contiguous bytes) read as one stream: at block b of nb, the
// lines D bytes past its b-th nb-th are asked for (HINT), so that the whole set's bytes are
// prefetched in order, D ahead, whatever the number of blocks.
template <int D, int HINT>
static inline void rows16_linear(const uint8_t* w, int64_t row_bytes, const int16_t* q, const float* s, int64_t nb, float* out) {
    __m512 acc = _mm512_setzero_ps();
    __m512i part[16];
    const int64_t set = 16 * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + b * 34;
        const char* from = reinterpret_cast<const char*>(w) + D + (set * b / nb & ~int64_t(63));
        const char* to = reinterpret_cast<const char*>(w) + D + set * (b + 1) / nb;
        for (const char* p = from; p < to; p += 64) _mm_prefetch(p, (_mm_hint)HINT);
        for (int i = 0; i < 16; ++i) part[i] = block_lanes(blk + i * row_bytes + 2, q + b * 32);
        const __m512 d = gather_scales(blk, row_bytes);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lane_sums(part)), _mm512_mul_ps(d, _mm512_set1_ps(s[b])), acc);
    }
    _mm512_storeu_ps(out, acc);
}

// The AVX2 build's form (8 rows in the lanes, ymm), run twice for 16 rows; prefetch as above.
static inline __m256i block_lanes8(const uint8_t* codes, const int16_t* q) {
    const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16)));
    return _mm256_add_epi32(_mm256_madd_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q))),
                            _mm256_madd_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16))));
}
static inline __m256i lane_sums8(const __m256i* v) {
    const __m256i h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const __m256i h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
}
template <bool LINEAR>
static inline void rows8x2(const uint8_t* w0, int64_t row_bytes, const int16_t* q, const float* s, int64_t nb, float* out) {
    for (int half = 0; half < 2; ++half) {
        const uint8_t* w = w0 + half * 8 * row_bytes;
        __m256 acc = _mm256_setzero_ps();
        __m256i part[8];
        const int64_t run = 8 * row_bytes;
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t* blk = w + b * 34;
            if (LINEAR) {
                const char* from = reinterpret_cast<const char*>(w) + 16384 + (run * b / nb & ~int64_t(63));
                const char* to = reinterpret_cast<const char*>(w) + 16384 + run * (b + 1) / nb;
                for (const char* p = from; p < to; p += 64) _mm_prefetch(p, _MM_HINT_T1);
            }
            for (int i = 0; i < 8; ++i) {
                if (!LINEAR && (b & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(blk + i * row_bytes) + 2048, _MM_HINT_T0);
                part[i] = block_lanes8(blk + i * row_bytes + 2, q + b * 32);
            }
            alignas(16) uint16_t h[8];
            for (int i = 0; i < 8; ++i) std::memcpy(h + i, blk + i * row_bytes, 2);
            const __m256 d = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h)));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lane_sums8(part)), _mm256_mul_ps(d, _mm256_set1_ps(s[b])), acc);
        }
        _mm256_storeu_ps(out + half * 8, acc);
    }
}

using Kernel = void (*)(const uint8_t*, int64_t, const int16_t*, const float*, int64_t, float*);

struct Form { const char* name; Kernel k; };

int main() {
    const int64_t K = 512, nb = K / 32, row_bytes = nb * 34;
    std::mt19937 rng(0);
    std::uniform_int_distribution<int> code(-127, 127), xq(-32767, 32767);
    std::vector<int16_t> q(K);
    std::vector<float> s(nb);
    for (auto& v : q) v = (int16_t)xq(rng);
    for (auto& v : s) v = 1e-4f * (1 + rng() % 100);
    auto fill = [&](std::vector<uint8_t>& w) {
        for (size_t i = 0; i < w.size(); ++i) w[i] = (uint8_t)code(rng);
        for (size_t r = 0; r < w.size() / row_bytes; ++r)
            for (int64_t b = 0; b < nb; ++b) {
                const uint16_t h = _cvtss_sh(1e-3f * (1 + rng() % 50), 0);
                std::memcpy(&w[r * row_bytes + b * 34], &h, 2);
            }
    };
    const int64_t small_rows = 256, big_rows = (128 << 20) / row_bytes / 16 * 16;
    std::vector<uint8_t> small(small_rows * row_bytes), big(big_rows * row_bytes);
    fill(small);
    fill(big);
    const Form forms[] = {
        {"before (gather, pf 2K every 2)", rows16<GATHER, 2048, 2>},
        {"gather, no prefetch", rows16<GATHER, 0, 1>},
        {"gather, pf 2K every 4", rows16<GATHER, 2048, 4>},
        {"gather, pf 4K every 2", rows16<GATHER, 4096, 2>},
        {"scalar scales, pf 2K every 2", rows16<SCALAR, 2048, 2>},
        {"scalar scales, pf 2K every 4", rows16<SCALAR, 2048, 4>},
        {"prepass scales, pf 2K every 2", rows16_prepass<2048, 2>},
        {"prepass scales, pf 2K every 4", rows16_prepass<2048, 4>},
        {"linear 2K T0", rows16_linear<2048, _MM_HINT_T0>},
        {"linear 4K T0", rows16_linear<4096, _MM_HINT_T0>},
        {"linear 8K T0", rows16_linear<8192, _MM_HINT_T0>},
        {"linear 16K T0", rows16_linear<16384, _MM_HINT_T0>},
        {"linear 8K T1", rows16_linear<8192, _MM_HINT_T1>},
        {"linear 16K T1 (operator)", rows16_linear<16384, _MM_HINT_T1>},
        {"linear 32K T1", rows16_linear<32768, _MM_HINT_T1>},
        {"linear 64K T1", rows16_linear<65536, _MM_HINT_T1>},
        {"AVX2 form, before (pf 2K every 2)", rows8x2<false>},
        {"AVX2 form, linear 16K T1 (operator)", rows8x2<true>},
        {"linear 16K T2", rows16_linear<16384, _MM_HINT_T2>},
    };
    std::vector<float> ref(big_rows), out(big_rows);
    for (int64_t r = 0; r < big_rows; r += 16) forms[0].k(big.data() + r * row_bytes, row_bytes, q.data(), s.data(), nb, ref.data() + r);
    for (const Form& f : forms) {
        for (int64_t r = 0; r < big_rows; r += 16) f.k(big.data() + r * row_bytes, row_bytes, q.data(), s.data(), nb, out.data() + r);
        if (std::memcmp(out.data(), ref.data(), ref.size() * 4) != 0) { std::printf("%s: floats differ\n", f.name); return 1; }
    }
    const int rounds = 11;
    std::vector<std::vector<double>> l2(std::size(forms)), mem(std::size(forms));
    for (int round = 0; round < rounds; ++round)
        for (size_t i = 0; i < std::size(forms); ++i) {
            const Form& f = forms[i];
            double t = now();
            for (int rep = 0; rep < 200; ++rep)
                for (int64_t r = 0; r < small_rows; r += 16) f.k(small.data() + r * row_bytes, row_bytes, q.data(), s.data(), nb, out.data() + r);
            l2[i].push_back((now() - t) * 1e9 / (200.0 * small_rows * nb));
            t = now();
            for (int64_t r = 0; r < big_rows; r += 16) f.k(big.data() + r * row_bytes, row_bytes, q.data(), s.data(), nb, out.data() + r);
            mem[i].push_back((now() - t) * 1e9 / double(big_rows * nb));
        }
    for (size_t i = 0; i < std::size(forms); ++i) {
        std::sort(l2[i].begin(), l2[i].end());
        std::sort(mem[i].begin(), mem[i].end());
        const double m = mem[i][rounds / 2];
        std::printf("%-36s L2 %.2f ns/block   memory %.2f ns/block (%.1f GB/s)\n", forms[i].name, l2[i][rounds / 2], m, 34 / m);
    }
}
