// C++ test of the CPU kernels against a naive fp64 implementation written here from the formulas
// (FedNTD not-true KL and plain KD): loss rows and gradients, C in {2, 3, 10, 1023}, an ignored row.
#include <ATen/ATen.h>

#include <cmath>
#include <cstdio>
#include <vector>

#include "fedfast_cpu.h"

static double naive_row(const double* z, const double* t, int64_t C, int64_t y, double tau, double ce_w, double kd_w,
                        bool not_true, std::vector<double>& g) {
  auto lse = [&](const double* x, double s, int64_t skip) {
    double m = -INFINITY;
    for (int64_t j = 0; j < C; ++j) if (j != skip) m = std::fmax(m, x[j] * s);
    double acc = 0;
    for (int64_t j = 0; j < C; ++j) if (j != skip) acc += std::exp(x[j] * s - m);
    return m + std::log(acc);
  };
  const int64_t skip = not_true ? y : -1;
  const double l1 = lse(z, 1.0, -1), lq = lse(z, 1.0 / tau, skip), lp = lse(t, 1.0 / tau, skip);
  double kl = 0;
  g.assign(C, 0.0);
  for (int64_t j = 0; j < C; ++j) {
    g[j] = ce_w * (std::exp(z[j] - l1) - (j == y ? 1.0 : 0.0));
    if (j == skip) continue;
    const double logp = t[j] / tau - lp, logq = z[j] / tau - lq;
    const double p = std::exp(logp), q = std::exp(logq);
    kl += p * (logp - logq);
    g[j] += kd_w / tau * (q - p);
  }
  return ce_w * (l1 - z[y]) + kd_w * kl;
}

int main() {
  int failures = 0;
  at::manual_seed(0);
  for (int64_t C : {2, 3, 10, 1023}) {
    for (bool not_true : {false, true}) {
      const int64_t R = 5;
      auto z = at::randn({R, C}) * 3, t = at::randn({R, C}) * 3;
      auto y = at::randint(0, C, {R}, at::kLong);
      y[2] = -100;
      auto out = fedfast::distill_rows_cpu(z, t, y, {}, {}, {}, {}, {}, 1.0, {}, {}, {}, 2.0, 0.7, 1.3, -100, not_true,
                                           false, false);  // FEDFAST_DISTILL_ROWS: the plain row op
      auto loss = std::get<0>(out), grad = std::get<1>(out);
      auto zd = z.to(at::kDouble), td = t.to(at::kDouble);
      double max_err = 0, max_ref = 1e-30;
      for (int64_t i = 0; i < R; ++i) {
        const int64_t yi = y[i].item<int64_t>();
        std::vector<double> g;
        double l = 0;
        if (yi >= 0) l = naive_row(zd[i].data_ptr<double>(), td[i].data_ptr<double>(), C, yi, 2.0, 0.7, 1.3, not_true, g);
        else g.assign(C, 0.0);
        max_err = std::fmax(max_err, std::fabs(loss[i].item<double>() - l));
        max_ref = std::fmax(max_ref, std::fabs(l));
        for (int64_t j = 0; j < C; ++j) {
          max_err = std::fmax(max_err, std::fabs(grad[i][j].item<double>() - g[j]));
        }
      }
      const bool ok = max_err / max_ref <= 1e-5 && std::get<2>(out) == 0;
      std::printf("C=%4ld not_true=%d max_err=%.3e %s\n", (long)C, (int)not_true, max_err, ok ? "ok" : "FAIL");
      failures += !ok;
    }
  }
  std::printf("%d passed, %d failed\n", 8 - failures, failures);
  return failures == 0 ? 0 : 1;
}
