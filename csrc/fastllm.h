// Declarations of every kernel entry point in fastllm._C.
//
// Each op has one Python-facing schema (fastllm/_library.py). The functions below take exactly
// that schema's arguments; fastllm/ops/<op>.py routes a call to one of them (or to the Triton or
// reference implementation) and extension.cpp exposes them to Python.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <vector>

namespace fastllm {

// AdamW with decoupled weight decay over many tensors (torch.optim.AdamW semantics).
// params, exp_avgs, exp_avg_sqs (and max_exp_avg_sqs when amsgrad) are updated in place; grads are
// only read (divided by *grad_scale on the fly when given); nothing changes when *found_inf != 0.
// steps are the per-parameter step counts, already incremented for this step.
void adamw_step_cpu(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                    const std::vector<at::Tensor>& exp_avgs,
                    const std::vector<at::Tensor>& exp_avg_sqs,
                    const std::vector<at::Tensor>& max_exp_avg_sqs,
                    const std::vector<at::Tensor>& steps, double lr, double beta1, double beta2,
                    double eps, double weight_decay, bool amsgrad, bool maximize,
                    const c10::optional<at::Tensor>& grad_scale,
                    const c10::optional<at::Tensor>& found_inf);

// Mixed-precision AdamW (fastllm/ops/adamw_master.py): bf16/fp16 params and grads, fp32 exp_avgs
// and exp_avg_sqs. With masters (fp32) the update is applied to the master and the param is
// rewritten as its rounding; without masters the param itself is updated ("pure" low precision),
// optionally with kahan_comps (param dtype) holding the rounding residual. Grads are multiplied by
// *clip_coef / *grad_scale on the fly; nothing changes when *found_inf != 0.
void adamw_master_step_cpu(const std::vector<at::Tensor>& params,
                           const std::vector<at::Tensor>& grads,
                           const std::vector<at::Tensor>& masters,
                           const std::vector<at::Tensor>& exp_avgs,
                           const std::vector<at::Tensor>& exp_avg_sqs,
                           const std::vector<at::Tensor>& kahan_comps,
                           const std::vector<at::Tensor>& steps, double lr, double beta1,
                           double beta2, double eps, double weight_decay, bool maximize,
                           bool stochastic_rounding, int64_t seed,
                           const c10::optional<at::Tensor>& grad_scale,
                           const c10::optional<at::Tensor>& clip_coef,
                           const c10::optional<at::Tensor>& found_inf);

// sqrt of the sum of squares of every element of every tensor (a 0-dim CPU tensor, fp64 when
// every tensor is fp64, else fp32, as torch.nn.utils.get_total_norm); non-finite when any element
// is inf or nan.
at::Tensor l2norm_cpu(const std::vector<at::Tensor>& tensors);

// The dtype of l2norm's result: fp64 when every tensor is fp64 (the sum is fp64 anyway), else fp32.
inline at::ScalarType l2norm_out_dtype(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors) {
    if (t.scalar_type() != at::kDouble) return at::kFloat;
  }
  return tensors.empty() ? at::kFloat : at::kDouble;
}

// LoRA dropout (fastllm::lora_linear): x * keep / (1 - p) for a contiguous (rows, cols) CPU
// tensor, keep a hash of (seed, row, col) that the backward regenerates (csrc/cpu/lora_linear.cpp).
at::Tensor lora_dropout_cpu(const at::Tensor& x, double p, int64_t seed);
// out += alpha * dropout(x), the same mask; out and x contiguous (rows, cols) of one dtype.
void lora_dropout_add_cpu(const at::Tensor& out, const at::Tensor& x, double p, int64_t seed,
                          double alpha);

// Memory-bandwidth probe (bench only): for each chunk, every read_write tensor is read and written
// back once and every read_only tensor read once. All tensors contiguous fp32 CPU, equal numel.
void stream_probe_cpu(const std::vector<at::Tensor>& read_write,
                      const std::vector<at::Tensor>& read_only);

// fastllm::scaled_copy (csrc/cpu/scaled_copy.cpp)
// dst[i] = src[i] * (scale / *divisor) for each pair, computed in fp32, rounded to nearest even
// into dst[i]'s dtype (fp32, bf16, fp16); pairs have equal numel and are contiguous CPU tensors.
void scaled_copy_cpu(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src,
                     double scale, const c10::optional<at::Tensor>& divisor);

// fastllm::nf4_dequantize (csrc/cpu/nf4.cpp)
// out[i] = code[q_i] * absmax[i / blocksize] in fp32, rounded into out's dtype (fp32, bf16, fp16);
// q_i is the 4-bit code of element i in packed (two per byte, even index in the high nibble).
void nf4_dequantize_cpu(const at::Tensor& packed, const at::Tensor& absmax,
                        const at::Tensor& code, const at::Tensor& out, int64_t blocksize);

// PowerSGD and GaLore (csrc/cpu/orthogonalize.cpp, powersgd_decompress.cpp,
// galore_adam_step.cpp) ---
// Modified Gram-Schmidt on the columns of each (n, r) fp32/fp64 matrix, in place:
// x_i /= ||x_i|| + epsilon, then x_i is removed from every later column.
void orthogonalize_cpu(const std::vector<at::Tensor>& matrices, double epsilon);
// For each i: errors[i] = matrices[i] - ps[i] local_qs[i]^T (when errors is not empty), then
// matrices[i] = scale * ps[i] qs[i]^T. M (n, m), P (n, r), Q and local Q (m, r), one fp32/fp64
// dtype, contiguous CPU tensors; errors and local_qs both empty or as long as matrices.
void powersgd_decompress_cpu(const std::vector<at::Tensor>& matrices,
                             const std::vector<at::Tensor>& ps, const std::vector<at::Tensor>& qs,
                             const std::vector<at::Tensor>& local_qs,
                             const std::vector<at::Tensor>& errors, double scale);
// One GaLore AdamW step of a 2-D param: project grad with proj (left: (rows, r), right:
// (cols, r)), update the low-rank moments, back-project, apply with decoupled weight decay.
void galore_adam_step_cpu(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& proj,
                          const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq, double step,
                          bool left, double lr, double beta1, double beta2, double eps,
                          double weight_decay, double scale);

// fastllm::adamw8bit_step (csrc/cpu/adamw8bit.cpp)
// AdamW with low-byte moments (fastllm/ops/adamw8bit.py): params/grads fp32, bf16 or fp16,
// optional fp32 masters; exp_avgs/exp_avg_sqs uint8 codes (block-wise absmax in
// exp_avg_absmaxes/exp_avg_sq_absmaxes, fp32, ceil(numel / block_size) each; qmaps (2, 384)
// fp32 the code tables) or bf16 (absmax lists empty). Grads are multiplied by
// *clip_coef / *grad_scale; nothing changes when *found_inf != 0.
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
                        const c10::optional<at::Tensor>& found_inf);

// fp32 CPU GEMMs by fastllm's routes (csrc/cpu/gemm.cpp, csrc/cpu/sgemm_avx2.cpp; the policy is
// fastllm/_gemm.py's) ---------------------------------------------------------------------------
// out = beta * out + alpha * (a @ b): 2-D fp32 CPU tensors, a and b of any strides (no negative
// bit), out contiguous; beta 0 does not read out. check_fp32_gemm_args raises on anything else.
void check_fp32_gemm_args(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out);
// through ATen's oneDNN matmul: raises when this PyTorch has none or it refuses the CPU
void gemm_onednn_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out,
                     double beta, double alpha);
bool onednn_gemm_available();
// A symbol of the loaded libtorch_cpu (dlsym; nullptr where it is absent, and off Linux): the
// entries ATen exports but its headers do not declare in every supported torch.
void* torch_cpu_symbol(const char* name);
// fastllm's AVX2 + FMA kernel: raises on a CPU without them
void sgemm_avx2_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out,
                    double beta, double alpha);
bool sgemm_avx2_available();
// The process-wide switch fastllm/_gemm.py sets: the route routed_mm_out etc. below take for
// fp32, 0 ATen (at::mm_out / addmm_), 1 oneDNN, 2 the AVX2 kernel (for products big enough that
// its packing pays; ATen's below). gemm_routed_cpu: the same product by the route in effect.
void set_fp32_gemm_route(int64_t route);
int64_t fp32_gemm_route();
void gemm_routed_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out,
                     double beta, double alpha);
// out = a @ b, out = bias + a @ b (bias (n,)) and out += alpha * (a @ b) for the C++ kernels,
// by that switch.
void routed_mm_out(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b);
void bias_mm_out(const at::Tensor& out, const at::Tensor& bias, const at::Tensor& a,
                 const at::Tensor& b);
void addmm_inplace(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, double alpha);
// bf16 x bf16 -> fp32 CPU GEMM (csrc/cpu/gemm_bf16.cpp): out = a @ b, or out += a @ b when
// accumulate, summed in fp32 and never rounded to bf16. a, b 2-D bf16 of any strides, out 2-D fp32
// with contiguous rows; subnormals flushed to zero by the kernel and by AMX (MKL on other CPUs
// may keep them). Two engines: fastllm's kernel (builds with
// AVX512-BF16) and MKL's cblas_gemm_bf16bf16f32 (where libtorch_cpu exports it), the default
// MKL's where bf16 GEMMs run on AMX, the kernel's elsewhere; raises where neither exists (when
// there is anything to multiply). gemm_bf16f32_available(): an engine exists and the GEMM is
// not switched off by set_gemm_bf16f32(false) (for tests of the fallbacks).
void gemm_bf16f32_cpu(const at::Tensor& a, const at::Tensor& b, const at::Tensor& out,
                      bool accumulate);
bool gemm_bf16f32_available();
// "fastllm", "mkl" or "none": the engine a call of gemm_bf16f32_cpu runs now (whether the C++
// kernels call it at all is gemm_bf16f32_preferred). set_gemm_bf16f32_engine picks one
// ("fastllm" | "mkl"; raises where it does not exist) or, nullopt, the default's.
std::string gemm_bf16f32_engine();
void set_gemm_bf16f32_engine(const c10::optional<std::string>& name);
// the engines that exist here, of "fastllm" and "mkl"
std::vector<std::string> gemm_bf16f32_engines();
// set_gemm_bf16f32: false off, true on wherever it applies (gemm_bf16f32_forced()), nullopt the
// default (on where its default engine exists: see gemm_bf16f32_preferred).
void set_gemm_bf16f32(c10::optional<bool> on);
bool gemm_bf16f32_forced();
// Whether PyTorch's bf16 GEMMs run on AMX tiles here (cpublas::could_pack): there at::mm's bf16
// (rounded output) beats fastllm's kernel, and MKL's bf16 -> fp32 GEMM beats the kernel and the
// callers' two rounded GEMMs (BENCHMARKS.md 2026-12-07).
bool bf16_gemm_on_amx();
// Whether the C++ kernels' bf16 products (the fused loss's dW, the CPU attention's S and dP) take
// gemm_bf16f32_cpu: available, with a default engine here (on AMX CPUs MKL's; the kernel is
// slower there than the callers' fallbacks) or an engine set, or forced.
bool gemm_bf16f32_preferred();

// fastllm::fused_linear_cross_entropy (csrc/cpu/fused_linear_cross_entropy.cpp)
// Cross-entropy of logits = hidden weight^T + bias over chunks of tokens, never materialising
// them. hidden (N, H), weight (V, H), bias (V,) of one dtype (fp32, bf16, fp16), labels (N,)
// int64, contiguous CPU tensors. Returns {loss (N,) fp32 per token (0 where ignored),
// grad_hidden (N, H), grad_weight (V, H), grad_bias (V,)}: each grad of
// sum_i w_i loss_i, w_i = scale * token_scale[i] (/ valid tokens when divide_by_valid), empty
// unless its need_* flag is set. softcap <= 0: none. chunk_rows <= 0: sized by the kernel.
std::vector<at::Tensor> fused_linear_cross_entropy_cpu(
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& labels,
    const c10::optional<at::Tensor>& bias, const c10::optional<at::Tensor>& token_scale,
    double scale, bool divide_by_valid, int64_t ignore_index, double label_smoothing,
    double z_loss, double softcap, bool need_hidden, bool need_weight, bool need_bias,
    int64_t chunk_rows);
// Model ops (csrc/cpu/rms_norm.cpp, rotary_embedding.cpp, swiglu.cpp; fastllm/ops/<op>.py) ---
// RMSNorm of contiguous x (..., h) with weight (h,) of x's dtype: {y of x's shape, rstd of
// x.shape[:-1], fp32 (fp64 for fp64 x)}; y = x * rstd * (offset + weight), offset 0 (Llama) or
// 1 (Gemma).
std::vector<at::Tensor> rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps,
                                     double offset);
// {dx, dweight} of rms_norm_cpu (each empty when not needed), one pass over x and grad_out.
std::vector<at::Tensor> rms_norm_backward_cpu(const at::Tensor& grad_out, const at::Tensor& x,
                                              const at::Tensor& weight, const at::Tensor& rstd,
                                              double offset, bool need_dx, bool need_dweight);
// Rotate-half rotary embedding of q (B, S, Hq, D) and k (B, S, Hk, D) into q_out / k_out (which
// may be q / k); cos, sin (P, D) gathered by position_ids (B or 1, S), or (B or 1, S, D) when
// position_ids is empty. backward: the transposed rotation (gradients).
void rotary_embedding_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                          const at::Tensor& sin, const at::Tensor& position_ids,
                          const at::Tensor& q_out, const at::Tensor& k_out, bool backward);
// silu(gate) * up for contiguous gate, up of one shape and dtype.
at::Tensor swiglu_cpu(const at::Tensor& gate, const at::Tensor& up);
// {dgate, dup, h} of swiglu_cpu, sigmoid(gate) recomputed; h = swiglu_cpu(gate, up) with need_h
// (the same pass), else empty.
std::vector<at::Tensor> swiglu_backward_cpu(const at::Tensor& grad_out, const at::Tensor& gate,
                                            const at::Tensor& up, bool need_h);
// gelu(gate, approximate="tanh") * up (Gemma's GeGLU), and its backward, as the two above.
at::Tensor geglu_cpu(const at::Tensor& gate, const at::Tensor& up);
std::vector<at::Tensor> geglu_backward_cpu(const at::Tensor& grad_out, const at::Tensor& gate,
                                           const at::Tensor& up, bool need_h);
// Causal attention (csrc/cpu/attention.cpp; fastllm/ops/attention.py): q (B, T, Hq, D), k, v
// (B, T, Hkv, D), one dtype (fp32, bf16, fp16), Hq a multiple of Hkv; query t attends keys
// doc_start[b, t] <= j <= t (doc_start an empty tensor: 0). Returns {out (B, T, Hq, D) of q's
// dtype, lse (B, Hq, T) fp32: logsumexp of scale * q k^T over the keys attended}.
std::vector<at::Tensor> attention_cpu(const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v, const at::Tensor& doc_start,
                                      double scale);
// {dq, dk, dv} of attention_cpu, the probabilities recomputed from lse.
std::vector<at::Tensor> attention_backward_cpu(const at::Tensor& grad_out, const at::Tensor& q,
                                               const at::Tensor& k, const at::Tensor& v,
                                               const at::Tensor& out, const at::Tensor& lse,
                                               const at::Tensor& doc_start, double scale);

#ifdef FASTLLM_WITH_CUDA
// Same contract on CUDA tensors: one multi-tensor launch per chunk of tensors. grad_scale and
// found_inf are read on the device (no host sync); steps may live on the CPU or on the device.
// lr_tensor (one element; None: `lr`) on the device is read there (then steps must be there).
void adamw_step_cuda(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
                     const std::vector<at::Tensor>& exp_avgs,
                     const std::vector<at::Tensor>& exp_avg_sqs,
                     const std::vector<at::Tensor>& max_exp_avg_sqs,
                     const std::vector<at::Tensor>& steps, double lr, double beta1, double beta2,
                     double eps, double weight_decay, bool amsgrad, bool maximize,
                     const c10::optional<at::Tensor>& grad_scale,
                     const c10::optional<at::Tensor>& found_inf,
                     const c10::optional<at::Tensor>& lr_tensor);

// adamw_master_step_cpu's contract on CUDA tensors (csrc/cuda/adamw_master.cu); grad_scale,
// clip_coef and found_inf may be fp32 tensors on the device (read by the kernel) or on the CPU;
// steps on the CPU or the device; lr_tensor as adamw_step_cuda's.
void adamw_master_step_cuda(const std::vector<at::Tensor>& params,
                            const std::vector<at::Tensor>& grads,
                            const std::vector<at::Tensor>& masters,
                            const std::vector<at::Tensor>& exp_avgs,
                            const std::vector<at::Tensor>& exp_avg_sqs,
                            const std::vector<at::Tensor>& kahan_comps,
                            const std::vector<at::Tensor>& steps, double lr, double beta1,
                            double beta2, double eps, double weight_decay, bool maximize,
                            bool stochastic_rounding, int64_t seed,
                            const c10::optional<at::Tensor>& grad_scale,
                            const c10::optional<at::Tensor>& clip_coef,
                            const c10::optional<at::Tensor>& found_inf,
                            const c10::optional<at::Tensor>& lr_tensor);

// l2norm_cpu's contract on CUDA tensors of one device: a 0-dim tensor on that device.
at::Tensor l2norm_cuda(const std::vector<at::Tensor>& tensors);
#endif

}  // namespace fastllm
