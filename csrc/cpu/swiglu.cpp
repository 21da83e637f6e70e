// Gated MLP activations for CPU tensors: y = act(gate) * up, with act(g) = g * sigmoid(a(g)):
//   SwiGLU (Llama, Qwen2, Mistral):  silu(g),       a(g) = g
//   GeGLU (Gemma):  gelu_tanh(g) = 0.5 g (1 + tanh(k (g + c g^3))) = g * sigmoid(2k (g + c g^3)),
//                   k = sqrt(2 / pi), c = 0.044715 (PyTorch's gelu(approximate="tanh"))
// The backward recomputes sig = sigmoid(a(gate)) from gate instead of reading a saved activation,
// in the same pass:
//   dgate = dy * up * sig * (1 + gate * (1 - sig) * a'(gate)),   dup = dy * gate * sig
// with need_h also the product h itself (swiglu_linear's weight grad), in that pass too. fp32
// arithmetic (fp64 for fp64), one rounding per output; e^x from vec_math.h so the loops vectorise.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "cpu/model_io.h"
#include "cpu/vec_math.h"
#include "fastllm.h"

namespace fastllm {
namespace {

using model_io::Io;

constexpr int64_t kGrain = int64_t(1) << 15;  // elements per task: a fork/join amortised

void check(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.sizes() == like.sizes() &&
                  t.scalar_type() == like.scalar_type(),
              "fastllm.swiglu: ", name, " must be a contiguous CPU tensor of gate's shape and dtype");
}

// a(g) and a'(g) of the activation act(g) = g * sigmoid(a(g)). (SiLU's a' is 1, whose products
// are exact: the SwiGLU loops compute what they did before GeGLU shared them, bit for bit.)
struct Silu {
  template <typename T>
  static T arg(T g) { return g; }
  template <typename T>
  static T darg(T) { return T(1); }
};
// GELU's a(g) and a'(g) take g clamped to [-20, 20], past which act(g) is g or 0 and its slope 1
// or 0 to fp64's precision: an fp32 gate of 1e19 or more made a'(g) inf and the slope 0 * inf
// (nan) or inf, where PyTorch's is finite. (ternaries, not std::clamp: they vectorise)
struct GeluTanh {
  template <typename T>
  static T clamped(T g) { return g < T(-20) ? T(-20) : (g > T(20) ? T(20) : g); }
  template <typename T>
  static T arg(T g) {
    const T c = clamped(g);
    return c * (T(1.5957691216057308) + T(0.07135481627260025) * c * c);
  }
  template <typename T>
  static T darg(T g) {
    const T c = clamped(g);
    return T(1.5957691216057308) + T(0.21406444881780076) * c * c;
  }
};

// The loops live outside AT_DISPATCH's lambda: a pragma cannot sit inside a macro argument.
template <typename scalar_t, typename Act>
FASTLLM_WIDE_VECTORS void forward_range(const scalar_t* g_raw, const scalar_t* u_raw,
                                        scalar_t* y_raw, int64_t begin, int64_t end) {
  using io = Io<scalar_t>;
  using op_t = typename io::opmath_t;
  using raw_t = typename io::raw_t;
  const raw_t* __restrict g = reinterpret_cast<const raw_t*>(g_raw);
  const raw_t* __restrict u = reinterpret_cast<const raw_t*>(u_raw);
  raw_t* __restrict out = reinterpret_cast<raw_t*>(y_raw);
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const op_t gv = io::load(g[i]);
    out[i] = io::store(gv * vec_math::sigmoid(Act::arg(gv)) * io::load(u[i]));
  }
}

// kNeedH: h = silu(gate) * up too, rounded as forward_range rounds it (swiglu_linear's weight
// grad reads it), from the same loads: one pass over gate and up instead of a second one.
template <typename scalar_t, typename Act, bool kNeedH>
FASTLLM_WIDE_VECTORS void backward_range(const scalar_t* dy_raw, const scalar_t* g_raw,
                                         const scalar_t* u_raw, scalar_t* dg_raw,
                                         scalar_t* du_raw, scalar_t* h_raw, int64_t begin,
                                         int64_t end) {
  using io = Io<scalar_t>;
  using op_t = typename io::opmath_t;
  using raw_t = typename io::raw_t;
  const raw_t* __restrict dy = reinterpret_cast<const raw_t*>(dy_raw);
  const raw_t* __restrict g = reinterpret_cast<const raw_t*>(g_raw);
  const raw_t* __restrict u = reinterpret_cast<const raw_t*>(u_raw);
  raw_t* __restrict dg = reinterpret_cast<raw_t*>(dg_raw);
  raw_t* __restrict du = reinterpret_cast<raw_t*>(du_raw);
  raw_t* __restrict h = reinterpret_cast<raw_t*>(h_raw);
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const op_t gv = io::load(g[i]), uv = io::load(u[i]), d = io::load(dy[i]);
    const op_t sig = vec_math::sigmoid(Act::arg(gv));
    dg[i] = io::store(d * uv * sig * (op_t(1) + gv * (op_t(1) - sig) * Act::darg(gv)));
    du[i] = io::store(d * gv * sig);
    if constexpr (kNeedH) h[i] = io::store(gv * sig * uv);
  }
}

template <typename Act>
at::Tensor forward(const at::Tensor& gate, const at::Tensor& up) {
  check(gate, gate, "gate");
  check(up, gate, "up");
  auto y = at::empty_like(gate);
  const int64_t n = gate.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(),
                                  "fastllm_swiglu_cpu", [&] {
    const scalar_t* g = gate.const_data_ptr<scalar_t>();
    const scalar_t* u = up.const_data_ptr<scalar_t>();
    scalar_t* out = y.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      forward_range<scalar_t, Act>(g, u, out, begin, end);
    });
  });
  return y;
}

template <typename Act>
std::vector<at::Tensor> backward(const at::Tensor& grad_out, const at::Tensor& gate,
                                 const at::Tensor& up, bool need_h) {
  check(gate, gate, "gate");
  check(up, gate, "up");
  check(grad_out, gate, "grad_out");
  auto dgate = at::empty_like(gate);
  auto dup = at::empty_like(gate);
  auto h = need_h ? at::empty_like(gate) : gate.new_empty({0});
  const int64_t n = gate.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(),
                                  "fastllm_swiglu_backward_cpu", [&] {
    const scalar_t* d = grad_out.const_data_ptr<scalar_t>();
    const scalar_t* g = gate.const_data_ptr<scalar_t>();
    const scalar_t* u = up.const_data_ptr<scalar_t>();
    scalar_t* dg = dgate.mutable_data_ptr<scalar_t>();
    scalar_t* du = dup.mutable_data_ptr<scalar_t>();
    scalar_t* hp = need_h ? h.mutable_data_ptr<scalar_t>() : nullptr;
    at::parallel_for(0, n, kGrain, [&](int64_t begin, int64_t end) {
      if (need_h) {
        backward_range<scalar_t, Act, true>(d, g, u, dg, du, hp, begin, end);
      } else {
        backward_range<scalar_t, Act, false>(d, g, u, dg, du, hp, begin, end);
      }
    });
  });
  return {dgate, dup, h};
}

}  // namespace

at::Tensor swiglu_cpu(const at::Tensor& gate, const at::Tensor& up) {
  return forward<Silu>(gate, up);
}

std::vector<at::Tensor> swiglu_backward_cpu(const at::Tensor& grad_out, const at::Tensor& gate,
                                            const at::Tensor& up, bool need_h) {
  return backward<Silu>(grad_out, gate, up, need_h);
}

at::Tensor geglu_cpu(const at::Tensor& gate, const at::Tensor& up) {
  return forward<GeluTanh>(gate, up);
}

std::vector<at::Tensor> geglu_backward_cpu(const at::Tensor& grad_out, const at::Tensor& gate,
                                           const at::Tensor& up, bool need_h) {
  return backward<GeluTanh>(grad_out, gate, up, need_h);
}

}  // namespace fastllm
