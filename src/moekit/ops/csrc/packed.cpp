// Few-row products on MXFP4 and FP8 weights read packed, without expanding them (moekit.ops.packed_layout's
// layouts): mxfp4_gemv, fp8_gemv. Same products as the reference, another summation order.
#include "ops.h"
#include "vec.h"

// FP4 E2M1 codes → twice their value, as int8 (low 8 codes positive, high 8 negative).
static const int8_t TWICE[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline float row_dot(const uint8_t* w, const float* x, int64_t groups) {
    float acc = 0.f;
#ifdef MK_AVX2
    const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(TWICE));
    const __m128i low4 = _mm_set1_epi8(0x0F);
#endif
    for (int64_t g = 0; g < groups; ++g, w += 17, x += 32) {
        const float scale = std::ldexp(1.0f, int(w[0]) - 128);  // 2^(s − 127) / 2 (codes are doubled)
#ifdef MK_AVX2
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 1));
        const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(bytes, low4));   // elements 0, 2, 4, ...
        const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));  // 1, 3, 5, ...
        const __m128i first = _mm_unpacklo_epi8(lo, hi);   // elements 0..15 in order
        const __m128i second = _mm_unpackhi_epi8(lo, hi);  // elements 16..31
        __m256 s0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(first)), _mm256_loadu_ps(x));
        __m256 s1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(first, 8))), _mm256_loadu_ps(x + 8));
        s0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(second)), _mm256_loadu_ps(x + 16), s0);
        s1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(second, 8))), _mm256_loadu_ps(x + 24), s1);
        __m256 s = _mm256_add_ps(s0, s1);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
        acc += scale * _mm_cvtss_f32(h);
#else
        float block = 0.f;
        for (int j = 0; j < 16; ++j) {
            const uint8_t b = w[1 + j];
            block += TWICE[b & 15] * x[2 * j] + TWICE[b >> 4] * x[2 * j + 1];
        }
        acc += scale * block;
#endif
    }
    return acc;
}

// One FP8 row: `in` float8_e4m3fn codes, then nbc fp32 scales (one per `block` columns).
static inline float fp8_row_dot(const uint8_t* w, const float* x, int64_t in, int64_t block, const float* lut) {
    const float* scales = reinterpret_cast<const float*>(w + in);  // may be unaligned: read by memcpy
    float acc = 0.f;
    for (int64_t c0 = 0, b = 0; c0 < in; c0 += block, ++b) {
        const int64_t c1 = c0 + block < in ? c0 + block : in;
        int64_t k = c0;
        float part = 0.f;
#ifdef MK_AVX2
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (; k + 16 <= c1; k += 16) {
            const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k));
            const __m256 v0 = _mm256_i32gather_ps(lut, _mm256_cvtepu8_epi32(bytes), 4);
            const __m256 v1 = _mm256_i32gather_ps(lut, _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)), 4);
            s0 = _mm256_fmadd_ps(v0, _mm256_loadu_ps(x + k), s0);
            s1 = _mm256_fmadd_ps(v1, _mm256_loadu_ps(x + k + 8), s1);
        }
        __m256 s = _mm256_add_ps(s0, s1);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_shuffle_ps(h, h, 1));
        part = _mm_cvtss_f32(h);
#endif
        for (; k < c1; ++k) part += lut[w[k]] * x[k];
        float scale; std::memcpy(&scale, scales + b, 4);
        acc += scale * part;
    }
    return acc;
}

// y[r, o] = dot(o, r) for n rows of x and `out` weight rows, threads over the weight rows.
template <typename Dot>
static void each_output(float* y, int64_t n, int64_t out, Dot dot) {
    at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
        for (int64_t o = begin; o < end; ++o)
            for (int64_t r = 0; r < n; ++r)
                y[r * out + o] = dot(o, r);
    });
}

torch::Tensor fp8_gemv(torch::Tensor x, torch::Tensor packed, int64_t block, torch::Tensor lut) {
    // x fp32 [N, in] contiguous; packed uint8 [out, in + 4 * nbc]; lut fp32 [256] → fp32 [N, out]
    const int64_t n = x.size(0), in = x.size(1), out = packed.size(0), width = packed.size(1);
    auto y = torch::empty({n, out}, x.options());
    const float* xp = x.data_ptr<float>();
    const uint8_t* wp = packed.data_ptr<uint8_t>();
    const float* lp = lut.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    each_output(yp, n, out, [&](int64_t o, int64_t r) { return fp8_row_dot(wp + o * width, xp + r * in, in, block, lp); });
    return y;
}

torch::Tensor mxfp4_gemv(torch::Tensor x, torch::Tensor packed) {
    // x fp32 [N, G * 32] contiguous; packed uint8 [out, G * 17] → fp32 [N, out]
    const int64_t n = x.size(0), out = packed.size(0), groups = packed.size(1) / 17;
    auto y = torch::empty({n, out}, x.options());
    const float* xp = x.data_ptr<float>();
    const uint8_t* wp = packed.data_ptr<uint8_t>();
    float* yp = y.data_ptr<float>();
    each_output(yp, n, out, [&](int64_t o, int64_t r) { return row_dot(wp + o * groups * 17, xp + r * groups * 32, groups); });
    return y;
}
