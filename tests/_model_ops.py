"""Shared checks for the model-op tests (test_rms_norm.py, test_rotary_embedding.py,
test_swiglu.py, test_patch.py): the house tolerance rule in one place.

fp32: within 1e-5 of the fp64 oracle relative to its largest magnitude (1e-4 for gradients).
bf16/fp16: the error against the fp64 oracle at most twice PyTorch's own (what a user would run:
the Hugging Face module or plain torch in that dtype)."""

import math
import sys

import torch


def check_close(name, got, torch_lp, oracle, dtype, fp32_rtol=1e-5):
    oracle = oracle.double()
    scale = oracle.abs().max().item() + 1e-30
    err = (got.double() - oracle).abs().max().item()
    if dtype in (torch.float32, torch.float64):
        assert err <= fp32_rtol * scale, f"{name}: error {err:.3g} vs scale {scale:.3g}"
    else:
        torch_err = (torch_lp.double() - oracle).abs().max().item()
        # The floor, one ulp of the largest magnitude, matters only on a tiny tensor where
        # PyTorch happens to land near the exact value: rounding the inputs (the oracle has them
        # exact) and the output alone can cost one element that much (a 2-element bf16 rotary on
        # an H200: 0.75 ulp against PyTorch's 0.35, 2026-12-04); over many elements PyTorch's
        # own error reaches half an ulp and twice it is the bound.
        ulp = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(scale))
        bound = max(2.0 * torch_err, ulp)
        assert err <= bound, f"{name}: error {err:.3g} > 2 x PyTorch's {torch_err:.3g}"


def grads(outputs, inputs, grad_outputs):
    """[outputs..., d inputs...] of sum(outputs . grad_outputs)."""
    outputs = list(outputs)
    return outputs + list(torch.autograd.grad(outputs, inputs, grad_outputs))


def count_varlen_calls(monkeypatch, attention_module):
    """A list that grows by one per call of PyTorch's varlen attention through
    fastllm.ops.attention that returned: a refusal (caught there, SDPA instead) is not counted."""
    calls = []
    fn, params = attention_module._varlen_kernel()

    def counted(*a, **kw):
        out = fn(*a, **kw)
        calls.append(1)
        return out

    monkeypatch.setattr(attention_module, "_varlen_kernel", lambda: (counted, params))
    return calls


def has_attention_kernel():
    """Whether this build has fastllm's CPU attention kernel."""
    import fastllm

    return fastllm._extension.has_cpp() and hasattr(fastllm._extension.extension(),
                                                    "attention_cpu")


def count_attention_calls(monkeypatch):
    """A list that grows by one per call of fastllm's attention op from the patched layers."""
    attention_module = sys.modules["fastllm.ops.attention"]  # fastllm.ops.attention: the function
    calls, real = [], attention_module.attention
    monkeypatch.setattr(attention_module, "attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls
