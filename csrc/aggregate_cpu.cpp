// Fused server update on the CPU: one pass over the participating client rows (see
// fedfast/ops/aggregate_reference.py for the formulas: FedAvg / FedAvgM / SlowMo / FedADC server rule,
// FedDyn, SCAFFOLD, FedGKD teacher buffer). Columns are split in blocks across threads; inside a block the
// rows are streamed once (row-major reads, vectorised over columns). Non-finite values are detected per row.
// Bytes: n*P*x (client rows) + 4P*(2 + 2*[momentum] + [M teacher reads + 1 write]) + 8*n*P per kept
// per-client state (FedDyn h_k / SCAFFOLD c_k read + write).
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

#include "fedfast_cpu.h"

namespace fedfast {
namespace {

constexpr int64_t kBlock = 16384;

template <typename X>
void aggregate_impl(const X* xp, const int64_t* rows, int64_t n, int64_t P, const float* g, const float* w,
                    double beta, double scale, double lr, const float* m_in, float* m_out, const float* h_in,
                    float* h_out, const float* hbar_in, float* hbar_out, double dyn_K, const float* c_in,
                    float* c_out, const float* ck_in, float* ck_out, const float* coef, double sc_K,
                    const float* tb_in, float* tb_out, int64_t M, int64_t slot, int64_t count, float* g_out,
                    float* avg_out, char* bad_blocks) {
  const int64_t nb = (P + kBlock - 1) / kBlock;
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> avg(kBlock), sum(kBlock), dc(kBlock), newg(kBlock);
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t j0 = blk * kBlock, len = std::min(kBlock, P - j0);
      for (int64_t j = 0; j < len; ++j) avg[j] = 0.f, sum[j] = 0.f, dc[j] = 0.f;
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
      for (int64_t k = 0; k < n && h_in; ++k) {
        const X* __restrict xr = xp + rows[k] * P + j0;
        {  // FedDyn needs the unweighted sum too
          float* __restrict sm = sum.data();
          for (int64_t j = 0; j < len; ++j) sm[j] += static_cast<float>(xr[j]);
        }
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
      if (h_in) {  // FedDyn: h_k += X_k - g ; hbar += sum_k (X_k - g) / K ; g' = avg + hbar'
        for (int64_t k = 0; k < n; ++k) {
          const X* xr = xp + rows[k] * P + j0;
          const float* hi = h_in + k * P + j0;
          float* ho = h_out + k * P + j0;
          for (int64_t j = 0; j < len; ++j) ho[j] = hi[j] + (static_cast<float>(xr[j]) - gb[j]);
        }
        const float invK = static_cast<float>(1.0 / dyn_K);
        for (int64_t j = 0; j < len; ++j) {
          const float hb = hbar_in[j0 + j] + (sum[j] - static_cast<float>(n) * gb[j]) * invK;
          hbar_out[j0 + j] = hb;
          newg[j] = avg[j] + hb;
        }
      } else {  // m' = beta m + scale (g - avg) ; g' = g - lr m'
        const float fb = static_cast<float>(beta), fs = static_cast<float>(scale), fl = static_cast<float>(lr);
        for (int64_t j = 0; j < len; ++j) {
          const float mm = (m_in ? fb * m_in[j0 + j] : 0.f) + fs * (gb[j] - avg[j]);
          if (m_out) m_out[j0 + j] = mm;
          newg[j] = gb[j] - fl * mm;
        }
      }
      if (c_in) {  // SCAFFOLD: c_k' = c_k - c + coef_k (g - X_k) ; c' = c + sum_k (c_k' - c_k) / K
        for (int64_t k = 0; k < n; ++k) {
          const X* xr = xp + rows[k] * P + j0;
          const float* ci = ck_in + k * P + j0;
          float* co = ck_out + k * P + j0;
          const float ck = coef[k];
          for (int64_t j = 0; j < len; ++j) {
            const float v = ci[j] - c_in[j0 + j] + ck * (gb[j] - static_cast<float>(xr[j]));
            co[j] = v;
            dc[j] += v - ci[j];
          }
        }
        const float invK = static_cast<float>(1.0 / sc_K);
        for (int64_t j = 0; j < len; ++j) c_out[j0 + j] = c_in[j0 + j] + dc[j] * invK;
      }
      for (int64_t j = 0; j < len; ++j) {
        g_out[j0 + j] = newg[j];
        avg_out[j0 + j] = avg[j];
      }
      if (tb_in) {  // FedGKD buffer: B[slot] = g' ; teacher = mean(B[:count])
        for (int64_t s = 0; s < M; ++s) {
          const float* src = s == slot ? newg.data() : tb_in + s * P + j0;
          float* dst = tb_out + s * P + j0;
          for (int64_t j = 0; j < len; ++j) dst[j] = src[j];
        }
      }
    }
  });
}

}  // namespace

std::vector<at::Tensor> aggregate_cpu(const at::Tensor& X_in, const at::Tensor& rows_in, const at::Tensor& g_in,
                                      const at::Tensor& w_in, double beta, double scale, double lr,
                                      const c10::optional<at::Tensor>& momentum,
                                      const c10::optional<at::Tensor>& dyn_h,
                                      const c10::optional<at::Tensor>& dyn_hbar, double dyn_K,
                                      const c10::optional<at::Tensor>& scaffold_c,
                                      const c10::optional<at::Tensor>& scaffold_ck,
                                      const c10::optional<at::Tensor>& scaffold_coef, double sc_K,
                                      const c10::optional<at::Tensor>& teacher_buffer, int64_t slot,
                                      int64_t count) {
  const at::Tensor X = X_in.contiguous(), rows = rows_in.to(at::kLong).contiguous();
  const at::Tensor g = g_in.to(at::kFloat).contiguous(), w = w_in.to(at::kFloat).contiguous();
  const int64_t n = rows.size(0), P = X.size(1);
  auto opts = g.options();
  auto f32 = [](const c10::optional<at::Tensor>& t) {
    return t.has_value() ? t->to(at::kFloat).contiguous() : at::Tensor();
  };
  at::Tensor m = f32(momentum), h = f32(dyn_h), hb = f32(dyn_hbar), c = f32(scaffold_c), ck = f32(scaffold_ck);
  at::Tensor coef = f32(scaffold_coef), tb = f32(teacher_buffer);
  at::Tensor g_out = at::empty({P}, opts), avg_out = at::empty({P}, opts);
  const bool keep_m = m.defined() || beta != 0.0;
  at::Tensor m_out = keep_m ? at::empty({P}, opts) : at::Tensor();
  at::Tensor h_out = h.defined() ? at::empty_like(h) : at::Tensor();
  at::Tensor hb_out = h.defined() ? at::empty_like(hb) : at::Tensor();
  at::Tensor c_out = c.defined() ? at::empty_like(c) : at::Tensor();
  at::Tensor ck_out = c.defined() ? at::empty_like(ck) : at::Tensor();
  at::Tensor tb_out = tb.defined() ? at::empty_like(tb) : at::Tensor();
  const int64_t nb = (P + kBlock - 1) / kBlock;
  std::vector<char> bad_blocks(nb * (n + 1), 0);
  auto P_ = [](const at::Tensor& t) -> float* { return t.defined() ? t.data_ptr<float>() : nullptr; };
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, X.scalar_type(), "aggregate_cpu", [&] {
    using XT = scalar_t;
    if constexpr (std::is_same_v<XT, double>) {
      TORCH_CHECK(false, "aggregate_cpu: fp64 client rows go through the reference backend");
    } else {
      aggregate_impl<XT>(X.data_ptr<XT>(), rows.data_ptr<int64_t>(), n, P, g.data_ptr<float>(),
                         w.data_ptr<float>(), beta, scale, lr, P_(m), P_(m_out), P_(h), P_(h_out), P_(hb), P_(hb_out),
                         dyn_K, P_(c), P_(c_out), P_(ck), P_(ck_out), P_(coef), sc_K, P_(tb), P_(tb_out),
                         tb.defined() ? tb.size(0) : 0, slot, count, g_out.data_ptr<float>(),
                         avg_out.data_ptr<float>(), bad_blocks.data());
    }
  });
  at::Tensor bad = at::zeros({n + 1}, at::kBool);  // [n] per-row flags, [n] = average non-finite
  bool* bp = bad.data_ptr<bool>();
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t k = 0; k <= n; ++k) bp[k] = bp[k] || bad_blocks[b * (n + 1) + k];
  at::Tensor teacher = tb.defined() ? tb_out.narrow(0, 0, count).mean(0) : at::Tensor();
  return {g_out, avg_out, m_out, h_out, hb_out, c_out, ck_out, tb_out, teacher, bad};
}

}  // namespace fedfast
