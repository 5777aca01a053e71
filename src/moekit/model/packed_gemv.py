"""Compiled few-row products for MXFP4 and FP8 weights that read the packed rows without expanding them.

The reference (moekit.model.packed.mxfp4_apply) writes the whole dequantized expert, then
multiplies: three passes over memory where one would do. This operator walks each output row's
blocks once: the 32 codes of a block become int8 twice their value (every FP4 value × 2 is an
integer: 0, 1, 2, 3, 4, 6, 8, 12) with one byte shuffle (AVX2; a table lookup otherwise), are
multiplied by x in fp32, and the block's sum is scaled by 2^(s − 128). Same products as the
reference, another summation order (~1e-6 relative), so it is chosen per shape by measuring
(`choose`), as int8's operator is, and tests hold it to the reference within a bound.

The FP8 operator (`fp8_gemv`) does the same for moekit.model.packed's FP8 rows: each code's value
from a 256-entry table (AVX2 gathers), summed against x per column block, times the block's scale.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional

import torch
from torch import Tensor

from moekit.model import packed as reference
from moekit.model.int8 import mean_time

GEMV_ROWS = 16  # x rows up to which the operator runs; more rows amortise a dequantized weight

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MX_AVX2 1
#endif

// FP4 E2M1 codes → twice their value, as int8 (low 8 codes positive, high 8 negative).
static const int8_t TWICE[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline float row_dot(const uint8_t* w, const float* x, int64_t groups) {
    float acc = 0.f;
#ifdef MX_AVX2
    const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(TWICE));
    const __m128i low4 = _mm_set1_epi8(0x0F);
#endif
    for (int64_t g = 0; g < groups; ++g, w += 17, x += 32) {
        const float scale = std::ldexp(1.0f, int(w[0]) - 128);  // 2^(s − 127) / 2 (codes are doubled)
#ifdef MX_AVX2
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
#ifdef MX_AVX2
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
"""

_STATUS: dict[str, str] = {}


@lru_cache(maxsize=1)
def operator():
    """The compiled operator, or None where it cannot be built (the reason is in `status`)."""
    try:
        from torch.utils.cpp_extension import load_inline

        module = load_inline(name="moekit_packed_gemv_v1", cpp_sources=_SOURCE, functions=["mxfp4_gemv", "fp8_gemv"],
                             extra_cflags=["-O3", "-march=native", "-fopenmp"], verbose=False)
    except Exception as err:  # a missing compiler or headers: fall back, and say why
        _STATUS["gemv"] = f"the MXFP4/FP8 operators could not be built ({type(err).__name__}: {str(err)[:120]})"
        return None
    return module


def status() -> str:
    return _STATUS.get("gemv", "the MXFP4/FP8 operators are built" if operator() is not None else "")


def mxfp4_gemv(x: Tensor, packed: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """x [.., in] → [.., out]: the operator on ≤ GEMV_ROWS rows, else the reference."""
    op = operator()
    x2 = x.reshape(-1, x.shape[-1])
    if op is None or x2.shape[0] > GEMV_ROWS or not packed.is_contiguous() or packed.device.type != "cpu":
        return reference.mxfp4_apply(x, packed, bias)
    y = op.mxfp4_gemv(x2.float().contiguous(), packed)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], packed.shape[0])


FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # code → value (exact)


def fp8_gemv(x: Tensor, packed: Tensor, bias: Optional[Tensor], block_in: int) -> Tensor:
    """x [.., in] → [.., out] for an FP8 prepared weight: the operator on ≤ GEMV_ROWS rows, else the reference."""
    op = operator()
    x2 = x.reshape(-1, x.shape[-1])
    if op is None or x2.shape[0] > GEMV_ROWS or not packed.is_contiguous() or packed.device.type != "cpu":
        return reference.fp8_apply(x, packed, bias, block_in)
    y = op.fp8_gemv(x2.float().contiguous(), packed, block_in, FP8_VALUES)
    if bias is not None:
        y += bias.float()
    return y.to(x.dtype).view(*x.shape[:-1], packed.shape[0])


@lru_cache(maxsize=None)
def choose(in_features: int, out_features: int, dtype: torch.dtype, block_in: int = 0) -> str:
    """'gemv' or 'reference': whichever runs one row of this shape faster here, measured once per
    process (best of three alternating rounds, so a noisy neighbour hurts both alike). block_in 0:
    MXFP4; else FP8 with column blocks that wide."""
    if operator() is None:
        return "reference"
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(min(out_features, 1024), in_features, generator=gen)
    x = torch.randn(1, in_features, generator=gen).to(dtype)
    if block_in:
        w = reference.fp8_prepare(w, block_in)
        fast, plain = (lambda: fp8_gemv(x, w, None, block_in)), (lambda: reference.fp8_apply(x, w, None, block_in))
    else:
        w = reference.mxfp4_prepare(w)
        fast, plain = (lambda: mxfp4_gemv(x, w)), (lambda: reference.mxfp4_apply(x, w))
    with torch.inference_mode():
        rounds = [(mean_time(fast), mean_time(plain)) for _ in range(3)]
    return "gemv" if min(r[0] for r in rounds) < min(r[1] for r in rounds) else "reference"
