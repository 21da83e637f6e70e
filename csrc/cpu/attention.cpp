// Causal attention for CPU training on whole-block GEMMs, with packed documents
// (fastllm::attention).
//
// q (B, T, Hq, D), k and v (B, T, Hkv, D) (flash-attention's layout, the projections' own; Hq a
// multiple of Hkv: grouped-query attention), one dtype (fp32, bf16, fp16). Query t of row b
// attends the keys j with doc_start[b, t] <= j <= t (doc_start empty: 0, plain causal); packed
// documents are the rows whose doc_start restarts. Everything is computed in fp32: the products
// of P and dS take fp32 copies of v, q, k, dO; S = Q K^T and dP = dO V^T, whose operands are the
// inputs themselves, multiply bf16 inputs as they are where the bf16 x bf16 -> fp32 GEMM is taken
// (csrc/cpu/gemm_bf16.cpp, gemm_bf16f32_preferred: fastllm's AVX512-BF16 kernel, or MKL's on AMX
// CPUs; fp32 sums, the values of fp32 copies' products up to the order of the sums and
// subnormals, which the kernel and AMX flush to zero).
//
// Why: PyTorch's CPU flash attention runs its softmax(QK^T)V a 64 x 64-ish tile at a time through
// per-tile GEMM calls; on an AMD Zen 5 (2 cores, torch 2.13) SmolLM2's attention (8 x 512
// tokens, 9 query / 3 kv heads of 64) ran at 0.04-0.07 TFLOP/s there, 27-44% of a training step
// (BENCHMARKS.md). Here one task is one (row b, kv head g): the G = Hq / Hkv query heads that
// share g are stacked into one (T * G, D) matrix (row t * G + h), so every product is one GEMM
// over a block of Tb query positions of all G heads against the keys the block can see, through
// fastllm::routed_mm_out (oneDNN fp32 where fastllm/_gemm.py routes it, csrc/cpu/gemm.cpp) or the
// bf16 x bf16 -> fp32 GEMM:
//
//   forward, per block of query positions [r0, r1) and its key range [lo, r1), lo = doc_start[r0]:
//     S = Q_blk K^T                      (G * nb, n) fp32, n = r1 - lo
//     E = exp(scale * S - max) masked    row pass: lse = max + log sum E (kept for backward)
//     O_blk = (E V) / rowsum(E)          (P = E / rowsum(E): the division on O's D columns)
//   backward (the same blocks; P recomputed from lse, nothing of size T^2 is kept):
//     dV += P^T dO,  dP = dO V^T,  dS = P (dP - rowsum(dO O)) scale,  dQ = dS K,  dK += dS^T Q
//
// Tasks run in parallel (at::parallel_for over B * Hkv; with fewer than kParts tasks each is
// split into runs of query blocks whose dK, dV are summed afterwards), each GEMM on one thread:
// a task's operands (T x D fp32 per head) and its block's scores (G * Tb x T fp32, 768 KB at
// G = 3, Tb = 128, T = 512) stay in the core's cache. Blocks skip the keys before their document and
// after their last query, so causal attention costs about half the full product, and packed
// short documents less.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/core/GradMode.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "../fastllm.h"
#include "cpu/model_io.h"
#include "cpu/vec_math.h"

namespace fastllm {
namespace {

using vec_math::exp_fast;

constexpr int64_t kBlock = 128;  // query positions per block

struct Shape {
  int64_t batch, tokens, heads, kv_heads, group, dim;
};

// Shapes and dtypes; with check_values also doc_start's values (the forward's job: the backward
// is handed the doc_start its forward accepted).
Shape check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
            const at::Tensor& doc_start, bool check_values) {
  const char* op = "fastllm.attention";
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), op,
              ": the cpp kernel takes CPU tensors");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op,
              ": q, k, v must be (batch, tokens, heads, head_dim)");
  TORCH_CHECK(k.sizes() == v.sizes(), op, ": k ", k.sizes(), " and v ", v.sizes(), " differ");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(1) == k.size(1) && q.size(3) == k.size(3), op,
              ": q ", q.sizes(), " and k ", k.sizes(), " disagree");
  TORCH_CHECK(k.size(2) > 0 && q.size(2) % k.size(2) == 0, op, ": ", q.size(2),
              " query heads are not a multiple of ", k.size(2), " key/value heads");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), op,
              ": q, k, v must share a dtype");
  TORCH_CHECK(q.size(3) > 0, op, ": head_dim must be positive");
  Shape s{q.size(0), q.size(1), q.size(2), k.size(2), q.size(2) / std::max<int64_t>(1, k.size(2)),
          q.size(3)};
  if (doc_start.numel() > 0) {
    TORCH_CHECK(doc_start.scalar_type() == at::kLong && doc_start.dim() == 2 &&
                    doc_start.size(0) == s.batch && doc_start.size(1) == s.tokens &&
                    doc_start.is_contiguous(),
                op, ": doc_start must be a contiguous (batch, tokens) int64 tensor");
  }
  if (check_values && doc_start.numel() > 0) {
    const int64_t* ds = doc_start.const_data_ptr<int64_t>();
    for (int64_t b = 0; b < s.batch; ++b) {
      for (int64_t t = 0; t < s.tokens; ++t) {
        const int64_t d = ds[b * s.tokens + t];
        TORCH_CHECK(d >= 0 && d <= t && (t == 0 || d >= ds[b * s.tokens + t - 1]), op,
                    ": doc_start[", b, ", ", t, "] = ", d,
                    " is not a document start (0 <= doc_start[t] <= t, non-decreasing in t)");
      }
    }
  }
  return s;
}

// Rows [t0, t1) of a task's (T, G, D) slice of x (B, T, H, D) at heads [h0, h0 + heads), as a
// ((t1 - t0) * heads, D) matrix of into's dtype: the first rows of `into` (contiguous).
// store() writes such rows back. Plain loops for x with contiguous rows of D in fp32, bf16 or
// fp16 (the projections' layout), the values widened / rounded to nearest even as every model
// kernel's (model_io.h): a task's copies were 8 ATen copy_ calls of 16-37 us each (a layer's
// fwd + bwd 64.7 -> 62.6 ms at SmolLM2's shape, BENCHMARKS.md 2026-12-05); other layouts and
// dtypes take copy_.
template <typename scalar_t, bool kStore>
void move_rows(const at::Tensor& x, int64_t b, int64_t t0, int64_t t1, int64_t h0, int64_t heads,
               const at::Tensor& buf) {
  using io = model_io::Io<scalar_t>;
  using raw_t = typename io::raw_t;
  // a store writes x (one of the op's outputs) from buf; a load reads x into buf
  std::conditional_t<kStore, raw_t*, const raw_t*> xp;
  std::conditional_t<kStore, const void*, void*> bp;
  if constexpr (kStore) {
    xp = static_cast<raw_t*>(x.mutable_data_ptr());
    bp = buf.const_data_ptr();
  } else {
    xp = static_cast<const raw_t*>(x.const_data_ptr());
    bp = buf.mutable_data_ptr();
  }
  const int64_t D = x.size(3), st = x.stride(1), sh = x.stride(2);
  xp += b * x.stride(0) + t0 * st + h0 * sh;
  const bool widen = buf.scalar_type() != x.scalar_type();  // buf fp32, x bf16 or fp16
  for (int64_t t = 0; t < t1 - t0; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const auto xr = xp + t * st + h * sh;
      const int64_t row = (t * heads + h) * D;
      if (!widen) {
        if constexpr (kStore) {
          std::copy_n(static_cast<const raw_t*>(bp) + row, D, xr);
        } else {
          std::copy_n(xr, D, static_cast<raw_t*>(bp) + row);
        }
      } else if constexpr (kStore) {
        const float* br = static_cast<const float*>(bp) + row;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) xr[d] = io::store(br[d]);
      } else {
        float* br = static_cast<float*>(bp) + row;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) br[d] = io::load(xr[d]);
      }
    }
  }
}

template <bool kStore>
void move(const at::Tensor& x, int64_t b, int64_t t0, int64_t t1, int64_t h0, int64_t heads,
          const at::Tensor& buf) {
  const auto dt = x.scalar_type();
  // (the entry points resolved negative views: every x here reads as its memory)
  const bool plain = x.stride(3) == 1 && buf.is_contiguous() &&
                     (buf.scalar_type() == dt || buf.scalar_type() == at::kFloat);
  if (plain && dt == at::kFloat) return move_rows<float, kStore>(x, b, t0, t1, h0, heads, buf);
  if (plain && dt == at::kBFloat16) {
    return move_rows<at::BFloat16, kStore>(x, b, t0, t1, h0, heads, buf);
  }
  if (plain && dt == at::kHalf) return move_rows<at::Half, kStore>(x, b, t0, t1, h0, heads, buf);
  auto rows = buf.narrow(0, 0, (t1 - t0) * heads).view({t1 - t0, heads, x.size(3)});
  auto part = x.select(0, b).narrow(0, t0, t1 - t0).narrow(1, h0, heads);
  if constexpr (kStore) {
    part.copy_(rows);
  } else {
    rows.copy_(part);
  }
}

void load(const at::Tensor& x, int64_t b, int64_t t0, int64_t t1, int64_t h0, int64_t heads,
          const at::Tensor& into) {
  move</*kStore=*/false>(x, b, t0, t1, h0, heads, into);
}

void store(const at::Tensor& from, const at::Tensor& x, int64_t b, int64_t t0, int64_t t1,
           int64_t h0, int64_t heads) {
  move</*kStore=*/true>(x, b, t0, t1, h0, heads, from);
}

// Rows t of head h of row b of x (B, T, H, D), as a (T, D) view (rows H * D apart): the keys or
// values of one kv head as the bf16 GEMM takes them, which reads any strides (no copy).
at::Tensor head_rows(const at::Tensor& x, int64_t b, int64_t h) {
  return x.select(0, b).select(1, h);
}

// Key range [lo, hi) of query position t (lo relative to the block's first key).
struct Range {
  int64_t lo, hi;
};

inline Range keys_of(const int64_t* ds, int64_t t, int64_t first_key) {
  return {(ds ? ds[t] : 0) - first_key, t + 1 - first_key};
}

// Whether S = Q K^T and dP = dO V^T multiply bf16 inputs as they are (the bf16 x bf16 -> fp32
// GEMM: fastllm's kernel with AVX512-BF16, MKL's on AMX CPUs) rather than fp32 copies of them.
// P and dS are never rounded to bf16: PyTorch's CPU flash attention keeps them fp32 (its bf16
// output and grads are within half an ulp there, and rounding them doubled fastllm's error on
// its tests). On AMX CPUs fastllm's kernel lost to the fp32 copies (fwd + bwd, bf16, 9 / 3 heads
// of 64, Intel Xeon, 2 cores: 8 x 512 tokens 69.8 ms against 54.8, BENCHMARKS.md 2026-12-07),
// so there the GEMM is MKL's or, in a PyTorch without it, the copies are taken
// (gemm_bf16f32_preferred; set_gemm_bf16f32 / set_gemm_bf16f32_engine force either).
bool bf16_products(const at::Tensor& q) {
  return q.scalar_type() == at::kBFloat16 && gemm_bf16f32_preferred();
}

// out (fp32) = a @ b: bf16 operands through csrc/cpu/gemm_bf16.cpp, fp32 ones through
// routed_mm_out.
void product(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() == at::kBFloat16) {
    gemm_bf16f32_cpu(a, b, out, /*accumulate=*/false);
  } else {
    routed_mm_out(out, a, b);
  }
}

// The row loops, on values passed in (no reference into the workers' captures, which gcc must
// assume a row's stores can change: it reloaded the scale with a gather every iteration and kept
// the running max in memory, BENCHMARKS.md 2026-12-05).
struct Softmax {
  float max, sum;
};

// The keys a row does not see: zeros for the products that read the whole block row.
inline void zero_outside(float* row, int64_t n, int64_t lo, int64_t hi) {
  std::fill(row, row + lo, 0.0f);
  std::fill(row + hi, row + n, 0.0f);
}

// row[lo, hi) <- exp(sc * row - max) (not divided by the sum: the caller scales the output's
// rows instead, D values a row instead of n); zero outside [lo, hi). The scaled scores are
// stored (rounded) before the exponent reads them: written as exp(row * sc - max), gcc fuses
// the product into an FMA (-ffp-contract=fast, its default), so the exponent saw the exact
// product while max and lse were of the rounded one (a row of one key got P = exp(residual),
// not 1: dV 1.4% off at |scaled score| 2.7e5, where the scale is not a power of two).
inline Softmax softmax_row(float* row, int64_t n, int64_t lo, int64_t hi, float sc) {
  float mx = -std::numeric_limits<float>::infinity();
  // a ternary, not std::max: gcc leaves a max reduction written with std::max scalar (its NaN
  // order is not the vector max's), which made this loop the softmax's slowest part
#pragma omp simd reduction(max : mx)
  for (int64_t j = lo; j < hi; ++j) {
    const float x = row[j] * sc;
    row[j] = x;
    mx = x > mx ? x : mx;
  }
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = lo; j < hi; ++j) {
    const float p = exp_fast(row[j] - mx);
    row[j] = p;
    sum += p;
  }
  zero_outside(row, n, lo, hi);
  return {mx, sum};
}

// rows x cols of x (contiguous) times each row's factor
inline void scale_rows(float* x, int64_t rows, int64_t cols, const float* factor) {
  for (int64_t i = 0; i < rows; ++i) {
    const float f = factor[i];
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) x[i * cols + j] *= f;
  }
}

// The backward's P row from its lse: row[lo, hi) <- exp(sc * row - lse), zero outside; the
// scaled scores rounded first, as the forward's (softmax_row) were.
inline void probs_row(float* row, int64_t n, int64_t lo, int64_t hi, float sc, float lse) {
#pragma omp simd
  for (int64_t j = lo; j < hi; ++j) row[j] *= sc;
#pragma omp simd
  for (int64_t j = lo; j < hi; ++j) row[j] = exp_fast(row[j] - lse);
  zero_outside(row, n, lo, hi);
}

// dS row from dP (in place) and P: dS = P (dP - delta) sc.
inline void dscores_row(float* dp, const float* p, int64_t n, float delta, float sc) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dp[j] = p[j] * (dp[j] - delta) * sc;
}

// The unit of parallel work: task bg = b * Hkv + g, its query positions [t0, t1) (whole blocks).
// A task is one part when there are at least kParts tasks; with fewer (a small batch, few kv
// heads) each task's blocks are split into parts of about equal causal work (block i sees i + 1
// blocks of keys), so that one row and three kv heads still keep 16 threads busy. The split is a
// function of the shapes alone, never of the thread count: the backward adds the parts' dK, dV in
// part order, so the thread count must not change the parts, or the bits of dK and dV would
// follow it (torch.set_num_threads(1) and (2) gave different last bits when it did).
constexpr int64_t kParts = 16;

struct Part {
  int64_t bg, t0, t1;
};

// One part runs on the calling thread, outside any parallel region, where its GEMMs (oneDNN's,
// OpenMP) would take every thread and split their sums by the thread count: dK, dV of one row
// with one kv head differed in the last bits between 1 and 2 threads. A task's GEMMs run on one
// thread wherever they run. (OpenMP's thread count is per thread: only the caller's changes.)
// ATen's own fp32 GEMM (MKL's sgemm, the route on Intel CPUs) keeps a thread count of its own,
// which torch.set_num_threads sets and omp_set_num_threads does not: dK differed by 2.4e-6
// between 1 and 2 threads on an Intel Xeon (2026-12-07), so MKL's per-thread count is set too,
// through MKL_Set_Num_Threads_Local, looked up at run time in libtorch_cpu (where MKL is linked
// in; a torch without MKL has nothing to set).
class OneThreadedGemms {
 public:
  explicit OneThreadedGemms(bool on) : on_(on) {
    if (!on) return;
    // ATen sets a thread's OpenMP and MKL counts to torch's on the thread's first parallel_for
    // (each library keeps its own once-per-thread flag, this extension too): done before the
    // counts are saved, or that first call would undo the guard and the destructor restore a
    // count torch had not set.
    at::internal::lazy_init_num_threads();
    saved_ = omp_get_max_threads();
    omp_set_num_threads(1);
    // (MKL's C entry: its header maps mkl_set_num_threads_local to it; the lower-case symbol is
    // the Fortran one, which takes a pointer)
    static const auto mkl_local =
        reinterpret_cast<int (*)(int)>(torch_cpu_symbol("MKL_Set_Num_Threads_Local"));
    mkl_ = mkl_local;
    if (mkl_ != nullptr) mkl_saved_ = mkl_(1);  // (the previous local count; 0: the global one)
  }
  ~OneThreadedGemms() {
    if (!on_) return;
    omp_set_num_threads(saved_);
    if (mkl_ != nullptr) mkl_(mkl_saved_);
  }
  OneThreadedGemms(const OneThreadedGemms&) = delete;
  OneThreadedGemms& operator=(const OneThreadedGemms&) = delete;

 private:
  bool on_;
  int saved_ = 0;
  int (*mkl_)(int) = nullptr;
  int mkl_saved_ = 0;
};

std::vector<Part> parts_of(const Shape& s) {
  const int64_t tasks = s.batch * s.kv_heads, T = s.tokens;
  const int64_t blocks = (T + kBlock - 1) / kBlock;
  int64_t split = 1;
  if (tasks > 0 && tasks < kParts) split = std::min(blocks, (kParts + tasks - 1) / tasks);
  std::vector<Part> parts;
  parts.reserve(tasks * split);
  const double total = double(blocks) * double(blocks + 1) / 2.0;
  for (int64_t bg = 0; bg < tasks; ++bg) {
    int64_t begin = 0;
    double work = 0.0;
    for (int64_t i = 0, k = 1; i < blocks; ++i) {
      work += double(i + 1);
      if (i + 1 == blocks || (k < split && work >= total * double(k) / double(split))) {
        parts.push_back({bg, begin * kBlock, std::min(T, (i + 1) * kBlock)});
        begin = i + 1;
        ++k;
      }
    }
  }
  return parts;
}

}  // namespace

std::vector<at::Tensor> attention_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                      const at::Tensor& v_in, const at::Tensor& doc_start,
                                      double scale) {
  // plain aliases: nothing the workers copy or multiply is recorded by autograd; a negative view
  // as its values (the workers read raw memory, and the bf16 GEMM refuses the bit)
  const auto q = q_in.detach().resolve_neg(), k = k_in.detach().resolve_neg(),
             v = v_in.detach().resolve_neg();
  const Shape s = check(q, k, v, doc_start, /*check_values=*/true);
  auto out = at::empty({s.batch, s.tokens, s.heads, s.dim}, q.options());
  auto lse = at::empty({s.batch, s.heads, s.tokens}, q.options().dtype(at::kFloat));
  if (out.numel() == 0) return {out, lse};
  const auto f32 = q.options().dtype(at::kFloat);
  const bool lowp = bf16_products(q);
  const int64_t T = s.tokens, G = s.group, D = s.dim;
  const float sc = static_cast<float>(scale);
  const int64_t* ds_all = doc_start.numel() > 0 ? doc_start.const_data_ptr<int64_t>() : nullptr;
  float* lse_all = lse.mutable_data_ptr<float>();
  const std::vector<Part> parts = parts_of(s);
  // the caller's thread-local state (inference mode, grad mode) in the pool's threads too: their
  // copies write tensors the caller made (an inference tensor under torch.inference_mode)
  const at::ThreadLocalState caller;
  const OneThreadedGemms one_threaded(parts.size() == 1);
  at::parallel_for(0, static_cast<int64_t>(parts.size()), 1, [&](int64_t begin, int64_t end) {
    at::ThreadLocalStateGuard same_state(caller);
    c10::NoGradGuard no_grad;
    // S's operands: bf16 q (the group's heads stacked) and k as it is (lowp), else fp32 copies
    auto qf = at::empty({T * G, D}, lowp ? q.options() : f32);
    auto kf = lowp ? at::Tensor() : at::empty({T, D}, f32);
    auto vf = at::empty({T, D}, f32), of = at::empty({T * G, D}, f32);
    auto scores = at::empty({std::min(T, kBlock) * G * T}, f32);
    std::vector<float> inv_sum(std::min(T, kBlock) * G);
    for (int64_t idx = begin; idx < end; ++idx) {
      const Part part = parts[idx];
      const int64_t b = part.bg / s.kv_heads, g = part.bg % s.kv_heads;
      const int64_t* ds = ds_all ? ds_all + b * T : nullptr;
      load(q, b, part.t0, part.t1, g * G, G, qf);  // row (t - t0) * G + h
      if (!lowp) load(k, b, 0, part.t1, g, 1, kf);  // row t: every key the part can see
      const auto keys = lowp ? head_rows(k, b, g) : kf;
      load(v, b, 0, part.t1, g, 1, vf);
      for (int64_t r0 = part.t0; r0 < part.t1; r0 += kBlock) {
        const int64_t r1 = std::min(part.t1, r0 + kBlock), rows = (r1 - r0) * G;
        const int64_t row0 = (r0 - part.t0) * G;
        const int64_t first = ds ? ds[r0] : 0, n = r1 - first;
        auto sblk = scores.narrow(0, 0, rows * n).view({rows, n});
        product(sblk, qf.narrow(0, row0, rows), keys.narrow(0, first, n).t());
        float* sp = sblk.mutable_data_ptr<float>();
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t t = r0 + i / G;
          const Range r = keys_of(ds, t, first);
          const Softmax row = softmax_row(sp + i * n, n, r.lo, r.hi, sc);
          inv_sum[i] = 1.0f / row.sum;
          lse_all[(b * s.heads + g * G + i % G) * T + t] = row.max + std::log(row.sum);
        }
        auto ob = of.narrow(0, row0, rows);
        routed_mm_out(ob, sblk, vf.narrow(0, first, n));
        scale_rows(ob.mutable_data_ptr<float>(), rows, D, inv_sum.data());
      }
      store(of, out, b, part.t0, part.t1, g * G, G);
    }
  });
  return {out, lse};
}

std::vector<at::Tensor> attention_backward_cpu(const at::Tensor& grad_out_in,
                                               const at::Tensor& q_in, const at::Tensor& k_in,
                                               const at::Tensor& v_in, const at::Tensor& out_in,
                                               const at::Tensor& lse, const at::Tensor& doc_start,
                                               double scale) {
  const auto grad_out = grad_out_in.detach().resolve_neg(), q = q_in.detach().resolve_neg(),
             k = k_in.detach().resolve_neg(), v = v_in.detach().resolve_neg(),
             out = out_in.detach().resolve_neg();
  const Shape s = check(q, k, v, doc_start, /*check_values=*/false);
  TORCH_CHECK(grad_out.sizes() == q.sizes() && out.sizes() == q.sizes() &&
                  lse.sizes() == at::IntArrayRef({s.batch, s.heads, s.tokens}) &&
                  lse.scalar_type() == at::kFloat && lse.is_contiguous(),
              "fastllm.attention_backward: grad_out/out must be q's shape and lse (B, Hq, T) "
              "contiguous fp32");
  auto dq = at::empty(q.sizes(), q.options());
  auto dk = at::empty(k.sizes(), k.options());
  auto dv = at::empty(v.sizes(), v.options());
  if (q.numel() == 0) return {dq, dk.zero_(), dv.zero_()};
  const auto f32 = q.options().dtype(at::kFloat);
  const bool lowp = bf16_products(q);
  const int64_t T = s.tokens, G = s.group, D = s.dim;
  const float sc = static_cast<float>(scale);
  const int64_t* ds_all = doc_start.numel() > 0 ? doc_start.const_data_ptr<int64_t>() : nullptr;
  const float* lse_all = lse.const_data_ptr<float>();
  const std::vector<Part> parts = parts_of(s);
  const int64_t tasks = s.batch * s.kv_heads;
  const bool split = static_cast<int64_t>(parts.size()) > tasks;
  // split tasks: each part's dK, dV contributions (rows [0, t1) of its keys) in rows of its own
  // (part i's from row offset[i]), summed per task in part order afterwards (only with fewer than
  // kParts tasks, so fewer than 2 x kParts x T rows of D fp32)
  at::Tensor dk_parts, dv_parts;
  std::vector<int64_t> offset(parts.size() + 1, 0);
  if (split) {
    for (size_t i = 0; i < parts.size(); ++i) offset[i + 1] = offset[i] + parts[i].t1;
    dk_parts = at::empty({offset.back(), D}, f32);
    dv_parts = at::empty({offset.back(), D}, f32);
  }
  const at::ThreadLocalState caller;
  const OneThreadedGemms one_threaded(parts.size() == 1);
  at::parallel_for(0, static_cast<int64_t>(parts.size()), 1, [&](int64_t begin, int64_t end) {
    at::ThreadLocalStateGuard same_state(caller);
    c10::NoGradGuard no_grad;
    auto qf = at::empty({T * G, D}, f32), kf = at::empty({T, D}, f32);
    auto vf = lowp ? at::Tensor() : at::empty({T, D}, f32);  // (lowp: dP takes v16)
    auto dof = at::empty({T * G, D}, f32), of = at::empty({T * G, D}, f32);
    // S's and dP's operands: bf16 copies of q and dO (lowp; k and v as they are), else the fp32
    // ones
    auto q16 = lowp ? at::empty({T * G, D}, q.options()) : qf;
    auto do16 = lowp ? at::empty({T * G, D}, q.options()) : dof;
    auto dqf = at::empty({T * G, D}, f32);
    auto dk_own = split ? at::Tensor() : at::empty({T, D}, f32);
    auto dv_own = split ? at::Tensor() : at::empty({T, D}, f32);
    const int64_t most = std::min(T, kBlock) * G * T;
    auto pbuf = at::empty({most}, f32), dpbuf = at::empty({most}, f32);
    std::vector<float> delta(T * G), row_lse(T * G);
    for (int64_t idx = begin; idx < end; ++idx) {
      const Part part = parts[idx];
      const int64_t b = part.bg / s.kv_heads, g = part.bg % s.kv_heads;
      const int64_t* ds = ds_all ? ds_all + b * T : nullptr;
      const int64_t own_rows = (part.t1 - part.t0) * G;
      load(q, b, part.t0, part.t1, g * G, G, qf);
      load(k, b, 0, part.t1, g, 1, kf);
      load(grad_out, b, part.t0, part.t1, g * G, G, dof);
      if (lowp) {
        load(q, b, part.t0, part.t1, g * G, G, q16);
        load(grad_out, b, part.t0, part.t1, g * G, G, do16);
      } else {
        load(v, b, 0, part.t1, g, 1, vf);
      }
      const auto k16 = lowp ? head_rows(k, b, g) : kf, v16 = lowp ? head_rows(v, b, g) : vf;
      load(out, b, part.t0, part.t1, g * G, G, of);
      // delta = rowsum(dO * O), and each row's lse, in the part's (t, h) row order
      const float* dop = dof.const_data_ptr<float>();
      const float* op = of.const_data_ptr<float>();
      for (int64_t i = 0; i < own_rows; ++i) {
        float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
        for (int64_t d = 0; d < D; ++d) acc += dop[i * D + d] * op[i * D + d];
        delta[i] = acc;
        row_lse[i] = lse_all[(b * s.heads + g * G + i % G) * T + part.t0 + i / G];
      }
      auto dkf = split ? dk_parts.narrow(0, offset[idx], part.t1) : dk_own;
      auto dvf = split ? dv_parts.narrow(0, offset[idx], part.t1) : dv_own;
      // the rows the part can reach: a split task's sum reads no others, and an unsplit task's
      // one part reaches all T
      dkf.narrow(0, 0, part.t1).zero_();
      dvf.narrow(0, 0, part.t1).zero_();
      for (int64_t r0 = part.t0; r0 < part.t1; r0 += kBlock) {
        const int64_t r1 = std::min(part.t1, r0 + kBlock), rows = (r1 - r0) * G;
        const int64_t row0 = (r0 - part.t0) * G;
        const int64_t first = ds ? ds[r0] : 0, n = r1 - first;
        auto p = pbuf.narrow(0, 0, rows * n).view({rows, n});
        auto dp = dpbuf.narrow(0, 0, rows * n).view({rows, n});
        const auto qb = qf.narrow(0, row0, rows), dob = dof.narrow(0, row0, rows);
        const auto kb = kf.narrow(0, first, n);
        product(p, q16.narrow(0, row0, rows), k16.narrow(0, first, n).t());
        float* pp = p.mutable_data_ptr<float>();
        for (int64_t i = 0; i < rows; ++i) {
          const int64_t t = r0 + i / G;
          const Range r = keys_of(ds, t, first);
          probs_row(pp + i * n, n, r.lo, r.hi, sc, row_lse[row0 + i]);
        }
        addmm_inplace(dvf.narrow(0, first, n), p.t(), dob, 1.0);
        product(dp, do16.narrow(0, row0, rows), v16.narrow(0, first, n).t());
        float* dpp = dp.mutable_data_ptr<float>();
        for (int64_t i = 0; i < rows; ++i) {
          dscores_row(dpp + i * n, pp + i * n, n, delta[row0 + i], sc);
        }
        routed_mm_out(dqf.narrow(0, row0, rows), dp, kb);
        addmm_inplace(dkf.narrow(0, first, n), dp.t(), qb, 1.0);
      }
      store(dqf, dq, b, part.t0, part.t1, g * G, G);
      if (!split) {
        store(dkf, dk, b, 0, T, g, 1);
        store(dvf, dv, b, 0, T, g, 1);
      }
    }
  });
  if (split) {
    // each task's parts in order: part p covered keys [0, its t1). Parallel over (task, block of
    // kBlock key rows), so that one task's sum is not left to one thread; every element is still
    // the sum of its parts in part order.
    std::vector<int64_t> first_part(tasks + 1, static_cast<int64_t>(parts.size()));
    for (int64_t i = static_cast<int64_t>(parts.size()) - 1; i >= 0; --i) first_part[parts[i].bg] = i;
    const int64_t key_blocks = (T + kBlock - 1) / kBlock;
    at::parallel_for(0, tasks * key_blocks, 1, [&](int64_t begin, int64_t end) {
      at::ThreadLocalStateGuard same_state(caller);
      c10::NoGradGuard no_grad;
      auto dk_sum = at::empty({kBlock, D}, f32), dv_sum = at::empty({kBlock, D}, f32);
      for (int64_t item = begin; item < end; ++item) {
        const int64_t bg = item / key_blocks, j0 = (item % key_blocks) * kBlock;
        const int64_t j1 = std::min(T, j0 + kBlock);
        const int64_t b = bg / s.kv_heads, g = bg % s.kv_heads;
        dk_sum.zero_();
        dv_sum.zero_();
        for (int64_t i = first_part[bg]; i < first_part[bg + 1]; ++i) {
          const int64_t seen = std::min(parts[i].t1, j1) - j0;  // the part's rows in the block
          if (seen <= 0) continue;
          dk_sum.narrow(0, 0, seen).add_(dk_parts.narrow(0, offset[i] + j0, seen));
          dv_sum.narrow(0, 0, seen).add_(dv_parts.narrow(0, offset[i] + j0, seen));
        }
        store(dk_sum, dk, b, j0, j1, g, 1);
        store(dv_sum, dv, b, j0, j1, g, 1);
      }
    });
  }
  return {dq, dk, dv};
}

}  // namespace fastllm
