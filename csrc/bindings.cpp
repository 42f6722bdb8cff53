// The one Python binding file of the CPU extension fedfast._C (ops are registered with torch.library
// on the Python side, in fedfast/ops/*.py, which call these functions).
#include <torch/extension.h>

#include "fedfast_cpu.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fedfast CPU kernels";
  m.def("distill_rows", &fedfast::distill_rows_cpu,
        "fused CE + distillation rows (FEDFAST_DISTILL_ROWS): (loss [R], dL/dz [R, C], status)");
  m.def("teacher_mixture", &fedfast::teacher_mixture_cpu, "FedGKD-VOTE mixture: (P [R, C], negent [R])");
  m.def("asd_weights", &fedfast::asd_weights_cpu, "ASD alphahat [R]");
  m.def("asd_row_weight", &fedfast::asd_row_weight_cpu,
        "ASD KD row weights n_seg alpha_i [R], prior check: (rw, status)");
  m.def("aggregate", &fedfast::aggregate_cpu, "fused server update (see fedfast/ops/aggregate_reference.py)");
  m.def("update_norms", &fedfast::update_norms_cpu, "||X_k - g|| of the rows (DP-FedAvg's clipping)");
  m.def("client_step", &fedfast::client_step_cpu, "fused all-client optimizer step, in place");
  m.def("client_adam", &fedfast::client_adam_cpu, "fused all-client Adam / AdamW step, in place");
  m.def("row_scale", &fedfast::row_scale_cpu, "reduction weights + target/segment validation: (scale, status)");
}
