// Gram-Schmidt orthonormalisation of the columns of many tall-skinny matrices, in place.
//
// For each (n, r) matrix X (row-major, r <= n), column by column (modified Gram-Schmidt, the
// order of torch's _orthogonalize_gram_schmidt in powerSGD_hook.py, and orthogonalize_ref's):
//   q_i  = x_i / (||x_i|| + eps), or 0 when ||x_i|| <= tol * ||x_i before any removal||
//   x_j -= (q_i . x_j) q_i            for every j > i
// tol = kDependence * r * epsilon(T): a column at or below it depends on the earlier ones and
// what is left of it is rounding residue (fastllm/ops/orthogonalize.py derives the bound); it is
// set to zero (times 0: a nan or inf stays visible) instead of normalised into a unit column that
// is not orthogonal to them. With eps = 0 a zero column stays zero (torch's would be nan).
// A kept column whose norm fell below 1/sqrt(2) of its first one is projected a second time
// against q_0 .. q_{i-1} (classical Gram-Schmidt: c = Q^T x_i, x_i -= Q c) before it is
// normalised: after one pass its rounding residue, relative to what is left of it, can leave it
// far from orthogonal (up to 5/16 just above tol); twice is enough (orthogonalize.py's docstring).
// One pass first takes every column's squared norm; then each column costs two passes over the
// rows: one normalises x_i and accumulates q_i . x_j for every j > i at once, the other removes
// q_i from the later columns and accumulates ||x_{i+1}||^2. Rows are contiguous, so every pass
// runs along memory. Sums are accumulated in double, kBlock rows at a time and the blocks' sums
// added up: (kBlock + n / kBlock) roundings per sum instead of n, which matters for double input
// (16384 equal values summed one by one: 2.5e-14 relative, 110 epsilon).
// Norms are double, so a kept float column may have a norm below 1/FLT_MAX (subnormal values)
// whose normaliser is inf as a float: it is applied in two exact steps (kSplit below).
// Matrices are independent: they are split across the ATen thread pool.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/irange.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "fastllm.h"

namespace fastllm {
namespace {

// As DEPENDENCE_C and REORTHOGONALIZE in fastllm/ops/orthogonalize.py.
constexpr double kDependence = 16.0;
constexpr double kReorthogonalize = 0.5;
constexpr int64_t kBlock = 64;
// As SPLIT there: a normaliser above it is applied as kSplit times inv / kSplit (2^64, exact).
constexpr double kSplit = 18446744073709551616.0;

// The second pass over column i of x (n, r): x_i -= sum_{k < i} (q_k . x_i) q_k, the dot
// products and each row's sum in double. Returns the new ||x_i||^2.
template <typename T>
double project_again(T* __restrict x, int64_t n, int64_t r, int64_t i, std::vector<double>& c,
                     std::vector<double>& part) {
  std::fill(c.begin(), c.begin() + i, 0.0);
  for (int64_t b = 0; b < n; b += kBlock) {
    std::fill(part.begin(), part.begin() + i, 0.0);
    for (int64_t row = b; row < std::min(n, b + kBlock); ++row) {
      const T* xr = x + row * r;
      const double xi = double(xr[i]);
      for (int64_t k = 0; k < i; ++k) part[k] += double(xr[k]) * xi;
    }
    for (int64_t k = 0; k < i; ++k) c[k] += part[k];
  }
  double norm2 = 0.0;
  for (int64_t b = 0; b < n; b += kBlock) {
    double sum = 0.0;
    for (int64_t row = b; row < std::min(n, b + kBlock); ++row) {
      T* xr = x + row * r;
      double proj = 0.0;
      for (int64_t k = 0; k < i; ++k) proj += c[k] * double(xr[k]);
      xr[i] = T(double(xr[i]) - proj);
      sum += double(xr[i]) * double(xr[i]);
    }
    norm2 += sum;
  }
  return norm2;
}

template <typename T>
void orthogonalize_one(T* __restrict x, int64_t n, int64_t r, double eps) {
  const double tol = kDependence * double(r) * std::numeric_limits<T>::epsilon();
  std::vector<double> acc(r, 0.0), part(r), limit(r), first(r), c(r);
  std::vector<T> coef(r);
  for (int64_t b = 0; b < n; b += kBlock) {
    std::fill(part.begin(), part.end(), 0.0);
    for (int64_t row = b; row < std::min(n, b + kBlock); ++row) {
      const T* xr = x + row * r;
      for (int64_t j = 0; j < r; ++j) part[j] += double(xr[j]) * double(xr[j]);
    }
    for (int64_t j = 0; j < r; ++j) acc[j] += part[j];
  }
  for (int64_t j = 0; j < r; ++j) limit[j] = tol * std::sqrt(acc[j]);
  first = acc;
  double norm2 = acc[0];
  for (int64_t i = 0; i < r; ++i) {
    const bool keep = std::sqrt(norm2) > limit[i];
    if (keep && i > 0 && norm2 < kReorthogonalize * first[i]) {
      norm2 = project_again(x, n, r, i, c, part);
    }
    const double norm = std::sqrt(norm2);
    // A column of norm below 1/FLT_MAX (subnormal fp32 values) has an inv that is inf as a T:
    // when inv > 2^64 (every |x| <= norm < 2^-64) the column is scaled by 2^64 first (exact)
    // and by T(inv / 2^64) then; a column with a finite, normal T(inv) comes out bitwise as
    // x * T(inv) (the same real product rounded once), any other is multiplied by 1 first.
    const double inv_d = keep ? 1.0 / (norm + eps) : 0.0;
    const bool big = inv_d > kSplit;
    const T pre = T(big ? kSplit : 1.0);
    const T inv = T(big ? inv_d / kSplit : inv_d);
    std::fill(acc.begin() + i + 1, acc.end(), 0.0);
    for (int64_t b = 0; b < n; b += kBlock) {
      std::fill(part.begin() + i + 1, part.end(), 0.0);
      for (int64_t row = b; row < std::min(n, b + kBlock); ++row) {
        T* xr = x + row * r;
        const T q = (xr[i] * pre) * inv;
        xr[i] = q;
        for (int64_t j = i + 1; j < r; ++j) part[j] += double(q) * double(xr[j]);
      }
      for (int64_t j = i + 1; j < r; ++j) acc[j] += part[j];
    }
    if (i + 1 == r) break;
    for (int64_t j = i + 1; j < r; ++j) coef[j] = T(acc[j]);
    norm2 = 0.0;
    for (int64_t b = 0; b < n; b += kBlock) {
      double sum = 0.0;
      for (int64_t row = b; row < std::min(n, b + kBlock); ++row) {
        T* xr = x + row * r;
        const T q = xr[i];
#pragma omp simd
        for (int64_t j = i + 1; j < r; ++j) xr[j] -= coef[j] * q;
        sum += double(xr[i + 1]) * double(xr[i + 1]);
      }
      norm2 += sum;
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
