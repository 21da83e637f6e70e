"""fastllm::adamw_master_step: AdamW for bf16/fp16 params with fp32 states, in one fused pass.

    adamw_master_step(params, grads, masters, exp_avgs, exp_avg_sqs, kahan_comps, steps, *,
                      lr, beta1, beta2, eps, weight_decay, maximize=False,
                      stochastic_rounding=False, seed=0, grad_scale=None, clip_coef=None,
                      found_inf=None)

`lr`: a float or a one-element tensor (read on the device by the GPU kernels: the op's
`lr_tensor` argument; fastllm/ops/_lr.py).

Per element, with step t (torch.optim.AdamW's maths, decoupled weight decay):
    g  = grad * clip_coef / grad_scale          (negated when maximize)
    x  = master                                 (masters given: fp32 master weights)
       | param + kahan_comp                     (kahan_comps given: pure bf16, Kahan summation)
       | param                                  (neither: pure bf16)
    x  = x * (1 - lr * weight_decay)
    m  = lerp(m, g, 1 - beta1);   v = beta2 * v + (1 - beta2) * g^2
    x  = x - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
    master = x;   param = round(x);   kahan_comp = round(x - param)

round() is round-to-nearest-even, or with stochastic_rounding=True rounds up with probability
equal to the fraction dropped, so its mean is exact. The random bits are a function
of (seed, tensor index, element index): the same call with the same seed writes the same bits on
one backend. The backends do NOT draw the same bits: cpp and cuda share one hash (lowbias32 of
seed and element index), triton uses Philox (`tl.randint`), ref a torch.Generator. Each is
unbiased with the same distribution (tests check the mean and the rounding probabilities), so
runs on different backends agree statistically, not bitwise.

Shapes and dtypes: at every index i, params[i] and grads[i] are bf16 or fp16 (one dtype per
call); masters[i] (empty list, or one per param) and exp_avgs[i], exp_avg_sqs[i] are fp32;
kahan_comps[i] (empty list, or one per param, only without masters) has the params' dtype; all
share numel, device, and are dense and contiguous. steps[i] is the step count, already
incremented. grad_scale, clip_coef and found_inf are one-element floating-point tensors
(found_inf may be bool) on the params' device (read there) or the CPU; nothing changes when
found_inf is nonzero.

Backends: cpp (CPU), cuda and triton (GPU; triton on CPU under TRITON_INTERPRET=1), and
`adamw_master_step_ref`, plain PyTorch.
"""

import math

import torch

from fastllm import _backend, _extension
from fastllm._library import lib
from fastllm.ops._overlap import labelled, refuse_overlap
from fastllm.ops._lr import check_lr_tensor, for_backend, ieee_div, split_lr
from fastllm.ops._scalar_args import check_scalar_args
from fastllm.ops.adamw import check_step_values, check_steps

_PREFERENCE = {"cpu": ("cpp", "ref"), "cuda": ("cuda", "triton", "ref")}

LOW_PRECISION = (torch.bfloat16, torch.float16)


def stochastic_round_ref(x, dtype, generator):
    """Round fp32 `x` to bf16 or fp16 stochastically: up with probability equal to the fraction
    of an ulp that rounding down drops, so the mean is x.

    bf16: add 16 random bits below bf16's last bit and truncate. fp16: pick between the two
    neighbours lo <= |x| < hi with probability (|x| - lo) / (hi - lo), compared exactly against
    24 random bits. nan and values that round to inf keep round-to-nearest's result.
    """
    x = x.to(torch.float32)
    if dtype == torch.bfloat16:
        bits = x.view(torch.int32)
        noise = torch.randint(0, 1 << 16, x.shape, dtype=torch.int32, device=x.device,
                              generator=generator)
        rounded = ((bits + noise) & -65536).view(torch.float32)
        # An inf (from a finite x above bf16's largest value) and nan: round to nearest instead.
        return torch.where(torch.isinf(rounded) | torch.isnan(x), x, rounded).to(dtype)
    if dtype != torch.float16:
        raise NotImplementedError(f"fastllm: stochastic rounding to {dtype} is not implemented")
    rn = x.to(torch.float16)
    bits = rn.view(torch.int16).to(torch.int32) & 0xFFFF
    ax, arn = x.abs(), rn.float().abs()
    below = arn < ax
    other = (torch.where(below, bits + 1, bits - 1) & 0xFFFF)
    other = torch.where(other >= 32768, other - 65536, other).to(torch.int16).view(torch.float16)
    lo = torch.where(below, rn, other)
    hi = torch.where(below, other, rn)
    alo = lo.float().abs()
    ulp = hi.float().abs() - alo
    noise = torch.randint(0, 1 << 24, x.shape, dtype=torch.int32, device=x.device,
                          generator=generator).float()
    up = noise * ulp < (ax - alo) * 16777216.0
    keep = (arn == ax) | torch.isinf(arn) | torch.isnan(x)
    return torch.where(keep, rn, torch.where(up, hi, lo))


def adamw_master_step_ref(
    params, grads, masters, exp_avgs, exp_avg_sqs, kahan_comps, steps, *, lr, beta1, beta2, eps,
    weight_decay, maximize=False, stochastic_rounding=False, seed=0, grad_scale=None,
    clip_coef=None, found_inf=None,
):
    """Plain-PyTorch step: the oracle and the fallback (`lr` may be a one-element tensor).

    Computes in the masters' dtype (the exp_avgs' when there are no masters): fp32 normally, fp64
    when a test hands it fp64 masters and states to get a float64 reference step.
    """
    if found_inf is not None and bool(found_inf.item()):
        return
    lr = float(lr) if isinstance(lr, torch.Tensor) else lr
    mult = 1.0
    if grad_scale is not None:
        mult = ieee_div(mult, grad_scale)
    if clip_coef is not None:
        mult *= float(clip_coef)
    generator = None
    if stochastic_rounding and params:
        generator = torch.Generator(device=params[0].device)
        generator.manual_seed(seed & ((1 << 63) - 1))
    for i, param in enumerate(params):
        opmath = masters[i].dtype if masters else exp_avgs[i].dtype
        g = grads[i].to(opmath) * mult
        if maximize:
            g = -g
        if masters:
            x = masters[i].to(opmath, copy=True)
        elif kahan_comps:
            x = param.to(opmath) + kahan_comps[i].to(opmath)
        else:
            x = param.to(opmath, copy=True)
        m = exp_avgs[i].to(opmath, copy=True)
        v = exp_avg_sqs[i].to(opmath, copy=True)
        step = float(steps[i])
        bias_correction1 = 1.0 - beta1**step
        bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
        x.mul_(1.0 - lr * weight_decay)
        m.lerp_(g, 1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        x.addcdiv_(m, denom, value=-lr / bias_correction1)
        if stochastic_rounding:
            p_new = stochastic_round_ref(x, param.dtype, generator)
        else:
            p_new = x.to(param.dtype)
        if masters:
            masters[i].copy_(x)
        if kahan_comps:
            kahan_comps[i].copy_((x - p_new.to(opmath)).to(param.dtype))
        param.copy_(p_new)
        exp_avgs[i].copy_(m)
        exp_avg_sqs[i].copy_(v)


def _compiled(name):
    def run(params, grads, masters, exp_avgs, exp_avg_sqs, kahan_comps, steps, *, lr, beta1,
            beta2, eps, weight_decay, maximize, stochastic_rounding, seed, grad_scale, clip_coef,
            found_inf, lr_tensor=None):
        fn = getattr(_extension.extension(), name, None)
        if fn is None:
            raise NotImplementedError(f"fastllm.adamw_master_step: fastllm._C has no {name}; "
                                      f"rebuild it (pip install --no-build-isolation -e .)")
        extra = (lr_tensor,) if name.endswith("_cuda") else ()  # (the CPU kernel: never)
        fn(params, grads, masters, exp_avgs, exp_avg_sqs, kahan_comps, steps, lr, beta1, beta2,
           eps, weight_decay, maximize, stochastic_rounding, seed, grad_scale, clip_coef,
           found_inf, *extra)

    return run


def _adamw_master_step_triton(*args, **kwargs):
    from fastllm.kernels.adamw_master import adamw_master_step_triton

    adamw_master_step_triton(*args, **kwargs)


_IMPLS = {
    "ref": adamw_master_step_ref,
    "cpp": _compiled("adamw_master_step_cpu"),
    "triton": _adamw_master_step_triton,
    "cuda": _compiled("adamw_master_step_cuda"),
}


def check_adamw_master_args(params, grads, masters, exp_avgs, exp_avg_sqs, kahan_comps, steps, *,
                            lr, beta1, beta2, eps, weight_decay, lr_tensor=None,
                            grad_scale=None, clip_coef=None, found_inf=None):
    """Raise ValueError/TypeError naming the first bad argument; touches nothing."""
    where = "fastllm.adamw_master_step"
    check_lr_tensor(where, lr_tensor, params[0].device if params else None)
    check_scalar_args(where, params[0].device if params else None, grad_scale=grad_scale,
                      clip_coef=clip_coef, found_inf=found_inf)
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{where}: {name} must be finite and >= 0, got {value}")
    for name, value in (("beta1", beta1), ("beta2", beta2)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{where}: {name} must be in [0, 1), got {value}")
    n = len(params)
    if masters and kahan_comps:
        raise ValueError(f"{where}: Kahan compensation is for training without master weights; "
                         f"pass masters or kahan_comps, not both")
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs, "steps": steps}
    if masters:
        lists["masters"] = masters
    if kahan_comps:
        lists["kahan_comps"] = kahan_comps
    for name, lst in lists.items():
        if len(lst) != n:
            raise ValueError(f"{where}: {name} has {len(lst)} tensors, params has {n}")
    if n == 0:
        return
    device = params[0].device
    dtype = params[0].dtype
    if dtype not in LOW_PRECISION:
        raise TypeError(f"{where}: params must be bfloat16 or float16, got {dtype}; fp32 params "
                        f"take fastllm.ops.adamw_step")
    expected = {"params": dtype, "grads": dtype, "masters": torch.float32,
                "exp_avgs": torch.float32, "exp_avg_sqs": torch.float32, "kahan_comps": dtype}
    for i, p in enumerate(params):
        for name, lst in (("params", params),) + tuple(
            (k, v) for k, v in lists.items() if k != "steps"
        ):
            t = lst[i]
            at = f"{where}: {name}[{i}]"
            if t.layout != torch.strided:
                raise TypeError(f"{at} is {t.layout}; only dense tensors are supported")
            if t.dtype != expected[name]:
                raise TypeError(f"{at} has dtype {t.dtype}, expected {expected[name]}")
            if t.device != device:
                raise ValueError(f"{at} is on {t.device}, params[0] on {device}")
            if t.shape != p.shape:
                raise ValueError(f"{at} has shape {tuple(t.shape)}, params[{i}] has "
                                 f"{tuple(p.shape)}")
            if not t.is_contiguous():
                raise ValueError(f"{at} is not contiguous; call .contiguous() first")
    check_steps(where, steps, device)


def _adamw_master_step_impl(params, grads, masters, exp_avgs, exp_avg_sqs, kahan_comps, steps, *,
                            lr, beta1, beta2, eps, weight_decay, maximize=False,
                            stochastic_rounding=False, seed=0, grad_scale=None, clip_coef=None,
                            found_inf=None, lr_tensor=None):
    if not _backend.prevalidated():
        check_adamw_master_args(params, grads, masters, exp_avgs, exp_avg_sqs, kahan_comps,
                                steps, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                                weight_decay=weight_decay, lr_tensor=lr_tensor,
                                grad_scale=grad_scale, clip_coef=clip_coef, found_inf=found_inf)
        check_step_values("fastllm.adamw_master_step", steps)
        refuse_overlap("fastllm.adamw_master_step", labelled(
            params=params, masters=masters, exp_avgs=exp_avgs, exp_avg_sqs=exp_avg_sqs,
            kahan_comps=kahan_comps), labelled(grads=grads, steps=steps))
    if not params:
        return
    device_type = params[0].device.type
    backend = _backend.select("adamw_master_step", device_type,
                              _PREFERENCE.get(device_type, ("ref",)))
    lr, lr_tensor = for_backend(lr, lr_tensor, backend, params[0].device)
    kwargs = {} if lr_tensor is None else {"lr_tensor": lr_tensor}
    with _backend.device_guard(params[0].device):
        _IMPLS[backend](
            params, grads, masters, exp_avgs, exp_avg_sqs, kahan_comps, steps, lr=lr,
            beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, maximize=maximize,
            stochastic_rounding=stochastic_rounding, seed=seed, grad_scale=grad_scale,
            clip_coef=clip_coef, found_inf=found_inf, **kwargs,
        )


lib.impl("adamw_master_step", _adamw_master_step_impl, "CPU")
lib.impl("adamw_master_step", _adamw_master_step_impl, "CUDA")


@torch.library.register_fake("fastllm::adamw_master_step")
def _adamw_master_step_fake(params, grads, masters, exp_avgs, exp_avg_sqs, kahan_comps, steps, *,
                            lr, beta1, beta2, eps, weight_decay, maximize=False,
                            stochastic_rounding=False, seed=0, grad_scale=None, clip_coef=None,
                            found_inf=None, lr_tensor=None):
    check_lr_tensor("fastllm.adamw_master_step", lr_tensor,
                    params[0].device if params else None)
    check_scalar_args("fastllm.adamw_master_step", params[0].device if params else None,
                      grad_scale=grad_scale, clip_coef=clip_coef, found_inf=found_inf)
    if params:  # (as adamw_step's fake: a step on the meta device dispatches here)
        check_steps("fastllm.adamw_master_step", steps, params[0].device)


def adamw_master_step(params, grads, masters, exp_avgs, exp_avg_sqs, kahan_comps, steps, *, lr,
                      beta1, beta2, eps, weight_decay, maximize=False, stochastic_rounding=False,
                      seed=0, grad_scale=None, clip_coef=None, found_inf=None):
    """Functional form of the op (see the module docstring); a no-op for empty lists. `lr`: a
    float or a one-element tensor."""
    if len(params) == 0:
        return
    lr, lr_tensor = split_lr(lr)
    if _backend.direct(params, grads, masters, exp_avgs, exp_avg_sqs):  # (torch.ops skipped)
        _adamw_master_step_impl(
            params, grads, masters, exp_avgs, exp_avg_sqs, kahan_comps, steps, lr=lr,
            beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, maximize=maximize,
            stochastic_rounding=stochastic_rounding, seed=int(seed), grad_scale=grad_scale,
            clip_coef=clip_coef, found_inf=found_inf, lr_tensor=lr_tensor,
        )
        torch.autograd.graph.increment_version(params)
        return
    torch.ops.fastllm.adamw_master_step(
        params, grads, masters, exp_avgs, exp_avg_sqs, kahan_comps, steps, lr=lr, beta1=beta1,
        beta2=beta2, eps=eps, weight_decay=weight_decay, maximize=maximize,
        stochastic_rounding=stochastic_rounding, seed=int(seed), grad_scale=grad_scale,
        clip_coef=clip_coef, found_inf=found_inf, lr_tensor=lr_tensor,
    )
