// bf16 x bf16 -> fp32 GEMM on CPUs with AVX512-BF16: out (+)= a @ b with the products summed in
// fp32 and written to an fp32 out, never rounded to bf16 on the way.
//
// PyTorch's CPU build has no public entry for this: at::mm of bf16 rounds its output to bf16,
// aten::mm.dtype (out_dtype) is CUDA-only, ATen's mkldnn_matmul wants out in a's dtype,
// cpublas::gemm's bf16 -> fp32 overload is not exported, and cpublas::brgemm (oneDNN's ukernel,
// exported) ran at ~205 GFLOP/s here against ~420 for ATen's bf16 GEMM on an AMD EPYC Zen 4
// (BENCHMARKS.md, 2026-12-04). The fused loss's bf16 dW is a sum of per-chunk products that must
// not be rounded chunk by chunk: it paid a second GEMM for each rounding residual instead.
//
// The kernel: B is packed once into pairs of k for every column (the layout vdpbf16ps reads:
// [k / 2][32 columns][2]), each task packs its block of A's rows as 32-bit pairs, and a 12 x 32
// register tile accumulates 24 zmm of fp32 with vdpbf16ps (one broadcast pair of A against 32
// columns of B per instruction pair). Blocks: 256 of k, 144 rows of A (L2), one 32-column panel
// of B at a time (16 KiB, L1). Every element of out is one task's, summed in a fixed k order:
// the result does not depend on the thread count. As every vdpbf16ps, it reads subnormal inputs
// as zero and flushes subnormal results (below 1.2e-38; an fp32 GEMM keeps them). An internal
// building block (the fused loss's bf16 dW, csrc/cpu/attention.cpp's bf16 products), not an op;
// set_gemm_bf16f32(false) turns its users back to their fallbacks, (true) on wherever they could
// take it, (None) back to the default (tests run both ways).
//
// Two engines run it. fastllm's kernel above, and MKL's cblas_gemm_bf16bf16f32 (exported by
// libtorch_cpu where PyTorch is built with MKL: its x86 builds), looked up at run time. Where
// PyTorch's bf16 GEMMs run on AMX (Intel Xeon, Sapphire Rapids on), MKL's runs on AMX as well
// and is the fastest way to this product summed in fp32: the fused loss's dW (49152 x 576 x 682)
// at 0.66 TFLOP/s, against the kernel's 0.18, fp32 copies' 0.23 and at::mm of bf16's 0.81, whose
// output is rounded (its callers added the rounding's residual with a second GEMM: BENCHMARKS.md,
// 2026-12-07); there it is the default. Elsewhere the kernel is: on an AMD Zen 4 (AVX512-BF16, no
// AMX) MKL's ran the same dW at 0.16 TFLOP/s against the kernel's 0.35, and the attention's
// S = QK^T at 0.08 against 0.18 (BENCHMARKS.md, 2026-12-07, fourth session): MKL takes no fast
// code on AMD CPUs for this product either. Unlike the kernel, MKL promises no bits across
// thread counts or operand layouts (on AMX the same bits were seen either way).
// set_gemm_bf16f32_engine("fastllm" | "mkl" | None) picks one for tests and benchmarks.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>


#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "../fastllm.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define FASTLLM_GEMM_BF16 1
#endif

namespace fastllm {

#ifdef FASTLLM_GEMM_BF16
namespace {

constexpr int kMR = 12;          // rows of the register tile
constexpr int kNR = 32;          // columns of the register tile (two zmm of fp32)
constexpr int64_t kKC = 256;     // k per block (even)
constexpr int64_t kMC = 144;     // rows of A per task (a multiple of kMR)

// The two bf16 at p (p[0] low, p[1] high): one 32-bit load.
inline uint32_t load_pair(const uint16_t* p) {
  uint32_t w;
  std::memcpy(&w, p, sizeof(w));
  return w;
}

// Rows [0, m) x k [0, kc) of A (element (i, k) at a[i * sm + k * sk]) as [m / kMR panels]
// [kc / 2][kMR] 32-bit pairs (A(i, k) low, A(i, k + 1) high), zero-padded to whole panels and
// an even k.
void pack_a(const uint16_t* a, int64_t sm, int64_t sk, int64_t m, int64_t kc, uint32_t* out) {
  const int64_t kp = (kc + 1) / 2;
  for (int64_t i0 = 0; i0 < m; i0 += kMR) {
    uint32_t* o = out + (i0 / kMR) * kp * kMR;
    const int64_t mr = std::min<int64_t>(kMR, m - i0);
    // k contiguous (sk == 1): each pair is one 32-bit word of the row, read as such
    const int64_t words = sk == 1 && mr == kMR ? kc / 2 : 0;
    for (int64_t i = 0; i < kMR && words > 0; ++i) {
      const uint16_t* r = a + (i0 + i) * sm;
      for (int64_t p = 0; p < words; ++p) o[p * kMR + i] = load_pair(r + 2 * p);
    }
    for (int64_t p = words; p < kp; ++p) {
      const int64_t k = 2 * p;
      const bool pair = k + 1 < kc;
      for (int64_t i = 0; i < kMR; ++i) {
        uint32_t v = 0;
        if (i < mr) {
          const uint16_t* r = a + (i0 + i) * sm + k * sk;
          v = uint32_t(r[0]) | (pair ? uint32_t(r[sk]) << 16 : 0u);
        }
        o[p * kMR + i] = v;
      }
    }
  }
}

// k [0, kc) x columns [0, n) (n <= kNR) of B (element (k, j) at b[k * sk + j * sn]) as
// [kc / 2][kNR][2], zero-padded.
void pack_b_panel(const uint16_t* b, int64_t sk, int64_t sn, int64_t kc, int64_t n,
                  uint16_t* out) {
  const int64_t kp = (kc + 1) / 2;
  // k contiguous (sk == 1, as B = K^T of row-major K): column j's pair is one 32-bit word
  const int64_t words = sk == 1 && n == kNR ? kc / 2 : 0;
  for (int64_t j = 0; j < kNR && words > 0; ++j) {
    const uint16_t* c = b + j * sn;
    for (int64_t p = 0; p < words; ++p) {
      const uint32_t w = load_pair(c + 2 * p);
      std::memcpy(out + (p * kNR + j) * 2, &w, sizeof(w));
    }
  }
  for (int64_t p = words; p < kp; ++p) {
    const int64_t k = 2 * p;
    const uint16_t* r0 = b + k * sk;
    const bool pair = k + 1 < kc;
    uint16_t* d = out + p * kNR * 2;
    for (int64_t j = 0; j < kNR; ++j) {
      d[2 * j] = j < n ? r0[j * sn] : 0;
      d[2 * j + 1] = (j < n && pair) ? r0[sk + j * sn] : 0;
    }
  }
}

// out[0:m, 0:n] (+)= the tile's kp pairs of k. The accumulators are indexed only with constants
// (the loops unrolled) so that they stay in registers; the edge rows and columns go through a
// stack copy of the tile and masked stores.
inline void micro_tile(int64_t kp, const uint32_t* a, const uint16_t* b, float* out, int64_t ld,
                       int m, int n, bool accumulate) {
  __m512 c0[kMR], c1[kMR];
#pragma GCC unroll 12
  for (int i = 0; i < kMR; ++i) {
    c0[i] = _mm512_setzero_ps();
    c1[i] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < kp; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + p * 2 * kNR);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + p * 2 * kNR + kNR);
#pragma GCC unroll 12
    for (int i = 0; i < kMR; ++i) {
      const __m512bh ai = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[p * kMR + i]));
      c0[i] = _mm512_dpbf16_ps(c0[i], ai, b0);
      c1[i] = _mm512_dpbf16_ps(c1[i], ai, b1);
    }
  }
  alignas(64) float tile[kMR * kNR];
#pragma GCC unroll 12
  for (int i = 0; i < kMR; ++i) {
    _mm512_store_ps(tile + i * kNR, c0[i]);
    _mm512_store_ps(tile + i * kNR + 16, c1[i]);
  }
  const __mmask16 m0 = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
  const __mmask16 m1 =
      n >= 32 ? __mmask16(0xFFFF) : (n <= 16 ? __mmask16(0) : __mmask16((1u << (n - 16)) - 1));
  for (int i = 0; i < m; ++i) {
    float* r = out + i * ld;
    __m512 v0 = _mm512_load_ps(tile + i * kNR);
    __m512 v1 = _mm512_load_ps(tile + i * kNR + 16);
    if (accumulate) {
      v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, r));
      v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, r + 16));
    }
    _mm512_mask_storeu_ps(r, m0, v0);
    _mm512_mask_storeu_ps(r + 16, m1, v1);
  }
}

}  // namespace
#endif  // FASTLLM_GEMM_BF16

namespace {
// the switch: used where measured to pay (kAuto, the default), everywhere it applies, or nowhere
enum Mode : int { kOff = 0, kAuto = 1, kForced = 2 };
std::atomic<int> g_bf16f32_mode{kAuto};

// the engines, and which one gemm_bf16f32_cpu takes (kNone in g_engine: the default's choice)
enum Engine : int { kNone = 0, kKernel = 1, kMkl = 2 };
std::atomic<int> g_engine{kNone};

#ifdef FASTLLM_GEMM_BF16
constexpr bool kKernelBuilt = true;
#else
constexpr bool kKernelBuilt = false;
#endif

// cblas_gemm_bf16bf16f32(layout, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
// MKL's LP64 interface (32-bit MKL_INT), as PyTorch links it.
using MklGemmFn = void (*)(int, int, int, int, int, int, float, const uint16_t*, int,
                           const uint16_t*, int, float, float*, int);
constexpr int kCblasRowMajor = 101, kCblasNoTrans = 111, kCblasTrans = 112;

// The entry, or nullptr where libtorch_cpu lacks it or it gets a 2 x 3 x 2 product (exact in bf16
// and fp32) wrong on first use: the engine is then absent. (PyTorch links MKL's LP64 interface;
// the check is that the entry computes, not a test of its integer width.)
MklGemmFn mkl_gemm() {
  static const MklGemmFn fn = []() -> MklGemmFn {
    auto f = reinterpret_cast<MklGemmFn>(torch_cpu_symbol("cblas_gemm_bf16bf16f32"));
    if (f == nullptr) return nullptr;
    const float av[6] = {1, 2, 3, 4, 5, 6}, bv[6] = {7, 8, 9, 10, 11, 12};
    uint16_t a[6], b[6];
    for (int i = 0; i < 6; ++i) {
      a[i] = c10::BFloat16(av[i]).x;
      b[i] = c10::BFloat16(bv[i]).x;
    }
    float c[4] = {-1, -1, -1, -1};
    f(kCblasRowMajor, kCblasNoTrans, kCblasNoTrans, 2, 2, 3, 1.0f, a, 3, b, 2, 0.0f, c, 2);
    const float want[4] = {58, 64, 139, 154};  // (2 x 3) @ (3 x 2), row-major
    return std::equal(c, c + 4, want) ? f : nullptr;
  }();
  return fn;
}

bool has(int engine) { return engine == kKernel ? kKernelBuilt : mkl_gemm() != nullptr; }

// The engine the default picks: MKL's where bf16 GEMMs run on AMX (kNone if this torch lacks
// it: there the AMX GEMMs of the callers' fallbacks beat the kernel), the kernel elsewhere.
int default_engine() {
  if (bf16_gemm_on_amx()) return has(kMkl) ? kMkl : kNone;
  return kKernelBuilt ? kKernel : kNone;
}

// The engine gemm_bf16f32_cpu runs: the one set, else the default's, else (forced on) any.
int engine() {
  const int set = g_engine.load(std::memory_order_relaxed);
  if (set != kNone) return has(set) ? set : kNone;
  const int picked = default_engine();
  if (picked != kNone) return picked;
  return kKernelBuilt ? kKernel : (has(kMkl) ? kMkl : kNone);
}

// (ld, transposed) of a 2-D operand (rows, cols) for MKL's row-major interface, or false where
// neither dimension is unit-stride (the kernel reads any strides) or a size is past 32 bits.
bool mkl_operand(const at::Tensor& t, int* ld, int* trans) {
  const int64_t rows = t.size(0), cols = t.size(1), limit = std::numeric_limits<int>::max();
  int64_t lead;
  if (cols == 1 || t.stride(1) == 1) {
    *trans = kCblasNoTrans;
    lead = rows == 1 ? cols : std::max<int64_t>(t.stride(0), cols);
    if (rows > 1 && t.stride(0) < cols) return false;  // rows overlap: not a row-major matrix
  } else if (rows == 1 || t.stride(0) == 1) {
    *trans = kCblasTrans;
    lead = cols == 1 ? rows : t.stride(1);
    if (cols > 1 && t.stride(1) < rows) return false;
  } else {
    return false;
  }
  if (rows > limit || cols > limit || lead > limit) return false;
  *ld = static_cast<int>(std::max<int64_t>(lead, 1));
  return true;
}
}  // namespace

bool gemm_bf16f32_available() {
  return g_bf16f32_mode.load(std::memory_order_relaxed) != kOff && engine() != kNone;
}

namespace {
const char* engine_name(int e) { return e == kKernel ? "fastllm" : e == kMkl ? "mkl" : "none"; }
}  // namespace

std::string gemm_bf16f32_engine() {
  return engine_name(gemm_bf16f32_available() ? engine() : kNone);
}

std::vector<std::string> gemm_bf16f32_engines() {
  std::vector<std::string> names;
  for (int e : {kKernel, kMkl}) {
    if (has(e)) names.push_back(engine_name(e));
  }
  return names;
}

void set_gemm_bf16f32_engine(const c10::optional<std::string>& name) {
  int e = kNone;
  if (name.has_value()) {
    TORCH_CHECK(*name == "fastllm" || *name == "mkl",
                "fastllm: the bf16 x bf16 -> fp32 GEMM's engine is 'fastllm' or 'mkl' (or None, "
                "the default), got '", *name, "'");
    e = *name == "mkl" ? kMkl : kKernel;
    TORCH_CHECK(has(e), "fastllm: no '", *name, "' bf16 x bf16 -> fp32 GEMM here (",
                e == kMkl ? "this PyTorch exports no working cblas_gemm_bf16bf16f32"
                          : "fastllm._C was built without AVX512-BF16", ")");
  }
  g_engine.store(e, std::memory_order_relaxed);
}

bool gemm_bf16f32_forced() { return g_bf16f32_mode.load(std::memory_order_relaxed) == kForced; }

bool bf16_gemm_on_amx() {
  // PyTorch's own test for packing B into AMX tiles (its CPU flash attention's), true where its
  // bf16 GEMMs run on AMX: at::native::cpublas::could_pack, looked up at run time through
  // torch_cpu_symbol (not in every supported torch's headers: older ones called it need_pack); a
  // torch without it counts as no AMX.
  static const bool amx = []() {
    using Fn = bool (*)(c10::ScalarType);
    auto fn = reinterpret_cast<Fn>(
        torch_cpu_symbol("_ZN2at6native7cpublas10could_packEN3c1010ScalarTypeE"));
    return fn != nullptr && fn(at::kBFloat16);
  }();
  return amx;
}

bool gemm_bf16f32_preferred() {
  if (!gemm_bf16f32_available()) return false;
  return gemm_bf16f32_forced() || g_engine.load(std::memory_order_relaxed) != kNone ||
         default_engine() != kNone;
}

void set_gemm_bf16f32(c10::optional<bool> on) {
  TORCH_CHECK(!on.value_or(false) || has(kKernel) || has(kMkl),
              "fastllm: no bf16 x bf16 -> fp32 GEMM here (fastllm._C was built without "
              "AVX512-BF16 and this PyTorch exports no working cblas_gemm_bf16bf16f32)");
  g_bf16f32_mode.store(!on.has_value() ? kAuto : (*on ? kForced : kOff),
                       std::memory_order_relaxed);
}

void gemm_bf16f32_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out,
                      bool accumulate) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && out.dim() == 2,
              "fastllm.gemm_bf16f32: a, b and out must be 2-D, got ", a.sizes(), ", ", b.sizes(),
              ", ", out.sizes());
  TORCH_CHECK(a.size(1) == b.size(0) && out.size(0) == a.size(0) && out.size(1) == b.size(1),
              "fastllm.gemm_bf16f32: shapes do not chain: a ", a.sizes(), " @ b ", b.sizes(),
              " into out ", out.sizes());
  TORCH_CHECK(a.scalar_type() == at::kBFloat16 && b.scalar_type() == at::kBFloat16,
              "fastllm.gemm_bf16f32: a and b must be bf16, got ", a.scalar_type(), " and ",
              b.scalar_type());
  TORCH_CHECK(out.scalar_type() == at::kFloat, "fastllm.gemm_bf16f32: out must be fp32, got ",
              out.scalar_type());
  for (const at::Tensor* t : {&a, &b, &out}) {
    TORCH_CHECK(t->device().is_cpu() && t->layout() == at::kStrided,
                "fastllm.gemm_bf16f32: dense CPU tensors only");
  }
  TORCH_CHECK(out.size(1) <= 1 || out.stride(1) == 1,
              "fastllm.gemm_bf16f32: out's rows must be contiguous (stride(1) == 1), got strides ",
              out.strides());
  at::assert_no_internal_overlap(out);  // tasks write disjoint elements of out
  TORCH_CHECK(!a.is_neg() && !b.is_neg(),
              "fastllm.gemm_bf16f32: a and b must not carry a negative bit (resolve_neg() first)");
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (!accumulate) out.zero_();
    return;
  }
  const int picked = engine();
  TORCH_CHECK(picked != kNone, "fastllm.gemm_bf16f32: no engine here (fastllm._C was built "
              "without AVX512-BF16 and this PyTorch exports no working cblas_gemm_bf16bf16f32)");
  TORCH_CHECK(M == 1 || out.stride(0) >= N, "fastllm.gemm_bf16f32: out's rows overlap (strides ",
              out.strides(), ")");
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  const bool fits = std::max({M, N, K, out.stride(0)}) <= kIntMax;
  if (picked == kMkl && fits) {
    // An operand MKL cannot read as it is (no unit stride) goes as a copy in its own orientation
    // (columns contiguous where its column stride is the smaller), so that MKL takes the same
    // transpose flag as for the operand laid out densely.
    int lda = 0, ldb = 0, ta = 0, tb = 0;
    const auto readable = [](const at::Tensor& t, int* ld, int* trans) {
      if (mkl_operand(t, ld, trans)) return t;
      const at::Tensor copy = t.stride(0) < t.stride(1) ? t.t().contiguous().t() : t.contiguous();
      TORCH_CHECK(mkl_operand(copy, ld, trans), "fastllm.gemm_bf16f32: internal: a dense copy ",
                  copy.sizes(), " with strides ", copy.strides(), " is not MKL-readable");
      return copy;
    };
    const at::Tensor ac = readable(a, &lda, &ta), bc = readable(b, &ldb, &tb);
    const int ldc = static_cast<int>(std::max<int64_t>({out.stride(0), N, 1}));
    mkl_gemm()(kCblasRowMajor, ta, tb, static_cast<int>(M), static_cast<int>(N),
               static_cast<int>(K), 1.0f, reinterpret_cast<const uint16_t*>(ac.const_data_ptr()),
               lda, reinterpret_cast<const uint16_t*>(bc.const_data_ptr()), ldb,
               accumulate ? 1.0f : 0.0f, out.mutable_data_ptr<float>(), ldc);
    return;
  }
  // sizes past MKL's 32-bit interface: fastllm's kernel where this build has it
  TORCH_CHECK(picked != kMkl || kKernelBuilt, "fastllm.gemm_bf16f32: sizes past MKL's 32-bit "
              "interface (", a.sizes(), " @ ", b.sizes(), " into out with strides ", out.strides(),
              ") and no fastllm kernel in this build (AVX512-BF16)");
#ifdef FASTLLM_GEMM_BF16
  const auto* pa = reinterpret_cast<const uint16_t*>(a.const_data_ptr());
  const auto* pb = reinterpret_cast<const uint16_t*>(b.const_data_ptr());
  float* pc = out.mutable_data_ptr<float>();
  const int64_t ldc = out.stride(0);
  const int64_t sam = a.stride(0), sak = a.stride(1), sbk = b.stride(0), sbn = b.stride(1);
  const int64_t panels = (N + kNR - 1) / kNR;
  const int64_t kblocks = (K + kKC - 1) / kKC;
  const int64_t kc_max = std::min(kKC, K);
  const int64_t panel_elems = ((kc_max + 1) / 2) * kNR * 2;
  // all of B, packed once: [k block][panel][kKC / 2][kNR][2]
  auto packed_b = at::empty({kblocks * panels * panel_elems}, b.options());
  auto* bp = reinterpret_cast<uint16_t*>(packed_b.mutable_data_ptr());
  at::parallel_for(0, kblocks * panels, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t kb = t / panels, jp = t % panels;
      const int64_t k0 = kb * kKC, j0 = jp * kNR;
      pack_b_panel(pb + k0 * sbk + j0 * sbn, sbk, sbn, std::min(kKC, K - k0),
                   std::min<int64_t>(kNR, N - j0), bp + t * panel_elems);
    }
  });
  // Tasks: blocks of kMC rows x groups of panels; groups only as many as the threads need
  // (each group packs its rows of A again).
  const int64_t mblocks = (M + kMC - 1) / kMC;
  // (called from a parallel region, as by the attention's tasks, everything runs on this thread)
  const int64_t want = at::in_parallel_region() ? 1 : 4 * at::get_num_threads();
  const int64_t groups = std::min(panels, std::max<int64_t>(1, (want + mblocks - 1) / mblocks));
  const int64_t per_group = (panels + groups - 1) / groups;
  at::parallel_for(0, mblocks * groups, 1, [&](int64_t t0, int64_t t1) {
    auto packed_a = at::empty({kMC * ((kc_max + 1) / 2)}, at::kInt);
    auto* ap = reinterpret_cast<uint32_t*>(packed_a.mutable_data_ptr());
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t i0 = (t / groups) * kMC, m = std::min(kMC, M - i0);
      const int64_t p0 = (t % groups) * per_group, p1 = std::min(panels, p0 + per_group);
      for (int64_t kb = 0; kb < kblocks; ++kb) {
        const int64_t k0 = kb * kKC, kc = std::min(kKC, K - k0), kp = (kc + 1) / 2;
        pack_a(pa + i0 * sam + k0 * sak, sam, sak, m, kc, ap);
        const bool acc = accumulate || kb > 0;
        for (int64_t jp = p0; jp < p1; ++jp) {
          const uint16_t* panel = bp + (kb * panels + jp) * panel_elems;
          const int n = static_cast<int>(std::min<int64_t>(kNR, N - jp * kNR));
          for (int64_t ii = 0; ii < m; ii += kMR) {
            micro_tile(kp, ap + (ii / kMR) * kp * kMR, panel, pc + (i0 + ii) * ldc + jp * kNR,
                       ldc, static_cast<int>(std::min<int64_t>(kMR, m - ii)), n, acc);
          }
        }
      }
    }
  });
#endif
}

}  // namespace fastllm
