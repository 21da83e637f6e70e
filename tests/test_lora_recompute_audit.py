"""LoRA dropout under recomputation: a checkpointed forward runs twice and must draw the same
mask both times (torch restores its RNG state for the recomputation, and lora_linear draws its
seed from torch's generator), while two ordinary forwards draw different masks and eval() draws
none. CPU, fp32, a single LoRALinear and a tiny patched Llama."""

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import fastllm
from fastllm.lora import LoRALinear, inject_lora

transformers = pytest.importorskip("transformers")


def _layer(p):
    torch.manual_seed(0)
    layer = LoRALinear(nn.Linear(16, 24), r=4, alpha=8, dropout=p).train()
    nn.init.normal_(layer.lora_B)  # B = 0 would give A no gradient to compare
    return layer


def _grads(layer, fn, params, x_shape, seed=7):
    """(dX, *dparams) of sum(fn(x)^2) with torch seeded `seed` just before the forward."""
    for q in params:
        q.grad = None
    x = torch.randn(*x_shape, generator=torch.Generator().manual_seed(5), requires_grad=True)
    torch.manual_seed(seed)
    fn(x).square().sum().backward()
    return [x.grad.clone()] + [q.grad.clone() for q in params]


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_checkpointed_layer_repeats_its_mask(use_reentrant):
    layer = _layer(0.3)
    params = [layer.lora_A, layer.lora_B]
    plain = _grads(layer, layer, params, (3, 16))
    ckpt = _grads(layer, lambda x: checkpoint(layer, x, use_reentrant=use_reentrant), params,
                  (3, 16))
    for a, b in zip(ckpt, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
    # not frozen: another seed, another mask, other gradients
    other = _grads(layer, layer, params, (3, 16), seed=8)
    assert not torch.allclose(other[1], plain[1])


def test_eval_and_zero_dropout_draw_no_mask():
    x = torch.randn(3, 16)
    layer, same = _layer(0.5), _layer(0.0)
    train_y = layer(x)
    assert not torch.equal(train_y, layer(x))  # two training forwards, two masks
    layer.eval()
    torch.testing.assert_close(layer(x), same(x), rtol=0, atol=0)


def test_patched_llama_checkpointed_matches_plain():
    from fastllm.parallel.tensor_parallel import apply_activation_checkpointing

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                   attn_implementation="eager")
    plain = transformers.LlamaForCausalLM(cfg)
    inject_lora(plain, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"], r=4, alpha=8, dropout=0.2)
    for m in plain.modules():
        if isinstance(m, LoRALinear):
            nn.init.normal_(m.lora_B, std=0.1)
    plain.train()
    ckpt = fastllm.patch(copy.deepcopy(plain))
    assert apply_activation_checkpointing(ckpt) == 1

    def grads(model):
        trained = [q for q in model.parameters() if q.requires_grad]
        return _grads(model, lambda x: model(inputs_embeds=x).logits, trained, (1, 5, 64))

    for a, b in zip(grads(ckpt), grads(plain), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
