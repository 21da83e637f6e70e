// RMSNorm for CPU tensors, forward and backward each one pass over the rows:
//   forward   rstd = 1 / sqrt(mean(x^2) + eps),  y = x * rstd * (offset + w)
//   backward  xhat = x * rstd,  g = dy * (offset + w)
//             dx = rstd * (g - xhat * mean(g * xhat)),   dw = sum over rows of dy * xhat
// offset is 0 (Llama) or 1 (Gemma's `1 + weight`). Everything is computed in fp32 (fp64 for fp64)
// and rounded once into the output dtype. dw is reduced per block of rows into fp32 partial sums
// (one per block), then added in block order. The blocks are a function of (rows, h) only, never
// of the thread count, so dw has the same bits on 1 thread or 64; the backward reads x and dy
// exactly once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "cpu/model_io.h"
#include "fastllm.h"

namespace fastllm {
namespace {

using model_io::Io;

template <typename scalar_t>
void forward_rows(const scalar_t* x_raw, const scalar_t* w_raw, scalar_t* y_raw,
                  typename Io<scalar_t>::opmath_t* rstd,
                  int64_t begin, int64_t end, int64_t h, double eps, double offset) {
  using io = Io<scalar_t>;
  using op_t = typename io::opmath_t;
  using raw_t = typename io::raw_t;
  const raw_t* __restrict x = reinterpret_cast<const raw_t*>(x_raw);
  const raw_t* __restrict w = reinterpret_cast<const raw_t*>(w_raw);
  raw_t* __restrict y = reinterpret_cast<raw_t*>(y_raw);
  const op_t off = static_cast<op_t>(offset);
  for (int64_t row = begin; row < end; ++row) {
    const raw_t* __restrict xr = x + row * h;
    raw_t* __restrict yr = y + row * h;
    op_t ss = 0;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < h; ++i) {
      const op_t v = io::load(xr[i]);
      ss += v * v;
    }
    const op_t r = op_t(1) / std::sqrt(ss / static_cast<op_t>(h) + static_cast<op_t>(eps));
    rstd[row] = r;
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) yr[i] = io::store(io::load(xr[i]) * r * (off + io::load(w[i])));
  }
}

template <typename scalar_t>
void backward_rows(const scalar_t* dy_raw, const scalar_t* x_raw, const scalar_t* w_raw,
                   const typename Io<scalar_t>::opmath_t* rstd, scalar_t* dx_raw,
                   typename Io<scalar_t>::opmath_t* __restrict dw_acc, int64_t begin,
                   int64_t end, int64_t h, double offset, bool need_dx) {
  using io = Io<scalar_t>;
  using op_t = typename io::opmath_t;
  using raw_t = typename io::raw_t;
  const raw_t* __restrict dy = reinterpret_cast<const raw_t*>(dy_raw);
  const raw_t* __restrict x = reinterpret_cast<const raw_t*>(x_raw);
  const raw_t* __restrict w = reinterpret_cast<const raw_t*>(w_raw);
  raw_t* __restrict dx = reinterpret_cast<raw_t*>(dx_raw);
  const op_t off = static_cast<op_t>(offset);
  const op_t inv_h = op_t(1) / static_cast<op_t>(h);
  for (int64_t row = begin; row < end; ++row) {
    const raw_t* __restrict xr = x + row * h;
    const raw_t* __restrict dyr = dy + row * h;
    const op_t r = rstd[row];
    op_t dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < h; ++i) {
      const op_t xhat = io::load(xr[i]) * r;
      const op_t g = io::load(dyr[i]);
      if (dw_acc != nullptr) dw_acc[i] += g * xhat;
      dot += g * (off + io::load(w[i])) * xhat;
    }
    if (!need_dx) continue;
    const op_t mean = dot * inv_h;
    raw_t* __restrict dxr = dx + row * h;
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) {
      const op_t xhat = io::load(xr[i]) * r;
      const op_t g = io::load(dyr[i]) * (off + io::load(w[i]));
      dxr[i] = io::store(r * (g - xhat * mean));
    }
  }
}

void check_args(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(),
              "fastllm.rms_norm: the cpp backend takes CPU tensors");
  TORCH_CHECK(x.dim() >= 1 && x.is_contiguous(), "fastllm.rms_norm: x must be contiguous (..., h)");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "fastllm.rms_norm: weight must be contiguous (h,) of x's dtype");
}

// Rows of x (..., h): the product of its leading sizes (h may be 0).
int64_t rows_of(const at::Tensor& x) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.size(d);
  return rows;
}

// Rows per parallel task: enough elements (~16K) that a fork/join is amortised.
int64_t grain_rows(int64_t h) { return std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>(h, 1)); }

// At most this many dw partial sums: enough blocks to balance the threads of a big machine,
// few enough that the partials (kMaxBlocks x h fp32, 147 KB at h = 576) stay in cache.
constexpr int64_t kMaxBlocks = 64;

// Rows per backward block: grain_rows(h), or more so that there are at most kMaxBlocks.
int64_t block_rows(int64_t rows, int64_t h) {
  return std::max(grain_rows(h), (rows + kMaxBlocks - 1) / kMaxBlocks);
}

// dw[i] = the blocks' partials at column i added in block order (fp32, fp64 for fp64), rounded
// once; parallel over columns, so the order of each sum is the same on any number of threads.
template <typename scalar_t>
void sum_partials(const typename Io<scalar_t>::opmath_t* partial, int64_t blocks, int64_t h,
                  scalar_t* dw_raw) {
  using io = Io<scalar_t>;
  using op_t = typename io::opmath_t;
  using raw_t = typename io::raw_t;
  raw_t* dw = reinterpret_cast<raw_t*>(dw_raw);
  constexpr int64_t kColumns = 256;  // a few cache lines of every block's partial per task
  // tasks of at least ~64K partial elements: a small sum (64 x 576) is cheaper than a fork/join
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / (blocks * kColumns));
  at::parallel_for(0, (h + kColumns - 1) / kColumns, grain, [&](int64_t c0, int64_t c1) {
    op_t acc[kColumns];
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t i0 = c * kColumns, n = std::min(kColumns, h - i0);
      std::fill(acc, acc + n, op_t(0));
      for (int64_t b = 0; b < blocks; ++b) {
        const op_t* __restrict p = partial + b * h + i0;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) acc[i] += p[i];
      }
      for (int64_t i = 0; i < n; ++i) dw[i0 + i] = io::store(acc[i]);
    }
  });
}

}  // namespace

std::vector<at::Tensor> rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps,
                                     double offset) {
  check_args(x, weight);
  const int64_t rows = rows_of(x), h = x.size(-1);
  auto y = at::empty_like(x);
  // rstd (x's leading sizes) in the compute precision: fp64 for fp64 (so its gradients are
  // fp64-accurate), else fp32
  const auto op_dtype = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(op_dtype));
  // h == 0 still runs the rows: their rstd is 1 / sqrt(0 / 0 + eps) = nan, as the mean of no
  // elements is (rms_norm_ref), not whatever at::empty left there
  if (rows == 0) return {y, rstd};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "fastllm_rms_norm_cpu",
                                  [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    const scalar_t* wp = weight.const_data_ptr<scalar_t>();
    scalar_t* yp = y.mutable_data_ptr<scalar_t>();
    auto* rp = rstd.mutable_data_ptr<typename Io<scalar_t>::opmath_t>();
    at::parallel_for(0, rows, grain_rows(h), [&](int64_t begin, int64_t end) {
      forward_rows<scalar_t>(xp, wp, yp, rp, begin, end, h, eps, offset);
    });
  });
  return {y, rstd};
}

std::vector<at::Tensor> rms_norm_backward_cpu(const at::Tensor& grad_out, const at::Tensor& x,
                                              const at::Tensor& weight, const at::Tensor& rstd,
                                              double offset, bool need_dx, bool need_dweight) {
  check_args(x, weight);
  TORCH_CHECK(grad_out.sizes() == x.sizes() && grad_out.is_contiguous() &&
                  grad_out.scalar_type() == x.scalar_type(),
              "fastllm.rms_norm: grad_out must be contiguous, of x's shape and dtype");
  const auto op_dtype = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t rows = rows_of(x), h = x.size(-1);
  TORCH_CHECK(rstd.scalar_type() == op_dtype && rstd.numel() == rows && rstd.is_contiguous(),
              "fastllm.rms_norm: rstd must be contiguous with one element per row of x, fp64 for "
              "fp64 x, else fp32");
  auto dx = need_dx ? at::empty_like(x) : at::empty({0}, x.options());
  auto dw = need_dweight ? at::empty_like(weight) : at::empty({0}, x.options());
  // Blocks of block_rows(rows, h) rows, each with its own dw partial sum: the split and the
  // order the partials are added in depend on the sizes alone, not on the thread count or on
  // how the scheduler hands the blocks out.
  const int64_t per_block = block_rows(rows, h);
  const int64_t blocks = std::max<int64_t>(1, (rows + per_block - 1) / per_block);
  auto partial = need_dweight && rows > 0 && h > 0
                     ? at::empty({blocks, h}, x.options().dtype(op_dtype)) : at::Tensor();
  if (rows > 0 && h > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(),
                                    "fastllm_rms_norm_backward_cpu", [&] {
      using op_t = typename Io<scalar_t>::opmath_t;
      const scalar_t* dyp = grad_out.const_data_ptr<scalar_t>();
      const scalar_t* xp = x.const_data_ptr<scalar_t>();
      const scalar_t* wp = weight.const_data_ptr<scalar_t>();
      const op_t* rp = rstd.const_data_ptr<op_t>();
      scalar_t* dxp = need_dx ? dx.mutable_data_ptr<scalar_t>() : nullptr;
      op_t* pp = need_dweight ? partial.mutable_data_ptr<op_t>() : nullptr;
      at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t begin = b * per_block, end = std::min(rows, begin + per_block);
          op_t* acc = pp ? pp + b * h : nullptr;
          if (acc != nullptr) std::fill(acc, acc + h, op_t(0));  // every block has rows
          backward_rows<scalar_t>(dyp, xp, wp, rp, dxp, acc, begin, end, h, offset, need_dx);
        }
      });
      if (need_dweight) sum_partials<scalar_t>(pp, blocks, h, dw.mutable_data_ptr<scalar_t>());
    });
  } else if (need_dweight) {
    dw.zero_();
  }
  return {dx, dw};
}

}  // namespace fastllm
