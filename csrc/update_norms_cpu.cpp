// Each participating client's update norm ||X_k - g|| (DP-FedAvg's clipping, fedfast/ops/aggregate.py;
// float64 spec: fedfast/ops/aggregate_reference.py, update_norms_reference). Rows are split across threads; each
// row is streamed once against g; the squares are summed in double (eight lanes), so a P of millions keeps float
// rounding out of the norm. Bytes: n*P*x (client rows) + P*4 (g, from cache).
#include <ATen/Parallel.h>

#include <cmath>

#include "fedfast_cpu.h"

namespace fedfast {
namespace {

template <typename X>
void norms_impl(const X* xp, const int64_t* rows, int64_t n, int64_t P, const float* g, float* out) {
  at::parallel_for(0, n, 1, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const X* __restrict xr = xp + rows[k] * P;
      double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // eight independent lanes: vectorisable, in double
      int64_t j = 0;
      for (; j + 8 <= P; j += 8)
        for (int i = 0; i < 8; ++i) {
          const double d = static_cast<double>(static_cast<float>(xr[j + i]) - g[j + i]);
          acc[i] += d * d;
        }
      double total = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
      for (; j < P; ++j) {
        const double d = static_cast<double>(static_cast<float>(xr[j]) - g[j]);
        total += d * d;
      }
      out[k] = static_cast<float>(std::sqrt(total));
    }
  });
}

}  // namespace

at::Tensor update_norms_cpu(const at::Tensor& X_in, const at::Tensor& rows_in, const at::Tensor& g_in) {
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
