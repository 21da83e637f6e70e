"""fastllm.preference: per-token and per-sequence log-probabilities without logits against the
materialised log_softmax (and against TRL's fused LM head where trl is installed), DPO's losses
against the papers' formulas written out here, and fastllm.lora.disable_adapters as DPO's
reference model."""

import json
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
    monkeypatch.setattr(_op_module, "CPU_MIN_CHUNK_ROWS", 1)
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
    monkeypatch.setattr(_op_module, "CPU_MIN_CHUNK_ROWS", 1)  # (chunks of 4 rows here)
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
    if not average:  # per_token=True: the same pass's values, column t scoring label t + 1
        with torch.no_grad():
            tokens = sequence_logps(model, ids, labels, attention_mask=mask, per_token=True)
        assert tokens.shape == ids.shape and (tokens[:, -1] == 0).all()
        assert (tokens[:, :-1][labels[:, 1:] == -100] == 0).all()
        torch.testing.assert_close(tokens.sum(-1), expected.detach(), rtol=1e-5, atol=1e-5)
    got = sequence_logps(model, ids, labels, attention_mask=mask, average=average)
    got.pow(2).sum().backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    have = _grads(model)
    assert have.keys() == want.keys() and ("lm_head.weight" in have) == (head == "trained")
    for n in want:
        torch.testing.assert_close(have[n], want[n], rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.parametrize("patched", [False, True], ids=["hf", "patched"])
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "logits"])
def test_padding_free_equals_padded(patched, side, fused):
    """The rows' attended tokens as one row (position ids from 0 per sequence, the attention kept
    inside each) give the padded rows' values and grads: sums, means, per token."""
    model = _model()
    inject_lora(model, target_modules=["q_proj", "v_proj"], r=4, alpha=8)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    if patched:
        fastllm.patch(model)
    ids, labels, mask = _pairs(pairs=3, length=13)
    if side == "left":  # each row's tokens moved to its end
        for r in range(len(ids)):
            n = int(mask[r].sum())
            for t in (ids, labels, mask):
                t[r] = torch.cat([t[r, n:], t[r, :n]])
    labels = labels.where(mask != 0, 7)  # a label on padding: scored by neither (masked below)
    padded_labels = labels.where(mask != 0, -100)
    attention_module = sys.modules["fastllm.ops.attention"]
    calls, real = [], attention_module.attention
    kernel = attention_module.cpu_attention_available()
    for kw in (dict(), dict(average=True), dict(per_token=True)):
        results = []
        for free, lab in ((False, padded_labels), (True, labels)):
            model.zero_grad(set_to_none=True)
            with pytest.MonkeyPatch.context() as m:
                m.setattr(attention_module, "attention",
                          lambda *a, **k: calls.append(free) or real(*a, **k))
                got = sequence_logps(model, ids, lab, attention_mask=mask, fused=fused,
                                     padding_free=free, **kw)
                with torch.no_grad():  # (a reference's pass: the packed row's plan too)
                    again = sequence_logps(model, ids, lab, attention_mask=mask, fused=fused,
                                           padding_free=free, **kw)
            torch.testing.assert_close(again, got.detach(), rtol=1e-5, atol=1e-5)
            got.pow(2).sum().backward()
            results.append((got.detach(), _grads(model)))
        (want, want_g), (have, have_g) = results
        if kw.get("per_token"):  # where the padded rows' tokens are (a left-padded row's
            want = want.where(mask != 0, 0.0)  # padding scores its first token: not ours)
            assert have.shape == ids.shape
        else:
            assert want.shape == have.shape == (len(ids),)
        torch.testing.assert_close(have, want, rtol=1e-5, atol=1e-5)
        assert want_g.keys() == have_g.keys() and want_g
        for n in want_g:
            torch.testing.assert_close(have_g[n], want_g[n], rtol=1e-4, atol=1e-5, msg=n)
    # the patched model's packed rows take fastllm's CPU attention (one causal block per
    # sequence, not a dense mask over the packed row), with grad and without, on every CPU
    # with the kernel
    assert (calls.count(True) == 3 * 2 * 2) == (patched and kernel), calls


def test_padding_free_sliding_window_and_short_rows():
    """Mistral's sliding window (shorter than the rows) measured within each packed sequence,
    rows of 1 token and of none: the padded rows' sums."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = fastllm.patch(MistralForCausalLM(MistralConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        sliding_window=4)))
    ids = torch.randint(0, 97, (4, 13), generator=torch.Generator().manual_seed(2))
    mask = torch.zeros_like(ids)
    for row, n in enumerate((13, 1, 0, 9)):
        mask[row, :n] = 1
    labels = ids.masked_fill(mask == 0, -100)
    want = sequence_logps(model, ids, labels, attention_mask=mask)
    got = sequence_logps(model, ids, labels, attention_mask=mask, padding_free=True)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got[1] == got[2] == 0 and (got[[0, 3]] < 0).all()


def test_padding_free_refusals():
    peft = pytest.importorskip("peft")
    model = _model()
    ids, labels, mask = _pairs()
    holes = mask.clone()
    holes[2, 4] = 0
    for kwargs, match in ((dict(attention_mask=holes), "row 2 has padding between"),
                          (dict(attention_mask=mask[:, 1:]), "must be \\(batch, seq\\)"),
                          (dict(attention_mask=mask * 0), "attends no token"),
                          (dict(attention_mask=mask, position_ids=mask.cumsum(-1)),
                           "position_ids are made")):
        with pytest.raises(ValueError, match=match):
            sequence_logps(model, ids, labels, padding_free=True, **kwargs)
    wrapped = peft.get_peft_model(model, peft.PromptTuningConfig(task_type="CAUSAL_LM",
                                                                  num_virtual_tokens=3))
    with pytest.raises(ValueError, match="prompt learning"):
        sequence_logps(wrapped, ids, labels, attention_mask=mask, padding_free=True)
    import transformers

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=97, n_embd=32,
                                                                n_layer=1, n_head=4))
    with pytest.raises(ValueError, match="families fastllm.patch knows.*GPT2LMHeadModel"):
        sequence_logps(gpt2, ids, labels, attention_mask=mask, padding_free=True)
    # an attention function of one's own: transformers makes it no mask (the packed sequences
    # would attend to each other); a cache: transformers then looks for no packed sequences
    transformers.AttentionInterface.register("my_sdpa", transformers.integrations.sdpa_attention
                                            .sdpa_attention_forward)
    custom = _model()
    custom.config._attn_implementation = "my_sdpa"
    with pytest.raises(ValueError, match="attention implementation.*got 'my_sdpa'"):
        sequence_logps(custom, ids, labels, attention_mask=mask, padding_free=True)
    with pytest.raises(ValueError, match="without a cache; do not pass past_key_values"):
        sequence_logps(model, ids, labels, attention_mask=mask, padding_free=True,
                       past_key_values=transformers.DynamicCache())


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


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_gemma_scored_fused_with_its_softcap(family, monkeypatch):
    """Gemma 2's and 3's logits are capped (cap * tanh(logits / cap)) after lm_head: the fused
    route applies the cap in the op (no logits), values and grads equal to the capped logits'."""
    import transformers

    import fastllm.preference as preference

    name = {"gemma2": "Gemma2", "gemma3_text": "Gemma3Text"}[family]
    config = getattr(transformers, name + "Config")(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, final_logit_softcapping=5.0)
    torch.manual_seed(0)
    model = getattr(transformers, "Gemma3ForCausalLM" if family == "gemma3_text"
                    else "Gemma2ForCausalLM")(config)
    with torch.no_grad():  # logits past the cap
        model.lm_head.weight.mul_(20.0)
    ids, labels, mask = _pairs()
    expected = _logits_way(model, ids, labels, mask)
    expected.sum().backward()
    want = _grads(model)
    model.zero_grad(set_to_none=True)
    calls = []
    monkeypatch.setattr(preference, "token_logps",
                        lambda *a: calls.append(a[-1]) or token_logps(*a))
    got = sequence_logps(model, ids, labels, attention_mask=mask)
    assert calls == [5.0]  # the fused route, with the cap
    got.sum().backward()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    have = _grads(model)
    assert have.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(have[n], want[n], rtol=1e-4, atol=1e-5, msg=n)


def test_matches_trl_fused_lm_head():
    pytest.importorskip("trl")
    from trl.trainer.utils import add_fused_lm_head

    model = _model()
    ids, labels, mask = _pairs()
    ours = sequence_logps(model, ids, labels, attention_mask=mask)
    add_fused_lm_head(model)
    trl = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs
    torch.testing.assert_close(ours, trl.sum(-1), rtol=1e-5, atol=1e-5)


def test_a_row_without_labels_scores_zero():
    """0 for the sum and the mean (TRL counts such a row as 1 token): no nan reaches the loss
    or, through it, every parameter's grad."""
    model = _model()
    inject_lora(model, target_modules=["q_proj"], r=4)
    ids, labels, mask = _pairs()
    labels[1] = -100
    for average in (False, True):
        got = sequence_logps(model, ids, labels, attention_mask=mask, average=average)
        assert got[1] == 0 and torch.isfinite(got).all()
        got.sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kind", ["prompt", "prefix"])
def test_peft_prompt_learning_scores_through_its_forward(kind):
    """PEFT's virtual tokens come from its own forward: the last T positions of its logits."""
    peft = pytest.importorskip("peft")
    model = _model()
    ids, labels, mask = _pairs()
    base = sequence_logps(model, ids, labels, attention_mask=mask).detach()
    config = (peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3)
              if kind == "prompt" else
              peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=3))
    wrapped = peft.get_peft_model(model, config)
    got = sequence_logps(wrapped, ids, labels, attention_mask=mask)
    logits = wrapped(input_ids=ids, attention_mask=mask).logits[:, -ids.shape[1]:, :].float()
    target = labels[:, 1:]
    keep = target != -100
    logp = logits[:, :-1].log_softmax(-1).gather(-1, target.where(keep, 0)[..., None])[..., 0]
    torch.testing.assert_close(got, (logp * keep).sum(-1), rtol=1e-5, atol=1e-5)
    assert got.requires_grad and (got.detach() - base).abs().max() > 1e-4


def test_bad_inputs():
    model = _model()
    ids, labels, _ = _pairs()
    with pytest.raises(ValueError, match="both be"):
        sequence_logps(model, ids, labels[:, :-1])
    with pytest.raises(ValueError, match="int64"):
        sequence_logps(model, ids, labels.int())


# --- DPO losses --------------------------------------------------------------------------------

def _paper(loss_type, c, r, rc, rr, beta, ls, nc, nr):
    """The per-pair losses as the papers (and TRL 1.16's DPOTrainer) write them; sigmoid with
    label smoothing as Mitchell's conservative DPO (TRL before 1.0, Liger-Kernel)."""
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
    for loss_type in ("robust", "sigmoid"):
        with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 0.5\)"):
            dpo_loss(x, x, x, x, loss_type=loss_type, label_smoothing=0.5)
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
    # the layers as they were: no instance flag left behind (torch.compile guards on its absence)
    assert not any("disabled" in m.__dict__ for _, m in fastllm.lora.lora_modules(model))


def test_disable_adapters_refusals():
    with pytest.raises(ValueError, match="no fastllm LoRALinear layers"):
        disable_adapters(_model()).__enter__()
    model = _model()
    inject_lora(model, target_modules=["q_proj"], r=4)
    with disable_adapters(model), pytest.raises(ValueError, match="inside disable_adapters"):
        merge_lora(model)
    merge_lora(model)
    with pytest.raises(ValueError, match="is merged"):
        disable_adapters(model).__enter__()
    assert not any(m.disabled for m in model.modules() if hasattr(m, "disabled"))
    from fastllm.prefix import attach_prefix

    with pytest.raises(ValueError, match="carries a prefix"):
        disable_adapters(attach_prefix(_model(), num_virtual_tokens=2)).__enter__()


# --- preference data and the DPO example -------------------------------------------------------

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
EXAMPLE_DATA = "examples/data/capital_preferences.jsonl"


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """A tiny Llama and a byte-level BPE with a ChatML template, saved as a model folder."""
    from _tiny_tokenizer import tiny_bpe
    from transformers import LlamaConfig, LlamaForCausalLM

    path = str(tmp_path_factory.mktemp("tiny_dpo"))
    tok = tiny_bpe(CHATML, pad="<|im_end|>")
    tok.save_pretrained(path)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)).save_pretrained(path)
    return path


def _hf_tok(folder):
    from transformers import AutoTokenizer

    from fastllm.train.data import HFTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(folder), folder)


def _write(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(path)


def test_pairs_are_two_sft_rows_chosen_first(tmp_path, tiny_folder):
    from fastllm.train.preference_data import encode_pair, pair_batch, read_pairs
    from fastllm.train.sft_data import encode_example
    from fastllm.train.sft_records import _check_fields

    tok = _hf_tok(tiny_folder)
    user = [{"role": "user", "content": "What is the capital of France?"}]
    records = [{"prompt": "What is the capital of France?", "chosen": " Paris.",
                "rejected": " Lyon, I think.", "messages": "(another dataset's column)"},
               {"prompt": user, "chosen": [{"role": "assistant", "content": "Paris."}],
                "rejected": [{"role": "assistant", "content": "It is Paris, in France."}]}]
    pairs, wheres = read_pairs(_write(tmp_path / "p.jsonl", records))
    assert wheres[1].endswith("p.jsonl line 2")
    encoded = [encode_pair(p, tok) for p in pairs]
    for record, (chosen, rejected) in zip(records, encoded):  # each side is SFT's encoding
        for side, got in (("chosen", chosen), ("rejected", rejected)):
            one = _check_fields({"prompt": record["prompt"], "completion": record[side]},
                                "x")
            assert got == encode_example(one, tok)
    batch = pair_batch(encoded, pad_id=0)
    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    assert ids.shape[0] == 4
    for row, (seq, keep) in enumerate([encoded[0][0], encoded[1][0], encoded[0][1],
                                       encoded[1][1]]):
        n = len(seq)
        assert ids[row, :n].tolist() == seq and mask[row, :n].all() and not mask[row, n:].any()
        want = [t if k else -100 for t, k in zip(seq, keep)] + [-100] * (ids.shape[1] - n)
        assert labels[row].tolist() == want
    prompt_len = len(encode_example(_check_fields({"prompt": user, "completion": [
        {"role": "assistant", "content": "x"}]}, "x"), tok)[0]) - 3
    with pytest.raises(ValueError, match="the chosen row keeps no completion token"):
        pair_batch(encoded[1:], pad_id=0, max_length=prompt_len, where=["p.jsonl line 2"])


def test_a_token_merging_across_the_join_is_the_completions(tmp_path, tiny_folder):
    """A prompt ending in a space: the tokenizer merges it into the completion's first word
    (' Paris'). SFT's rule (the first len(prompt tokens) tokens are the prompt) gave that token
    to the prompt, so the chosen reply was scored without its one word; as TRL's DPOTrainer, the
    completion now starts where the prompt's tokens and either side's part ways."""
    from fastllm.train.preference_data import encode_pair, read_pairs

    tok = _hf_tok(tiny_folder)
    record = {"prompt": "What is the capital of France? ", "chosen": "Paris.",
              "rejected": "The capital is Paris, in France."}
    pairs, _ = read_pairs(_write(tmp_path / "p.jsonl", [record]))
    with pytest.warns(UserWarning, match="as in TRL's DPOTrainer"):
        (chosen, chosen_mask), (rejected, rejected_mask) = encode_pair(pairs[0], tok)
    eos = tok.decode([tok.eos_token_id])
    assert tok.decode([t for t, m in zip(chosen, chosen_mask) if m]) == " Paris." + eos
    assert tok.decode([t for t, m in zip(rejected, rejected_mask) if m]).endswith(
        "The capital is Paris, in France." + eos)
    n = chosen_mask.index(1)  # one boundary for both sides, the prompt's tokens before it
    assert rejected_mask.index(1) == n and chosen[:n] == rejected[:n]
    assert tok.decode(chosen[:n]) == "What is the capital of France?"


@pytest.mark.parametrize("record,match", [
    ({"prompt": "a", "chosen": "b"}, r"\['rejected'\] missing"),
    ({"chosen": "a b", "rejected": "a c"}, "implicit-prompt record"),
    ({"prompt": [{"role": "user", "content": "a"}], "chosen": "b", "rejected": [
        {"role": "assistant", "content": "c"}]}, "key 'chosen' must be a list of messages"),
    ({"prompt": "a", "chosen": "b", "rejected": 3}, "key 'rejected' must be a string"),
    ([1, 2], "must be a JSON object"),
    ({"prompt": "a", "chosen": "b", "rejected": "c", "tools": [{"name": "f"}]},
     "go with conversational records"),
])
def test_malformed_pairs_are_refused_naming_the_line_and_key(tmp_path, record, match):
    from fastllm.train.preference_data import read_pairs

    good = {"prompt": "a", "chosen": "b", "rejected": "c"}
    with pytest.raises(ValueError, match=match) as e:
        read_pairs(_write(tmp_path / "p.jsonl", [good, record]))
    assert "p.jsonl line 2" in str(e.value)


def test_dpo_example_trains_and_saves_a_peft_adapter(tmp_path, tiny_folder, monkeypatch):
    """examples/dpo_lora.py end to end on a tiny model: the first loss is ln 2 (policy = its
    reference while B = 0), the held-out pairs' loss and chosen NLL (RPO) fall, the adapter
    loads in PEFT."""
    import math
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(os.path.join(root, "examples"))
    import dpo_lora

    out = tmp_path / "adapter"
    summary = dpo_lora.main([tiny_folder, "--data", os.path.join(root, EXAMPLE_DATA),
                             "--steps", "6", "--pairs", "4", "--eval-pairs", "4", "--lr", "3e-3",
                             "--r", "4", "--max-length", "96", "--threads", "1",
                             "--rpo-alpha", "1", "--out", str(out)])
    before, after = summary["eval_before"], summary["eval"]
    assert before["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert after["loss"] < before["loss"] - 0.01 and after["margin"] > 0
    assert after["chosen_nll"] < before["chosen_nll"]
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_folder),
                                            str(out))
    assert any("lora_A" in n for n, _ in loaded.named_parameters())
