// Gram-Schmidt orthonormalisation of the columns of many tall-skinny matrices, in place.
//
// For each (n, r) matrix X (row-major, r <= n), column by column (modified Gram-Schmidt, the
// order of torch's _orthogonalize_gram_schmidt in powerSGD_hook.py):
//   x_i  = x_i / (||x_i|| + eps)
//   x_j -= (x_i . x_j) x_i            for every j > i
// With eps = 0 a zero column stays zero instead of becoming nan (torch divides by zero there).
// Each column costs two passes over the rows: one accumulates ||x_i||^2 and x_i . x_j for every
// j > i at once, the other normalises x_i and removes it from the later columns. Rows are
// contiguous, so both passes run along memory; sums are accumulated in double.
// Matrices are independent: they are split across the ATen thread pool.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/irange.h>

#include <cmath>
#include <vector>

#include "fastllm.h"

namespace fastllm {
namespace {

template <typename T>
void orthogonalize_one(T* __restrict x, int64_t n, int64_t r, double eps) {
  std::vector<double> dots(r);
  std::vector<T> coef(r);
  for (int64_t i = 0; i < r; ++i) {
    std::fill(dots.begin(), dots.end(), 0.0);
    for (int64_t row = 0; row < n; ++row) {
      const T* xr = x + row * r;
      const double xi = xr[i];
      for (int64_t j = i; j < r; ++j) dots[j] += xi * double(xr[j]);
    }
    const double norm = std::sqrt(dots[i]);
    const double denom = norm + eps;
    const double inv = denom > 0.0 ? 1.0 / denom : 0.0;
    // (x_i / d) . x_j * (x_i / d) = (x_i . x_j) / d^2 * x_i
    for (int64_t j = i + 1; j < r; ++j) coef[j] = T(dots[j] * inv * inv);
    const T inv_t = T(inv);
    for (int64_t row = 0; row < n; ++row) {
      T* xr = x + row * r;
      const T xi = xr[i];
#pragma omp simd
      for (int64_t j = i + 1; j < r; ++j) xr[j] -= coef[j] * xi;
      xr[i] = xi * inv_t;
    }
  }
}

}  // namespace

void orthogonalize_cpu(const std::vector<at::Tensor>& matrices, double epsilon) {
  for (const auto k : c10::irange(matrices.size())) {
    const auto& m = matrices[k];
    TORCH_CHECK(m.device().is_cpu() && m.layout() == at::kStrided && m.is_contiguous() &&
                    m.dim() == 2,
                "fastllm.orthogonalize (cpu): matrices[", k,
                "] must be a dense contiguous 2-D CPU tensor");
    TORCH_CHECK(m.scalar_type() == at::kFloat || m.scalar_type() == at::kDouble,
                "fastllm.orthogonalize: matrices[", k, "] has dtype ", m.scalar_type(),
                "; expected float32 or float64");
  }
  at::parallel_for(0, int64_t(matrices.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t k = first; k < last; ++k) {
      const auto& m = matrices[k];
      if (m.numel() == 0) continue;
      if (m.scalar_type() == at::kFloat) {
        orthogonalize_one(m.data_ptr<float>(), m.size(0), m.size(1), epsilon);
      } else {
        orthogonalize_one(m.data_ptr<double>(), m.size(0), m.size(1), epsilon);
      }
    }
  });
}

}  // namespace fastllm
