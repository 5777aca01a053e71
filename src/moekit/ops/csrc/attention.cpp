// Decode attention over the cache read in place: attend (grouped-query), latent_attend (MLA).
#include "ops.h"
#include "rows.h"

#if MK_WIDE == 16
// e^x for x <= 0, 16 lanes: x = n ln2 + r, |r| <= ln2 / 2, e^r by its Taylor polynomial to r^7
// (relative error ~1e-7), times 2^n by scalef; -inf gives 0, and x below -88 gives e^-88.
static inline VF vexp_neg(VF x) {
    const __mmask16 finite = _mm512_cmp_ps_mask(x, vset(-INFINITY), _CMP_NEQ_UQ);
    x = _mm512_max_ps(x, vset(-88.f));
    const VF n = _mm512_roundscale_ps(_mm512_mul_ps(x, vset(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    VF r = _mm512_fnmadd_ps(n, vset(0.693359375f), x);  // ln2 in two parts: n · ln2 exact enough
    r = _mm512_fnmadd_ps(n, vset(-2.12194440e-4f), r);
    VF p = vset(1.f / 5040);
    for (const float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = vfma(p, r, vset(c));
    return _mm512_maskz_mov_ps(finite, _mm512_scalef_ps(p, n));
}
#endif

// One head's attention over the cache at decode, a task on the thread pool (latent_attend: MLA's
// heads, the keys and values one latent cache; attend: grouped-query heads): the scores
// query · keys over the visible positions, their softmax, and Σ_s p_s · values[s, :R]. Inductor's
// fused loops for the same ran on one thread (a perf profile of deepseek_v3-1b's bf16 step: 1.5 µs
// per cached position per layer). Scores are taken 8 positions at a time (each chunk of the query
// loaded once for 8 rows, 8 independent chains), the exponentials 16 lanes at a time with AVX-512
// (the two: 55 against 68 µs for 16 heads over 300 positions, 2 threads), and the weighted sum keeps up
// to 8 vectors of the output in registers across the positions; a masked position is skipped.
// keys and values: rows a stride of ss apart, one per position.
template <typename W>
static void attend_head(const float* q, const W* keys, const W* values, int64_t ss, const bool* vis, int64_t S,
                        int64_t C, int64_t R, float scale, float* out, float* p) {
    int64_t s = 0;
#ifdef MK_WIDE
    constexpr int L = MK_WIDE, P = 8;
    for (; s + P <= S; s += P) {
        VF a[P];
        for (int i = 0; i < P; ++i) a[i] = vzero();
        int64_t k = 0;
        for (; k + L <= C; k += L) {
            const VF qk = vload(q + k);
            for (int i = 0; i < P; ++i) a[i] = vfma(vload(keys + (s + i) * ss + k), qk, a[i]);
        }
        for (int i = 0; i < P; ++i) {
            float acc = vsum(a[i]);
            for (int64_t j = k; j < C; ++j) acc += static_cast<float>(keys[(s + i) * ss + j]) * q[j];
            p[s + i] = acc;
        }
    }
#endif
    for (; s < S; ++s) p[s] = dot(keys + s * ss, q, C);
    float top = -INFINITY;
    for (s = 0; s < S; ++s) {
        p[s] = vis[s] ? p[s] * scale : -INFINITY;
        top = std::max(top, p[s]);
    }
    float sum = 0.f;
    s = 0;
#if MK_WIDE == 16
    VF total = vzero();
    for (; s + L <= S; s += L) {  // a masked position's -inf: 0
        const VF e = vexp_neg(_mm512_sub_ps(vload(p + s), vset(top)));
        vstore(p + s, e);
        total = vadd(total, e);
    }
    sum = vsum(total);
#endif
    for (; s < S; ++s) {
        p[s] = vis[s] ? std::exp(p[s] - top) : 0.f;
        sum += p[s];
    }
    const float inv = 1.f / sum;  // a decode row sees its own position: sum >= 1
    for (s = 0; s < S; ++s) p[s] *= inv;
    int64_t k = 0;
#ifdef MK_WIDE
    constexpr int V = 8;
    while (k + L <= R) {
        const int n = static_cast<int>(std::min<int64_t>(V, (R - k) / L));  // vectors in this chunk
        VF acc[V];
        for (int j = 0; j < V; ++j) acc[j] = vzero();
        for (s = 0; s < S; ++s) {
            if (!vis[s]) continue;
            const VF ps = vset(p[s]);
            const W* row = values + s * ss + k;
            if (n == V)  // a full chunk: a loop of constant length, unrolled
                for (int j = 0; j < V; ++j) acc[j] = vfma(ps, vload(row + j * L), acc[j]);
            else
                for (int j = 0; j < n; ++j) acc[j] = vfma(ps, vload(row + j * L), acc[j]);
        }
        for (int j = 0; j < n; ++j) vstore(out + k + j * L, acc[j]);
        k += n * L;
    }
#endif
    for (; k < R; ++k) {
        float acc = 0.f;
        for (s = 0; s < S; ++s)
            if (vis[s]) acc += p[s] * static_cast<float>(values[s * ss + k]);
        out[k] = acc;
    }
}

// query [B, H, C] fp32, cached [B, S, C'] fp32 or bf16 (C' >= C; the cache stack read in place: any
// row strides, positions contiguous), visible [B, S] bool → [B, H, R] fp32 (R <= C).
torch::Tensor latent_attend(torch::Tensor query, torch::Tensor cached, torch::Tensor visible, double scale, int64_t R) {
    TORCH_CHECK(query.dim() == 3 && query.scalar_type() == torch::kFloat, "latent_attend: query fp32 [B, H, C]");
    TORCH_CHECK(cached.dim() == 3 && cached.size(0) == query.size(0) && cached.size(2) >= query.size(2) && cached.stride(2) == 1
                && (cached.scalar_type() == torch::kFloat || cached.scalar_type() == torch::kBFloat16),
                "latent_attend: cached fp32 or bf16 [B, S, C], its last dim contiguous");
    TORCH_CHECK(visible.dim() == 2 && visible.size(0) == query.size(0) && visible.size(1) == cached.size(1)
                && visible.scalar_type() == torch::kBool, "latent_attend: visible bool [B, S]");
    TORCH_CHECK(R > 0 && R <= query.size(2), "latent_attend: 0 < r <= C");
    const int64_t B = query.size(0), H = query.size(1), C = query.size(2), S = cached.size(1);
    const auto qc = query.contiguous();
    const auto vc = visible.contiguous();
    auto out = torch::empty({B, H, R}, query.options());
    const float* q = qc.data_ptr<float>();
    const bool* vis = vc.data_ptr<bool>();
    float* o = out.data_ptr<float>();
    const int64_t sb = cached.stride(0), ss = cached.stride(1);
    const bool bf16 = cached.scalar_type() == torch::kBFloat16;
    const void* base = cached.data_ptr();
    at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> p(S);
        for (int64_t i = begin; i < end; ++i) {
            const int64_t b = i / H;
            if (bf16) {
                const auto* row = static_cast<const c10::BFloat16*>(base) + b * sb;
                attend_head(q + i * C, row, row, ss, vis + b * S, S, C, R, float(scale), o + i * R, p.data());
            } else {
                const auto* row = static_cast<const float*>(base) + b * sb;
                attend_head(q + i * C, row, row, ss, vis + b * S, S, C, R, float(scale), o + i * R, p.data());
            }
        }
    });
    return out;
}

// Grouped-query attention at decode, the cache read in place: query [B, Hkv, G, D] fp32, keys and
// values [B, Hkv, S, D] fp32 or bf16 (views of the cache stack: the same strides, D contiguous),
// allowed [B, S] bool → [B, Hkv, G, D] fp32, softmax(q . keys * scale) . values over the allowed
// positions; one (row, query head) a task, as latent_attend. In the graph the same was a bf16
// cache widened to fp32 copies (keys and values, every layer, every step: growing with the
// context), two batched matmuls and a softmax, ~90 µs a layer for a bf16 batch of 8 at 40 positions.
torch::Tensor attend(torch::Tensor query, torch::Tensor keys, torch::Tensor values, torch::Tensor allowed, double scale) {
    TORCH_CHECK(query.dim() == 4 && query.scalar_type() == torch::kFloat, "attend: query fp32 [B, Hkv, G, D]");
    TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes() && keys.strides() == values.strides()
                && keys.scalar_type() == values.scalar_type() && keys.stride(3) == 1
                && (keys.scalar_type() == torch::kFloat || keys.scalar_type() == torch::kBFloat16),
                "attend: keys and values fp32 or bf16 [B, Hkv, S, D] alike, D contiguous");
    const int64_t B = query.size(0), Hkv = query.size(1), G = query.size(2), D = query.size(3), S = keys.size(2);
    TORCH_CHECK(keys.size(0) == B && keys.size(1) == Hkv && keys.size(3) == D, "attend: keys [B, Hkv, S, D] for query [B, Hkv, G, D]");
    TORCH_CHECK(allowed.dim() == 2 && allowed.size(0) == B && allowed.size(1) == S && allowed.scalar_type() == torch::kBool,
                "attend: allowed bool [B, S]");
    const auto qc = query.contiguous();
    const auto ac = allowed.contiguous();
    auto out = torch::empty({B, Hkv, G, D}, query.options());
    const float* q = qc.data_ptr<float>();
    const bool* vis = ac.data_ptr<bool>();
    float* o = out.data_ptr<float>();
    const int64_t sb = keys.stride(0), sh = keys.stride(1), ss = keys.stride(2);
    const bool bf16 = keys.scalar_type() == torch::kBFloat16;
    const void* kp = keys.data_ptr();
    const void* vp = values.data_ptr();
    at::parallel_for(0, B * Hkv * G, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> p(S);
        for (int64_t i = begin; i < end; ++i) {
            const int64_t b = i / (Hkv * G), at = b * sb + (i / G % Hkv) * sh;
            if (bf16)
                attend_head(q + i * D, static_cast<const c10::BFloat16*>(kp) + at, static_cast<const c10::BFloat16*>(vp) + at,
                            ss, vis + b * S, S, D, D, float(scale), o + i * D, p.data());
            else
                attend_head(q + i * D, static_cast<const float*>(kp) + at, static_cast<const float*>(vp) + at,
                            ss, vis + b * S, S, D, D, float(scale), o + i * D, p.data());
        }
    });
    return out;
}
