// Fused linear cross-entropy for CPU tensors: the head matmul and the loss over chunks of tokens,
// with the grads of hidden, weight and bias produced in the same pass; the (tokens x vocab)
// logits and their grad never exist, only one (chunk rows x vocab) buffer.
//
// Per chunk of c valid tokens (ignored tokens are dropped before any matmul: they cost nothing):
//   Z  = X_c W^T + b                  fastllm::routed_mm_out (csrc/cpu/gemm.cpp), into the chunk
//   row pass (OpenMP over rows, vectorised, fp32 whatever the storage dtype), in place in Z:
//        z = cap * tanh(z / cap)                          (logit_softcap, Gemma-2)
//        lse = log sum_j exp(z_j)
//        loss = lse - (1 - eps) z_y - eps mean_j(z_j) + z_loss lse^2
//        G_j = w (p_j (1 + 2 z_loss lse) - eps / V - (1 - eps) [j = y]) (1 - (z_j / cap)^2)
//   dX_c = G W                        fastllm::routed_mm_out, straight into grad_hidden's rows
//   dW  += G^T X_c, db += sum_rows G  fp32 accumulation: fp32 in place (addmm_); bf16 over
//                                     several chunks: the bf16 x bf16 -> fp32 GEMM into an fp32
//                                     dW (csrc/cpu/gemm_bf16.cpp: MKL's on AMX CPUs, fastllm's
//                                     with AVX512-BF16); else (fp16, or neither) each chunk's
//                                     product by the
//                                     native low-precision GEMM, a tile of vocabulary rows at a
//                                     time, added with its rounding residual into an fp32 dW
//                                     (one chunk: at::mm, one rounding, as torch's own backward)
// w is the token's weight in the reduction (1 / valid tokens for "mean", 1 for "sum", the
// incoming grad for "none"'s backward). The maths is fastllm/ops/fused_linear_cross_entropy.py's
// `fused_linear_cross_entropy_ref`, differentiated by hand.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "fastllm.h"
#include "cpu/vec_math.h"
#include "low_precision.h"

namespace fastllm {
namespace {

using vec_math::exp_fast;
using vec_math::softcap_fast;

template <typename scalar_t>
struct Store;  // raw storage type and fp32 conversions of the chunk buffer

template <>
struct Store<float> {
  using raw_t = float;
  static float load(float v) { return v; }
  static float store(float v) { return v; }
};
template <>
struct Store<at::BFloat16> {
  using raw_t = uint16_t;
  static float load(uint16_t v) { return lowp::BF16::load(v); }
  static uint16_t store(float v) { return lowp::BF16::round_nearest(v); }
};
template <>
struct Store<at::Half> {
  using raw_t = uint16_t;
  static float load(uint16_t v) { return lowp::F16::load(v); }
  static uint16_t store(float v) { return lowp::F16::round_nearest(v); }
};

struct LossParams {
  float smoothing;  // label_smoothing eps
  float z_loss;     // z_loss coefficient
  float cap;        // logit_softcap, 0 for none
  bool need_grad;   // overwrite the row with the logits' grad
};

// One token's row of logits (vocab entries) -> its loss; with need_grad the row is replaced by
// w * dloss/dlogits. scratch: vocab fp32 (the row itself for fp32 storage). Three passes over the
// row, which stays in L2 between them (196 KB at vocab 49152 in fp32): max (and sum) from the
// stored logits; e^(z - max) and its sum, kept in scratch for the grad; the grad written straight
// into the row. 512-bit vectors where the CPU has them: gcc's -march=native stops at 256 bits
// (prefer-vector-width) and the exponential's polynomial is this loop's work (BENCHMARKS.md,
// 2026-12-07, third session).
template <typename scalar_t>
FASTLLM_WIDE_VECTORS float row_pass(typename Store<scalar_t>::raw_t* row, float* scratch,
                                    int64_t vocab, int64_t label, float w, const LossParams& p) {
  using S = Store<scalar_t>;
  const bool capped = p.cap > 0.0f;
  const float cap = p.cap, inv_cap = capped ? 1.0f / p.cap : 0.0f;
  float mx = -std::numeric_limits<float>::infinity();
  float sum_z = 0.0f;
  if (capped) {  // scratch keeps the capped logits for the exponentials and the cap's derivative
#pragma omp simd reduction(max : mx) reduction(+ : sum_z)
    for (int64_t j = 0; j < vocab; ++j) {
      const float z = softcap_fast(S::load(row[j]), cap, inv_cap);
      scratch[j] = z;
      mx = z > mx ? z : mx;
      sum_z += z;
    }
  } else {
#pragma omp simd reduction(max : mx) reduction(+ : sum_z)
    for (int64_t j = 0; j < vocab; ++j) {
      const float z = S::load(row[j]);
      mx = z > mx ? z : mx;
      sum_z += z;
    }
  }
  const float z_y = capped ? scratch[label] : S::load(row[label]);
  // Without a cap and with a grad to make, scratch keeps e^(z - max) for it: p = e / sum, one
  // exponential per logit where the grad pass took a second (its exp(z - lse) is e / sum up to
  // rounding). With a cap scratch must keep z for the cap's derivative.
  const bool keep_exp = p.need_grad && !capped;
  float sum_exp = 0.0f;
  if (keep_exp) {
#pragma omp simd reduction(+ : sum_exp)
    for (int64_t j = 0; j < vocab; ++j) {
      const float e = exp_fast(S::load(row[j]) - mx);
      scratch[j] = e;
      sum_exp += e;
    }
  } else if (capped) {
#pragma omp simd reduction(+ : sum_exp)
    for (int64_t j = 0; j < vocab; ++j) sum_exp += exp_fast(scratch[j] - mx);
  } else {
#pragma omp simd reduction(+ : sum_exp)
    for (int64_t j = 0; j < vocab; ++j) sum_exp += exp_fast(S::load(row[j]) - mx);
  }
  const float lse = mx + std::log(sum_exp);
  const float eps = p.smoothing;
  // The smoothing term only when eps > 0: a -inf logit (a bias masking vocabulary entries) makes
  // sum_z -inf, and 0 * -inf would turn a finite loss into nan (F.cross_entropy gives it finite).
  const float smooth = eps > 0.0f ? eps * (sum_z / static_cast<float>(vocab)) : 0.0f;
  const float loss = lse - (1.0f - eps) * z_y - smooth + p.z_loss * lse * lse;
  if (!p.need_grad) return loss;
  const float coef = w * (1.0f + 2.0f * p.z_loss * lse);
  const float offset = w * eps / static_cast<float>(vocab);
  // The grad computed in fp32 and rounded once into the row (for fp32 storage scratch is the row:
  // each entry is read before it is written). The target entry is then made from its own fp32
  // term, read before the pass (not from the rounded value it stores).
  if (capped) {
    const float t_y = z_y * inv_cap;
    const float g_y = (coef * exp_fast(z_y - lse) - offset - w * (1.0f - eps)) *
                      (1.0f - t_y * t_y);
#pragma omp simd
    for (int64_t j = 0; j < vocab; ++j) {
      const float z = scratch[j];
      const float t = z * inv_cap;
      row[j] = S::store((coef * exp_fast(z - lse) - offset) * (1.0f - t * t));
    }
    row[label] = S::store(g_y);
  } else {
    const float scale = coef / sum_exp;
    const float g_y = (scratch[label] * scale - offset) - w * (1.0f - eps);
#pragma omp simd
    for (int64_t j = 0; j < vocab; ++j) row[j] = S::store(scratch[j] * scale - offset);
    row[label] = S::store(g_y);
  }
  return loss;
}

void check_inputs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
                  const c10::optional<at::Tensor>& bias,
                  const c10::optional<at::Tensor>& token_scale) {
  const char* op = "fastllm.fused_linear_cross_entropy";
  TORCH_CHECK(hidden.device().is_cpu() && weight.device().is_cpu() && labels.device().is_cpu(),
              op, ": the cpp kernel takes CPU tensors");
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && labels.dim() == 1, op,
              ": expects hidden (N, H), weight (V, H), labels (N,)");
  TORCH_CHECK(hidden.size(1) == weight.size(1) && labels.size(0) == hidden.size(0), op,
              ": shapes disagree: hidden ", hidden.sizes(), ", weight ", weight.sizes(),
              ", labels ", labels.sizes());
  TORCH_CHECK(hidden.scalar_type() == weight.scalar_type(), op, ": hidden is ",
              hidden.scalar_type(), " but weight is ", weight.scalar_type());
  TORCH_CHECK(labels.scalar_type() == at::kLong, op, ": labels must be int64");
  TORCH_CHECK(hidden.is_contiguous() && weight.is_contiguous() && labels.is_contiguous(), op,
              ": hidden, weight and labels must be contiguous");
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) &&
                    bias->scalar_type() == weight.scalar_type() && bias->is_contiguous(),
                op, ": bias must be a contiguous (V,) tensor of weight's dtype");
  }
  if (token_scale) {
    TORCH_CHECK(token_scale->dim() == 1 && token_scale->size(0) == hidden.size(0) &&
                    token_scale->scalar_type() == at::kFloat && token_scale->is_contiguous(),
                op, ": token_scale must be a contiguous (N,) fp32 tensor");
  }
}

// Rows of the chunk buffer: ~kBudget bytes of (rows x vocab) logits, at least 1 row and no more
// than the tokens.
int64_t chunk_rows_for(int64_t tokens, int64_t vocab, int64_t elem_size, int64_t requested) {
  // fastllm/ops/fused_linear_cross_entropy.py passes rows from its CHUNK_BYTES; the same default
  constexpr int64_t kBudget = int64_t(128) << 20;
  const int64_t most = std::max<int64_t>(
      1, requested > 0 ? requested : kBudget / std::max<int64_t>(1, vocab * elem_size));
  if (tokens <= most) return std::max<int64_t>(1, tokens);
  // As few chunks as an equal split needs: each chunk streams the whole weight through its three
  // GEMMs however few its rows, so 2048 tokens at 682 rows go as 3 chunks (688, 688, 672), not
  // 3 x 682 + 2 (a chunk may exceed `most` by up to an eighth and a tile for that; the last one
  // takes what is left). From 8 tiles of kRowTile rows on, whole tiles: oneDNN's GEMMs ran at
  // 60-75% of their speed at some row counts (1363, 682) and at full speed at every multiple of
  // 16 tried (BENCHMARKS.md, 2026-12-05). fastllm/ops/fused_linear_cross_entropy.py's
  // balanced_rows is the same rule.
  constexpr int64_t kRowTile = 16;
  int64_t chunks = tokens / most;
  if ((tokens + chunks - 1) / chunks > most + most / 8) chunks += 1;
  int64_t rows = (tokens + chunks - 1) / chunks;
  if (rows >= 8 * kRowTile) rows = std::min(tokens, (rows + kRowTile - 1) / kRowTile * kRowTile);
  return rows;
}

template <typename scalar_t>
std::vector<at::Tensor> run(const at::Tensor& hidden, const at::Tensor& weight,
                            const at::Tensor& labels, const c10::optional<at::Tensor>& bias,
                            const c10::optional<at::Tensor>& token_scale, double scale,
                            bool divide_by_valid, int64_t ignore_index, const LossParams& params, bool need_hidden,
                            bool need_weight, bool need_bias, int64_t chunk_rows_requested) {
  using raw_t = typename Store<scalar_t>::raw_t;
  const int64_t n = hidden.size(0), h = hidden.size(1), vocab = weight.size(0);
  const auto f32 = hidden.options().dtype(at::kFloat);
  auto loss = at::zeros({n}, f32);
  const bool grads = params.need_grad;
  at::Tensor grad_hidden = hidden.new_empty({0});
  at::Tensor grad_weight = weight.new_empty({0});
  at::Tensor grad_bias = weight.new_empty({0});
  const int64_t* lab = labels.const_data_ptr<int64_t>();
  // Valid tokens, in order; ignored ones are left out of every matmul.
  std::vector<int64_t> valid;
  valid.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t y = lab[i];
    if (y == ignore_index) continue;
    TORCH_CHECK(y >= 0 && y < vocab, "fastllm.fused_linear_cross_entropy: label ", y,
                " at token ", i, " is outside [0, ", vocab, ") and is not ignore_index (",
                ignore_index, ")");
    valid.push_back(i);
  }
  const int64_t m = static_cast<int64_t>(valid.size());
  if (grads && need_hidden) grad_hidden = m == n ? at::empty_like(hidden) : at::zeros_like(hidden);
  const bool fp32 = hidden.scalar_type() == at::kFloat;
  const int64_t rows = chunk_rows_for(m, vocab, hidden.element_size(), chunk_rows_requested);
  // fp32 accumulators; bf16/fp16 with a single chunk write dW with one product (one rounding)
  const bool direct_dw = fp32 || m <= rows;
  // Otherwise (fp16, or bf16 where gemm_bf16f32_preferred() is false) over several chunks: dw32
  // is an fp32 (V, H) accumulator and `partial` one tile of a chunk's product P in the storage
  // dtype (the tile, not the chunk's whole (V, H) product, keeps the transient at
  // kPartialBytes). The native low-precision GEMM accumulates in fp32 but rounds its output,
  // and partial sums rounded chunk by chunk can cancel to worse than torch's one rounding; so
  // each tile is added as round(P) and then the rounded residual round(P - round(P)) (a second
  // GEMM with beta = -1, whose sum the GEMM forms in fp32): the accumulated error is ~u^2 |P|,
  // fp32-like. Two native GEMMs are
  // still faster than ATen's cpublas::brgemm with an fp32 accumulator, which ran at 146 GFLOP/s
  // on AVX512-BF16 without AMX (no VNNI packing there) against ~530 for this GEMM (BENCHMARKS.md,
  // 2026-12-02).
  // bf16 where the bf16 x bf16 -> fp32 GEMM takes the C++ kernels' products
  // (gemm_bf16f32_preferred: fastllm's kernel with AVX512-BF16, MKL's on AMX CPUs, where the
  // kernel was slower than the two native AMX GEMMs: 1.5-1.6x the loss's time, BENCHMARKS.md
  // 2026-12-07): each chunk's product is summed straight into dw32 in fp32 by one GEMM, no
  // rounding and no residual.
  const bool widened_dw = !direct_dw && std::is_same<scalar_t, at::BFloat16>::value &&
                          gemm_bf16f32_preferred();
  constexpr int64_t kPartialBytes = int64_t(16) << 20;
  at::Tensor dw32, partial, db32;
  int64_t tile = vocab;
  if (grads && need_weight) {
    if (direct_dw) {
      dw32 = m > 0 ? at::empty_like(weight) : at::zeros_like(weight);
    } else if (widened_dw) {
      dw32 = at::empty({vocab, h}, f32);  // m > rows > 0: the first chunk writes it whole
    } else {
      dw32 = at::zeros({vocab, h}, f32);
      tile = std::min<int64_t>(vocab, std::max<int64_t>(256, kPartialBytes / (std::max<int64_t>(1, h) * weight.element_size())));
      partial = at::empty({tile, h}, weight.options());
    }
  }
  if (grads && need_bias && bias) db32 = at::zeros({vocab}, f32);
  if (m > 0) {
    const bool all_valid = m == n;
    at::Tensor index;
    if (!all_valid) index = at::from_blob(valid.data(), {m}, at::kLong).clone();
    auto buffer = at::empty({rows, vocab}, hidden.options());
    const float token_weight = static_cast<float>(divide_by_valid ? scale / double(m) : scale);
    const float* ts = token_scale ? token_scale->const_data_ptr<float>() : nullptr;
    float* loss_ptr = loss.mutable_data_ptr<float>();
    const auto wt = weight.t();
    for (int64_t c0 = 0; c0 < m; c0 += rows) {
      const int64_t c = std::min(rows, m - c0);
      auto z = buffer.narrow(0, 0, c);
      auto x = all_valid ? hidden.narrow(0, c0, c) : hidden.index_select(0, index.narrow(0, c0, c));
      if (bias) {
        bias_mm_out(z, *bias, x, wt);
      } else {
        routed_mm_out(z, x, wt);
      }
      raw_t* zp = reinterpret_cast<raw_t*>(z.mutable_data_ptr());
      const int64_t* vp = valid.data() + c0;
      const bool stage = !std::is_same<scalar_t, float>::value;
      at::parallel_for(0, c, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scratch(stage ? vocab : 0);
        for (int64_t r = begin; r < end; ++r) {
          const int64_t tok = vp[r];
          raw_t* row = zp + r * vocab;
          float* s = stage ? scratch.data() : reinterpret_cast<float*>(row);
          const float w = token_weight * (ts ? ts[tok] : 1.0f);
          loss_ptr[tok] = row_pass<scalar_t>(row, s, vocab, lab[tok], w, params);
        }
      });
      if (!grads) continue;
      if (need_hidden) {
        if (all_valid) {
          routed_mm_out(grad_hidden.narrow(0, c0, c), z, weight);
        } else {
          auto rows_grad = at::empty({c, h}, z.options());
          routed_mm_out(rows_grad, z, weight);
          grad_hidden.index_copy_(0, index.narrow(0, c0, c), rows_grad);
        }
      }
      if (need_weight) {
        if (direct_dw) {
          if (c0 == 0) {
            routed_mm_out(dw32, z.t(), x);
          } else {
            addmm_inplace(dw32, z.t(), x, 1.0);
          }
        } else if (widened_dw) {
          gemm_bf16f32_cpu(z.t(), x, dw32, /*accumulate=*/c0 > 0);
        } else {
          const auto gt = z.t();  // (V, c)
          for (int64_t v0 = 0; v0 < vocab; v0 += tile) {
            const int64_t nv = std::min(tile, vocab - v0);
            auto p = partial.narrow(0, 0, nv);
            const auto g = gt.narrow(0, v0, nv);
            auto acc = dw32.narrow(0, v0, nv);
            routed_mm_out(p, g, x);    // P rounded once
            acc.add_(p);
            p.addmm_(g, x, -1.0);  // the rounding's residual P - round(P), itself rounded
            acc.add_(p);
          }
        }
      }
      if (db32.defined()) db32.add_(at::sum(z, {0}, false, at::kFloat));
    }
  }
  if (dw32.defined()) grad_weight = direct_dw ? dw32 : dw32.to(weight.scalar_type());
  if (db32.defined()) grad_bias = db32.to(weight.scalar_type());
  return {loss, grad_hidden, grad_weight, grad_bias};
}

}  // namespace

std::vector<at::Tensor> fused_linear_cross_entropy_cpu(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
    const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& token_scale,
    double scale, bool divide_by_valid, int64_t ignore_index, double label_smoothing, double z_loss, double softcap,
    bool need_hidden, bool need_weight, bool need_bias, int64_t chunk_rows) {
  check_inputs(hidden, weight, labels, bias, token_scale);
  const LossParams params{static_cast<float>(label_smoothing), static_cast<float>(z_loss),
                          static_cast<float>(softcap > 0.0 ? softcap : 0.0),
                          need_hidden || need_weight || need_bias};
  switch (hidden.scalar_type()) {
    case at::kFloat:
      return run<float>(hidden, weight, labels, bias, token_scale, scale, divide_by_valid, ignore_index, params,
                        need_hidden, need_weight, need_bias, chunk_rows);
    case at::kBFloat16:
      return run<at::BFloat16>(hidden, weight, labels, bias, token_scale, scale, divide_by_valid, ignore_index,
                               params, need_hidden, need_weight, need_bias, chunk_rows);
    case at::kHalf:
      return run<at::Half>(hidden, weight, labels, bias, token_scale, scale, divide_by_valid, ignore_index, params,
                           need_hidden, need_weight, need_bias, chunk_rows);
    default:
      TORCH_CHECK(false, "fastllm.fused_linear_cross_entropy: the cpp kernel takes fp32, bf16 or "
                         "fp16, got ", hidden.scalar_type());
  }
}

}  // namespace fastllm
