// The compute side of the MXFP4 x bf16 products (src/moekit/ops/csrc/packed.cpp, AVX512-BF16), on
// one core, with the weight in L2 (512 rows of gpt-oss-20b's 2880 inputs, 783 KB) so that memory
// does not bound it: ns a 17-byte weight block for the operator's unpack (vpmovzxbd, shift and mask,
// vpermw from the scale byte's table) against other ways of making the block's 32 bf16 values, and
// for the few-row form (G weight rows x NR x rows a pass, block g into chain g % 4, as the operator
// sums): bf16 x rows went 2 a pass ("before"), now up to 4 ("now"). Every variant's floats are checked equal to the operator form's. A core streams ~15 GB/s
// from memory here: a form below ~1.1 ns a block (17 bytes) keeps up with it.
//
//   g++ -O3 -march=native -o /tmp/mxfp4_unpack benchmarks/mxfp4_unpack.cpp && taskset -c 0 /tmp/mxfp4_unpack
#include <immintrin.h>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

static const int8_t TWICE[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static std::vector<uint16_t> table(256 * 16);  // scale byte s, code c → bf16 bits of TWICE[c] · 2^(s − 128)
static uint16_t bf16(float f) { uint32_t u; std::memcpy(&u, &f, 4); return uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16); }

// The operator's form (packed.cpp's block_pairs).
static inline __m512bh operator_form(const uint8_t* w) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 1)));
    const __m512i codes = _mm512_ternarylogic_epi32(b, _mm512_slli_epi32(b, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
    const __m512i t = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(table.data() + 16 * w[0])));
    return (__m512bh)_mm512_permutexvar_epi16(codes, t);
}
// Nibbles split on 128 bits, interleaved, widened to words by one vpmovzxbw.
static inline __m512bh narrow_split(const uint8_t* w) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 1)), m = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(b, m), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m);
    const __m512i codes = _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi)));
    const __m512i t = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(table.data() + 16 * w[0])));
    return (__m512bh)_mm512_permutexvar_epi16(codes, t);
}
// Words widened to qwords, each word's nibble moved to its low bits by vpmultishiftqb; the table
// broadcast to both halves (vpermw reads 5 index bits).
static inline __m512bh multishift(const uint8_t* w) {
    const __m512i q = _mm512_cvtepu16_epi64(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 1)));
    const __m512i codes = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x0C0C080804040000LL), q);
    const __m512i t = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(table.data() + 16 * w[0])));
    return (__m512bh)_mm512_permutexvar_epi16(codes, t);
}

using Unpack = __m512bh (*)(const uint8_t*);

// G weight rows against NR x rows, the chains' index a constant in every unrolled step.
template <Unpack U, int G, int NR>
static inline void step(__m512 (&acc)[G][NR][4], int c, const uint8_t* w, int64_t row_bytes, const uint16_t* const* xs, int64_t b) {
    __m512bh v[G];
    for (int g = 0; g < G; ++g) v[g] = U(w + g * row_bytes + b * 17);
    for (int r = 0; r < NR; ++r)
        for (int g = 0; g < G; ++g) acc[g][r][c] = _mm512_dpbf16_ps(acc[g][r][c], v[g], (__m512bh)_mm512_loadu_si512(xs[r] + b * 32));
}
template <Unpack U, int G, int NR>
__attribute__((noinline)) static void dots(const uint8_t* w, int64_t row_bytes, const uint16_t* const* xs, int64_t groups, float* out) {
    __m512 acc[G][NR][4];
    for (auto& a : acc) for (auto& r : a) for (auto& c : r) c = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 4 <= groups; b += 4) {
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) step<U, G, NR>(acc, c, w, row_bytes, xs, b + c);
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) if (b + c < groups) step<U, G, NR>(acc, c, w, row_bytes, xs, b + c);
    for (int g = 0; g < G; ++g)
        for (int r = 0; r < NR; ++r)
            out[g * NR + r] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[g][r][0], acc[g][r][1]), _mm512_add_ps(acc[g][r][2], acc[g][r][3])));
}

int main() {
    for (int s = 0; s < 256; ++s)
        for (int c = 0; c < 16; ++c) table[s * 16 + c] = bf16(TWICE[c] * std::ldexp(1.0f, s - 128));
    const int rows = 512, groups = 90, bytes = groups * 17;  // gpt-oss-20b: 2880 inputs
    std::mt19937 gen(1);
    std::vector<uint8_t> w(rows * bytes);
    for (auto& b : w) b = uint8_t(gen());
    for (int i = 0; i < rows * groups; ++i) w[i * 17] = uint8_t(118 + gen() % 8);  // scales 2^-10 .. 2^-3
    std::vector<uint16_t> x(4 * groups * 32);
    for (auto& v : x) v = bf16(int(gen() % 2001) / 1000.f - 1.f);
    const uint16_t* xs[4] = {x.data(), x.data() + groups * 32, x.data() + 2 * groups * 32, x.data() + 3 * groups * 32};
    std::vector<float> out(4 * rows), want(4 * rows);
    auto time = [&](const char* name, int G, int NR, auto call) {
        double best = 1e9;
        for (int rep = 0; rep < 7; ++rep) {
            const auto t = std::chrono::steady_clock::now();
            for (int it = 0; it < 50; ++it)
                for (int o = 0; o < rows; o += G) call(o);
            best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count() / 50);
        }
        std::printf("%-46s %6.3f ns a weight block (%d x row%s)\n", name, best / (rows * groups) * 1e9, NR, NR > 1 ? "s" : "");
    };
    auto check = [&](const char* name, auto call) {
        for (int o = 0; o < rows; ++o) call(o, &out[o]);
        if (std::memcmp(out.data(), want.data(), rows * sizeof(float)) != 0) std::printf("  %s: NOT the operator form's floats\n", name);
    };
    for (int o = 0; o < rows; ++o) dots<operator_form, 1, 1>(w.data() + o * bytes, bytes, xs, groups, &want[o]);
    check("narrow split", [&](int o, float* y) { dots<narrow_split, 1, 1>(w.data() + o * bytes, bytes, xs, groups, y); });
    check("multishift", [&](int o, float* y) { dots<multishift, 1, 1>(w.data() + o * bytes, bytes, xs, groups, y); });
    float sink[16];
    time("one row: the operator's unpack", 1, 1, [&](int o) { dots<operator_form, 1, 1>(w.data() + o * bytes, bytes, xs, groups, sink); });
    time("one row: 128-bit split + vpmovzxbw", 1, 1, [&](int o) { dots<narrow_split, 1, 1>(w.data() + o * bytes, bytes, xs, groups, sink); });
    time("one row: vpmovzxwq + vpmultishiftqb", 1, 1, [&](int o) { dots<multishift, 1, 1>(w.data() + o * bytes, bytes, xs, groups, sink); });
    time("2 weight rows x 2 x rows (one pass)", 2, 2, [&](int o) { dots<operator_form, 2, 2>(w.data() + o * bytes, bytes, xs, groups, sink); });
    time("2 x 2 twice (4 x rows: two passes, before)", 2, 4, [&](int o) {
        dots<operator_form, 2, 2>(w.data() + o * bytes, bytes, xs, groups, sink);
        dots<operator_form, 2, 2>(w.data() + o * bytes, bytes, xs + 2, groups, sink);
    });
    time("2 weight rows x 3 x rows (one pass, now)", 2, 3, [&](int o) { dots<operator_form, 2, 3>(w.data() + o * bytes, bytes, xs, groups, sink); });
    time("2 x 2 + 2 x 1 (3 x rows: two passes, before)", 2, 3, [&](int o) {
        dots<operator_form, 2, 2>(w.data() + o * bytes, bytes, xs, groups, sink);
        dots<operator_form, 2, 1>(w.data() + o * bytes, bytes, xs + 2, groups, sink);
    });
    time("1 weight row x 3 x rows", 1, 3, [&](int o) { dots<operator_form, 1, 3>(w.data() + o * bytes, bytes, xs, groups, sink); });
    time("1 weight row x 4 x rows", 1, 4, [&](int o) { dots<operator_form, 1, 4>(w.data() + o * bytes, bytes, xs, groups, sink); });
    time("2 weight rows x 4 x rows (one pass, now)", 2, 4, [&](int o) { dots<operator_form, 2, 4>(w.data() + o * bytes, bytes, xs, groups, sink); });
}
