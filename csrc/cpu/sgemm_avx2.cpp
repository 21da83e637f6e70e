// fp32 GEMM for x86 CPUs with AVX2 + FMA and without AVX-512, where ATen's fp32 GEMM (MKL's
// sgemm) runs far below the hardware and oneDNN's entry refuses the CPU (fastllm/_gemm.py owns
// the policy and says when).
//
// Measured on an AMD EPYC Zen 2 (AVX2, 2 cores, torch 2.13; BENCHMARKS.md, 2026-12-06): one core
// issues 99 GFLOP/s of fp32 FMAs; MKL's sgemm ran the SmolLM2-sized products at 52 GFLOP/s on one
// thread and 104-131 on two, and ATen's at::native::mkldnn_matmul refuses the CPU ("bf16 path
// needs avx512bw..." even for fp32), so csrc/cpu/gemm.cpp's oneDNN route does not exist there.
//
// The kernel is the classic blocked one (Goto / BLIS): for each panel of kNC columns and kKC of
// k, B's panel is packed once into kNR-column slivers ([kc][kNR], zero-padded), shared by the
// threads; each task packs a block of kMC rows of A into kMR-row slivers ([kc][kMR]) and runs a
// kMR x kNR register tile (12 ymm accumulators: one broadcast of A against two vectors of B per
// pair of FMAs) over its slivers of B. Sizes: k in equal blocks of at most kKC 768 (fewer passes
// over out: with 384, which keeps a B sliver in L1, two threads ran 10-15% slower on this CPU),
// kMC 96 rows (an A block, 288 KiB, and a B sliver, 48 KiB, in L2), kNC 4096 columns (a B panel,
// 12 MiB, in L3). Every element of out is one task's, summed in the same k order whatever the
// thread count: results do not depend on it.
// out = beta * out + alpha * (a @ b); beta 0 does not read out (torch's rule: nan there stays
// out of the result).
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "../fastllm.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define FASTLLM_SGEMM_AVX2 1
#define FASTLLM_AVX2 __attribute__((target("avx2,fma")))
#endif

namespace fastllm {

#ifdef FASTLLM_SGEMM_AVX2
namespace {

constexpr int kMR = 6;         // rows of the register tile
constexpr int kNR = 16;        // columns of the register tile (two ymm of fp32)
constexpr int64_t kKC = 768;   // k per block, at most (K is cut in equal blocks)
constexpr int64_t kMC = 96;    // rows of A per task (a multiple of kMR)
constexpr int64_t kNC = 4096;  // columns of B per packed panel (a multiple of kNR)

// Rows [0, m) x k [0, kc) of A (element (i, k) at a[i * sm + k * sk]) as [m / kMR slivers][kc]
// [kMR], zero-padded to whole slivers.
FASTLLM_AVX2 void pack_a(const float* a, int64_t sm, int64_t sk, int64_t m, int64_t kc,
                         float* out) {
  for (int64_t i0 = 0; i0 < m; i0 += kMR) {
    float* o = out + i0 * kc;
    const int64_t mr = std::min<int64_t>(kMR, m - i0);
    if (sk == 1) {  // rows contiguous (a row-major A): read along each row
      for (int64_t i = 0; i < kMR; ++i) {
        if (i < mr) {
          const float* r = a + (i0 + i) * sm;
          for (int64_t p = 0; p < kc; ++p) o[p * kMR + i] = r[p];
        } else {
          for (int64_t p = 0; p < kc; ++p) o[p * kMR + i] = 0.0f;
        }
      }
    } else {
      for (int64_t p = 0; p < kc; ++p) {
        const float* c = a + i0 * sm + p * sk;
        for (int64_t i = 0; i < kMR; ++i) o[p * kMR + i] = i < mr ? c[i * sm] : 0.0f;
      }
    }
  }
}

// k [0, kc) x columns [0, n) of B (element (k, j) at b[k * sk + j * sn]) as [n / kNR slivers]
// [kc][kNR], zero-padded.
FASTLLM_AVX2 void pack_b_sliver(const float* b, int64_t sk, int64_t sn, int64_t kc, int64_t n,
                                float* out) {
  if (sn == 1 && n == kNR) {  // rows of B contiguous: two vectors per k
    for (int64_t p = 0; p < kc; ++p) {
      _mm256_store_ps(out + p * kNR, _mm256_loadu_ps(b + p * sk));
      _mm256_store_ps(out + p * kNR + 8, _mm256_loadu_ps(b + p * sk + 8));
    }
    return;
  }
  if (sk == 1) {  // columns contiguous (B = W^T of a row-major weight): read along each column
    for (int64_t j = 0; j < kNR; ++j) {
      if (j < n) {
        const float* c = b + j * sn;
        for (int64_t p = 0; p < kc; ++p) out[p * kNR + j] = c[p];
      } else {
        for (int64_t p = 0; p < kc; ++p) out[p * kNR + j] = 0.0f;
      }
    }
    return;
  }
  for (int64_t p = 0; p < kc; ++p) {
    for (int64_t j = 0; j < kNR; ++j) out[p * kNR + j] = j < n ? b[p * sk + j * sn] : 0.0f;
  }
}

// out[0:m, 0:n] = alpha * tile + beta * out (beta 0: out not read). The accumulators are indexed
// only with constants (the loops unrolled, as in csrc/cpu/gemm_bf16.cpp) so that they stay in
// registers.
FASTLLM_AVX2 void micro_tile(int64_t kc, const float* __restrict a, const float* __restrict b,
                             float* out, int64_t ld, int m, int n, float alpha, float beta) {
  __m256 c0[kMR], c1[kMR];
#pragma GCC unroll 6
  for (int i = 0; i < kMR; ++i) {
    c0[i] = _mm256_setzero_ps();
    c1[i] = _mm256_setzero_ps();
  }
  for (int64_t p = 0; p < kc; ++p) {
    const __m256 b0 = _mm256_load_ps(b + p * kNR), b1 = _mm256_load_ps(b + p * kNR + 8);
    _mm_prefetch(reinterpret_cast<const char*>(b + (p + 8) * kNR), _MM_HINT_T0);
#pragma GCC unroll 6
    for (int i = 0; i < kMR; ++i) {
      const __m256 x = _mm256_broadcast_ss(a + p * kMR + i);
      c0[i] = _mm256_fmadd_ps(x, b0, c0[i]);
      c1[i] = _mm256_fmadd_ps(x, b1, c1[i]);
    }
  }
  alignas(32) float tile[kMR * kNR];
#pragma GCC unroll 6
  for (int i = 0; i < kMR; ++i) {
    _mm256_store_ps(tile + i * kNR, c0[i]);
    _mm256_store_ps(tile + i * kNR + 8, c1[i]);
  }
  if (m == kMR && n == kNR) {
    const __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
    for (int i = 0; i < kMR; ++i) {
      float* r = out + i * ld;
      __m256 y0 = _mm256_mul_ps(va, _mm256_load_ps(tile + i * kNR));
      __m256 y1 = _mm256_mul_ps(va, _mm256_load_ps(tile + i * kNR + 8));
      if (beta != 0.0f) {
        y0 = _mm256_fmadd_ps(vb, _mm256_loadu_ps(r), y0);
        y1 = _mm256_fmadd_ps(vb, _mm256_loadu_ps(r + 8), y1);
      }
      _mm256_storeu_ps(r, y0);
      _mm256_storeu_ps(r + 8, y1);
    }
    return;
  }
  for (int i = 0; i < m; ++i) {
    float* r = out + i * ld;
    for (int j = 0; j < n; ++j) {
      const float y = alpha * tile[i * kNR + j];
      r[j] = beta == 0.0f ? y : y + beta * r[j];
    }
  }
}

// One task: rows [0, m) of the product against slivers [s0, s1) of the packed panel.
FASTLLM_AVX2 void run_block(const float* packed_a, const float* packed_b, int64_t kc, int64_t m,
                            int64_t s0, int64_t s1, int64_t n, float* out, int64_t ld,
                            float alpha, float beta) {
  for (int64_t s = s0; s < s1; ++s) {
    const int nr = static_cast<int>(std::min<int64_t>(kNR, n - s * kNR));
    for (int64_t i = 0; i < m; i += kMR) {
      micro_tile(kc, packed_a + i * kc, packed_b + s * kNR * kc, out + i * ld + s * kNR, ld,
                 static_cast<int>(std::min<int64_t>(kMR, m - i)), nr, alpha, beta);
    }
  }
}

}  // namespace
#endif  // FASTLLM_SGEMM_AVX2

bool sgemm_avx2_available() {
#ifdef FASTLLM_SGEMM_AVX2
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
#else
  return false;
#endif
}

void sgemm_avx2_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out,
                    double beta, double alpha) {
  TORCH_CHECK(sgemm_avx2_available(),
              "fastllm.gemm: this CPU (or build) has no AVX2 + FMA for fastllm's fp32 GEMM");
  check_fp32_gemm_args(a, b, out);
  at::assert_no_internal_overlap(out);  // tasks write disjoint elements of out
  at::assert_no_overlap(out, a);         // and read a and b after writing some of out
  at::assert_no_overlap(out, b);
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  if (M == 0 || N == 0) return;
  if (K == 0 || alpha == 0.0) {
    if (beta == 0.0) {
      out.zero_();
    } else if (beta != 1.0) {
      out.mul_(beta);
    }
    return;
  }
#ifdef FASTLLM_SGEMM_AVX2
  const float* pa = a.const_data_ptr<float>();
  const float* pb = b.const_data_ptr<float>();
  float* pc = out.mutable_data_ptr<float>();
  const int64_t ldc = out.stride(0);
  const int64_t sam = a.stride(0), sak = a.stride(1), sbk = b.stride(0), sbn = b.stride(1);
  const int64_t kblocks = (K + kKC - 1) / kKC;
  const int64_t kc_max = (K + kblocks - 1) / kblocks, nc_max = std::min(kNC, N);
  const int64_t slivers_max = (nc_max + kNR - 1) / kNR;
  auto packed_b = at::empty({slivers_max * kNR * kc_max}, out.options());
  float* bp = packed_b.mutable_data_ptr<float>();
  const int64_t mblocks = (M + kMC - 1) / kMC;
  // (called from a parallel region, as by the attention's tasks, everything runs on this thread)
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  for (int64_t j0 = 0; j0 < N; j0 += kNC) {
    const int64_t nc = std::min(kNC, N - j0);
    const int64_t slivers = (nc + kNR - 1) / kNR;
    // tasks: blocks of kMC rows x groups of slivers, as few groups as give every thread the same
    // number of tasks or at least 8 (each group packs its rows of A again; 11 row blocks on 2
    // threads, a 1024-row chunk of the LM head, ran 6 against 5)
    int64_t groups = 1;
    while (groups < slivers && (mblocks * groups) % threads != 0 &&
           mblocks * groups < 8 * threads) {
      ++groups;
    }
    const int64_t per_group = (slivers + groups - 1) / groups;
    for (int64_t k0 = 0; k0 < K; k0 += kc_max) {
      const int64_t kc = std::min(kc_max, K - k0);
      const float step_beta = k0 == 0 ? static_cast<float>(beta) : 1.0f;
      at::parallel_for(0, slivers, 1, [&](int64_t s0, int64_t s1) {
        for (int64_t s = s0; s < s1; ++s) {
          pack_b_sliver(pb + k0 * sbk + (j0 + s * kNR) * sbn, sbk, sbn, kc,
                        std::min<int64_t>(kNR, nc - s * kNR), bp + s * kNR * kc);
        }
      });
      at::parallel_for(0, mblocks * groups, 1, [&](int64_t t0, int64_t t1) {
        auto packed_a = at::empty({kMC * kc_max}, out.options());
        float* ap = packed_a.mutable_data_ptr<float>();
        for (int64_t t = t0; t < t1; ++t) {
          const int64_t i0 = (t / groups) * kMC, m = std::min(kMC, M - i0);
          const int64_t s0 = (t % groups) * per_group, s1 = std::min(slivers, s0 + per_group);
          if (s0 >= s1) continue;
          pack_a(pa + i0 * sam + k0 * sak, sam, sak, m, kc, ap);
          run_block(ap, bp, kc, m, s0, s1, nc, pc + i0 * ldc + j0, ldc,
                    static_cast<float>(alpha), step_beta);
        }
      });
    }
  }
#endif
}

}  // namespace fastllm
