// PowerSGD decompression with the error-feedback update, one pass over each gradient matrix.
//
// For each matrix M (n, m) with the all-reduced factors P (n, r), Q (m, r) and this rank's own
// Q_local = M^T P (m, r) from before the Q all-reduce:
//   error = M - P Q_local^T       (when errors are given; the local compression error)
//   M     = scale * P Q^T         (the averaged low-rank gradient)
// torch's powerSGD_hook does this as a bmm into M, then `error = copy_of_M - M` over the whole
// bucket, which needs a clone of the bucket made beforehand; here M is read once and M and
// error written once. r is small (PowerSGD ranks are 1..32), so each element is two r-term dot
// products computed in registers: the pass is bound by memory, not arithmetic. The Qs are
// transposed to (r, m) first so the inner loops run along contiguous memory.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/irange.h>

#include <vector>

#include "fastllm.h"

namespace fastllm {
namespace {

template <typename T>
void decompress_rows(T* __restrict mat, T* __restrict err, const T* __restrict p,
                     const T* __restrict qt, const T* __restrict local_qt, int64_t m, int64_t r,
                     T scale, int64_t row_begin, int64_t row_end) {
  std::vector<T> acc(m), local(m);
  for (int64_t row = row_begin; row < row_end; ++row) {
    const T* pr = p + row * r;
    std::fill(acc.begin(), acc.end(), T(0));
    for (int64_t k = 0; k < r; ++k) {
      const T pk = pr[k] * scale;
      const T* q = qt + k * m;
#pragma omp simd
      for (int64_t j = 0; j < m; ++j) acc[j] += pk * q[j];
    }
    T* mr = mat + row * m;
    if (err != nullptr) {
      std::fill(local.begin(), local.end(), T(0));
      for (int64_t k = 0; k < r; ++k) {
        const T pk = pr[k];
        const T* q = local_qt + k * m;
#pragma omp simd
        for (int64_t j = 0; j < m; ++j) local[j] += pk * q[j];
      }
      T* er = err + row * m;
#pragma omp simd
      for (int64_t j = 0; j < m; ++j) {
        er[j] = mr[j] - local[j];
        mr[j] = acc[j];
      }
    } else {
#pragma omp simd
      for (int64_t j = 0; j < m; ++j) mr[j] = acc[j];
    }
  }
}

template <typename T>
void decompress_one(const at::Tensor& mat, const at::Tensor* err, const at::Tensor& p,
                    const at::Tensor& q, const at::Tensor* local_q, double scale) {
  const int64_t n = mat.size(0), m = mat.size(1), r = p.size(1);
  const at::Tensor qt = q.t().contiguous();
  const at::Tensor local_qt = local_q == nullptr ? qt : local_q->t().contiguous();
  T* err_ptr = err == nullptr ? nullptr : err->data_ptr<T>();
  // Rows per work item: about 64K elements, enough to amortise a task.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(m, 1));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    decompress_rows(mat.data_ptr<T>(), err_ptr, p.data_ptr<T>(), qt.data_ptr<T>(),
                    local_qt.data_ptr<T>(), m, r, T(scale), begin, end);
  });
}

}  // namespace

void powersgd_decompress_cpu(const std::vector<at::Tensor>& matrices,
                             const std::vector<at::Tensor>& ps, const std::vector<at::Tensor>& qs,
                             const std::vector<at::Tensor>& local_qs,
                             const std::vector<at::Tensor>& errors, double scale) {
  const char* op = "fastllm.powersgd_decompress (cpu)";
  TORCH_CHECK(ps.size() == matrices.size() && qs.size() == matrices.size(), op,
              ": matrices, ps and qs must have the same length");
  TORCH_CHECK(errors.size() == local_qs.size() &&
                  (errors.empty() || errors.size() == matrices.size()),
              op, ": errors and local_qs must both be empty or as long as matrices");
  for (const auto i : c10::irange(matrices.size())) {
    const auto& mat = matrices[i];
    const auto dt = mat.scalar_type();
    TORCH_CHECK(dt == at::kFloat || dt == at::kDouble, op, ": matrices[", i, "] has dtype ", dt,
                "; expected float32 or float64");
    TORCH_CHECK(mat.dim() == 2 && ps[i].dim() == 2 && qs[i].dim() == 2 &&
                    ps[i].size(0) == mat.size(0) && qs[i].size(0) == mat.size(1) &&
                    ps[i].size(1) == qs[i].size(1),
                op, ": matrices[", i, "] ", mat.sizes(), ", ps[", i, "] ", ps[i].sizes(),
                " and qs[", i, "] ", qs[i].sizes(), " do not fit M (n, m), P (n, r), Q (m, r)");
    std::vector<const at::Tensor*> all = {&mat, &ps[i], &qs[i]};
    if (!errors.empty()) {
      all.push_back(&errors[i]);
      all.push_back(&local_qs[i]);
      TORCH_CHECK(local_qs[i].sizes() == qs[i].sizes(), op, ": local_qs[", i, "] has shape ",
                  local_qs[i].sizes(), ", qs[", i, "] ", qs[i].sizes());
    }
    for (const at::Tensor* t : all) {
      TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == dt, op,
                  ": every tensor of index ", i, " must be a contiguous CPU tensor of dtype ", dt);
    }
    if (!errors.empty()) {
      TORCH_CHECK(errors[i].sizes() == mat.sizes(), op, ": errors[", i, "] has shape ",
                  errors[i].sizes(), ", matrices[", i, "] ", mat.sizes());
    }
  }
  for (const auto i : c10::irange(matrices.size())) {
    const at::Tensor* err = errors.empty() ? nullptr : &errors[i];
    const at::Tensor* local_q = errors.empty() ? nullptr : &local_qs[i];
    if (matrices[i].numel() == 0) continue;
    if (matrices[i].scalar_type() == at::kFloat) {
      decompress_one<float>(matrices[i], err, ps[i], qs[i], local_q, scale);
    } else {
      decompress_one<double>(matrices[i], err, ps[i], qs[i], local_q, scale);
    }
  }
}

}  // namespace fastllm
