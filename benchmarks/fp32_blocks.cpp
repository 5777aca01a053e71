// fp32 batch products with the block (G weight rows x RB x rows, rows.h's dot_block) picked at run
// time, for benchmarks/fp32_blocks.py: the operators' own loops (rows_loop, experts_loop) around each
// block, built once per ISA as the operators are. Every block gives the same floats: each (weight
// row, x row) pair keeps its own chains.
#include "rows.h"

#ifndef BENCH_NAMESPACE
#define BENCH_NAMESPACE fp32_blocks
#endif

// The last `left` (< T + 1) x rows as one block of that many.
template <int G, int T>
static inline void tail(const float* w, int64_t stride, const float* const* xs, int64_t left, int64_t K, float* out,
                        int64_t ldo) {
    if constexpr (T > 0) {
        if (left == T) dot_block<G, T>(w, stride, xs, K, out, ldo);
        else tail<G, T - 1>(w, stride, xs, left, K, out, ldo);
    }
}

// R x rows against G weight rows, RB x rows a block.
template <int G, int RB>
static inline void blocks(const float* w, int64_t stride, const float* const* xs, int64_t R, int64_t K, float* out,
                          int64_t ldo) {
    int64_t r = 0;
    for (; r + RB <= R; r += RB) dot_block<G, RB>(w, stride, xs + r, K, out + r, ldo);
    tail<G, RB - 1>(w, stride, xs + r, R - r, K, out + r, ldo);
}

template <int G, int RB>
static torch::Tensor rows_with(const torch::Tensor& x, const torch::Tensor& w) {
    const int64_t M = x.size(0), N = w.size(0), K = x.size(1);
    auto y = torch::empty({M, N}, x.options());
    const float* xp = x.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    rows_loop<G>(
        y.data_ptr<float>(), M, N, K * 4, [xp, K](int64_t r) { return xp + r * K; },
        [&](int64_t n, auto xs, int64_t R, float* out) { dots(wp + n * K, xs, R, K, out); },
        [&](int64_t n, auto x1, float* out) { dot_group(wp + n * K, K, x1, K, out); },
        [&](int64_t n, auto xs, int64_t R, float* out) { blocks<G, RB>(wp + n * K, K, xs, R, K, out, R); }, false);
    return y;
}

template <int G, int RB>
static torch::Tensor experts_with(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& ids) {
    const int64_t B = x.size(0), X = x.size(1), K = x.size(2), E = w.size(0), N = w.size(1), C = ids.size(1);
    auto y = torch::empty({B, C, N}, x.options());
    const float* xp = x.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    experts_loop<G>(
        ids.data_ptr<int64_t>(), y.data_ptr<float>(), B, X, C, E, N, [xp, K](int64_t r) { return xp + r * K; },
        [&](int64_t e, int64_t n, auto xs, int64_t R, float* out) { dots(wp + (e * N + n) * K, xs, R, K, out); },
        [&](int64_t e, int64_t n, auto x1, float* out) { dot_group(wp + (e * N + n) * K, K, x1, K, out); },
        [&](int64_t e, int64_t n, auto xs, int64_t R, float* out) { blocks<G, RB>(wp + (e * N + n) * K, K, xs, R, K, out, R); },
        false);
    return y;
}

static void check(const torch::Tensor& x, const torch::Tensor& w) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat && x.is_contiguous() && w.is_contiguous(),
                "fp32_blocks: contiguous fp32 x and w");
}

#define MK_BLOCKS(F) F(1, 1) F(1, 2) F(1, 4) F(1, 6) F(1, 8) F(2, 2) F(2, 4) F(2, 8)

torch::Tensor rows(torch::Tensor x, torch::Tensor w, int64_t G, int64_t R) {
    check(x, w);
#define MK_CASE(g, r) if (G == g && R == r) return rows_with<g, r>(x, w);
    MK_BLOCKS(MK_CASE)
#undef MK_CASE
    TORCH_CHECK(false, "fp32_blocks: no block ", G, " x ", R);
}

torch::Tensor experts(torch::Tensor x, torch::Tensor w, torch::Tensor ids, int64_t G, int64_t R) {
    check(x, w);
    TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.is_contiguous(), "fp32_blocks: ids contiguous int64");
#define MK_CASE(g, r) if (G == g && R == r) return experts_with<g, r>(x, w, ids);
    MK_BLOCKS(MK_CASE)
#undef MK_CASE
    TORCH_CHECK(false, "fp32_blocks: no block ", G, " x ", R);
}

TORCH_LIBRARY(BENCH_NAMESPACE, m) {
    m.def("rows(Tensor x, Tensor w, int G, int R) -> Tensor");
    m.def("experts(Tensor x, Tensor w, Tensor ids, int G, int R) -> Tensor");
}
TORCH_LIBRARY_IMPL(BENCH_NAMESPACE, CPU, m) {
    m.impl("rows", &rows);
    m.impl("experts", &experts);
}
