// Fused server update on the CPU: one pass over the participating client rows (formulas:
// fedfast/ops/aggregate_reference.py): the weighted average, the server rule m' = beta m + scale (g - avg),
// g' = g - lr m', an optional per-client state-row update R_k' = R_k + shift + a_k (X_k - g) with the column sum
// of its changes, and an optional ring-buffer write B[slot] = g'. An optional avg_shift [P] starts the average
// (DP-FedAvg: the clipped deltas' weights are not normalised; fedfast/ops/aggregate.py). Columns are split in blocks across threads;
// inside a block the rows are streamed once (row-major reads, vectorised over columns). Non-finite values are
// detected per row. Bytes: n*P*x (client rows) + 4P*(2 + 2*[momentum] + [M ring reads + 1 write]) + 8*n*P with
// state rows (read + write) + 4P*[shift, change].
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "fedfast_cpu.h"

namespace fedfast {
namespace {

constexpr int64_t kBlock = 16384;

template <typename X>
void aggregate_impl(const X* xp, const int64_t* rows, int64_t n, int64_t P, const float* g, const float* w,
                    double beta, double scale, double lr, const float* m_in, float* m_out, const float* r_in,
                    float* r_out, const float* coef, const float* shift, float* change, const float* ring_in,
                    float* ring_out, int64_t M, int64_t slot, float* g_out, float* avg_out, char* bad_blocks,
                    const float* avg_shift) {
  const int64_t nb = (P + kBlock - 1) / kBlock;
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> avg(kBlock), dc(kBlock), newg(kBlock);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t j0 = blk * kBlock, len = std::min(kBlock, P - j0);
      for (int64_t j = 0; j < len; ++j) avg[j] = avg_shift ? avg_shift[j0 + j] : 0.f, dc[j] = 0.f;
      float* __restrict a = avg.data();
      int64_t k = 0;
      for (; k + 4 <= n; k += 4) {  // four rows per pass: a quarter of the accumulator traffic, 4 streams
        const X* __restrict x0 = xp + rows[k] * P + j0;
        const X* __restrict x1 = xp + rows[k + 1] * P + j0;
        const X* __restrict x2 = xp + rows[k + 2] * P + j0;
        const X* __restrict x3 = xp + rows[k + 3] * P + j0;
        const float w0 = w[k], w1 = w[k + 1], w2 = w[k + 2], w3 = w[k + 3];
        for (int64_t j = 0; j < len; ++j)
          a[j] += (w0 * static_cast<float>(x0[j]) + w1 * static_cast<float>(x1[j])) +
                  (w2 * static_cast<float>(x2[j]) + w3 * static_cast<float>(x3[j]));
      }
      for (; k < n; ++k) {
        const X* __restrict xr = xp + rows[k] * P + j0;
        const float wk = w[k];
        for (int64_t j = 0; j < len; ++j) a[j] += wk * static_cast<float>(xr[j]);
      }
      // A NaN/inf in any row (even with weight 0: 0 * inf = NaN) makes the average non-finite: only then
      // rescan this block's rows to name them (rare path; keeps the hot loop a plain vectorised FMA).
      float chk = 0.f;
      for (int64_t j = 0; j < len; ++j) chk += avg[j] * 0.f;
      if (chk != 0.f) {
        for (int64_t k = 0; k < n; ++k) {
          const X* xr = xp + rows[k] * P + j0;
          for (int64_t j = 0; j < len; ++j)
            if (!std::isfinite(static_cast<float>(xr[j]))) { bad_blocks[blk * (n + 1) + k] = 1; break; }
        }
        bad_blocks[blk * (n + 1) + n] = 1;  // the block is non-finite even if no row is (overflow)
      }
      const float* gb = g + j0;
      {  // m' = beta m + scale (g - avg) ; g' = g - lr m'
        const float fb = static_cast<float>(beta), fs = static_cast<float>(scale), fl = static_cast<float>(lr);
        for (int64_t j = 0; j < len; ++j) {
          const float mm = (m_in ? fb * m_in[j0 + j] : 0.f) + fs * (gb[j] - avg[j]);
          if (m_out) m_out[j0 + j] = mm;
          newg[j] = gb[j] - fl * mm;
        }
      }
      if (r_in) {  // R_k' = (R_k + shift) + a_k (X_k - g) ; change = sum_k (R_k' - R_k)
        for (int64_t k = 0; k < n; ++k) {
          const X* xr = xp + rows[k] * P + j0;
          const float* ri = r_in + k * P + j0;
          float* ro = r_out + k * P + j0;
          const float ak = coef[k];
          if (shift) {
            for (int64_t j = 0; j < len; ++j) {
              const float v = (ri[j] + shift[j0 + j]) + ak * (static_cast<float>(xr[j]) - gb[j]);
              ro[j] = v;
              dc[j] += v - ri[j];
            }
          } else {
            for (int64_t j = 0; j < len; ++j) {
              const float v = ri[j] + ak * (static_cast<float>(xr[j]) - gb[j]);
              ro[j] = v;
              dc[j] += v - ri[j];
            }
          }
        }
        for (int64_t j = 0; j < len; ++j) change[j0 + j] = dc[j];
      }
      for (int64_t j = 0; j < len; ++j) {
        g_out[j0 + j] = newg[j];
        avg_out[j0 + j] = avg[j];
      }
      if (ring_in) {  // B[slot] = g'
        for (int64_t s = 0; s < M; ++s) {
          const float* src = s == slot ? newg.data() : ring_in + s * P + j0;
          float* dst = ring_out + s * P + j0;
          for (int64_t j = 0; j < len; ++j) dst[j] = src[j];
        }
      }
    }
  });
}

}  // namespace

FEDFAST_AGGREGATE(aggregate_cpu) {
  const at::Tensor X = X_in.contiguous(), rows = rows_in.to(at::kLong).contiguous();
  const at::Tensor g = g_in.to(at::kFloat).contiguous(), w = w_in.to(at::kFloat).contiguous();
  const int64_t n = rows.size(0), P = X.size(1);
  auto opts = g.options();
  auto f32 = [](const c10::optional<at::Tensor>& t) {
    return t.has_value() ? t->to(at::kFloat).contiguous() : at::Tensor();
  };
  at::Tensor m = f32(momentum), r = f32(state_rows), coef = f32(state_coef), shift = f32(state_shift), rb = f32(ring_in);
  at::Tensor ashift = f32(avg_shift);  // avg = avg_shift + sum_k w_k X_k (DP-FedAvg: unnormalised w)
  TORCH_CHECK(!r.defined() || (coef.defined() && coef.numel() == n), "state_coef must have one value per row");
  at::Tensor g_out = at::empty({P}, opts), avg_out = at::empty({P}, opts);
  const bool keep_m = m.defined() || beta != 0.0;
  at::Tensor m_out = keep_m ? at::empty({P}, opts) : at::Tensor();
  at::Tensor r_out = r.defined() ? at::empty_like(r) : at::Tensor();
  at::Tensor change = r.defined() ? at::empty({P}, opts) : at::Tensor();
  at::Tensor rb_out = rb.defined() ? at::empty_like(rb) : at::Tensor();
  const int64_t nb = (P + kBlock - 1) / kBlock;
  std::vector<char> bad_blocks(nb * (n + 1), 0);
  auto P_ = [](const at::Tensor& t) -> float* { return t.defined() ? t.data_ptr<float>() : nullptr; };
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, X.scalar_type(), "aggregate_cpu", [&] {
    using XT = scalar_t;
    if constexpr (std::is_same_v<XT, double>) {
      TORCH_CHECK(false, "aggregate_cpu: fp64 client rows go through the reference backend");
    } else {
      aggregate_impl<XT>(X.data_ptr<XT>(), rows.data_ptr<int64_t>(), n, P, g.data_ptr<float>(),
                         w.data_ptr<float>(), beta, scale, lr, P_(m), P_(m_out), P_(r), P_(r_out), P_(coef),
                         P_(shift), P_(change), P_(rb), P_(rb_out), rb.defined() ? rb.size(0) : 0, slot,
                         g_out.data_ptr<float>(), avg_out.data_ptr<float>(), bad_blocks.data(), P_(ashift));
    }
  });
  at::Tensor bad = at::zeros({n + 1}, at::kBool);  // [n] per-row flags, [n] = average non-finite
  bool* bp = bad.data_ptr<bool>();
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t k = 0; k <= n; ++k) bp[k] = bp[k] || bad_blocks[b * (n + 1) + k];
  at::Tensor ring_mean = rb.defined() ? rb_out.narrow(0, 0, count).mean(0) : at::Tensor();
  return {g_out, avg_out, m_out, r_out, change, rb_out, ring_mean, bad};
}

}  // namespace fedfast
