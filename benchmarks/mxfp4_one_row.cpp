// The one-row MXFP4 x bf16 product (src/moekit/ops/csrc/packed.cpp, AVX512-BF16) at gpt-oss-20b's
// expert rows (2880 inputs: 90 blocks, 1530 bytes a row), 16 rows a work item as experts_loop hands
// them out: weight row by weight row (row_dot, the lead's 2 KB-ahead prefetch: the operator before)
// against G weight rows a pass with the one x row (rows_dots<G, 1>, the next pass's rows prefetched:
// G = 4 the operator now). Each from memory (1.2 GB of rows, --threads OpenMP threads over them) and,
// on the calling thread, from L2 (512 rows, 783 KB, thread CPU time: the instructions' own rate).
// Every form's floats are checked equal to row_dot's. The forms alternate within each round.
//
//   g++ -O3 -march=native -fopenmp -o /tmp/mxfp4_one_row benchmarks/mxfp4_one_row.cpp && /tmp/mxfp4_one_row 1 9 && /tmp/mxfp4_one_row 2 9
#include <immintrin.h>
#include <omp.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

using bf = uint16_t;
static const int8_t TWICE[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
static uint16_t TABLE[256 * 16];  // scale byte s, code c → bf16 bits of TWICE[c] · 2^(s − 128)
static uint16_t to_bf16(float f) { uint32_t u; std::memcpy(&u, &f, 4); return uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16); }
static double wall() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
static double cpu() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

// packed.cpp's block_pairs and pair_fma.
static inline __m512bh block_pairs(const uint8_t* w) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 1)));
    const __m512i codes = _mm512_ternarylogic_epi32(b, _mm512_slli_epi32(b, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
    const __m512i table = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(TABLE + 16 * w[0])));
    return (__m512bh)_mm512_permutexvar_epi16(codes, table);
}
static inline __m512 pair_fma(__m512 acc, __m512bh v, const bf* x) { return _mm512_dpbf16_ps(acc, v, (__m512bh)_mm512_loadu_si512(x)); }
static inline float chains_sum(const __m512* a) { return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]))); }

// packed.cpp's row_dot (bf16 x): block g into chain g % 4, 2 lines prefetched 2 KB ahead every 4 blocks.
__attribute__((noinline)) static float row_dot(const uint8_t* w, const bf* x, int64_t groups) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t g = 0; g < groups; g += 4) {
        const char* ahead = reinterpret_cast<const char*>(w + g * 17) + 2048;
        _mm_prefetch(ahead, _MM_HINT_T0);
        _mm_prefetch(ahead + 64, _MM_HINT_T0);
        for (int c = 0; c < 4; ++c)
            if (g + c < groups) acc[c] = pair_fma(acc[c], block_pairs(w + (g + c) * 17), x + (g + c) * 32);
    }
    return chains_sum(acc);
}

// packed.cpp's rows_dots<G, 1> (bf16 x): G weight rows, the same chains each, the next pass's rows prefetched.
template <int G>
__attribute__((noinline)) static void rows_dots(const uint8_t* w, int64_t row_bytes, const bf* x, int64_t groups, float* out) {
    __m512 acc[G][4];
    for (int g = 0; g < G; ++g)
        for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
    const auto step = [&](int c, int64_t b) {
        __m512bh v[G];
        if (c == 0)
            for (int g = 0; g < G; ++g) {
                const char* next = reinterpret_cast<const char*>(w + (g + G) * row_bytes + b * 17);
                _mm_prefetch(next, _MM_HINT_T0);
                _mm_prefetch(next + 64, _MM_HINT_T0);
            }
        for (int g = 0; g < G; ++g) v[g] = block_pairs(w + g * row_bytes + b * 17);
        for (int g = 0; g < G; ++g) acc[g][c] = pair_fma(acc[g][c], v[g], x + b * 32);
    };
    int64_t b = 0;
    for (; b + 4 <= groups; b += 4) {
#pragma GCC unroll 4
        for (int c = 0; c < 4; ++c) step(c, b + c);
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c)
        if (b + c < groups) step(c, b + c);
    for (int g = 0; g < G; ++g) out[g] = chains_sum(acc[g]);
}

constexpr int64_t GROUPS = 90, ROW_BYTES = GROUPS * 17;
enum Form { ROW_BY_ROW, TWO_A_PASS, FOUR_A_PASS, FORMS };
static const char* NAMES[FORMS] = {"row by row (before)", "2 rows a pass", "4 rows a pass (now)"};

// Rows [0, rows) in work items of 16, OpenMP threads over the items (wide) or on the calling thread.
static void run(Form f, const uint8_t* w, const bf* x, int64_t rows, float* y, bool wide) {
#pragma omp parallel for schedule(static) if (wide)
    for (int64_t r = 0; r < rows; r += 16) {
        const uint8_t* item = w + r * ROW_BYTES;
        if (f == ROW_BY_ROW) for (int i = 0; i < 16; ++i) y[r + i] = row_dot(item + i * ROW_BYTES, x, GROUPS);
        if (f == TWO_A_PASS) for (int i = 0; i < 16; i += 2) rows_dots<2>(item + i * ROW_BYTES, ROW_BYTES, x, GROUPS, y + r + i);
        if (f == FOUR_A_PASS) for (int i = 0; i < 16; i += 4) rows_dots<4>(item + i * ROW_BYTES, ROW_BYTES, x, GROUPS, y + r + i);
    }
}

int main(int argc, char** argv) {
    const int threads = argc > 1 ? std::atoi(argv[1]) : 1, rounds = argc > 2 ? std::atoi(argv[2]) : 9;
    const int64_t rows = 800000, small = 512, repeats = 200;  // 1.22 GB; 783 KB
    for (int s = 0; s < 256; ++s)
        for (int c = 0; c < 16; ++c) TABLE[s * 16 + c] = to_bf16(TWICE[c] * std::ldexp(1.0f, s - 128));
    std::vector<uint8_t> w(rows * ROW_BYTES);
    uint64_t state = 1;
    for (auto& b : w) { state = state * 6364136223846793005ULL + 1442695040888963407ULL; b = uint8_t(state >> 56); }
    for (int64_t i = 0; i < rows * GROUPS; ++i) w[i * 17] = uint8_t(120 + i % 5);  // scales 2^-7 .. 2^-3, gpt-oss's range
    std::vector<bf> x(GROUPS * 32);
    for (size_t i = 0; i < x.size(); ++i) x[i] = to_bf16(0.01f * float(int(i % 37) - 18));
    std::vector<float> y(rows), want(small);
    omp_set_num_threads(threads);
    run(ROW_BY_ROW, w.data(), x.data(), small, want.data(), false);
    for (int f = 1; f < FORMS; ++f) {
        run(Form(f), w.data(), x.data(), small, y.data(), false);
        printf("%s: floats equal to row_dot's: %s\n", NAMES[f], std::equal(want.begin(), want.end(), y.begin()) ? "yes" : "NO");
    }
    std::vector<double> memory[FORMS], l2[FORMS];
    for (int r = 0; r < rounds; ++r)
        for (int i = 0; i < FORMS; ++i) {
            const Form f = Form(r % 2 ? FORMS - 1 - i : i);  // the order reversed every other round
            const double t0 = wall();
            run(f, w.data(), x.data(), rows, y.data(), true);
            memory[f].push_back(wall() - t0);
            const double c0 = cpu();
            for (int k = 0; k < repeats; ++k) run(f, w.data(), x.data(), small, y.data(), false);
            l2[f].push_back(cpu() - c0);
        }
    const auto median = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
    printf("load average %s", [] { static char b[64] = {}; FILE* f = std::fopen("/proc/loadavg", "r"); if (f) { std::fgets(b, 63, f); std::fclose(f); } return b; }());
    for (int f = 0; f < FORMS; ++f)
        printf("%-22s from memory, %d thread(s): %5.1f GB/s | in L2, 1 thread CPU time: %.2f ns a block, %5.1f GB/s\n", NAMES[f], threads,
               rows * ROW_BYTES / median(memory[f]) / 1e9, median(l2[f]) / (small * GROUPS * repeats) * 1e9,
               small * ROW_BYTES * repeats / median(l2[f]) / 1e9);
}
