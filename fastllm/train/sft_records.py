"""Supervised fine-tuning examples read from files: JSON Lines (.jsonl: one record a line) or JSON
(.json: a top-level array of records, or JSON Lines, as datasets.load_dataset("json") reads both);
a folder's .jsonl and .json files in name order. A training folder holding files named for
another split (test.jsonl, data/validation-00000-of-00001.jsonl) is refused, and so are table
and archive files (.csv, .parquet, .gz, ...) unless data.format=text reads them as text.

A record is one example, in one of these shapes (the names of HF TRL and Alpaca):

    {"text": "..."}                                   every token counts
    {"prompt": "...", "completion": "..."}            the completion counts
    {"prompt": [messages], "completion": [messages]}  TRL's conversational prompt-completion:
                                                      the completion's messages count
    {"instruction": "...", "input": "...", "output": "..."}   Alpaca: the output counts
    {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]}
                                                      the assistant turns count

A conversational record ("messages", or "prompt" and "completion" message lists) may also carry
TRL's per-record chat template inputs: "tools" (a list of JSON schemas, passed as
apply_chat_template's tools=) and "chat_template_kwargs" (an object of extra template variables,
e.g. {"enable_thinking": false}). A message keeps its other keys ("tool_calls", "name",
"tool_call_id", ...) for the template; an assistant message with "tool_calls" may have no content.

Each is checked and normalised to (kind, fields) before any is tokenised: ("text", text),
("completion", (prompt, completion)), ("chat_completion", (prompt messages, completion
messages)), ("alpaca", (instruction, input, output, system)) or ("chat", messages); a
conversational record with tools or chat_template_kwargs is (kind, fields, template inputs),
the last {"tools": [...], "chat_template_kwargs": {...}} (only the keys it has).
"""

import codecs
import difflib
import json
import os
import re

import torch

from fastllm._files import files_under
from fastllm.train.config_values import ConfigError

__all__ = ["Records", "check_splits", "data_format", "decode_utf8", "first_records",
           "read_records", "split_examples", "template_inputs", "text_pieces"]

_ROLES = ("system", "user", "assistant", "tool")
_EXTENSIONS = (".jsonl", ".json")
_TEXT = (".txt", ".md")  # a text folder's files (fastllm.train.data.load_text)
# tables and archives: neither JSON nor text (read as text, a CSV's header and commas were
# trained on)
_NOT_TEXT = (".csv", ".tsv", ".parquet", ".arrow", ".gz", ".zip", ".bz2", ".xz", ".zst")
# the other splits' keywords of Hugging Face datasets (data_files.py SPLIT_KEYWORDS), a name part
# between its non-word characters "-._ 0-9" (NON_WORDS_CHARS) or "/"
_OTHER_SPLITS = {"validation", "valid", "dev", "val", "test", "testing", "eval", "evaluation"}
# apply_chat_template's own arguments: fastllm sets them, a record's chat_template_kwargs may not
_RESERVED = ("conversation", "tools", "documents", "add_generation_prompt",
             "continue_final_message", "tokenize", "padding", "truncation", "max_length",
             "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
             "chat_template")


def data_format(path, fmt="auto"):
    """text or jsonl: `fmt` when given, else from the extension (.jsonl/.json: jsonl); a folder is
    jsonl when it holds .jsonl or .json files, and refused when it also holds text (.txt, .md
    other than a README.md: a dataset card), of which one kind would be left unread. A table or
    archive file (.csv, .parquet, .gz, ...) is refused unless fmt is text."""
    if (fmt != "text" and path is not None and path.lower().endswith(_NOT_TEXT)
            and not os.path.isdir(path)):
        raise ConfigError(f"fastllm train: data.path {path} is a table or archive "
                          f"({os.path.splitext(path)[1]}): fastllm train reads JSON Lines / JSON "
                          f"records (.jsonl, .json) or text; convert it (e.g. datasets' "
                          f"load_dataset(...).to_json('train.jsonl')), or give data.format=text "
                          f"to train on its raw text")
    if fmt != "auto":
        return fmt
    if path is None:
        return "text"
    if os.path.isdir(path):
        records = _folder_files(path)
        text = [f for f in files_under(path, _TEXT)
                if os.path.basename(f).lower() != "readme.md"]
        if records and text:  # (a ConfigError: fastllm train's config check reports it too)
            raise ConfigError(f"fastllm train: data folder {path} holds both JSON Lines / JSON "
                              f"records ({records[0]}) and text ({text[0]}): give "
                              f"data.format=jsonl to read only the .jsonl/.json files or "
                              f"data.format=text for the .txt/.md ones, or keep one kind there")
        return "jsonl" if records else "text"
    return "jsonl" if is_json_name(path) else "text"


def is_json_name(name):
    """Whether a file name ends in .jsonl or .json, in any case (train.JSONL is JSON Lines)."""
    return name.lower().endswith(_EXTENSIONS)


def _folder_files(path):
    return files_under(path, _EXTENSIONS)


def check_splits(folder, files, text=False):
    """Refuse a training folder's `files` named for another split as Hugging Face datasets names
    them (test.jsonl, data/validation-00000-of-00001.jsonl, my_eval.json, dev/part.jsonl): read
    with the rest, they were trained on. A ConfigError listing them. text: a folder of text
    files, refused only when a file named for the train split is there too (valid.txt beside
    train.txt; a documentation corpus may well have a dev/ folder or a testing.md)."""
    def parts(f):
        return set(re.split(r"[-._ 0-9/\\]+", os.path.relpath(f, folder).lower()))

    other = [f for f in files if _OTHER_SPLITS & parts(f)]
    if other and text and not any("train" in parts(f) for f in files):
        return
    if other:
        names = ", ".join(os.path.relpath(f, folder) for f in other[:6])
        where = "" if text else " and data.eval_path at the eval file"
        raise ConfigError(f"fastllm train: data folder {folder} holds files of another split than "
                          f"train ({names}{', ...' if len(other) > 6 else ''}), which would be "
                          f"trained on: point data.path at the train file(s){where}")


def _files(path, train=True):
    """The files of a data path; a folder's (train: refused when some are another split's)."""
    if os.path.isdir(path):
        files = _folder_files(path)
        if not files:
            raise FileNotFoundError(f"fastllm train: no .jsonl or .json files under {path}")
        if train:
            check_splits(path, files)
        return files
    if not os.path.isfile(path):
        raise FileNotFoundError(f"fastllm train: data path {path} does not exist")
    return [path]


def _type(value):
    return "missing" if value is None else f"a {type(value).__name__}"


def _messages(record, key, where):
    """record[key] as a checked list of {'role', 'content', ...} messages (their other keys, such
    as tool_calls, kept for the template)."""
    messages = record[key]
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"fastllm train: {where}: key {key!r} must be a non-empty list")
    for i, m in enumerate(messages):
        # an assistant turn that only calls tools has no text (OpenAI's and TRL's content: null)
        calls = isinstance(m, dict) and m.get("role") == "assistant" and bool(m.get("tool_calls"))
        if not isinstance(m, dict) or m.get("role") not in _ROLES or not (
                isinstance(m.get("content"), str) or (calls and m.get("content") is None)):
            raise ValueError(f"fastllm train: {where}: key {key!r}[{i}] must be "
                             f"{{'role': one of {list(_ROLES)}, 'content': a string}}, got "
                             f"{json.dumps(m)[:80]}")
    return [dict(m) for m in messages]


def template_inputs(record, kind, where):
    """TRL's per-record "tools" and "chat_template_kwargs", checked: {} when it has neither (or
    they are null, as a dataset's column is where a record has none)."""
    out = {}
    tools, kwargs = record.get("tools"), record.get("chat_template_kwargs")
    if tools is not None:
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            raise ValueError(f"fastllm train: {where}: key 'tools' must be a list of JSON "
                             f"schemas (objects), got {json.dumps(tools)[:80]}")
        if tools:  # (an empty list is no tools, as null is)
            out["tools"] = tools
    if kwargs is not None:
        if not isinstance(kwargs, dict):
            raise ValueError(f"fastllm train: {where}: key 'chat_template_kwargs' must be an "
                             f"object of template variables, got {json.dumps(kwargs)[:80]}")
        reserved = sorted(k for k in kwargs if k in _RESERVED)
        if reserved:
            raise ValueError(f"fastllm train: {where}: key 'chat_template_kwargs' sets "
                             f"{reserved}, which fastllm sets itself when rendering the chat")
        if kwargs:
            out["chat_template_kwargs"] = kwargs
    if out and kind not in ("chat", "chat_completion"):
        raise ValueError(f"fastllm train: {where}: keys 'tools' and 'chat_template_kwargs' go "
                         f"with conversational records ('messages', or 'prompt' and "
                         f"'completion' message lists), which the chat template renders")
    return out


def _check(record, where):
    """The record normalised to (kind, fields) or (kind, fields, template inputs), or ValueError
    naming where it is and the key."""
    normal = _check_fields(record, where)
    extra = template_inputs(record, normal[0], where)
    return normal + (extra,) if extra else normal


def _check_fields(record, where):
    def need_str(key, optional=False):
        value = record.get(key)
        if value is None and optional:
            return ""
        if not isinstance(value, str):
            got = "missing" if key not in record else _type(value)
            raise ValueError(f"fastllm train: {where}: key {key!r} must be a string, got {got}")
        return value

    if not isinstance(record, dict):
        raise ValueError(f"fastllm train: {where}: a record must be a JSON object, got "
                         f"{type(record).__name__}")
    if "messages" in record:
        messages = _messages(record, "messages", where)
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError(f"fastllm train: {where}: key 'messages' has no assistant turn "
                             f"(nothing to learn)")
        return "chat", messages
    if "prompt" in record or "completion" in record:
        prompt, completion = record.get("prompt"), record.get("completion")
        if isinstance(prompt, list) or isinstance(completion, list):
            for key, other, value in (("prompt", "completion", prompt),
                                      ("completion", "prompt", completion)):
                if not isinstance(value, list):
                    raise ValueError(f"fastllm train: {where}: key {key!r} must be a list of "
                                     f"messages as {other!r} is (TRL's conversational "
                                     f"prompt-completion) or both strings, got {_type(value)}")
            return "chat_completion", (_messages(record, "prompt", where),
                                       _messages(record, "completion", where))
        return "completion", (need_str("prompt"), need_str("completion"))
    if "instruction" in record or "output" in record:
        _refuse_near_misses(record, ("input", "system"), where)
        return "alpaca", (need_str("instruction"), need_str("input", optional=True),
                          need_str("output"), need_str("system", optional=True))
    if "text" in record:
        return "text", need_str("text")
    raise ValueError(f"fastllm train: {where}: a record needs the key 'text', 'prompt' + "
                     f"'completion', 'instruction' + 'output' or 'messages'; got keys "
                     f"{sorted(record)}")


def _refuse_near_misses(record, optional, where):
    """An optional key absent but spelt nearly so ("inputs", "Input" for Alpaca's "input") would
    be read as empty and the example trained without it: refused, naming both. Other extra keys
    (an id, a source) are a dataset's own and stay allowed."""
    for key in optional:
        if key in record:
            continue
        # (strictly above 0.8: "stem", "subsystem", "ecosystem" score 0.8 against "system";
        # a key with digits, "input1", is one of a dataset's enumerated fields)
        near = [k for k in record if isinstance(k, str) and k not in ("instruction", "output")
                and not any(c.isdigit() for c in k)
                and difflib.SequenceMatcher(None, k.lower(), key).ratio() > 0.8]
        if near:
            raise ValueError(f"fastllm train: {where}: key {near[0]!r} is not one the record's "
                             f"format reads: did you mean {key!r}? (as it is, {key!r} would be "
                             f"read as empty)")


def decode_utf8(raw, where, bom):
    """raw (bytes) as text, or ValueError naming `where` and the first byte that is not UTF-8;
    bom: a leading byte-order mark is dropped (a file's first line)."""
    try:
        # utf-8-sig: a byte-order mark (Windows editors write one) is not JSON
        return raw.decode("utf-8-sig" if bom else "utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"fastllm train: {where}: not UTF-8 (byte {e.start}: "
                         f"{raw[e.start:e.start + 1]!r})") from None


def _json_lines(name, raw):
    """(where, parsed record) of each non-blank line of a JSON Lines file."""
    for n, line in enumerate(raw.split(b"\n"), 1):
        where = f"{name} line {n}"
        line = decode_utf8(line, where, bom=n == 1)
        if not line.strip():
            continue
        try:
            yield where, json.loads(line)
        except ValueError as e:
            if name.lower().endswith(".json"):
                _refuse_one_value(name, raw)
            raise ValueError(f"fastllm train: {where}: not valid JSON ({e})") from None


def _refuse_one_value(name, raw):
    """A .json file that is one JSON value over several lines, and no array: say what it needs."""
    try:
        value = json.loads(raw.decode("utf-8-sig"))
    except ValueError:
        return
    what = f"an object with keys {sorted(value)[:8]}" if isinstance(value, dict) else \
        f"a {type(value).__name__}"
    raise ValueError(f"fastllm train: {name}: holds one JSON value ({what}); a .json file holds "
                     f"an array of records ([{{...}}, {{...}}]) or one record a line (JSON Lines)")


def _json_array(name, raw):
    """(where, parsed record) of each item of a file holding one JSON array."""
    text = decode_utf8(raw, name, bom=True)
    try:
        items = json.loads(text)
    except ValueError as e:
        raise ValueError(f"fastllm train: {name}: not valid JSON ({e})") from None
    for i, record in enumerate(items):
        yield f"{name} record {i}", record


def parsed(name):
    """(where, parsed record) of each record of a .jsonl or .json file (JSON Lines, or one
    JSON array in a .json)."""
    with open(name, "rb") as f:
        raw = f.read()
    # a .json file may hold an array of records (datasets' json loader reads both)
    if name.lower().endswith(".json") and raw.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):
        return _json_array(name, raw)
    return _json_lines(name, raw)


def _first_parsed(name):
    """(where, parsed record) of the first record of a file, named as parsed names it, reading
    no further than that record; None for a file without one."""
    with open(name, "rb") as f:
        if name.lower().endswith(".json"):
            first = _first_item(f, name)
            if first is not False:
                return first
            f.seek(0)
        for n, line in enumerate(f, 1):
            where = f"{name} line {n}"
            line = decode_utf8(line, where, bom=n == 1)
            if line.strip():
                return where, json.loads(line)
    return None


_FIRST_ITEM_LIMIT = 64 << 20  # bytes of a .json array read to find its first item, at most


def _first_item(f, name):
    """(where, item 0) of a .json file holding an array, decoded until its first item parses
    (tried again each time what was read doubles: linear in the item's size); None for an empty
    array or a first item not found within _FIRST_ITEM_LIMIT (read_records judges those), False
    for a file holding no array."""
    decoder = codecs.getincrementaldecoder("utf-8-sig")()
    text, size, tried = "", 0, 0
    while True:
        chunk = f.read(max(1 << 20, size))  # reads of 1 MB, then as much as was read: doubling
        size += len(chunk)
        text += decoder.decode(chunk, final=not chunk)
        body = text.lstrip(" \t\r\n")
        if body and not body.startswith("[") or not (body or chunk):
            return False
        if chunk and size < 2 * tried:
            continue
        tried = size
        try:
            return f"{name} record 0", json.JSONDecoder().raw_decode(body[1:].lstrip())[0]
        except ValueError:
            if not chunk or size >= _FIRST_ITEM_LIMIT:
                return None


def first_records(path, train=True):
    """(where, kind) of the first record of each file of a JSONL data path (a file, or a folder's
    files as read_records reads them), reading each file no further than that record: what a
    check before the run can afford. A file that is missing, empty or whose first record is
    malformed is left out (read_records refuses it, naming where); a training folder holding
    another split's files is refused (check_splits)."""
    out = []
    try:
        names = _files(path, train)
    except FileNotFoundError:
        return out
    for name in names:
        try:
            first = _first_parsed(name)
            if first is not None:
                out.append((first[0], _check_fields(first[1], first[0])[0]))
        except (OSError, ValueError):
            pass
    return out


class Records(list):
    """read_records' examples; wheres[i] names where example i is (its file and line, or its
    index in a JSON array), for errors found when it is tokenised."""

    def __init__(self):
        super().__init__()
        self.wheres = []


def read_records(path, train=True):
    """Every example of a .jsonl or .json file (or a folder's .jsonl and .json files, in name
    order), each (kind, fields), as a Records list. A malformed record raises ValueError naming
    the file, the line (JSON Lines) or the record's index from 0 (a JSON array) and the key,
    before any is tokenised. Blank lines are skipped. train: the training data, whose folder may
    hold no other split's files (check_splits); false for data.eval_path."""
    records = Records()
    for name in _files(path, train):
        for where, record in parsed(name):
            record = _check(record, where)
            try:  # "\ud800" is valid JSON but no text: refused here, not by the tokenizer
                json.dumps(record, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"fastllm train: {where}: a lone UTF-16 surrogate "
                                 f"({e.object[e.start]!r}) is not text") from None
            records.append(record)
            records.wheres.append(where)
    if not records:
        raise ValueError(f"fastllm train: {path} holds no examples")
    return records


def text_pieces(records):
    """Every string of the records (to train a BPE tokenizer on)."""
    out = []
    for kind, fields, *_ in records:
        if kind == "chat":
            out += [m["content"] for m in fields if m.get("content") is not None]
        elif kind == "chat_completion":
            out += [m["content"] for messages in fields for m in messages
                    if m.get("content") is not None]
        elif isinstance(fields, str):
            out.append(fields)
        else:
            out += [f for f in fields if f]
    return out


def split_examples(n, eval_fraction, seed):
    """(train indices, eval indices) of n examples: a seeded eval_fraction held out (at least one
    when the fraction is > 0, and at least one left to train on)."""
    if eval_fraction <= 0:
        return list(range(n)), []
    n_eval = min(n - 1, max(1, int(round(eval_fraction * n))))
    if n_eval < 1:
        raise ValueError(f"fastllm train: data.eval_fraction={eval_fraction} needs at least two "
                         f"examples, the data has {n}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + 17)
    perm = torch.randperm(n, generator=g).tolist()
    return sorted(perm[n_eval:]), sorted(perm[:n_eval])
