"""Preference data (TRL's explicit-prompt format) tokenised into DPO's chosen/rejected rows.

A record is one prompt with a preferred and a dispreferred completion, strings or message lists
(TRL's "standard" and "conversational" preference records):

    {"prompt": "What is the capital of Kenya?", "chosen": " Nairobi.", "rejected": " Dodoma."}
    {"prompt": [{"role": "user", "content": "..."}],
     "chosen": [{"role": "assistant", "content": "..."}],
     "rejected": [{"role": "assistant", "content": "..."}]}

Each side is tokenised as the SFT prompt-completion record {"prompt", "completion": side} is
(fastllm.train.sft_data.encode_example: TRL's rules, the chat template for message lists), so the
completion's tokens are the targets and the prompt's are not; the completion starts where the
prompt's tokens and either side's part ways (TRL's DPOTrainer; encode_pair). A batch of B records is
2B rows, the B chosen first, right-padded: what fastllm.preference.sequence_logps and dpo_loss take.

PreferenceDataset serves such batches to `fastllm train objective=dpo|cpo|orpo`
(fastllm.train.data.Loader: a sample is a pair, micro_batch_size pairs a micro-batch, as TRL's
per_device_train_batch_size).
"""

import torch

from fastllm.train.sft_data import Batch
from fastllm.train.sft_records import _check_fields, _files, parsed, template_inputs

__all__ = ["read_pairs", "encode_pair", "pair_batch", "PairBatch", "PreferenceDataset",
           "build_preference_data", "pair_texts"]

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


def read_pairs(path, train=True):
    """The preference records of a .jsonl or .json file (or a folder's), each a pair of SFT
    prompt-completion records, with wheres (file and line, or index in a JSON array). A
    malformed record raises ValueError naming where it is and the key, before any is read on.
    train: the training data, whose folder may hold no other split's files (as SFT's)."""
    pairs, wheres = [], []
    for name in _files(path, train):
        for where, record in parsed(name):
            pairs.append(_check_pair(record, where))
            wheres.append(where)
    if not pairs:
        raise ValueError(f"fastllm train: {path} holds no preference records")
    return pairs, wheres


def encode_pair(pair, tokenizer, where="a preference record"):
    """((chosen ids, chosen mask), (rejected ids, rejected mask)): lists of ints, mask 1 on the
    completion's tokens. tokenizer: fastllm.train.data.HFTokenizer (or ByteTokenizer).

    The completion starts where the prompt's own tokens and either side's part ways, as in TRL's
    DPOTrainer (a prompt ending in a space merges it into the completion's first word: ' Paris'
    is scored, not left to the prompt as SFT's first-len(prompt)-tokens rule would)."""
    import warnings

    from fastllm.train.sft_data import encode_example, prompt_ids

    with warnings.catch_warnings():  # (SFT's warning names SFT's rule; DPO's is below)
        warnings.simplefilter("ignore")
        rows = [encode_example(record, tokenizer)[0] for record in pair]
    head = prompt_ids(pair[0], tokenizer)  # (one prompt for both sides)
    n = min(_common_prefix(head, ids) for ids in rows)
    if n < len(head):
        warnings.warn("fastllm train: a prompt's tokens are not a prefix of prompt + "
                      "completion's (tokens merge across the join, or the template); the "
                      "completion starts where they part, as in TRL's DPOTrainer")
    out = []
    for side, ids in zip(_SIDES, rows):
        if len(ids) <= n:
            raise ValueError(f"fastllm train: {where}: the {side} completion has no token")
        out.append((ids, [0] * n + [1] * (len(ids) - n)))
    return tuple(out)


def _common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


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


def pair_texts(pairs):
    """Every string of read_pairs' pairs (to train a BPE tokenizer on)."""
    from fastllm.train.sft_records import text_pieces

    return text_pieces([side for pair in pairs for side in pair])


class PairBatch(Batch):
    """A DPO micro-batch: pair_batch's tensors and 'num_tokens' (the rows' unpadded tokens),
    moved together by .to() (fastllm.train.sft_data.Batch's)."""


class PreferenceDataset:
    """Tokenised pairs (encode_pair's), each side cut to seq_len tokens (a pair left without a
    completion token on either side is dropped: `dropped` counts them), in a seeded order
    reshuffled every epoch; the interface fastllm.train.data.Loader serves (num_sequences:
    the pairs, batch(samples))."""

    def __init__(self, encoded, wheres, seq_len, seed, pad_id):
        # a side's first token is scored by nothing (position t scores label t + 1)
        fits = [all(any(mask[1:seq_len]) for _, mask in pair) for pair in encoded]
        self.pairs = [p for p, ok in zip(encoded, fits) if ok]
        self.wheres = [w for w, ok in zip(wheres, fits) if ok]
        self.dropped = len(encoded) - len(self.pairs)
        self.truncated = sum(any(len(ids) > seq_len for ids, _ in pair) for pair in self.pairs)
        self.seq_len, self.seed, self.pad_id = seq_len, seed, pad_id
        self.num_sequences = len(self.pairs)
        self.ref_logps = None  # (pairs, 2): the reference's, when precomputed (preference_step)
        self._order_epoch, self._order = None, None

    def row(self, sample):
        epoch, i = divmod(sample, self.num_sequences)
        if epoch != self._order_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order, self._order_epoch = torch.randperm(self.num_sequences,
                                                            generator=g).tolist(), epoch
        return self._order[i]

    def batch(self, samples, rows=None):
        """PairBatch of pairs `rows` (indices), or of the pairs at sample positions `samples`:
        (2 x pairs, longest row) input_ids, labels, attention_mask, chosen rows first; and
        ref_logps (2 x pairs,) once the reference's are precomputed."""
        rows = [self.row(s) for s in samples] if rows is None else rows
        out = pair_batch([self.pairs[i] for i in rows], self.pad_id, self.seq_len,
                         [self.wheres[i] for i in rows])
        if self.ref_logps is not None:  # (2 x pairs,): the chosen rows', then the rejected's
            out["ref_logps"] = self.ref_logps[rows].t().reshape(-1)
        return PairBatch(out, num_tokens=out["attention_mask"].sum())

    def all_batches(self, batch_size):
        """Every pair once, in order, in batches of batch_size pairs (for evaluation)."""
        for k in range(0, self.num_sequences, batch_size):
            yield self.batch(None, rows=list(range(k, min(k + batch_size, self.num_sequences))))


def build_preference_data(cfg, tokenizer, pairs, log=print):
    """(train PreferenceDataset, eval PreferenceDataset or None) of a TrainConfig with
    objective=dpo: read_pairs' (pairs, wheres) of data.path, split by data.eval_fraction (seeded,
    as SFT examples are) unless data.eval_path is given. Tokenised in memory."""
    from fastllm.train.sft_data import split_examples

    data = cfg.data
    pad = getattr(getattr(tokenizer, "tok", None), "pad_token_id", None)
    pad = tokenizer.eos_token_id if pad is None else pad
    pad = 0 if pad is None else pad  # (padding is never scored, and masked off in attention)

    def dataset(pairs, wheres, indices):
        indices = list(indices)
        encoded = [encode_pair(pairs[i], tokenizer, wheres[i]) for i in indices]
        return PreferenceDataset(encoded, [wheres[i] for i in indices], data.seq_len, cfg.seed,
                                 pad)

    if data.eval_path:
        train = dataset(*pairs, range(len(pairs[0])))
        held_pairs = read_pairs(data.eval_path, train=False)
        held = dataset(*held_pairs, range(len(held_pairs[0])))
    else:
        tr, ev = split_examples(len(pairs[0]), data.eval_fraction, cfg.seed)
        train = dataset(*pairs, tr)
        held = dataset(*pairs, ev) if ev else None
    for name, part in (("training", train), ("held-out", held)):
        if part is not None and part.dropped:
            log(f"fastllm train: {part.dropped} {name} pairs keep no chosen or no rejected "
                f"completion token within data.seq_len={data.seq_len} and were dropped")
    if train.truncated:
        log(f"fastllm train: {train.truncated} of {train.num_sequences} training pairs are "
            f"longer than data.seq_len={data.seq_len} tokens and were truncated (their ends)")
    if not train.num_sequences:
        raise ValueError(f"fastllm train: no preference pair keeps a completion token on both "
                         f"sides within data.seq_len={data.seq_len}: raise data.seq_len")
    if held is not None and not held.num_sequences:
        held = None
    return train, held


def build_datasets(cfg, model_dir, rank, world, barrier, log=print):
    """fastllm.train.sft_data.build_datasets for objective=dpo: (tokenizer, train
    PreferenceDataset, eval PreferenceDataset or None) of data.path's preference records. Rank 0
    builds the tokenizer (and trains a BPE on the records' text) first, the other ranks then
    find its cache; nothing is written to output_dir."""
    from fastllm.train.data import build_tokenizer

    data = cfg.data
    pairs = read_pairs(data.path)
    for turn in ((0,) if world == 1 else (0, 1)):
        if (rank == 0) == (turn == 0):
            tok = build_tokenizer(data.tokenizer, pair_texts(pairs[0]), data.vocab_size,
                                  data.cache_dir, model_dir)
        barrier()
    train, held = build_preference_data(cfg, tok, pairs, log)
    return tok, train, held
