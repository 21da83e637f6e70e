"""SFT data against what Hugging Face users expect (TRL's SFTTrainer, apply_chat_template): a chat
that opens with the assistant, BOS and EOS of plain examples, a lone surrogate escape, the cache
of an eval_path under a trained BPE, packed boundaries and a resumed order, .json arrays,
conversational prompt-completion and prompt + completion tokenised together (tiny offline
tokenizers, CPU)."""

import json
import warnings

import pytest

from fastllm.train import sft_data
from fastllm.train.config import TrainConfig
from fastllm.train.data import ByteTokenizer, HFTokenizer
from fastllm.train.sft_data import (SFTDataset, build_datasets, data_format, encode_example,
                                    read_records, text_pieces, tokenize_records)

from _tiny_tokenizer import tiny_bpe

# SmolLM2's ChatML template, its default system turn included (tests/test_sft.py drops it)
SMOL = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are SmolLM<|im_end|>\n' }}{% endif %}"
        "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# a Llama-style template: the BOS as text, then the turns
LLAMA = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
         "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
         "{% if add_generation_prompt %}[assistant]{% endif %}")


def _tokenizer(specials, bos=None, eos=None, template=None):
    """tiny_bpe as fastllm's HFTokenizer, named by its tokens (the token cache's key)."""
    return HFTokenizer(tiny_bpe(template, specials, bos=bos, eos=eos),
                       f"audit-{bos}-{eos}-{bool(template)}")


def _targets(tok, ids, mask):
    return tok.decode([t for t, m in zip(ids, mask) if m])


def test_chat_opening_with_the_assistant_trains_on_the_reply_only():
    tok = _tokenizer(["<|im_start|>", "<|im_end|>"], eos="<|im_end|>", template=SMOL)
    chat = [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Paris."}]
    ids, mask = encode_example(("chat", chat), tok)
    assert ids == tok.tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
    # neither the template's default system turn nor the reply's header is a target
    assert _targets(tok, ids, mask) == "Hello!<|im_end|>\nParis.<|im_end|>\n"
    ids, mask = encode_example(("chat", chat[:1]), tok)
    assert _targets(tok, ids, mask) == "Hello!<|im_end|>\n"


def test_plain_examples_start_with_the_tokenizers_bos_and_chats_have_one():
    tok = _tokenizer(["<s>", "</s>"], bos="<s>", eos="</s>", template=LLAMA)
    bos, eos = tok.tok.bos_token_id, tok.eos_token_id
    # TRL: tok(text) (its BOS) + EOS; generation without a template also starts with the BOS
    ids, mask = encode_example(("text", "Paris."), tok)
    assert ids == tok.tok("Paris.")["input_ids"] + [eos] and ids[0] == bos
    ids, mask = encode_example(("completion", ("What is", " Paris.")), tok)
    assert ids == tok.tok("What is Paris.")["input_ids"] + [eos]
    assert _targets(tok, ids, mask) == " Paris.</s>"
    # the template writes its BOS: one, as apply_chat_template's
    chat = [{"role": "user", "content": "What is"}, {"role": "assistant", "content": "Paris."}]
    ids, mask = encode_example(("chat", chat), tok)
    assert ids == tok.tok.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
    assert ids.count(bos) == 1 and _targets(tok, ids, mask) == "Paris.</s>"


def test_an_example_ending_with_the_eos_gets_no_second_one():
    tok = _tokenizer(["<|im_start|>", "<|im_end|>"], eos="<|im_end|>")
    eos = tok.eos_token_id
    ids, mask = encode_example(("text", "Paris.<|im_end|>"), tok)
    assert ids == tok.encode("Paris.") + [eos] and all(mask)
    ids, mask = encode_example(("completion", ("What is", " Paris.<|im_end|>")), tok)
    assert ids == tok.encode("What is Paris.") + [eos]
    # an empty completion still learns to stop, whatever the prompt ends with
    ids, mask = encode_example(("completion", ("What is<|im_end|>", "")), tok)
    assert ids == tok.encode("What is") + [eos, eos] and mask[-2:] == [0, 1]


def _write(path, records):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return str(path)


def test_a_lone_surrogate_escape_is_refused_with_its_line(tmp_path):
    path = tmp_path / "s.jsonl"
    # a surrogate pair is one character (kept); a lone half is valid JSON but no text
    path.write_text('{"text": "sushi \\ud83c\\udf63"}\n{"prompt": "x", "completion": "\\ud800"}\n')
    with pytest.raises(ValueError, match=r"s.jsonl line 2: a lone UTF-16 surrogate"):
        read_records(str(path))
    path.write_text('{"text": "sushi \\ud83c\\udf63"}\n')
    assert read_records(str(path)) == [("text", "sushi \U0001f363")]


def test_eval_path_tokenised_by_the_bpe_of_this_training_data(tmp_path):
    """data.tokenizer=bpe learns from data.path; a changed data.path's BPE must not reuse the
    eval_path tokens of the old one (same vocab size, other merges)."""
    held = _write(tmp_path / "eval.jsonl", [{"prompt": "apple banana",
                                             "completion": " cherry zebra"}])
    for k, words in enumerate(["apple banana cherry", "zebra yak xylophone walrus"]):
        data = _write(tmp_path / f"train{k}.jsonl",
                      [{"prompt": words * 3, "completion": " " + words}] * 4)
        cfg = TrainConfig.from_dict(dict(
            model="tiny", output_dir=str(tmp_path / "run"),
            data=dict(path=data, eval_path=held, tokenizer="bpe", vocab_size=270, seq_len=64,
                      cache_dir=str(tmp_path / "cache"))))
        tok, _, eval_set = build_datasets(cfg, None, 0, 1, lambda: None)
        assert len(tok.tok) == 270
        s, e = eval_set.spans[0]
        want, _ = encode_example(read_records(held)[0], tok)
        assert [int(t) for t in eval_set.tokens[s:e]] == want, k


@pytest.mark.parametrize("packing", [True, False])
def test_targets_stay_inside_their_example_and_a_resume_keeps_the_order(tmp_path, packing):
    """HF shifts labels once, in the model: label t is predicted from token t - 1 of the same
    example, and an example's first token is never a target (not even from the previous one)."""
    from fastllm.train.data import ByteTokenizer, Loader

    recs = [("completion", ("q" * (1 + i % 4), "a" * (1 + i % 5))) for i in range(13)]
    recs += [("text", "é" * 9), ("completion", ("p", ""))]  # multi-byte; an empty completion
    path = tokenize_records(recs, ByteTokenizer(), str(tmp_path))
    ds = SFTDataset(path, range(len(recs)), seq_len=12, seed=1, packing=packing)
    seen = []
    for samples in ([0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]):
        b = ds.batch(samples)
        for row, ids, labels, pos in zip((ds.rows[ds.row(s)] for s in samples), b["input_ids"],
                                         b["labels"], b["position_ids"]):
            at = 0
            for i in row:
                s, e = ds.spans[i]
                n = e - s
                assert pos[at:at + n].tolist() == list(range(n))
                assert ids[at:at + n].tolist() == ds.tokens[s:e].tolist()
                want = [t if m else -100 for t, m in zip(ds.tokens[s:e], ds.mask[s:e])]
                assert labels[at:at + n].tolist() == [-100] + want[1:]
                at += n
            assert (labels[at:] == -100).all()
        seen += [ds.row(s) for s in samples]
    n = ds.num_sequences
    assert sorted(seen[:n]) == list(range(n))  # an epoch: every row once
    loader = Loader(ds, 0, 1, 2, 4, 0, position=0)
    whole = [loader.next_step()[0] for _ in range(4)]
    loader.reset(8)  # resume after two steps
    again = [loader.next_step()[0] for _ in range(2)]
    loader.close()
    for (sa, ba), (sb, bb) in zip([m for step in whole[2:] for m in step],
                                  [m for step in again for m in step]):
        assert sa == sb and all((ba[k] == bb[k]).all() for k in ("input_ids", "labels"))


def test_json_arrays_and_json_lines_are_read_and_a_folder_holds_both(tmp_path):
    """datasets.load_dataset("json") reads a .json file holding an array of records, or JSON
    Lines; errors name the file and the record's index (from 0)."""
    folder = tmp_path / "data"
    folder.mkdir()
    # a pretty-printed array, with a byte-order mark
    (folder / "a.json").write_text("\ufeff" + json.dumps(
        [{"text": "one"}, {"prompt": "1+1=", "completion": "2"}], indent=2))
    _write(folder / "b.json", [{"text": "three"}])  # JSON Lines in a .json file
    _write(folder / "c.jsonl", [{"text": "four"}])
    assert read_records(str(folder / "a.json")) == [("text", "one"), ("completion", ("1+1=", "2"))]
    assert [f for _, f in read_records(str(folder))] == ["one", ("1+1=", "2"), "three", "four"]
    only_json = tmp_path / "j"
    only_json.mkdir()
    (only_json / "x.json").write_text('[{"text": "x"}]')
    assert data_format(str(only_json)) == "jsonl" and read_records(str(only_json))
    bad = [('[{"text": "ok"}, {"prompt": "x"}]', r"a.json record 1: key 'completion'"),
           ('[{"text": "ok"}, 3]', r"a.json record 1: a record must be a JSON object"),
           ('[{"text": "ok"},\n {"text": ]', r"a.json: not valid JSON \(.*line 2"),
           ('{\n  "text": "one record"\n}', r"a.json: holds one JSON value \(an object with keys "
                                            r"\['text'\]\); a .json file holds an array"),
           ('[]', r"holds no examples")]
    for text, message in bad:
        (folder / "a.json").write_text(text)
        with pytest.raises(ValueError, match=message):
            read_records(str(folder / "a.json"))
    (folder / "a.json").write_bytes(b'[{"text": "caf\xe9"}]')
    with pytest.raises(ValueError, match=r"a.json: not UTF-8 \(byte 14"):
        read_records(str(folder / "a.json"))


def _as_trl(tok, prompt, completion):
    """TRL's SFTTrainer tokenize_fn for conversational prompt-completion: ids and completion_mask"""
    ids = tok.tok.apply_chat_template(prompt + completion, tokenize=True,
                                      return_dict=True)["input_ids"]
    head = tok.tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                       return_dict=True)["input_ids"]
    return ids, [0] * len(head) + [1] * (len(ids) - len(head))


@pytest.mark.parametrize("template", ["smol", "llama"])
def test_conversational_prompt_completion_trains_on_the_completion_as_trl(tmp_path, template):
    if template == "smol":
        tok = _tokenizer(["<|im_start|>", "<|im_end|>"], eos="<|im_end|>", template=SMOL)
        reply = "Paris.<|im_end|>\n"
    else:
        tok = _tokenizer(["<s>", "</s>"], bos="<s>", eos="</s>", template=LLAMA)
        reply = "Paris.</s>"
    prompt = [{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "What is the capital of France?"}]
    completion = [{"role": "assistant", "content": "Paris."}]
    path = _write(tmp_path / "pc.jsonl", [{"prompt": prompt, "completion": completion}])
    (record,) = read_records(path)
    assert record == ("chat_completion", (prompt, completion))
    ids, mask = encode_example(record, tok)
    assert (ids, mask) == _as_trl(tok, prompt, completion)
    assert _targets(tok, ids, mask) == reply
    assert all(encode_example(record, tok, train_on_prompt=True)[1])
    assert text_pieces([record]) == ["Be brief.", "What is the capital of France?", "Paris."]
    with pytest.raises(ValueError, match="chat template"):
        encode_example(record, ByteTokenizer())
    bad = [({"prompt": prompt, "completion": "Paris."}, "key 'completion' must be a list of "
                                                        "messages as 'prompt' is"),
           ({"prompt": "What?", "completion": completion}, "key 'prompt' must be a list of "
                                                           "messages as 'completion' is"),
           ({"prompt": prompt, "completion": []}, r"key 'completion' must be a non-empty list"),
           ({"prompt": [{"role": "robot", "content": "x"}], "completion": completion},
            r"key 'prompt'\[0\] must be"),
           ({"prompt": prompt}, "key 'completion' must be a list of messages .* got missing")]
    for rec, message in bad:
        with pytest.raises(ValueError, match=r"pc.jsonl line 1: " + message):
            read_records(_write(tmp_path / "pc.jsonl", [rec]))


def test_prompt_and_completion_are_tokenised_together_as_trl():
    """TRL: ids = tok(prompt + completion) (+ EOS), completion_mask 1 from len(tok(prompt)) on,
    even where tok(prompt) is no prefix of them (it warns)."""
    tok = _tokenizer(["<s>", "</s>"], bos="<s>", eos="</s>")
    eos = tok.eos_token_id
    # a prompt ending with a space: " Paris" is one token of the whole, as TRL tokenises it
    with pytest.warns(UserWarning, match="not a prefix"):
        ids, mask = encode_example(("completion", ("What is ", "Paris.")), tok)
    assert ids == tok.tok("What is Paris.")["input_ids"] + [eos]
    assert mask == [0] * len(tok.tok("What is ")["input_ids"]) + [1] * 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert all(encode_example(("completion", ("What is ", "Paris.")), tok, True)[1])
        ids, mask = encode_example(("completion", ("What is", " Paris.")), tok)
    assert _targets(tok, ids, mask) == " Paris.</s>"
    # every split of one text: the same ids, TRL's mask
    text = "What is the capital of France? Paris."
    for k in range(len(text) + 1):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ids, mask = encode_example(("completion", (text[:k], text[k:])), tok)
        whole, head = tok.tok(text)["input_ids"], tok.tok(text[:k])["input_ids"]
        assert ids == whole + [eos], k
        n = min(len(head), len(whole))
        assert mask == [0] * n + [1] * (len(whole) - n) + [1], k


def test_caches_of_the_old_tokenisation_are_not_reused(tmp_path, monkeypatch):
    tok = _tokenizer(["<s>", "</s>"], bos="<s>", eos="</s>")
    recs = [("completion", ("What is", " Paris."))]
    monkeypatch.setattr(sft_data, "_VERSION", "sft-2")
    old = tokenize_records(recs, tok, str(tmp_path))
    monkeypatch.undo()
    new = tokenize_records(recs, tok, str(tmp_path))
    assert new != old
    ds = SFTDataset(new, [0], seq_len=64, seed=0)
    assert ds.tokens.tolist() == encode_example(recs[0], tok)[0]


# ChatML with TRL's per-record inputs: a tools block (tools=) and a template variable
# (chat_template_kwargs={"enable_thinking": false}); an assistant turn may call tools instead
TOOLS = ("{% if enable_thinking is defined and not enable_thinking %}/no_think\n{% endif %}"
         "{% if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='name') | join(',') }}"
         "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
         "{% if m.get('tool_calls') %}call {{ m['tool_calls'][0]['name'] }}{% else %}"
         "{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
         "<|im_start|>assistant\n{% endif %}")


def test_tools_and_chat_template_kwargs_are_rendered_as_trl(tmp_path):
    """TRL's SFTTrainer renders a conversational record with apply_chat_template(..., tools=
    record["tools"], **record["chat_template_kwargs"]); messages keep their tool_calls."""
    tok = _tokenizer(["<|im_start|>", "<|im_end|>"], eos="<|im_end|>", template=TOOLS)
    tools = [{"name": "weather", "parameters": {"type": "object"}}]
    kwargs = {"enable_thinking": False}
    chat = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": None, "tool_calls": [{"name": "weather"}]},
            {"role": "tool", "content": "sunny", "name": "weather"},
            {"role": "assistant", "content": "Paris."}]
    prompt, completion = chat[:1], chat[3:]
    path = _write(tmp_path / "t.jsonl", [
        {"messages": chat, "tools": tools},
        {"prompt": prompt, "completion": completion, "tools": tools,
         "chat_template_kwargs": kwargs},
        {"messages": chat[:1] + chat[3:], "tools": None, "chat_template_kwargs": {}}])
    with_tools, pc, plain = read_records(path)
    assert with_tools == ("chat", chat, {"tools": tools})
    assert pc == ("chat_completion", (prompt, completion),
                  {"tools": tools, "chat_template_kwargs": kwargs})
    assert plain == ("chat", chat[:1] + chat[3:])  # null / empty: as if absent
    ids, mask = encode_example(with_tools, tok)
    assert ids == tok.tok.apply_chat_template(chat, tools=tools, tokenize=True,
                                              return_dict=True)["input_ids"]
    assert tok.decode(ids).startswith("<|im_start|>system\nTools: weather<|im_end|>")
    assert _targets(tok, ids, mask) == "call weather<|im_end|>\nParis.<|im_end|>\n"
    trl_ids = tok.tok.apply_chat_template(prompt + completion, tools=tools, tokenize=True,
                                          return_dict=True, **kwargs)["input_ids"]
    head = tok.tok.apply_chat_template(prompt, tools=tools, tokenize=True, return_dict=True,
                                       add_generation_prompt=True, **kwargs)["input_ids"]
    assert tok.decode(trl_ids).startswith("/no_think\n<|im_start|>system\nTools: weather")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the prompt rendered alone is a prefix: no warning
        ids, mask = encode_example(pc, tok)
    assert (ids, mask) == (trl_ids, [0] * len(head) + [1] * (len(trl_ids) - len(head)))
    assert _targets(tok, ids, mask) == "Paris.<|im_end|>\n"
    assert text_pieces([with_tools]) == ["What is the capital of France?", "sunny", "Paris."]
    bad = [({"messages": chat, "tools": {"name": "weather"}}, "key 'tools' must be a list"),
           ({"messages": chat, "chat_template_kwargs": [1]},
            "key 'chat_template_kwargs' must be an object"),
           ({"messages": chat, "chat_template_kwargs": {"add_generation_prompt": True}},
            r"key 'chat_template_kwargs' sets \['add_generation_prompt'\], which fastllm"),
           ({"text": "Paris.", "tools": tools}, "keys 'tools' and 'chat_template_kwargs' go with"),
           ({"messages": [{"role": "user", "content": None}] + chat[3:]}, r"key 'messages'\[0\]")]
    for rec, message in bad:
        with pytest.raises(ValueError, match="t.jsonl line 1: " + message):
            read_records(_write(tmp_path / "t.jsonl", [rec]))


def test_a_chat_is_tokenised_whole_by_a_sentencepiece_style_tokenizer():
    """A Metaspace tokenizer (Llama's, Mistral's) puts a word-start marker before a text: each
    piece of the chat encoded alone got one (a space the data does not have, trained on). The
    ids are the whole render's, as apply_chat_template's (and TRL's); the replies are found by
    their characters' offsets."""
    template = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
                "{{ '[INST] ' + m['content'] + ' [/INST]' }}{% else %}"
                "{{ m['content'] + eos_token }}{% endif %}{% endfor %}")
    from _tiny_tokenizer import tiny_bpe as make

    fast = make(template, ["<s>", "</s>", "[INST]", "[/INST]"], bos="<s>", eos="</s>",
                words="What is the capital of France? Paris. And Italy? Rome.", metaspace=True)
    tok = HFTokenizer(fast, "audit-metaspace")
    chat = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And Italy?"}, {"role": "assistant", "content": "Rome."}]
    ids, mask = encode_example(("chat", chat), tok)
    assert ids == fast.apply_chat_template(chat, tokenize=True, return_dict=True)["input_ids"]
    assert "".join(fast.decode(t) for t, m in zip(ids, mask) if m) == "Paris.</s>Rome.</s>"
    assert _targets(tok, ids, mask) == "Paris.</s>Rome.</s>"  # (no '▁' before either reply)


# Qwen3's way (abridged): an assistant turn before the last one loses its <think> block, so a
# chat's rendering up to an earlier reply is no prefix of the whole chat's; THINK_MARKED marks
# the replies with transformers' {% generation %} (what TRL's assistant_only_loss reads)
_THINK = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% set c = m['content'] %}"
          "{% if m['role'] == 'assistant' and not loop.last %}"
          "{% set c = c.split('</think>')[-1].lstrip('\n') %}{% endif %}")
THINK = _THINK + ("{{ c }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
THINK_MARKED = _THINK + ("{% if m['role'] == 'assistant' %}{% generation %}{{ c }}<|im_end|>\n"
                         "{% endgeneration %}{% else %}{{ c }}<|im_end|>\n{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
THINK_CHAT = [{"role": "user", "content": "What is"},
              {"role": "assistant", "content": "<think>the capital</think>Paris."},
              {"role": "user", "content": "France?"},
              {"role": "assistant", "content": "<think>of France</think>Paris."}]


def test_a_template_rendering_earlier_turns_anew_trains_on_the_whole_chat_with_train_on_prompt():
    """With data.train_on_prompt=true every token counts, as TRL's SFTTrainer trains on a
    conversational record by default: the whole render, no turn boundaries needed. Without it,
    the replies cannot be found: refused, saying what to do."""
    tok = _tokenizer(["<|im_start|>", "<|im_end|>"], eos="<|im_end|>", template=THINK)
    whole = tok.tok.apply_chat_template(THINK_CHAT, tokenize=True, return_dict=True)["input_ids"]
    ids, mask = encode_example(("chat", THINK_CHAT), tok, train_on_prompt=True)
    assert ids == whole and mask == [1] * len(ids)
    assert "<think>the capital</think>" not in tok.decode(ids)
    with pytest.raises(ValueError, match=r"data.train_on_prompt=true .*\{% generation %\}"):
        encode_example(("chat", THINK_CHAT), tok)
    # a template rendering chats as prefixes: the same ids either way
    tok = _tokenizer(["<|im_start|>", "<|im_end|>"], eos="<|im_end|>", template=SMOL)
    ids, mask = encode_example(("chat", THINK_CHAT), tok, train_on_prompt=True)
    assert ids == encode_example(("chat", THINK_CHAT), tok)[0] and all(mask)


# ChatML whose markers leave out the '\n' after each <|im_end|> (written as an expression:
# transformers' jinja drops a newline right after a block tag); it renders chats as prefixes
CHATML_MARKED = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{{ '\\n' }}{% else %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_generation_markers_win_over_prefixes():
    """A template that marks its replies and also renders chats as prefixes: the markers decide
    (TRL's assistant_only_loss), so the '\n' they leave after each <|im_end|> is no target; the
    prefixes alone counted it."""
    tok = _tokenizer(["<|im_start|>", "<|im_end|>"], eos="<|im_end|>", template=CHATML_MARKED)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "France?"},
            {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Italy?"},
            {"role": "assistant", "content": "Rome."}]
    out = tok.tok.apply_chat_template(chat, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
    ids, mask = encode_example(("chat", chat), tok)
    assert (ids, mask) == (out["input_ids"], out["assistant_masks"])
    assert _targets(tok, ids, mask) == "Paris.<|im_end|>Rome.<|im_end|>"


def test_generation_markers_find_the_replies_of_such_a_template():
    """A template with {% generation %} markers: the replies are its assistant mask
    (apply_chat_template's return_assistant_tokens_mask, as TRL's assistant_only_loss)."""
    tok = _tokenizer(["<|im_start|>", "<|im_end|>"], eos="<|im_end|>", template=THINK_MARKED)
    out = tok.tok.apply_chat_template(THINK_CHAT, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
    ids, mask = encode_example(("chat", THINK_CHAT), tok)
    assert (ids, mask) == (out["input_ids"], out["assistant_masks"])
    assert _targets(tok, ids, mask) == ("Paris.<|im_end|>\n<think>of France</think>Paris."
                                        "<|im_end|>\n")
    ids, mask = encode_example(("chat", THINK_CHAT), tok, train_on_prompt=True)
    assert ids == out["input_ids"] and all(mask)
