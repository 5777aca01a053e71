// Vector helpers every kernel is written against: one set of small functions per ISA (AVX-512,
// AVX2), chosen by the compiler's defines (-march, -mno-avx512f), and none where neither is there,
// in which case the kernels' scalar branches run. AVX512-BF16 and AMX are detected in rows.h.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define MK_AVX2 1
#endif

// The vector width: AVX-512 where the build machine has it (16 floats a vector: one load per cache
// line; a bf16 step's products 14% faster than with 8-float vectors on an Intel Xeon), else AVX2.
// The code below is written once against these few functions.
#if defined(MK_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__)
#define MK_WIDE 16
using VF = __m512;
static inline VF vload(const float* p) { return _mm512_loadu_ps(p); }
static inline VF vload(const c10::BFloat16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline VF vzero() { return _mm512_setzero_ps(); }
static inline void vstore(float* p, VF v) { _mm512_storeu_ps(p, v); }
static inline void vstream(float* p, VF v) { _mm512_stream_ps(p, v); }  // p 64-byte aligned
// Column 0 of a 16 x 16 float tile at p (row stride 16).
static inline VF vcolumn(const float* p) {
    const __m512i rows = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
    return _mm512_i32gather_ps(rows, p, 4);
}
static inline VF vset(float v) { return _mm512_set1_ps(v); }
static inline VF vadd(VF a, VF b) { return _mm512_add_ps(a, b); }
static inline VF vfma(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(VF v) { return _mm512_reduce_add_ps(v); }
static inline VF vmax(VF a, VF b) { return _mm512_max_ps(a, b); }
static inline float vhmax(VF v) { return _mm512_reduce_max_ps(v); }
static inline unsigned lanes_equal(VF a, VF b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
static inline unsigned lanes_nan(VF a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
// A q8_0 block's 32 codes as 32 int16, and its sum against 32 int16 of x: 16 int32 lanes of 2 products.
struct Codes { __m512i c; };
static inline Codes widen(const uint8_t* codes) {
    return {_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)))};
}
static inline VF block_sum(Codes w, const int16_t* q) {
    return _mm512_cvtepi32_ps(_mm512_madd_epi16(w.c, _mm512_loadu_si512(q)));
}
#elif defined(MK_AVX2)
#define MK_WIDE 8
using VF = __m256;
static inline VF vload(const float* p) { return _mm256_loadu_ps(p); }
static inline VF vload(const c10::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline VF vzero() { return _mm256_setzero_ps(); }
static inline void vstore(float* p, VF v) { _mm256_storeu_ps(p, v); }
static inline void vstream(float* p, VF v) { _mm256_stream_ps(p, v); }  // p 32-byte aligned
// Column 0 of an 8 x 8 float tile at p (row stride 8).
static inline VF vcolumn(const float* p) {
    return _mm256_i32gather_ps(p, _mm256_set_epi32(56, 48, 40, 32, 24, 16, 8, 0), 4);
}
static inline VF vset(float v) { return _mm256_set1_ps(v); }
static inline VF vadd(VF a, VF b) { return _mm256_add_ps(a, b); }
static inline VF vfma(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(VF v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}
static inline VF vmax(VF a, VF b) { return _mm256_max_ps(a, b); }
static inline float vhmax(VF v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}
static inline unsigned lanes_equal(VF a, VF b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }
static inline unsigned lanes_nan(VF a) { return _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)); }
// A q8_0 block's 32 codes as two vectors of 16 int16; its sum: 8 int32 lanes of 4 products.
struct Codes { __m256i lo, hi; };
static inline Codes widen(const uint8_t* codes) {
    return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))),
            _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16)))};
}
static inline VF block_sum(Codes w, const int16_t* q) {
    const __m256i lo = _mm256_madd_epi16(w.lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
    const __m256i hi = _mm256_madd_epi16(w.hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 16)));
    return _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi));
}
#endif
