"""fastllm.patch under TRL's SFTTrainer (checked on TRL 1.16.0), on a tiny random-init Llama.

TRL's trainers give the causal LM an instance `forward` in their __init__ (add_fused_lm_head): with
`fused_lm_head=True`, their training and evaluation loss, it runs the backbone (model.model) and
TRL's own chunked log-prob kernel over lm_head's weight, so the logits never exist; otherwise the
forward it wrapped. Patched before the trainer, the backbone runs fastllm's RMSNorm, rotary and
SwiGLU kernels under TRL's head, and training is the unpatched model's (fp32: 1e-5 on the losses
and TRL's entropy and token-accuracy metrics, 1e-4 on every gradient and parameter), with PEFT's
LoRA, fastllm.lora and gradient checkpointing, and so is evaluate(). Patching after the trainer,
or unpatching under TRL's head, is refused with what to do instead: the test of those messages
without TRL builds a stand-in of TRL's wrapper the way add_fused_lm_head does.

TRL is not a dependency of fastllm: the tests that run it skip without it (and `datasets`)."""

import copy
import functools
import types

import pytest
import torch

import fastllm
import fastllm.lora

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

# the kernels patch() runs in the backbone (fastllm/patch.py looks each up at call time)
_KERNELS = {"rms_norm": "fastllm.ops.rms_norm", "rotary_embedding": "fastllm.ops.rotary_embedding",
            "swiglu_linear": "fastllm.ops.swiglu", "swiglu_mlp": "fastllm.ops.gated_mlp",
            "attention": "fastllm.ops.attention"}
# (an MLP runs as swiglu_mlp, one node, where F.linear is what its projections run: always on
# a GPU; on a CPU where fastllm routes fp32 matmuls, as swiglu_linear after them)


@pytest.fixture(scope="module")
def trl():
    trl = pytest.importorskip("trl")
    pytest.importorskip("datasets")
    return trl


@pytest.fixture(scope="module")
def tok():
    """A 300-token byte-level BPE, built offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["What is the capital of France? Paris. Two plus two is four."] * 4,
                            trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>",
                                                pad_token="<pad>")


def _model(tok):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa", pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id))
    with torch.no_grad():  # HF initialises norms to 1: make them differ so their grads count
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _data(n):
    """prompt / completion rows of 2 to 11 tokens each: TRL trains on the completions only."""
    from datasets import Dataset

    prompts = ["What is the capital of France?", "Two plus two?", "Capital?", "What is four?"]
    answers = [" Paris.", " four.", " Paris is the capital of France.", " Two plus two is four."]
    return Dataset.from_dict({"prompt": [prompts[i % 4] for i in range(n)],
                              "completion": [answers[3 * i % 4] for i in range(n)]})


class _Grads(transformers.TrainerCallback):
    """Every trainable parameter's gradient before each optimizer step."""

    def __init__(self):
        self.steps = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.steps.append({n: p.grad.clone() for n, p in model.named_parameters()
                           if p.requires_grad})


def _trainer(trl, model, tok, out, peft_config=None, **over):
    args = dict(output_dir=str(out), use_cpu=True, bf16=False, report_to=[], seed=0,
                dataloader_num_workers=0, max_steps=2, per_device_train_batch_size=2,
                per_device_eval_batch_size=2, gradient_accumulation_steps=2, optim="sgd",
                learning_rate=0.1, lr_scheduler_type="constant", logging_steps=1,
                save_strategy="no", disable_tqdm=True, max_length=32,
                train_sampling_strategy="sequential")
    args.update(over)
    torch.manual_seed(1)  # PEFT's LoRA initialisation, in SFTTrainer's __init__
    return trl.SFTTrainer(model=model, args=trl.SFTConfig(**args), train_dataset=_data(8),
                          eval_dataset=_data(4), processing_class=tok, peft_config=peft_config)


def _count_kernels(monkeypatch):
    import importlib

    calls = dict.fromkeys(_KERNELS, 0)
    for name, module in _KERNELS.items():
        module = importlib.import_module(module)

        def counted(*args, _real=getattr(module, name), _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


def _run(trl, model, tok, out, **over):
    """(train logs, gradients per step, evaluate()'s metrics, the trained model)."""
    trainer = _trainer(trl, model, tok, out, **over)
    grads = _Grads()
    trainer.add_callback(grads)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    metrics = trainer.evaluate()
    return logs, grads.steps, metrics, trainer.model


def _assert_close(got, want, rtol, name):
    scale = want.abs().max().item() + 1e-30
    err = (got - want).abs().max().item()
    assert err <= rtol * scale, f"{name}: error {err:.3g} vs scale {scale:.3g}"


@pytest.mark.parametrize("adapters,checkpointing,packing", [
    (None, False, False), (None, True, False), ("peft", True, False), ("fastllm", True, False),
    (None, False, True)])
def test_sft_trainer_patched_before_trains_as_unpatched(trl, tok, tmp_path, monkeypatch,
                                                        adapters, checkpointing, packing):
    from peft import LoraConfig

    over = dict(gradient_checkpointing=checkpointing)
    if packing:  # rows of whole examples with restarting position ids, no attention_mask
        if not hasattr(fastllm._extension.extension(), "attention_cpu"):
            pytest.skip("no cpp attention kernel")
        monkeypatch.setenv("FASTLLM_CPU_ATTENTION", "fastllm")
        over["packing"] = True
    if adapters == "peft":
        over["peft_config"] = LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM",
                                         target_modules=["q_proj", "v_proj", "gate_proj"])
    reference = _model(tok)
    if adapters == "fastllm":
        fastllm.lora.inject_lora(reference, target_modules=["q_proj", "k_proj", "v_proj"],
                                 r=4, alpha=8)
    ours = fastllm.patch(copy.deepcopy(reference))
    calls = _count_kernels(monkeypatch)
    logs, grads, metrics, trained = _run(trl, ours, tok, tmp_path, **over)
    # the backbone ran fastllm's kernels: 4 micro-batches and 1 evaluation batch of 2 layers
    assert calls["rotary_embedding"] >= 10
    assert calls["swiglu_linear"] + calls["swiglu_mlp"] >= 10
    assert calls["rms_norm"] >= 25
    # packed: fastllm's attention in every layer of every training micro-batch (the backbone,
    # which TRL's head calls directly, hands its layers the attention plan)
    assert calls["attention"] >= (2 * 2 if packing else 0)
    calls.update(dict.fromkeys(calls, 0))
    want_logs, want_grads, want_metrics, want_trained = _run(trl, reference, tok, tmp_path,
                                                             **over)
    assert not any(calls.values())
    assert len(logs) == len(want_logs) == 2
    for key in ("loss", "entropy", "mean_token_accuracy"):
        torch.testing.assert_close([h[key] for h in logs], [h[key] for h in want_logs],
                                   rtol=1e-5, atol=0, msg=key)
    for key in ("eval_loss", "eval_entropy", "eval_mean_token_accuracy"):
        torch.testing.assert_close(metrics[key], want_metrics[key], rtol=1e-5, atol=0, msg=key)
    assert len(grads) == len(want_grads) == 2
    for step, want in zip(grads, want_grads):
        assert step.keys() == want.keys()
        for name, g in step.items():
            _assert_close(g, want[name], 1e-4, name)
    for (name, p), q in zip(trained.named_parameters(), want_trained.parameters()):
        _assert_close(p.detach(), q.detach(), 1e-4, name)


def test_patch_after_sft_trainer_says_patch_before(trl, tok, tmp_path, monkeypatch):
    model = _model(tok)
    trainer = _trainer(trl, model, tok, tmp_path, max_steps=1, gradient_checkpointing=False)
    with pytest.raises(ValueError, match=r"TRL's fused LM head.*before SFTTrainer\(\.\.\.\)"):
        fastllm.patch(model)
    assert not any(fastllm.patched(model).values())  # nothing patched
    # the causal LM's forward is the one kind TRL's head replaces in training: the others patch
    fastllm.patch(model, cross_entropy=False)
    assert fastllm.patched(model)["rms_norm"] == 5 and fastllm.patched(model)["cross_entropy"] == 0
    calls = _count_kernels(monkeypatch)
    trainer.train()
    assert calls["rms_norm"] > 0 and calls["swiglu_linear"] + calls["swiglu_mlp"] > 0


def test_unpatch_under_sft_trainers_head_says_what_to_do(trl, tok, tmp_path):
    model = fastllm.patch(_model(tok))
    _trainer(trl, model, tok, tmp_path, max_steps=1, gradient_checkpointing=False).train()
    ids = tok("What is the capital", return_tensors="pt").input_ids
    model.eval()
    # generation through TRL's head and fastllm's forward: the class's forward without labels
    got = model.generate(ids, max_new_tokens=4, do_sample=False)
    with pytest.raises(RuntimeError, match=r"TRL's fused LM head.*del <module>\.forward"):
        fastllm.unpatch(model)
    assert fastllm.patched(model)["rms_norm"] == 5  # nothing unpatched
    del model.forward
    fastllm.unpatch(model)
    assert not any(k.startswith("_fastllm") or k == "forward"
                   for m in model.modules() for k in m.__dict__)
    fresh = _model(tok).eval()
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(got, fresh.generate(ids, max_new_tokens=4, do_sample=False))
    assert torch.equal(got, model.generate(ids, max_new_tokens=4, do_sample=False))


# --- without TRL: a stand-in of its wrapper ------------------------------------------------------

_STAND_IN = '''
def add_fused_lm_head(model):
    original_forward = model.forward

    @functools.wraps(type(model).forward)
    def _fused_forward(self, *args, fused_lm_head=False, **kwargs):
        return original_forward(*args, **kwargs)

    model.forward = types.MethodType(_fused_forward, model)
'''


def _add_head(model, module_name):
    """What trl.trainer.utils.add_fused_lm_head (TRL 1.16.0) does to model.forward, defined in a
    module called module_name."""
    namespace = {"__name__": module_name, "functools": functools, "types": types}
    exec(_STAND_IN, namespace)
    namespace["add_fused_lm_head"](model)


def _autocast_wrapper(model):
    """accelerate's mixed-precision wrapper over the instance forward (functools.wraps)."""
    inner = model.forward.__func__

    @functools.wraps(inner)
    def forward(self, *args, **kwargs):
        return inner(self, *args, **kwargs)

    model.forward = types.MethodType(forward, model)


def _tiny():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, attn_implementation="sdpa"))


@pytest.mark.parametrize("accelerate_on_top", [False, True])
def test_refusals_name_trls_head(accelerate_on_top):
    ids = torch.randint(0, 64, (1, 5))
    model = _tiny()
    _add_head(model, "trl.trainer.utils")
    if accelerate_on_top:
        _autocast_wrapper(model)
    with pytest.raises(ValueError, match="TRL's fused LM head.*cross_entropy=False"):
        fastllm.patch(model)
    assert not any(fastllm.patched(model).values())

    model = fastllm.patch(_tiny())
    want = model(ids).logits
    _add_head(model, "trl.trainer.utils")
    if accelerate_on_top:
        _autocast_wrapper(model)
    torch.testing.assert_close(model(ids).logits, want, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="TRL's fused LM head.*del <module>"):
        fastllm.unpatch(model)
    del model.forward
    fastllm.unpatch(model)
    assert not any(fastllm.patched(model).values())


def test_other_wrappers_keep_the_plain_refusals():
    model = _tiny()
    _add_head(model, "mylib.heads")  # the same code elsewhere is not TRL's
    with pytest.raises(ValueError, match="Patch before wrapping them") as raised:
        fastllm.patch(model)
    assert "TRL" not in str(raised.value)
    model = fastllm.patch(_tiny())
    _add_head(model, "mylib.heads")
    with pytest.raises(RuntimeError, match="Remove that wrapper first") as raised:
        fastllm.unpatch(model)
    assert "TRL" not in str(raised.value)
