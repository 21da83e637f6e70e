"""fastllm train checks what only the model or the tokenizer can tell before it writes anything: a
lora.target_modules entry that names no nn.Linear (a typo) is refused on the model's meta
skeleton (no weights read) with the names there are; eval.prompts_file records carry TRL's
per-record `tools` and `chat_template_kwargs` into the chat template of the generation prompt,
and are refused where the tokenizer has no chat template (built-in model, a tiny HF folder), as
chat training records are (the first record of each data file is read, for train and eval
files, JSON Lines and arrays, folders and data.format=jsonl). A PEFT adapter folder given as
model= and freeze.layers / lora.layers above the model's layer count are refused too."""

import json
import os
import re

import pytest
import torch

from fastllm.train import TrainConfig, Trainer
from fastllm.train.config import ConfigError

from _tiny_tokenizer import tiny_bpe

# ChatML with a tools block and a template variable, as tests/test_sft_data_audit.py's
TOOLS = ("{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}"
         "{% if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='name') | join(',') }}"
         "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
         "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
         "<|im_start|>assistant\n{% endif %}")
WEATHER = [{"name": "weather", "parameters": {"type": "object"}}]
# the words the tokenizer's BPE is trained on
WORDS = "user assistant system Tools: weather What is the capital of France? Paris."

pytestmark = pytest.mark.usefixtures("one_thread")


def _hf_folder(path, template=TOOLS, weights=True):
    """A 2-layer Llama (random weights) with a ChatML BPE tokenizer; weights=False: config.json
    and the tokenizer only."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tiny_bpe(template, words=WORDS, pad="<|im_end|>")
    tok.save_pretrained(path)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=128, eos_token_id=tok.eos_token_id)
    if weights:
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(path)
    else:
        config.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return _hf_folder(tmp_path_factory.mktemp("hf-model"))


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "t.txt"
    path.write_text("What is the capital of France? Paris. " * 20)
    return str(path)


def _args(model, text, out, *extra):
    return [f"model={model}", f"data.path={text}", "data.seq_len=32", "micro_batch_size=2",
            "threads=1", "track_memory=false", "log_interval=100", "warmup_steps=1",
            f"data.cache_dir={out.parent / 'cache'}", f"output_dir={out}", *extra]


# ----- lora.target_modules -----

# the names there are: the layers' last names, in the model's order
NAMES = "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head"


@pytest.mark.parametrize("targets,says", [
    ("[q_prj]", f"no nn.Linear in the model matches 'q_prj'; its nn.Linear layers are named "
                f"{NAMES}"),
    ("[q_proj,v_prj]", "matches 'v_prj'"),          # one typo among good names
    ("[self_attn]", "matches 'self_attn'"),         # a module, but no nn.Linear
    ("[q_proj,all-linear]", "'all-linear' .* stands alone"),
])
@pytest.mark.parametrize("model", ["tiny", "hf"])
@pytest.mark.parametrize("backend", ["fastllm", "torch"])
def test_a_lora_target_typo_is_refused_before_the_run_folder_is_written(
        tmp_path, hf_model, text, targets, says, model, backend):
    out = tmp_path / "run"
    cfg = TrainConfig.from_args(_args(hf_model if model == "hf" else "tiny", text, out,
                                      "finetune=lora", f"backend={backend}", "max_steps=1",
                                      f"lora.target_modules={targets}"))
    if backend == "torch":  # PEFT adapts embeddings too: they are among the names
        says = says.replace("nn.Linear", "nn.Linear, nn.Embedding or convolution").replace(
            "named q_proj", "named embed_tokens, q_proj")
    with pytest.raises(ConfigError, match=f"^fastllm train: lora.target_modules: .*{says}"):
        Trainer(cfg, log=lambda t: None).train()
    assert not out.exists()


def test_the_typo_is_found_without_reading_weights_and_under_lora_layers(tmp_path, text):
    """A folder with config.json but no weights: the skeleton is enough. lora.layers=1 adapts the
    last layer only, where a full name of layer 0 matches nothing."""
    folder = _hf_folder(tmp_path / "config-only", weights=False)
    out = tmp_path / "run"
    for targets, bad in (("[q_prj]", "q_prj"),
                         ("[model.layers.0.self_attn.q_proj]", "model.layers.0.self_attn.q_proj")):
        cfg = TrainConfig.from_args(_args(folder, text, out, "finetune=lora", "lora.layers=1",
                                          f"lora.target_modules={targets}"))
        with pytest.raises(ConfigError, match=rf"matches {re.escape(repr(bad))}.*\(lora.layers=1"):
            Trainer(cfg, log=lambda t: None).train()
        assert not out.exists()


def test_the_cli_names_the_typo_and_writes_nothing(tmp_path, text):
    from fastllm.cli import main

    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["train", *_args("tiny", text, out, "finetune=lora", "lora.target_modules=q_prj")])
    assert ("lora.target_modules: no nn.Linear in the model matches 'q_prj'; its nn.Linear "
            "layers are named q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, "
            "lm_head" in str(e.value.code))
    assert not out.exists()


def test_the_late_check_gives_the_same_names():
    """inject_lora itself (a library user's, or the trainer's after the preflight) names the
    layers there are too."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from fastllm.lora import inject_lora

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match=r"no nn.Linear in the model matches \['q_prj'\]; its "
                                         r"nn.Linear layers are named .*q_proj.*down_proj"):
        inject_lora(model, target_modules=["q_prj"])


@pytest.mark.parametrize("targets", ["all-linear", "ALL-LINEAR", "[q_proj,v_proj]", "o_proj",
                                     "[model.layers.1.self_attn.q_proj]"])
@pytest.mark.parametrize("model", ["tiny", "hf"])
def test_good_targets_pass_the_preflight(tmp_path, hf_model, text, targets, model):
    from fastllm.train.preflight import check_lora_targets

    cfg = TrainConfig.from_args(_args(hf_model if model == "hf" else "tiny", text,
                                      tmp_path / "run", "finetune=lora",
                                      f"lora.target_modules={targets}"))
    check_lora_targets(cfg)
    assert not (tmp_path / "run").exists()


# ----- eval.prompts_file: TRL's per-record tools and chat_template_kwargs -----

def _prompts(path, *records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_a_prompt_records_tools_and_template_kwargs_reach_the_chat_template(tmp_path):
    from fastllm.train.data import HFTokenizer
    from fastllm.train.evaluate import chat_prompt_ids, read_prompt_records

    path = _prompts(tmp_path / "p.jsonl",
                    {"prompt": "What is the weather?", "tools": WEATHER,
                     "chat_template_kwargs": {"enable_thinking": False}},
                    {"prompt": "Capital of France?", "tools": None})
    records = read_prompt_records(["Hi"], path)
    assert records == [("Hi", {}, "eval.prompts[0]"),
                       ("What is the weather?",
                        {"tools": WEATHER, "chat_template_kwargs": {"enable_thinking": False}},
                        f"{path} line 1"),
                       ("Capital of France?", {}, f"{path} line 2")]
    fast = tiny_bpe(TOOLS, words=WORDS, pad="<|im_end|>")
    tok = HFTokenizer(fast, "chatml")
    text, template, _ = records[1]
    ids = chat_prompt_ids(tok, text, template)
    user = [{"role": "user", "content": text}]
    # as a training record is rendered (tests/test_sft_data_audit.py): apply_chat_template's
    # tools= and the kwargs as template variables
    want = fast.apply_chat_template(user, tools=WEATHER, tokenize=False,
                                    add_generation_prompt=True, enable_thinking=False)
    assert want.startswith("/no_think\n<|im_start|>system\nTools: weather<|im_end|>")
    assert ids == fast(want, add_special_tokens=False)["input_ids"]
    plain = fast.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    assert chat_prompt_ids(tok, text) == fast(plain, add_special_tokens=False)["input_ids"]
    # without a chat template there is nothing to render them with (a library caller's refusal)
    with pytest.raises(ValueError, match="'tools' and 'chat_template_kwargs' are rendered by a "
                                         "chat template; tokenizer plain has none"):
        chat_prompt_ids(HFTokenizer(tiny_bpe(None, words=WORDS, pad="<|im_end|>"), "plain"),
                        text, template)


def test_a_prompt_without_a_template_is_tokenised_as_training_tokenises_it():
    """A tokenizer whose post-processor appends EOS (Llama's add_eos_token): tok(prompt) ended
    the generation prompt with EOS, where training's prompt (BOS + text) has none."""
    from tokenizers import processors

    from fastllm.train.data import HFTokenizer
    from fastllm.train.evaluate import chat_prompt_ids
    from fastllm.train.sft_data import encode_example

    fast = tiny_bpe(None, specials=("<s>", "</s>"), bos="<s>", eos="</s>")
    ids = {t: fast.backend_tokenizer.token_to_id(t) for t in ("<s>", "</s>")}
    fast.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=list(ids.items()))
    tok = HFTokenizer(fast, "eos-appending")
    prompt = "What is the capital of France?"
    trained, mask = encode_example(("completion", (prompt, " Paris.")), tok)
    want = trained[:mask.index(1)]
    assert want[0] == ids["<s>"] and ids["</s>"] not in want
    assert chat_prompt_ids(tok, prompt) == want
    assert chat_prompt_ids(fast, prompt) == want  # a transformers tokenizer itself


@pytest.mark.parametrize("record,says", [
    ({"prompt": "a", "tools": {"name": "weather"}}, "line 1: key 'tools' must be a list"),
    ({"prompt": "a", "chat_template_kwargs": [1]}, "line 1: key 'chat_template_kwargs' must be"),
    ({"prompt": "a", "chat_template_kwargs": {"add_generation_prompt": False}},
     r"line 1: key 'chat_template_kwargs' sets \['add_generation_prompt'\]"),
    ({"prompt": ["a"]}, r"line 1: expected \{\"prompt\": a string\}"),
])
def test_a_malformed_prompt_record_is_refused_before_the_run_folder_is_written(
        tmp_path, hf_model, text, record, says):
    out = tmp_path / "run"
    prompts = _prompts(tmp_path / "p.jsonl", record)
    cfg = TrainConfig.from_args(_args(hf_model, text, out, "max_steps=1",
                                      f"eval.prompts_file={prompts}"))
    with pytest.raises(ValueError, match=says):
        Trainer(cfg, log=lambda t: None).train()
    assert not out.exists()


@pytest.mark.parametrize("model", ["tiny", "hf-without-template"])
def test_tools_without_a_chat_template_are_refused_before_the_run_folder_is_written(
        tmp_path, text, model):
    if model == "tiny":
        model, name = "tiny", "byte"
    else:
        model = name = _hf_folder(tmp_path / "plain", template=None, weights=False)
    out = tmp_path / "run"
    prompts = _prompts(tmp_path / "p.jsonl", {"prompt": "a"},
                       {"prompt": "What is the weather?", "tools": WEATHER})
    cfg = TrainConfig.from_args(_args(model, text, out, "max_steps=1",
                                      f"eval.prompts_file={prompts}"))
    with pytest.raises(ConfigError, match=rf"{re.escape(prompts)} line 2: 'tools' and "
                                          rf"'chat_template_kwargs' are rendered by a chat "
                                          rf"template; tokenizer {re.escape(name)} has none"):
        Trainer(cfg, log=lambda t: None).train()
    assert not out.exists()


def test_eval_samples_are_generated_with_each_prompts_tools(tmp_path, hf_model, text,
                                                            monkeypatch):
    from fastllm.train import evaluate

    seen = []
    real = evaluate.chat_prompt_ids

    def spy(tokenizer, prompt, template=None):
        ids = real(tokenizer, prompt, template)
        seen.append((prompt, tokenizer.decode(ids)))
        return ids

    monkeypatch.setattr(evaluate, "chat_prompt_ids", spy)
    out = tmp_path / "run"
    prompts = _prompts(tmp_path / "p.jsonl", {"prompt": "Capital of France?"},
                       {"prompt": "What is the weather?", "tools": WEATHER,
                        "chat_template_kwargs": {"enable_thinking": False}})
    Trainer(TrainConfig.from_args(_args(hf_model, text, out, "max_steps=1", "finetune=lora",
                                        "lora.target_modules=all-linear",
                                        f"eval.prompts_file={prompts}", "eval.max_new_tokens=2")),
            log=lambda t: None).train()
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["prompt"]) for s in samples] == [
        (0, "Capital of France?"), (0, "What is the weather?"),
        (1, "Capital of France?"), (1, "What is the weather?")]
    assert [p for p, _ in seen] == [s["prompt"] for s in samples]
    plain, tools = seen[:2]
    assert "Tools:" not in plain[1] and plain[1].startswith("<|im_start|>user\nCapital")
    assert tools[1].startswith("/no_think\n<|im_start|>system\nTools: weather<|im_end|>\n"
                               "<|im_start|>user\nWhat is the weather?<|im_end|>\n"
                               "<|im_start|>assistant\n")


# ----- chat training records need a chat template -----

CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"},
                     {"role": "assistant", "content": "Paris."}]}
CHAT_COMPLETION = {"prompt": [{"role": "user", "content": "What is the capital of France?"}],
                   "completion": [{"role": "assistant", "content": "Paris."}]}
COMPLETION = {"prompt": "What is the capital of France?", "completion": " Paris."}
ALPACA = {"instruction": "Name the capital.", "input": "France", "output": "Paris."}


def _jsonl(path, *records):
    """JSON Lines of `records` (a string as it is: a blank line, or a line that is no JSON)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return str(path)


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory):
    """An HF folder whose tokenizer has no chat template (config.json and the tokenizer only)."""
    return _hf_folder(tmp_path_factory.mktemp("plain"), template=None, weights=False)


def _chat_data(tmp_path, layout, chat):
    """(overrides naming the data, where its chat record is) for each way a run reads JSONL."""
    d = tmp_path / "data"
    if layout == "jsonl":  # after a blank line: the record's own line is named
        path = _jsonl(d / "c.jsonl", "", chat, COMPLETION)
        return [f"data.path={path}"], f"{path} line 2"
    if layout == "json-array":  # the rest of the array is not read, nor parsed
        path = d / "c.json"
        d.mkdir()
        path.write_text(" [\n" + json.dumps(chat) + ",\n{broken")
        return [f"data.path={path}"], f"{path} record 0"
    if layout == "folder":  # a text file first, then the chats
        _jsonl(d / "a" / "1.jsonl", {"text": "Paris."})
        path = _jsonl(d / "b" / "2.jsonl", chat)
        return [f"data.path={d}"], f"{path} line 1"
    if layout == "eval-path":  # the training records need no template, the held-out ones do
        train, held = _jsonl(d / "t.jsonl", COMPLETION), _jsonl(d / "e.jsonl", chat)
        return [f"data.path={train}", f"data.eval_path={held}"], f"{held} line 1"
    assert layout == "format-jsonl"  # JSONL under another name, as data.format declares
    path = _jsonl(d / "c.txt", chat)
    return [f"data.path={path}", "data.format=jsonl"], f"{path} line 1"


@pytest.mark.parametrize("layout", ["jsonl", "json-array", "folder", "eval-path", "format-jsonl"])
@pytest.mark.parametrize("chat", [CHAT, CHAT_COMPLETION], ids=["messages", "prompt-completion"])
@pytest.mark.parametrize("tokenizer", ["byte", "bpe", "hf-without-template"])
def test_chat_data_without_a_chat_template_is_refused_before_the_run_folder_is_written(
        tmp_path, plain_model, layout, chat, tokenizer):
    data, where = _chat_data(tmp_path, layout, chat)
    model, name = ((plain_model, plain_model) if tokenizer == "hf-without-template" else
                   ("tiny", tokenizer))
    out = tmp_path / "run"
    cfg = TrainConfig.from_args(_args(model, "unused", out, "max_steps=1",
                                      f"data.tokenizer={name}", *data))
    with pytest.raises(ConfigError, match=rf"^fastllm train: {re.escape(where)}: chat examples "
                                          rf"need a tokenizer with a chat template; "
                                          rf"{re.escape(name)} has none \(data.tokenizer="):
        Trainer(cfg, log=lambda t: None).train()
    assert not out.exists()


def test_the_cli_names_the_chat_record_and_writes_nothing(tmp_path):
    from fastllm.cli import main

    data = _jsonl(tmp_path / "c.jsonl", CHAT)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["train", *_args("tiny", data, out)])
    assert (f"{data} line 1: chat examples need a tokenizer with a chat template; byte has none "
            f"(data.tokenizer=<a model folder>, or model=<an HF folder>)" in str(e.value.code))
    assert not out.exists()


def _template_in_tokenizer_config(folder):
    """The folder's chat template moved from chat_template.jinja into tokenizer_config.json, where
    tokenizers saved by transformers < 4.47 keep it."""
    jinja = os.path.join(folder, "chat_template.jinja")
    with open(jinja) as f:
        template = f.read()
    os.remove(jinja)
    config = os.path.join(folder, "tokenizer_config.json")
    with open(config) as f:
        saved = json.load(f)
    with open(config, "w") as f:
        json.dump(dict(saved, chat_template=template), f)
    return folder


@pytest.mark.parametrize("case", ["jinja", "tokenizer-config", "tokenizer-folder", "alpaca",
                                  "text-format", "completion"])
def test_data_the_tokenizer_can_render_passes_the_chat_check(tmp_path, hf_model, plain_model,
                                                             case):
    """A template in chat_template.jinja or (older folders) tokenizer_config.json, a tokenizer
    folder beside a built-in model; Alpaca records (Stanford Alpaca's prompt without a template),
    chat records read as text (data.format=text) and plain prompt + completion need none."""
    from transformers import AutoTokenizer

    from fastllm.train.preflight import check_chat_data

    chat, model, extra = _jsonl(tmp_path / "c.jsonl", CHAT), "tiny", []
    if case == "jinja":
        model = hf_model
    elif case == "tokenizer-config":
        model = _template_in_tokenizer_config(_hf_folder(tmp_path / "old", weights=False))
        assert not os.path.exists(os.path.join(model, "chat_template.jinja"))
        assert AutoTokenizer.from_pretrained(model).chat_template == TOOLS
    elif case == "tokenizer-folder":
        extra = [f"data.tokenizer={hf_model}"]
    elif case == "alpaca":
        model, chat = plain_model, _jsonl(tmp_path / "a.jsonl", ALPACA)
    elif case == "text-format":
        extra = ["data.format=text"]
    else:
        chat = _jsonl(tmp_path / "p.jsonl", COMPLETION)
    cfg = TrainConfig.from_args(_args(model, chat, tmp_path / "run", *extra))
    check_chat_data(cfg)
    assert not (tmp_path / "run").exists()


def test_a_chat_record_after_other_records_is_refused_when_tokenised_with_the_same_words(
        tmp_path, text):
    """The check reads each file's first record only (not the whole dataset twice); a chat
    further on is refused when the run tokenises it, in the same words, naming its line."""
    from fastllm.train.preflight import check_chat_data

    data = _jsonl(tmp_path / "c.jsonl", COMPLETION, CHAT)
    out = tmp_path / "run"
    cfg = TrainConfig.from_args(_args("tiny", data, out, "max_steps=1"))
    check_chat_data(cfg)
    with pytest.raises(ValueError, match=r"^fastllm train: .*c\.jsonl line 2: chat examples need "
                                         r"a tokenizer with a chat template; byte has none "
                                         r"\(data.tokenizer="):
        Trainer(cfg, log=lambda t: None).train()


@pytest.mark.parametrize("value,says", [("cpu", "FASTLLM_BACKEND='cpu' is not one of"),
                                        ("cuda", "FASTLLM_BACKEND=cuda cannot run here")])
def test_a_forced_backend_that_cannot_run_is_refused_before_the_run_folder(
        tmp_path, monkeypatch, value, says):
    """FASTLLM_BACKEND was read at the first op: a typo, or a backend this device has not, failed
    a run that had already written its folder."""
    monkeypatch.setenv("FASTLLM_BACKEND", value)
    out = tmp_path / "run"
    cfg = TrainConfig.from_args(["model=tiny", "max_steps=1", "device=cpu",
                                 f"output_dir={out}"])
    with pytest.raises(ConfigError, match=re.escape(says)):
        Trainer(cfg).train()
    assert not out.exists()


# ----- the model folder and its layer count -----

def test_a_peft_adapter_folder_as_the_model_is_refused_before_the_run_folder(tmp_path, hf_model,
                                                                             text):
    """transformers' from_pretrained loads the base an adapter_config.json names and applies the
    adapter on top: finetune=full trained base and adapter weights both, and the run's export
    failed. Refused naming the base model and --merged, in the preflight and when built."""
    import peft
    from transformers import AutoModelForCausalLM

    from fastllm.train.model import build_model

    adapter = tmp_path / "adapter"
    base = AutoModelForCausalLM.from_pretrained(hf_model)
    peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["q_proj"])).save_pretrained(
        adapter)
    out = tmp_path / "run"
    cfg = TrainConfig.from_args(_args(adapter, text, out, "max_steps=1"))
    says = (f"model={adapter} is a PEFT adapter folder (adapter_config.json), not a model: train "
            f"the base model its adapter_config.json names ({hf_model}), or a merged folder "
            f"(`fastllm export RUN_DIR OUT_DIR --merged`")
    with pytest.raises(ConfigError, match=re.escape(says)):
        Trainer(cfg, log=lambda t: None).train()
    assert not out.exists()
    with pytest.raises(ConfigError, match=re.escape(says)):
        build_model(cfg, 300, torch.float32)


@pytest.mark.parametrize("option", ["finetune=freeze freeze.layers", "finetune=lora lora.layers"])
@pytest.mark.parametrize("model", ["tiny", "hf"])
def test_more_last_layers_than_the_model_has_are_refused_before_the_run_folder(
        tmp_path, hf_model, text, option, model):
    """freeze.layers / lora.layers above the decoder layer count were clamped: freeze.layers=5
    on 2 layers trained every layer. Both models have 2; 2 is all of them and passes."""
    from fastllm.train.model import apply_finetune, build_model, check_model

    mode, key = option.split()
    out = tmp_path / "run"
    cfg = TrainConfig.from_args(_args(hf_model if model == "hf" else "tiny", text, out, mode,
                                      f"{key}=3", "max_steps=1"))
    says = f"fastllm train: {key}=3 is more than the model's 2 decoder layers; give at most 2"
    with pytest.raises(ConfigError, match=re.escape(says)):
        Trainer(cfg, log=lambda t: None).train()
    assert not out.exists()
    with pytest.raises(ConfigError, match=re.escape(says)):  # a caller that skips the preflight
        apply_finetune(build_model(cfg, 300, torch.float32), cfg)
    cfg.set(key, "2")
    check_model(cfg)
