// Products on MXFP4 and FP8 weights read packed, without expanding the weight (moekit.ops.packed_layout's
// layouts): mxfp4_gemv, fp8_gemv, and their stacked experts' forms (the compiled decode step's)
// experts_mxfp4, experts_fp8. Same products as the reference, another summation order. MXFP4 on
// several rows (a prompt's rows routed to one expert) expands each weight block once for several x rows.
#include "ops.h"
#include "rows.h"

// FP4 E2M1 codes → twice their value, as int8 (low 8 codes positive, high 8 negative).
static const int8_t TWICE[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// E8M0 scale byte s → 2^(s − 128): the block's scale halved, as the codes above are doubled (a table:
// std::ldexp per block was a libm call in the decode's inner loop).
static const float* half_scales() {
    static const std::vector<float> powers = [] {
        std::vector<float> v(256);
        for (int s = 0; s < 256; ++s) v[s] = std::ldexp(1.0f, s - 128);
        return v;
    }();
    return powers.data();
}

// Every MXFP4 product here is one sum per weight row and x row in one order, whichever form runs it:
// each block's 32 values (code × 2^(s − 127), exact in fp32) multiplied by x's and added into
// BLOCK_VECTORS vector accumulators (lane by lane, block after block), then those summed. The few-row
// form (rows_dots) makes each block's values once for several x rows, the one-row form (row_dot) for
// one. Same floats either way, so a row's outputs do not depend on how many rows came with it
// (greedy tokens must not change with batching).
// A one-row MXFP4 product does ~4 vector instructions a 17-byte block, and on an Intel Xeon (AMX) the
// hardware prefetcher fell behind it: the experts' product at gpt-oss-20b's shape read 4.2 GB/s on
// one thread and 7.1 on two; asking for the 4 blocks' 2 lines BLOCK_PREFETCH (rows.h: 2 KB) ahead every
// 4 blocks took it to 8.3 and 15.5-16.0 (bf16 x; fp32 x 2.9 → 7.0 and 5.6 → 12.7; 1 and 4 KB no better;
// benchmarks/mxfp4_bandwidth.py, 2026-12-05 20:38-20:50 UTC, load 0.5-2.4).
static constexpr int64_t FOUR_BLOCKS_BYTES = 128;  // 4 × 17 = 68 bytes, on at most 2 lines: both asked for
#ifdef MK_AVX2
constexpr int BLOCK_VECTORS = 32 / MK_WIDE;

// One 17-byte block's 32 values as BLOCK_VECTORS vectors, in order.
static inline void block_values(const uint8_t* w, const float* scales, VF* v) {
    const __m128i table = _mm_loadu_si128(reinterpret_cast<const __m128i*>(TWICE));
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 1));
    const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(bytes, low4));   // elements 0, 2, 4, ...
    const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));  // 1, 3, 5, ...
    const __m128i first = _mm_unpacklo_epi8(lo, hi);   // elements 0..15 in order
    const __m128i second = _mm_unpackhi_epi8(lo, hi);  // elements 16..31
    const VF scale = vset(scales[w[0]]);
#if MK_WIDE == 16
    v[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(first)), scale);
    v[1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(second)), scale);
#else
    v[0] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(first)), scale);
    v[1] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(first, 8))), scale);
    v[2] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(second)), scale);
    v[3] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(second, 8))), scale);
#endif
}

static inline float lanes_sum(const VF* acc) {
#if MK_WIDE == 16
    return vsum(vadd(acc[0], acc[1]));
#else
    return vsum(vadd(vadd(acc[0], acc[1]), vadd(acc[2], acc[3])));
#endif
}
#endif

// Not inlined: one compiled body for the rows and the experts operators (inlined, the compiler
// vectorised a tail loop in one caller and not in the other: 1 ulp apart, measured).
__attribute__((noinline)) static float row_dot(const uint8_t* w, const float* x, int64_t groups) {
    const float* scales = half_scales();
#ifdef MK_AVX2
    VF acc[BLOCK_VECTORS], v[BLOCK_VECTORS];
    for (int i = 0; i < BLOCK_VECTORS; ++i) acc[i] = vzero();
    for (int64_t g = 0; g < groups; ++g, w += 17, x += 32) {
        if ((g & 3) == 0) block_prefetch(w, FOUR_BLOCKS_BYTES);
        block_values(w, scales, v);
        for (int i = 0; i < BLOCK_VECTORS; ++i) acc[i] = vfma(v[i], vload(x + i * MK_WIDE), acc[i]);
    }
    return lanes_sum(acc);
#else
    float acc = 0.f;
    for (int64_t g = 0; g < groups; ++g, w += 17, x += 32) {
        const float scale = scales[w[0]];
        for (int j = 0; j < 16; ++j) {
            const uint8_t b = w[1 + j];
            acc = std::fma(TWICE[b & 15] * scale, x[2 * j], acc);
            acc = std::fma(TWICE[b >> 4] * scale, x[2 * j + 1], acc);
        }
    }
    return acc;
#endif
}

#ifdef MK_DPBF16
// bf16 x (a bf16 engine's activations, read in place) on AVX512-BF16: a block's 32 values made as
// bf16 by one vpermw from its scale byte's table of the 16 codes' values (code × 2^(s − 127): three
// significant bits, exact in bf16 as in fp32), then multiplied by x's bf16 pairs into fp32 chains
// (a product of two bf16 is exact in fp32): the fp32 form's products, summed in another order, and
// ~4 vector instructions a block where the fp32 form's unpacking took ~7 cycles. Block g goes into
// chain g % PAIR_CHAINS in every form, so a row's floats do not depend on the rows beside it.
// AVX512-BF16 reads subnormal bf16 as zero: values of blocks scaled below 2^-126 (gpt-oss's are
// ~2^-10 .. 2^0), and subnormal x.
constexpr int PAIR_CHAINS = 4;

// [256][16] bf16 bits: scale byte s, code c → TWICE[c] · 2^(s − 128), the fp32 form's values.
static const uint16_t* scaled_codes() {
    static const std::vector<uint16_t> table = [] {
        std::vector<uint16_t> t(256 * 16);
        for (int s = 0; s < 256; ++s)
            for (int c = 0; c < 16; ++c) t[s * 16 + c] = c10::BFloat16(TWICE[c] * std::ldexp(1.0f, s - 128)).x;
        return t;
    }();
    return table.data();
}

// One 17-byte block's 32 values as bf16, in x's order: byte j's low code is value 2j, its high 2j + 1,
// so dword j's index words are (b & 15, b >> 4): (b | b << 12) & 0x000F000F.
static inline __m512bh block_pairs(const uint8_t* w, const uint16_t* tables) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 1)));
    const __m512i codes = _mm512_ternarylogic_epi32(b, _mm512_slli_epi32(b, 12), _mm512_set1_epi32(0x000F000F), 0xA8);  // (A | B) & C
    // the table's 16 words in the low half; the codes (< 16) never index the high half
    const __m512i table = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tables + 16 * w[0])));
    return (__m512bh)_mm512_permutexvar_epi16(codes, table);
}

static inline __m512 pair_fma(__m512 acc, __m512bh v, const c10::BFloat16* x) {
    return _mm512_dpbf16_ps(acc, v, (__m512bh)_mm512_loadu_si512(x));
}

static inline float chains_sum(const __m512* acc) {
    return vsum(vadd(vadd(acc[0], acc[1]), vadd(acc[2], acc[3])));
}

__attribute__((noinline)) static float row_dot(const uint8_t* w, const c10::BFloat16* x, int64_t groups) {
    const uint16_t* tables = scaled_codes();
    __m512 acc[PAIR_CHAINS] = {vzero(), vzero(), vzero(), vzero()};
    for (int64_t g = 0; g < groups; g += PAIR_CHAINS) {
        block_prefetch(w + g * 17, FOUR_BLOCKS_BYTES);
        for (int c = 0; c < PAIR_CHAINS; ++c)  // unrolled: each chain stays in its register
            if (g + c < groups) acc[c] = pair_fma(acc[c], block_pairs(w + (g + c) * 17, tables), x + (g + c) * 32);
    }
    return chains_sum(acc);
}
#endif

// Weight rows of a block and x rows of a pass where a weight block's values are made once for
// several x rows (in registers): AVX-512, 2 · 4 · 2 accumulators of its 32 registers; AVX2, 1 · 2 · 4
// of 16; without vectors, each pair through row_dot. (bf16 x: x_rows below.)
#if defined(MK_AVX2) && MK_WIDE == 16
constexpr int ROWS_BLOCK = 2, X_ROWS = 4;
#else
constexpr int ROWS_BLOCK = 1, X_ROWS = 2;
#endif
// bf16 x: 4 x rows a pass, so an expert chosen by up to 4 rows (serving at c = 4) makes each block's
// values once; 2 · 4 · PAIR_CHAINS accumulators, the 32 registers' worth. On one
// core of an AMD EPYC (Zen 4), the weight in L2: 4 rows 1.57-1.60 ns a weight block in one pass
// against 2.27 in two passes of 2 rows; 3 rows 1.39 against 2 passes (benchmarks/mxfp4_unpack.cpp).
template <typename X>
constexpr int x_rows() { return std::is_same_v<X, float> ? X_ROWS : 4; }

// G weight rows (row g at w + g · row_bytes) against NR x rows: out[g · R + r] = row_dot(row g,
// xs[r]) bit for bit (each block's values made as row_dot makes them, the same FMAs in the same
// order), each block's values made once for the NR rows and each x vector loaded once for the G.
template <int G, int NR>
static void rows_dots(const uint8_t* w, int64_t row_bytes, const float* const* xs, int64_t groups, int64_t R, float* out) {
#ifdef MK_AVX2
    const float* scales = half_scales();
    VF acc[G][NR][BLOCK_VECTORS];
    for (int g = 0; g < G; ++g)
        for (int r = 0; r < NR; ++r)
            for (int i = 0; i < BLOCK_VECTORS; ++i) acc[g][r][i] = vzero();
    for (int64_t b = 0; b < groups; ++b) {
        VF v[G][BLOCK_VECTORS];
        for (int g = 0; g < G; ++g) block_values(w + g * row_bytes + b * 17, scales, v[g]);
        for (int i = 0; i < BLOCK_VECTORS; ++i) {
            VF xv[NR];
            for (int r = 0; r < NR; ++r) xv[r] = vload(xs[r] + b * 32 + i * MK_WIDE);
            for (int g = 0; g < G; ++g)
                for (int r = 0; r < NR; ++r) acc[g][r][i] = vfma(v[g][i], xv[r], acc[g][r][i]);
        }
    }
    for (int g = 0; g < G; ++g)
        for (int r = 0; r < NR; ++r) out[g * R + r] = lanes_sum(acc[g][r]);
#else
    for (int g = 0; g < G; ++g)
        for (int r = 0; r < NR; ++r) out[g * R + r] = row_dot(w + g * row_bytes, xs[r], groups);
#endif
}

#ifdef MK_DPBF16
// rows_dots for bf16 x: out[g · R + r] = row_dot(row g, xs[r]) bit for bit, each block's bf16 values
// made once for the NR rows.
template <int G, int NR>
static void rows_dots(const uint8_t* w, int64_t row_bytes, const c10::BFloat16* const* xs, int64_t groups, int64_t R, float* out) {
    const uint16_t* tables = scaled_codes();
    __m512 acc[G][NR][PAIR_CHAINS];
    for (int g = 0; g < G; ++g)
        for (int r = 0; r < NR; ++r)
            for (int c = 0; c < PAIR_CHAINS; ++c) acc[g][r][c] = vzero();
    // Block b into chain c = b % PAIR_CHAINS, c a constant in each unrolled step (the accumulators
    // stay registers, not an array indexed at run time).
    const auto step = [&](int c, int64_t b) {
        __m512bh v[G];
        // The next pass's G weight rows, as far along, asked for now: G rows read side by side are G
        // short streams the hardware prefetcher did not follow (from memory, 2 rows of one expert
        // ran at 3-6x a lone row's time for twice the rows; measured on an AMD EPYC, Zen 4).
        if (c == 0)
            for (int g = 0; g < G; ++g) {
                const char* next = reinterpret_cast<const char*>(w + (g + G) * row_bytes + b * 17);
                _mm_prefetch(next, _MM_HINT_T0);
                _mm_prefetch(next + 64, _MM_HINT_T0);
            }
        for (int g = 0; g < G; ++g) v[g] = block_pairs(w + g * row_bytes + b * 17, tables);
        for (int r = 0; r < NR; ++r)
            for (int g = 0; g < G; ++g) acc[g][r][c] = pair_fma(acc[g][r][c], v[g], xs[r] + b * 32);
    };
    int64_t b = 0;
    for (; b + PAIR_CHAINS <= groups; b += PAIR_CHAINS) {
#pragma GCC unroll 4
        for (int c = 0; c < PAIR_CHAINS; ++c) step(c, b + c);
    }
#pragma GCC unroll 4
    for (int c = 0; c < PAIR_CHAINS; ++c)
        if (b + c < groups) step(c, b + c);
    for (int g = 0; g < G; ++g)
        for (int r = 0; r < NR; ++r) out[g * R + r] = chains_sum(acc[g][r]);
}
#endif

// G weight rows against R x rows (out[g · R + r] = row_dot(row g, xs[r])), x_rows<X>() x rows a pass.
template <int G, typename X>
static void block_dots(const uint8_t* w, int64_t row_bytes, const X* const* xs, int64_t R, int64_t groups, float* out) {
    constexpr int XR = x_rows<X>();
    int64_t r = 0;
    for (; r + XR <= R; r += XR) rows_dots<G, XR>(w, row_bytes, xs + r, groups, R, out + r);
    switch (R - r) {
        case 3: if constexpr (XR > 3) rows_dots<G, 3>(w, row_bytes, xs + r, groups, R, out + r); break;
        case 2: if constexpr (XR > 2) rows_dots<G, 2>(w, row_bytes, xs + r, groups, R, out + r); break;
        case 1: rows_dots<G, 1>(w, row_bytes, xs + r, groups, R, out + r); break;
        default: break;
    }
}

// one_row_grouped: one x row against GROUP (rows.h: 4 with AVX-512) weight rows a pass (block_dots<GROUP>, bit for bit
// row_dot on each) rather than row by row: x's vectors loaded once for the GROUP rows, and each pass
// asks for the next pass's rows (6 KB ahead at gpt-oss-20b's 1530-byte rows). On the Intel Xeon (AMX)
// the bf16-x one-row product is bound by its instructions (the weight in L2: 1.46-1.6 ns a block, ~11
// GB/s a core); 4 rows a pass took 4-14% off that (thread CPU time, 5 runs), from memory within the
// noise (benchmarks/mxfp4_one_row.cpp, 2026-12-05 21:03-21:15 UTC, load 8-11, under load). AVX-512
// builds only: AVX2's 16 registers do not hold 2 rows' accumulators and values; not measured there.
// bf16 x only: fp32 x's grouped form (rows_dots on block_values) asks for no bytes ahead, and at
// gpt-oss-20b's shape read 4.0 GB/s on one thread against row_dot's 7.0 (benchmarks/mxfp4_bandwidth.py).
template <typename X>
constexpr bool one_row_grouped() {
#if MK_WIDE == 16 && defined(MK_DPBF16)
    return std::is_same_v<X, c10::BFloat16>;
#else
    return false;
#endif
}

// One weight row against R x rows: the few-row form's last rows, and each weight row of an expert one x row chose.
template <typename X>
static void row_dots(const uint8_t* w, const X* const* xs, int64_t R, int64_t groups, float* out) {
    if (R == 1) {
        out[0] = row_dot(w, xs[0], groups);
        return;
    }
    block_dots<1>(w, 0, xs, R, groups, out);
}

// One FP8 row: `in` float8_e4m3fn codes, then nbc fp32 scales (one per `block` columns). Not
// inlined, as row_dot.
__attribute__((noinline)) static float fp8_row_dot(const uint8_t* w, const float* x, int64_t in, int64_t block, const float* lut) {
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

// x as the MXFP4 products read it: bf16 in place where the pair form is built, else fp32 (a bf16
// x widened: the same values).
static torch::Tensor mxfp4_input(const torch::Tensor& x) {
#ifdef MK_DPBF16
    if (x.scalar_type() == torch::kBFloat16) return x.contiguous();
#endif
    return x.to(torch::kFloat).contiguous();
}

template <typename X>
static void mxfp4_rows(const X* xp, const uint8_t* wp, int64_t n, int64_t out, int64_t groups, float* yp) {
    std::vector<const X*> xs(n);
    for (int64_t r = 0; r < n; ++r) xs[r] = xp + r * groups * 32;
    at::parallel_for(0, out, 16, [&](int64_t begin, int64_t end) {
        std::vector<float> dots(ROWS_BLOCK * n);
        int64_t o = begin;
        if (n == 1 && one_row_grouped<X>())  // one x row: GROUP weight rows a pass (one_row_grouped says why), each row's floats row_dot's
            for (; o + GROUP <= end; o += GROUP) block_dots<GROUP>(wp + o * groups * 17, groups * 17, xs.data(), 1, groups, yp + o);
        if (n > 1)
            for (; o + ROWS_BLOCK <= end; o += ROWS_BLOCK) {
                block_dots<ROWS_BLOCK>(wp + o * groups * 17, groups * 17, xs.data(), n, groups, dots.data());
                for (int g = 0; g < ROWS_BLOCK; ++g)
                    for (int64_t r = 0; r < n; ++r) yp[r * out + o + g] = dots[g * n + r];
            }
        for (; o < end; ++o) {
            row_dots(wp + o * groups * 17, xs.data(), n, groups, dots.data());
            for (int64_t r = 0; r < n; ++r) yp[r * out + o] = dots[r];
        }
    });
}

torch::Tensor mxfp4_gemv(torch::Tensor x, torch::Tensor packed) {
    // x fp32 or bf16 [N, G * 32]; packed uint8 [out, G * 17] → fp32 [N, out]
    TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16) &&
                packed.scalar_type() == torch::kByte && packed.size(1) % 17 == 0 && x.size(1) == packed.size(1) / 17 * 32,
                "mxfp4_gemv: x fp32 or bf16 [N, G * 32], packed uint8 [out, G * 17]");
    const int64_t n = x.size(0), out = packed.size(0), groups = packed.size(1) / 17;
    const auto xc = mxfp4_input(x);
    const auto pc = packed.contiguous();
    auto y = torch::empty({n, out}, x.options().dtype(torch::kFloat));
    const uint8_t* wp = pc.data_ptr<uint8_t>();
#ifdef MK_DPBF16
    if (xc.scalar_type() == torch::kBFloat16) {
        mxfp4_rows(xc.data_ptr<c10::BFloat16>(), wp, n, out, groups, y.data_ptr<float>());
        return y;
    }
#endif
    mxfp4_rows(xc.data_ptr<float>(), wp, n, out, groups, y.data_ptr<float>());
    return y;
}

// Each float8_e4m3fn code's value, as torch converts it (moekit.ops.calls.FP8_VALUES): the experts'
// form takes no table argument, so the compiled step holds no constant tensor for it.
static const float* fp8_values() {
    static const std::vector<float> values = [] {
        std::vector<float> v(256);
        for (int c = 0; c < 256; ++c) v[c] = float(c10::Float8_e4m3fn(uint8_t(c), c10::Float8_e4m3fn::from_bits()));
        return v;
    }();
    return values.data();
}

// The chosen experts of a stack of packed rows w [E, N, width], each product the rows operator's own
// (`dots`: one weight row against R x rows, so an expert's outputs are bit for bit mxfp4_gemv's / fp8_gemv's on it):
// x [B, X, in] (fp32, or bf16 where `dots` takes it; X = 1: one row per token; X = C: one per choice),
// ids [B, C] → fp32 [B, C, N]. `block` (BG > 0): BG weight rows at a time against R x rows, as dots_block (rows.h).
template <int BG, typename T, typename Dots, typename Block, typename Group>
static torch::Tensor packed_experts(const char* name, const torch::Tensor& xc, const torch::Tensor& w, const torch::Tensor& ids,
                                    int64_t in, Dots dots, Block block, Group group, bool grouped) {
    const int64_t B = xc.size(0), X = xc.size(1), C = ids.size(1), E = w.size(0), N = w.size(1), width = w.size(2);
    TORCH_CHECK(X == 1 || X == C, name, ": x holds one row per token or one per choice");
    const auto wc = w.contiguous();
    const auto ic = ids.to(torch::kLong).contiguous();
    auto y = torch::empty({B, C, N}, xc.options().dtype(torch::kFloat));
    const T* xp = xc.data_ptr<T>();
    const uint8_t* wp = wc.data_ptr<uint8_t>();
    experts_loop<BG>(ic.data_ptr<int64_t>(), y.data_ptr<float>(), B, X, C, E, N, [xp, in](int64_t r) { return xp + r * in; },
                     [&](int64_t e, int64_t n, const T* const* xs, int64_t R, float* out) {
                         dots(wp + (e * N + n) * width, xs, R, out);
                     },
                     [&](int64_t e, int64_t n, const T* x1, float* out) { group(wp + (e * N + n) * width, width, x1, out); },
                     [&](int64_t e, int64_t n, const T* const* xs, int64_t R, float* out) {
                         block(wp + (e * N + n) * width, width, xs, R, out);
                     },
                     grouped);
    return y;
}

template <typename T>
static torch::Tensor mxfp4_experts(const torch::Tensor& xc, const torch::Tensor& w, const torch::Tensor& ids) {
    const int64_t groups = w.size(2) / 17;
    return packed_experts<ROWS_BLOCK, T>(
        "experts_mxfp4", xc, w, ids, groups * 32,
        [groups](const uint8_t* row, const T* const* xs, int64_t R, float* out) { row_dots(row, xs, R, groups, out); },
        [groups](const uint8_t* rows, int64_t row_bytes, const T* const* xs, int64_t R, float* out) {
            block_dots<ROWS_BLOCK>(rows, row_bytes, xs, R, groups, out);
        },
        [groups](const uint8_t* rows, int64_t row_bytes, const T* x1, float* out) {  // an expert one x row chose
            block_dots<GROUP>(rows, row_bytes, &x1, 1, groups, out);
        },
        one_row_grouped<T>());
}

torch::Tensor experts_mxfp4(torch::Tensor x, torch::Tensor w, torch::Tensor ids) {
    TORCH_CHECK(x.dim() == 3 && w.dim() == 3 && ids.dim() == 2 &&
                (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16) &&
                w.scalar_type() == torch::kByte && w.size(2) % 17 == 0 && x.size(2) == w.size(2) / 17 * 32,
                "experts_mxfp4: x fp32 or bf16 [B, X, G * 32], w uint8 [E, N, G * 17], ids [B, C]");
    const auto xc = mxfp4_input(x);
#ifdef MK_DPBF16
    if (xc.scalar_type() == torch::kBFloat16) return mxfp4_experts<c10::BFloat16>(xc, w, ids);
#endif
    return mxfp4_experts<float>(xc, w, ids);
}

torch::Tensor experts_fp8(torch::Tensor x, torch::Tensor w, torch::Tensor ids, int64_t block) {
    TORCH_CHECK(x.dim() == 3 && w.dim() == 3 && ids.dim() == 2 && x.scalar_type() == torch::kFloat && block > 0 &&
                w.scalar_type() == torch::kByte && w.size(2) == x.size(2) + 4 * ((x.size(2) + block - 1) / block),
                "experts_fp8: x fp32 [B, X, in], w uint8 [E, N, in + 4 * nbc], ids [B, C]");
    const int64_t in = x.size(2);
    const float* lut = fp8_values();
    return packed_experts<0, float>(
        "experts_fp8", x.contiguous(), w, ids, in,
        [in, block, lut](const uint8_t* row, const float* const* xs, int64_t R, float* out) {
            for (int64_t r = 0; r < R; ++r) out[r] = fp8_row_dot(row, xs[r], in, block, lut);
        },
        [](const uint8_t*, int64_t, const float* const*, int64_t, float*) {},
        [](const uint8_t*, int64_t, const float*, float*) {}, false);
}
