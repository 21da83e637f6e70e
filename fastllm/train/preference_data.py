"""Preference data (TRL's explicit-prompt format) tokenised into DPO's chosen/rejected rows.

A record is one prompt with a preferred and a dispreferred completion, strings or message lists
(TRL's "standard" and "conversational" preference records):

    {"prompt": "What is the capital of Kenya?", "chosen": " Nairobi.", "rejected": " Dodoma."}
    {"prompt": [{"role": "user", "content": "..."}],
     "chosen": [{"role": "assistant", "content": "..."}],
     "rejected": [{"role": "assistant", "content": "..."}]}

Each side is tokenised as the SFT prompt-completion record {"prompt", "completion": side} is
(fastllm.train.sft_data.encode_example: TRL's rules, the chat template for message lists), so
the completion's tokens are the targets and the prompt's are not. A batch of B records is 2B
rows, the B chosen first, right-padded: what fastllm.preference.sequence_logps and dpo_loss take.
"""

import torch

from fastllm.train.sft_records import _check_fields, _files, parsed, template_inputs

__all__ = ["read_pairs", "encode_pair", "pair_batch"]

_SIDES = ("chosen", "rejected")
_TEMPLATE_KEYS = ("tools", "chat_template_kwargs")  # TRL's per-record chat template inputs


def _check_pair(record, where):
    """The record's two sides as SFT prompt-completion records ((kind, fields) or (kind, fields,
    template inputs)), or ValueError naming where and the key."""
    if not isinstance(record, dict):
        raise ValueError(f"fastllm train: {where}: a preference record must be a JSON object, got "
                         f"{type(record).__name__}")
    missing = [k for k in ("prompt",) + _SIDES if k not in record]
    if missing:
        hint = (" (an implicit-prompt record, the prompt inside chosen and rejected, is not "
                "read: give the prompt as its own key)" if missing == ["prompt"] else "")
        raise ValueError(f"fastllm train: {where}: a preference record needs the keys 'prompt', "
                         f"'chosen' and 'rejected'; {missing} missing{hint}")
    sides = []
    for side in _SIDES:
        # only the prompt-completion record's keys: another record kind's ("messages", ...)
        # beside them would make SFT's check read the record as that kind
        one = {k: record[k] for k in _TEMPLATE_KEYS if k in record}
        one.update(prompt=record["prompt"], completion=record[side])
        try:
            normal = _check_fields(one, where)
            extra = template_inputs(one, normal[0], where)
        except ValueError as e:  # name the side, not SFT's 'completion'
            raise ValueError(str(e).replace("'completion'", repr(side))) from None
        sides.append(normal + (extra,) if extra else normal)
    return sides


def read_pairs(path):
    """The preference records of a .jsonl or .json file (or a folder's), each a pair of SFT
    prompt-completion records, with wheres (file and line, or index in a JSON array). A
    malformed record raises ValueError naming where it is and the key, before any is read on."""
    pairs, wheres = [], []
    for name in _files(path):
        for where, record in parsed(name):
            pairs.append(_check_pair(record, where))
            wheres.append(where)
    if not pairs:
        raise ValueError(f"fastllm train: {path} holds no preference records")
    return pairs, wheres


def encode_pair(pair, tokenizer, where="a preference record"):
    """((chosen ids, chosen mask), (rejected ids, rejected mask)): lists of ints, mask 1 on the
    completion's tokens. tokenizer: fastllm.train.data.HFTokenizer (or ByteTokenizer)."""
    from fastllm.train.sft_data import encode_example

    out = []
    for side, record in zip(_SIDES, pair):
        ids, mask = encode_example(record, tokenizer)
        if not any(mask):
            raise ValueError(f"fastllm train: {where}: the {side} completion has no token")
        out.append((ids, mask))
    return tuple(out)


def pair_batch(encoded, pad_id, max_length=None, where=None):
    """input_ids, labels (-100 off the completions and on the padding), attention_mask: (2B, T)
    int64 tensors, the B chosen rows first, right-padded to the longest row. max_length cuts
    each row's end (TRL's truncation_mode="keep_start"); a row left with no completion token is
    refused, naming its pair (`where`: a list of the pairs' wheres)."""
    rows = [pair[0] for pair in encoded] + [pair[1] for pair in encoded]
    if max_length is not None:
        rows = [(ids[:max_length], mask[:max_length]) for ids, mask in rows]
    for i, (_, mask) in enumerate(rows):
        if not any(mask):
            b = i % len(encoded)
            name = where[b] if where else f"pair {b}"
            raise ValueError(f"fastllm train: {name}: the {_SIDES[i // len(encoded)]} row keeps no "
                             f"completion token within max_length={max_length}")
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for r, (row, mask) in enumerate(rows):
        n = len(row)
        ids[r, :n] = torch.tensor(row)
        keep = torch.tensor(mask, dtype=torch.bool)
        labels[r, :n] = ids[r, :n].masked_fill(~keep, -100)
        attention[r, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": attention}
