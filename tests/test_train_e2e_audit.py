"""fastllm train as a user fine-tuning a pretrained model meets it: a mistyped tokenizer or data
file is refused by name before the run folder is written, `--help` works after the overrides and
lists every config key, a resume with another LoRA alpha or dropout names the key; and (with
FASTLLM_TEST_MODEL=<a SmolLM2 folder>) LoRA SFT on chat JSONL resumed mid-run gives the
uninterrupted run's losses, and its PEFT adapter and merged export give the trained model's
logits in peft and transformers; a bf16/fp16 built-in model gives its exported folder's
logits (RoPE's inv_freq kept fp32)."""

import dataclasses
import json
import os
import shutil

import pytest
import torch

from fastllm.train.config import ConfigError, TrainConfig

SMOLLM2 = os.environ.get("FASTLLM_TEST_MODEL", "")


@pytest.mark.parametrize("overrides,says", [
    # a typo here reached AutoTokenizer.from_pretrained: an OSError traceback about the Hub
    (["data.tokenizer=/no/such/tokenizer"], "data.tokenizer='/no/such/tokenizer' is neither "
                                            "byte, bpe nor a folder"),
    (["data.tokenizer=byt"], "data.tokenizer='byt' is neither byte, bpe nor a folder"),
    (["model={model}", "data.tokenizer=bpe"], "data.tokenizer=bpe trains a new vocabulary"),
    (["data.path=no-such.jsonl"], "data.path=no-such.jsonl does not exist"),
    (["data.path={data}", "data.eval_path=no-such.jsonl"], "data.eval_path=no-such.jsonl does"),
    (["eval.prompts_file=no-such.txt"], "eval.prompts_file=no-such.txt does not exist"),
])
def test_a_mistyped_tokenizer_or_file_is_refused_before_the_run_folder_is_written(
        tmp_path, overrides, says):
    from fastllm.train.trainer import Trainer

    model = tmp_path / "model"  # a folder is a model folder to the config
    model.mkdir()
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a", "completion": " b"}\n')
    out = tmp_path / "run"
    args = [a.format(model=model, data=data) for a in overrides]
    cfg = TrainConfig.from_args(["max_steps=1", f"output_dir={out}", *args])
    with pytest.raises(ConfigError, match=says):
        Trainer(cfg, log=lambda text: None).train()
    assert not out.exists()


def test_help_after_overrides_prints_the_help_naming_every_config_key(capsys):
    from fastllm.cli import main

    # argparse's REMAINDER took --help for an override: "expected key=value, got '--help'"
    for flag in ("--help", "-h"):
        with pytest.raises(SystemExit) as e:
            main(["train", "finetune=lora", flag])
        assert e.value.code in (0, None)
        assert "usage: fastllm train" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    cfg = TrainConfig()
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            keys = ", ".join(g.name for g in dataclasses.fields(value))
            assert f"{f.name}.{{{keys}}}" in text
        else:
            assert f" {f.name}," in text or f" {f.name};" in text, f.name
    assert "learning_rate (lr)" in text


def test_one_key_under_two_names_on_the_command_line_is_refused():
    # (a config file giving both was refused; on the command line the later one won silently)
    with pytest.raises(ConfigError, match="learning_rate and lr are the same key"):
        TrainConfig.from_args(["lr=1e-3", "learning_rate=2e-3"])
    assert TrainConfig.from_args(["lr=1e-3", "lr=2e-3"]).lr == 2e-3  # one name: the later wins


def test_malformed_prompts_jsonl_names_the_line(tmp_path):
    from fastllm.train.evaluate import read_prompts

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b"\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl line 2: not valid JSON"):
        read_prompts([], str(path))


@pytest.mark.parametrize("change", ["lora.alpha=32", "lora.dropout=0.1",
                                    "lora.quantize_base=nf4"])
def test_resume_with_another_lora_scaling_names_the_key(tmp_path, change):
    """fastllm's load_adapter refuses layers whose alpha or dropout differ from the saved
    adapter_config.json: a resume hit it after the model was built, saying "unload(model) first"
    (a library call a `fastllm train` user cannot make). A dense base turned 4-bit (or back) at
    a resume went through silently, the adapter then trained over other base weights."""
    from fastllm.train.trainer import Trainer

    out, text = tmp_path / "run", tmp_path / "t.txt"
    text.write_text("the capital of France is Paris. " * 40)

    def run(*extra):
        args = ["model=tiny", "finetune=lora", f"data.path={text}", "data.seq_len=32",
                "micro_batch_size=2",
                "threads=1", "track_memory=false", "log_interval=100", "lora.alpha=16",
                "lora.dropout=0", f"data.cache_dir={tmp_path / 'cache'}", f"output_dir={out}"]
        return Trainer(TrainConfig.from_args(args + list(extra)), log=lambda text: None).train()

    run("max_steps=1")
    key = change.split("=")[0]
    with pytest.raises(ConfigError, match=rf"trained with {key}=.*, this run has {change}"):
        run("max_steps=2", change)
    assert run("max_steps=2")["steps"] == 2


def test_a_key_newer_than_the_checkpoint_is_taken_at_its_default(tmp_path):
    """A checkpoint's config.yaml from before a key existed (lora.quantize_base, 2026-12-06)
    ran with that key's default: the same setting resumes, another is refused."""
    import yaml

    from fastllm.train.checkpoint_layout import check_resume_config

    cfg = TrainConfig.from_args(["model=tiny", "finetune=lora"])
    saved = cfg.to_dict()
    del saved["lora"]["quantize_base"], saved["lora"]["double_quant"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(saved))
    check_resume_config(str(tmp_path), cfg, log=lambda text: None)
    with pytest.raises(ConfigError, match="trained with lora.quantize_base=none, this run has "
                                          "lora.quantize_base=nf4"):
        check_resume_config(str(tmp_path), TrainConfig.from_args(
            ["model=tiny", "finetune=lora", "lora.quantize_base=nf4"]), log=lambda text: None)


# ----- a real pretrained model (skipped without FASTLLM_TEST_MODEL) -----

needs_model = pytest.mark.skipif(not (SMOLLM2 and os.path.isdir(SMOLLM2)),
                                 reason="needs FASTLLM_TEST_MODEL=<a SmolLM2 folder>")


def _capitals(path):
    pairs = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
             ("Japan", "Tokyo"), ("Peru", "Lima")]
    recs = []
    for i, (country, city) in enumerate(pairs):
        user = [{"role": "user", "content": f"Capital of {country}?"}]
        reply = [{"role": "assistant", "content": f"{city}."}]
        # both of TRL's conversational shapes
        recs.append({"messages": user + reply} if i % 2 else {"prompt": user, "completion": reply})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return str(path)


def _sft(tmp_path, name, **kw):
    cfg = dict(model=SMOLLM2, finetune="lora", output_dir=str(tmp_path / name), max_steps=4,
               learning_rate=1e-3, warmup_steps=1, micro_batch_size=2, seed=0, threads=2,
               track_memory=False, log_interval=100, eval_interval=2,
               lora=dict(r=4, alpha=8, dropout=0.1, target_modules=["q_proj", "v_proj"]),
               checkpoint=dict(interval=2),
               data=dict(path=_capitals(tmp_path / "chat.jsonl"), seq_len=64, eval_fraction=0.2,
                         cache_dir=str(tmp_path / "cache")))
    cfg.update(kw)
    return TrainConfig.from_dict(cfg)


def _curve(run):
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [(r.get("step"), r.get("eval_step"), r.get("loss"), r.get("eval_loss"))
                for r in map(json.loads, f)]


@needs_model
def test_smollm2_lora_sft_resumes_identically_and_exports_to_peft_and_transformers(tmp_path):
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fastllm.export import export, load_run
    from fastllm.train.trainer import Trainer

    quiet = dict(log=lambda text: None)
    Trainer(_sft(tmp_path, "whole"), **quiet).train()
    cut = _sft(tmp_path, "cut")
    Trainer(cut, **quiet).train()
    shutil.rmtree(os.path.join(cut.output_dir, "checkpoint-4"))  # as if killed after step 2
    Trainer(_sft(tmp_path, "cut"), **quiet).train()
    whole = _curve(str(tmp_path / "whole"))
    assert _curve(cut.output_dir) == whole and len(whole) == 7  # 4 steps, evals at 0, 2, 4
    assert whole[-1][3] < whole[0][3]  # the held-out loss fell

    model, tok, _ = load_run(cut.output_dir)
    chat = [{"role": "user", "content": "Capital of Peru?"}]
    hf_tok = AutoTokenizer.from_pretrained(SMOLLM2)
    ids = hf_tok.apply_chat_template(chat, add_generation_prompt=True, return_dict=True,
                                     return_tensors="pt")["input_ids"]
    with torch.no_grad():
        want = model(input_ids=ids).logits
        adapter = export(cut.output_dir, str(tmp_path / "adapter"))
        base = AutoModelForCausalLM.from_pretrained(SMOLLM2, dtype=torch.float32)
        assert (base(input_ids=ids).logits - want).abs().max() > 1e-2  # it did train
        pm = peft.PeftModel.from_pretrained(base, adapter)
        torch.testing.assert_close(pm(input_ids=ids).logits, want, rtol=1e-3, atol=1e-3)
        merged = export(cut.output_dir, str(tmp_path / "merged"), merged=True)
        hf = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
        torch.testing.assert_close(hf(input_ids=ids).logits, want, rtol=1e-3, atol=1e-3)
    assert AutoTokenizer.from_pretrained(merged).chat_template == hf_tok.chat_template


def test_export_keeps_a_model_folders_stop_tokens():
    """A model folder's generation_config may list several stop tokens (Llama-3-Instruct: three);
    the export kept only the tokenizer's EOS, so generate on it ran past the others. A built-in
    model's LlamaConfig defaults (bos 1 / eos 2) still become the tokenizer's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fastllm.export import _finish_config

    class Tok:
        eos_token_id, tok = 1, None

    def model():
        m = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, vocab_size=300,
                                         num_hidden_layers=1, num_attention_heads=2))
        m.config.eos_token_id = m.generation_config.eos_token_id = [1, 299]
        return m

    m = model()
    _finish_config(m, Tok(), from_folder=True)
    assert m.generation_config.eos_token_id == [1, 299] and m.config.eos_token_id == [1, 299]
    Tok.eos_token_id = 7
    _finish_config(m, Tok(), from_folder=True)
    assert m.generation_config.eos_token_id == [1, 299, 7]
    m = model()
    m.generation_config.use_cache = False  # (a built-in model's: it trains without a cache)
    _finish_config(m, Tok(), from_folder=False)
    assert m.generation_config.eos_token_id == 7 and m.config.bos_token_id is None
    assert m.generation_config.use_cache  # (transformers' generate fed the whole sequence)


def test_a_built_in_model_has_no_special_token_ids_of_its_own():
    """A built-in model took LlamaConfig's bos 1 / eos 2, which generate_samples added to the
    tokenizer's stop tokens: a sample stopped at token 2 (`"` of a trained BPE)."""
    from fastllm.train.model import build_model

    m = build_model(TrainConfig.from_args(["model=tiny"]), 300, torch.float32)
    assert m.config.eos_token_id is None and m.generation_config.eos_token_id is None
    assert m.config.bos_token_id is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_low_precision_built_in_model_gives_its_exported_folders_logits(tmp_path, dtype):
    """build_model's cast to bf16/fp16 also cast RoPE's inv_freq, which transformers keeps fp32
    when it loads a folder: the run and its export gave other logits (bf16: 0.0078 apart)."""
    from transformers import AutoModelForCausalLM

    from fastllm.train.model import build_model

    cfg = TrainConfig.from_args(["model=tiny"])
    model = build_model(cfg, 300, dtype).eval()
    rope, exact = model.model.rotary_emb, build_model(cfg, 300, torch.float32).model.rotary_emb
    for name in ("inv_freq", "original_inv_freq"):
        assert torch.equal(getattr(rope, name), getattr(exact, name))  # fp32, not re-widened
    assert model.model.embed_tokens.weight.dtype == dtype
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval()
    ids = torch.randint(0, 300, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)


def _tiny_lm(vocab=257):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, vocab_size=vocab,
                                        num_hidden_layers=1, num_attention_heads=2)).eval()


def test_generation_stops_at_every_stop_token_of_the_generation_config():
    """A model's generation_config may list stop tokens beside the tokenizer's EOS (Llama-3's
    <|eot_id|>): model.generate stops at any; fastllm generate passed the tokenizer's alone."""
    from fastllm.train.data import ByteTokenizer
    from fastllm.train.evaluate import generate_samples

    model, tok = _tiny_lm(), ByteTokenizer()
    ids = torch.tensor([tok.encode("hello")])
    first = int(model(input_ids=ids).logits[0, -1].argmax())
    assert generate_samples(model, tok, ["hello"], max_new_tokens=4) != [""]
    model.generation_config.eos_token_id = [first]
    assert generate_samples(model, tok, ["hello"], max_new_tokens=4) == [""]


def test_model_and_tokenizer_folders_are_kept_absolute(tmp_path, monkeypatch):
    """config.yaml names the model folder for fastllm export and generate, which may run from
    elsewhere: a relative one was looked up from their working directory. A run saved with the
    relative path still resumes (the same folder)."""
    from fastllm.train.checkpoint_layout import _same

    (tmp_path / "hf").mkdir()
    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig.from_args(["model=hf", "data.tokenizer=hf"]).check_files()
    assert cfg.model == str(tmp_path / "hf") and cfg.data.tokenizer == str(tmp_path / "hf")
    assert _same("model", "hf", cfg.model) and not _same("model", "other", cfg.model)
    assert TrainConfig.from_args(["model=tiny"]).check_files().model == "tiny"


def test_a_text_folder_is_read_whatever_its_names(tmp_path):
    """NOTES.TXT and README.MD were skipped (case-sensitive glob), a folder named data[1] found
    no files (a glob character class), and a folder named site.md crashed the run."""
    from fastllm.train.data import load_text

    root = tmp_path / "data[1]"
    (root / "site.md").mkdir(parents=True)
    (root / "site.md" / "index.txt").write_text("inner")
    (root / "NOTES.TXT").write_text("upper")
    (root / "b.Md").write_text("mixed")
    (root / "skip.json").write_text("{}")
    assert sorted(load_text(str(root))) == ["inner", "mixed", "upper"]
    with pytest.raises(ConfigError, match="data.vocab_size=100 with data.tokenizer=bpe"):
        TrainConfig.from_args(["data.tokenizer=bpe", "data.vocab_size=100"])
