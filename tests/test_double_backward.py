"""Second derivatives through fastllm's fused ops: refused, naming the op.

Their backwards run kernels with no derivative of their own (C++/Triton, backward ops without
autograd, grads computed in the forward), so gradients taken with create_graph=True have no graph
back to the inputs. Before, differentiating them again only warned and gave wrong numbers
(rms_norm's second derivative 280 off in fp64 on a 4 x 8 input, swiglu's 44,000) or silently
none at all (the fused loss with reduction="mean")."""

import pytest
import torch

from fastllm import _lowp
from fastllm.ops import (attention, fused_linear_cross_entropy, linear, lora_linear, rms_norm,
                         rotary_embedding, swiglu)
from fastllm.ops.lora_linear_multi import lora_linear_multi
from fastllm.ops.swiglu import geglu, geglu_linear, swiglu_linear


def _leaf(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype).requires_grad_()


def _cases():
    x, w, W = _leaf(3, 8), _leaf(8), _leaf(5, 8)
    a, b = _leaf(2, 8), _leaf(5, 2)
    q, k, v = _leaf(1, 4, 2, 8), _leaf(1, 4, 1, 8), _leaf(1, 4, 1, 8)
    cos, sin = torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    labels = torch.tensor([1, 4, 0])
    bq, bk, bv = (t.detach().to(torch.bfloat16).transpose(1, 2).requires_grad_()
                  for t in (q, k, v))
    return {
        "fastllm.rms_norm": (lambda: rms_norm(x, w), [x, w]),
        "fastllm.swiglu": (lambda: swiglu(x, x * 2), [x]),
        "fastllm.swiglu_linear": (lambda: swiglu_linear(x, x * 2, W), [x, W]),
        "fastllm.geglu": (lambda: geglu(x, x * 2), [x]),
        "fastllm.geglu_linear": (lambda: geglu_linear(x, x * 2, W), [x, W]),
        "fastllm.linear": (lambda: linear(x, W), [x, W]),
        "fastllm.lora_linear": (lambda: lora_linear(x, W.detach(), a, b, 2.0), [x, a]),
        "fastllm.lora_linear_multi": (
            lambda: torch.cat(lora_linear_multi(x, [W.detach()], [a], [b], [2.0]), -1), [x, a]),
        "fastllm.rotary_embedding": (
            lambda: torch.cat([t.flatten() for t in rotary_embedding(q, k, cos, sin)]), [q]),
        "fastllm.attention": (lambda: attention(q, k, v), [q, k, v]),
        "fastllm.fused_linear_cross_entropy": (  # grads computed in the forward ("mean")
            lambda: fused_linear_cross_entropy(x, W, labels), [x, W]),
        "fastllm.fused_linear_cross_entropy.none": (
            lambda: fused_linear_cross_entropy(x, W, labels, reduction="none"), [x, W]),
        "fastllm.patch's widened attention": (
            lambda: _lowp.scaled_dot_product_attention(bq, bk, bv, is_causal=True),
            [bq, bk, bv]),
    }


CASES = list(_cases())


@pytest.mark.parametrize("name", CASES)
def test_first_order_grads_with_create_graph_are_refused_by_name(name):
    torch.manual_seed(0)
    fn, inputs = _cases()[name]
    out = fn().float().square().sum()
    torch.autograd.grad(out, inputs)  # first order: fine
    with pytest.raises(RuntimeError, match=name.split(".none")[0] + ".*double backward"):
        torch.autograd.grad(fn().float().square().sum(), inputs, create_graph=True)

