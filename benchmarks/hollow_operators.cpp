// Operators with the products' schemas that only allocate their outputs (benchmarks/compiled_step_ab.py
// --hollow): a step's time without its products.
#include <torch/extension.h>
torch::Tensor rows(torch::Tensor x, torch::Tensor w, bool grouped) { return torch::empty({x.size(0), w.size(0)}, x.options()); }
torch::Tensor experts(torch::Tensor x, torch::Tensor w, torch::Tensor ids, bool grouped) {
    return torch::empty({x.size(0), ids.size(1), w.size(1)}, x.options());
}
TORCH_LIBRARY(hollow, m) {
    m.def("rows_gemv(Tensor x, Tensor w, bool grouped=False) -> Tensor");
    m.def("experts_gemv(Tensor x, Tensor w, Tensor ids, bool grouped=False) -> Tensor");
    // The tiles' operators hollowed under other names: a C entry point named after an operator alone
    // (aoti_torch_cpu_rows_tiles) would be the real one's.
    m.def("hollow_rows_tiles(Tensor x, Tensor w, bool grouped=False) -> Tensor");
    m.def("hollow_experts_tiles(Tensor x, Tensor w, Tensor ids, bool grouped=False) -> Tensor");
}
TORCH_LIBRARY_IMPL(hollow, CPU, m) {
    m.impl("rows_gemv", &rows); m.impl("experts_gemv", &experts);
    m.impl("hollow_rows_tiles", &rows); m.impl("hollow_experts_tiles", &experts);
}
