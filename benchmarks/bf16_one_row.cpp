// The bf16 x bf16 one-row products (src/moekit/ops/csrc/rows.h's dot_group, AVX512-BF16: 4 weight rows a
// group, 2 chains each; products.cpp's tiles_dots: blocks of 16 rows in the tiles layout) at gpt-oss-20b's
// lm_head [201088, 2880] (1.16 GB, from memory), against a streaming read of as many bytes, OpenMP threads
// over the rows, the forms alternated in each round; variants: g4pf1k / g4pf2k ask for each row's bytes
// 1 / 2 KB ahead, t1a4 takes tiles one block at a time (the operator: t2a4, 2 blocks, 4 tiles ahead).
// With one thread also each form's rate from L2 (256 rows, thread CPU time): the instructions' own.
// Standalone copies of the kernels (no torch); the weight's values are not checked against the operators.
//
//   g++ -O3 -march=native -fopenmp -o /tmp/bf16_one_row benchmarks/bf16_one_row.cpp && /tmp/bf16_one_row 2 7 && /tmp/bf16_one_row 1 7
#include <immintrin.h>
#include <omp.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <string>
#include <functional>
#include <time.h>
using bf = uint16_t;
static double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
static inline __m512 dp(__m512 a, const bf* w, const bf* x) { return _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(w), (__m512bh)_mm512_loadu_si512(x)); }
// hub layout, GROUP rows, 2 chains each; PF: prefetch distance bytes (0 none)
template <int G, int PF>
static void group(const bf* w, int64_t K, const bf* x, float* out) {
    __m512 a[G][2];
    for (int g = 0; g < G; ++g) a[g][0] = a[g][1] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64)
        for (int g = 0; g < G; ++g) {
            const bf* r = w + g * K + k;
            if (PF) { _mm_prefetch((const char*)r + PF, _MM_HINT_T0); _mm_prefetch((const char*)r + PF + 64, _MM_HINT_T0); }
            a[g][0] = dp(a[g][0], r, x + k);
            a[g][1] = dp(a[g][1], r + 32, x + k + 32);
        }
    for (int g = 0; g < G; ++g) {
        int64_t j = k;
        for (; j + 32 <= K; j += 32) a[g][0] = dp(a[g][0], w + g * K + j, x + j);
        out[g] = _mm512_reduce_add_ps(_mm512_add_ps(a[g][0], a[g][1]));
    }
}
// tiles layout: S blocks of 16 rows
template <int S, int AHEAD>
static void tiles(const bf* w, int64_t K, const bf* x, float* out) {
    __m512 acc[S][16];
    for (int s = 0; s < S; ++s) for (int i = 0; i < 16; ++i) acc[s][i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + k);
        for (int s = 0; s < S; ++s) {
            const bf* t = w + s * 16 * K + k * 16;
            if (AHEAD) { const char* ah = (const char*)(t + AHEAD * 512); for (int i = 0; i < 16; ++i) _mm_prefetch(ah + i * 64, _MM_HINT_T0); }
            for (int i = 0; i < 16; ++i) acc[s][i] = _mm512_dpbf16_ps(acc[s][i], (__m512bh)_mm512_loadu_si512(t + i * 32), xv);
        }
    }
    for (int s = 0; s < S; ++s) for (int i = 0; i < 16; ++i) out[s * 16 + i] = _mm512_reduce_add_ps(acc[s][i]);
}

int main(int argc, char** argv) {
    const int64_t N = 201088, K = 2880;
    int threads = argc > 1 ? atoi(argv[1]) : 2;
    int rounds = argc > 2 ? atoi(argv[2]) : 5;
    std::vector<bf> W(N * K), X(K);
    for (int64_t i = 0; i < N * K; ++i) W[i] = 0x3f80 + (i * 7 % 64);
    for (int64_t i = 0; i < K; ++i) X[i] = 0x3f80 + (i % 17);
    std::vector<float> y(N);
    std::vector<float> big(N * K / 2);
    for (auto& v : big) v = 1.f;
    omp_set_num_threads(threads);
    auto rows = [&](auto fn, int G) {
        const double t0 = now();
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < N; n += G) fn(W.data() + n * K, K, X.data(), y.data() + n);
        return now() - t0;
    };
    std::vector<std::string> names = {"read", "g4", "g4pf2k", "g4pf1k", "t2a4", "t1a4"};
    std::vector<std::vector<double>> ts(names.size());
    float sink = 0;
    for (int r = 0; r < rounds; ++r)
        for (size_t v = 0; v < names.size(); ++v) {
            double t;
            const std::string& n = names[v];
            if (n == "read") {
                const double t0 = now(); float tot = 0;
#pragma omp parallel reduction(+ : tot)
                {
                    const int id = omp_get_thread_num(), T = omp_get_num_threads();
                    const int64_t M = big.size(), b = M / T * id, e = id == T - 1 ? M : M / T * (id + 1);
                    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                    for (int64_t i = b; i + 64 <= e; i += 64) {
                        a0 = _mm512_add_ps(a0, _mm512_loadu_ps(&big[i])); a1 = _mm512_add_ps(a1, _mm512_loadu_ps(&big[i + 16]));
                        a2 = _mm512_add_ps(a2, _mm512_loadu_ps(&big[i + 32])); a3 = _mm512_add_ps(a3, _mm512_loadu_ps(&big[i + 48]));
                    }
                    tot += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
                }
                sink += tot; t = now() - t0;
            } else if (n == "g4") t = rows(group<4, 0>, 4);
            else if (n == "g4pf2k") t = rows(group<4, 2048>, 4);
            else if (n == "g4pf1k") t = rows(group<4, 1024>, 4);
            else if (n == "t2a4") t = rows(tiles<2, 4>, 32);
            else if (n == "t1a4") t = rows(tiles<1, 4>, 16);
            else if (n == "t1a8") t = rows(tiles<1, 8>, 16);
            else if (n == "t2a0") t = rows(tiles<2, 0>, 32);
            else t = rows(tiles<1, 0>, 16);
            ts[v].push_back(t);
        }
    // compute rate: the same kernels on 256 rows (1.47 MB, in L2), thread CPU time, one thread
    if (threads == 1) {
        auto cpu = [] { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec + 1e-9 * t.tv_nsec; };
        auto small = [&](auto fn, int G) { const double c0 = cpu(); for (int rep = 0; rep < 400; ++rep) for (int64_t n = 0; n < 256; n += G) fn(W.data() + n * K, K, X.data(), y.data() + n); return cpu() - c0; };
        std::vector<std::pair<const char*, std::function<double()>>> vs = {
            {"g4", [&] { return small(group<4, 0>, 4); }}, {"g4pf2k", [&] { return small(group<4, 2048>, 4); }},
            {"t2a4", [&] { return small(tiles<2, 4>, 32); }}, {"t1a4", [&] { return small(tiles<1, 4>, 16); }}};
        for (auto& [name, f] : vs) { std::vector<double> t; for (int r = 0; r < 5; ++r) t.push_back(f()); std::sort(t.begin(), t.end());
            printf("L2 %-8s %5.1f GB/s (cpu time)\n", name, 256.0 * K * 2 * 400 / t[2] / 1e9); }
    }
    const double bytes = double(N) * K * 2;
    for (size_t v = 0; v < names.size(); ++v) {
        auto s = ts[v]; std::sort(s.begin() + 1, s.end());
        double med = s[1 + (s.size() - 1) / 2];
        printf("%-8s %7.2f ms %5.1f GB/s\n", names[v].c_str(), med * 1e3, bytes / med / 1e9);
    }
    printf("sink %f %f\n", sink, y[5]);
}
