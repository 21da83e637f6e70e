"""Prefix-tuning (fastllm.prefix) against PEFT's PREFIX_TUNING: logits and grads, adapter files
both ways (with and without the reparameterisation), packing, generate() with the KV cache, and a
training run."""

import os

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
