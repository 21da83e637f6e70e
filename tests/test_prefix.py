"""Prefix-tuning (fastllm.prefix) against PEFT's PREFIX_TUNING: logits and grads, adapter files
both ways (with and without the reparameterisation), sliding-window models, packing, generate()
with the KV cache, a training run, and what is refused (bad arguments, gradient checkpointing,
resume files that do not fit) before the model changes."""

import os
import warnings

import pytest
import torch

from fastllm.prefix import attach_prefix, load_prefix, prefix_mask_ref, save_prefix


def _model(attn="sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=64,
                                        attn_implementation=attn))


def _sliding(kind, attn="sdpa"):
    """A tiny model with sliding-window attention: Mistral's (every layer, window 3) or Qwen2's
    (layer 0 full, layer 1 window 3: one mask per layer type)."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    dims = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                sliding_window=3, attn_implementation=attn)
    if kind == "mistral":
        return MistralForCausalLM(MistralConfig(**dims))
    return Qwen2ForCausalLM(Qwen2Config(use_sliding_window=True, max_window_layers=1, **dims))


def _ids(b=2, n=9):
    return torch.randint(0, 64, (b, n), generator=torch.Generator().manual_seed(3))


def test_mask_ref():
    pos = torch.tensor([[0, 1, 2, 0, 1]])
    m = prefix_mask_ref(pos, 2)
    allowed = (m[0, 0] == 0).int().tolist()
    assert allowed == [[1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0],
                       [1, 1, 0, 0, 0, 1, 0], [1, 1, 0, 0, 0, 1, 1]]


@pytest.mark.parametrize("projection", [False, True])
def test_matches_peft_both_ways(tmp_path, projection):
    import peft

    ids = _ids()
    ours = attach_prefix(_model(), num_virtual_tokens=3, prefix_projection=projection,
                         encoder_hidden_size=8)
    with torch.no_grad():
        for p in ours.prefix_encoder.parameters():
            p.normal_(0, 0.5)
    assert {n for n, p in ours.named_parameters() if p.requires_grad} == {
        "prefix_encoder." + n for n, _ in ours.prefix_encoder.named_parameters()}
    save_prefix(ours, str(tmp_path / "a"))
    theirs = peft.PeftModel.from_pretrained(_model(), str(tmp_path / "a"))
    got = ours(input_ids=ids).logits
    with torch.no_grad():
        torch.testing.assert_close(got, theirs(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    # grads of the prefix rows, against PEFT's trainable (plain) prefix of the same rows
    if not projection:
        trainable = peft.get_peft_model(_model(), peft.PrefixTuningConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=3))
        with torch.no_grad():
            trainable.prompt_encoder["default"].embedding.weight.copy_(
                ours.prefix_encoder.embedding.weight)
        got.square().mean().backward()
        trainable(input_ids=ids).logits.square().mean().backward()
        want = trainable.prompt_encoder["default"].embedding.weight.grad
        torch.testing.assert_close(ours.prefix_encoder.embedding.weight.grad, want, rtol=1e-5,
                                   atol=1e-7)
    # PEFT -> fastllm
    pm = peft.get_peft_model(_model(), peft.PrefixTuningConfig(
        task_type="CAUSAL_LM", num_virtual_tokens=4, prefix_projection=projection,
        encoder_hidden_size=8))
    with torch.no_grad():
        for p in pm.prompt_encoder.parameters():
            p.normal_(0, 0.5)
    pm.eval()
    pm.save_pretrained(str(tmp_path / "b"))
    mine = load_prefix(_model(), str(tmp_path / "b"))
    with torch.no_grad():
        torch.testing.assert_close(mine(input_ids=ids).logits, pm(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)


def test_packed_equals_one_by_one():
    model = attach_prefix(_model("eager"), num_virtual_tokens=2)
    with torch.no_grad():
        model.prefix_encoder.embedding.weight.normal_(0, 0.5)
    a, b = _ids(1, 4), _ids(1, 6)[:, 1:]
    packed = model(input_ids=torch.cat([a, b], 1),
                   position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])).logits
    torch.testing.assert_close(packed[:, :4], model(input_ids=a).logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[:, 4:], model(input_ids=b).logits, rtol=1e-5, atol=1e-5)


def test_prefix_sft_run_resumes_bitwise_and_exports_for_peft(tmp_path):
    import json
    import shutil

    import peft
    from transformers import AutoModelForCausalLM

    from fastllm.export import export, load_run
    from fastllm.train.config import TrainConfig
    from fastllm.train.trainer import Trainer

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "completion": f" {i + 1}"}) + "\n"
                            for i in range(12)))

    def cfg():
        return TrainConfig.from_dict(dict(
            model="tiny", finetune="prefix", prefix=dict(num_virtual_tokens=4,
                                                         prefix_projection=True),
            output_dir=str(tmp_path / "run"), max_steps=4, lr=1e-2, min_lr=1e-3, warmup_steps=0,
            micro_batch_size=2, track_memory=False, checkpoint=dict(interval=2),
            data=dict(path=str(data), seq_len=32, cache_dir=str(tmp_path / "cache"),
                      eval_fraction=0.25), eval=dict(prompts=["3 + 1 ="], max_new_tokens=3)))

    first = Trainer(cfg()).train()["losses"]
    shutil.rmtree(tmp_path / "run" / "checkpoint-4")
    assert Trainer(cfg()).train()["losses"] == first
    model, tok, _ = load_run(str(tmp_path / "run"))
    ids = torch.tensor([tok.encode("3 + 1 =")])
    out = export(str(tmp_path / "run"), str(tmp_path / "out"))
    with open(os.path.join(out, "adapter_config.json")) as f:
        base = json.load(f)["base_model_name_or_path"]
    pm = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out)
    with torch.no_grad():
        torch.testing.assert_close(pm(input_ids=ids).logits, model(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="cannot be merged"):
        export(str(tmp_path / "run"), str(tmp_path / "merged"), merged=True)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("padded", [False, True], ids=["full", "left_padded"])
def test_generate_with_the_kv_cache_equals_full_forwards(attn, padded):
    model = attach_prefix(_model(attn), num_virtual_tokens=3).eval()
    with torch.no_grad():
        model.prefix_encoder.embedding.weight.normal_(0, 0.5)
    model.generation_config.eos_token_id = None  # decode all n tokens: no early stop
    ids, n = _ids(2, 5), 6
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :2] = 0
    seq, full = ids, mask
    with torch.no_grad():
        for _ in range(n):  # greedy by full forward passes, positions as generate() gives them
            pos = (full.cumsum(-1) - 1).masked_fill(full == 0, 1)
            logits = model(input_ids=seq, attention_mask=full, position_ids=pos,
                           use_cache=False).logits
            seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], 1)
            full = torch.cat([full, torch.ones_like(full[:, :1])], 1)
        for use_cache in (True, False):
            got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                                 do_sample=False, use_cache=use_cache, pad_token_id=0)
            assert got.tolist() == seq.tolist(), use_cache


def test_mask_ref_sliding_window():
    # window 2, prefix of 2: index q (prefix at 0, 1; the example's tokens from 2) sees k > q - 2;
    # the second packed example counts from its own start
    m = prefix_mask_ref(torch.tensor([[0, 1, 2, 0, 1]]), 2, sliding_window=2)
    allowed = (m[0, 0] == 0).int().tolist()
    assert allowed == [[0, 1, 1, 0, 0, 0, 0], [0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 0, 0],
                       [0, 1, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1, 1]]
    # leading padding counts (as in PEFT's model, whose indices do not skip it)
    m = prefix_mask_ref(torch.tensor([[1, 0, 1]]), 2, torch.tensor([[0, 1, 1]]), sliding_window=3)
    assert (m[0, 0] == 0).int().tolist() == [[1, 1, 0, 0, 0], [0, 1, 0, 1, 0], [0, 0, 0, 1, 1]]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_sliding_window_matches_peft(kind, attn):
    import peft

    ids = _ids(2, 9)
    ours = attach_prefix(_sliding(kind, attn), num_virtual_tokens=4)
    with torch.no_grad():
        ours.prefix_encoder.embedding.weight.normal_(0, 1)
    theirs = peft.get_peft_model(_sliding(kind, attn), peft.PrefixTuningConfig(
        task_type="CAUSAL_LM", num_virtual_tokens=4))
    with torch.no_grad():
        theirs.prompt_encoder["default"].embedding.weight.copy_(
            ours.prefix_encoder.embedding.weight)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    for m in (None, mask):
        got, want = ours(input_ids=ids, attention_mask=m).logits, theirs(
            input_ids=ids, attention_mask=m).logits
        real = torch.ones_like(ids, dtype=torch.bool) if m is None else m.bool()
        torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)
    got[real].square().mean().backward()
    want[real].square().mean().backward()
    torch.testing.assert_close(ours.prefix_encoder.embedding.weight.grad,
                               theirs.prompt_encoder["default"].embedding.weight.grad,
                               rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["mistral", "qwen2"])
def test_sliding_window_packed_and_generate(kind):
    model = attach_prefix(_sliding(kind, "eager"), num_virtual_tokens=2).eval()
    with torch.no_grad():
        model.prefix_encoder.embedding.weight.normal_(0, 1)
        a, b = _ids(1, 4), _ids(1, 6)[:, 1:]
        packed = model(input_ids=torch.cat([a, b], 1),
                       position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4]])).logits
        torch.testing.assert_close(packed[:, :4], model(input_ids=a).logits, rtol=1e-5,
                                   atol=1e-5)
        torch.testing.assert_close(packed[:, 4:], model(input_ids=b).logits, rtol=1e-5,
                                   atol=1e-5)
    model.generation_config.eos_token_id = None
    ids, mask = _ids(2, 5), torch.ones(2, 5, dtype=torch.long)
    mask[0, :2] = 0
    seq, full = ids, mask
    with torch.no_grad():
        for _ in range(5):
            pos = (full.cumsum(-1) - 1).masked_fill(full == 0, 1)
            logits = model(input_ids=seq, attention_mask=full, position_ids=pos,
                           use_cache=False).logits
            seq = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], 1)
            full = torch.cat([full, torch.ones_like(full[:, :1])], 1)
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5,
                             do_sample=False, pad_token_id=0)
    assert got.tolist() == seq.tolist()


def _same(model, before):
    after = dict(model.named_parameters())
    return before.keys() == after.keys() and all(
        torch.equal(before[k][0], after[k]) and before[k][1] == after[k].requires_grad
        for k in before)


def _snapshot(model):
    return {k: (p.detach().clone(), p.requires_grad) for k, p in model.named_parameters()}


def test_unsupported_attention_is_refused_before_the_model_changes():
    model = _sliding("qwen2")
    model.config.layer_types = ["full_attention", "chunked_attention"]
    before = _snapshot(model)
    with pytest.raises(ValueError, match="chunked_attention"):
        attach_prefix(model, num_virtual_tokens=2)
    assert _same(model, before) and not hasattr(model, "prefix_encoder")


def test_gradient_checkpointing_is_refused():
    model = _model()
    model.gradient_checkpointing_enable()
    before = _snapshot(model)
    with pytest.raises(ValueError, match="gradient .*checkpointing"):
        attach_prefix(model, num_virtual_tokens=2)
    assert _same(model, before) and not hasattr(model, "prefix_encoder")
    # switched on after the prefix: refused at the first training forward, not a size mismatch
    model = attach_prefix(_model(), num_virtual_tokens=2)
    model.gradient_checkpointing_enable()
    model.train()
    with pytest.raises(ValueError, match="gradient .*checkpointing"):
        model(input_ids=_ids(), labels=_ids())
    with torch.no_grad(), pytest.raises(ValueError, match="gradient .*checkpointing"):
        model(input_ids=_ids())  # (transformers 5.17 drops the cache in training mode so)
    with torch.no_grad():  # eval: no checkpointing, the layers keep the cache
        model.eval()(input_ids=_ids())


@pytest.mark.parametrize("kwargs,says", [
    (dict(num_virtual_tokens=2.5), "num_virtual_tokens must be an int >= 1, got 2.5"),
    (dict(num_virtual_tokens=True), "num_virtual_tokens must be an int >= 1, got True"),
    (dict(num_virtual_tokens="4"), "num_virtual_tokens must be an int >= 1, got '4'"),
    (dict(num_virtual_tokens=0), "num_virtual_tokens must be an int >= 1, got 0"),
    (dict(encoder_hidden_size=8.0), "encoder_hidden_size must be an int >= 1 or None"),
    (dict(encoder_hidden_size=0), "encoder_hidden_size must be an int >= 1 or None"),
    (dict(prefix_projection="yes"), "prefix_projection must be True or False"),
])
def test_attach_validates_arguments_before_touching_the_model(kwargs, says):
    model = _model()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=says):
        attach_prefix(model, **kwargs)
    assert _same(model, before) and not hasattr(model, "_fastllm_prefix")


def test_load_refuses_a_resume_file_that_does_not_fit_before_changing_the_model(tmp_path):
    save_prefix(attach_prefix(_model(), 4, prefix_projection=True, encoder_hidden_size=8),
                str(tmp_path))
    model = attach_prefix(_model(), 4, prefix_projection=True, encoder_hidden_size=16)
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"prefix_encoder.safetensors does not fit .*"
                                         r"encoder_hidden_size=16.*transform.0.weight"):
        load_prefix(model, str(tmp_path))
    assert _same(model, before)


@pytest.mark.parametrize("projection", [False, True])
def test_load_takes_the_adapter_rows_over_a_stale_resume_file(tmp_path, projection):
    import peft
    from safetensors.torch import load_file

    src = attach_prefix(_model(), 3, prefix_projection=projection, encoder_hidden_size=8)
    with torch.no_grad():
        for p in src.prefix_encoder.parameters():
            p.normal_(0, 0.5)
    save_prefix(src, str(tmp_path))
    # a fresh resume is taken as it is (the MLP too), without a warning
    fresh = attach_prefix(_model(), 3, prefix_projection=projection, encoder_hidden_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_prefix(fresh, str(tmp_path))
    for k, v in src.prefix_encoder.state_dict().items():
        assert torch.equal(fresh.prefix_encoder.state_dict()[k], v), k
    # PEFT trains on and re-saves the adapter, leaving fastllm's resume file behind
    pm = peft.PeftModel.from_pretrained(_model(), str(tmp_path))
    with torch.no_grad():
        for p in pm.prompt_encoder.parameters():
            p.add_(1.0)
    pm.save_pretrained(str(tmp_path))
    rows = load_file(str(tmp_path / "adapter_model.safetensors"))["prompt_embeddings"]
    model = attach_prefix(_model(), 3, prefix_projection=projection, encoder_hidden_size=8)
    if not projection:
        with pytest.warns(UserWarning, match="prefix_encoder.safetensors .* stale and ignored"):
            load_prefix(model, str(tmp_path))
        assert torch.equal(model.prefix_encoder().detach(), rows)
        return
    # a reparameterised prefix cannot take the rows: refused, unchanged
    before = _snapshot(model)
    with pytest.warns(UserWarning, match="stale"), pytest.raises(ValueError, match="stale"):
        load_prefix(model, str(tmp_path))
    assert _same(model, before)


def test_a_save_prefix_failing_midway_leaves_the_adapter_in_the_folder(tmp_path, monkeypatch):
    """Every file under a temporary name first: a save that fails on its last file (the config,
    a full disk) replaces none of the three already there."""
    import errno
    import json

    torch.manual_seed(0)
    save_prefix(attach_prefix(_model(), 4), str(tmp_path))
    before = {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)}

    def disk_full(obj, f, **kw):
        f.write('{"peft_type": "PRE')
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(json, "dump", disk_full)
    other = attach_prefix(_model(), 4)
    with pytest.raises(OSError, match="No space left"):
        save_prefix(other, str(tmp_path))
    assert {n: (tmp_path / n).read_bytes() for n in os.listdir(tmp_path)} == before
    monkeypatch.undo()
    save_prefix(other, str(tmp_path))
    assert len(os.listdir(tmp_path)) == len(before)
    loaded = load_prefix(attach_prefix(_model(), 4), str(tmp_path))
    torch.testing.assert_close(loaded.prefix_encoder.embedding.weight,
                               other.prefix_encoder.embedding.weight, rtol=0, atol=0)


@pytest.mark.parametrize("change,says", [
    (dict(num_layers=None), "num_layers=None \\(missing\\)"),
    (dict(num_virtual_tokens="4"), "num_virtual_tokens='4'"),
    (dict(token_dim=1.5), "token_dim=1.5"),
])
def test_load_refuses_a_config_missing_or_mistyping_a_size(tmp_path, change, says):
    """A missing num_layers was a KeyError; a str num_virtual_tokens a shape message."""
    import json

    save_prefix(attach_prefix(_model(), 4), str(tmp_path))
    file = tmp_path / "adapter_config.json"
    config = json.loads(file.read_text())
    for key, value in change.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    file.write_text(json.dumps(config))
    model = _model()
    before = _snapshot(model)
    with pytest.raises(ValueError, match="adapter_config.json has " + says):
        load_prefix(model, str(tmp_path))
    assert _same(model, before) and not hasattr(model, "prefix_encoder")


@pytest.mark.parametrize("name,key", [("adapter_model.safetensors", "prompt_embeddings"),
                                      ("prefix_encoder.safetensors", "embedding.weight")])
@pytest.mark.parametrize("dtype", [torch.int64, torch.complex64, torch.float8_e4m3fn])
def test_load_refuses_prefix_tensors_of_a_non_float_dtype(tmp_path, name, key, dtype):
    """embedding.weight.copy_(rows) cast them silently."""
    from safetensors.torch import load_file, save_file

    save_prefix(attach_prefix(_model(), 4), str(tmp_path))
    file = str(tmp_path / name)
    tensors = load_file(file)
    tensors[key] = tensors[key].to(dtype)
    save_file(tensors, file)
    for model in (_model(), attach_prefix(_model(), 4)):
        before = _snapshot(model)
        had = hasattr(model, "prefix_encoder")
        if name == "prefix_encoder.safetensors" and not had:
            load_prefix(model, str(tmp_path))  # (a fresh model does not read the resume file)
            continue
        with pytest.raises(ValueError, match=f"{name} holds {key} as {dtype}"):
            load_prefix(model, str(tmp_path))
        assert _same(model, before) and hasattr(model, "prefix_encoder") == had


def test_a_prefix_and_lora_on_one_model_are_refused_before_anything_changes(tmp_path):
    """PEFT has no one adapter file for both. Before: attach_prefix froze the LoRA weights,
    inject_lora("all-linear") wrapped the prefix encoder's MLP, and fastllm.adapters.save_adapter
    wrote the prefix alone, dropping the LoRA weights without a word."""
    from fastllm import adapters, lora
    from fastllm.dora import inject_dora

    for inject in (lora.inject_lora, inject_dora):
        model = inject(_model(), target_modules=["q_proj"], r=2)
        before = _snapshot(model)
        with pytest.raises(ValueError, match="LoRA/DoRA layers .* not supported"):
            attach_prefix(model, 2)
        assert _same(model, before) and not hasattr(model, "_fastllm_prefix")
        adapters.save_adapter(model, str(tmp_path / inject.__name__))
    model = attach_prefix(_model(), 2, prefix_projection=True)
    before = _snapshot(model)
    for call in (lambda: lora.inject_lora(model, target_modules="all-linear"),
                 lambda: adapters.load_adapter(model, str(tmp_path / "inject_lora")),
                 lambda: adapters.load_adapter(model, str(tmp_path / "inject_dora"))):
        with pytest.raises(ValueError, match="has a fastllm prefix"):
            call()
        assert _same(model, before) and not lora.lora_modules(model)
    attn = model.model.layers[0].self_attn  # both, built past the refusals: nothing is written
    attn.q_proj = lora.LoRALinear(attn.q_proj, r=2)
    for save in (adapters.save_adapter, save_prefix, lora.save_adapter):
        with pytest.raises(ValueError, match="not supported"):
            save(model, str(tmp_path / "both"))
        assert not (tmp_path / "both").exists()


class _IdTokenizer:
    """Token ids as text ("5 6 7"), decoded back to a list of ids."""
    bos_ids, eos_token_id = (), None

    def encode(self, text):
        return [int(t) for t in text.split()]

    def decode(self, ids):
        return list(ids)


def test_samples_of_a_prefix_model_follow_its_generation_config():
    """fastllm train's samples of a prefix-tuned model were decoded by full forward passes that
    knew temperature/top-k/top-p alone: the generation_config's repetition_penalty,
    no_repeat_ngram_size, ... were ignored. They come from model.generate now, as for any model."""
    from fastllm.train.evaluate import generate_samples

    model = attach_prefix(_model("eager"), num_virtual_tokens=3).eval()
    with torch.no_grad():
        model.prefix_encoder.embedding.weight.normal_(0, 0.5)
    model.generation_config.eos_token_id = None
    prompt, n = [5, 6, 7], 12
    plain = generate_samples(model, _IdTokenizer(), ["5 6 7"], max_new_tokens=n)[0]
    assert len(set(prompt + plain)) < len(prompt) + n  # greedy repeats itself here ...
    model.generation_config.no_repeat_ngram_size = 1
    got = generate_samples(model, _IdTokenizer(), ["5 6 7"], max_new_tokens=n)[0]
    assert len(set(prompt + got)) == len(prompt) + n  # ... and not with the setting
    with torch.no_grad():
        want = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n,
                              do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    assert got == want
