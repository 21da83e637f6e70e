// LoRA dropout for CPU tensors: xd = x * keep / (1 - p) in one pass, the keep mask computed from
// (seed, row, column) by a counter-based hash, so the backward regenerates it instead of storing
// it. lora_dropout_add_cpu applies the same mask to the backward's low-rank dX term, added to dX.
//
// The mask is the same in every fastllm backend (`lora_dropout_mask_ref` in
// fastllm/ops/lora_linear.py, `_keep_mask` in fastllm/kernels/lora_linear.py):
//   key  = seed & 0x7fffffff
//   h    = fmix32(fmix32(uint32(row) ^ key) ^ uint32(col))     (MurmurHash3's 32-bit finaliser)
//   keep = (h >> 8) >= threshold,   threshold = round(p * 2^24)
// The matmuls around it are ATen's (fastllm/ops/lora_linear.py). Why C++: torch.rand (mt19937)
// alone took ~17-20 ms for a 2048x2048 mask here (1 thread, the same order as the low-rank
// matmuls), and a compare and a multiply add two passes; this kernel is one pass of ~1 ms.
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

#include "fastllm.h"

namespace fastllm {
namespace {

// MurmurHash3 fmix32 (Austin Appleby, public domain, github.com/aappleby/smhasher).
inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

// Loads and stores through opmath_t. bf16 is converted with explicit bit operations (round to
// nearest even, as c10::BFloat16 does) so that gcc vectorises the loop; c10's conversion does not.
template <typename scalar_t>
struct Io {
  using opmath_t = at::opmath_type<scalar_t>;
  using raw_t = scalar_t;
  static opmath_t load(raw_t v) { return static_cast<opmath_t>(v); }
  static raw_t store(opmath_t v) { return static_cast<raw_t>(v); }
};

template <>
struct Io<at::BFloat16> {
  using opmath_t = float;
  using raw_t = uint16_t;
  static float load(uint16_t b) {
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  }
  static uint16_t store(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    const uint16_t rounded = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return f != f ? uint16_t(0x7fc0) : rounded;  // NaN stays a (quiet) NaN
  }
};

// out[row, col] (+)= keep(row, col) * x[row, col] * scale for rows [row_begin, row_end).
template <typename scalar_t, bool ACCUMULATE>
void dropout_rows(const void* x_raw, void* out_raw, int64_t row_begin, int64_t row_end,
                  int64_t cols, uint32_t key, uint32_t threshold, double scale) {
  using io = Io<scalar_t>;
  using opmath_t = typename io::opmath_t;
  using raw_t = typename io::raw_t;
  const raw_t* __restrict x = static_cast<const raw_t*>(x_raw);
  raw_t* __restrict out = static_cast<raw_t*>(out_raw);
  const opmath_t s = static_cast<opmath_t>(scale);
  for (int64_t row = row_begin; row < row_end; ++row) {
    const uint32_t row_key = fmix32(static_cast<uint32_t>(row) ^ key);
    const raw_t* __restrict xr = x + row * cols;
    raw_t* __restrict outr = out + row * cols;
#pragma omp simd
    for (int64_t col = 0; col < cols; ++col) {
      const uint32_t h = fmix32(row_key ^ static_cast<uint32_t>(col));
      const opmath_t v = io::load(xr[col]) * s;
      opmath_t d = (h >> 8) >= threshold ? v : opmath_t(0);
      if constexpr (ACCUMULATE) d += io::load(outr[col]);
      outr[col] = io::store(d);
    }
  }
}

void check_2d(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.layout() == at::kStrided,
              "fastllm.lora_linear: dropout expects a dense CPU tensor for ", name);
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(),
              "fastllm.lora_linear: dropout expects a contiguous (rows, cols) tensor for ", name);
}

// x (rows, cols) -> out: out = alpha * dropout(x), or out += alpha * dropout(x) when ACCUMULATE.
template <bool ACCUMULATE>
void dropout_into(const at::Tensor& x, const at::Tensor& out, double p, int64_t seed,
                  double alpha) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "fastllm.lora_linear: dropout_p must be in [0, 1), got ", p);
  const int64_t rows = x.size(0), cols = x.size(1);
  if (x.numel() == 0) return;
  const uint32_t key = static_cast<uint32_t>(seed & 0x7fffffff);
  const uint32_t threshold = static_cast<uint32_t>(std::llround(p * double(1 << 24)));
  const double scale = alpha / (1.0 - p);  // rounded to the tensor's opmath type where used
  // Rows per task: at least ~64K elements so a fork/join is amortised.
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(cols, 1));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(),
                                  "fastllm_lora_dropout_cpu", [&] {
    const void* xp = x.const_data_ptr();
    void* op = out.mutable_data_ptr();
    at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
      dropout_rows<scalar_t, ACCUMULATE>(xp, op, begin, end, cols, key, threshold, scale);
    });
  });
}

}  // namespace

at::Tensor lora_dropout_cpu(const at::Tensor& x, double p, int64_t seed) {
  check_2d(x, "x");
  auto out = at::empty_like(x);
  dropout_into<false>(x, out, p, seed, 1.0);
  return out;
}

void lora_dropout_add_cpu(const at::Tensor& out, const at::Tensor& x, double p, int64_t seed,
                          double alpha) {
  check_2d(x, "x");
  check_2d(out, "out");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(),
              "fastllm.lora_linear: dropout-add needs out and x of one shape and dtype");
  dropout_into<true>(x, out, p, seed, alpha);
}

}  // namespace fastllm
