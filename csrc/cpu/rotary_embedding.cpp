// Rotary position embedding of q and k together, Hugging Face's rotate-half convention, for CPU
// tensors. For each (batch b, position s) row, head and i < d/2 (h = d/2):
//   forward   out[i]   = x[i] cos[i]     - x[i+h] sin[i]
//             out[i+h] = x[i+h] cos[i+h] + x[i]   sin[i+h]
//   backward  dx[i]    = dy[i] cos[i]     + dy[i+h] sin[i+h]
//             dx[i+h]  = dy[i+h] cos[i+h] - dy[i]   sin[i]
// (the transpose of the forward's 2x2 rotation; with HF's duplicated halves, the forward with -sin).
// q (B, S, Hq, D) and k (B, S, Hk, D) have any strides with a unit last stride (HF's (B, H, S, D)
// tensors are passed transposed); Hk may be smaller than Hq (GQA). cos/sin rows are picked as
// cos[position_ids[b, s]] from a (P, D) table, or cos[b, s] from (B or 1, S, D) when
// position_ids is empty. Outputs may be the inputs themselves (in place): each element is read
// before its pair is written, within one row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "cpu/model_io.h"
#include "fastllm.h"

namespace fastllm {
namespace {

using model_io::Io;

struct View4 {  // (B, S, H, D) strides in elements, last stride 1
  int64_t sb, ss, sh;
};

View4 view_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

template <typename scalar_t, bool BACKWARD>
void rotate_heads(const typename Io<scalar_t>::raw_t* src, typename Io<scalar_t>::raw_t* dst,
                  int64_t heads, int64_t src_sh, int64_t dst_sh,
                  const typename Io<scalar_t>::raw_t* c, const typename Io<scalar_t>::raw_t* s,
                  int64_t d) {
  // No __restrict: dst may be src (in place). Each iteration reads its own pair before writing
  // it and touches no other iteration's elements, so `omp simd` is still exact.
  using io = Io<scalar_t>;
  using op_t = typename io::opmath_t;
  using raw_t = typename io::raw_t;
  const int64_t half = d / 2;
  for (int64_t hd = 0; hd < heads; ++hd) {
    const raw_t* x = src + hd * src_sh;
    raw_t* o = dst + hd * dst_sh;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const op_t x1 = io::load(x[i]), x2 = io::load(x[i + half]);
      const op_t c1 = io::load(c[i]), c2 = io::load(c[i + half]);
      const op_t s1 = io::load(s[i]), s2 = io::load(s[i + half]);
      op_t o1, o2;
      if constexpr (BACKWARD) {
        o1 = x1 * c1 + x2 * s2;
        o2 = x2 * c2 - x1 * s1;
      } else {
        o1 = x1 * c1 - x2 * s1;
        o2 = x2 * c2 + x1 * s2;
      }
      o[i] = io::store(o1);
      o[i + half] = io::store(o2);
    }
  }
}

template <typename scalar_t, bool BACKWARD>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
         const at::Tensor& position_ids, const at::Tensor& q_out, const at::Tensor& k_out) {
  using raw_t = typename Io<scalar_t>::raw_t;
  const int64_t B = q.size(0), S = q.size(1), Hq = q.size(2), Hk = k.size(2), D = q.size(3);
  const View4 vq = view_of(q), vk = view_of(k), vqo = view_of(q_out), vko = view_of(k_out);
  const raw_t* qp = reinterpret_cast<const raw_t*>(q.const_data_ptr());
  const raw_t* kp = reinterpret_cast<const raw_t*>(k.const_data_ptr());
  raw_t* qo = reinterpret_cast<raw_t*>(q_out.mutable_data_ptr());
  raw_t* ko = reinterpret_cast<raw_t*>(k_out.mutable_data_ptr());
  const raw_t* cp = reinterpret_cast<const raw_t*>(cos.const_data_ptr());
  const raw_t* sp = reinterpret_cast<const raw_t*>(sin.const_data_ptr());
  const bool gather = position_ids.numel() > 0;
  const int64_t* pos = gather ? position_ids.const_data_ptr<int64_t>() : nullptr;
  const int64_t pos_sb = gather ? (position_ids.size(0) == 1 ? 0 : position_ids.stride(0)) : 0;
  const int64_t pos_ss = gather ? position_ids.stride(1) : 0;
  // cos/sin: (P, D) with position_ids, else (B or 1, S, D); unit last stride
  const int64_t c_sb = gather ? 0 : (cos.size(0) == 1 ? 0 : cos.stride(0));
  const int64_t c_ss = gather ? 0 : cos.stride(1);
  const int64_t c_sp = gather ? cos.stride(0) : 0;
  const int64_t s_sb = gather ? 0 : (sin.size(0) == 1 ? 0 : sin.stride(0));
  const int64_t s_ss = gather ? 0 : sin.stride(1);
  const int64_t s_sp = gather ? sin.stride(0) : 0;
  const int64_t rows = B * S;
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 14) / std::max<int64_t>((Hq + Hk) * D, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / S, s = row % S;
      const raw_t* c;
      const raw_t* sn;
      if (gather) {
        const int64_t p = pos[b * pos_sb + s * pos_ss];
        c = cp + p * c_sp;
        sn = sp + p * s_sp;
      } else {
        c = cp + b * c_sb + s * c_ss;
        sn = sp + b * s_sb + s * s_ss;
      }
      rotate_heads<scalar_t, BACKWARD>(qp + b * vq.sb + s * vq.ss, qo + b * vqo.sb + s * vqo.ss, Hq,
                                       vq.sh, vqo.sh, c, sn, D);
      rotate_heads<scalar_t, BACKWARD>(kp + b * vk.sb + s * vk.ss, ko + b * vko.sb + s * vko.ss, Hk,
                                       vk.sh, vko.sh, c, sn, D);
    }
  });
}

}  // namespace

void rotary_embedding_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                          const at::Tensor& sin, const at::Tensor& position_ids,
                          const at::Tensor& q_out, const at::Tensor& k_out, bool backward) {
  // (an empty tensor's strides say nothing: autograd hands an empty output's grad as a
  // zero-stride expand, which .contiguous() keeps)
  for (const auto* t : {&q, &k, &q_out, &k_out}) {
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 4 && (t->numel() == 0 || t->stride(3) == 1) &&
                    t->scalar_type() == q.scalar_type(),
                "fastllm.rotary_embedding: q, k and outputs must be 4-D (B, S, H, D) CPU tensors "
                "of one dtype with unit last stride");
  }
  TORCH_CHECK(cos.scalar_type() == q.scalar_type() && sin.scalar_type() == q.scalar_type() &&
                  (cos.numel() == 0 || cos.stride(-1) == 1) &&
                  (sin.numel() == 0 || sin.stride(-1) == 1),
              "fastllm.rotary_embedding: cos and sin must have q's dtype and unit last stride");
  TORCH_CHECK(position_ids.numel() == 0 || (position_ids.scalar_type() == at::kLong &&
                                            position_ids.dim() == 2),
              "fastllm.rotary_embedding: position_ids must be int64 (B or 1, S)");
  if (q.numel() == 0 && k.numel() == 0) return;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(),
                                  "fastllm_rotary_embedding_cpu", [&] {
    if (backward) {
      run<scalar_t, true>(q, k, cos, sin, position_ids, q_out, k_out);
    } else {
      run<scalar_t, false>(q, k, cos, sin, position_ids, q_out, k_out);
    }
  });
}

}  // namespace fastllm
