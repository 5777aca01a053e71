// q8_0 products: rows_q8, experts_q8 (moekit.model.int8's blocks).
#include "ops.h"
#include "rows.h"

// A q8_0 product's x: each row's blocks of 32 rounded to int16 with one float scale per block,
// s = max|x| / 32767 and q = x / s rounded to nearest even (relative error <= 2^-16 of the block's
// largest |x|, 128 times finer than bf16); moekit.model.int8.int8_reference is the same rounding in
// torch. What every path below computes, for weight row n and x row m (the arithmetic is defined
// once, so a row's float is the same alone, in a batch of any size, in any build's lane layout):
//   acc = 0;  for b in 0 .. nb-1:  acc = fma(float(isum_b), d_b * s_b, acc)
// where isum_b = Σ_j code_bj · q_bj is the block's exact integer sum (|·| <= 128 · 32767 · 32 < 2^31),
// float() rounds it to nearest even, d_b * s_b is one float product and fma rounds once. An integer
// sum is exact in any order, so the kernels are free to form it however the vector units like:
//   - one x row or few (a decode step): 16 (AVX-512) / 8 (AVX2) weight rows in the lanes, each
//     row's block products summed by madd and a transposing add tree (rows_lanes);
//   - many x rows (a prefill, a big decode batch): 16 / 8 x rows in the lanes, repacked once as
//     int16 pairs, against each weight row's codes widened once to int16 and broadcast a pair at a
//     time: one dpwssd (AVX512-VNNI / AVX-VNNI; madd + add without) does 2 products for every lane,
//     and the float work is once per block for all the lanes (x_lanes). Against widening each
//     code and scaling every 2-product lane per x row (the previous kernel): ~4x fewer vector ops.
struct Q16Row { const int16_t* q; const float* s; };

// x rows in the lanes: LANES rows' blocks repacked as int32 pairs, q[(b * 16 + p) * LANES + l] =
// (q_l[b*32 + 2p], q_l[b*32 + 2p + 1]), and s[b * LANES + l]; rows past the last are zeros.
struct XLanes {
    std::vector<int32_t> q;
    std::vector<float> s;
};

struct Q16Rows {
    std::vector<int16_t> q;
    std::vector<float> s;
    Q16Row row(int64_t r, int64_t nb) const { return {q.data() + r * nb * 32, s.data() + r * nb}; }
};

// One block of 32 x values to int16 and its scale, written plainly: the definition above.
static inline float q16_block(const float* xb, int16_t* q) {
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
    const float s = amax / 32767.f;
    for (int j = 0; j < 32; ++j) q[j] = s == 0.f ? 0 : (int16_t)std::nearbyint(xb[j] / s);
    return s;
}

#if MK_WIDE == 16
// q16_block in two vectors: the same max, the same correctly rounded division and the same
// round-to-nearest-even (the conversion's default mode, as nearbyint's), so the same codes for any
// finite x. Every q8_0 product rounds its x first, on the calling thread before the threads split
// the rows; the plain loop (a division and a rounding per value, one at a time) cost ~0.3 us of a
// batch-1 [512, 512] product's ~12 us in cache (1-3% of its CPU time, Intel Xeon; from memory the
// product takes ~35 us and the difference is within the noise).
static inline float q16_block_wide(const float* xb, int16_t* q) {
    const __m512 a = _mm512_loadu_ps(xb), b = _mm512_loadu_ps(xb + 16);
    const __m512 mag = _mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b));
    const float s = _mm512_reduce_max_ps(mag) / 32767.f;
    if (s == 0.f) {
        std::memset(q, 0, 32 * sizeof(int16_t));
        return s;
    }
    const __m512 sv = _mm512_set1_ps(s);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_div_ps(a, sv))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_div_ps(b, sv))));
    return s;
}
#endif

static Q16Rows q16_rows(const float* x, int64_t rows, int64_t nb) {
    Q16Rows out;
    out.q.resize(rows * nb * 32);
    out.s.resize(rows * nb);
    for (int64_t rb = 0; rb < rows * nb; ++rb) {
#if MK_WIDE == 16
        out.s[rb] = q16_block_wide(x + rb * 32, out.q.data() + rb * 32);
#else
        out.s[rb] = q16_block(x + rb * 32, out.q.data() + rb * 32);
#endif
    }
    return out;
}

// A one-row product takes LANES weight rows a step, block by block: LANES short streams (17 lines
// each at 512 inputs) that the hardware prefetcher follows late (~4.2 ns a block from memory, 8 GB/s,
// against ~1 ns a block in L2: memory-bound, not compute-bound). The LANES rows are one contiguous
// run of bytes, so it is asked for as one stream instead: at block b of nb, the lines Q8_AHEAD bytes
// past the run's b-th nb-th, into L2 (benchmarks/q8_block.cpp, one core of the Intel Xeon, 128 MB of
// [*, 512] rows: 9.0 -> 12.2 GB/s, the same with both cores reading; 8 KB ahead: 11.7, 32 KB: 12.3;
// into L1 at 8 KB: 10.4). The earlier form, 2 KB ahead along each row every other block, read 9.0.
static constexpr int64_t Q8_AHEAD = 16384;
// Lines [from, to) (not past stop: the bytes after a span belong to another thread or are not read).
static inline void q8_prefetch(const uint8_t* from, const uint8_t* to, const uint8_t* stop) {
#ifdef MK_AVX2
    const uint8_t* end = std::min(to, stop);
    const auto line = reinterpret_cast<uintptr_t>(from) & ~uintptr_t(63);
    for (const char* p = reinterpret_cast<const char*>(line); p < reinterpret_cast<const char*>(end); p += 64) _mm_prefetch(p, _MM_HINT_T1);
#else
    (void)from, (void)to, (void)stop;
#endif
}

static inline int32_t q8_isum_scalar(const uint8_t* w, const int16_t* q) {
    const int8_t* c = reinterpret_cast<const int8_t*>(w + 2);
    int32_t s = 0;
    for (int j = 0; j < 32; ++j) s += int32_t(c[j]) * int32_t(q[j]);
    return s;
}

// One weight row against one x row, block by block: the definition above, written plainly. The
// lane kernels' leftovers (weight rows short of a full set of lanes) run it.
static inline float q8_dot(const uint8_t* w, Q16Row x, int64_t nb) {
    float acc = 0.f;
    for (int64_t b = 0; b < nb; ++b, w += 34) acc = std::fma(float(q8_isum_scalar(w, x.q + b * 32)), half_to_float(w) * x.s[b], acc);
    return acc;
}

#if MK_WIDE == 16
constexpr int LANES = 16;
using VI = __m512i;
static inline VI izero() { return _mm512_setzero_si512(); }
static inline VI iload(const void* p) { return _mm512_loadu_si512(p); }
static inline void istore(void* p, VI v) { _mm512_storeu_si512(p, v); }
static inline VI iadd(VI a, VI b) { return _mm512_add_epi32(a, b); }
static inline VF tofloat(VI v) { return _mm512_cvtepi32_ps(v); }
static inline VF fmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
static inline VI bcast32(const int16_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm512_set1_epi32(v); }
// acc + Σ of each lane's 2 int16 products.
static inline VI dp(VI acc, VI a, VI b) {
#ifdef __AVX512VNNI__
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
// A block's 32 codes against 32 int16 of x: 16 int32 lanes of 2 products each.
static inline VI block_lanes(const uint8_t* codes, const int16_t* q) {
    return _mm512_madd_epi16(_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes))), iload(q));
}
// 32 codes widened to 32 int16.
static inline void widen_codes(const uint8_t* codes, int16_t* out) {
    istore(out, _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes))));
}
// Lane i of the result = the sum of v[i]'s lanes (integer adds: exact in any order).
static inline VI lane_sums(VI* v) {
    VI t[8], u[4], w[2];
    for (int i = 0; i < 8; ++i)
        t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)
        u[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
    for (int i = 0; i < 2; ++i)
        w[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_i32x4(u[2 * i], u[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(w[0], w[1], _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_i32x4(w[0], w[1], _MM_SHUFFLE(3, 1, 3, 1)));
}
// The float16 scales of block b of LANES weight rows `row_bytes` apart.
static inline VF lane_scales(const uint8_t* w, int64_t row_bytes) {
    const __m512i at = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32((int)row_bytes));
    return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_i32gather_epi32(at, w, 1)));
}
#elif defined(MK_WIDE)
constexpr int LANES = 8;
using VI = __m256i;
static inline VI izero() { return _mm256_setzero_si256(); }
static inline VI iload(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
static inline void istore(void* p, VI v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
static inline VI iadd(VI a, VI b) { return _mm256_add_epi32(a, b); }
static inline VF tofloat(VI v) { return _mm256_cvtepi32_ps(v); }
static inline VF fmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
static inline VI bcast32(const int16_t* p) { int32_t v; std::memcpy(&v, p, 4); return _mm256_set1_epi32(v); }
static inline VI dp(VI acc, VI a, VI b) {
#ifdef __AVXVNNI__
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
static inline VI block_lanes(const uint8_t* codes, const int16_t* q) {
    const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16)));
    return _mm256_add_epi32(_mm256_madd_epi16(lo, iload(q)), _mm256_madd_epi16(hi, iload(q + 16)));
}
static inline void widen_codes(const uint8_t* codes, int16_t* out) {
    istore(out, _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
    istore(out + 16, _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16))));
}
static inline VI lane_sums(VI* v) {
    const VI h0 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
    const VI h1 = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(h0, h1, 0x20), _mm256_permute2x128_si256(h0, h1, 0x31));
}
static inline VF lane_scales(const uint8_t* w, int64_t row_bytes) {
    alignas(16) uint16_t h[8];
    for (int i = 0; i < 8; ++i) std::memcpy(h + i, w + i * row_bytes, 2);
    return _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h)));
}
#endif

#ifdef MK_WIDE
// LANES consecutive weight rows (`row_bytes` apart) against one x row: out[0 .. LANES). The bytes
// Q8_AHEAD past them are prefetched, none from `stop` on.
static inline void rows_lanes(const uint8_t* w, int64_t row_bytes, Q16Row x, int64_t nb, float* out, const uint8_t* stop) {
    VF acc = vzero();
    VI part[LANES];
    const int64_t run = LANES * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = w + b * 34;
        q8_prefetch(w + Q8_AHEAD + run * b / nb, w + Q8_AHEAD + run * (b + 1) / nb, stop);
        for (int i = 0; i < LANES; ++i) part[i] = block_lanes(blk + i * row_bytes + 2, x.q + b * 32);
        acc = vfma(tofloat(lane_sums(part)), fmul(lane_scales(blk, row_bytes), vset(x.s[b])), acc);
    }
    vstore(out, acc);
}


static XLanes x_lanes(const Q16Row* xs, int64_t R, int64_t nb) {
    XLanes out;
    out.q.assign(nb * 16 * LANES, 0);
    out.s.assign(nb * LANES, 0.f);
    for (int64_t l = 0; l < R; ++l) {
        const int32_t* pairs = reinterpret_cast<const int32_t*>(xs[l].q);  // int16 pairs, as dp reads them
        for (int64_t i = 0; i < nb * 16; ++i) std::memcpy(&out.q[i * LANES + l], pairs + i, 4);
        for (int64_t b = 0; b < nb; ++b) out.s[b * LANES + l] = xs[l].s[b];
    }
    return out;
}

// G weight rows, their codes widened to int16 (w16[g], nb * 32) and their scales (d[g], nb), against
// LANES x rows in lanes: out[g * LANES + l].
template <int G>
static inline void lanes_block(const int16_t* const* w16, const float* const* d, const XLanes& x, int64_t nb, float* out) {
    VF acc[G];
    for (int g = 0; g < G; ++g) acc[g] = vzero();
    const int32_t* xq = x.q.data();
    for (int64_t b = 0; b < nb; ++b) {
        VI i0[G], i1[G];
        for (int g = 0; g < G; ++g) i0[g] = i1[g] = izero();
        for (int p = 0; p < 16; p += 2) {
            const VI x0 = iload(xq + (b * 16 + p) * LANES), x1 = iload(xq + (b * 16 + p + 1) * LANES);
            for (int g = 0; g < G; ++g) {
                i0[g] = dp(i0[g], x0, bcast32(w16[g] + b * 32 + 2 * p));
                i1[g] = dp(i1[g], x1, bcast32(w16[g] + b * 32 + 2 * p + 2));
            }
        }
        const VF s = vload(x.s.data() + b * LANES);
        for (int g = 0; g < G; ++g) acc[g] = vfma(tofloat(iadd(i0[g], i1[g])), fmul(vset(d[g][b]), s), acc[g]);
    }
    for (int g = 0; g < G; ++g) vstore(out + g * LANES, acc[g]);
}

// Weight rows rows[0 .. n) (pointers to their q8_0 bytes) against the x rows packed in `chunks`
// (LANES each, R rows in all): put(g, l, value) for weight row g, x row l (of all R).
constexpr int XG = 4;  // weight rows a step: 4 · 2 integer chains and the x pairs loaded once for 4
template <typename Put>
static void lanes_rows(const uint8_t* const* rows, int64_t n, const std::vector<XLanes>& chunks, int64_t R, int64_t nb, Put put) {
    std::vector<int16_t> wide(XG * nb * 32);
    std::vector<float> scales(XG * nb);
    alignas(64) float out[XG * LANES];
    for (int64_t r0 = 0; r0 < n; r0 += XG) {
        const int G = (int)std::min<int64_t>(XG, n - r0);
        const int16_t* w16[XG];
        const float* d[XG];
        for (int g = 0; g < G; ++g) {
            int16_t* to = wide.data() + g * nb * 32;
            float* ds = scales.data() + g * nb;
            for (int64_t b = 0; b < nb; ++b) {
                widen_codes(rows[r0 + g] + b * 34 + 2, to + b * 32);
                ds[b] = half_to_float(rows[r0 + g] + b * 34);
            }
            w16[g] = to;
            d[g] = ds;
        }
        for (size_t c = 0; c < chunks.size(); ++c) {
            if (G == 4) lanes_block<4>(w16, d, chunks[c], nb, out);
            else if (G == 3) lanes_block<3>(w16, d, chunks[c], nb, out);
            else if (G == 2) lanes_block<2>(w16, d, chunks[c], nb, out);
            else lanes_block<1>(w16, d, chunks[c], nb, out);
            const int64_t L = std::min<int64_t>(LANES, R - (int64_t)c * LANES);
            for (int g = 0; g < G; ++g)
                for (int64_t l = 0; l < L; ++l) put(r0 + g, c * LANES + l, out[g * LANES + l]);
        }
    }
}

static std::vector<XLanes> lane_chunks(const Q16Row* xs, int64_t R, int64_t nb) {
    std::vector<XLanes> chunks;
    for (int64_t r0 = 0; r0 < R; r0 += LANES) chunks.push_back(x_lanes(xs + r0, std::min<int64_t>(LANES, R - r0), nb));
    return chunks;
}
// x rows from which they go in the lanes (below, each row on its own): at 4 rows the lanes were
// 25-35% slower than 4 rows alone on a [1024, 512] weight, at 8 rows 25% faster (1 thread, Intel Xeon).
constexpr int64_t LANE_ROWS = 6;
#else
constexpr int LANES = 1;
static inline void rows_lanes(const uint8_t* w, int64_t, Q16Row x, int64_t nb, float* out, const uint8_t*) { out[0] = q8_dot(w, x, nb); }
#endif

// Weight rows n0 .. n1 (`row_bytes` apart from w) against x rows xs[0 .. R): put(n, r, value).
// Few x rows: each on its own, LANES weight rows at a time, prefetching none of the bytes from
// `stop` on; many: x rows in the lanes.
template <typename Put>
static void q8_span(const uint8_t* w, int64_t row_bytes, int64_t n0, int64_t n1, const Q16Row* xs, int64_t R, int64_t nb,
                    const void* chunks, const uint8_t* stop, Put put) {
#ifdef MK_WIDE
    if (R >= LANE_ROWS) {
        std::vector<const uint8_t*> rows(n1 - n0);
        for (int64_t n = n0; n < n1; ++n) rows[n - n0] = w + n * row_bytes;
        lanes_rows(rows.data(), n1 - n0, *static_cast<const std::vector<XLanes>*>(chunks), R, nb,
                   [&](int64_t g, int64_t r, float v) { put(n0 + g, r, v); });
        return;
    }
#endif
    alignas(64) float out[LANES];
    for (int64_t r = 0; r < R; ++r) {
        int64_t n = n0;
        for (; n + LANES <= n1; n += LANES) {
            rows_lanes(w + n * row_bytes, row_bytes, xs[r], nb, out, stop);
            for (int i = 0; i < LANES; ++i) put(n + i, r, out[i]);
        }
        for (; n < n1; ++n) put(n, r, q8_dot(w + n * row_bytes, xs[r], nb));
    }
}

// q8_0 weights: w [N, nb * 34] (one projection) or [E, N, nb * 34] (stacked experts), uint8.
// `grouped` is kept for the schema: every path here reads several weight rows at once.
torch::Tensor rows_q8(torch::Tensor x, torch::Tensor w, bool grouped) {
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.scalar_type() == torch::kByte && w.size(1) % 34 == 0,
                "rows_q8: x [M, K], w uint8 [N, nb * 34]");
    (void)grouped;
    const int64_t M = x.size(0), N = w.size(0), nb = w.size(1) / 34, row_bytes = nb * 34;
    const auto xq = q16_rows(float_rows(x, nb * 32).data, M, nb);
    auto wc = w.contiguous();
    Output y({M, N}, x);
    float* yp = y.data;
    const uint8_t* wp = wc.data_ptr<uint8_t>();
    std::vector<Q16Row> xs(M);
    for (int64_t m = 0; m < M; ++m) xs[m] = xq.row(m, nb);
#ifdef MK_WIDE
    const auto chunks = M >= LANE_ROWS ? lane_chunks(xs.data(), M, nb) : std::vector<XLanes>();
    const void* lanes = &chunks;
#else
    const void* lanes = nullptr;
#endif
    // Threads over spans of whole lane sets of weight rows, at least MIN_THREAD_BYTES each.
    const int64_t unit = std::max<int64_t>(LANES, 4), units = (N + unit - 1) / unit;
    const int64_t grain = std::max<int64_t>(1, MIN_THREAD_BYTES / std::max<int64_t>(1, unit * row_bytes * std::max<int64_t>(1, M / 16)));
    at::parallel_for(0, units, grain, [&](int64_t begin, int64_t end) {
        const int64_t n1 = std::min(N, end * unit);
        q8_span(wp, row_bytes, begin * unit, n1, xs.data(), M, nb, lanes, wp + n1 * row_bytes,
                [&](int64_t n, int64_t m, float v) { yp[m * N + n] = v; });
    });
    return y.finish();
}

torch::Tensor experts_q8(torch::Tensor x, torch::Tensor w, torch::Tensor ids, bool grouped) {
    TORCH_CHECK(x.dim() == 3 && w.dim() == 3 && ids.dim() == 2 && w.scalar_type() == torch::kByte && w.size(2) % 34 == 0,
                "experts_q8: x [B, X, K], w uint8 [E, N, nb * 34], ids [B, C]");
    (void)grouped;
    const int64_t B = x.size(0), X = x.size(1), E = w.size(0), N = w.size(1), nb = w.size(2) / 34, C = ids.size(1);
    const int64_t row_bytes = nb * 34;
    TORCH_CHECK(X == 1 || X == C, "experts_q8: x holds one row per token or one per choice");
    const auto xq = q16_rows(float_rows(x, nb * 32).data, B * X, nb);
    auto wc = w.contiguous();
    auto ic = ids.to(torch::kLong).contiguous();
    Output y({B, C, N}, x);
    float* yp = y.data;
    const uint8_t* wp = wc.data_ptr<uint8_t>();
    const auto [first, order] = by_expert(ic.data_ptr<int64_t>(), B * C, E);
    const auto xs = rows_in_order([&](int64_t r) { return xq.row(r, nb); }, order, C, X);
    // Each chosen expert's x rows in lanes, once (where it has enough of them).
    std::vector<std::vector<XLanes>> lanes(E);
#ifdef MK_WIDE
    for (int64_t e = 0; e < E; ++e)
        if (first[e + 1] - first[e] >= LANE_ROWS) lanes[e] = lane_chunks(xs.data() + first[e], first[e + 1] - first[e], nb);
#endif
    const int64_t blocks = (N + 15) / 16;
    const std::vector<int64_t> items = expert_blocks(first, E, blocks);
    at::parallel_for(0, (int64_t)items.size(), 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const int64_t e = items[i] / blocks, blk = items[i] % blocks;
            const int64_t j0 = first[e], R = first[e + 1] - j0;
            // The prefetch runs on through the expert's next rows (the thread's next item, mostly).
            q8_span(wp + e * N * row_bytes, row_bytes, blk * 16, std::min(N, (blk + 1) * 16), xs.data() + j0, R, nb, &lanes[e],
                    wp + (e + 1) * N * row_bytes,
                    [&](int64_t n, int64_t r, float v) { yp[order[j0 + r] * N + n] = v; });
        }
    });
    return y.finish();
}
