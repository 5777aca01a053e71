// llama.cpp's one-row products (ggml's CPU mul_mat / mul_mat_id, as its decode runs them) at one
// shape, from memory, and a plain streaming read: the other side of benchmarks/row_products.py, which
// builds this file as a plain shared library (no torch) and calls it through ctypes, taking turns
// with moekit's operators in one process. A bench holds `copies` products of one shape on distinct
// weights (`bytes` of what the products read, so each is read from memory) in one graph, run by one persistent thread
// pool, as llama.cpp's decode runs its graph (the pool's barrier between nodes). The pool does not
// poll between graphs (poll 0), so its threads leave the cores to the other side's turn.
#include <ggml.h>
#include <ggml-cpu.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <random>
#include <vector>

namespace {
double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

struct Bench {
    ggml_context* ctx = nullptr;
    ggml_cgraph* graph = nullptr;
    ggml_threadpool* pool = nullptr;
    ggml_cplan plan{};
    std::vector<uint8_t> work;
    int copies = 0;
};
}  // namespace

extern "C" {

// type: 0 f32, 1 q8_0, 2 bf16. experts 0: a weight [N, K] times x [K]; else a stack [experts, N, K] of which
// x's one row chooses `chosen` distinct experts (mul_mat_id). Returns null where the context fails.
void* bench_new(int type, long long N, long long K, long long experts, long long chosen, int threads, long long bytes) {
    const ggml_type t = type == 1 ? GGML_TYPE_Q8_0 : type == 2 ? GGML_TYPE_BF16 : GGML_TYPE_F32;
    const long long stack = std::max(experts, 1LL);
    const size_t wbytes = ggml_row_size(t, K) * N * stack, read = ggml_row_size(t, K) * N * (experts ? chosen : 1);
    auto* b = new Bench;
    b->copies = (int)std::max<long long>(1, bytes / (long long)read);
    ggml_init_params params = {b->copies * (wbytes + 4096) + (size_t)(16 << 20), nullptr, false};
    b->ctx = ggml_init(params);
    if (!b->ctx) { delete b; return nullptr; }
    std::mt19937 gen(1);
    std::normal_distribution<float> normal;
    std::vector<float> src(K * N * stack);
    for (auto& v : src) v = normal(gen);
    std::vector<uint8_t> packed(wbytes);
    if (t == GGML_TYPE_Q8_0) ggml_quantize_chunk(t, src.data(), packed.data(), 0, N * stack, K, nullptr);
    else if (t == GGML_TYPE_BF16) ggml_fp32_to_bf16_row(src.data(), (ggml_bf16_t*)packed.data(), N * stack * K);
    else std::memcpy(packed.data(), src.data(), wbytes);
    ggml_tensor* x = ggml_new_tensor_3d(b->ctx, GGML_TYPE_F32, K, 1, 1);
    for (long long k = 0; k < K; ++k) ((float*)x->data)[k] = normal(gen);
    b->graph = ggml_new_graph_custom(b->ctx, 3 * b->copies + 16, false);  // nodes, and leafs: a weight and ids a copy
    for (int i = 0; i < b->copies; ++i) {
        ggml_tensor* w = experts ? ggml_new_tensor_3d(b->ctx, t, K, N, experts) : ggml_new_tensor_2d(b->ctx, t, K, N);
        std::memcpy(w->data, packed.data(), wbytes);
        ggml_tensor* ids = nullptr;  // copy i chooses experts i, i + E / C, ... (mod E), as row_products.py's calls do
        if (experts) {
            ids = ggml_new_tensor_2d(b->ctx, GGML_TYPE_I32, chosen, 1);
            for (long long c = 0; c < chosen; ++c) ((int32_t*)ids->data)[c] = (int32_t)((c * (experts / chosen) + i) % experts);
        }
        ggml_build_forward_expand(b->graph, experts ? ggml_mul_mat_id(b->ctx, w, x, ids) : ggml_mul_mat(b->ctx, w, x));
    }
    ggml_threadpool_params tpp = ggml_threadpool_params_default(threads);
    tpp.poll = 0;
    b->pool = ggml_threadpool_new(&tpp);
    b->plan = ggml_graph_plan(b->graph, threads, b->pool);
    b->work.resize(b->plan.work_size + 64);
    b->plan.work_data = b->work.data();
    return b;
}

int bench_copies(void* p) { return static_cast<Bench*>(p)->copies; }

// Seconds for one pass over every copy.
double bench_run(void* p) {
    auto* b = static_cast<Bench*>(p);
    const double t0 = now();
    ggml_graph_compute(b->graph, &b->plan);
    return now() - t0;
}

void bench_free(void* p) {
    auto* b = static_cast<Bench*>(p);
    ggml_threadpool_free(b->pool);
    ggml_free(b->ctx);
    delete b;
}

// Sum of n floats, 4 vector chains per thread, threads over contiguous halves: the rate a product
// could read its weight at if its arithmetic were free. Returns seconds.
double stream_read(const float* p, long long n, int threads, float* sink) {
    const double t0 = now();
    float total = 0.f;
#pragma omp parallel num_threads(threads) reduction(+ : total)
    {
        const int t = omp_get_thread_num(), T = omp_get_num_threads();
        const long long b = n / T * t, e = t == T - 1 ? n : n / T * (t + 1);
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (long long i = b; i + 64 <= e; i += 64) {
            a0 = _mm512_add_ps(a0, _mm512_loadu_ps(p + i));
            a1 = _mm512_add_ps(a1, _mm512_loadu_ps(p + i + 16));
            a2 = _mm512_add_ps(a2, _mm512_loadu_ps(p + i + 32));
            a3 = _mm512_add_ps(a3, _mm512_loadu_ps(p + i + 48));
        }
        total += _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    }
    *sink = total;
    return now() - t0;
}
}
