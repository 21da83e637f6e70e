"""Supervised fine-tuning: JSONL formats and their loss masks, packing that keeps examples apart,
evaluation and samples, HF argument names, an SFT run's resume (tiny models, CPU)."""

import json
import math
import os

import pytest
import torch

from fastllm.train.config import ConfigError, TrainConfig
from fastllm.train.data import ByteTokenizer, HFTokenizer
from fastllm.train.sft_data import (SFTDataset, _pack, encode_example, read_records,
                                    split_examples, tokenize_records)

from _tiny_tokenizer import tiny_bpe

# SmolLM2's (ChatML) template without its default system turn
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# a SmolLM2-135M-Instruct folder (examples/prepare_smollm2.py DIR); the test needing it skips
# without it
SMOLLM2 = os.environ.get("FASTLLM_TEST_MODEL", "")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A small byte-level BPE with ChatML's special tokens and a chat template, built offline."""
    fast = tiny_bpe(CHATML, pad="<|im_end|>")
    path = str(tmp_path_factory.mktemp("tok"))
    fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(tok_dir), tok_dir)


def _write(path, records):
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


CHAT = {"messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "What is the capital of France?"},
                     {"role": "assistant", "content": "Paris."},
                     {"role": "user", "content": "Italy?"},
                     {"role": "assistant", "content": "Rome."}]}


def test_formats_read_and_malformed_lines_refused(tmp_path):
    good = [{"text": "hello"}, {"prompt": "1+1=", "completion": "2"},
            {"instruction": "Add.", "input": "1 1", "output": "2"}, CHAT]
    recs = read_records(_write(tmp_path / "a.jsonl", good[:2] + [""] + good[2:]))
    assert [k for k, _ in recs] == ["text", "completion", "alpaca", "chat"]
    bad = [('{"prompt": "x"}', "line 2: key 'completion'"),
           ('{"prompt": "x", "completion": 3}', "line 2: key 'completion' must be a string"),
           ('{"messages": [{"role": "robot", "content": "x"}]}', "line 2: key 'messages'[0]"),
           ('{"messages": [{"role": "user", "content": "x"}]}', "line 2: key 'messages' has no "
                                                                "assistant"),
           ('{"foo": 1}', "line 2: a record needs"),
           ('{"text": "a"', "line 2: not valid JSON"),
           ('[1, 2]', "line 2: a record must be a JSON object")]
    for line, message in bad:
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("+", r"\+")):
            read_records(_write(tmp_path / "b.jsonl", [{"text": "fine"}, line]))


def test_non_utf8_line_is_refused_with_file_and_line_and_a_bom_is_read(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1.jsonl line 2: not UTF-8"):
        read_records(str(path))
    path.write_bytes(b'\xef\xbb\xbf{"text": "ok"}\n')
    assert read_records(str(path)) == [("text", "ok")]


def test_mask_is_exactly_the_completion_and_assistant_tokens(tok):
    enc = tok.encode
    # chat: token by token, the template's pieces and which of them count
    ids, mask = encode_example(("chat", CHAT["messages"]), tok)
    pieces = [("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is the capital "
               "of France?<|im_end|>\n<|im_start|>assistant\n", 0),
              ("Paris.<|im_end|>\n", 1),
              ("<|im_start|>user\nItaly?<|im_end|>\n<|im_start|>assistant\n", 0),
              ("Rome.<|im_end|>\n", 1)]
    want_ids = [t for text, _ in pieces for t in enc(text)]
    want_mask = [m for text, m in pieces for _ in enc(text)]
    assert ids == want_ids and mask == want_mask
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "Paris.<|im_end|>\nRome.<|im_end|>\n"
    # prompt/completion: the completion and the EOS
    ids, mask = encode_example(("completion", ("What is", " Paris.")), tok)
    assert ids == enc("What is") + enc(" Paris.") + [tok.eos_token_id]
    assert mask == [0] * len(enc("What is")) + [1] * (len(enc(" Paris.")) + 1)
    ids, mask = encode_example(("completion", ("What is", " Paris.")), tok, train_on_prompt=True)
    assert all(mask)
    # Alpaca with a chat template: a user turn and an assistant turn
    ids, mask = encode_example(("alpaca", ("Capital?", "France", "Paris.", "")), tok)
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "Paris.<|im_end|>\n"
    assert "user\nCapital?\n\nFrance" in tok.decode(ids)
    # Alpaca without one: Stanford Alpaca's prompt; text: every token
    byte = ByteTokenizer()
    ids, mask = encode_example(("alpaca", ("Capital?", "", "Paris.", "")), byte)
    assert byte.decode([t for t, m in zip(ids, mask) if m]) == "Paris."
    assert byte.decode(ids).endswith("### Response:\nParis.")
    ids, mask = encode_example(("text", "abc"), byte)
    assert ids == [97, 98, 99, 256] and mask == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="chat template"):
        encode_example(("chat", CHAT["messages"]), byte)


@pytest.mark.skipif(not (SMOLLM2 and os.path.isdir(SMOLLM2)),
                    reason="needs FASTLLM_TEST_MODEL=<a SmolLM2 folder>")
def test_mask_with_smollm2_template():
    from transformers import AutoTokenizer

    tok = HFTokenizer(AutoTokenizer.from_pretrained(SMOLLM2), SMOLLM2)
    ids, mask = encode_example(("chat", CHAT["messages"][1:]), tok)
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "Paris.<|im_end|>\nRome.<|im_end|>\n"
    # the rendering is the template's own (its default system turn included)
    assert tok.decode(ids) == tok.tok.apply_chat_template(CHAT["messages"][1:], tokenize=False)


def test_packing_and_padding(tmp_path):
    assert _pack([5, 3, 4, 2, 1], 6) == [[0, 4], [2, 3], [1]]
    recs = [("text", "a" * n) for n in (3, 9, 1, 5, 20)]
    path = tokenize_records(recs, ByteTokenizer(), str(tmp_path))
    assert tokenize_records(recs, ByteTokenizer(), str(tmp_path)) == path  # cached
    ds = SFTDataset(path, range(5), seq_len=12, seed=0, packing=True, pad_id=0)
    # lengths with EOS 4, 10, 2, 6, 12 (truncated) in rows of 12
    assert ds.truncated == 1 and sorted(map(sorted, ds.rows)) == [[0, 3], [1, 2], [4]]
    b = ds.batch(None, rows=[[0, 3], [4]])
    assert b["input_ids"].shape == (2, 12) and int(b["num_tokens"]) == 4 + 6 + 12
    # positions restart at each example, and padding is a segment of its own
    assert b["position_ids"][0].tolist() == list(range(4)) + list(range(6)) + [0, 1]
    assert (b["labels"][0, 10:] == -100).all()
    assert b["position_ids"][1].tolist() == list(range(12))
    assert b["labels"][0, 0] == -100 and b["labels"][0, 4] == -100  # each example's first
    assert (b["labels"][0, 1:4] == b["input_ids"][0, 1:4]).all()
    ds = SFTDataset(path, range(5), seq_len=12, seed=0, packing=False)
    b = ds.batch([0, 1])
    lens = [ds._lengths[ds.row(0)], ds._lengths[ds.row(1)]]
    assert lens[0] >= lens[1] and b["input_ids"].shape == (2, lens[0])  # longest first
    assert (b["labels"][1, lens[1]:] == -100).all()  # padding never counts
    train, held = split_examples(10, 0.2, seed=3)
    assert len(held) == 2 and sorted(train + held) == list(range(10))
    assert split_examples(10, 0.2, seed=3) == (train, held)


def _tiny_llama(vocab, attn):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, attn_implementation=attn)
    return LlamaForCausalLM(cfg).float()


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_batch_equals_examples_one_by_one(tmp_path, attn):
    recs = [("completion", ("ab", "cdef")), ("text", "xyz12"), ("completion", ("q", "rs"))]
    path = tokenize_records(recs, ByteTokenizer(), str(tmp_path))
    model = _tiny_llama(257, attn)
    packed = SFTDataset(path, range(3), seq_len=24, seed=0, packing=True)
    assert len(packed.rows) == 1
    batch = packed.batch(None, rows=packed.rows)
    batch.pop("num_tokens")
    n = int((batch["labels"][:, 1:] != -100).sum())
    loss = model(**batch, num_items_in_batch=n, use_cache=False).loss
    grads = torch.autograd.grad(loss, list(model.parameters()))
    single = SFTDataset(path, range(3), seq_len=24, seed=0, packing=False)
    total = 0
    for i in range(3):
        b = single.batch(None, rows=[[i]])
        b.pop("num_tokens")
        total = total + model(**b, num_items_in_batch=n, use_cache=False).loss
    ref = torch.autograd.grad(total, list(model.parameters()))
    torch.testing.assert_close(loss, total, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)


def test_step_loss_is_the_global_target_mean_under_data_parallel(tmp_path):
    """Two data-parallel ranks of unequal target counts: each rank's loss, / accumulation, and
    the gradients averaged over the ranks (DDP) equal one process's step over all four rows."""
    from fastllm.train.sft_data import prepare_step

    recs = [("completion", ("q", "x" * n)) for n in (2, 9, 5, 16)]
    path = tokenize_records(recs, ByteTokenizer(), str(tmp_path))
    ds = SFTDataset(path, range(4), seq_len=32, seed=0, packing=False)
    model = _tiny_llama(257, "sdpa")
    params = list(model.parameters())

    def grads(micro, reduce=None, dp=1):
        counts = prepare_step(micro, reduce, dp)
        loss = sum(model(**b, use_cache=False).loss for _, b in micro) / len(micro)
        return counts, torch.autograd.grad(loss, params)

    def micro(rows):
        return [(None, ds.batch(None, rows=[[r] for r in part])) for part in rows]

    one, ref = grads(micro([[0, 1], [2, 3]]))
    total = one[0], one[1]
    assert one == (4 + 3 + 10 + 6 + 17, 3 + 10 + 6 + 17)  # tokens with EOS; targets
    per_rank = []
    for rows in ([[0], [1]], [[2], [3]]):  # rank 0: short examples, rank 1: long ones
        counts, g = grads(micro(rows), lambda t: torch.tensor(total), dp=2)
        assert counts == total  # logged tokens: every rank's
        per_rank.append(g)
    for r, g0, g1 in zip(ref, *per_rank):
        torch.testing.assert_close((g0 + g1) / 2, r, rtol=1e-5, atol=1e-7)


def test_no_target_tokens_skip_the_step_report_nan_and_refuse_the_data(tmp_path):
    from fastllm.train.evaluate import evaluate_loss
    from fastllm.train.trainer import Trainer

    long_prompt = {"prompt": "p" * 80, "completion": "c"}  # truncated away at seq_len 64
    data = _write(tmp_path / "some.jsonl", [long_prompt, {"prompt": "q", "completion": "abc"}])
    cfg = TrainConfig.from_dict(dict(
        model="tiny", output_dir=str(tmp_path / "run"), max_steps=2, micro_batch_size=1,
        warmup_steps=0, track_memory=False, threads=1, checkpoint=dict(interval=0),
        data=dict(path=data, seq_len=64, packing=False, cache_dir=str(tmp_path / "cache"))))
    Trainer(cfg, log=lambda text: None).train()
    recs = [json.loads(line) for line in open(os.path.join(cfg.output_dir, "metrics.jsonl"))]
    empty = [r for r in recs if r["tokens"] == 64]  # the truncated row
    full = [r for r in recs if r["tokens"] != 64]
    assert len(empty) == len(full) == 1
    assert empty[0]["skipped"] and math.isnan(empty[0]["loss"]) and empty[0]["grad_norm"] is None
    assert not full[0]["skipped"] and math.isfinite(full[0]["loss"]) and full[0]["loss"] > 0
    path = tokenize_records(read_records(data), ByteTokenizer(), str(tmp_path / "cache"))
    nothing = SFTDataset(path, [0], seq_len=64, seed=0)
    out = evaluate_loss(_tiny_llama(257, "sdpa"), nothing, 2, "cpu")
    assert out["eval_tokens"] == 0 and math.isnan(out["eval_loss"])
    only_long = _write(tmp_path / "none.jsonl", [long_prompt])
    cfg.data.path, cfg.output_dir = only_long, str(tmp_path / "run2")
    with pytest.raises(ValueError, match="no training example has a target token within "
                                         "data.seq_len=64"):
        Trainer(cfg, log=lambda text: None).train()


def test_hf_argument_names():
    cfg = TrainConfig.from_args(["learning_rate=1e-3", "min_lr=1e-4", "save_steps=7",
                                 "per_device_train_batch_size=2", "gradient_accumulation_steps=3",
                                 "logging_steps=5", "eval_steps=4"])
    assert (cfg.lr, cfg.checkpoint.interval, cfg.micro_batch_size, cfg.log_interval,
            cfg.eval_interval) == (1e-3, 7, 2, 5, 4)
    assert cfg.gradient_accumulation_steps == 3  # a step: 2 x 3 x dp (test_compare_hf)
    cfg = TrainConfig.from_dict({"learning_rate": 1e-3, "min_lr": 0, "save_steps": 3,
                                 "checkpoint": {"keep_last": 1}})
    assert cfg.lr == 1e-3 and cfg.checkpoint.interval == 3 and cfg.checkpoint.keep_last == 1
    with pytest.raises(ConfigError, match="learning_rate is lr"):
        TrainConfig.from_dict({"learning_rate": 1e-3, "lr": 1e-3})


def _sft_cfg(tmp_path, tok_dir, data, **kw):
    cfg = dict(model="tiny", output_dir=str(tmp_path / "run"), max_steps=6, lr=3e-3, min_lr=3e-4,
               warmup_steps=0, micro_batch_size=2, track_memory=False, log_interval=100,
               eval_interval=3, data=dict(path=data, tokenizer=tok_dir, seq_len=64,
                                          cache_dir=str(tmp_path / "cache"), eval_fraction=0.25),
               eval=dict(prompts=["What is the capital of France?"], max_new_tokens=4),
               checkpoint=dict(interval=3))
    for key, value in kw.items():
        cfg[key] = value
    return TrainConfig.from_dict(cfg)


def _chat_data(tmp_path, n=16):
    recs = [{"messages": [{"role": "user", "content": f"What is the capital of France? {i}"},
                          {"role": "assistant", "content": "Paris." * (1 + i % 3)}]}
            for i in range(n)]
    return _write(tmp_path / "chat.jsonl", recs)


def test_sft_run_evaluates_held_out_writes_samples_and_resumes_bitwise(tmp_path, tok_dir,
                                                                      capsys):
    from fastllm.train.evaluate import read_eval
    from fastllm.train.trainer import Trainer

    data = _chat_data(tmp_path)
    cfg = _sft_cfg(tmp_path, tok_dir, data)
    Trainer(cfg).train()
    run = cfg.output_dir
    evals = read_eval(os.path.join(run, "metrics.jsonl"))
    assert [e["eval_step"] for e in evals] == [0, 3, 6]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    # held-out only: the eval set's target tokens are the 4 held-out chats' replies
    from fastllm.train.sft_data import build_datasets

    _, train_set, eval_set = build_datasets(cfg, None, 0, 1, lambda: None)
    held = {tuple(eval_set.tokens[s:e]) for s, e in eval_set.spans}
    train = {tuple(train_set.tokens[s:e]) for s, e in train_set.spans}
    assert len(eval_set.spans) == 4 and not held & train
    assert evals[0]["eval_tokens"] == sum(int(eval_set.mask[s + 1:e].sum())
                                          for s, e in eval_set.spans)
    samples = [json.loads(line) for line in open(os.path.join(run, "samples.jsonl"))]
    assert [s["step"] for s in samples] == [0, 3, 6] and all("output" in s for s in samples)
    # resume from checkpoint-3 reproduces steps 4..6 bitwise
    full = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    import shutil

    shutil.rmtree(os.path.join(run, "checkpoint-6"))
    Trainer(_sft_cfg(tmp_path, tok_dir, data)).train()
    again = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]

    def losses(recs):
        return [(r["step"], r["loss"], r.get("eval_loss")) for r in recs if "step" in r]

    assert losses(again) == losses(full)
    from fastllm.cli import main

    main(["report", run, "--out", str(tmp_path / "r.png")])
    assert "eval at step 6: loss" in capsys.readouterr().out


@pytest.mark.parametrize("dora", [False, True])
def test_export_merged_and_adapter_load_in_transformers_and_peft(tmp_path, tok_dir, dora,
                                                                capsys):
    import peft
    from transformers import AutoModelForCausalLM

    from fastllm.export import export, load_model, load_run
    from fastllm.train.trainer import Trainer

    data = _chat_data(tmp_path, n=8)
    cfg = _sft_cfg(tmp_path, tok_dir, data, finetune="lora", max_steps=2, eval_interval=0,
                   eval={}, lr=3e-2)
    cfg.data.eval_fraction = 0.0
    cfg.lora.target_modules = ["q_proj", "v_proj", "down_proj"]
    cfg.lora.use_dora = dora
    Trainer(cfg).train()
    model, tok, _ = load_run(cfg.output_dir)
    ids = torch.tensor([tok.encode("What is the capital of France?")])
    with torch.no_grad():
        want = model(input_ids=ids).logits
    from fastllm.cli import main

    merged = str(tmp_path / "merged")
    main(["export", cfg.output_dir, merged, "--merged"])
    hf = AutoModelForCausalLM.from_pretrained(merged)
    assert not any("lora" in k for k in hf.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
    assert os.path.exists(os.path.join(merged, "tokenizer.json"))
    assert os.path.exists(os.path.join(merged, "generation_config.json"))
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(merged).chat_template == CHATML
    if not dora:  # the adapter and loader paths are the same code for both
        return
    adapter = export(cfg.output_dir, str(tmp_path / "adapter"))
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        base = json.load(f)["base_model_name_or_path"]
    pm = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
    with torch.no_grad():
        torch.testing.assert_close(pm(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    # fastllm generate's loader reads the adapter folder and the merged folder alike
    for folder in (adapter, merged, cfg.output_dir):
        m, _ = load_model(folder)
        with torch.no_grad():
            torch.testing.assert_close(m(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
    main(["generate", merged, "What is the capital of France?", "--max-new-tokens", "3"])
    assert capsys.readouterr().out.strip()


def test_exports_of_a_byte_tokenizer_run_load_and_generate(tmp_path, capsys):
    # the byte tokenizer (data.tokenizer's default) has no files: export wrote none, and
    # load_model / fastllm generate failed on the export asking for sentencepiece or tiktoken
    from transformers import AutoTokenizer

    from fastllm.cli import main
    from fastllm.export import export, load_model, load_run
    from fastllm.train.trainer import Trainer

    data = _write(tmp_path / "d.jsonl", [{"prompt": f"{i} + 1 =", "completion": f" {i + 1}"}
                                         for i in range(8)])
    cfg = _sft_cfg(tmp_path, "byte", data, finetune="lora", max_steps=1, eval_interval=0,
                   eval={}, lr=3e-2)
    cfg.data.eval_fraction = 0.0
    Trainer(cfg).train()
    model, tok, _ = load_run(cfg.output_dir)
    assert isinstance(tok, ByteTokenizer)
    text = "1 + 1 = <|endoftext|> é ✓ 😀"
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        want = model(input_ids=ids).logits
    capsys.readouterr()
    main(["generate", cfg.output_dir, "7 + 1 =", "--max-new-tokens", "4"])
    said = capsys.readouterr().out
    for merged in (True, False):
        out = export(cfg.output_dir, str(tmp_path / f"out-{merged}"), merged=merged)
        m, t = load_model(out)
        assert (t.encode(text), t.eos_token_id, t.vocab_size) == (tok.encode(text), 256, 257)
        assert t.decode(list(range(256))) == tok.decode(list(range(256)))
        with torch.no_grad():
            torch.testing.assert_close(m(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
        main(["generate", out, "7 + 1 =", "--max-new-tokens", "4"])
        got = capsys.readouterr().out
        assert got == said or merged  # merged: the same up to rounding, which may flip a tie
        hf = AutoTokenizer.from_pretrained(out)  # and a transformers consumer reads it too
        assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    # an export without the files (by an older fastllm) is refused naming the byte tokenizer
    for name in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(os.path.join(out, name))
        os.remove(os.path.join(out, "base_model", name))
    with pytest.raises(FileNotFoundError, match=r"no tokenizer files .*data.tokenizer=byte"):
        load_model(out)


def test_examples_parse():
    import glob

    names = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "examples", "*.yaml")))
    modes = {TrainConfig.load(n).validate().finetune for n in names}
    assert modes == {"full", "freeze", "lora", "prefix", "galore", "badam"}
    dora = TrainConfig.load(os.path.join(os.path.dirname(names[0]), "sft_dora.yaml"))
    assert dora.lora.use_dora and dora.lr == 2e-4
    qlora = TrainConfig.load(os.path.join(os.path.dirname(names[0]), "sft_qlora.yaml"))
    assert qlora.lora.quantize_base == "nf4" and qlora.finetune == "lora"
    dpo = TrainConfig.load(os.path.join(os.path.dirname(names[0]), "dpo_lora.yaml"))
    assert dpo.objective == "dpo" and dpo.dpo.rpo_alpha == 1.0 and dpo.finetune == "lora"
    orpo = TrainConfig.load(os.path.join(os.path.dirname(names[0]), "orpo_lora.yaml"))
    assert orpo.objective == "orpo" and orpo.orpo.beta == 0.1 and orpo.finetune == "lora"
    simpo = TrainConfig.from_args(  # (the SimPO line of its comment)
        ["objective=cpo", "cpo.loss_type=simpo", "cpo.cpo_alpha=0", "cpo.beta=2.0"],
        os.path.join(os.path.dirname(names[0]), "orpo_lora.yaml"))
    assert simpo.validate().cpo.loss_type == "simpo" and simpo.cpo.beta == 2.0


def test_compare_hf_runs_the_same_batches(tmp_path, capsys):
    pytest.importorskip("peft")
    from fastllm.train.compare_hf import compare_hf

    data = _write(tmp_path / "d.jsonl", [{"prompt": f"{i} + 1 =", "completion": f" {i + 1}"}
                                         for i in range(20)])
    cfg = TrainConfig.from_dict(dict(
        model="tiny", finetune="lora", output_dir=str(tmp_path / "run"), num_train_epochs=1,
        lr=1e-2, min_lr=1e-3, warmup_steps=1, micro_batch_size=2, gradient_accumulation_steps=2,
        track_memory=False, eval=dict(batches=1),  # (the HF side evaluated every batch)
        data=dict(path=data, seq_len=24, cache_dir=str(tmp_path / "cache"), eval_fraction=0.2,
                  packing=False)))
    (_, mine), (_, theirs) = compare_hf(cfg)
    # 16 training examples, one a row, 4 a step
    assert mine["steps"] == theirs["steps"] == 4
    assert math.isclose(mine["first_loss"], theirs["first_loss"], rel_tol=1e-5)
    # the same adapters to start from (PEFT drew its lora_A from the seed in another order)
    assert math.isclose(mine["final_loss"], theirs["final_loss"], rel_tol=1e-4)
    assert math.isclose(mine["eval_loss"], theirs["eval_loss"], rel_tol=1e-4)
    out = capsys.readouterr().out  # (track_memory=False: no peak on the HF side, no ratio)
    assert "fastllm / hf: tokens/s" in out and "peak memory not compared" in out
