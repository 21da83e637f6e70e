"""SFT inputs fastllm train refuses in one line, naming where: a record the chat template
rejects, data.format=jsonl without data.path, a tokenizer without an EOS token, an eval prompts
file that is not UTF-8 (and one with a byte-order mark, accepted), a data folder mixing records
and text. Tiny offline tokenizers, CPU."""

import json

import pytest

from fastllm.train.config import ConfigError, TrainConfig
from fastllm.train.data import ByteTokenizer, HFTokenizer, build_tokenizer
from fastllm.train.evaluate import read_prompt_records
from fastllm.train.sft_data import encode_example, read_records, tokenize_records

from _tiny_tokenizer import tiny_bpe

# ChatML as SmolLM2 writes it, and a Mistral-style one refusing roles that do not alternate
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
ALTERNATE = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
             "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
             "{% endif %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
             "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
USER = {"role": "user", "content": "What is"}
REPLY = {"role": "assistant", "content": "Paris."}
SYSTEM = {"role": "system", "content": "Be brief."}
# an assistant turn that only calls a tool (content null), which ChatML's template cannot render
CALL = {"role": "assistant", "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}]}


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("template, refused, says", [
    (ALTERNATE, [SYSTEM, USER, REPLY], "TemplateError: Conversation roles must alternate"),
    # (transformers 5.17 renders the None content itself: '...' + None, a TypeError)
    (CHATML, [USER, CALL, {"role": "tool", "content": "1"}, REPLY], "(UndefinedError|TypeError)"),
], ids=["raise_exception", "undefined"])
def test_a_record_the_chat_template_refuses_is_named_by_its_line(tmp_path, template, refused,
                                                                 says):
    tok = HFTokenizer(tiny_bpe(template), f"refuse-{len(refused)}")
    path = _write(tmp_path / "chat.jsonl", [{"messages": [USER, REPLY]}, {"messages": refused}])
    with pytest.raises(ValueError, match=rf"chat\.jsonl line 2: the tokenizer's chat template "
                                         rf"refused the chat: {says}"):
        tokenize_records(read_records(path), tok, str(tmp_path / "cache"))


def test_jsonl_format_needs_a_data_path():
    with pytest.raises(ConfigError, match="data.format=jsonl .* give data.path"):
        TrainConfig.from_args(["data.format=jsonl"])
    assert TrainConfig.from_args(["data.format=jsonl", "data.path=a.jsonl"]).data.path


def test_a_tokenizer_without_eos_is_refused_and_builtin_ones_end_with_eos(tmp_path):
    folder = str(tmp_path / "noeos")
    tiny_bpe(eos=None).save_pretrained(folder)
    with pytest.raises(ValueError, match=rf"tokenizer {folder} has no EOS token.*\"eos_token\" "
                                         rf"in its tokenizer_config.json"):
        build_tokenizer(folder, [], 0, str(tmp_path / "cache"))
    # the last vocabulary id is not made a training target in its place
    with pytest.raises(ValueError, match="tokenizer noeos has no EOS token"):
        encode_example(("text", "Paris."), HFTokenizer(tiny_bpe(eos=None), "noeos"))
    bpe = build_tokenizer("bpe", ["What is the capital of France? Paris."] * 4, 300,
                          str(tmp_path / "cache"))
    for tok in (ByteTokenizer(), bpe):
        ids, mask = encode_example(("completion", ("What is", " Paris.")), tok)
        assert tok.eos_token_id is not None and ids[-1] == tok.eos_token_id and mask[-1] == 1


def test_prompts_file_names_a_line_not_utf8_and_accepts_a_byte_order_mark(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"hi\n\xff\xfe\n")
    with pytest.raises(ValueError, match=r"bad\.txt line 2: not UTF-8"):
        read_prompt_records([], str(bad))
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"prompt": "hi"}\r\n\n{"prompt": "yo"}\n')
    assert read_prompt_records([], str(bom)) == [("hi", {}, f"{bom} line 1"),
                                                 ("yo", {}, f"{bom} line 3")]
    for name, text in (("blank.txt", "\n  \n"), ("empty.jsonl", "")):
        (tmp_path / name).write_text(text)  # (samples asked for were silently never written)
        with pytest.raises(ValueError, match="holds no prompts"):
            read_prompt_records(["given"], str(tmp_path / name))


def test_prompts_json_and_upper_case_extensions_are_read_as_json(tmp_path):
    """A .json prompts file (an array, or JSON Lines) is read as the training data's .json is
    (its lines were sent to the model as prompts, braces and all), and a data file or prompts
    file named .JSONL is JSON Lines (it was trained on as plain text); an empty tools list is no
    tools, as null is."""
    from fastllm.train.sft_records import data_format

    array = tmp_path / "prompts.json"
    array.write_text('[{"prompt": "Capital of Kenya?"}, {"prompt": "Hi", "tools": []}]')
    assert read_prompt_records([], str(array)) == [
        ("Capital of Kenya?", {}, f"{array} record 0"), ("Hi", {}, f"{array} record 1")]
    upper = tmp_path / "P.JSONL"
    upper.write_text('{"prompt": "yo"}\n')
    assert read_prompt_records([], str(upper)) == [("yo", {}, f"{upper} line 1")]
    data = tmp_path / "train.JSONL"
    data.write_text('{"prompt": "Q", "completion": "A", "tools": []}\n')
    assert data_format(str(data)) == "jsonl"
    assert read_records(str(data))[0][:2] == ("completion", ("Q", "A"))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "part.Json").write_text('[{"text": "x"}]')
    assert data_format(str(folder)) == "jsonl" and len(read_records(str(folder))) == 1


def test_a_folder_of_records_and_text_is_refused_naming_one_of_each(tmp_path):
    """A folder holding .jsonl/.json records and .txt/.md text left one kind unread (a text
    corpus with a stray meta/info.json was read as JSONL); data.format picks one, and a
    README.md (a dataset card) is no text to train on."""
    from fastllm.train.sft_records import data_format

    folder = tmp_path / "mixed"
    (folder / "meta").mkdir(parents=True)
    (folder / "corpus.txt").write_text("a text document\n")
    (folder / "meta" / "info.json").write_text('{"source": "x"}')
    with pytest.raises(ValueError, match=r"both JSON Lines / JSON records \(.*info.json\) and "
                                         r"text \(.*corpus.txt\): give data.format=jsonl"):
        data_format(str(folder))
    with pytest.raises(ValueError, match="data.format=text"):
        TrainConfig.from_args([f"data.path={folder}", "data.eval_fraction=0.1"])
    assert data_format(str(folder), "text") == "text"
    assert data_format(str(folder), "jsonl") == "jsonl"
    cards = tmp_path / "dataset"
    cards.mkdir()
    (cards / "README.md").write_text("# a dataset card\n")
    (cards / "train.jsonl").write_text('{"text": "x"}\n')
    assert data_format(str(cards)) == "jsonl"


def test_a_training_folder_holding_another_splits_files_is_refused(tmp_path):
    """A folder laid out for Hugging Face datasets (train.jsonl beside test.jsonl, sharded
    data/validation-*.jsonl, my_eval.json, a dev/ folder) had its test and validation records
    trained on; names are split at datasets' non-word characters (devices.jsonl is no dev
    split). An eval_path folder may hold them."""
    from fastllm.train import preflight
    from fastllm.train.data import load_text

    def folder_of(name, *files):
        for f in files:
            (tmp_path / name / f).parent.mkdir(parents=True, exist_ok=True)
            _write(tmp_path / name / f, [{"text": f}])
        return str(tmp_path / name)

    for k, other in enumerate(["test.jsonl", "data/validation-00000-of-00001.jsonl",
                               "my_eval.json", "dev/part.jsonl", "TEST.JSONL"]):
        folder = folder_of(f"split{k}", "train.jsonl", other)
        with pytest.raises(ValueError, match=rf"holds files of another split than train "
                                             rf"\({other}\).*point data.path at the train "
                                             rf"file\(s\) and data.eval_path at the eval file"):
            read_records(folder)
    with pytest.raises(ConfigError, match="another split"):  # before the run
        preflight.check_chat_data(TrainConfig.from_args([f"data.path={folder}"]))
    assert len(read_records(folder, train=False)) == 2
    fine = folder_of("fine", "train-00000-of-00002.jsonl", "devices.jsonl",
                     "training_interval.json")
    assert len(read_records(fine)) == 3
    text = tmp_path / "text"
    text.mkdir()
    (text / "train.txt").write_text("a")
    (text / "valid.txt").write_text("b")
    with pytest.raises(ValueError, match=r"another split than train \(valid.txt\).*file\(s\)$"):
        load_text(str(text))
    # text without a train file: a corpus's dev/ folder or testing.md is training text
    (text / "train.txt").unlink()
    (text / "dev").mkdir()
    (text / "dev" / "setup.md").write_text("c")
    assert sorted(load_text(str(text))) == ["b", "c"]


@pytest.mark.parametrize("name", ["train.csv", "train.TSV", "train.parquet", "train.jsonl.gz",
                                  "data.zip"])
def test_a_table_or_archive_is_refused_unless_format_text_is_given(tmp_path, name):
    """A .csv (what load_dataset("csv") reads) was trained on as raw text, header and commas."""
    from fastllm.train import preflight
    from fastllm.train.sft_records import data_format

    path = tmp_path / name
    path.write_text('prompt,completion\n"What is 2+2?"," 4"\n')
    with pytest.raises(ConfigError, match=rf"{name} is a table or archive .*JSON Lines / JSON "
                                          rf"records .* or give data.format=text"):
        preflight.check_chat_data(TrainConfig.from_args([f"data.path={path}"]))
    with pytest.raises(ConfigError, match="table or archive"):
        data_format(str(path), "jsonl")
    assert data_format(str(path), "text") == "text"


def test_an_empty_prompt_is_refused_by_name(tmp_path):
    """An empty eval prompt was read, and with a tokenizer that adds no BOS (the byte tokenizer
    of the built-in runs) generate() failed on torch.tensor([[]]), a float tensor, after the run
    folder was written; `fastllm generate RUN ""` the same."""
    from fastllm.train.evaluate import generate_samples

    with pytest.raises(ValueError, match=r"eval.prompts\[1\] is empty"):
        read_prompt_records(["hi", ""], None)
    records = tmp_path / "p.jsonl"
    records.write_text('{"prompt": "hi"}\n{"prompt": ""}\n')
    with pytest.raises(ValueError, match=r"p\.jsonl line 2: the prompt is empty"):
        read_prompt_records([], str(records))
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, vocab_size=257,
                                         num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="is no tokens .*nothing to continue"):
        generate_samples(model, ByteTokenizer(), [""], max_new_tokens=2)
    assert len(generate_samples(model, ByteTokenizer(), ["a"], max_new_tokens=2)) == 1


@pytest.mark.parametrize("key,meant", [("inputs", "input"), ("Input", "input"),
                                       ("sytem", "system")])
def test_a_near_miss_of_an_optional_alpaca_key_is_refused(tmp_path, key, meant):
    """A misspelt optional key ("inputs" for "input") was read as an empty input: the example
    trained on the bare instruction. Refused naming both keys; other extra keys stay allowed."""
    path = tmp_path / "data.jsonl"
    record = {"instruction": "Name the capital.", key: "Spain", "output": "Madrid."}
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=rf"line 1: key '{key}' .*did you mean '{meant}'"):
        read_records(str(path))
    path.write_text(json.dumps({"instruction": "I", "input": "x", "output": "O", "id": 3,
                                "source": "s", "stem": "q", "subsystem": "a", "input1": "b",
                                "input_ids": [1], "system_prompt": "p"}) + "\n")
    assert read_records(str(path))[0][:2] == ("alpaca", ("I", "x", "O", ""))
