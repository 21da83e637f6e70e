"""Every fastllm op's schema, declared once under the `fastllm` namespace.

Implementations live beside each op in fastllm/ops/<op>.py: a CPU and a CUDA kernel registered
with `lib.impl` (each routes to the cpp/cuda/triton/ref backend, see fastllm/_backend.py) and a
fake (shape-only) implementation for torch.compile and torch.library.opcheck.
"""

import functools

import torch

from fastllm import _backend

lib = torch.library.Library("fastllm", "DEF")

SCHEMAS = {
    # torch.optim.AdamW's update over many tensors, in place; the same contract as
    # aten::_fused_adamw_, except that grads are only read (never unscaled in place). These three
    # AdamW ops take the learning rate as `lr`, or from `lr_tensor` when given (its overload
    # with a Tensor lr): read by the kernel on the device, so a CUDA graph replays the current
    # value (fastllm/ops/_lr.py).
    "adamw_step": (
        "adamw_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] max_exp_avg_sqs, Tensor[] steps, *, float lr, "
        "float beta1, float beta2, float eps, float weight_decay, bool amsgrad, bool maximize, "
        "Tensor? grad_scale=None, Tensor? found_inf=None, Tensor? lr_tensor=None) -> ()"
    ),
    # Mixed-precision AdamW over many bf16/fp16 params with fp32 states: on fp32 masters (masters
    # non-empty) or on the params themselves (pure bf16, optional Kahan compensation buffers).
    # Grads are read and multiplied by clip_coef / grad_scale; see fastllm/ops/adamw_master.py.
    "adamw_master_step": (
        "adamw_master_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] masters, "
        "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] kahan_comps, "
        "Tensor[] steps, *, float lr, float beta1, float beta2, float eps, float weight_decay, "
        "bool maximize=False, bool stochastic_rounding=False, int seed=0, "
        "Tensor? grad_scale=None, Tensor? clip_coef=None, Tensor? found_inf=None, "
        "Tensor? lr_tensor=None) -> ()"
    ),
    # sqrt of the sum of squares over every element of many tensors, as a 0-dim fp32 tensor;
    # non-finite when any element is inf or nan. See fastllm/ops/l2norm.py.
    "l2norm": "l2norm(Tensor[] tensors) -> Tensor",
    # y = x W^T + bias + scaling * dropout(x) A^T B^T, and xa_t = A dropout(x)^T, (r, rows of x),
    # which the backward reads. seed: int64 scalar tensor, the dropout mask's key (on x's GPU for
    # GPU tensors: the Triton kernels read it there).
    "lora_linear": (
        "lora_linear(Tensor x, Tensor weight, Tensor lora_a, Tensor lora_b, float scaling, "
        "Tensor? bias, float dropout_p, Tensor seed) -> (Tensor, Tensor)"
    ),
    # (grad_x, grad_lora_a, grad_lora_b) of lora_linear; an output whose output_mask entry is
    # False comes back empty.
    "lora_linear_backward": (
        "lora_linear_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor lora_a, "
        "Tensor lora_b, Tensor xa_t, float scaling, float dropout_p, Tensor seed, "
        "bool[] output_mask) -> (Tensor, Tensor, Tensor)"
    ),
    # a 4-bit NF4 tensor of `shape` (two codes a byte, one fp32 absmax per block) in `dtype`;
    # see fastllm/ops/nf4.py.
    "nf4_dequantize": (
        "nf4_dequantize(Tensor packed, Tensor absmax, int[] shape, int blocksize, "
        "ScalarType dtype) -> Tensor"
    ),
    "nf4_dequantize_into": (
        "nf4_dequantize_into(Tensor(a!) out, Tensor packed, Tensor absmax, int blocksize) -> ()"
    ),
    # dst[i] = src[i] * (scale / divisor) in fp32, rounded into dst[i]'s dtype; pairs of equal
    # numel. The pack/unpack and wire cast of fastllm.distributed; see fastllm/ops/scaled_copy.py.
    "scaled_copy": (
        "scaled_copy(Tensor(a!)[] dst, Tensor[] src, float scale, Tensor? divisor=None) -> ()"
    ),
    # PowerSGD and GaLore (fastllm/ops/orthogonalize.py, powersgd_decompress.py,
    # galore_adam_step.py) ---
    # Gram-Schmidt on the columns of each (n, r) matrix, in place (torch's powerSGD_hook order).
    "orthogonalize": "orthogonalize(Tensor(a!)[] matrices, float epsilon=0.0) -> ()",
    # error = M - P Q_local^T (errors and local_qs may be empty); M = scale * P Q^T. Per matrix.
    "powersgd_decompress": (
        "powersgd_decompress(Tensor(a!)[] matrices, Tensor[] ps, Tensor[] qs, "
        "Tensor[] local_qs, Tensor(b!)[] errors, float scale) -> ()"
    ),
    # One GaLore AdamW step of a 2-D param with an orthonormal projector (left or right).
    "galore_adam_step": (
        "galore_adam_step(Tensor(a!) param, Tensor grad, Tensor proj, Tensor(b!) exp_avg, "
        "Tensor(c!) exp_avg_sq, *, float step, bool left, float lr, float beta1, float beta2, "
        "float eps, float weight_decay, float scale) -> ()"
    ),
    # AdamW with 8-bit block-quantised or bf16 moments (fastllm/ops/adamw8bit.py)
    "adamw8bit_step": (
        "adamw8bit_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] masters, "
        "Tensor(c!)[] exp_avgs, Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] exp_avg_absmaxes, "
        "Tensor(f!)[] exp_avg_sq_absmaxes, Tensor[] steps, Tensor qmaps, *, float lr, "
        "float beta1, float beta2, float eps, float weight_decay, int block_size=256, "
        "bool maximize=False, bool stochastic_rounding=False, int seed=0, "
        "Tensor? grad_scale=None, Tensor? clip_coef=None, Tensor? found_inf=None, "
        "Tensor? lr_tensor=None) -> ()"
    ),
    # Cross-entropy of hidden weight^T + bias over chunks of tokens (fastllm/ops/
    # fused_linear_cross_entropy.py): (loss, grad_hidden, grad_weight, grad_bias), the grads of
    # the loss computed in the same pass for the True entries of grad_mask ([hidden, weight,
    # bias]; "mean"/"sum" only), else empty. logit_softcap 0: none. Its autograd's backward
    # scales those grads by grad_loss in place and hands them out: a caller of the op itself who
    # keeps them sees them scaled after a backward.
    "fused_linear_cross_entropy": (
        "fused_linear_cross_entropy(Tensor hidden, Tensor weight, Tensor labels, Tensor? bias, "
        "int ignore_index, str reduction, float label_smoothing, float z_loss, "
        "float logit_softcap, bool[] grad_mask) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
    # (grad_hidden, grad_weight, grad_bias) for grad_loss (0-d, or labels' shape for "none"),
    # recomputing the logits chunk by chunk; empty where grad_mask is False.
    "fused_linear_cross_entropy_backward": (
        "fused_linear_cross_entropy_backward(Tensor grad_loss, Tensor hidden, Tensor weight, "
        "Tensor labels, Tensor? bias, int ignore_index, str reduction, float label_smoothing, "
        "float z_loss, float logit_softcap, bool[] grad_mask) -> (Tensor, Tensor, Tensor)"
    ),
    # Model ops (fastllm/ops/rms_norm.py, rotary_embedding.py, attention.py, swiglu.py) ---
    # RMSNorm: (y, rstd); rstd (rows of x,) fp32 (fp64 for fp64 x) is what the backward reads.
    "rms_norm": "rms_norm(Tensor x, Tensor weight, float eps, float offset=0.0) -> (Tensor, Tensor)",
    "rms_norm_backward": (
        "rms_norm_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor rstd, float offset, "
        "bool[] output_mask) -> (Tensor, Tensor)"
    ),
    # Rotate-half rotary embedding of q (B, S, Hq, D) and k (B, S, Hk, D) together.
    "rotary_embedding": (
        "rotary_embedding(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? position_ids=None) "
        "-> (Tensor, Tensor)"
    ),
    "rotary_embedding_backward": (
        "rotary_embedding_backward(Tensor grad_q, Tensor grad_k, Tensor cos, Tensor sin, "
        "Tensor? position_ids=None) -> (Tensor, Tensor)"
    ),
    "rotary_embedding_": (
        "rotary_embedding_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin, "
        "Tensor? position_ids=None) -> ()"
    ),
    # Causal attention of q (B, T, Hq, D) over k, v (B, T, Hkv, D), query t attending keys
    # doc_start[b, t] <= j <= t (fastllm/ops/attention.py): (out, lse (B, Hq, T) fp32).
    "attention": (
        "attention(Tensor q, Tensor k, Tensor v, Tensor? doc_start, float scale) "
        "-> (Tensor, Tensor)"
    ),
    "attention_backward": (
        "attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
        "Tensor lse, Tensor? doc_start, float scale) -> (Tensor, Tensor, Tensor)"
    ),
    # silu(gate) * up; the backward recomputes sigmoid(gate), and with need_h the product
    # silu(gate) * up itself in the same pass (swiglu_linear's weight grad reads it), else an
    # empty tensor.
    "swiglu": "swiglu(Tensor gate, Tensor up) -> Tensor",
    "swiglu_backward": (
        "swiglu_backward(Tensor grad_out, Tensor gate, Tensor up, bool need_h=False) "
        "-> (Tensor, Tensor, Tensor)"
    ),
    # gelu(gate, approximate="tanh") * up (Gemma's GeGLU), its backward as swiglu_backward's.
    "geglu": "geglu(Tensor gate, Tensor up) -> Tensor",
    "geglu_backward": (
        "geglu_backward(Tensor grad_out, Tensor gate, Tensor up, bool need_h=False) "
        "-> (Tensor, Tensor, Tensor)"
    ),
    # x weight^T + bias, computed in fp32 for bf16/fp16 on CPUs without a native low-precision
    # GEMM (fastllm/ops/linear.py, fastllm/_lowp.py); (dx, dweight, dbias), empty where
    # output_mask is False.
    "linear": "linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor",
    "linear_backward": (
        "linear_backward(Tensor grad_out, Tensor x, Tensor weight, bool[] output_mask) "
        "-> (Tensor, Tensor, Tensor)"
    ),
}

for _schema in SCHEMAS.values():
    lib.define(_schema)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def plain_eager(args):
    """Whether a call with these arguments may skip the dispatcher: eager code (not traced by
    torch.compile, no dispatch or function mode such as FakeTensor or FlopCounter, no functorch
    transform, no torch.jit.trace, which would record the kernels' surroundings without them) on
    plain tensors (not DTensor or another subclass). The dispatcher's Python round trip (boxing,
    default filling, the autograd redispatch) cost a patched model's step more than its GPU
    kernels saved: on an H200, fastllm's kernels took 59 ms of a 198 ms step (2026-12-04)."""
    if _backend.intercepted() or torch._C._are_functorch_transforms_active():
        return False
    # a negated or conjugated view (x._neg_view(), z.conj().imag) goes through torch.ops too:
    # the dispatcher's fallbacks hand the kernels its values, which read raw memory; and a meta
    # tensor (a model built under torch.device("meta")), which has none: its fake kernel runs
    # (a loop, not all() over a generator: this runs on every op call of a patched step)
    for a in args:
        if isinstance(a, torch.Tensor) and (type(a) not in _PLAIN or a.is_neg() or a.is_conj()
                                            or a.is_meta):
            return False
    return True


def direct_op(name, impl):
    """torch.ops.fastllm.<name> as a function that calls `impl` (its implementation, the same on
    every device) directly in plain eager code: for the ops without autograd of their own (the
    backward ops). Arguments: every schema argument, positionally."""
    packet = getattr(torch.ops.fastllm, name)

    def call(*args):
        return impl(*args) if plain_eager(args) else packet(*args)

    call.__name__ = name
    return call


def remember_backend(ctx):
    """In a forward (or setup_context): keep the backend forced on this thread for the backward
    (on_forward_backend), which autograd may run on another thread."""
    ctx.fastllm_backend = _backend.thread_backend()


def on_forward_backend(backward):
    """Decorator for a backward(ctx, *grads) whose forward called remember_backend(ctx): it runs
    under the backend forced around that forward."""
    @functools.wraps(backward)
    def run(ctx, *grads):
        name = getattr(ctx, "fastllm_backend", None)
        if name is None:
            return backward(ctx, *grads)
        with _backend.use_backend(name):
            return backward(ctx, *grads)

    return run


def register_autograd(op, backward, *, setup_context, impl, materialize_grads=True):
    """torch.library.register_autograd for a fastllm op, whose backward then runs on the backend
    forced around its forward: fastllm.use_backend holds for one thread, and autograd runs the
    backward of CUDA tensors on a device thread of its own, where the forward's choice was lost
    (a forward forced to ref had its backward on Triton; seen on an H200, 2026-12-04).

    impl: the op's implementation (the same on every device). Returns a function that calls the
    op with every schema argument, positionally: in plain eager code (plain_eager) through an
    autograd.Function of the same forward, setup_context and backward, without the dispatcher
    (the custom op's own autograd is that Function behind two dispatches); otherwise through
    torch.ops (torch.compile, modes, DTensor).

    materialize_grads=False: on the eager path the backward gets None, not zeros, for outputs
    without a gradient: for ops whose extra outputs are non-differentiable (RMSNorm's rstd, the
    attention's lse, LoRA's xa, the fused loss's precomputed grads), whose zeros autograd
    would otherwise allocate and fill on every backward, only to be ignored (the fused loss's
    included a weight-sized tensor). Such an op has one differentiable output, whose grad its
    backward reads and which is defined whenever the backward runs."""
    def setup(ctx, inputs, output):
        remember_backend(ctx)
        setup_context(ctx, inputs, output)

    run_backward = on_forward_backend(backward)
    torch.library.register_autograd(op, run_backward, setup_context=setup)
    packet = getattr(torch.ops.fastllm, op.split("::", 1)[1])

    def forward(ctx, *args):
        if not materialize_grads:
            ctx.set_materialize_grads(False)
        out = impl(*args)
        setup(ctx, args, out)
        return out

    def backward_or_none(ctx, *grads):
        # with no output grad at all (gradcheck's undefined-grad check, a grad of zeros), the
        # inputs' grads are zero: None, without running the backward
        if all(g is None for g in grads):
            return (None,) * len(ctx.needs_input_grad)
        return run_backward(ctx, *grads)

    direct = type(f"Direct_{packet.__name__}", (torch.autograd.Function,), {
        "forward": staticmethod(forward),
        "backward": staticmethod(run_backward if materialize_grads else backward_or_none)})

    def call(*args):
        if not plain_eager(args):
            return packet(*args)
        if torch.is_grad_enabled():
            for a in args:
                if isinstance(a, torch.Tensor) and a.requires_grad:
                    return direct.apply(*args)
        return impl(*args)

    call.__name__ = packet.__name__
    return call


def first_order_only(where):
    """Decorator for the backward of a fastllm op whose gradients come from kernels (C++,
    Triton, a backward op with no derivative of its own, or grads computed in the forward):
    under create_graph=True, with an input that needs a gradient, it raises, naming the op. Such
    gradients have no graph back to the inputs, so a second derivative through them would be
    silently zero or wrong (a backward op without autograd only warned). where: the op's name,
    or a function of ctx giving it (one autograd.Function serving several ops)."""

    def wrap(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            # grad mode is on inside a backward only under create_graph=True
            if torch.is_grad_enabled() and any(ctx.needs_input_grad):
                name = where(ctx) if callable(where) else where
                raise RuntimeError(
                    f"{name}: double backward (create_graph=True) is not supported: its "
                    "backward runs fastllm's kernels, which have no derivative of their own; "
                    "use the plain-PyTorch module or <op>_ref where second derivatives are "
                    "needed")
            return backward(ctx, *grads)

        return wrapper

    return wrap
