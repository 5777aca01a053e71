// The row-product kernels and the loops over weight rows and experts that the fp32/bf16 and q8_0
// products share (products.cpp, q8.cpp), and one weight row's dot that attention reuses.
#pragma once
#include "vec.h"

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
// One weight row at a time, against up to 4 x rows (one chain per pair). Four weight rows side by
// side (G = 4, 16 chains) read the weight as four interleaved streams, and on an AMD EPYC (Zen 4) a
// 32000 x 512 bf16 head at 2, 4, 8, 16 rows took 4.1, 4.5, 5.8, 11.1 ms against 2.4, 2.6, 2.8, 5.5 ms
// one weight row at a time (1 thread, under load; docs/BENCHMARKS.md). The floats are the same either
// way: each pair keeps its own chain.
template <>
struct Block<c10::BFloat16, c10::BFloat16> {
    static constexpr int G = 1, R = 4;
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
static inline bool amx_ready() {
    static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return ok;
}

// Tile rows: x rows in a tile are always 16, the unused ones zero (the tiles' multiply costs nothing
// next to the weight's bytes), so one configuration serves every call and every expert.
static constexpr int64_t AMX_ROWS = 16;

static inline void amx_configure() {
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
static inline void amx_pairs(const c10::BFloat16* const* xs, int64_t R, int64_t K, uint32_t* out) {
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
static inline void amx_rows(const c10::BFloat16* x, int64_t M, const c10::BFloat16* w, int64_t N, int64_t K, float* y) {
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
static inline std::pair<std::vector<AmxGroup>, std::vector<uint32_t>> amx_groups(int64_t E, int64_t K, const std::vector<int64_t>& first,
                                                                           const std::vector<const c10::BFloat16*>& xs) {
    std::vector<AmxGroup> groups;
    for (int64_t e = 0; e < E; ++e)
        for (int64_t j0 = first[e]; j0 < first[e + 1]; j0 += AMX_ROWS)
            groups.push_back({e, j0, std::min<int64_t>(AMX_ROWS, first[e + 1] - j0), j0 * (K / 2)});
    std::vector<uint32_t> pairs((int64_t)xs.size() * (K / 2) + AMX_PAIRS_TAIL);
    for (const AmxGroup& g : groups) amx_pairs(xs.data() + g.j0, g.R, K, pairs.data() + g.at);
    return {groups, pairs};
}

static inline void amx_experts(const c10::BFloat16* w, int64_t E, int64_t N, int64_t K, const std::vector<int64_t>& first,
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
static inline std::pair<std::vector<int64_t>, std::vector<int64_t>> by_expert(const int64_t* ids, int64_t P, int64_t E) {
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

// Work items (expert, block of 16 outputs), as e * blocks + blk, for each expert with rows: a lone
// row still spreads over the threads.
static inline std::vector<int64_t> expert_blocks(const std::vector<int64_t>& first, int64_t E, int64_t blocks) {
    std::vector<int64_t> items;
    for (int64_t e = 0; e < E; ++e)
        if (first[e + 1] > first[e])
            for (int64_t blk = 0; blk < blocks; ++blk) items.push_back(e * blocks + blk);
    return items;
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
    const int64_t blocks = (N + 15) / 16;
    const std::vector<int64_t> items = expert_blocks(first, E, blocks);
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

static inline FloatRows float_rows(const torch::Tensor& x, int64_t width) {
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
