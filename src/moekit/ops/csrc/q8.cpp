// q8_0 products: rows_q8, experts_q8 (moekit.model.int8's blocks).
#include "ops.h"
#include "rows.h"

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
