"""Few-row products that stream their weight at memory speed: a small C++ operator for the compiled step.

Why: at batch 1 a decode step is ~40 matrix-vector products. Inductor's reduction for
`(x[:, None, :] * W).sum(-1)` reaches memory speed in fp32 on one core but not in bf16 (measured
here: ~2.2 G weights/s either way, so bf16 moves half the bytes per second), and MKL's / oneDNN's
one-row GEMMs stay below it. These two operators read each weight row once for all M rows of x,
convert bf16 with a shift, and accumulate in fp32 with FMA over four independent chains:
  moekit::rows_gemv(x [M, K], w [N, K]) -> [M, N]                     a projection, Hub layout
  moekit::experts_gemv(x [B, X, K], w [E, N, K], ids [B, C]) -> [B, C, N]
      row b's C chosen experts, each on x[b, 0] (X = 1, gate_up) or on x[b, c] (X = C, down),
      read in place from the stacked weights (no gather copy), each chosen expert once per call
x and w are fp32 or bf16 (w's dtype decides the load; x is read as fp32); the output has x's dtype.
They are registered as dispatcher operators with shape functions, so torch.compile calls them as
extern kernels inside the compiled graph. Built once per machine with torch.utils.cpp_extension;
where no compiler is available `operators()` is None and the compiled step keeps its reductions.
tests/model/test_gemv.py holds both to F.linear on the same inputs.
"""

from __future__ import annotations

from functools import lru_cache

import torch

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MK_AVX2 1
#endif

#ifdef MK_AVX2
static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const c10::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
    return _mm_cvtss_f32(lo);
}
#endif

// One weight row of K against one x row of K floats.
template <typename W>
static inline float dot(const W* w, const float* x, int64_t K) {
    int64_t k = 0;
    float acc = 0.f;
#ifdef MK_AVX2
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
    for (; k + 32 <= K; k += 32) {
        a0 = _mm256_fmadd_ps(load8(w + k), load8(x + k), a0);
        a1 = _mm256_fmadd_ps(load8(w + k + 8), load8(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(load8(w + k + 16), load8(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(load8(w + k + 24), load8(x + k + 24), a3);
    }
    for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(load8(w + k), load8(x + k), a0);
    acc = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
    for (; k < K; ++k) acc += float(w[k]) * x[k];
    return acc;
}

template <typename W>
static void rows_kernel(const float* x, const W* w, float* y, int64_t M, int64_t N, int64_t K) {
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n)
            for (int64_t m = 0; m < M; ++m)
                y[m * N + n] = dot(w + n * K, x + m * K, K);
    });
}

torch::Tensor rows_gemv(torch::Tensor x, torch::Tensor w) {
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "rows_gemv: x [M, K], w [N, K]");
    const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
    auto xf = x.to(torch::kFloat).contiguous();
    auto wc = w.contiguous();
    auto y = torch::empty({M, N}, xf.options());
    if (wc.scalar_type() == torch::kBFloat16)
        rows_kernel(xf.data_ptr<float>(), wc.data_ptr<c10::BFloat16>(), y.data_ptr<float>(), M, N, K);
    else
        rows_kernel(xf.data_ptr<float>(), wc.data_ptr<float>(), y.data_ptr<float>(), M, N, K);
    return y.to(x.scalar_type());
}

template <typename W>
static void experts_kernel(const float* x, const W* w, const int64_t* ids, float* y,
                           int64_t B, int64_t X, int64_t C, int64_t E, int64_t N, int64_t K) {
    // The (row, choice) pairs grouped by expert: each chosen expert's weight rows are read once for
    // all the pairs that chose it (a batch reads the union of its experts, not one copy per row).
    std::vector<std::vector<int64_t>> pairs(E);
    for (int64_t bc = 0; bc < B * C; ++bc) {
        TORCH_CHECK(ids[bc] >= 0 && ids[bc] < E, "experts_gemv: expert id out of range");
        pairs[ids[bc]].push_back(bc);
    }
    // Work items are (expert, block of 16 outputs): a lone row still spreads over the threads.
    const int64_t blocks = (N + 15) / 16;
    std::vector<int64_t> items;
    for (int64_t e = 0; e < E; ++e)
        if (!pairs[e].empty())
            for (int64_t blk = 0; blk < blocks; ++blk) items.push_back(e * blocks + blk);
    at::parallel_for(0, (int64_t)items.size(), 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const int64_t e = items[i] / blocks, blk = items[i] % blocks;
            const W* we = w + e * N * K;
            const int64_t n_end = std::min(N, (blk + 1) * 16);
            for (int64_t n = blk * 16; n < n_end; ++n)
                for (const int64_t bc : pairs[e]) {
                    const int64_t b = bc / C, c = bc % C;
                    y[bc * N + n] = dot(we + n * K, x + (b * X + (X == 1 ? 0 : c)) * K, K);
                }
        }
    });
}

torch::Tensor experts_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor ids) {
    TORCH_CHECK(x.dim() == 3 && w.dim() == 3 && ids.dim() == 2 && x.size(2) == w.size(2),
                "experts_gemv: x [B, X, K], w [E, N, K], ids [B, C]");
    const int64_t B = x.size(0), X = x.size(1), K = x.size(2), E = w.size(0), N = w.size(1), C = ids.size(1);
    TORCH_CHECK(X == 1 || X == C, "experts_gemv: x holds one row per token or one per choice");
    auto xf = x.to(torch::kFloat).contiguous();
    auto wc = w.contiguous();
    auto ic = ids.to(torch::kLong).contiguous();
    auto y = torch::empty({B, C, N}, xf.options());
    if (wc.scalar_type() == torch::kBFloat16)
        experts_kernel(xf.data_ptr<float>(), wc.data_ptr<c10::BFloat16>(), ic.data_ptr<int64_t>(), y.data_ptr<float>(), B, X, C, E, N, K);
    else
        experts_kernel(xf.data_ptr<float>(), wc.data_ptr<float>(), ic.data_ptr<int64_t>(), y.data_ptr<float>(), B, X, C, E, N, K);
    return y.to(x.scalar_type());
}

TORCH_LIBRARY(moekit, m) {
    m.def("rows_gemv(Tensor x, Tensor w) -> Tensor");
    m.def("experts_gemv(Tensor x, Tensor w, Tensor ids) -> Tensor");
}
TORCH_LIBRARY_IMPL(moekit, CPU, m) {
    m.impl("rows_gemv", &rows_gemv);
    m.impl("experts_gemv", &experts_gemv);
}
"""

_STATUS: dict[str, str] = {}


@lru_cache(maxsize=1)
def operators():
    """torch.ops.moekit once the operators are built and registered, else None (see `status`)."""
    try:
        from torch.utils.cpp_extension import load_inline

        # -fopenmp at compile time only: the parallel regions bind to the OpenMP runtime torch
        # already loaded, so there is one thread pool, not two.
        load_inline(name="moekit_gemv_v2", cpp_sources=_SOURCE, is_python_module=False,
                    extra_cflags=["-O3", "-march=native", "-fopenmp"], verbose=False)
    except Exception as err:  # a missing compiler or headers: the compiled step keeps its reductions
        _STATUS["gemv"] = f"the gemv operators could not be built ({type(err).__name__}: {str(err)[:120]})"
        return None
    _register_shapes()
    return torch.ops.moekit


def _register_shapes() -> None:
    """Shape functions, so that torch.compile can trace through the operators."""

    @torch.library.register_fake("moekit::rows_gemv")
    def _rows(x, w):
        return x.new_empty((x.shape[0], w.shape[0]))

    @torch.library.register_fake("moekit::experts_gemv")
    def _experts(x, w, ids):
        return x.new_empty((x.shape[0], ids.shape[1], w.shape[1]))


def status() -> str:
    return _STATUS.get("gemv", "built")
