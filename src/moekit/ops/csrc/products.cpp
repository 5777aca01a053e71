// fp32 / bf16 products: rows_gemv, experts_gemv, and the tiles layout's rows_tiles, experts_tiles.
#include "ops.h"
#include "rows.h"

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
// block is one contiguous stream of 32 K bytes (moekit.ops.to_tiles writes it). Read in the
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

// Whether a batch's bf16 products run on AMX tiles here (built with them, and the OS grants them).
bool bf16_tiles() {
#ifdef MK_AMX
    return amx_ready();
#else
    return false;
#endif
}
