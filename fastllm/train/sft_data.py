"""Supervised fine-tuning data: JSON Lines / JSON instructions and chats (read and checked by
fastllm.train.sft_records, which lists the shapes) -> token ids and a loss mask in the
memory-mapped cache (tokenised once) -> packed or length-grouped batches.

Chats are rendered with the tokenizer's own chat template (apply_chat_template, given a record's
tools and chat_template_kwargs as TRL gives them), and so are Alpaca records when the tokenizer
has one (as a user turn and an assistant turn); without a template an Alpaca record takes
Stanford Alpaca's prompt. data.train_on_prompt=true counts every token (of a chat, its whole
render: what TRL's SFTTrainer trains on for a conversational record by default). A chat's
replies are found by rendering it up to each, and their tokens are those with a character in a
reply; a template that renders earlier turns differently once later ones follow (Qwen3's) needs
{% generation %} markers (the assistant mask of TRL's assistant_only_loss) or is refused. A
prompt and its completion are tokenised as TRL's SFTTrainer does: the two together (strings
joined; messages rendered together), the prompt being as many tokens as it tokenises to alone (a
conversational prompt rendered with add_generation_prompt). Text, prompts and Alpaca prompts
without a template start with what the tokenizer puts before a text (Llama's BOS, GPT-2's
nothing) and end with one EOS, as in TRL.

Batches are dicts of (batch, length) int64 tensors: input_ids, labels (-100 where the loss does
not count: prompts, padding and each example's first token) and position_ids. With packing
(data.packing=true) several examples share a row and their position ids restart at 0 at each
example; transformers (>= 4.57's masking_utils.find_packed_sequence_indices) turns restarting
position ids, with no attention_mask, into a block-diagonal causal mask for eager, sdpa and flex
attention, so a packed row computes exactly what its examples compute one by one. Without
packing a row is one example, and a micro-batch's rows have similar lengths (HF's
LengthGroupedSampler: sorted within mega-batches) and are padded to the longest.
"""

import hashlib
import json
import os
import re
import warnings

import numpy as np
import torch
import torch.distributed as dist

from fastllm.train.config_values import ConfigError
from fastllm.train.sft_records import (data_format, read_records, split_examples,
                                       text_pieces)

__all__ = ["data_format", "read_records", "encode_example", "tokenize_records", "SFTDataset",
           "split_examples", "prompt_ids", "build_sft_data", "build_datasets", "Batch",
           "prepare_step", "model_inputs", "max_steps", "text_pieces", "dp_sum", "gather_samples",
           "render_chat", "chat_refusal", "check_rows", "IGNORE_INDEX", "NO_TEMPLATE_HINT"]

IGNORE_INDEX = -100
# what to do when the run's tokenizer has no chat template (byte and bpe have none)
NO_TEMPLATE_HINT = "(data.tokenizer=<a model folder>, or model=<an HF folder>)"
# sft-6: a template's {% generation %} markers before prefixes; sft-5: a chat tokenised whole,
# its replies found by offsets; sft-4: records' tools, chat_template_kwargs and messages'
# tool_calls rendered; sft-3: prompt and completion tokenised together
_VERSION = "sft-6"
# transformers' marker of a chat template's assistant text (return_assistant_tokens_mask)
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
_NO_REPLIES = ("fastllm train: the tokenizer's chat template renders a chat's earlier turns "
               "differently once later turns follow (a chat is no prefix of its longer chats), "
               "so the assistant turns to train on cannot be found: set "
               "data.train_on_prompt=true (train on the whole chat, TRL's default for "
               "conversational data), use a chat template with {% generation %} markers or one "
               "that renders chats as prefixes, or give the chat as a prompt and a completion "
               "(message lists: the completion's turns count)")
# Stanford Alpaca's prompts (github.com/tatsu-lab/stanford_alpaca, train.py PROMPT_DICT)
_ALPACA = ("Below is an instruction that describes a task. Write a response that appropriately "
           "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")
_ALPACA_INPUT = ("Below is an instruction that describes a task, paired with an input that "
                 "provides further context. Write a response that appropriately completes the "
                 "request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n"
                 "### Response:\n")


def chat_refusal(where, tokenizer_name):
    """The error for a chat example (where: its file and line, or None) and a tokenizer without
    a chat template: the same from fastllm.train.preflight, before the run, and from tokenising."""
    where = f"{where}: " if where else ""
    return (f"fastllm train: {where}chat examples need a tokenizer with a chat template; "
            f"{tokenizer_name} has none {NO_TEMPLATE_HINT}")


def _template(tokenizer):
    tok = getattr(tokenizer, "tok", None)
    return getattr(tok, "chat_template", None) if tok is not None else None


def render_chat(tokenizer, messages, add_generation_prompt=False, template=None):
    """The chat as text (tokenizer: a fastllm HFTokenizer or a transformers one); template: a
    record's TRL inputs ({"tools", "chat_template_kwargs"}), passed as TRL's SFTTrainer passes
    them."""
    return _apply_template(tokenizer, messages, template, tokenize=False,
                           add_generation_prompt=add_generation_prompt)


def _apply_template(tokenizer, messages, template, **kwargs):
    """apply_chat_template(messages, **kwargs) with a record's tools and template kwargs."""
    from jinja2.exceptions import TemplateError

    template = template or {}
    tok = getattr(tokenizer, "tok", tokenizer)
    try:
        return tok.apply_chat_template(messages, tools=template.get("tools"), **kwargs,
                                       **template.get("chat_template_kwargs", {}))
    except (TemplateError, TypeError) as e:
        # a template's raise_exception (Mistral's, refusing a system turn) or a message it
        # cannot render (UndefinedError; transformers 5.17 hands jinja a None content, whose
        # '...' + None is a TypeError): the user's data, not a bug of ours
        raise ValueError(f"fastllm train: the tokenizer's chat template refused the chat: "
                         f"{type(e).__name__}: {e}") from None


def _chat_pieces(tokenizer, messages, template=None):
    """The rendered chat as (text, is_assistant_reply) pieces: each assistant reply (its content
    and the template's end-of-turn text) is the rendering of the chat up to it minus the
    rendering before it with the generation prompt. None when the template renders an earlier
    turn differently once later turns follow (Qwen3 drops earlier replies' <think> blocks, Phi-3
    puts its EOS at the end only, Mistral v0.3 the system prompt in the last user turn)."""
    full = render_chat(tokenizer, messages, template=template)
    pieces, done = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i:
            before = render_chat(tokenizer, messages[:i], add_generation_prompt=True,
                                 template=template)
        else:
            # transformers renders no empty chat, and a template may open with text of its own
            # (SmolLM2's default system turn) and the reply's header: what two renderings share
            # when their replies differ only in the first character is the text before the reply
            a, b = (render_chat(tokenizer, [dict(m, content=c + (m.get("content") or ""))],
                                template=template) for c in "\ue000\ue001")
            before = os.path.commonprefix([a, b])
        upto = render_chat(tokenizer, messages[:i + 1], template=template)
        if not (full.startswith(upto) and upto.startswith(before) and len(before) >= done):
            return None
        pieces += [(full[done:len(before)], False), (upto[len(before):], True)]
        done = len(upto)
    pieces.append((full[done:], False))
    return [(t, a) for t, a in pieces if t]


def _marked_chat(tokenizer, messages, template=None):
    """(ids, mask) of a chat whose template marks the replies with {% generation %}:
    apply_chat_template's assistant mask (what TRL's assistant_only_loss trains on); None when
    the template has no markers or the tokenizer no offsets (a slow one)."""
    tok, source = getattr(tokenizer, "tok", None), _template(tokenizer)
    source = "".join(source.values()) if isinstance(source, dict) else source or ""
    if not (getattr(tok, "is_fast", False) and _GENERATION.search(source)):
        return None
    out = _apply_template(tokenizer, messages, template, tokenize=True, return_dict=True,
                          return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def _encode_chat(tokenizer, pieces, train_on_prompt):
    """(ids, mask) of a rendered chat's pieces. The whole render is tokenised at once, as TRL's
    SFTTrainer tokenises it and as the prompt is at inference (a SentencePiece tokenizer encoding
    each piece alone would put a word-start marker, a space, at the head of each); a token is a
    target when a character of it is in an assistant reply (transformers'
    return_assistant_tokens_mask marks the tokens from the reply's first character to its last).
    A tokenizer without offsets (the byte tokenizer, where pieces join exactly; a slow Hugging
    Face one) encodes piece by piece."""
    tok = getattr(tokenizer, "tok", None)
    if tok is None or not getattr(tok, "is_fast", False):
        ids, mask = [], []
        for text, counts in pieces:
            piece = tokenizer.encode(text)
            ids += piece
            mask += [int(counts or train_on_prompt)] * len(piece)
        return ids, mask
    enc = tok("".join(t for t, _ in pieces), add_special_tokens=False,
              return_offsets_mapping=True)
    spans, at = [], 0
    for text, counts in pieces:
        if counts:
            spans.append((at, at + len(text)))
        at += len(text)

    def target(start, end):  # the token's characters [start, end) meet a reply (a token of no
        end = max(end, start + 1)  # characters, as some tokenizers' markers: the one at start)
        return any(start < b and a < end for a, b in spans)

    return list(enc["input_ids"]), [int(train_on_prompt or target(*o))
                                    for o in enc["offset_mapping"]]


def _prompt_mask(ids, head, train_on_prompt):
    """The loss mask of prompt + completion ids whose prompt alone tokenises to `head`: the first
    len(head) positions are the prompt (TRL's completion_mask), whether or not `head` is a prefix
    of ids (TRL warns, and so do we)."""
    if ids[:len(head)] != head and not train_on_prompt:  # (every token counts: no boundary)
        warnings.warn("fastllm train: a prompt's tokens are not a prefix of its prompt + "
                      "completion tokens (whitespace at their join, or the template); its first "
                      "len(prompt tokens) tokens are the prompt, as in TRL's SFTTrainer")
    n = min(len(head), len(ids))
    return [int(train_on_prompt)] * n + [1] * (len(ids) - n)


def prompt_ids(record, tokenizer):
    """The tokens of a prompt-completion record's prompt alone, as TRL tokenizes it: a chat
    prompt rendered with the generation prompt (and the record's template inputs), a text one
    after what the tokenizer puts before a text (Llama's BOS)."""
    kind, (prompt, _), *rest = record
    if kind == "chat_completion":
        return tokenizer.encode(render_chat(tokenizer, prompt, add_generation_prompt=True,
                                            template=rest[0] if rest else None))
    return list(getattr(tokenizer, "bos_ids", ())) + tokenizer.encode(prompt)


def encode_example(record, tokenizer, train_on_prompt=False):
    """(token ids, loss mask) of one (kind, fields) or (kind, fields, template inputs) record
    (fastllm.train.sft_records): lists of ints, mask 1 where the token is a target of the loss.
    A conversational record's tools and chat_template_kwargs go to apply_chat_template, as
    TRL's SFTTrainer passes them."""
    kind, fields, *rest = record
    template = rest[0] if rest else None  # a conversational record's tools / template kwargs
    eos = tokenizer.eos_token_id
    if kind == "alpaca":
        instruction, inp, output, system = fields
        if _template(tokenizer):
            user = instruction + ("\n\n" + inp if inp else "")
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": user}, {"role": "assistant", "content": output}]
            kind, fields = "chat", messages
        else:
            prompt = (_ALPACA_INPUT if inp else _ALPACA).format(instruction=instruction, input=inp)
            kind, fields = "completion", ((system + "\n\n" if system else "") + prompt, output)
    if kind in ("chat", "chat_completion") and not _template(tokenizer):
        raise ValueError(chat_refusal(None, tokenizer.name))
    if kind == "chat":
        # with train_on_prompt every token counts (TRL's default for a conversational record):
        # the whole render, tokenised at once (a tokenizer without offsets: by its pieces when
        # the template has them); else the replies the template marks with {% generation %}
        # (TRL's assistant_only_loss: what the markers leave out, as ChatML's '\n' after
        # <|im_end|>, is no target), else by prefixes
        marked = None if train_on_prompt else _marked_chat(tokenizer, fields, template)
        whole = train_on_prompt and getattr(getattr(tokenizer, "tok", None), "is_fast", False)
        pieces = None if whole or marked else _chat_pieces(tokenizer, fields, template)
        if pieces is None and train_on_prompt:
            pieces = [(render_chat(tokenizer, fields, template=template), False)]
        elif pieces is None and not marked:
            raise ValueError(_NO_REPLIES)
        return marked or _encode_chat(tokenizer, pieces, train_on_prompt)
    if kind == "chat_completion":
        # TRL's SFTTrainer: the prompt rendered with the generation prompt, prompt + completion
        # rendered together; the template ends the turns itself (no EOS added)
        prompt, completion = fields
        ids = tokenizer.encode(render_chat(tokenizer, prompt + completion, template=template))
        return ids, _prompt_mask(ids, prompt_ids(record, tokenizer), train_on_prompt)
    # what the tokenizer puts before a text (Llama's BOS), as TRL's SFTTrainer and generation
    # without a template tokenize; a chat template writes its own
    bos = list(getattr(tokenizer, "bos_ids", ()))
    if kind == "text":
        ids = bos + tokenizer.encode(fields)
        n, mask = len(bos), [1] * len(ids)
    else:
        # prompt + completion tokenised together, as TRL does (" Paris" after "What is ", not
        # " " and "Paris"); the prompt is as many tokens as it has alone
        prompt, completion = fields
        ids = bos + tokenizer.encode(prompt + completion)
        head = prompt_ids((kind, fields), tokenizer)
        n, mask = len(head), _prompt_mask(ids, head, train_on_prompt)
    # one EOS at the end; a text or completion that ends with the EOS keeps it (TRL's add_eos)
    if eos is None:
        from fastllm.train.data import no_eos_message

        raise ValueError(no_eos_message(tokenizer.name))
    if not (len(ids) > n and ids[-1] == eos):
        ids.append(eos)
        mask.append(1)
    return ids, mask


def _cache_dir(cfg_dir):
    return cfg_dir or os.environ.get("FASTLLM_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "fastllm")


def tokenize_records(records, tokenizer, cache_dir, train_on_prompt=False):
    """Tokenise once into `<cache>/sft-<hash>.bin` (ids, uint16/uint32), `.mask.bin` (uint8) and
    `.offsets.npy` (int64, examples + 1); later calls with the same records, tokenizer, template
    and masking reuse them. Returns the path of the .bin."""
    h = hashlib.sha256(f"{_VERSION}-{tokenizer.name}-{tokenizer.vocab_size}-"
                       f"{train_on_prompt}-{_template(tokenizer)}".encode())
    for r in records:
        h.update(json.dumps(r, ensure_ascii=False).encode())
        h.update(b"\0")
    folder = _cache_dir(cache_dir)
    path = os.path.join(folder, f"sft-{h.hexdigest()[:24]}.bin")
    if os.path.exists(path + ".json"):
        return path
    os.makedirs(folder, exist_ok=True)
    ids, mask, offsets = [], [], [0]
    wheres = getattr(records, "wheres", None)  # read_records' (file and line of each)
    for k, r in enumerate(records):
        try:
            i, m = encode_example(r, tokenizer, train_on_prompt)
        except ValueError as e:
            if not wheres:
                raise
            raise ValueError(f"fastllm train: {wheres[k]}: "
                             f"{str(e).removeprefix('fastllm train: ')}") from None
        ids += i
        mask += m
        offsets.append(len(ids))
    dtype = np.uint16 if tokenizer.vocab_size <= 65535 else np.uint32
    tmp = f".{os.getpid()}.tmp"
    np.asarray(ids, dtype=dtype).tofile(path + tmp)
    np.asarray(mask, dtype=np.uint8).tofile(path + ".mask" + tmp)
    with open(path + ".offsets" + tmp, "wb") as f:
        np.save(f, np.asarray(offsets, dtype=np.int64))
    os.replace(path + tmp, path)
    os.replace(path + ".mask" + tmp, path + ".mask.bin")
    os.replace(path + ".offsets" + tmp, path + ".offsets.npy")
    with open(path + ".json" + tmp, "w") as f:
        json.dump({"dtype": np.dtype(dtype).name, "tokens": len(ids), "examples": len(records),
                   "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size,
                   "train_on_prompt": train_on_prompt}, f)
    os.replace(path + ".json" + tmp, path + ".json")
    return path


# Rows of one length-grouped mega-batch (data.packing=false): at most this many, a quarter of the
# rows in a smaller dataset (one mega-batch of all of them would be one sort: the same order in
# every epoch and for every seed). Set by the row count alone, so an epoch's order is the same at
# any micro_batch_size, which a resume may change (to fit memory) while the saved data position
# indexes that order. HF's LengthGroupedSampler uses at most 50 batches (of per-device x
# accumulation rows) and about a quarter of the rows; 512 is 50 batches of about 10 rows.
MEGA_BATCH = 512


class SFTDataset:
    """Rows of examples of a tokenize_records cache, `indices` of its examples (truncated to
    seq_len tokens), in a seeded order reshuffled every epoch; the PackedDataset interface
    (num_sequences, batch(samples)) so fastllm.train.data.Loader serves it.

    packing: rows are bins of whole examples (best-fit decreasing, computed once), padded to the
    longest row of the micro-batch; else one example per row, micro-batches of similar length
    (length-grouped in mega-batches of up to MEGA_BATCH rows). pad_to_multiple_of: each batch's
    width rounded up to a multiple of it (parallel.tp under sequence parallel, which splits the
    sequence over the tp ranks; seq_len is a multiple of it).
    """

    def __init__(self, path, indices, seq_len, seed, packing=True, pad_id=0,
                 pad_to_multiple_of=1):
        with open(path + ".json") as f:
            meta = json.load(f)
        self.tokens = np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")
        self.mask = np.memmap(path + ".mask.bin", dtype=np.uint8, mode="r")
        offsets = np.load(path + ".offsets.npy")
        self.spans = [(int(offsets[i]), min(int(offsets[i + 1]), int(offsets[i]) + seq_len))
                      for i in indices]
        if not self.spans:
            raise ValueError("fastllm train: no examples to train on")
        self.truncated = sum(int(offsets[i + 1] - offsets[i]) > seq_len for i in indices)
        self.seq_len, self.seed, self.packing = seq_len, seed, packing
        self.pad_id, self.pad_to_multiple_of = pad_id, pad_to_multiple_of
        lengths = [e - s for s, e in self.spans]
        self.rows = _pack(lengths, seq_len) if packing else [[i] for i in range(len(lengths))]
        self.num_sequences = len(self.rows)
        self._lengths = [sum(lengths[i] for i in row) for row in self.rows]
        self._order_epoch, self._order = None, None

    def _epoch_order(self, epoch):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(self.num_sequences, generator=g).tolist()
        if self.packing:
            return perm
        # length-grouped (HF's LengthGroupedSampler): longest first within each mega-batch
        mega = min(MEGA_BATCH, max(1, self.num_sequences // 4))
        return [i for k in range(0, len(perm), mega)
                for i in sorted(perm[k:k + mega], key=lambda j: -self._lengths[j])]

    def row(self, sample):
        epoch, i = divmod(sample, self.num_sequences)
        if epoch != self._order_epoch:
            self._order, self._order_epoch = self._epoch_order(epoch), epoch
        return self._order[i]

    def batch(self, samples, rows=None):
        """{'input_ids', 'labels', 'position_ids'}: (len(samples), longest row) int64, and
        'num_tokens' (a 0-d tensor: the rows' tokens without padding)."""
        rows = [self.rows[self.row(s)] for s in samples] if rows is None else rows
        width = max(sum(self.spans[i][1] - self.spans[i][0] for i in row) for row in rows)
        width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.int64)
        labels = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.int64)
        pos = torch.zeros((len(rows), width), dtype=torch.int64)
        for b, row in enumerate(rows):
            at = 0
            for i in row:
                s, e = self.spans[i]
                n = e - s
                tok = torch.from_numpy(self.tokens[s:e].astype(np.int64))
                keep = torch.from_numpy(self.mask[s:e].astype(bool))
                ids[b, at:at + n] = tok
                labels[b, at:at + n] = torch.where(keep, tok, IGNORE_INDEX)
                # the first token is predicted by nothing of its own example (in a packed row,
                # by the previous example's last token)
                labels[b, at] = IGNORE_INDEX
                pos[b, at:at + n] = torch.arange(n)
                at += n
            # padding: a segment of its own (positions from 0), never a target
            pos[b, at:] = torch.arange(width - at)
        return Batch({"input_ids": ids, "labels": labels, "position_ids": pos,
                      "num_tokens": torch.tensor(sum(self.spans[i][1] - self.spans[i][0]
                                                     for row in rows for i in row))})

    def all_batches(self, batch_size):
        """Every row once, in order, in batches of batch_size (for evaluation)."""
        for k in range(0, self.num_sequences, batch_size):
            yield self.batch(None, rows=self.rows[k:k + batch_size])


def _pack(lengths, capacity):
    """Best-fit decreasing bin packing: lists of example indices, each list's lengths summing to
    at most capacity; deterministic."""
    import bisect

    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins, free = [], []  # free: sorted (room left, bin index)
    for i in order:
        k = bisect.bisect_left(free, (lengths[i], -1))
        if k == len(free):
            bins.append([i])
            room, b = capacity - lengths[i], len(bins) - 1
        else:
            room, b = free.pop(k)
            bins[b].append(i)
            room -= lengths[i]
        bisect.insort(free, (room, b))
    return bins


def build_sft_data(cfg, tokenizer, records=None, log=print):
    """(train SFTDataset, eval SFTDataset or None) for a TrainConfig whose data is JSONL:
    data.path (or its `records`), split by data.eval_fraction (seeded) unless data.eval_path
    is given."""
    data = cfg.data
    records = read_records(data.path) if records is None else records
    eval_records = read_records(data.eval_path, train=False) if data.eval_path else None
    path = tokenize_records(records, tokenizer, data.cache_dir, data.train_on_prompt)
    pad = getattr(getattr(tokenizer, "tok", None), "pad_token_id", None)
    pad = tokenizer.eos_token_id if pad is None else pad
    kw = dict(seq_len=data.seq_len, seed=cfg.seed, packing=data.packing, pad_id=pad,
              pad_to_multiple_of=cfg.parallel.tp if cfg.parallel.sequence_parallel else 1)
    if eval_records is not None:
        train = SFTDataset(path, range(len(records)), **kw)
        epath = tokenize_records(eval_records, tokenizer, data.cache_dir, data.train_on_prompt)
        held = SFTDataset(epath, range(len(eval_records)), **kw)
    else:
        tr, ev = split_examples(len(records), data.eval_fraction, cfg.seed)
        train = SFTDataset(path, tr, **kw)
        held = SFTDataset(path, ev, **kw) if ev else None
    if train.truncated:
        log(f"fastllm train: {train.truncated} of {len(train.spans)} examples are longer than "
            f"data.seq_len={data.seq_len} tokens and were truncated")
    # (each example's first token is predicted by nothing of its own: never a target)
    if not any(train.mask[s + 1:e].any() for s, e in train.spans):
        raise ValueError(f"fastllm train: no training example has a target token within "
                         f"data.seq_len={data.seq_len} ({train.truncated} of {len(train.spans)} "
                         f"truncated; a completion's tokens count, an example's first token "
                         f"never): raise data.seq_len or give longer completions")
    return train, held


class Batch(dict):
    """An SFT micro-batch: the model's keyword arguments, moved together by .to() (as a tensor
    of token ids is)."""

    def to(self, device, non_blocking=False):
        return type(self)({k: v.to(device, non_blocking=non_blocking) if torch.is_tensor(v)
                           else v for k, v in self.items()})


def prepare_step(micro, reduce=None, dp=1):
    """Ready a step's micro-batches [(samples, batch)] for the model; returns (real (unpadded)
    tokens, target tokens) of the whole step over every data-parallel rank, or None for plain
    token windows. SFT batches: the step's loss is the mean over all its target tokens,
    whichever micro-batch and data-parallel rank holds them (transformers' num_items_in_batch,
    times the accumulation and dp, which the trainer's loss / accumulation and the gradient
    average over dp undo; HF's average_tokens_across_devices).

    reduce(t): t (a (2,) int64 CPU tensor) summed over the dp ranks, each batch counted once
    (None: one process)."""
    batches = [b for _, b in micro if isinstance(b, dict)]
    if not batches:
        return None
    counts = torch.tensor([sum(int(b.pop("num_tokens")) for b in batches),
                           sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in batches)],
                          dtype=torch.int64)
    if reduce is not None:  # one collective per step, not per micro-batch
        counts = reduce(counts)
    tokens, targets = int(counts[0]), int(counts[1])
    for b in batches:
        # a step without targets is skipped by the trainer (its loss would read 0)
        b["num_items_in_batch"] = max(targets, 1) / (len(micro) * dp)
    return tokens, targets


def dp_sum(layout, device, world):
    """prepare_step's `reduce` for a run on `world` ranks of `layout`: a count summed over the
    world, less the tp and pp ranks that read copies of each dp rank's batch (None: one
    process)."""
    if world == 1:
        return None

    def reduce(counts):
        counts = counts.to(device)  # (NCCL reduces device tensors only)
        dist.all_reduce(counts)
        return counts.cpu() // (layout.tp * layout.pp)
    return reduce


def gather_samples(micro, world):
    """The sample indices of a step's micro-batches [(samples, batch)] over every rank."""
    mine = [s for samples, _ in micro for s in samples]
    if world == 1:
        return mine
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    # the tp ranks and pipeline stages of one data-parallel rank read the same samples
    return list({s for part in everyone for s in part})


def model_inputs(batch):
    """The model's keyword arguments for a micro-batch: an SFT Batch as it is, a tensor of token
    ids as input_ids and labels."""
    return batch if isinstance(batch, dict) else dict(input_ids=batch, labels=batch)


def build_datasets(cfg, model_dir, rank, world, barrier, log=print):
    """(tokenizer, train dataset, eval dataset or None) of cfg.data: JSONL examples (SFTDataset)
    or text (fastllm.train.data.PackedDataset). Rank 0 tokenises (and trains a BPE) first, the
    other ranks then find the cache. Nothing is written to output_dir (a record refused here must
    leave an earlier run there as it was): fastllm.train.run_dir.save_run_files saves an HF
    tokenizer to output_dir/tokenizer once the run's resume checks passed."""
    from fastllm.train.data import PackedDataset, build_tokenizer, load_text, tokenize_to_file

    data = cfg.data
    sft = data_format(data.path, data.format) == "jsonl"
    if sft and cfg.parallel.pp > 1:
        raise ValueError("fastllm train: JSONL (SFT) data does not run under parallel.pp > 1")
    records = read_records(data.path) if sft else None
    docs = text_pieces(records) if sft else load_text(data.path)
    held = None
    for turn in ((0,) if world == 1 else (0, 1)):
        if (rank == 0) == (turn == 0):
            tok = build_tokenizer(data.tokenizer, docs, data.vocab_size, data.cache_dir,
                                  model_dir)
            if sft:
                train, held = build_sft_data(cfg, tok, records, log)
            else:
                path = tokenize_to_file(docs, tok, data.cache_dir)
        barrier()
    if not sft:
        train = PackedDataset(path, data.seq_len, cfg.seed)
    return tok, train, held


def max_steps(cfg, dataset, global_batch, dp=1):
    """cfg.max_steps when set (> 0: it overrides num_train_epochs, as in HF), else the steps
    num_train_epochs take over `dataset`, else config.DEFAULT_MAX_STEPS. A warmup_steps longer
    than that is warned about (HF's Trainer accepts it too): the peak lr is never reached. Data
    of fewer rows than one global batch (of dp data-parallel ranks) is refused (check_rows)."""
    check_rows(cfg, dataset, global_batch, dp)
    steps = cfg.resolved_max_steps(dataset.num_sequences, global_batch)
    if cfg.warmup_steps > steps:
        warnings.warn(f"fastllm train: warmup_steps={cfg.warmup_steps} is longer than max_steps="
                      f"{steps}: the lr never reaches its peak lr={cfg.lr}", stacklevel=2)
    return steps


def check_rows(cfg, dataset, global_batch, dp=1):
    """Refuse data of fewer rows (packed rows of SFT examples, or text windows) than one global
    batch: every step takes global_batch rows, so one step would hold the same row more than
    once. (A step at an epoch's end that takes the next epoch's first rows, when the rows are
    no multiple of the batch, is torch's DistributedSampler padding, and allowed.)"""
    rows = dataset.num_sequences
    if rows >= global_batch:
        return
    spans = getattr(dataset, "spans", None)
    what = (f"{len(spans)} examples in {rows} rows of data.seq_len={cfg.data.seq_len} tokens"
            f"{' (packed)' if dataset.packing else ''}" if spans is not None else
            f"{rows} preference pairs (a pair is one sample)" if hasattr(dataset, "pairs") else
            f"{rows} windows of data.seq_len={cfg.data.seq_len} tokens")
    accum = global_batch // max(1, cfg.micro_batch_size * dp)
    packed = (f" (or data.packing=false: a row per example, {len(spans)} rows)"
              if spans is not None and dataset.packing else "")
    raise ConfigError(f"fastllm train: the data holds {what}, fewer than the global batch of "
                      f"{global_batch} rows (micro_batch_size={cfg.micro_batch_size} x "
                      f"{accum} accumulation x {dp} data parallel): every step would train on "
                      f"the same rows more than once. Lower micro_batch_size, "
                      f"gradient_accumulation_steps or global_batch_size (or the data-parallel "
                      f"size) to at most {rows} rows a step, or give more data"
                      f"{packed}")
