// The operators every source defines and register.cpp / shims.cpp expose, and the names one build
// gives them. One set of sources is built once per ISA variant (moekit.ops.build); the variant's
// namespace and name suffix come in as defines (-DMOEKIT_NAMESPACE=moekit_avx2 -DMOEKIT_SUFFIX=_avx2),
// because Inductor names a custom operator's C entry point after the operator alone, so two builds
// loaded in one process need two names.
#pragma once
#include <torch/extension.h>

#ifndef MOEKIT_NAMESPACE
#define MOEKIT_NAMESPACE moekit
#endif
#ifndef MOEKIT_SUFFIX
#define MOEKIT_SUFFIX
#endif
#define MK_STR2(x) #x
#define MK_STR(x) MK_STR2(x)
#define MK_CAT2(a, b) a##b
#define MK_CAT(a, b) MK_CAT2(a, b)
// An operator's schema name in this build: MK_NAME("rows_gemv") is "rows_gemv" or "rows_gemv_avx2".
#define MK_NAME(name) name MK_STR(MOEKIT_SUFFIX)

torch::Tensor rows_gemv(torch::Tensor x, torch::Tensor w, bool grouped);
torch::Tensor experts_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor ids, bool grouped);
torch::Tensor rows_tiles(torch::Tensor x, torch::Tensor w);
torch::Tensor experts_tiles(torch::Tensor x, torch::Tensor w, torch::Tensor ids);
bool bf16_tiles();
torch::Tensor rows_q8(torch::Tensor x, torch::Tensor w, bool grouped);
torch::Tensor experts_q8(torch::Tensor x, torch::Tensor w, torch::Tensor ids, bool grouped);
torch::Tensor rows_argmax(torch::Tensor x);
void transpose_into(torch::Tensor src, torch::Tensor out);
torch::Tensor latent_attend(torch::Tensor query, torch::Tensor cached, torch::Tensor visible, double scale, int64_t R);
torch::Tensor attend(torch::Tensor query, torch::Tensor keys, torch::Tensor values, torch::Tensor allowed, double scale);
torch::Tensor mxfp4_gemv(torch::Tensor x, torch::Tensor packed);
torch::Tensor fp8_gemv(torch::Tensor x, torch::Tensor packed, int64_t block, torch::Tensor lut);
torch::Tensor experts_mxfp4(torch::Tensor x, torch::Tensor w, torch::Tensor ids);
torch::Tensor experts_fp8(torch::Tensor x, torch::Tensor w, torch::Tensor ids, int64_t block);
