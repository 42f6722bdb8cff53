// Each participating client's update norm ||X_k - g|| (DP-FedAvg's clipping, fedfast/ops/aggregate.py;
// float64 spec: fedfast/ops/aggregate_reference.py, update_norms_reference). Rows are split across threads; each
// row is streamed once against g (row_math.h's sq_dist: float lanes per block of 512 columns, the blocks in
// double; 52 ms for 1000 rows of 199,210 values on the 2-core VM against the aggregation's 38 ms for the same
// bytes; the all-double loop took 63 ms; both need setup.py's -fno-wrapv to vectorise). The engine reads the norms
// from the client step instead (delta_norm, client_step_cpu.cpp); this pass serves rows trained elsewhere.
// Bytes: n*P*x (client rows) + P*4 (g, from cache).
#include <ATen/Parallel.h>

#include <cmath>

#include "fedfast_cpu.h"
#include "row_math.h"

namespace fedfast {
namespace {

template <typename X>
void norms_impl(const X* xp, const int64_t* rows, int64_t n, int64_t P, const float* g, float* out) {
  at::parallel_for(0, n, 1, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) out[k] = static_cast<float>(std::sqrt(sq_dist<X>(xp + rows[k] * P, g, P)));
  });
}

}  // namespace

FEDFAST_UPDATE_NORMS(update_norms_cpu) {
  const at::Tensor X = X_in.contiguous(), rows = rows_in.to(at::kLong).contiguous();
  const at::Tensor g = g_in.to(at::kFloat).contiguous();
  const int64_t n = rows.size(0), P = X.size(1);
  TORCH_CHECK(g.numel() == P, "update_norms: global_params must have one value per column");
  at::Tensor out = at::empty({n}, g.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, X.scalar_type(), "update_norms_cpu", [&] {
    using XT = scalar_t;
    if constexpr (std::is_same_v<XT, double>) {
      TORCH_CHECK(false, "update_norms_cpu: fp64 client rows go through the reference");
    } else {
      norms_impl<XT>(X.data_ptr<XT>(), rows.data_ptr<int64_t>(), n, P, g.data_ptr<float>(),
                     out.data_ptr<float>());
    }
  });
  return out;
}

}  // namespace fedfast
