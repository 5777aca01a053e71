// Small operators: rows_argmax (greedy decoding's token), transpose_into (the expert store's copy).
#include "ops.h"
#include "vec.h"

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
