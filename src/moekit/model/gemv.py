"""Few-row products that stream their weight at memory speed: a small C++ operator for the compiled step.

Why: at batch 1 a decode step is ~40 matrix-vector products. Inductor's reduction for
`(x[:, None, :] * W).sum(-1)` reaches memory speed in fp32 on one core but not in bf16 (measured
here: ~2.2 G weights/s either way, so bf16 moves half the bytes per second), and MKL's / oneDNN's
one-row GEMMs stay below it. These two operators read each weight row once for all M rows of x,
convert bf16 with a shift, and accumulate in fp32 with FMA over four independent chains (one row
of x; where `grouped`, consecutive weight rows taken in groups, 4 with AVX-512 and 2 with AVX2, so
that several streams from memory are in flight, each row's arithmetic unchanged), or multiply each chunk of a
weight row, loaded and converted once, with up to four rows of x at a time (a batch, where those
loads and not the bytes bound the products). With AVX512-BF16, a bf16 weight and a bf16 x are
multiplied as bf16 pairs, without widening; with AMX-BF16 too, a batch (2 rows or more, inputs a
multiple of 32) is multiplied on AMX tiles, 16 weight rows x 32 inputs at a time read straight from
the Hub layout (at 8 rows the vector kernels are bound by their multiplies; the tiles are not).
The vector width is the build machine's (AVX-512, else AVX2):
  moekit::rows_gemv(x [M, K], w [N, K], grouped) -> [M, N]            a projection, Hub layout
  moekit::experts_gemv(x [B, X, K], w [E, N, K], ids [B, C], grouped) -> [B, C, N]
      row b's C chosen experts, each on x[b, 0] (X = 1, gate_up) or on x[b, c] (X = C, down),
      read in place from the stacked weights (no gather copy), each chosen expert once per call
  moekit::rows_q8 / moekit::experts_q8: the same two with q8_0 weights (uint8 [.., N, nb · 34]:
      per 32 inputs a float16 scale and 32 int8, moekit.model.int8), x zero padded to nb · 32 and
      rounded to int16 per block of 32, so each block's products are one integer sum
  moekit::rows_argmax(x [M, V] fp32) -> [M] int64: torch.argmax(x, -1) in two vector passes (greedy
      decoding's token; `rows_argmax` uses it where the operators are registered)
  moekit::transpose_into(src [R, C] fp32 or bf16, out [C, R] fp32): out = src.t(), in tiles (the
      expert store's missed experts laid out for the transposed kernel; `copy_into` below)
  moekit::latent_attend(query [B, H, C] fp32, cached [B, S, C] fp32/bf16, visible [B, S], scale, r)
      -> [B, H, r] fp32: MLA's attention over its latent cache, (row, head) pairs on the thread pool
  moekit::attend(query [B, Hkv, G, D] fp32, keys, values [B, Hkv, S, D] fp32/bf16, allowed [B, S], scale)
      -> [B, Hkv, G, D] fp32: grouped-query attention over the cache, read in place, the same way
  moekit::rows_tiles(x [M, K] bf16, w [N, K] bf16 in tiles) -> [M, N] / moekit::experts_tiles(x, w
      [E, N, K] in tiles, ids): rows_gemv / experts_gemv on bf16 weights in the tiles layout
      (`to_tiles`: blocks of 16 rows stored tile by tile, one contiguous stream each), which an
      AMX machine's compiled bf16 step lays its weights out in (moekit.model.linear.TILES)
x and w are fp32 or bf16 (w's dtype decides the load; x is read as fp32, a bf16 x widened inside
the operator); the output has x's dtype. A q8_0 batch widens each block's codes once for up to 4 rows
and keeps the one-row order of operations, so a row's int8 product is the same float solo or batched.
A call on under 64 KB of weight per thread stays on one thread. What is fastest is the machine's:
on an Intel Xeon the groups took a bf16 step's products 12% faster and AVX-512 beat AVX2; on an AMD
EPYC (Zen 4) the groups were 1.7x slower and AVX2 streamed ~20% faster. So an AVX-512 machine builds
the operators twice (torch.ops.moekit and, for AVX2 only, torch.ops.moekit_avx2), `variant(kind)`
measures which build, grouped or not, is fastest for each kind of weight once per process, and the
callers use what it says.
The eager int8 kernel (moekit.model.int8.int8_gemv) is rows_q8 too, so the compiled step's int8
products are the eager ones, bit for bit.
They are registered as dispatcher operators with shape functions, so torch.compile calls them as
extern kernels inside the compiled graph; each also has a C entry point (`c_shims`), which the
compiled step's generated C++ calls directly instead of going through the boxed dispatcher (a
bf16 step 2.3% faster on the ~140M qwen3_moe, fp32 0.8%, measured). A build's operator names end
in its suffix (rows_gemv, rows_gemv_avx2: `op`), because Inductor names an entry point after the
operator alone. Built once per machine with torch.utils.cpp_extension;
where no compiler is available `operators()` is None and the compiled step keeps its reductions.
tests/model/test_gemv.py holds both to F.linear on the same inputs.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

_SOURCE = r"""
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

// One weight row of K against one x row of K floats: four independent FMA chains.
template <typename W>
static inline float dot(const W* w, const float* x, int64_t K) {
    int64_t k = 0;
    float acc = 0.f;
#ifdef MK_WIDE
    constexpr int L = MK_WIDE;
    VF a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
    for (; k + 4 * L <= K; k += 4 * L) {
        a0 = vfma(vload(w + k), vload(x + k), a0);
        a1 = vfma(vload(w + k + L), vload(x + k + L), a1);
        a2 = vfma(vload(w + k + 2 * L), vload(x + k + 2 * L), a2);
        a3 = vfma(vload(w + k + 3 * L), vload(x + k + 3 * L), a3);
    }
    for (; k + L <= K; k += L) a0 = vfma(vload(w + k), vload(x + k), a0);
    acc = vsum(vadd(vadd(a0, a1), vadd(a2, a3)));
#endif
    for (; k < K; ++k) acc += float(w[k]) * x[k];
    return acc;
}

#ifdef MK_WIDE
// One weight row against R x rows (R <= 4) at once: each chunk of w is loaded (and, for bf16,
// converted) once for all R rows. A batch's products are bound by these loads, not by the bytes.
template <int R, typename W>
static inline void dot_rows(const W* w, const float* const* xs, int64_t K, float* out) {
    constexpr int L = MK_WIDE;
    VF a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = vzero();
    int64_t k = 0;
    for (; k + 2 * L <= K; k += 2 * L) {
        const VF w0 = vload(w + k), w1 = vload(w + k + L);
        for (int r = 0; r < R; ++r) {
            a[r][0] = vfma(w0, vload(xs[r] + k), a[r][0]);
            a[r][1] = vfma(w1, vload(xs[r] + k + L), a[r][1]);
        }
    }
    for (int r = 0; r < R; ++r) {
        float acc = vsum(vadd(a[r][0], a[r][1]));
        for (int64_t j = k; j < K; ++j) acc += float(w[j]) * xs[r][j];
        out[r] = acc;
    }
}
#endif

#if MK_WIDE == 16 && defined(__AVX512BF16__)
#define MK_DPBF16 1
// bf16 weight rows times bf16 x (a bf16 engine's activations, read in place): AVX512-BF16 multiplies
// pairs, each product of two bf16 exact in fp32, into fp32 chains. Against widening the weight to
// fp32 first, on an Intel Xeon with AVX512-BF16: 9-23% more GB/s on the same rows.
static inline __m512 dp32(__m512 acc, const c10::BFloat16* w, const c10::BFloat16* x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(w), (__m512bh)_mm512_loadu_si512(x));
}
static inline float dot(const c10::BFloat16* w, const c10::BFloat16* x, int64_t K) {
    VF a0 = vzero(), a1 = vzero();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
        a0 = dp32(a0, w + k, x + k);
        a1 = dp32(a1, w + k + 32, x + k + 32);
    }
    for (; k + 32 <= K; k += 32) a0 = dp32(a0, w + k, x + k);
    float acc = vsum(vadd(a0, a1));
    for (; k < K; ++k) acc += float(w[k]) * float(x[k]);
    return acc;
}
template <int R>
static inline void dot_rows(const c10::BFloat16* w, const c10::BFloat16* const* xs, int64_t K, float* out) {
    VF a[R];
    for (int r = 0; r < R; ++r) a[r] = vzero();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32)
        for (int r = 0; r < R; ++r) a[r] = dp32(a[r], w + k, xs[r] + k);
    for (int r = 0; r < R; ++r) {
        float acc = vsum(a[r]);
        for (int64_t j = k; j < K; ++j) acc += float(w[j]) * float(xs[r][j]);
        out[r] = acc;
    }
}
#endif

// out[r] = w · xs[r] for R x rows; a lone row keeps dot()'s four chains (batch 1 is unchanged).
template <typename W, typename X>
static inline void dots(const W* w, const X* const* xs, int64_t R, int64_t K, float* out) {
    if (R == 1) {
        out[0] = dot(w, xs[0], K);
        return;
    }
#ifdef MK_WIDE
    int64_t r = 0;
    for (; r + 4 <= R; r += 4) dot_rows<4>(w, xs + r, K, out + r);
    if (R - r == 3) dot_rows<3>(w, xs + r, K, out + r);
    else if (R - r == 2) dot_rows<2>(w, xs + r, K, out + r);
    else if (R - r == 1) dot_rows<1>(w, xs + r, K, out + r);
#else
    for (int64_t r = 0; r < R; ++r) out[r] = dot(w, xs[r], K);
#endif
}

// GROUP consecutive weight rows (`stride` elements apart) against one x row, interleaved so that
// GROUP streams from memory are in flight at once; each row's arithmetic is exactly dot()'s (its
// chains, in its order), so a row's float does not depend on the group it fell in. Measured on the
// Intel machine, a 65 MB fp32 weight: ~20 GB/s in groups of 4 against 14-19 GB/s row by row.
#if MK_WIDE == 16
constexpr int GROUP = 4;
#elif defined(MK_WIDE)
constexpr int GROUP = 2;  // AVX2's 16 registers hold 2 rows' 4 chains
#else
constexpr int GROUP = 1;
#endif

template <typename W>
static inline void dot_group(const W* w, int64_t stride, const float* x, int64_t K, float* out) {
#ifdef MK_WIDE
    constexpr int L = MK_WIDE;
    VF a[GROUP][4];
    for (int g = 0; g < GROUP; ++g) a[g][0] = a[g][1] = a[g][2] = a[g][3] = vzero();
    int64_t k = 0;
    for (; k + 4 * L <= K; k += 4 * L) {
        const VF x0 = vload(x + k), x1 = vload(x + k + L), x2 = vload(x + k + 2 * L), x3 = vload(x + k + 3 * L);
        for (int g = 0; g < GROUP; ++g) {
            const W* r = w + g * stride + k;
            a[g][0] = vfma(vload(r), x0, a[g][0]);
            a[g][1] = vfma(vload(r + L), x1, a[g][1]);
            a[g][2] = vfma(vload(r + 2 * L), x2, a[g][2]);
            a[g][3] = vfma(vload(r + 3 * L), x3, a[g][3]);
        }
    }
    for (int g = 0; g < GROUP; ++g) {
        const W* r = w + g * stride;
        int64_t j = k;
        for (; j + L <= K; j += L) a[g][0] = vfma(vload(r + j), vload(x + j), a[g][0]);
        float acc = vsum(vadd(vadd(a[g][0], a[g][1]), vadd(a[g][2], a[g][3])));
        for (; j < K; ++j) acc += float(r[j]) * x[j];
        out[g] = acc;
    }
#else
    for (int g = 0; g < GROUP; ++g) out[g] = dot(w + g * stride, x, K);
#endif
}

#ifdef MK_DPBF16
// The bf16 × bf16 dot() in groups, the same way.
static inline void dot_group(const c10::BFloat16* w, int64_t stride, const c10::BFloat16* x, int64_t K, float* out) {
    VF a[GROUP][2];
    for (int g = 0; g < GROUP; ++g) a[g][0] = a[g][1] = vzero();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64)
        for (int g = 0; g < GROUP; ++g) {
            const c10::BFloat16* r = w + g * stride + k;
            a[g][0] = dp32(a[g][0], r, x + k);
            a[g][1] = dp32(a[g][1], r + 32, x + k + 32);
        }
    for (int g = 0; g < GROUP; ++g) {
        const c10::BFloat16* r = w + g * stride;
        int64_t j = k;
        for (; j + 32 <= K; j += 32) a[g][0] = dp32(a[g][0], r + j, x + j);
        float acc = vsum(vadd(a[g][0], a[g][1]));
        for (; j < K; ++j) acc += float(r[j]) * float(x[j]);
        out[g] = acc;
    }
}
#endif

static inline float half_to_float(const uint8_t* p) {
    uint16_t h; std::memcpy(&h, p, 2);
#ifdef MK_AVX2
    return _cvtsh_ss(h);
#else
    return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// A batch's products: G weight rows (stride apart) × R x rows at once, out[g * ldo + r]. Each
// (weight row, x row) pair keeps its own chains in exactly dot_rows' order, so its float is the
// same whatever block it falls in; what the block adds is G · R independent chains. One weight row
// at a time (dots) left the FMA units waiting on its few chains: at batch 8 the products ran at a
// third of batch 1's bytes per second, bound by latency, not memory (measured on an Intel Xeon).
// A block does R times a lone row's arithmetic per weight byte, and the hardware prefetcher falls
// behind (as with q8_0 rows, below): each step asks for its bytes BLOCK_PREFETCH ahead.
static constexpr int64_t BLOCK_PREFETCH = 2048;
static inline void block_prefetch(const void* at, int64_t bytes) {
#ifdef MK_AVX2
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(static_cast<const char*>(at) + BLOCK_PREFETCH + b, _MM_HINT_T0);
#endif
}

template <int G, int R, typename W>
static inline void dot_block(const W* w, int64_t stride, const float* const* xs, int64_t K, float* out, int64_t ldo) {
#ifdef MK_WIDE
    constexpr int L = MK_WIDE;
    VF a[G][R][2];
    for (int g = 0; g < G; ++g)
        for (int r = 0; r < R; ++r) a[g][r][0] = a[g][r][1] = vzero();
    int64_t k = 0;
    for (; k + 2 * L <= K; k += 2 * L) {
        VF w0[G], w1[G];
        for (int g = 0; g < G; ++g) {
            block_prefetch(w + g * stride + k, 2 * L * sizeof(W));
            w0[g] = vload(w + g * stride + k);
            w1[g] = vload(w + g * stride + k + L);
        }
        for (int r = 0; r < R; ++r) {
            const VF x0 = vload(xs[r] + k), x1 = vload(xs[r] + k + L);
            for (int g = 0; g < G; ++g) {
                a[g][r][0] = vfma(w0[g], x0, a[g][r][0]);
                a[g][r][1] = vfma(w1[g], x1, a[g][r][1]);
            }
        }
    }
    for (int g = 0; g < G; ++g)
        for (int r = 0; r < R; ++r) {
            float acc = vsum(vadd(a[g][r][0], a[g][r][1]));
            for (int64_t j = k; j < K; ++j) acc += float(w[g * stride + j]) * xs[r][j];
            out[g * ldo + r] = acc;
        }
#else
    for (int g = 0; g < G; ++g)
        for (int r = 0; r < R; ++r) out[g * ldo + r] = dot(w + g * stride, xs[r], K);
#endif
}

#ifdef MK_DPBF16
// The bf16 × bf16 dot_rows in blocks, the same way (one chain per pair, as there).
template <int G, int R>
static inline void dot_block(const c10::BFloat16* w, int64_t stride, const c10::BFloat16* const* xs, int64_t K,
                             float* out, int64_t ldo) {
    VF a[G][R];
    for (int g = 0; g < G; ++g)
        for (int r = 0; r < R; ++r) a[g][r] = vzero();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512bh wv[G];
        for (int g = 0; g < G; ++g) {
            block_prefetch(w + g * stride + k, 64);
            wv[g] = (__m512bh)_mm512_loadu_si512(w + g * stride + k);
        }
        for (int r = 0; r < R; ++r) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xs[r] + k);
            for (int g = 0; g < G; ++g) a[g][r] = _mm512_dpbf16_ps(a[g][r], wv[g], xv);
        }
    }
    for (int g = 0; g < G; ++g)
        for (int r = 0; r < R; ++r) {
            float acc = vsum(a[g][r]);
            for (int64_t j = k; j < K; ++j) acc += float(w[g * stride + j]) * float(xs[r][j]);
            out[g * ldo + r] = acc;
        }
}
#endif

// How many weight rows (G) and x rows (R) a block takes: G · R · chains accumulators, within the
// vector registers (32 with AVX-512, 16 with AVX2) beside the G weight vectors.
template <typename W, typename X>
struct Block {
#if MK_WIDE == 16
    static constexpr int G = 2, R = 4;  // 2 · 4 · 2 chains = 16
#elif defined(MK_WIDE)
    static constexpr int G = 2, R = 2;  // 2 · 2 · 2 chains = 8
#else
    static constexpr int G = 1, R = 1;
#endif
};
#ifdef MK_DPBF16
template <>
struct Block<c10::BFloat16, c10::BFloat16> {
    static constexpr int G = 4, R = 4;  // one chain per pair: 16
};
#endif

// out[g * ldo + r] = weight row g · xs[r] for Block's G weight rows and any R x rows.
template <typename W, typename X>
static inline void dots_block(const W* w, int64_t stride, const X* const* xs, int64_t R, int64_t K, float* out,
                              int64_t ldo) {
    constexpr int G = Block<W, X>::G, RB = Block<W, X>::R;
    int64_t r = 0;
    for (; r + RB <= R; r += RB) dot_block<G, RB>(w, stride, xs + r, K, out + r, ldo);
    if constexpr (RB > 3) if (R - r == 3) dot_block<G, 3>(w, stride, xs + r, K, out + r, ldo);
    if constexpr (RB > 2) if (R - r == 2) dot_block<G, 2>(w, stride, xs + r, K, out + r, ldo);
    if constexpr (RB > 1) if (R - r == 1) dot_block<G, 1>(w, stride, xs + r, K, out + r, ldo);
}

// A q8_0 product's x: each row's blocks of 32 rounded to int16 with one float scale per block,
// s = max|x| / 32767 and q = x / s rounded to nearest even (relative error <= 2^-16 of the block's
// largest |x|, 128 times finer than bf16). A block's 32 products are then integer sums: each int32
// lane adds 4 of them (AVX2; 2 with AVX-512), |·| <= 128 · 32767 · 4 < 2^24, exact in the float it
// becomes, and the lanes are scaled by d · s. Half the vector ops of widening every code to float
// (AVX2 code, 2 threads of an Intel Xeon, weights in its cache: 43 against 26 G weights/s);
// moekit.model.int8.int8_reference is the same rounding in torch.
struct Q16Row { const int16_t* q; const float* s; };

struct Q16Rows {
    std::vector<int16_t> q;
    std::vector<float> s;
    Q16Row row(int64_t r, int64_t nb) const { return {q.data() + r * nb * 32, s.data() + r * nb}; }
};

static Q16Rows q16_rows(const float* x, int64_t rows, int64_t nb) {
    Q16Rows out;
    out.q.resize(rows * nb * 32);
    out.s.resize(rows * nb);
    for (int64_t rb = 0; rb < rows * nb; ++rb) {
        const float* xb = x + rb * 32;
        float amax = 0.f;
        for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
        const float s = amax / 32767.f;
        out.s[rb] = s;
        for (int j = 0; j < 32; ++j) out.q[rb * 32 + j] = s == 0.f ? 0 : (int16_t)std::nearbyint(xb[j] / s);
    }
    return out;
}

// q8_0 rows do ~8 times the arithmetic per byte that fp32 rows do, and the hardware prefetcher
// falls behind: a software prefetch 2 KB ahead, every other block, took a scratch 4-row q8_0 kernel
// from 9-11 to 17-18 G weights/s on a 139 MB weight (Intel Xeon, 2 threads; 512 B: no gain, 4 KB:
// 14). For fp32 / bf16 rows the same prefetch gained nothing here and lost on an AMD EPYC.
static constexpr int64_t Q8_PREFETCH = 2048;
static inline void q8_prefetch(const uint8_t* block) {  // called once per pair of blocks
#ifdef MK_AVX2
    _mm_prefetch(reinterpret_cast<const char*>(block) + Q8_PREFETCH, _MM_HINT_T0);
#endif
}

// One block's integer sum (|·| <= 128 · 32767 · 32 fits int32), for CPUs without AVX2.
static inline int32_t q8_isum_scalar(const uint8_t* w, const int16_t* q) {
    const int8_t* c = reinterpret_cast<const int8_t*>(w + 2);
    int32_t s = 0;
    for (int j = 0; j < 32; ++j) s += int32_t(c[j]) * int32_t(q[j]);
    return s;
}

#ifdef MK_WIDE
// acc + block b's sum (its codes already widened, its scale d) with x row r's block b.
static inline VF q8_block(VF acc, Codes codes, float d, Q16Row x, int64_t b) {
    return vfma(block_sum(codes, x.q + b * 32), vset(d * x.s[b]), acc);
}
#endif

// One q8_0 weight row (nb blocks of 34 bytes: a float16 scale, 32 int8) against one rounded x row:
// Σ_blocks float(Σ q8 · q16) · (d · s), block b into chain b % 2. The blocks go in pairs, one
// chain each, so both chains stay in registers: indexing them by b % 2 kept them in memory, and
// the pairs took a 32000 x 512 q8_0 product from 6.7 to 7.4 G weights/s on one thread of an AMD
// EPYC (Zen 1, AVX2), 7.9 with the prefetch once per pair (the same floats: measured).
static inline float q8_dot(const uint8_t* w, Q16Row x, int64_t nb) {
#ifdef MK_WIDE
    VF a0 = vzero(), a1 = vzero();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2, w += 68) {
        q8_prefetch(w);
        a0 = q8_block(a0, widen(w + 2), half_to_float(w), x, b);
        a1 = q8_block(a1, widen(w + 36), half_to_float(w + 34), x, b + 1);
    }
    if (b < nb) a0 = q8_block(a0, widen(w + 2), half_to_float(w), x, b);
    return vsum(vadd(a0, a1));
#else
    float acc = 0.f;
    for (int64_t b = 0; b < nb; ++b, w += 34) acc += float(q8_isum_scalar(w, x.q + b * 32)) * (half_to_float(w) * x.s[b]);
    return acc;
#endif
}

#ifdef MK_WIDE
// One q8_0 weight row against R x rows (R <= 4): each block's codes are widened once for all R rows,
// and each row's arithmetic is q8_dot's, in its order, so a row of a batch gets exactly the float
// its solo product gets.
template <int R>
static inline void q8_rows(const uint8_t* w, const Q16Row* xs, int64_t nb, float* out) {
    VF a0[R], a1[R];
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = vzero();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2, w += 68) {
        q8_prefetch(w);
        const Codes even = widen(w + 2), odd = widen(w + 36);
        const float d0 = half_to_float(w), d1 = half_to_float(w + 34);
        for (int r = 0; r < R; ++r) {
            a0[r] = q8_block(a0[r], even, d0, xs[r], b);
            a1[r] = q8_block(a1[r], odd, d1, xs[r], b + 1);
        }
    }
    if (b < nb) {
        const Codes codes = widen(w + 2);
        const float d = half_to_float(w);
        for (int r = 0; r < R; ++r) a0[r] = q8_block(a0[r], codes, d, xs[r], b);
    }
    for (int r = 0; r < R; ++r) out[r] = vsum(vadd(a0[r], a1[r]));
}
#endif

// out[r] = q8_0 row w · xs[r] for R x rows.
static inline void q8_dots(const uint8_t* w, const Q16Row* xs, int64_t R, int64_t nb, float* out) {
    int64_t r = 0;
#ifdef MK_WIDE
    if (R > 1) {
        for (; r + 4 <= R; r += 4) q8_rows<4>(w, xs + r, nb, out + r);
        if (R - r == 3) q8_rows<3>(w, xs + r, nb, out + r);
        else if (R - r == 2) q8_rows<2>(w, xs + r, nb, out + r);
        else if (R - r == 1) out[r] = q8_dot(w, xs[r], nb);
        return;
    }
#endif
    for (; r < R; ++r) out[r] = q8_dot(w, xs[r], nb);
}

// GROUP consecutive q8_0 weight rows (`row_bytes` apart) against one rounded x row, each row's
// arithmetic exactly q8_dot's.
static inline void q8_group(const uint8_t* w, int64_t row_bytes, Q16Row x, int64_t nb, float* out) {
#ifdef MK_WIDE
    VF a0[GROUP], a1[GROUP];
    for (int g = 0; g < GROUP; ++g) a0[g] = a1[g] = vzero();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2)
        for (int g = 0; g < GROUP; ++g) {
            const uint8_t* r = w + g * row_bytes + b * 34;
            q8_prefetch(r);
            a0[g] = q8_block(a0[g], widen(r + 2), half_to_float(r), x, b);
            a1[g] = q8_block(a1[g], widen(r + 36), half_to_float(r + 34), x, b + 1);
        }
    for (; b < nb; ++b)
        for (int g = 0; g < GROUP; ++g) {
            const uint8_t* r = w + g * row_bytes + b * 34;
            a0[g] = q8_block(a0[g], widen(r + 2), half_to_float(r), x, b);
        }
    for (int g = 0; g < GROUP; ++g) out[g] = vsum(vadd(a0[g], a1[g]));
#else
    for (int g = 0; g < GROUP; ++g) out[g] = q8_dot(w + g * row_bytes, x, nb);
#endif
}

// Below this many weight bytes per thread a call runs on one thread: waking the second costs
// more than it saves (measured: a 32 × 512 router 4.3 µs on one thread, 5.8 µs on two).
static constexpr int64_t MIN_THREAD_BYTES = 64 * 1024;

#if defined(MK_DPBF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define MK_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
// A batch's bf16 rows times bf16 weights on AMX tiles. At 8 rows the vector kernels are bound by
// their multiplies, not the bytes (the 32000 x 512 head: 1.70 ms widened to fp32, 2.39 ms as bf16
// pairs, 0.84 ms on tiles, the speed the one-row product reads it at; measured on an Intel Xeon).
// A tile of 16 weight rows x 32 inputs is loaded straight from the Hub layout [N, K] (a stride of K);
// x is laid out once per call as the tiles' pairs, x[m][k], x[m][k + 1] side by side for each m.
// Each output is its own chain over k in 32-input steps, the pairs of a step summed by the tile
// multiply, so a row's floats do not depend on the rows beside it; they differ from the vector
// kernels' (another order of the same fp32 sums), and a call with one row keeps the vector kernel.
struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
};

// Linux hands a process the tiles' state only on request (ARCH_REQ_XCOMP_PERM, XTILEDATA).
static bool amx_ready() {
    static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return ok;
}

// Tile rows: x rows in a tile are always 16, the unused ones zero (the tiles' multiply costs nothing
// next to the weight's bytes), so one configuration serves every call and every expert.
static constexpr int64_t AMX_ROWS = 16;

static void amx_configure() {
    TileConfig cfg;
    for (int t = 0; t < 4; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = AMX_ROWS * 4; }
    cfg.rows[4] = cfg.rows[5] = 16; cfg.colsb[4] = cfg.colsb[5] = 64;
    cfg.rows[6] = 16; cfg.colsb[6] = AMX_ROWS * 4;
    _tile_loadconfig(&cfg);
}

// Up to 16 x rows as the tiles' pairs, packed: out[p * R + r] = (x_r[2p], x_r[2p + 1]). A tile row
// of pairs is loaded with a stride of R pairs, so its columns past R hold the next rows' pairs, and
// the tile's outputs for them are ignored (an output column reads its own column of pairs only).
// Packing, not zero-padding to 16 rows: a batch-8 expert chosen by one row took 16 KB of pairs (at K
// = 512) where it needs 1 KB, written on one thread for every chosen expert of every call.
static void amx_pairs(const c10::BFloat16* const* xs, int64_t R, int64_t K, uint32_t* out) {
    for (int64_t p = 0; p < K / 2; ++p)
        for (int64_t r = 0; r < R; ++r) std::memcpy(&out[p * R + r], xs[r] + 2 * p, 4);
}

// Pairs for groups of R rows, packed one after another, and the tail the last tile load reads past
// the last group's pairs (a tile row is always 16 pairs wide).
static constexpr int64_t AMX_PAIRS_TAIL = AMX_ROWS;

// c[t * 256 + i * 16 + r] = x row r . weight row n0 + 16 t + i of w [.., K], for T tiles of 16 weight
// rows: C tiles 0 .. T-1, weight tiles 4 and 5 in turn, x's R rows of pairs (amx_pairs) in tile 6.
// next: the weight rows of the call's next block of as many rows, or nullptr. An expert's block of
// 16 rows is 16 short streams (32 lines each at K = 512), too short for the hardware to prefetch
// well: the next block is prefetched a 16th of it per step of 32 inputs.
template <int T>
static inline void amx_block(const c10::BFloat16* w, int64_t K, const uint32_t* pairs, int64_t R, int64_t n0, float* c,
                             const c10::BFloat16* next = nullptr) {
    _tile_zero(0);
    if (T > 1) _tile_zero(1);
    if (T > 2) _tile_zero(2);
    if (T > 3) _tile_zero(3);
    const c10::BFloat16* a = w + n0 * K;
    for (int64_t k = 0; k < K; k += 32) {
        if (next != nullptr) {
            const char* ahead = reinterpret_cast<const char*>(next) + (k / 32) * 16 * T * 64;
            for (int i = 0; i < 16 * T; ++i) _mm_prefetch(ahead + i * 64, _MM_HINT_T0);
        }
        _tile_loadd(6, pairs + (k / 2) * R, R * 4);
        _tile_loadd(4, a + k, K * 2);
        _tile_dpbf16ps(0, 4, 6);
        if (T > 1) { _tile_loadd(5, a + 16 * K + k, K * 2); _tile_dpbf16ps(1, 5, 6); }
        if (T > 2) { _tile_loadd(4, a + 32 * K + k, K * 2); _tile_dpbf16ps(2, 4, 6); }
        if (T > 3) { _tile_loadd(5, a + 48 * K + k, K * 2); _tile_dpbf16ps(3, 5, 6); }
    }
    _tile_stored(0, c, AMX_ROWS * 4);
    if (T > 1) _tile_stored(1, c + 256, AMX_ROWS * 4);
    if (T > 2) _tile_stored(2, c + 512, AMX_ROWS * 4);
    if (T > 3) _tile_stored(3, c + 768, AMX_ROWS * 4);
}

// w [N, K] (K a multiple of 32) with M bf16 x rows of K, into y [M, N]: 16 x rows at a time, threads
// over blocks of 64 weight rows; the last N % 16 weight rows, short of a tile, by the vector kernel.
static void amx_rows(const c10::BFloat16* x, int64_t M, const c10::BFloat16* w, int64_t N, int64_t K, float* y) {
    const int64_t tiles = N / 16, blocks = (tiles + 3) / 4;
    const int64_t grain = std::max<int64_t>(1, MIN_THREAD_BYTES / (64 * K * 2));
    std::vector<uint32_t> pairs((K / 2) * AMX_ROWS + AMX_PAIRS_TAIL);
    std::vector<const c10::BFloat16*> xs(AMX_ROWS);
    for (int64_t m0 = 0; m0 < M; m0 += AMX_ROWS) {
        const int64_t R = std::min<int64_t>(AMX_ROWS, M - m0);
        for (int64_t r = 0; r < R; ++r) xs[r] = x + (m0 + r) * K;
        amx_pairs(xs.data(), R, K, pairs.data());
        at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
            amx_configure();
            alignas(64) float c[4 * 256];
            for (int64_t b = begin; b < end; ++b) {
                const int T = (int)std::min<int64_t>(4, tiles - b * 4);
                if (T == 4) amx_block<4>(w, K, pairs.data(), R, b * 64, c);
                else if (T == 3) amx_block<3>(w, K, pairs.data(), R, b * 64, c);
                else if (T == 2) amx_block<2>(w, K, pairs.data(), R, b * 64, c);
                else amx_block<1>(w, K, pairs.data(), R, b * 64, c);
                for (int64_t i = 0; i < 16 * T; ++i)
                    for (int64_t r = 0; r < R; ++r) y[(m0 + r) * N + b * 64 + i] = c[i * 16 + r];
            }
            _tile_release();
        });
    }
    std::vector<const c10::BFloat16*> all(M);
    for (int64_t m = 0; m < M; ++m) all[m] = x + m * K;
    std::vector<float> out(M);
    for (int64_t n = N - N % 16; n < N; ++n) {
        dots(w + n * K, all.data(), M, K, out.data());
        for (int64_t m = 0; m < M; ++m) y[m * N + n] = out[m];
    }
}

// experts_loop for a batch's bf16 rows and bf16 weights: each chosen expert's rows on the tiles, 16 at
// a time, an expert one row chose too (a row's floats must not depend on whether another row chose its
// expert); only the last N % 16 weight rows keep the vector kernel (`dots`). xs[j]: the x row of the
// j-th pair in expert order.
struct AmxGroup { int64_t e, j0, R, at; };  // rows order[j0 .. j0 + R) of expert e, their pairs at pairs[at ..)

// The pairs of each chosen expert's x rows, 16 rows a group: groups, and their pairs (amx_pairs),
// group g's at pairs[g.at ..).
static std::pair<std::vector<AmxGroup>, std::vector<uint32_t>> amx_groups(int64_t E, int64_t K, const std::vector<int64_t>& first,
                                                                           const std::vector<const c10::BFloat16*>& xs) {
    std::vector<AmxGroup> groups;
    for (int64_t e = 0; e < E; ++e)
        for (int64_t j0 = first[e]; j0 < first[e + 1]; j0 += AMX_ROWS)
            groups.push_back({e, j0, std::min<int64_t>(AMX_ROWS, first[e + 1] - j0), j0 * (K / 2)});
    std::vector<uint32_t> pairs((int64_t)xs.size() * (K / 2) + AMX_PAIRS_TAIL);
    for (const AmxGroup& g : groups) amx_pairs(xs.data() + g.j0, g.R, K, pairs.data() + g.at);
    return {groups, pairs};
}

static void amx_experts(const c10::BFloat16* w, int64_t E, int64_t N, int64_t K, const std::vector<int64_t>& first,
                        const std::vector<int64_t>& order, const std::vector<const c10::BFloat16*>& xs, float* y) {
    const auto [groups, pairs] = amx_groups(E, K, first, xs);
    const int64_t blocks = (N + 15) / 16;  // work items: (group, block of 16 weight rows)
    at::parallel_for(0, (int64_t)groups.size() * blocks, 1, [&](int64_t begin, int64_t end) {
        amx_configure();
        alignas(64) float c[256];
        float out[AMX_ROWS];
        for (int64_t i = begin; i < end; ++i) {
            const AmxGroup& g = groups[i / blocks];
            const int64_t n0 = (i % blocks) * 16, n_end = std::min(N, n0 + 16);
            const c10::BFloat16* we = w + g.e * N * K;
            if (n_end - n0 == 16) {
                const c10::BFloat16* next = nullptr;  // this thread's next item, where it is a whole tile
                if (i + 1 < end && ((i + 1) % blocks) * 16 + 16 <= N)
                    next = w + (groups[(i + 1) / blocks].e * N + ((i + 1) % blocks) * 16) * K;
                amx_block<1>(we, K, pairs.data() + g.at, g.R, n0, c, next);
                for (int64_t n = 0; n < 16; ++n)
                    for (int64_t r = 0; r < g.R; ++r) y[order[g.j0 + r] * N + n0 + n] = c[n * 16 + r];
                continue;
            }
            for (int64_t n = n0; n < n_end; ++n) {
                dots(we + n * K, xs.data() + g.j0, g.R, K, out);
                for (int64_t r = 0; r < g.R; ++r) y[order[g.j0 + r] * N + n] = out[r];
            }
        }
        _tile_release();
    });
}
#endif

// y[m, n] = weight row n · x row m for M x rows (xrow(m) → its floats) and N weight rows of
// row_bytes each, threads over N; row_dots(n, xs, R, out) multiplies weight row n with R x rows,
// group_dots(n, x, out) weight rows n .. n + GROUP - 1 with one x row (batch 1, where `grouped`).
// block_dots(n, xs, R, out) multiplies weight rows n .. n + BG - 1 with R x rows into out[g * R + r]
// (a batch's dots_block; BG = 0: no blocks, each weight row on its own).
template <int BG, typename XRow, typename RowDots, typename GroupDots, typename BlockDots>
static void rows_loop(float* y, int64_t M, int64_t N, int64_t row_bytes, XRow xrow, RowDots row_dots,
                      GroupDots group_dots, BlockDots block_dots, bool grouped) {
    const int64_t grain = std::max<int64_t>(16, MIN_THREAD_BYTES / std::max<int64_t>(1, row_bytes));
    if (M == 1) {  // batch 1: straight into y, nothing to allocate; GROUP rows at a time where grouped
        const auto x0 = xrow(0);
        at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
            int64_t n = begin;
            if (grouped)
                for (; n + GROUP <= end; n += GROUP) group_dots(n, x0, y + n);
            for (; n < end; ++n) row_dots(n, &x0, 1, y + n);
        });
        return;
    }
    std::vector<decltype(xrow(0))> xs(M);
    for (int64_t m = 0; m < M; ++m) xs[m] = xrow(m);
    at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
        std::vector<float> out(M * std::max(BG, 1));
        int64_t n = begin;
        if constexpr (BG > 0)
            for (; n + BG <= end; n += BG) {
                block_dots(n, xs.data(), M, out.data());
                for (int g = 0; g < BG; ++g)
                    for (int64_t m = 0; m < M; ++m) y[m * N + n + g] = out[g * M + m];
            }
        for (; n < end; ++n) {
            row_dots(n, xs.data(), M, out.data());
            for (int64_t m = 0; m < M; ++m) y[m * N + n] = out[m];
        }
    });
}

// The (row, choice) pairs of ids [P] in expert order (a counting sort): expert e's are
// order[first[e] .. first[e + 1]).
static std::pair<std::vector<int64_t>, std::vector<int64_t>> by_expert(const int64_t* ids, int64_t P, int64_t E) {
    std::vector<int64_t> first(E + 1, 0), order(P);
    for (int64_t bc = 0; bc < P; ++bc) {
        TORCH_CHECK(ids[bc] >= 0 && ids[bc] < E, "experts_gemv: expert id out of range");
        ++first[ids[bc] + 1];
    }
    for (int64_t e = 0; e < E; ++e) first[e + 1] += first[e];
    std::vector<int64_t> fill(first.begin(), first.end() - 1);
    for (int64_t bc = 0; bc < P; ++bc) order[fill[ids[bc]]++] = bc;
    return {first, order};
}

// xs[j] = the x row of pair order[j] (row b, choice c): x[b, 0] (X = 1) or x[b, c] (X = C).
template <typename XRow>
static auto rows_in_order(XRow xrow, const std::vector<int64_t>& order, int64_t C, int64_t X) {
    std::vector<decltype(xrow(0))> xs(order.size());
    for (size_t j = 0; j < order.size(); ++j) xs[j] = xrow(order[j] / C * X + (X == 1 ? 0 : order[j] % C));
    return xs;
}

// y[b, c, n] = row n of expert ids[b, c] · x row, for every (row, choice), where the x row is
// x[b, 0] (X = 1) or x[b, c] (X = C). The pairs are grouped by expert: each chosen expert's weight
// rows are read once for all the pairs that chose it (a batch reads the union of its experts), and
// expert_dots(e, n, xs, R, out) multiplies one of them with all those pairs' x rows at once, and
// expert_group(e, n, x, out) rows n .. n + GROUP - 1 of expert e with one x row (where `grouped`).
// expert_block(e, n, xs, R, out): rows n .. n + BG - 1 of expert e with R x rows into out[g * R + r]
// (BG = 0: none; BG divides 16).
template <int BG, typename XRow, typename ExpertDots, typename ExpertGroup, typename ExpertBlock>
static void experts_loop(const int64_t* ids, float* y, int64_t B, int64_t X, int64_t C, int64_t E, int64_t N,
                         XRow xrow, ExpertDots expert_dots, ExpertGroup expert_group, ExpertBlock expert_block,
                         bool grouped) {
    const int64_t P = B * C;
    const auto [first, order] = by_expert(ids, P, E);
    const auto xs = rows_in_order(xrow, order, C, X);
    // Work items are (expert, block of 16 outputs): a lone row still spreads over the threads.
    const int64_t blocks = (N + 15) / 16;
    std::vector<int64_t> items;
    for (int64_t e = 0; e < E; ++e)
        if (first[e + 1] > first[e])
            for (int64_t blk = 0; blk < blocks; ++blk) items.push_back(e * blocks + blk);
    at::parallel_for(0, (int64_t)items.size(), 1, [&](int64_t begin, int64_t end) {
        float out[64 * 4];  // up to 64 rows × a block's weight rows (Block's G is at most 4)
        for (int64_t i = begin; i < end; ++i) {
            const int64_t e = items[i] / blocks, blk = items[i] % blocks;
            const int64_t n_end = std::min(N, (blk + 1) * 16);
            if (first[e + 1] - first[e] == 1) {  // one row chose this expert (all of them at batch 1)
                const int64_t j = first[e];
                float* yj = y + order[j] * N;
                int64_t n = blk * 16;
                if (grouped)
                    for (; n + GROUP <= n_end; n += GROUP) expert_group(e, n, xs[j], yj + n);
                for (; n < n_end; ++n) expert_dots(e, n, xs.data() + j, 1, yj + n);
                continue;
            }
            int64_t n = blk * 16;
            if constexpr (BG > 0)
                for (; n + BG <= n_end; n += BG)
                    for (int64_t j0 = first[e]; j0 < first[e + 1]; j0 += 64) {
                        const int64_t R = std::min<int64_t>(64, first[e + 1] - j0);
                        expert_block(e, n, xs.data() + j0, R, out);
                        for (int g = 0; g < BG; ++g)
                            for (int64_t j = 0; j < R; ++j) y[order[j0 + j] * N + n + g] = out[g * R + j];
                    }
            for (; n < n_end; ++n)
                for (int64_t j0 = first[e]; j0 < first[e + 1]; j0 += 64) {  // at most 64 rows at a time
                    const int64_t R = std::min<int64_t>(64, first[e + 1] - j0);
                    expert_dots(e, n, xs.data() + j0, R, out);
                    for (int64_t j = 0; j < R; ++j) y[order[j0 + j] * N + n] = out[j];
                }
        }
    });
}

// x's rows as contiguous fp32 rows of `width` floats (zero padded past x's last size). An fp32
// contiguous x of that width is read in place; a bf16 / fp16 one is widened here, not by a
// separate torch op (at batch 1 the two extra ops per product were ~10% of a bf16 step, measured).
struct FloatRows {
    torch::Tensor keep;  // x or its contiguous copy, alive while `data` points into it
    std::vector<float> copy;
    const float* data = nullptr;
};

template <typename T>
static void widen(const T* src, int64_t rows, int64_t k, int64_t width, float* dst) {
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < width; ++j) dst[r * width + j] = j < k ? float(src[r * k + j]) : 0.f;
}

static FloatRows float_rows(const torch::Tensor& x, int64_t width) {
    FloatRows out;
    out.keep = x.contiguous();
    const int64_t k = x.size(-1), rows = k == 0 ? 0 : x.numel() / k;
    TORCH_CHECK(k <= width, "gemv: x is wider than the weight");
    const auto type = x.scalar_type();
    if (type == torch::kFloat && k == width) {
        out.data = out.keep.data_ptr<float>();
        return out;
    }
    out.copy.resize(rows * width);
    if (type == torch::kFloat) widen(out.keep.data_ptr<float>(), rows, k, width, out.copy.data());
    else if (type == torch::kBFloat16) widen(out.keep.data_ptr<c10::BFloat16>(), rows, k, width, out.copy.data());
    else if (type == torch::kHalf) widen(out.keep.data_ptr<c10::Half>(), rows, k, width, out.copy.data());
    else TORCH_CHECK(false, "gemv: x must be float32, bfloat16 or float16");
    out.data = out.copy.data();
    return out;
}

// The output in x's dtype: the loops write fp32 into `data` (the tensor itself when x is fp32),
// and finish() narrows it once, rounding to nearest even as Tensor.to does.
struct Output {
    torch::Tensor y;
    std::unique_ptr<float[]> wide;  // every product writes all of y: not zeroed first
    float* data = nullptr;
    Output(std::vector<int64_t> shape, const torch::Tensor& like) : y(torch::empty(shape, like.options())) {
        if (y.scalar_type() == torch::kFloat) data = y.data_ptr<float>();
        else { wide.reset(new float[y.numel()]); data = wide.get(); }
    }
    torch::Tensor finish() {
        const int64_t n = wide ? y.numel() : 0;
        if (y.scalar_type() == torch::kBFloat16) {
            c10::BFloat16* p = y.data_ptr<c10::BFloat16>();
            for (int64_t i = 0; i < n; ++i) p[i] = c10::BFloat16(wide[i]);
        } else if (y.scalar_type() == torch::kHalf) {
            c10::Half* p = y.data_ptr<c10::Half>();
            for (int64_t i = 0; i < n; ++i) p[i] = c10::Half(wide[i]);
        }
        return y;
    }
};

// Calls fn(xrow), xrow(r) → x's row r as the products read it: bf16 in place where the weight is
// bf16 too and the CPU multiplies bf16 pairs (MK_DPBF16), else fp32 rows (float_rows).
template <typename Fn>
static void with_x_rows(const torch::Tensor& x, int64_t K, bool bf16_weight, Fn fn) {
#ifdef MK_DPBF16
    if (bf16_weight && x.scalar_type() == torch::kBFloat16) {
        const auto xc = x.contiguous();
        const c10::BFloat16* xp = xc.data_ptr<c10::BFloat16>();
        fn([xp, K](int64_t r) { return xp + r * K; });
        return;
    }
#endif
    const auto xf = float_rows(x, K);
    const float* xp = xf.data;
    fn([xp, K](int64_t r) { return xp + r * K; });
}

torch::Tensor rows_gemv(torch::Tensor x, torch::Tensor w, bool grouped) {
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "rows_gemv: x [M, K], w [N, K]");
    const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
    auto wc = w.contiguous();
    Output y({M, N}, x);
    const bool bf16 = wc.scalar_type() == torch::kBFloat16;
    with_x_rows(x, K, bf16, [&](auto xrow) {
        using X = std::remove_const_t<std::remove_pointer_t<decltype(xrow(0))>>;
        auto run = [&](auto wp) {
            using W = std::remove_const_t<std::remove_pointer_t<decltype(wp)>>;
            rows_loop<Block<W, X>::G>(
                y.data, M, N, K * (int64_t)sizeof(W), xrow,
                [&](int64_t n, auto xs, int64_t R, float* out) { dots(wp + n * K, xs, R, K, out); },
                [&](int64_t n, auto x1, float* out) { dot_group(wp + n * K, K, x1, K, out); },
                [&](int64_t n, auto xs, int64_t R, float* out) { dots_block(wp + n * K, K, xs, R, K, out, R); }, grouped);
        };
#ifdef MK_AMX
        if constexpr (std::is_same_v<X, c10::BFloat16>) {
            if (bf16 && M >= 2 && K % 32 == 0 && N >= 16 && amx_ready()) {
                amx_rows(xrow(0), M, wc.data_ptr<c10::BFloat16>(), N, K, y.data);
                return;
            }
        }
#endif
        if (bf16) run(static_cast<const c10::BFloat16*>(wc.data_ptr<c10::BFloat16>()));
        else if constexpr (std::is_same_v<X, float>) run(static_cast<const float*>(wc.data_ptr<float>()));  // fp32 rows
    });
    return y.finish();
}

torch::Tensor experts_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor ids, bool grouped) {
    TORCH_CHECK(x.dim() == 3 && w.dim() == 3 && ids.dim() == 2 && x.size(2) == w.size(2),
                "experts_gemv: x [B, X, K], w [E, N, K], ids [B, C]");
    const int64_t B = x.size(0), X = x.size(1), K = x.size(2), E = w.size(0), N = w.size(1), C = ids.size(1);
    TORCH_CHECK(X == 1 || X == C, "experts_gemv: x holds one row per token or one per choice");
    auto wc = w.contiguous();
    auto ic = ids.to(torch::kLong).contiguous();
    Output y({B, C, N}, x);
    const bool bf16 = wc.scalar_type() == torch::kBFloat16;
    with_x_rows(x, K, bf16, [&](auto xrow) {
        using XT = std::remove_const_t<std::remove_pointer_t<decltype(xrow(0))>>;
        auto run = [&](auto wp) {
            using W = std::remove_const_t<std::remove_pointer_t<decltype(wp)>>;
            experts_loop<Block<W, XT>::G>(
                ic.data_ptr<int64_t>(), y.data, B, X, C, E, N, xrow,
                [&](int64_t e, int64_t n, auto xs, int64_t R, float* out) { dots(wp + (e * N + n) * K, xs, R, K, out); },
                [&](int64_t e, int64_t n, auto x1, float* out) { dot_group(wp + (e * N + n) * K, K, x1, K, out); },
                [&](int64_t e, int64_t n, auto xs, int64_t R, float* out) { dots_block(wp + (e * N + n) * K, K, xs, R, K, out, R); },
                grouped);
        };
#ifdef MK_AMX
        if constexpr (std::is_same_v<XT, c10::BFloat16>) {
            if (bf16 && B >= 2 && K % 32 == 0 && amx_ready()) {
                const auto [first, order] = by_expert(ic.data_ptr<int64_t>(), B * C, E);
                const auto xs = rows_in_order(xrow, order, C, X);
                amx_experts(wc.data_ptr<c10::BFloat16>(), E, N, K, first, order, xs, y.data);
                return;
            }
        }
#endif
        if (bf16) run(static_cast<const c10::BFloat16*>(wc.data_ptr<c10::BFloat16>()));
        else if constexpr (std::is_same_v<XT, float>) run(static_cast<const float*>(wc.data_ptr<float>()));
    });
    return y.finish();
}

// The tiles layout of a bf16 weight [N, K] (N a multiple of 16, K of 32): blocks of 16 weight rows,
// each stored as its K / 32 tiles of 16 rows x 32 inputs, a tile's rows side by side (1 KB), so a
// block is one contiguous stream of 32 K bytes (moekit.model.gemv.to_tiles writes it). Read in the
// Hub layout, an AMX tile load touches 16 rows a stride of K apart, and a batch's products streamed
// a weight at 19-20 GB/s where the same bytes in tiles streamed at 23-25 (2 threads, 32000 x 512 and
// expert-sized weights from memory, an Intel Xeon); one row's vector products gain too (19.5-21
// against 22-23 GB/s with the next tiles prefetched). Tiles are an AMX machine's layout only.
static constexpr int64_t TILE_ROWS = 16, TILE_COLS = 32, TILE_AHEAD = 4;  // TILE_AHEAD: tiles prefetched ahead

static void check_tiles(const torch::Tensor& w, int64_t K, const char* what) {
    TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.is_contiguous(), what, ": w is a contiguous bf16 weight in tiles");
    TORCH_CHECK(w.size(-2) % TILE_ROWS == 0 && K % TILE_COLS == 0, what, ": tiles need N % 16 == 0 and K % 32 == 0");
}

// out[s * 16 + i] = weight row i of block s . x, for S consecutive blocks from w (16 K elements each),
// one x row; each output an fp32 chain over the 32-input steps, the step's pairs summed by
// vdpbf16ps's lanes (or, without AVX512-BF16, the same products in order).
template <int S>
static inline void tiles_dots(const c10::BFloat16* w, int64_t K, const c10::BFloat16* x, float* out) {
#ifdef MK_DPBF16
    __m512 acc[S][TILE_ROWS];
    for (int s = 0; s < S; ++s)
        for (int i = 0; i < TILE_ROWS; ++i) acc[s][i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += TILE_COLS) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
        for (int s = 0; s < S; ++s) {
            const c10::BFloat16* t = w + s * TILE_ROWS * K + k * TILE_ROWS;
            const char* ahead = reinterpret_cast<const char*>(t + TILE_AHEAD * TILE_ROWS * TILE_COLS);
            for (int i = 0; i < TILE_ROWS; ++i) _mm_prefetch(ahead + i * 64, _MM_HINT_T0);
            for (int i = 0; i < TILE_ROWS; ++i)
                acc[s][i] = _mm512_dpbf16_ps(acc[s][i], (__m512bh)_mm512_loadu_si512(t + i * TILE_COLS), xv);
        }
    }
    for (int s = 0; s < S; ++s)
        for (int i = 0; i < TILE_ROWS; ++i) out[s * TILE_ROWS + i] = _mm512_reduce_add_ps(acc[s][i]);
#else
    for (int s = 0; s < S; ++s)
        for (int i = 0; i < TILE_ROWS; ++i) {
            float acc = 0.f;
            for (int64_t k = 0; k < K; k += TILE_COLS) {
                const c10::BFloat16* r = w + s * TILE_ROWS * K + k * TILE_ROWS + i * TILE_COLS;
                for (int64_t j = 0; j < TILE_COLS; ++j) acc += float(r[j]) * float(x[k + j]);
            }
            out[s * TILE_ROWS + i] = acc;
        }
#endif
}

// One x row times blocks [b0, b1) of w (block b at w + b * 16 K) into y[b0 * 16 ..): two blocks at a
// time, two streams for the memory to fill in parallel.
static void tiles_row(const c10::BFloat16* w, int64_t K, const c10::BFloat16* x, int64_t b0, int64_t b1, float* y) {
    int64_t b = b0;
    for (; b + 2 <= b1; b += 2) tiles_dots<2>(w + b * TILE_ROWS * K, K, x, y + b * TILE_ROWS);
    if (b < b1) tiles_dots<1>(w + b * TILE_ROWS * K, K, x, y + b * TILE_ROWS);
}

#ifdef MK_AMX
// c[t * 256 + i * 16 + r] = x row r . weight row 16 t + i of the T blocks from w (tiles layout); x's
// pairs as amx_block takes them. The T blocks are T streams, read side by side.
template <int T>
static inline void amx_tiles(const c10::BFloat16* w, int64_t K, const uint32_t* pairs, int64_t R, float* c) {
    _tile_zero(0);
    if (T > 1) _tile_zero(1);
    if (T > 2) _tile_zero(2);
    if (T > 3) _tile_zero(3);
    for (int64_t k = 0; k < K; k += TILE_COLS) {
        const c10::BFloat16* a = w + k * TILE_ROWS;
        _tile_loadd(6, pairs + (k / 2) * R, R * 4);
        _tile_loadd(4, a, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (T > 1) { _tile_loadd(5, a + TILE_ROWS * K, 64); _tile_dpbf16ps(1, 5, 6); }
        if (T > 2) { _tile_loadd(4, a + 2 * TILE_ROWS * K, 64); _tile_dpbf16ps(2, 4, 6); }
        if (T > 3) { _tile_loadd(5, a + 3 * TILE_ROWS * K, 64); _tile_dpbf16ps(3, 5, 6); }
    }
    _tile_stored(0, c, AMX_ROWS * 4);
    if (T > 1) _tile_stored(1, c + 256, AMX_ROWS * 4);
    if (T > 2) _tile_stored(2, c + 512, AMX_ROWS * 4);
    if (T > 3) _tile_stored(3, c + 768, AMX_ROWS * 4);
}

// R x rows (their pairs) times T blocks from w, into y_rows[r][0 .. 16 T).
static inline void amx_tiles_into(const c10::BFloat16* w, int64_t K, const uint32_t* pairs, int64_t T,
                                  float* const* y_rows, int64_t R) {
    alignas(64) float c[4 * 256];
    if (T == 4) amx_tiles<4>(w, K, pairs, R, c);
    else if (T == 3) amx_tiles<3>(w, K, pairs, R, c);
    else if (T == 2) amx_tiles<2>(w, K, pairs, R, c);
    else amx_tiles<1>(w, K, pairs, R, c);
    for (int64_t i = 0; i < TILE_ROWS * T; ++i)
        for (int64_t r = 0; r < R; ++r) y_rows[r][i] = c[i * AMX_ROWS + r];
}
#endif

// y [M, N] = x [M, K] . w [N, K] in tiles: one row by the vector kernel; more rows on AMX tiles, 16
// at a time, each group of 4 blocks (64 weight rows) read once for all of them.
torch::Tensor rows_tiles(torch::Tensor x, torch::Tensor w) {
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "rows_tiles: x [M, K], w [N, K]");
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "rows_tiles: x is bf16");
    const int64_t M = x.size(0), N = w.size(0), K = x.size(1), blocks = N / TILE_ROWS;
    check_tiles(w, K, "rows_tiles");
    const auto xc = x.contiguous();
    const c10::BFloat16* xp = xc.data_ptr<c10::BFloat16>();
    const c10::BFloat16* wp = w.data_ptr<c10::BFloat16>();
    Output y({M, N}, x);
    const int64_t grain = std::max<int64_t>(2, MIN_THREAD_BYTES / (TILE_ROWS * K * 2));
#ifdef MK_AMX
    if (M >= 2 && amx_ready()) {
        const int64_t chunks = (M + AMX_ROWS - 1) / AMX_ROWS, quads = (blocks + 3) / 4;
        std::vector<uint32_t> pairs(M * (K / 2) + AMX_PAIRS_TAIL);  // chunk ch's at ch * (K / 2) * 16
        std::vector<const c10::BFloat16*> xs(M);
        for (int64_t m = 0; m < M; ++m) xs[m] = xp + m * K;
        for (int64_t ch = 0; ch < chunks; ++ch)
            amx_pairs(xs.data() + ch * AMX_ROWS, std::min<int64_t>(AMX_ROWS, M - ch * AMX_ROWS), K, pairs.data() + ch * (K / 2) * AMX_ROWS);
        at::parallel_for(0, quads, std::max<int64_t>(1, grain / 4), [&](int64_t begin, int64_t end) {
            amx_configure();
            float* rows[AMX_ROWS];
            for (int64_t q = begin; q < end; ++q) {
                const int64_t T = std::min<int64_t>(4, blocks - q * 4);
                for (int64_t ch = 0; ch < chunks; ++ch) {
                    const int64_t R = std::min<int64_t>(AMX_ROWS, M - ch * AMX_ROWS);
                    for (int64_t r = 0; r < R; ++r) rows[r] = y.data + (ch * AMX_ROWS + r) * N + q * 4 * TILE_ROWS;
                    amx_tiles_into(wp + q * 4 * TILE_ROWS * K, K, pairs.data() + ch * (K / 2) * AMX_ROWS, T, rows, R);
                }
            }
            _tile_release();
        });
        return y.finish();
    }
#endif
    at::parallel_for(0, blocks, grain, [&](int64_t begin, int64_t end) {
        for (int64_t m = 0; m < M; ++m) tiles_row(wp, K, xp + m * K, begin, end, y.data + m * N);
    });
    return y.finish();
}

// y [B, C, N] = each (row, choice)'s x row . expert ids[b, c] of w [E, N, K], each expert in tiles.
// One row: its C experts' blocks spread over the threads, two blocks at a time. More rows on AMX
// tiles: each chosen expert's blocks read once, 4 at a time, for all the rows that chose it.
torch::Tensor experts_tiles(torch::Tensor x, torch::Tensor w, torch::Tensor ids) {
    TORCH_CHECK(x.dim() == 3 && w.dim() == 3 && ids.dim() == 2 && x.size(2) == w.size(2),
                "experts_tiles: x [B, X, K], w [E, N, K], ids [B, C]");
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "experts_tiles: x is bf16");
    const int64_t B = x.size(0), X = x.size(1), K = x.size(2), E = w.size(0), N = w.size(1), C = ids.size(1);
    TORCH_CHECK(X == 1 || X == C, "experts_tiles: x holds one row per token or one per choice");
    check_tiles(w, K, "experts_tiles");
    const auto xc = x.contiguous();
    const auto ic = ids.to(torch::kLong).contiguous();
    const c10::BFloat16* xp = xc.data_ptr<c10::BFloat16>();
    const c10::BFloat16* wp = w.data_ptr<c10::BFloat16>();
    const auto xrow = [xp, K](int64_t r) { return xp + r * K; };
    const auto [first, order] = by_expert(ic.data_ptr<int64_t>(), B * C, E);
    const auto xs = rows_in_order(xrow, order, C, X);
    const int64_t blocks = N / TILE_ROWS;
    Output y({B, C, N}, x);
#ifdef MK_AMX
    if (B >= 2 && amx_ready()) {
        const auto [groups, pairs] = amx_groups(E, K, first, xs);
        const int64_t quads = (blocks + 3) / 4;  // work items: (group, 4 blocks)
        at::parallel_for(0, (int64_t)groups.size() * quads, 1, [&](int64_t begin, int64_t end) {
            amx_configure();
            float* rows[AMX_ROWS];
            for (int64_t i = begin; i < end; ++i) {
                const AmxGroup& g = groups[i / quads];
                const int64_t q = i % quads, T = std::min<int64_t>(4, blocks - q * 4);
                for (int64_t r = 0; r < g.R; ++r) rows[r] = y.data + order[g.j0 + r] * N + q * 4 * TILE_ROWS;
                amx_tiles_into(wp + (g.e * N + q * 4 * TILE_ROWS) * K, K, pairs.data() + g.at, T, rows, g.R);
            }
            _tile_release();
        });
        return y.finish();
    }
#endif
    const int64_t P = B * C, duos = (blocks + 1) / 2;  // work items: (pair, 2 blocks)
    at::parallel_for(0, P * duos, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const int64_t j = i / duos, b0 = (i % duos) * 2, e = ic.data_ptr<int64_t>()[order[j]];
            tiles_row(wp + e * N * K, K, xs[j], b0, std::min(blocks, b0 + 2), y.data + order[j] * N);
        }
    });
    return y.finish();
}

// q8_0 weights: w [N, nb * 34] (one projection) or [E, N, nb * 34] (stacked experts), uint8.
torch::Tensor rows_q8(torch::Tensor x, torch::Tensor w, bool grouped) {
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.scalar_type() == torch::kByte && w.size(1) % 34 == 0,
                "rows_q8: x [M, K], w uint8 [N, nb * 34]");
    const int64_t M = x.size(0), N = w.size(0), nb = w.size(1) / 34;
    const auto xq = q16_rows(float_rows(x, nb * 32).data, M, nb);
    auto wc = w.contiguous();
    Output y({M, N}, x);
    const uint8_t* wp = wc.data_ptr<uint8_t>();
    rows_loop<0>(y.data, M, N, nb * 34, [&](int64_t m) { return xq.row(m, nb); },
              [&](int64_t n, const Q16Row* xs, int64_t R, float* out) { q8_dots(wp + n * nb * 34, xs, R, nb, out); },
              [&](int64_t n, Q16Row x1, float* out) { q8_group(wp + n * nb * 34, nb * 34, x1, nb, out); },
              [](int64_t, const Q16Row*, int64_t, float*) {}, grouped);
    return y.finish();
}

torch::Tensor experts_q8(torch::Tensor x, torch::Tensor w, torch::Tensor ids, bool grouped) {
    TORCH_CHECK(x.dim() == 3 && w.dim() == 3 && ids.dim() == 2 && w.scalar_type() == torch::kByte && w.size(2) % 34 == 0,
                "experts_q8: x [B, X, K], w uint8 [E, N, nb * 34], ids [B, C]");
    const int64_t B = x.size(0), X = x.size(1), E = w.size(0), N = w.size(1), nb = w.size(2) / 34, C = ids.size(1);
    TORCH_CHECK(X == 1 || X == C, "experts_q8: x holds one row per token or one per choice");
    const auto xq = q16_rows(float_rows(x, nb * 32).data, B * X, nb);
    auto wc = w.contiguous();
    auto ic = ids.to(torch::kLong).contiguous();
    Output y({B, C, N}, x);
    const uint8_t* wp = wc.data_ptr<uint8_t>();
    experts_loop<0>(ic.data_ptr<int64_t>(), y.data, B, X, C, E, N, [&](int64_t r) { return xq.row(r, nb); },
                 [&](int64_t e, int64_t n, const Q16Row* xs, int64_t R, float* out) {
                     q8_dots(wp + (e * N + n) * nb * 34, xs, R, nb, out); },
                 [&](int64_t e, int64_t n, Q16Row x1, float* out) { q8_group(wp + (e * N + n) * nb * 34, nb * 34, x1, nb, out); },
                 [](int64_t, int64_t, const Q16Row*, int64_t, float*) {}, grouped);
    return y.finish();
}

// The index of a row's largest value as torch.argmax gives it: the first of equal maxima, or the
// first NaN where the row holds one (argmax ranks NaN above everything). ATen's argmax over a row
// is a scalar loop (~30 µs for a 32k vocabulary here, ~60 at 2 threads: a greedy token's cost);
// this is two vector passes, the max and then its first lane.
static int64_t first_max(const float* x, int64_t V) {
    float best = -INFINITY;
    unsigned nan = 0;
    int64_t k = 0;
#ifdef MK_WIDE
    constexpr int L = MK_WIDE;
    VF m = vset(-INFINITY);
    for (; k + L <= V; k += L) {
        const VF v = vload(x + k);
        nan |= lanes_nan(v);
        m = vmax(m, v);
    }
    best = vhmax(m);
#endif
    for (; k < V; ++k) {
        if (std::isnan(x[k])) nan = 1;
        else if (x[k] > best) best = x[k];
    }
    if (nan)
        for (int64_t i = 0; i < V; ++i)
            if (std::isnan(x[i])) return i;
    k = 0;
#ifdef MK_WIDE
    const VF b = vset(best);
    for (; k + L <= V; k += L) {
        const unsigned hit = lanes_equal(vload(x + k), b);
        if (hit) return k + __builtin_ctz(hit);
    }
#endif
    for (; k < V; ++k)
        if (x[k] == best) return k;
    return 0;  // unreachable: best is one of the row's values
}

torch::Tensor rows_argmax(torch::Tensor x) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.size(1) > 0, "rows_argmax: x float32 [M, V], V > 0");
    const auto xc = x.contiguous();
    const int64_t M = xc.size(0), V = xc.size(1);
    auto out = torch::empty({M}, xc.options().dtype(torch::kLong));
    const float* xp = xc.data_ptr<float>();
    int64_t* o = out.data_ptr<int64_t>();
    for (int64_t r = 0; r < M; ++r) o[r] = first_max(xp + r * V, V);
    return out;
}

// out [C, R] fp32 = src [R, C] (fp32 or bf16, contiguous) transposed: how the expert store lays a
// missed expert's Hub weight out for products on the transposed layout. Rows are read as vectors
// into an L x L tile and its columns written out as vectors, L output rows at a time, so each
// write moves a whole cache line; where out's rows are aligned, with streaming stores, which do
// not first read the lines they overwrite (a slot is cold: a miss's stall per token 1.07 against
// 1.38 ms with plain stores, in the store's worst case on the ~140M checkpoint, measured). A
// strided ATen copy of a bf16 [1024, 512] took 0.56 ms on one core here, the tiles 0.16 (warm).
// Exact: a bf16 widens to fp32 without rounding.
template <typename S>
static void transpose_to_float(const S* s, float* d, int64_t R, int64_t C) {
    int64_t Rv = 0, Cv = 0;
#ifdef MK_WIDE
    constexpr int L = MK_WIDE;
    alignas(64) float tile[L][L];
    Rv = R - R % L;
    Cv = C - C % L;
    const bool stream = R % L == 0 && reinterpret_cast<uintptr_t>(d) % (L * sizeof(float)) == 0;
    for (int64_t c0 = 0; c0 < Cv; c0 += L)
        for (int64_t r0 = 0; r0 < Rv; r0 += L) {
            for (int i = 0; i < L; ++i) vstore(tile[i], vload(s + (r0 + i) * C + c0));
            if (stream)
                for (int j = 0; j < L; ++j) vstream(d + (c0 + j) * R + r0, vcolumn(&tile[0][j]));
            else
                for (int j = 0; j < L; ++j) vstore(d + (c0 + j) * R + r0, vcolumn(&tile[0][j]));
        }
    if (stream) _mm_sfence();  // the streamed lines are visible before the products read them
#endif
    for (int64_t c = 0; c < C; ++c)  // the edges the tiles left: the last rows, then the last columns
        for (int64_t r = c < Cv ? Rv : 0; r < R; ++r) d[c * R + r] = static_cast<float>(s[r * C + c]);
}

void transpose_into(torch::Tensor src, torch::Tensor out) {
    TORCH_CHECK(src.dim() == 2 && src.is_contiguous() && (src.scalar_type() == torch::kFloat || src.scalar_type() == torch::kBFloat16),
                "transpose_into: src a contiguous fp32 or bf16 [R, C]");
    TORCH_CHECK(out.scalar_type() == torch::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == src.size(1) && out.size(1) == src.size(0),
                "transpose_into: out a contiguous fp32 [C, R]");
    if (src.scalar_type() == torch::kFloat) transpose_to_float(src.data_ptr<float>(), out.data_ptr<float>(), src.size(0), src.size(1));
    else transpose_to_float(reinterpret_cast<const c10::BFloat16*>(src.data_ptr()), out.data_ptr<float>(), src.size(0), src.size(1));
}

#if MK_WIDE == 16
// e^x for x <= 0, 16 lanes: x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor polynomial to r^7
// (relative error ~1e-7), times 2^n by scalef; -inf gives 0, and x below -88 gives e^-88.
static inline VF vexp_neg(VF x) {
    const __mmask16 finite = _mm512_cmp_ps_mask(x, vset(-INFINITY), _CMP_NEQ_UQ);
    x = _mm512_max_ps(x, vset(-88.f));
    const VF n = _mm512_roundscale_ps(_mm512_mul_ps(x, vset(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    VF r = _mm512_fnmadd_ps(n, vset(0.693359375f), x);  // ln2 in two parts: n · ln2 exact enough
    r = _mm512_fnmadd_ps(n, vset(-2.12194440e-4f), r);
    VF p = vset(1.f / 5040);
    for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = vfma(p, r, vset(c));
    return _mm512_maskz_mov_ps(finite, _mm512_scalef_ps(p, n));
}
#endif

// One head's attention over the cache at decode, a task on the thread pool (latent_attend: MLA's
// heads, the keys and values one latent cache; attend: grouped-query heads): the scores
// query · keys over the visible positions, their softmax, and Σ_s p_s · values[s, :R]. Inductor's
// fused loops for the same ran on one thread (a perf profile of deepseek_v3-1b's bf16 step: 1.5 µs
// per cached position per layer). Scores are taken 8 positions at a time (each chunk of the query
// loaded once for 8 rows, 8 independent chains), the exponentials 16 lanes at a time with AVX-512
// (the two: 55 against 68 µs for 16 heads over 300 positions, 2 threads), and the weighted sum keeps up
// to 8 vectors of the output in registers across the positions; a masked position is skipped.
// keys and values: rows a stride of ss apart, one per position.
template <typename W>
static void attend_head(const float* q, const W* keys, const W* values, int64_t ss, const bool* vis, int64_t S,
                        int64_t C, int64_t R, float scale, float* out, float* p) {
    int64_t s = 0;
#ifdef MK_WIDE
    constexpr int L = MK_WIDE, P = 8;
    for (; s + P <= S; s += P) {
        VF a[P];
        for (int i = 0; i < P; ++i) a[i] = vzero();
        int64_t k = 0;
        for (; k + L <= C; k += L) {
            const VF qk = vload(q + k);
            for (int i = 0; i < P; ++i) a[i] = vfma(vload(keys + (s + i) * ss + k), qk, a[i]);
        }
        for (int i = 0; i < P; ++i) {
            float acc = vsum(a[i]);
            for (int64_t j = k; j < C; ++j) acc += static_cast<float>(keys[(s + i) * ss + j]) * q[j];
            p[s + i] = acc;
        }
    }
#endif
    for (; s < S; ++s) p[s] = dot(keys + s * ss, q, C);
    float top = -INFINITY;
    for (s = 0; s < S; ++s) {
        p[s] = vis[s] ? p[s] * scale : -INFINITY;
        top = std::max(top, p[s]);
    }
    float sum = 0.f;
    s = 0;
#if MK_WIDE == 16
    VF total = vzero();
    for (; s + L <= S; s += L) {  // a masked position's -inf: 0
        const VF e = vexp_neg(_mm512_sub_ps(vload(p + s), vset(top)));
        vstore(p + s, e);
        total = vadd(total, e);
    }
    sum = vsum(total);
#endif
    for (; s < S; ++s) {
        p[s] = vis[s] ? std::exp(p[s] - top) : 0.f;
        sum += p[s];
    }
    const float inv = 1.f / sum;  // a decode row sees its own position: sum >= 1
    for (s = 0; s < S; ++s) p[s] *= inv;
    int64_t k = 0;
#ifdef MK_WIDE
    constexpr int V = 8;
    while (k + L <= R) {
        const int n = static_cast<int>(std::min<int64_t>(V, (R - k) / L));  // vectors in this chunk
        VF acc[V];
        for (int j = 0; j < V; ++j) acc[j] = vzero();
        for (s = 0; s < S; ++s) {
            if (!vis[s]) continue;
            const VF ps = vset(p[s]);
            const W* row = values + s * ss + k;
            if (n == V)  // a full chunk: a loop of constant length, unrolled
                for (int j = 0; j < V; ++j) acc[j] = vfma(ps, vload(row + j * L), acc[j]);
            else
                for (int j = 0; j < n; ++j) acc[j] = vfma(ps, vload(row + j * L), acc[j]);
        }
        for (int j = 0; j < n; ++j) vstore(out + k + j * L, acc[j]);
        k += n * L;
    }
#endif
    for (; k < R; ++k) {
        float acc = 0.f;
        for (s = 0; s < S; ++s)
            if (vis[s]) acc += p[s] * static_cast<float>(values[s * ss + k]);
        out[k] = acc;
    }
}

// query [B, H, C] fp32, cached [B, S, C'] fp32 or bf16 (C' >= C; the cache stack read in place: any
// row strides, positions contiguous), visible [B, S] bool → [B, H, R] fp32 (R <= C).
torch::Tensor latent_attend(torch::Tensor query, torch::Tensor cached, torch::Tensor visible, double scale, int64_t R) {
    TORCH_CHECK(query.dim() == 3 && query.scalar_type() == torch::kFloat, "latent_attend: query fp32 [B, H, C]");
    TORCH_CHECK(cached.dim() == 3 && cached.size(0) == query.size(0) && cached.size(2) >= query.size(2) && cached.stride(2) == 1
                && (cached.scalar_type() == torch::kFloat || cached.scalar_type() == torch::kBFloat16),
                "latent_attend: cached fp32 or bf16 [B, S, C], its last dim contiguous");
    TORCH_CHECK(visible.dim() == 2 && visible.size(0) == query.size(0) && visible.size(1) == cached.size(1)
                && visible.scalar_type() == torch::kBool, "latent_attend: visible bool [B, S]");
    TORCH_CHECK(R > 0 && R <= query.size(2), "latent_attend: 0 < r <= C");
    const int64_t B = query.size(0), H = query.size(1), C = query.size(2), S = cached.size(1);
    const auto qc = query.contiguous();
    const auto vc = visible.contiguous();
    auto out = torch::empty({B, H, R}, query.options());
    const float* q = qc.data_ptr<float>();
    const bool* vis = vc.data_ptr<bool>();
    float* o = out.data_ptr<float>();
    const int64_t sb = cached.stride(0), ss = cached.stride(1);
    const bool bf16 = cached.scalar_type() == torch::kBFloat16;
    const void* base = cached.data_ptr();
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> p(S);
        for (int64_t i = begin; i < end; ++i) {
            const int64_t b = i / H;
            if (bf16) {
                const auto* row = static_cast<const c10::BFloat16*>(base) + b * sb;
                attend_head(q + i * C, row, row, ss, vis + b * S, S, C, R, float(scale), o + i * R, p.data());
            } else {
                const auto* row = static_cast<const float*>(base) + b * sb;
                attend_head(q + i * C, row, row, ss, vis + b * S, S, C, R, float(scale), o + i * R, p.data());
            }
        }
    });
    return out;
}

// Grouped-query attention at decode, the cache read in place: query [B, Hkv, G, D] fp32, keys and
// values [B, Hkv, S, D] fp32 or bf16 (views of the cache stack: the same strides, D contiguous),
// allowed [B, S] bool → [B, Hkv, G, D] fp32, softmax(q . keys * scale) . values over the allowed
// positions; one (row, query head) a task, as latent_attend. In the graph the same was a bf16
// cache widened to fp32 copies (keys and values, every layer, every step: growing with the
// context), two batched matmuls and a softmax, ~90 µs a layer for a bf16 batch of 8 at 40 positions.
torch::Tensor attend(torch::Tensor query, torch::Tensor keys, torch::Tensor values, torch::Tensor allowed, double scale) {
    TORCH_CHECK(query.dim() == 4 && query.scalar_type() == torch::kFloat, "attend: query fp32 [B, Hkv, G, D]");
    TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes() && keys.strides() == values.strides()
                && keys.scalar_type() == values.scalar_type() && keys.stride(3) == 1
                && (keys.scalar_type() == torch::kFloat || keys.scalar_type() == torch::kBFloat16),
                "attend: keys and values fp32 or bf16 [B, Hkv, S, D] alike, D contiguous");
    const int64_t B = query.size(0), Hkv = query.size(1), G = query.size(2), D = query.size(3), S = keys.size(2);
    TORCH_CHECK(keys.size(0) == B && keys.size(1) == Hkv && keys.size(3) == D, "attend: keys [B, Hkv, S, D] for query [B, Hkv, G, D]");
    TORCH_CHECK(allowed.dim() == 2 && allowed.size(0) == B && allowed.size(1) == S && allowed.scalar_type() == torch::kBool,
                "attend: allowed bool [B, S]");
    const auto qc = query.contiguous();
    const auto ac = allowed.contiguous();
    auto out = torch::empty({B, Hkv, G, D}, query.options());
    const float* q = qc.data_ptr<float>();
    const bool* vis = ac.data_ptr<bool>();
    float* o = out.data_ptr<float>();
    const int64_t sb = keys.stride(0), sh = keys.stride(1), ss = keys.stride(2);
    const bool bf16 = keys.scalar_type() == torch::kBFloat16;
    const void* kp = keys.data_ptr();
    const void* vp = values.data_ptr();
    at::parallel_for(0, B * Hkv * G, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> p(S);
        for (int64_t i = begin; i < end; ++i) {
            const int64_t b = i / (Hkv * G), at = b * sb + (i / G % Hkv) * sh;
            if (bf16)
                attend_head(q + i * D, static_cast<const c10::BFloat16*>(kp) + at, static_cast<const c10::BFloat16*>(vp) + at,
                            ss, vis + b * S, S, D, D, float(scale), o + i * D, p.data());
            else
                attend_head(q + i * D, static_cast<const float*>(kp) + at, static_cast<const float*>(vp) + at,
                            ss, vis + b * S, S, D, D, float(scale), o + i * D, p.data());
        }
    });
    return out;
}

// Whether a batch's bf16 products run on AMX tiles here (built with them, and the OS grants them).
bool bf16_tiles() {
#ifdef MK_AMX
    return amx_ready();
#else
    return false;
#endif
}

// The names end in the build's suffix (@S@: "" or "_avx2", filled in by _build): Inductor names a
// custom operator's C entry point after the operator alone, so two builds need two names.

TORCH_LIBRARY(moekit, m) {
    m.def("rows_gemv@S@(Tensor x, Tensor w, bool grouped=False) -> Tensor");
    m.def("experts_gemv@S@(Tensor x, Tensor w, Tensor ids, bool grouped=False) -> Tensor");
    m.def("rows_q8@S@(Tensor x, Tensor w, bool grouped=False) -> Tensor");
    m.def("experts_q8@S@(Tensor x, Tensor w, Tensor ids, bool grouped=False) -> Tensor");
    m.def("rows_argmax@S@(Tensor x) -> Tensor");
    m.def("bf16_tiles@S@() -> bool", &bf16_tiles);  // no tensor to dispatch on: one kernel for all
    m.def("transpose_into@S@(Tensor src, Tensor(a!) out) -> ()");
    m.def("latent_attend@S@(Tensor query, Tensor cached, Tensor visible, float scale, int r) -> Tensor");
    m.def("attend@S@(Tensor query, Tensor keys, Tensor values, Tensor allowed, float scale) -> Tensor");
    m.def("rows_tiles@S@(Tensor x, Tensor w) -> Tensor");
    m.def("experts_tiles@S@(Tensor x, Tensor w, Tensor ids) -> Tensor");
}
TORCH_LIBRARY_IMPL(moekit, CPU, m) {
    m.impl("rows_gemv@S@", &rows_gemv);
    m.impl("experts_gemv@S@", &experts_gemv);
    m.impl("rows_q8@S@", &rows_q8);
    m.impl("experts_q8@S@", &experts_q8);
    m.impl("rows_argmax@S@", &rows_argmax);
    m.impl("transpose_into@S@", &transpose_into);
    m.impl("latent_attend@S@", &latent_attend);
    m.impl("attend@S@", &attend);
    m.impl("rows_tiles@S@", &rows_tiles);
    m.impl("experts_tiles@S@", &experts_tiles);
}

// C entry points for the compiled step's generated C++ (Inductor's cpp_wrapper, told of them by
// c_shims()): without them it calls each operator through the boxed dispatcher, ~1.8 µs more a
// call (measured), 41 calls a step on the ~140M qwen3_moe.
static const torch::Tensor& held(AtenTensorHandle h) { return *torch::aot_inductor::tensor_handle_to_tensor_pointer(h); }
#define MK_RETURN(expr) AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({ *ret0 = torch::aot_inductor::new_tensor_handle(expr); })
extern "C" {
AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_rows_gemv@S@(AtenTensorHandle x, AtenTensorHandle w, int32_t grouped, AtenTensorHandle* ret0) {
    MK_RETURN(rows_gemv(held(x), held(w), grouped != 0))
}
AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_experts_gemv@S@(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle ids, int32_t grouped, AtenTensorHandle* ret0) {
    MK_RETURN(experts_gemv(held(x), held(w), held(ids), grouped != 0))
}
AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_rows_q8@S@(AtenTensorHandle x, AtenTensorHandle w, int32_t grouped, AtenTensorHandle* ret0) {
    MK_RETURN(rows_q8(held(x), held(w), grouped != 0))
}
AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_experts_q8@S@(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle ids, int32_t grouped, AtenTensorHandle* ret0) {
    MK_RETURN(experts_q8(held(x), held(w), held(ids), grouped != 0))
}
AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_latent_attend@S@(AtenTensorHandle query, AtenTensorHandle cached, AtenTensorHandle visible, double scale, int64_t r, AtenTensorHandle* ret0) {
    MK_RETURN(latent_attend(held(query), held(cached), held(visible), scale, r))
}
AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_attend@S@(AtenTensorHandle query, AtenTensorHandle keys, AtenTensorHandle values, AtenTensorHandle allowed, double scale, AtenTensorHandle* ret0) {
    MK_RETURN(attend(held(query), held(keys), held(values), held(allowed), scale))
}
AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_rows_tiles@S@(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret0) {
    MK_RETURN(rows_tiles(held(x), held(w)))
}
AOTI_TORCH_EXPORT AOTITorchError aoti_torch_cpu_experts_tiles@S@(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle ids, AtenTensorHandle* ret0) {
    MK_RETURN(experts_tiles(held(x), held(w), held(ids)))
}
}
"""

_STATUS: dict[str, str] = {}
NARROW = "moekit_avx2"  # the same operators built for AVX2 only, beside the AVX-512 build


@lru_cache(maxsize=1)
def operators():
    """torch.ops.moekit once the operators are built and registered, else None (see `status`).
    On an AVX-512 machine the same source is built a second time for AVX2 only, as torch.ops.moekit_avx2
    (`namespaces()`): on an AMD EPYC (Zen 4) those kernels streamed a weight ~20% faster (fp32: 28
    against 23 GB/s, 2 threads), on an Intel Xeon the AVX-512 ones were faster; `variant` measures."""
    try:
        _build("moekit", [])
    except Exception as err:  # a missing compiler or headers: the compiled step keeps its reductions
        _STATUS["gemv"] = f"the gemv operators could not be built ({type(err).__name__}: {str(err)[:120]})"
        return None
    if torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        try:
            _build(NARROW, ["-mno-avx512f"])
        except Exception as err:  # the AVX-512 build serves alone
            _STATUS["narrow"] = f"the AVX2 build failed ({type(err).__name__}: {str(err)[:120]})"
    return torch.ops.moekit


def _build(namespace: str, flags: list[str]) -> None:
    from torch.utils.cpp_extension import load_inline

    source = _SOURCE.replace("TORCH_LIBRARY(moekit, m)", f"TORCH_LIBRARY({namespace}, m)")
    source = source.replace("TORCH_LIBRARY_IMPL(moekit,", f"TORCH_LIBRARY_IMPL({namespace},")
    source = source.replace("@S@", suffix(namespace))
    # -fopenmp at compile time only: the parallel regions bind to the OpenMP runtime torch
    # already loaded, so there is one thread pool, not two. Hidden visibility: of the two builds'
    # same-named C++ functions each library calls its own once both are global (below).
    path = load_inline(name=_library_name(namespace), cpp_sources=source, is_python_module=False,
                       extra_cflags=["-O3", "-march=native", *flags, "-fopenmp", "-fvisibility=hidden"], verbose=False)
    # Made global, so that the compiled step's generated library finds the C entry points.
    ctypes.CDLL(path, mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
    _register_shapes(namespace)


def _library_name(namespace: str) -> str:
    """The name torch's extension cache keeps one build under (a new name for every change of _SOURCE)."""
    return f"{namespace}_gemv_v30"


def built_here() -> bool:
    """Whether torch's extension cache on this machine already holds this version's build, so that
    operators() loads it in a moment instead of compiling for about a minute (twice on an AVX-512
    CPU); asking builds nothing. True where that cannot be told, so that nobody is told of a build
    that does not come."""
    try:
        from torch.utils.cpp_extension import _get_build_directory  # the folder load_inline builds in

        name = _library_name("moekit")
        return (Path(_get_build_directory(name, verbose=False)) / f"{name}.so").exists()
    except Exception:  # a torch that keeps its builds elsewhere
        return True


def suffix(namespace: str) -> str:
    """What the operator names of one build end in: "" for moekit, "_avx2" for moekit_avx2."""
    return "" if namespace == "moekit" else "_" + namespace.removeprefix("moekit_")


OPERATORS = ("rows_gemv", "experts_gemv", "rows_q8", "experts_q8", "rows_argmax", "transpose_into", "latent_attend", "attend",
             "rows_tiles", "experts_tiles")  # their plain names


def op(namespace: str, name: str):
    """One build's operator by its plain name (OPERATORS): torch.ops.moekit.rows_gemv,
    torch.ops.moekit_avx2.rows_gemv_avx2, ..."""
    return getattr(getattr(torch.ops, namespace), name + suffix(namespace))


# The operators the compiled step calls, with the arguments of their C entry points.
_C_ARGS = {
    "rows_gemv": "AtenTensorHandle x, AtenTensorHandle w, int32_t grouped",
    "experts_gemv": "AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle ids, int32_t grouped",
    "rows_q8": "AtenTensorHandle x, AtenTensorHandle w, int32_t grouped",
    "experts_q8": "AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle ids, int32_t grouped",
    "latent_attend": "AtenTensorHandle query, AtenTensorHandle cached, AtenTensorHandle visible, double scale, int64_t r",
    "attend": "AtenTensorHandle query, AtenTensorHandle keys, AtenTensorHandle values, AtenTensorHandle allowed, double scale",
    "rows_tiles": "AtenTensorHandle x, AtenTensorHandle w",
    "experts_tiles": "AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle ids",
}


def c_shims() -> dict:
    """Inductor's aot_inductor.custom_ops_to_c_shims for the built operators: each one → the
    declaration of its C entry point, which the generated C++ then calls directly (empty where the
    operators are not built)."""
    return {op(space, name).default: [f"AOTITorchError aoti_torch_cpu_{name}{suffix(space)}({args}, AtenTensorHandle* ret0)"]
            for space in namespaces() for name, args in _C_ARGS.items()}


def namespaces() -> tuple[str, ...]:
    """The torch.ops namespaces the operators are built under here (none where they cannot be)."""
    if operators() is None:
        return ()
    return tuple(space for space in ("moekit", NARROW) if hasattr(getattr(torch.ops, space), "rows_gemv" + suffix(space)))


def _register_shapes(namespace: str) -> None:
    """Shape functions, so that torch.compile can trace through the operators."""

    def rows(x, w, grouped=False):  # [M, K] · [N, K (or nb · 34 bytes)] → [M, N]
        return x.new_empty((x.shape[0], w.shape[0]))

    def experts(x, w, ids, grouped=False):  # [B, X, K] · [E, N, ...] at ids [B, C] → [B, C, N]
        return x.new_empty((x.shape[0], ids.shape[1], w.shape[1]))

    end = suffix(namespace)
    for name, shape in (("rows_gemv", rows), ("experts_gemv", experts), ("rows_q8", rows), ("experts_q8", experts)):
        torch.library.register_fake(f"{namespace}::{name}{end}")(shape)
    torch.library.register_fake(f"{namespace}::rows_argmax{end}")(lambda x: x.new_empty((x.shape[0],), dtype=torch.int64))
    torch.library.register_fake(f"{namespace}::attend{end}")(lambda query, keys, values, allowed, scale: torch.empty_like(query))
    torch.library.register_fake(f"{namespace}::latent_attend{end}")(
        lambda query, cached, visible, scale, r: query.new_empty((query.shape[0], query.shape[1], r)))
    torch.library.register_fake(f"{namespace}::rows_tiles{end}")(lambda x, w: rows(x, w))
    torch.library.register_fake(f"{namespace}::experts_tiles{end}")(lambda x, w, ids: experts(x, w, ids))


def rows_argmax(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax(logits, dim=-1), the same indices (the first of equal maxima, the first NaN),
    for fp32 [B, V] CPU logits: by moekit::rows_argmax where this process has the operators
    registered (a compiled step or int8 weights build them; an eager engine never builds them for
    this), else by torch. Greedy decoding's token: 3.6 against 33 µs for one row of 32k here (measured)."""
    if (logits.dim() == 2 and logits.dtype == torch.float32 and logits.device.type == "cpu"
            and not logits.requires_grad and hasattr(torch.ops.moekit, "rows_argmax")):
        return op("moekit", "rows_argmax")(logits)
    return logits.argmax(dim=-1)


def is_transpose(view: torch.Tensor) -> bool:
    """Whether view is a contiguous matrix's transpose (what moekit::transpose_into writes out)."""
    return view.dim() == 2 and view.stride() == (1, view.shape[0])


def copy_into(out: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """out.copy_(view), the same values; where view is a contiguous fp32 or bf16 matrix's
    transpose, out is fp32 and contiguous and this process has the operators registered, by
    moekit::transpose_into (a bf16 [1024, 512] widened and transposed in 0.16 against 0.56 ms on
    one core here, measured; in tiles, with streaming stores where aligned)."""
    if (is_transpose(view) and view.dtype in (torch.float32, torch.bfloat16)
            and out.dtype == torch.float32 and out.shape == view.shape and out.is_contiguous()
            and view.device.type == out.device.type == "cpu" and hasattr(torch.ops.moekit, "transpose_into")):
        op("moekit", "transpose_into")(view.t(), out)
        return out
    return out.copy_(view)


TILE_ROWS, TILE_COLS = 16, 32  # a tile: 16 weight rows x 32 inputs (the C++ TILE_ROWS, TILE_COLS)


def tiles_fit(weight: torch.Tensor) -> bool:
    """Whether a Hub weight [out, in] (or a stack [E, out, in]) can be laid out in tiles: bf16, on
    the CPU, out a multiple of 16 and in of 32."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() in (2, 3)
            and weight.shape[-2] % TILE_ROWS == 0 and weight.shape[-1] % TILE_COLS == 0)


def to_tiles(weight: torch.Tensor) -> torch.Tensor:
    """A Hub weight [.., N, K] in the tiles layout moekit::rows_tiles / experts_tiles read: the same
    shape and values, each block of 16 rows stored as its K / 32 tiles of 16 rows x 32 inputs."""
    *lead, n, k = weight.shape
    blocks = weight.reshape(*lead, n // TILE_ROWS, TILE_ROWS, k // TILE_COLS, TILE_COLS)
    return blocks.transpose(-3, -2).contiguous().view(weight.shape)


def from_tiles(tiled: torch.Tensor) -> torch.Tensor:
    """The Hub weight back from to_tiles' layout, exactly."""
    *lead, n, k = tiled.shape
    blocks = tiled.reshape(*lead, n // TILE_ROWS, k // TILE_COLS, TILE_ROWS, TILE_COLS)
    return blocks.transpose(-3, -2).contiguous().view(tiled.shape)


def tiles_ready() -> bool:
    """Whether bf16 weights should be laid out in tiles here: the operators are built (this builds
    them) and the AVX-512 build's batch products run on AMX tiles (where tiles measured faster, see
    rows_tiles). The tiles operators are always that build's."""
    return "moekit" in namespaces() and bool(op("moekit", "bf16_tiles")())


def status() -> str:
    return _STATUS.get("gemv", "built")


KINDS = ("float32", "bfloat16", "q8_0")
PROBE_BYTES = 128 << 20  # past the last-level cache of the machines measured (32 MB on the AMD EPYC)
PROBE_EXPERTS, PROBE_CHOSEN = 32, 4  # a stack's experts, and those one row's call reads
BF16_MARGIN = 0.2  # past the probe's spread between processes for bf16 here (up to 16%, measured)


@dataclass(frozen=True)
class Variant:
    """Which build of the operators (a torch.ops namespace) runs one kind of weight, and whether its
    one-row products take the weight rows in groups."""

    namespace: str = "moekit"
    grouped: bool = False

    @property
    def label(self) -> str:
        return self.namespace + (", grouped" if self.grouped else "")


def kind_of(weight: torch.Tensor) -> str:
    """The operators' name for a weight's kind: its dtype, or "q8_0" for the uint8 blocks."""
    return "q8_0" if weight.dtype == torch.uint8 else str(weight.dtype).removeprefix("torch.")


@lru_cache(maxsize=None)
def variant(kind: str) -> Variant:
    """The fastest Variant here for one-row products on this kind of weight (KINDS): each build
    (`namespaces()`), rows grouped or not, timed on what a decode step does most: one row's 4 chosen
    experts of 32 read from distinct stacks of this kind (_probe, PROBE_BYTES in all, so from memory),
    7 alternating rounds after one to warm up, at the current thread count; measured once per process.
    The variants differ only in the order a row's vector lanes are summed (AVX2 8 lanes, AVX-512 16),
    and one process uses one variant per kind throughout, so within a process the choice is speed
    alone. The default Variant where the operators are not built or the kind is not theirs.
    Why experts, not one large weight: on the AMD EPYC (Zen 4) a single 128 MB weight had the two
    builds within noise, and the choice flipped from process to process (bf16 took the AVX2 build in
    6 of 8 processes, fp32 the AVX-512 one in 2 of 8), while inside a compiled step the AVX-512
    build's bf16 step was 11% faster and its fp32 step 22-28% slower (qwen3_moe-150m, one process,
    alternating). With the experts probe fp32 took the AVX2 build in 10 of 10 processes (17-27%
    faster there), as the step wants; bf16 still swung (the AVX2 build 16% faster to 4% slower on
    the probe). So for bf16 the build that multiplies bf16 pairs (AVX512-BF16, the default build on
    such a CPU) is kept unless another variant beats it on the probe by more than BF16_MARGIN."""
    spaces = namespaces()
    if not spaces or kind not in KINDS:
        return Variant()
    x, stacks, chosen = _probe(kind)
    candidates = [Variant(space, way) for space in spaces for way in (False, True)]
    name = "experts_q8" if kind == "q8_0" else "experts_gemv"

    def run(v: Variant) -> None:
        product = op(v.namespace, name)
        for stack in stacks:
            for ids in chosen:
                product(x, stack, ids, v.grouped)

    median = _alternating_medians({v: (lambda v=v: run(v)) for v in candidates}, rounds=8)
    best = min(candidates, key=median.get)
    if kind == "bfloat16" and torch.cpu._is_avx512_bf16_supported() and median[best] * (1 + BF16_MARGIN) > median[Variant()]:
        return Variant()
    return best


BATCH_PROBE_ROWS = 8  # the batch the targets name
WIDEN_MARGIN = 0.1  # a batch's bf16 products are widened only where that is clearly faster


@lru_cache(maxsize=None)
def widen_batch(kind: str) -> bool:
    """Whether a batch's products on bf16 weights run faster here with the batch's rows widened to
    fp32 (fp32 FMAs on the widened weight) than as bf16 pairs (AVX512-BF16): both timed with the
    chosen build's rows_gemv on BATCH_PROBE_ROWS rows against distinct [2048, 512] bf16 weights,
    PROBE_BYTES in all (from memory), alternating, once per process; widening must win by
    WIDEN_MARGIN. Measured on an Intel Xeon (2 threads, 64 MB of weights, 8 rows): 4.0 ms widened
    against 7.2 ms in pairs, while in cache both multiplied ~70 G MAC/s, and at one row the pairs
    were as fast or faster. False for other kinds, or where the operators are not built."""
    if kind != "bfloat16" or not namespaces():
        return False
    width = 512
    weights = _distinct(torch.full((4 * width, width), 0.01, dtype=torch.bfloat16))
    rows = op(variant(kind).namespace, "rows_gemv")

    def run(x: torch.Tensor) -> None:
        for w in weights:
            rows(x, w, False)

    pairs, widened = torch.full((BATCH_PROBE_ROWS, width), 0.5, dtype=torch.bfloat16), torch.full((BATCH_PROBE_ROWS, width), 0.5)
    median = _alternating_medians({"pairs": lambda: run(pairs), "widened": lambda: run(widened)}, rounds=6)
    return median["widened"] * (1 + WIDEN_MARGIN) < median["pairs"]


def _alternating_medians(sides: dict, rounds: int) -> dict:
    """name → the median seconds of its call over `rounds` rounds, the sides taking turns (a noisy
    neighbour slows all alike), the first round a warm-up left out."""
    times: dict = {name: [] for name in sides}
    for _ in range(rounds):
        for name, call in sides.items():
            began = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - began)
    return {name: statistics.median(t[1:]) for name, t in times.items()}


def _distinct(t: torch.Tensor) -> list[torch.Tensor]:
    """t and copies of it, PROBE_BYTES in all: a probe that reads them all reads from memory."""
    return [t] + [t.clone() for _ in range(max(0, PROBE_BYTES // t.nbytes - 1))]


def chosen() -> dict[str, str]:
    """kind → the Variant variant() chooses for it in this process, as "namespace" or "namespace,
    grouped": a benchmark's record of which build ran (the choice moved a step's time by 11-28%,
    measured). Empty where this process has not registered the operators (an eager engine), so
    asking never builds them."""
    if not hasattr(torch.ops.moekit, "rows_gemv"):
        return {}
    return {kind: variant(kind).label + (", batch widened to fp32" if widen_batch(kind) else "")
            + (", batch on AMX tiles" if kind == "bfloat16" and not widen_batch(kind) and bf16_tiles() else "") for kind in KINDS}


def bf16_tiles() -> bool:
    """Whether a batch's bf16 rows times bf16 weights run on AMX tiles in the build variant("bfloat16")
    chose (an AVX-512 build whose compiler and CPU have AMX-BF16, and a kernel that grants the tiles)."""
    space = variant("bfloat16").namespace
    return bool(namespaces()) and bool(op(space, "bf16_tiles")())


def _probe(kind: str, width: int = 512) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """x [1, 1, width]; distinct expert stacks [PROBE_EXPERTS, width, width] of this kind, PROBE_BYTES
    in all; and the experts the calls choose ([1, PROBE_CHOSEN] each), which read every expert of a
    stack once. Constant values: their speed is any values'."""
    if kind == "q8_0":
        from moekit.model.int8 import quantize_q8_0

        row = quantize_q8_0(torch.full((1, width), 0.01))  # [1, nb * 34]
        stack = row.expand(PROBE_EXPERTS * width, -1).reshape(PROBE_EXPERTS, width, -1).contiguous()
        x = torch.full((1, 1, width), 0.5)
    else:
        dtype = getattr(torch, kind)
        stack = torch.full((PROBE_EXPERTS, width, width), 0.01, dtype=dtype)
        x = torch.full((1, 1, width), 0.5, dtype=dtype)
    stacks = _distinct(stack)
    chosen = [torch.arange(first, first + PROBE_CHOSEN)[None] for first in range(0, PROBE_EXPERTS, PROBE_CHOSEN)]
    return x, stacks, chosen
