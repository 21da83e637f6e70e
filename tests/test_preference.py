"""fastllm.preference: per-token and per-sequence log-probabilities without logits against the
materialised log_softmax (and against TRL's fused LM head where trl is installed), DPO's losses
against the papers' formulas written out here, and fastllm.lora.disable_adapters as DPO's
reference model."""

import sys

import pytest
import torch
import torch.nn.functional as F

import fastllm
from fastllm.adapters import disable_adapters
from fastllm.bench.harness import allocator_peak_bytes
from fastllm.dora import inject_dora
from fastllm.lora import inject_lora, merge_lora
from fastllm.preference import (LOSS_TYPES, dpo_loss, sequence_logps, token_logps,
                                token_logps_ref)

from conftest import backend_device_params

_op_module = sys.modules["fastllm.ops.fused_linear_cross_entropy"]
BACKENDS = [p for p in backend_device_params() if p.values[0] != "cuda"]


def _model(seed=0, vocab=97):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=32))


def _pairs(vocab=97, pairs=3, length=11, seed=0):
    """2 x pairs rows (chosen first), right-padded: a 3-token prompt masked, completions of
    different lengths, padding masked and out of the attention."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2 * pairs, length), generator=g)
    mask = torch.ones_like(ids)
    for row in range(2 * pairs):
        mask[row, length - row % 4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100
    return ids, labels, mask


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_token_logps_matches_ref(backend, device, dtype, monkeypatch):
    monkeypatch.setattr(_op_module, "CHUNK_BYTES", 3 * 131 * 4)  # several chunks, a short last
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 9, 24, generator=g)
    weight = torch.randn(131, 24, generator=g) / 3
    bias = torch.randn(131, generator=g)
    labels = torch.randint(0, 131, (2, 9), generator=g)
    labels[:, ::4] = -100
    seed = torch.randn(2, 9, generator=g)  # a different upstream grad per token

    def run(fn, dt):
        ts = [t.to(device, dt).requires_grad_() for t in (hidden, weight, bias)]
        out = fn(*ts[:2], labels.to(device), ts[2])
        return [out.detach()] + list(torch.autograd.grad((out * seed.to(device)).sum(), ts))

    with fastllm.use_backend(backend):
        got = run(token_logps, dtype)
    oracle = run(token_logps_ref, torch.float64)
    torch_lp = run(token_logps_ref, dtype)
    assert (got[0].cpu()[labels == -100] == 0).all()
    for name, a, lp, o in zip(("logps", "hidden", "weight", "bias"), got, torch_lp, oracle):
        err = (a.double().cpu() - o.cpu()).abs().max().item()
        scale = o.abs().max().item()
        if dtype == torch.float32:
            assert err <= 1e-5 * scale, (name, err, scale)
        else:
            bound = 2 * (lp.double().cpu() - o.cpu()).abs().max().item() + 1e-6 * scale
            assert err <= bound, (name, err, bound)


def test_token_logps_never_hold_the_logits(monkeypatch):
    backend = "ref" if fastllm._backend.unavailable_reason("cpp", "cpu") else "cpp"
    monkeypatch.setattr(_op_module, "CHUNK_BYTES", 64 << 10)
    tokens, h, v = 512, 16, 4096
    hidden = torch.randn(tokens, h, requires_grad=True)
    weight = (torch.randn(v, h) / 4).requires_grad_()
    labels = torch.randint(0, v, (tokens,))

    def step(fn):
        def run():
            torch.autograd.grad(fn(hidden, weight, labels).sum(), [hidden, weight])
        return run

    with fastllm.use_backend(backend):
        ours = allocator_peak_bytes(step(token_logps))
    materialised = allocator_peak_bytes(step(token_logps_ref))
    assert materialised > tokens * v * 4  # the check can fail: the reference holds them
    assert ours < 2 * (tokens * h + v * h) * 4 + (1 << 20), ours


def _logits_way(model, ids, labels, mask, average=False):
    """What a plain loop does: the logits, log_softmax, gather, masked sum (or mean)."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
    target = labels[:, 1:]
    keep = target != -100
    logp = logits.log_softmax(-1).gather(-1, target.where(keep, 0).unsqueeze(-1)).squeeze(-1)
    total = (logp * keep).sum(-1)
    return total / keep.sum(-1) if average else total


@pytest.mark.parametrize("patched", [False, True], ids=["hf", "patched"])
@pytest.mark.parametrize("average", [False, True], ids=["sum", "mean"])
@pytest.mark.parametrize("head", ["frozen", "trained"])
def test_sequence_logps_and_grads_match_the_logits(patched, average, head):
    """A frozen head (LoRA) takes the op's one-pass path (grad_hidden made in the forward), a
    trained one the recomputing backward."""
    model = _model()
    inject_lora(model, target_modules=["q_proj", "v_proj", "down_proj"], r=4, alpha=8)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    model.lm_head.weight.requires_grad_(head == "trained")  # (untied here)
    ids, labels, mask = _pairs()
    expected = _logits_way(model, ids, labels, mask, average)
    expected.pow(2).sum().backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    if patched:
        fastllm.patch(model)
    got = sequence_logps(model, ids, labels, attention_mask=mask, average=average)
    got.pow(2).sum().backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    have = _grads(model)
    assert have.keys() == want.keys() and ("lm_head.weight" in have) == (head == "trained")
    for n in want:
        torch.testing.assert_close(have[n], want[n], rtol=1e-4, atol=1e-5, msg=n)


def test_sequence_logps_through_peft_and_hooks():
    peft = pytest.importorskip("peft")
    model = _model()
    ids, labels, mask = _pairs()
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    expected = _logits_way(wrapped, ids, labels, mask)
    torch.testing.assert_close(sequence_logps(wrapped, ids, labels, attention_mask=mask),
                               expected, rtol=1e-5, atol=1e-5)
    seen = []  # a hook on the head must run: the model's own forward takes over
    handle = model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    try:
        torch.testing.assert_close(sequence_logps(wrapped, ids, labels, attention_mask=mask),
                                   expected, rtol=1e-5, atol=1e-5)
    finally:
        handle.remove()
    assert seen


@pytest.mark.parametrize("family", ["cohere", "gpt2"])
def test_other_families_use_their_logits(family):
    """Cohere scales its logits (logit_scale) and GPT-2's backbone is `transformer`: models of
    families fastllm.patch does not know are scored from the logits their forward makes."""
    import transformers

    torch.manual_seed(0)
    if family == "cohere":
        model = transformers.CohereForCausalLM(transformers.CohereConfig(
            vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, logit_scale=0.37))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=97, n_embd=32, n_layer=1, n_head=4, n_positions=32)).eval()  # (dropout)
    ids, labels, mask = _pairs()
    torch.testing.assert_close(sequence_logps(model, ids, labels, attention_mask=mask),
                               _logits_way(model, ids, labels, mask), rtol=1e-5, atol=1e-5)


def test_matches_trl_fused_lm_head():
    pytest.importorskip("trl")
    from trl.trainer.utils import add_fused_lm_head

    model = _model()
    ids, labels, mask = _pairs()
    ours = sequence_logps(model, ids, labels, attention_mask=mask)
    add_fused_lm_head(model)
    trl = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs
    torch.testing.assert_close(ours, trl.sum(-1), rtol=1e-5, atol=1e-5)


def test_bad_inputs():
    model = _model()
    ids, labels, _ = _pairs()
    with pytest.raises(ValueError, match="both be"):
        sequence_logps(model, ids, labels[:, :-1])
    with pytest.raises(ValueError, match="int64"):
        sequence_logps(model, ids, labels.int())


# --- DPO losses --------------------------------------------------------------------------------

def _paper(loss_type, c, r, rc, rr, beta, ls, nc, nr):
    """The per-pair losses as the papers (and TRL 1.16's DPOTrainer) write them."""
    sig, logsig = torch.sigmoid, F.logsigmoid
    u = beta * ((c - rc) - (r - rr))
    if loss_type == "sigmoid":  # DPO (Rafailov et al. eq. 7); cDPO for ls > 0
        return -(1 - ls) * logsig(u) - ls * logsig(-u)
    if loss_type == "robust":  # rDPO (Chowdhury et al. eq. 4)
        return (-(1 - ls) * logsig(u) + ls * logsig(-u)) / (1 - 2 * ls)
    if loss_type == "hinge":
        return torch.clamp(1 - u, min=0)
    if loss_type == "ipo":  # Azar et al. eq. 17, log-ratios per token
        d = (c - rc) / nc.clamp(min=1) - (r - rr) / nr.clamp(min=1)
        return (d - 1 / (2 * beta)) ** 2
    if loss_type == "sigmoid_norm":
        d = (c - rc) / nc.clamp(min=1) - (r - rr) / nr.clamp(min=1)
        return -logsig(beta * d)
    if loss_type == "bco_pair":
        return -logsig(beta * (c - rc)) - logsig(-beta * (r - rr))
    if loss_type == "nca_pair":
        return (-logsig(beta * (c - rc)) - 0.5 * logsig(-beta * (c - rc))
                - 0.5 * logsig(-beta * (r - rr)))
    if loss_type == "sppo_hard":
        return (c - rc - 0.5 / beta) ** 2 + (r - rr + 0.5 / beta) ** 2
    if loss_type == "apo_zero":
        return (1 - sig(beta * (c - rc))) + sig(beta * (r - rr))
    return sig(beta * (c - rc)) + (1 - sig(u))  # apo_down


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_dpo_losses_match_the_papers(loss_type):
    g = torch.Generator().manual_seed(1)
    c, r, rc, rr = (torch.randn(5, generator=g, dtype=torch.float64) * 4 - 20 for _ in range(4))
    nc, nr = torch.tensor([3, 9, 1, 0, 12]), torch.tensor([5, 2, 7, 4, 1])
    ls = 0.2 if loss_type in ("sigmoid", "robust") else 0.0
    c.requires_grad_()
    out = dpo_loss(c, r, rc, rr, beta=0.3, loss_type=loss_type, label_smoothing=ls,
                   chosen_lengths=nc, rejected_lengths=nr)
    want = _paper(loss_type, c, r, rc, rr, 0.3, ls, nc, nr)
    torch.testing.assert_close(out.loss, want, rtol=1e-12, atol=1e-12)
    g_out, = torch.autograd.grad(out.loss.sum(), c)
    g_want, = torch.autograd.grad(want.sum(), c)
    torch.testing.assert_close(g_out, g_want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.chosen_rewards, 0.3 * (c - rc).detach())
    torch.testing.assert_close(out.rejected_rewards, 0.3 * (r - rr))
    assert not out.chosen_rewards.requires_grad


def test_dpo_loss_refuses_bad_arguments():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="unknown loss_type 'sigmod'.*sigmoid, hinge"):
        dpo_loss(x, x, x, x, loss_type="sigmod")
    for beta in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="beta must be"):
            dpo_loss(x, x, x, x, beta=beta)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0.5\)"):
        dpo_loss(x, x, x, x, loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="used by loss_type 'sigmoid' and 'robust' only"):
        dpo_loss(x, x, x, x, loss_type="hinge", label_smoothing=0.1)
    with pytest.raises(ValueError, match="ref_rejected_logps has 2 pairs"):
        dpo_loss(x, x, x, torch.zeros(2))
    with pytest.raises(ValueError, match="rejected_logps must be a 1-d floating"):
        dpo_loss(x, torch.zeros(3, dtype=torch.long), x, x)
    with pytest.raises(ValueError, match="pass chosen_lengths and rejected_lengths"):
        dpo_loss(x, x, x, x, loss_type="ipo")


# --- the reference model: adapters disabled ----------------------------------------------------

@pytest.mark.parametrize("kind", ["lora", "dora"])
@pytest.mark.parametrize("patched", [False, True], ids=["hf", "patched"])
def test_disable_adapters_gives_the_base_model(kind, patched):
    ids, labels, mask = _pairs()
    base = _model()
    want = sequence_logps(base, ids, labels, attention_mask=mask)
    model = _model()
    inject = inject_dora if kind == "dora" else inject_lora
    inject(model, target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj",
                                  "down_proj"], r=4, alpha=8)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.add_(torch.randn_like(p) * 0.2)
    if patched:
        fastllm.patch(model)
    adapted = sequence_logps(model, ids, labels, attention_mask=mask).detach()
    assert (adapted - want).abs().max() > 1e-3  # the adapters do change the output
    with torch.no_grad(), disable_adapters(model):
        torch.testing.assert_close(sequence_logps(model, ids, labels, attention_mask=mask),
                                   want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="inside"), disable_adapters(model):
        raise RuntimeError("inside")
    torch.testing.assert_close(sequence_logps(model, ids, labels, attention_mask=mask).detach(),
                               adapted)


def test_disable_adapters_refusals():
    with pytest.raises(ValueError, match="no LoRALinear layers"):
        disable_adapters(_model()).__enter__()
    model = _model()
    inject_lora(model, target_modules=["q_proj"], r=4)
    merge_lora(model)
    with pytest.raises(ValueError, match="is merged"):
        disable_adapters(model).__enter__()
    assert not any(m.disabled for m in model.modules() if hasattr(m, "disabled"))
    from fastllm.prefix import attach_prefix

    with pytest.raises(ValueError, match="carries a prefix"):
        disable_adapters(attach_prefix(_model(), num_virtual_tokens=2)).__enter__()
