// C entry points for the compiled step's generated C++ (Inductor's cpp_wrapper, told of them by
// moekit.ops.shims): without them it calls each operator through the boxed dispatcher, ~1.8 µs more
// a call (measured), 41 calls a step on the ~140M qwen3_moe. Named aoti_torch_cpu_<operator name>.
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>
#include "ops.h"

static const torch::Tensor& held(AtenTensorHandle h) { return *torch::aot_inductor::tensor_handle_to_tensor_pointer(h); }
#define MK_RETURN(expr) AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({ *ret0 = torch::aot_inductor::new_tensor_handle(expr); })
#define MK_SHIM(name) MK_CAT(MK_CAT(aoti_torch_cpu_, name), MOEKIT_SUFFIX)

extern "C" {
AOTI_TORCH_EXPORT AOTITorchError MK_SHIM(rows_gemv)(AtenTensorHandle x, AtenTensorHandle w, int32_t grouped, AtenTensorHandle* ret0) {
    MK_RETURN(rows_gemv(held(x), held(w), grouped != 0))
}
AOTI_TORCH_EXPORT AOTITorchError MK_SHIM(experts_gemv)(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle ids, int32_t grouped, AtenTensorHandle* ret0) {
    MK_RETURN(experts_gemv(held(x), held(w), held(ids), grouped != 0))
}
AOTI_TORCH_EXPORT AOTITorchError MK_SHIM(rows_q8)(AtenTensorHandle x, AtenTensorHandle w, int32_t grouped, AtenTensorHandle* ret0) {
    MK_RETURN(rows_q8(held(x), held(w), grouped != 0))
}
AOTI_TORCH_EXPORT AOTITorchError MK_SHIM(experts_q8)(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle ids, int32_t grouped, AtenTensorHandle* ret0) {
    MK_RETURN(experts_q8(held(x), held(w), held(ids), grouped != 0))
}
AOTI_TORCH_EXPORT AOTITorchError MK_SHIM(latent_attend)(AtenTensorHandle query, AtenTensorHandle cached, AtenTensorHandle visible, double scale, int64_t r, AtenTensorHandle* ret0) {
    MK_RETURN(latent_attend(held(query), held(cached), held(visible), scale, r))
}
AOTI_TORCH_EXPORT AOTITorchError MK_SHIM(attend)(AtenTensorHandle query, AtenTensorHandle keys, AtenTensorHandle values, AtenTensorHandle allowed, double scale, AtenTensorHandle* ret0) {
    MK_RETURN(attend(held(query), held(keys), held(values), held(allowed), scale))
}
AOTI_TORCH_EXPORT AOTITorchError MK_SHIM(rows_tiles)(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle* ret0) {
    MK_RETURN(rows_tiles(held(x), held(w)))
}
AOTI_TORCH_EXPORT AOTITorchError MK_SHIM(experts_tiles)(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle ids, AtenTensorHandle* ret0) {
    MK_RETURN(experts_tiles(held(x), held(w), held(ids)))
}
AOTI_TORCH_EXPORT AOTITorchError MK_SHIM(experts_mxfp4)(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle ids, AtenTensorHandle* ret0) {
    MK_RETURN(experts_mxfp4(held(x), held(w), held(ids)))
}
AOTI_TORCH_EXPORT AOTITorchError MK_SHIM(experts_fp8)(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle ids, int64_t block, AtenTensorHandle* ret0) {
    MK_RETURN(experts_fp8(held(x), held(w), held(ids), block))
}
}
