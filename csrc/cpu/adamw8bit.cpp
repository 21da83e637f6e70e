// AdamW with low-byte moments for CPU tensors (fastllm/ops/adamw8bit.py has the full contract).
//
// Per element, with step t:
//   g = grad * clip_coef / grad_scale (negated when maximize);  x = master | param
//   m = dequant(m_q);  v = dequant(v_q)
//   x = x * (1 - lr * wd);  m = lerp(m, g, 1 - beta1);  v = beta2 * v + (1 - beta2) * g^2
//   x = x - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
//   master = x;  param = round(x);  m_q = quant(m);  v_q = quant(v)
// 8-bit moments: per block of block_size elements an fp32 absmax and one byte per element, an
// index into bitsandbytes' dynamic map (256 sorted codes; signed for m, unsigned for v).
// dequant(c) = code[c] * absmax: with VBMI byte permutes over the table's four byte planes,
// else an AVX-512 gather from the 1 KiB table; the absmax multiply is folded into beta1 and
// beta2. quant() picks the nearest code without searching: inside a decade the codes
// are equally spaced, so k = trunc(a * inv_spacing + offset), and the decade is a lookup by the
// fp32 exponent of a = |x| / absmax plus one comparison of mantissa bits (every binary octave
// holds at most one decade boundary), done as one integer add (Code::oct_key).
// The constants come from `qmaps` (built once in Python, fastllm/ops/adamw8bit.py), so Python,
// C++ and Triton share one definition. A block is processed in two passes over stack buffers
// (L1-resident): update (writing params, tracking the new absmax), then encode with that
// absmax. On this AMD EPYC (Zen 4) VM the step is compute-bound (two decodes, the update with
// its sqrt and reciprocal, two encodes): ~0.95 ns per element on one core (about 2.5 cycles at
// the nominal 2.6 GHz), the same in L2 as from DRAM, so it runs above the memory probe's time
// for its bytes; bench/bench_adamw8bit.py measures both.
// bf16 moments: dequant is an upcast, quant a round-to-nearest-even.
//
// Blocks of all tensors of one call are cut into chunks and split across the ATen (OpenMP) thread
// pool in one parallel region. With AVX-512 (-march=native on such a machine) the block loop is
// written with intrinsics; elsewhere a scalar loop computes the same thing.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/irange.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define FASTLLM_ADAMW8BIT_AVX512 1
#endif

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "low_precision.h"
#include "fastllm.h"
#include "static_dispatch.h"
#include "tensor_checks.h"

namespace fastllm {
namespace {

using lowp::bits_to_float;
using lowp::float_to_bits;

constexpr int kMaxBlock = 4096;
// The qmaps row layout of fastllm/ops/adamw8bit.py.
constexpr int kFirst = 256, kLast = 272, kInv = 288, kOffset = 304, kOctBase = 320,
              kOctThr = 352, kQmapWidth = 384;


struct alignas(64) Code {
  float value[256];
  int32_t first[16];
  int32_t span[16];  // last - first
  int32_t last[16];
  float inv[16];
  float offset[16];
  int32_t oct_base[32];
  float oct_thr[32];
  // Per octave, base and threshold in one integer for the vector encoder: (base << 23) +
  // 2^23 - mantissa bits of the threshold (2^23 - 2^23 = 0 where the octave holds no boundary,
  // its threshold being 2.0). Adding the mantissa bits of an `a` in that octave carries into
  // bit 23 exactly when a >= threshold, so key >> 23 is the segment.
  int32_t oct_key[32];
  // The code values' bytes by significance (planes[b][c] = byte b of value[c]), for decode64.
  alignas(64) uint8_t planes[4][256];
};

Code make_code(const float* row) {
  Code c;
  std::memcpy(c.value, row, sizeof(c.value));
  for (int j = 0; j < 16; ++j) {
    c.first[j] = int32_t(row[kFirst + j]);
    c.span[j] = int32_t(row[kLast + j]) - c.first[j];
    c.inv[j] = row[kInv + j];
    c.offset[j] = row[kOffset + j];
  }
  for (int s = 0; s < 32; ++s) {
    c.oct_base[s] = int32_t(row[kOctBase + s]);
    c.oct_thr[s] = row[kOctThr + s];
    const float thr = c.oct_thr[s];
    // A threshold inside octave s has that octave's exponent; 2.0 marks "none" (the
    // segment's upper boundary lies in a later octave).
    const bool inside = thr < std::ldexp(1.0f, s - 30);
    const int32_t mant = inside ? int32_t(float_to_bits(thr) & 0x7fffffu) : (1 << 23);
    c.oct_key[s] = (c.oct_base[s] << 23) + ((1 << 23) - mant);
  }
  for (int j = 0; j < 16; ++j) c.last[j] = c.first[j] + c.span[j];
  for (int i = 0; i < 256; ++i) {
    for (int b = 0; b < 4; ++b) c.planes[b][i] = uint8_t(float_to_bits(c.value[i]) >> (8 * b));
  }
  return c;
}

// Index of the code nearest to a in [0, 1] among the non-negative codes.
inline int32_t encode_magnitude(const Code& c, float a) {
  const int32_t slot = std::min<int32_t>(std::max<int32_t>(int32_t(float_to_bits(a) >> 23), 96), 127) - 96;
  const int32_t j = c.oct_base[slot] + int32_t(a >= c.oct_thr[slot]);
  const int32_t k = int32_t(std::fma(a, c.inv[j], c.offset[j]));
  return c.first[j] + std::min(std::max(k, 0), c.span[j]);
}

// |x| as the bits of an fp32: a block's absmax is their largest. As integers they order as the
// values do and every NaN's lie above inf's, so a NaN in the block gives the block a NaN absmax
// (as torch.amax in adamw8bit_step_ref), which std::max, fmax and vmaxps would drop, leaving
// finite garbage in the state where torch.optim.AdamW has a NaN.
inline uint32_t abs_bits(float x) { return float_to_bits(x) & 0x7fffffffu; }

// A block's encode scale: its values times `up`, then times `inv` = 1 / (absmax * up). up is
// 2^64 for an absmax below 2^-64, else 1 (a power of two: exact): 1 / absmax alone overflows fp32
// below 2^-128 (subnormal moments: tiny grads, or decay without gradient), and every code of
// such a block came out the top one.
struct BlockScale {
  float up, inv;
};

inline BlockScale block_scale(float absmax) {
  const float up = absmax < 0x1p-64f ? 0x1p64f : 1.0f;
  return {up, absmax > 0.0f ? 1.0f / (absmax * up) : 0.0f};
}

inline uint8_t encode_signed(const Code& c, float x, float inv_absmax) {
  const float a = std::min(std::fabs(x) * inv_absmax, 1.0f);
  const int32_t idx = a == a ? encode_magnitude(c, a) : 255;
  return uint8_t(x < 0.0f ? 254 - std::min(idx, 254) : idx);
}

inline uint8_t encode_unsigned(const Code& c, float x, float inv_absmax) {
  const float a = std::min(std::fabs(x) * inv_absmax, 1.0f);
  return uint8_t(a == a ? encode_magnitude(c, a) : 255);
}

struct Scalars {
  float decay;          // 1 - lr * weight_decay
  float lerp_weight;    // 1 - beta1
  float beta2;
  float one_minus_beta2;
  float neg_step_size;  // -lr / (1 - beta1^t)
  float inv_bc2_sqrt;   // 1 / sqrt(1 - beta2^t)
  float eps;
  float grad_mult;      // clip_coef / grad_scale, negated when maximize
  uint32_t seed;        // this tensor's random stream (stochastic rounding)
};

// Param formats: the element type in memory and its fp32 conversions.
struct F32 {
  using T = float;
  static float load(float x) { return x; }
  static float round_nearest(float x) { return x; }
  static float round_stochastic(float x, uint32_t) { return x; }
};
struct BF16 : lowp::BF16 {
  using T = uint16_t;
};
struct F16 : lowp::F16 {
  using T = uint16_t;
};

struct TensorPtrs {
  void* p;
  const void* g;
  float* master;
  void* m;  // uint8 codes or bf16 bits
  void* v;
  float* absmax_m;
  float* absmax_v;
};

// One block, scalar: the reference loop for builds without AVX-512 (and fp16 with stochastic
// rounding, which has no vector path).
template <typename Fmt, bool Q8, bool MASTER, bool SR>
void block_scalar(const TensorPtrs& t, int64_t begin, int64_t len, int64_t block,
                  const Scalars& s, const Code& cm, const Code& cv) {
  using T = typename Fmt::T;
  T* p = static_cast<T*>(t.p) + begin;
  const T* g_ptr = static_cast<const T*>(t.g) + begin;
  float mbuf[kMaxBlock], vbuf[kMaxBlock];
  const float old_am = Q8 ? t.absmax_m[block] : 0.0f;
  const float old_av = Q8 ? t.absmax_v[block] : 0.0f;
  const bool small_weight = s.lerp_weight < 0.5f;
  uint32_t max_m = 0, max_v = 0;  // abs_bits
  for (int64_t i = 0; i < len; ++i) {
    const float g = Fmt::load(g_ptr[i]) * s.grad_mult;
    float x = MASTER ? t.master[begin + i] : Fmt::load(p[i]);
    float m, v;
    if constexpr (Q8) {
      m = cm.value[static_cast<uint8_t*>(t.m)[begin + i]] * old_am;
      v = cv.value[static_cast<uint8_t*>(t.v)[begin + i]] * old_av;
    } else {
      m = lowp::BF16::load(static_cast<uint16_t*>(t.m)[begin + i]);
      v = lowp::BF16::load(static_cast<uint16_t*>(t.v)[begin + i]);
    }
    const float diff = g - m;
    m = small_weight ? m + s.lerp_weight * diff : g - diff * (1.0f - s.lerp_weight);
    v = v * s.beta2 + s.one_minus_beta2 * g * g;
    const float denom = std::sqrt(v) * s.inv_bc2_sqrt + s.eps;
    // One rounding for decay and update: the result is within half an ulp of the exact value
    // (given the update), which is what the tests hold the kernels to.
    x = std::fma(x, s.decay, s.neg_step_size * m / denom);
    if constexpr (MASTER) t.master[begin + i] = x;
    if constexpr (SR) {
      p[i] = Fmt::round_stochastic(x, hash32(s.seed + uint32_t(begin + i)));
    } else {
      p[i] = Fmt::round_nearest(x);
    }
    if constexpr (Q8) {
      mbuf[i] = m;
      vbuf[i] = v;
      max_m = std::max(max_m, abs_bits(m));
      max_v = std::max(max_v, abs_bits(v));
    } else {
      static_cast<uint16_t*>(t.m)[begin + i] = lowp::BF16::round_nearest(m);
      static_cast<uint16_t*>(t.v)[begin + i] = lowp::BF16::round_nearest(v);
    }
  }
  if constexpr (Q8) {
    const float am = bits_to_float(max_m), av = bits_to_float(max_v);
    const BlockScale sm = block_scale(am), sv = block_scale(av);
    uint8_t* mq = static_cast<uint8_t*>(t.m) + begin;
    uint8_t* vq = static_cast<uint8_t*>(t.v) + begin;
    for (int64_t i = 0; i < len; ++i) {
      mq[i] = encode_signed(cm, mbuf[i] * sm.up, sm.inv);
      vq[i] = encode_unsigned(cv, vbuf[i] * sv.up, sv.inv);
    }
    t.absmax_m[block] = am;
    t.absmax_v[block] = av;
  }
}

#ifdef FASTLLM_ADAMW8BIT_AVX512

inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? __mmask16(0xffff) : __mmask16((1u << remaining) - 1u);
}

template <typename Fmt>
inline __m512 load_vec(const typename Fmt::T* ptr, __mmask16 k) {
  if constexpr (std::is_same_v<Fmt, F32>) {
    return _mm512_maskz_loadu_ps(k, ptr);
  } else if constexpr (std::is_same_v<Fmt, BF16>) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, ptr));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  } else {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, ptr));
  }
}

// bf16 round-to-nearest-even bits of x, one per 32-bit lane (nan not handled)
inline __m512i bf16_nearest_bits(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_srli_epi32(
      _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
}

inline __m256i bf16_round_nearest_vec(__m512 x) {
  __m512i r = bf16_nearest_bits(x);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(r);
}

inline __m512i hash32_vec(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(int32_t(0x846ca68bU)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

template <typename Fmt, bool SR>
inline void store_vec(typename Fmt::T* ptr, __mmask16 k, __m512 x, uint32_t stream) {
  if constexpr (std::is_same_v<Fmt, F32>) {
    _mm512_mask_storeu_ps(ptr, k, x);
  } else if constexpr (std::is_same_v<Fmt, BF16>) {
    if constexpr (SR) {
      const __m512i idx = _mm512_add_epi32(
          _mm512_set1_epi32(int32_t(stream)),
          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      const __m512i noise = _mm512_and_si512(hash32_vec(idx), _mm512_set1_epi32(0xffff));
      __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), noise), 16);
      // carried up to +-inf: round_nearest's result instead (lowp::BF16::round_stochastic's rule:
      // a finite value above bf16's largest keeps the largest where nearest gives it)
      const __mmask16 to_inf = _mm512_cmpeq_epi32_mask(
          _mm512_and_si512(r, _mm512_set1_epi32(0x7fff)), _mm512_set1_epi32(0x7f80));
      r = _mm512_mask_mov_epi32(r, to_inf, bf16_nearest_bits(x));
      const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
      _mm256_mask_storeu_epi16(ptr, k, _mm512_cvtepi32_epi16(r));
    } else {
      _mm256_mask_storeu_epi16(ptr, k, bf16_round_nearest_vec(x));
    }
  } else {
    _mm256_mask_storeu_epi16(ptr, k, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// sqrt and 1/x from the 14-bit estimates plus one Newton step (relative error ~2^-23): on this
// class of CPU vsqrtps and vdivps on zmm take 10-12 cycles each per 16 lanes, more than the
// whole rest of the step, so they would make the kernel compute-bound below the memory speed.
inline __m512 sqrt_nr(__m512 v) {
  // v * rsqrt(v) is nan at v = 0; from FLT_MIN up it is finite, and sqrt(FLT_MIN) ~ 1e-19 is
  // nothing next to eps. v second: vmaxps returns its second operand when one is nan, so a nan v
  // stays nan (as std::sqrt's). v = inf ((1 - beta2) * g^2 overflowing fp32 for |g| above ~6e20)
  // would give inf * 0 = nan: it is passed through as inf, so that (with reciprocal_nr(inf) = 0)
  // the element gets no update, as in the scalar path and torch.optim.AdamW.
  v = _mm512_max_ps(_mm512_set1_ps(1.17549435e-38f), v);
  __m512 y = _mm512_rsqrt14_ps(v);
  const __m512 half_v = _mm512_mul_ps(v, _mm512_set1_ps(0.5f));
  y = _mm512_mul_ps(y, _mm512_fnmadd_ps(_mm512_mul_ps(half_v, y), y, _mm512_set1_ps(1.5f)));
  const __mmask16 inf = _mm512_cmp_ps_mask(v, _mm512_set1_ps(FLT_MAX), _CMP_GT_OQ);
  return _mm512_mask_mov_ps(_mm512_mul_ps(v, y), inf, v);
}

inline __m512 reciprocal_nr(__m512 d) {  // d > 0 or nan here (a denominator sqrt(v) * c + eps)
  const __m512 r = _mm512_rcp14_ps(d);
  const __mmask16 inf = _mm512_cmp_ps_mask(d, _mm512_set1_ps(FLT_MAX), _CMP_GT_OQ);
  return _mm512_mask_mov_ps(_mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f))), inf,
                            _mm512_setzero_ps());
}

struct CodeVec {
  __m512 inv, offset;
  __m512i first, last, key_lo, key_hi;
  const float* value;
  const uint8_t (*planes)[256];
  explicit CodeVec(const Code& c)
      : inv(_mm512_load_ps(c.inv)),
        offset(_mm512_load_ps(c.offset)),
        first(_mm512_load_si512(c.first)),
        last(_mm512_load_si512(c.last)),
        key_lo(_mm512_load_si512(c.oct_key)),
        key_hi(_mm512_load_si512(c.oct_key + 16)),
        value(c.value),
        planes(c.planes) {}
};

#ifdef __AVX512VBMI__
// Code values of 64 codes with byte permutes (no gather): each byte plane of the 256-entry
// table is 4 zmm; two vpermi2b look up the lower and upper 128 entries, a blend on the code's
// top bit picks one. The codes are first reordered so that the in-lane unpacks that assemble
// the four planes into floats return elements 0-15, 16-31, 32-47 and 48-63 in order.
inline void decode64(const uint8_t (*planes)[256], __m512i codes, __m512 out[4]) {
  const __m512i order = _mm512_set_epi8(
      63, 62, 61, 60, 47, 46, 45, 44, 31, 30, 29, 28, 15, 14, 13, 12,
      59, 58, 57, 56, 43, 42, 41, 40, 27, 26, 25, 24, 11, 10, 9, 8,
      55, 54, 53, 52, 39, 38, 37, 36, 23, 22, 21, 20, 7, 6, 5, 4,
      51, 50, 49, 48, 35, 34, 33, 32, 19, 18, 17, 16, 3, 2, 1, 0);
  const __m512i c = _mm512_permutexvar_epi8(order, codes);
  const __mmask64 upper = _mm512_movepi8_mask(c);
  __m512i b[4];
  for (int k = 0; k < 4; ++k) {
    const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(planes[k]), c,
                                                _mm512_load_si512(planes[k] + 64));
    const __m512i hi = _mm512_permutex2var_epi8(_mm512_load_si512(planes[k] + 128), c,
                                                _mm512_load_si512(planes[k] + 192));
    b[k] = _mm512_mask_blend_epi8(upper, lo, hi);
  }
  const __m512i b01_lo = _mm512_unpacklo_epi8(b[0], b[1]);
  const __m512i b01_hi = _mm512_unpackhi_epi8(b[0], b[1]);
  const __m512i b23_lo = _mm512_unpacklo_epi8(b[2], b[3]);
  const __m512i b23_hi = _mm512_unpackhi_epi8(b[2], b[3]);
  out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(b01_lo, b23_lo));
  out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(b01_lo, b23_lo));
  out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(b01_hi, b23_hi));
  out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(b01_hi, b23_hi));
}
#endif

// encode_magnitude for 16 values of a in [0, 2) (nan, inf and -0.0 allowed): a >= 1, inf and nan
// fall in octave slot 31, the last segment (one code, the top one); -0.0 in code 0's segment.
inline __m512i encode_magnitude_vec(const CodeVec& c, __m512 a) {
  const __m512i bits = _mm512_castps_si512(a);
  // Exponents 96..127 select slots 0..31 (permutex2var reads the low 5 bits of the index);
  // below 2^-31 there is no boundary, so slot 0's key (which has none) holds.
  const __m512i e = _mm512_max_epi32(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(96));
  const __m512i key = _mm512_permutex2var_epi32(c.key_lo, e, c.key_hi);
  const __m512i j = _mm512_srli_epi32(
      _mm512_add_epi32(key, _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffff))), 23);
  const __m512 t = _mm512_fmadd_ps(a, _mm512_permutexvar_ps(j, c.inv),
                                   _mm512_permutexvar_ps(j, c.offset));
  // t > -1 for every a in segment j (its first decision boundary is less than a spacing below
  // the first code's), so truncation gives k >= 0 and only the top needs a clamp. A nan t (a nan,
  // or inf * 0: an infinite m or v over its block's inf absmax) truncates to INT_MIN; the clamp
  // is unsigned so that it gives the top code 255, as encode_signed/encode_unsigned do. A signed
  // min kept a negative k whose low byte is 255 too, but encode_signed_vec's 254 - k for m < 0
  // then wrapped to 255 (+1.0) instead of 0 (-1.0): -inf came back as +inf.
  const __m512i k = _mm512_add_epi32(_mm512_cvttps_epi32(t), _mm512_permutexvar_epi32(j, c.first));
  return _mm512_min_epu32(k, _mm512_permutexvar_epi32(j, c.last));
}

// Code of the first moment: the magnitude's code mirrored for m < 0 (254 - i; -0.0 and nan
// keep the magnitude's code).
inline __m512i encode_signed_vec(const CodeVec& c, __m512 m, __m512 inv_absmax) {
  const __m512i c254 = _mm512_set1_epi32(254);
  const __m512i i = encode_magnitude_vec(c, _mm512_mul_ps(_mm512_abs_ps(m), inv_absmax));
  const __mmask16 neg = _mm512_cmp_ps_mask(m, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_mask_sub_epi32(i, neg, c254, _mm512_min_epi32(i, c254));
}

// The low bytes of four int32 vectors, in order: 3 shuffles for 64 codes (vpmovdb costs 2 each).
inline __m512i pack_low_bytes(__m512i a, __m512i b, __m512i c, __m512i d) {
#ifndef __AVX512VBMI__
  const __m512i lo = _mm512_inserti32x4(_mm512_castsi128_si512(_mm512_cvtepi32_epi8(a)),
                                        _mm512_cvtepi32_epi8(b), 1);
  const __m512i hi = _mm512_inserti32x4(_mm512_castsi128_si512(_mm512_cvtepi32_epi8(c)),
                                        _mm512_cvtepi32_epi8(d), 1);
  return _mm512_inserti64x4(lo, _mm512_castsi512_si256(hi), 1);
#else
  const __m512i idx = _mm512_set_epi8(
      124, 120, 116, 112, 108, 104, 100, 96, 92, 88, 84, 80, 76, 72, 68, 64,
      60, 56, 52, 48, 44, 40, 36, 32, 28, 24, 20, 16, 12, 8, 4, 0,
      124, 120, 116, 112, 108, 104, 100, 96, 92, 88, 84, 80, 76, 72, 68, 64,
      60, 56, 52, 48, 44, 40, 36, 32, 28, 24, 20, 16, 12, 8, 4, 0);
  const __m512i lo = _mm512_permutex2var_epi8(a, idx, b);
  const __m512i hi = _mm512_permutex2var_epi8(c, idx, d);
  return _mm512_inserti64x4(lo, _mm512_castsi512_si256(hi), 1);
#endif
}

// The per-block constants of the vector step.
struct VecScalars {
  __m512 decay, beta2, omb1, omb2, nss, ibc2, eps, mult, w;
  bool small_weight;
  explicit VecScalars(const Scalars& s)
      : decay(_mm512_set1_ps(s.decay)),
        beta2(_mm512_set1_ps(s.beta2)),
        omb1(_mm512_set1_ps(s.lerp_weight)),
        omb2(_mm512_set1_ps(s.one_minus_beta2)),
        nss(_mm512_set1_ps(s.neg_step_size)),
        ibc2(_mm512_set1_ps(s.inv_bc2_sqrt)),
        eps(_mm512_set1_ps(s.eps)),
        mult(_mm512_set1_ps(s.grad_mult)),
        w(_mm512_set1_ps(s.lerp_weight < 0.5f ? s.lerp_weight : 1.0f - s.lerp_weight)),
        small_weight(s.lerp_weight < 0.5f) {}
};

// 16 elements at offset i of the block: load, update m and v (given their dequantised values
// before the step, or for 8-bit moments their code values with the absmax folded into
// beta1_absmax / beta2_absmax), write the param (and master); returns the new m, v.
template <typename Fmt, bool Q8, bool MASTER, bool SR>
inline void update16(const TensorPtrs& t, int64_t at, __mmask16 k, const VecScalars& c,
                     uint32_t seed, __m512 beta1_absmax, __m512 beta2_absmax, __m512& m,
                     __m512& v) {
  using T = typename Fmt::T;
  T* p = static_cast<T*>(t.p) + at;
  const __m512 g = _mm512_mul_ps(load_vec<Fmt>(static_cast<const T*>(t.g) + at, k), c.mult);
  __m512 x = MASTER ? _mm512_maskz_loadu_ps(k, t.master + at) : load_vec<Fmt>(p, k);
  if constexpr (Q8) {
    // m = beta1 * absmax * code + (1 - beta1) * g; v = beta2 * absmax * code + (1 - beta2) * g^2
    m = _mm512_fmadd_ps(m, beta1_absmax, _mm512_mul_ps(g, c.omb1));
    v = _mm512_fmadd_ps(_mm512_mul_ps(c.omb2, g), g, _mm512_mul_ps(v, beta2_absmax));
  } else {
    const __m512 diff = _mm512_sub_ps(g, m);
    m = c.small_weight ? _mm512_fmadd_ps(c.w, diff, m) : _mm512_fnmadd_ps(diff, c.w, g);
    v = _mm512_fmadd_ps(_mm512_mul_ps(c.omb2, g), g, _mm512_mul_ps(v, c.beta2));
  }
  const __m512 denom = _mm512_fmadd_ps(sqrt_nr(v), c.ibc2, c.eps);
  x = _mm512_fmadd_ps(x, c.decay, _mm512_mul_ps(_mm512_mul_ps(c.nss, m), reciprocal_nr(denom)));
  if constexpr (MASTER) _mm512_mask_storeu_ps(t.master + at, k, x);
  store_vec<Fmt, SR>(p, k, x, seed + uint32_t(at));
}

// One block. 8-bit moments: one pass updates the block (dequantising both moments), keeping
// the new m and v in an L1 buffer and tracking their absmax; a second pass encodes them with
// that absmax. Full groups of 64 elements run unmasked and store 64 codes at
// once; a ragged end runs in masked steps of 16.
template <typename Fmt, bool Q8, bool MASTER, bool SR>
void block_avx512(const TensorPtrs& t, int64_t begin, int64_t len, int64_t block,
                  const Scalars& s, const CodeVec& cm, const CodeVec& cv) {
  const VecScalars c(s);
  if constexpr (!Q8) {
    for (int64_t i = 0; i < len; i += 16) {
      const __mmask16 k = tail_mask(len - i);
      uint16_t* mp = static_cast<uint16_t*>(t.m) + begin + i;
      uint16_t* vp = static_cast<uint16_t*>(t.v) + begin + i;
      __m512 m = load_vec<BF16>(mp, k), v = load_vec<BF16>(vp, k);
      update16<Fmt, false, MASTER, SR>(t, begin + i, k, c, s.seed, m, m, m, v);
      _mm256_mask_storeu_epi16(mp, k, bf16_round_nearest_vec(m));
      _mm256_mask_storeu_epi16(vp, k, bf16_round_nearest_vec(v));
    }
  } else {
    alignas(64) float mbuf[kMaxBlock];
    alignas(64) float vbuf[kMaxBlock];
    uint8_t* mq = static_cast<uint8_t*>(t.m) + begin;
    uint8_t* vq = static_cast<uint8_t*>(t.v) + begin;
    const __m512 b1am = _mm512_set1_ps((1.0f - s.lerp_weight) * t.absmax_m[block]);
    const __m512 b2av = _mm512_set1_ps(s.beta2 * t.absmax_v[block]);
    // The absmaxes as abs_bits, lane by lane (vpmaxud: a NaN is kept, vmaxps would drop it).
    const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
    __m512i max_m = _mm512_setzero_si512(), max_v = _mm512_setzero_si512();
    int64_t i = 0;
    // Full groups of 64 run unmasked, the 64 values of each moment decoded up front: with VBMI
    // by byte permutes instead of gathers (a gather is 16 loads). On this Zen 4 VM decoding the
    // first moment this way too made the whole step 19% faster per element than gathering it
    // (1.25 -> 1.02 ns, one thread, 64K elements in L2; 1.19 -> 0.97 ns from DRAM).
    for (; i + 64 <= len; i += 64) {
      __m512 vd[4];
#ifdef __AVX512VBMI__
      __m512 md[4];
      decode64(cv.planes, _mm512_loadu_si512(vq + i), vd);
      decode64(cm.planes, _mm512_loadu_si512(mq + i), md);
#else
      for (int u = 0; u < 4; ++u) {
        vd[u] = _mm512_i32gather_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(
                                        reinterpret_cast<const __m128i*>(vq + i + 16 * u))),
                                    cv.value, 4);
      }
#endif
      for (int u = 0; u < 4; ++u) {
        const int64_t iu = i + 16 * u;
#ifdef __AVX512VBMI__
        __m512 m = md[u];
#else
        const __m512i mi =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mq + iu)));
        __m512 m = _mm512_i32gather_ps(mi, cm.value, 4);
#endif
        __m512 v = vd[u];
        update16<Fmt, true, MASTER, SR>(t, begin + iu, __mmask16(0xffff), c, s.seed, b1am, b2av,
                                        m, v);
        _mm512_store_ps(mbuf + iu, m);
        _mm512_store_ps(vbuf + iu, v);
        max_m = _mm512_max_epu32(max_m, _mm512_and_si512(_mm512_castps_si512(m), abs_mask));
        max_v = _mm512_max_epu32(max_v, _mm512_and_si512(_mm512_castps_si512(v), abs_mask));
      }
    }
    for (; i < len; i += 16) {
      const __mmask16 k = tail_mask(len - i);
      const __m512i mi = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, mq + i));
      const __m512i vi = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(k, vq + i));
      __m512 m = _mm512_i32gather_ps(mi, cm.value, 4);
      __m512 v = _mm512_i32gather_ps(vi, cv.value, 4);
      update16<Fmt, true, MASTER, SR>(t, begin + i, k, c, s.seed, b1am, b2av, m, v);
      _mm512_store_ps(mbuf + i, m);
      _mm512_store_ps(vbuf + i, v);
      max_m = _mm512_mask_max_epu32(max_m, k, max_m,
                                    _mm512_and_si512(_mm512_castps_si512(m), abs_mask));
      max_v = _mm512_mask_max_epu32(max_v, k, max_v,
                                    _mm512_and_si512(_mm512_castps_si512(v), abs_mask));
    }
    const float am = bits_to_float(uint32_t(_mm512_reduce_max_epu32(max_m)));
    const float av = bits_to_float(uint32_t(_mm512_reduce_max_epu32(max_v)));
    const BlockScale sm = block_scale(am), sv = block_scale(av);
    const __m512 up_m = _mm512_set1_ps(sm.up), inv_m = _mm512_set1_ps(sm.inv);
    const __m512 up_v = _mm512_set1_ps(sv.up), inv_v = _mm512_set1_ps(sv.inv);
    const auto scaled_m = [&](int64_t at) {
      return _mm512_mul_ps(_mm512_load_ps(mbuf + at), up_m);
    };
    const auto scaled_v = [&](int64_t at) {
      return _mm512_mul_ps(_mm512_mul_ps(_mm512_load_ps(vbuf + at), up_v), inv_v);
    };
    i = 0;
    for (; i + 64 <= len; i += 64) {
      __m512i ci[4], vi[4];
      for (int u = 0; u < 4; ++u) {
        ci[u] = encode_signed_vec(cm, scaled_m(i + 16 * u), inv_m);
        vi[u] = encode_magnitude_vec(cv, scaled_v(i + 16 * u));
      }
      _mm512_storeu_si512(mq + i, pack_low_bytes(ci[0], ci[1], ci[2], ci[3]));
      _mm512_storeu_si512(vq + i, pack_low_bytes(vi[0], vi[1], vi[2], vi[3]));
    }
    for (; i < len; i += 16) {
      const __mmask16 k = tail_mask(len - i);
      const __m512i ci = encode_signed_vec(cm, scaled_m(i), inv_m);
      const __m512i vi = encode_magnitude_vec(cv, scaled_v(i));
      _mm_mask_storeu_epi8(mq + i, k, _mm512_cvtepi32_epi8(ci));
      _mm_mask_storeu_epi8(vq + i, k, _mm512_cvtepi32_epi8(vi));
    }
    t.absmax_m[block] = am;
    t.absmax_v[block] = av;
  }
}
#endif  // FASTLLM_ADAMW8BIT_AVX512

template <typename Fmt, bool Q8, bool MASTER, bool SR>
void run_tensors(const std::vector<TensorPtrs>& tensors, const std::vector<int64_t>& numels,
                 const std::vector<Scalars>& scalars, int64_t block_size, const Code& cm,
                 const Code& cv) {
  struct Chunk {
    int64_t tensor, first_block, end_block;
  };
  // About 64K elements per work item, as in adamw.cpp.
  const int64_t blocks_per_chunk = std::max<int64_t>(1, (int64_t(1) << 16) / block_size);
  std::vector<Chunk> chunks;
  for (const auto t : c10::irange(tensors.size())) {
    const int64_t nb = (numels[t] + block_size - 1) / block_size;
    for (int64_t b = 0; b < nb; b += blocks_per_chunk) {
      chunks.push_back({int64_t(t), b, std::min(nb, b + blocks_per_chunk)});
    }
  }
  at::parallel_for(0, int64_t(chunks.size()), 1, [&](int64_t lo, int64_t hi) {
#ifdef FASTLLM_ADAMW8BIT_AVX512
    const CodeVec vm(cm), vv(cv);
#endif
    for (int64_t c = lo; c < hi; ++c) {
      const Chunk& ch = chunks[c];
      const auto& t = tensors[ch.tensor];
      const int64_t n = numels[ch.tensor];
      for (int64_t b = ch.first_block; b < ch.end_block; ++b) {
        const int64_t begin = b * block_size;
        const int64_t len = std::min(block_size, n - begin);
#ifdef FASTLLM_ADAMW8BIT_AVX512
        if constexpr (!(std::is_same_v<Fmt, F16> && SR)) {
          block_avx512<Fmt, Q8, MASTER, SR>(t, begin, len, b, scalars[ch.tensor], vm,
                                                      vv);
          continue;
        }
#endif
        block_scalar<Fmt, Q8, MASTER, SR>(t, begin, len, b, scalars[ch.tensor], cm,
                                                    cv);
      }
    }
  });
}

}  // namespace

void adamw8bit_step_cpu(const std::vector<at::Tensor>& params,
                        const std::vector<at::Tensor>& grads,
                        const std::vector<at::Tensor>& masters,
                        const std::vector<at::Tensor>& exp_avgs,
                        const std::vector<at::Tensor>& exp_avg_sqs,
                        const std::vector<at::Tensor>& exp_avg_absmaxes,
                        const std::vector<at::Tensor>& exp_avg_sq_absmaxes,
                        const std::vector<at::Tensor>& steps, const at::Tensor& qmaps, double lr,
                        double beta1, double beta2, double eps, double weight_decay,
                        int64_t block_size, bool maximize, bool stochastic_rounding, int64_t seed,
                        const c10::optional<at::Tensor>& grad_scale,
                        const c10::optional<at::Tensor>& clip_coef,
                        const c10::optional<at::Tensor>& found_inf) {
  if (params.empty()) return;
  const char* op = "fastllm.adamw8bit_step (cpu)";
  const auto dtype = params[0].scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": params must be float32, bfloat16 or float16, got ", dtype);
  TORCH_CHECK(block_size >= 16 && block_size <= kMaxBlock && block_size % 16 == 0, op,
              ": block_size must be a multiple of 16 in [16, ", kMaxBlock, "], got ", block_size);
  TORCH_CHECK(!exp_avgs.empty(), op, ": exp_avgs is empty");
  const auto state_dtype = exp_avgs[0].scalar_type();
  TORCH_CHECK(state_dtype == at::kByte || state_dtype == at::kBFloat16, op,
              ": exp_avgs must be uint8 or bfloat16, got ", state_dtype);
  const bool q8 = state_dtype == at::kByte;
  const bool master = !masters.empty();
  const at::Device cpu(at::kCPU);
  check_tensor_list(op, params, "params", params, cpu, dtype);
  check_tensor_list(op, grads, "grads", params, cpu, dtype);
  if (master) check_tensor_list(op, masters, "masters", params, cpu, at::kFloat);
  check_tensor_list(op, exp_avgs, "exp_avgs", params, cpu, state_dtype);
  check_tensor_list(op, exp_avg_sqs, "exp_avg_sqs", params, cpu, state_dtype);
  TORCH_CHECK(steps.size() == params.size(), op, ": steps has ", steps.size(),
              " tensors but params has ", params.size());
  if (q8) {
    TORCH_CHECK(exp_avg_absmaxes.size() == params.size() &&
                    exp_avg_sq_absmaxes.size() == params.size(),
                op, ": 8-bit moments need one absmax tensor per param");
    for (const auto i : c10::irange(params.size())) {
      const int64_t nb = (params[i].numel() + block_size - 1) / block_size;
      for (const auto* t : {&exp_avg_absmaxes[i], &exp_avg_sq_absmaxes[i]}) {
        TORCH_CHECK(t->device() == cpu && t->scalar_type() == at::kFloat && t->numel() == nb &&
                        t->is_contiguous(),
                    op, ": absmax tensors of param ", i, " must be contiguous float32 CPU "
                    "tensors of ", nb, " elements");
      }
    }
    TORCH_CHECK(qmaps.device() == cpu && qmaps.scalar_type() == at::kFloat &&
                    qmaps.dim() == 2 && qmaps.size(0) == 2 && qmaps.size(1) == kQmapWidth &&
                    qmaps.is_contiguous(),
                op, ": qmaps must be a contiguous (2, ", kQmapWidth, ") float32 CPU tensor");
  }
  if (found_inf.has_value() && scalar_value(*found_inf) != 0.0) return;
  double grad_mult = 1.0;
  if (grad_scale.has_value()) grad_mult /= scalar_value(*grad_scale);
  if (clip_coef.has_value()) grad_mult *= scalar_value(*clip_coef);

  Code cm{}, cv{};
  if (q8) {
    const float* rows = qmaps.data_ptr<float>();
    cm = make_code(rows);
    cv = make_code(rows + kQmapWidth);
  }
  std::vector<TensorPtrs> tensors(params.size());
  std::vector<int64_t> numels(params.size());
  std::vector<Scalars> scalars(params.size());
  const uint32_t seed32 = hash32(uint32_t(uint64_t(seed)) ^ hash32(uint32_t(uint64_t(seed) >> 32)));
  for (const auto i : c10::irange(params.size())) {
    const double step = scalar_value(steps[i]);
    const double bc1 = 1.0 - std::pow(beta1, step);
    const double bc2 = 1.0 - std::pow(beta2, step);
    scalars[i] = {float(1.0 - lr * weight_decay), float(1.0 - beta1), float(beta2),
                  float(1.0 - beta2), float(-lr / bc1), float(1.0 / std::sqrt(bc2)), float(eps),
                  float(maximize ? -grad_mult : grad_mult),
                  hash32(seed32 + 0x9e3779b9U * uint32_t(i + 1))};
    tensors[i] = {params[i].data_ptr(), grads[i].data_ptr(),
                  master ? masters[i].data_ptr<float>() : nullptr, exp_avgs[i].data_ptr(),
                  exp_avg_sqs[i].data_ptr(),
                  q8 ? exp_avg_absmaxes[i].data_ptr<float>() : nullptr,
                  q8 ? exp_avg_sq_absmaxes[i].data_ptr<float>() : nullptr};
    numels[i] = params[i].numel();
  }
  const bool sr = stochastic_rounding && dtype != at::kFloat;
  auto run = [&](auto fmt) {
    using Fmt = decltype(fmt);
    dispatch_bool(q8, [&](auto q) {
      dispatch_bool(master && !std::is_same_v<Fmt, F32>, [&](auto ma) {
        dispatch_bool(sr && !std::is_same_v<Fmt, F32>, [&](auto s) {
          run_tensors<Fmt, decltype(q)::value, decltype(ma)::value, decltype(s)::value>(
              tensors, numels, scalars, block_size, cm, cv);
        });
      });
    });
  };
  if (dtype == at::kFloat) {
    run(F32{});
  } else if (dtype == at::kBFloat16) {
    run(BF16{});
  } else {
    run(F16{});
  }
}

}  // namespace fastllm
