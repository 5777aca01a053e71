// The operators' schemas and CPU kernels, under this build's namespace and names (ops.h).
#include "ops.h"

// Expanded once more so that MOEKIT_NAMESPACE is replaced before TORCH_LIBRARY pastes it.
#define MK_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define MK_LIBRARY_IMPL(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)

MK_LIBRARY(MOEKIT_NAMESPACE, m) {
    m.def(MK_NAME("rows_gemv") "(Tensor x, Tensor w, bool grouped=False) -> Tensor");
    m.def(MK_NAME("experts_gemv") "(Tensor x, Tensor w, Tensor ids, bool grouped=False) -> Tensor");
    m.def(MK_NAME("rows_q8") "(Tensor x, Tensor w, bool grouped=False) -> Tensor");
    m.def(MK_NAME("experts_q8") "(Tensor x, Tensor w, Tensor ids, bool grouped=False) -> Tensor");
    m.def(MK_NAME("rows_argmax") "(Tensor x) -> Tensor");
    m.def(MK_NAME("bf16_tiles") "() -> bool", &bf16_tiles);  // no tensor to dispatch on: one kernel for all
    m.def(MK_NAME("transpose_into") "(Tensor src, Tensor(a!) out) -> ()");
    m.def(MK_NAME("latent_attend") "(Tensor query, Tensor cached, Tensor visible, float scale, int r) -> Tensor");
    m.def(MK_NAME("attend") "(Tensor query, Tensor keys, Tensor values, Tensor allowed, float scale) -> Tensor");
    m.def(MK_NAME("rows_tiles") "(Tensor x, Tensor w) -> Tensor");
    m.def(MK_NAME("experts_tiles") "(Tensor x, Tensor w, Tensor ids) -> Tensor");
    m.def(MK_NAME("mxfp4_gemv") "(Tensor x, Tensor packed) -> Tensor");
    m.def(MK_NAME("fp8_gemv") "(Tensor x, Tensor packed, int block, Tensor lut) -> Tensor");
    m.def(MK_NAME("experts_mxfp4") "(Tensor x, Tensor w, Tensor ids) -> Tensor");
    m.def(MK_NAME("experts_fp8") "(Tensor x, Tensor w, Tensor ids, int block) -> Tensor");
}
MK_LIBRARY_IMPL(MOEKIT_NAMESPACE, CPU, m) {
    m.impl(MK_NAME("rows_gemv"), &rows_gemv);
    m.impl(MK_NAME("experts_gemv"), &experts_gemv);
    m.impl(MK_NAME("rows_q8"), &rows_q8);
    m.impl(MK_NAME("experts_q8"), &experts_q8);
    m.impl(MK_NAME("rows_argmax"), &rows_argmax);
    m.impl(MK_NAME("transpose_into"), &transpose_into);
    m.impl(MK_NAME("latent_attend"), &latent_attend);
    m.impl(MK_NAME("attend"), &attend);
    m.impl(MK_NAME("rows_tiles"), &rows_tiles);
    m.impl(MK_NAME("experts_tiles"), &experts_tiles);
    m.impl(MK_NAME("mxfp4_gemv"), &mxfp4_gemv);
    m.impl(MK_NAME("fp8_gemv"), &fp8_gemv);
    m.impl(MK_NAME("experts_mxfp4"), &experts_mxfp4);
    m.impl(MK_NAME("experts_fp8"), &experts_fp8);
}
