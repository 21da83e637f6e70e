"""Data: text -> a memory-mapped token file (cached by content hash) -> fixed-length sequences ->
each rank's micro-batches, prefetched by a background thread.

The order of sequences is a function of (seed, epoch) only, and the loader's position is the
number of sequences the whole job has consumed. A step takes the next global_batch_size
sequences; rank r of W takes its contiguous share of them. So the batches of a step do not depend
on when the run was interrupted, nor (as a set) on the world size: a resumed run, at any world
size, sees exactly the sequences the uninterrupted run would have.
"""

import codecs
import hashlib
import json
import os
import queue
import threading
import time

import numpy as np
import torch

from fastllm._files import files_under

__all__ = ["builtin_corpus", "load_text", "build_tokenizer", "tokenize_to_file", "PackedDataset",
           "Loader"]


def builtin_corpus():
    """English text every Python install has: the pydoc topics (~0.6 MB), in a fixed order."""
    from pydoc_data import topics

    return [topics.topics[k] for k in sorted(topics.topics)]


def load_text(path):
    """Documents from a text file, a folder of .txt/.md files (none named for another split than
    train: sft_records.check_splits), or (path None) the built-in corpus."""
    if path is None:
        return builtin_corpus()
    if os.path.isdir(path):
        from fastllm.train.sft_records import check_splits

        files = files_under(path, (".txt", ".md"))
        if not files:
            raise FileNotFoundError(f"fastllm train: no .txt or .md files under {path}")
        check_splits(path, files, text=True)  # (valid.txt beside train.txt: another split)
    elif os.path.isfile(path):
        files = [path]
    else:
        raise FileNotFoundError(f"fastllm train: data.path {path} does not exist")
    docs = []
    for name in files:
        with open(name, "rb") as f:
            raw = f.read()
        # a byte-order mark (Windows editors) is not text to train on (as utf-8-sig, which
        # the JSONL and prompts readers use; stripped here so error offsets stay the file's)
        bom = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0
        try:
            text = raw[bom:].decode("utf-8")
        except UnicodeDecodeError as e:
            at = e.start + bom
            raise ValueError(f"fastllm train: data.path {name} is not UTF-8 text (byte "
                             f"{at}: {raw[at:at + 4]!r}); a binary file?") from None
        if "\x00" in text:
            raise ValueError(f"fastllm train: data.path {name} holds NUL bytes (at "
                             f"{text.index(chr(0))}): a binary file, not text")
        docs.append(text)
    return docs


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, 256 = end of document. No training, no files."""

    vocab_size = 257
    eos_token_id = 256
    bos_ids = []
    name = "byte"

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer (a trained byte-level BPE, or a model folder's own).
    eos_token_id: the tokenizer's, None when it has none (fastllm train refuses it:
    build_tokenizer)."""

    def __init__(self, tok, name):
        self.tok = tok
        self.name = name
        self.vocab_size = len(tok)
        self.eos_token_id = tok.eos_token_id
        # the ids tok(text) puts before the text's own (Llama's BOS; none for GPT-2's BPE)
        special, plain = (tok("a", add_special_tokens=s)["input_ids"] for s in (True, False))
        self.bos_ids = next((special[:k] for k in range(len(special) - len(plain) + 1)
                             if special[k:k + len(plain)] == plain), [])

    def encode(self, text):
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids):
        return self.tok.decode(ids)


def no_eos_message(folder):
    """The refusal of a tokenizer (folder: its folder or name) without an EOS token."""
    return (f"fastllm train: the tokenizer {folder} has no EOS token, and fastllm train appends "
            f"one to each example and document: set \"eos_token\" in its "
            f"tokenizer_config.json")


def _cache_dir(cfg_dir):
    return cfg_dir or os.environ.get("FASTLLM_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "fastllm")


def build_tokenizer(spec, docs, vocab_size, cache_dir, model_dir=None):
    """byte; bpe (a byte-level BPE trained on `docs`, cached); or a folder with a tokenizer."""
    if spec == "byte" and model_dir is None:
        return ByteTokenizer()
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if spec not in ("byte", "bpe") or model_dir is not None:
        folder = model_dir if spec == "byte" else spec
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        if tok.eos_token_id is None:
            raise ValueError(no_eos_message(folder))
        # the caches keyed by the name follow the folder's files, not its path alone (another
        # tokenizer saved into the same folder reused the first one's token cache)
        return HFTokenizer(tok, f"{folder}-{_files_digest(folder)}")
    digest = _digest(docs, f"bpe-{vocab_size}")[:16]
    folder = os.path.join(_cache_dir(cache_dir), f"bpe-{digest}")
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(path):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(docs, trainer)
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        tok.save(tmp)
        os.replace(tmp, path)
    fast = PreTrainedTokenizerFast(tokenizer_file=path, eos_token="<|endoftext|>")
    # the digest: caches keyed by the name (an SFT eval_path's) follow the corpus the BPE learned
    return HFTokenizer(fast, f"bpe-{vocab_size}-{digest}")


# a model folder's weights (hashing them would read gigabytes; they do not tokenize)
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt", ".onnx")


def _files_digest(folder):
    """sha256 of a folder's files but its weights (tokenizer files, configs, chat template)."""
    h = hashlib.sha256()
    if not os.path.isdir(folder):
        return "0"
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.endswith(_WEIGHTS) or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            h.update(name.encode() + b"\0" + hashlib.sha256(f.read()).digest())
    return h.hexdigest()[:16]


def _digest(docs, salt):
    h = hashlib.sha256(salt.encode())
    for d in docs:
        h.update(d.encode("utf-8", errors="replace"))
        h.update(b"\0")
    return h.hexdigest()


def tokenize_to_file(docs, tokenizer, cache_dir):
    """Tokenize once into `<cache>/tokens-<hash>.bin` (uint16/uint32, documents separated by EOS);
    later calls with the same text and tokenizer reuse it. Returns the path."""
    if tokenizer.eos_token_id is None:
        raise ValueError(no_eos_message(tokenizer.name))
    folder = _cache_dir(cache_dir)
    digest = _digest(docs, f"{tokenizer.name}-{tokenizer.vocab_size}")[:24]
    path = os.path.join(folder, f"tokens-{digest}.bin")
    if os.path.exists(path) and os.path.exists(path + ".json"):
        return path
    os.makedirs(folder, exist_ok=True)
    dtype = np.uint16 if tokenizer.vocab_size <= 65535 else np.uint32
    ids = []
    for d in docs:
        ids.extend(tokenizer.encode(d))
        ids.append(tokenizer.eos_token_id)
    arr = np.asarray(ids, dtype=dtype)
    tmp = f"{path}.{os.getpid()}.tmp"
    arr.tofile(tmp)
    os.replace(tmp, path)
    with open(tmp, "w") as f:
        json.dump({"dtype": np.dtype(dtype).name, "tokens": int(arr.size),
                   "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size}, f)
    os.replace(tmp, path + ".json")
    return path


class PackedDataset:
    """Non-overlapping seq_len windows of a token file (memory-mapped), in a seeded order that is
    reshuffled every epoch. Sample index s (0, 1, 2, ... over the whole run) is window
    perm_epoch[s % n] with epoch = s // n."""

    def __init__(self, path, seq_len, seed):
        with open(path + ".json") as f:
            meta = json.load(f)
        self.tokens = np.memmap(path, dtype=np.dtype(meta["dtype"]), mode="r")
        self.seq_len = seq_len
        self.seed = seed
        self.num_sequences = len(self.tokens) // seq_len
        if self.num_sequences < 1:
            raise ValueError(f"fastllm train: the corpus has {len(self.tokens)} tokens, fewer "
                             f"than one sequence of data.seq_len={seq_len}")
        self._perm_epoch, self._perm = None, None

    def window(self, sample):
        epoch, i = divmod(sample, self.num_sequences)
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.num_sequences, generator=g).numpy()
            self._perm_epoch = epoch
        return int(self._perm[i])

    def batch(self, samples):
        """(len(samples), seq_len) int64 token ids."""
        rows = [self.tokens[w * self.seq_len:(w + 1) * self.seq_len]
                for w in (self.window(s) for s in samples)]
        return torch.from_numpy(np.stack(rows).astype(np.int64))


class Loader:
    """This rank's micro-batches, step after step, from global sample `position` on.

    Each step is global_batch sequences; this rank takes [rank * per_rank, (rank + 1) * per_rank)
    of them in micro-batches of micro_batch. A daemon thread keeps up to `prefetch` sequences
    ready. next_step() returns ([(samples, input_ids)] * accumulation, seconds waited).
    """

    def __init__(self, dataset, rank, world, micro_batch, global_batch, prefetch, position=0):
        per_rank, rem = divmod(global_batch, world)
        if rem or per_rank % micro_batch:
            raise ValueError(f"fastllm train: global_batch_size={global_batch} must be a multiple "
                             f"of micro_batch_size * data-parallel size = {micro_batch} * {world}")
        self.dataset = dataset
        self.rank, self.world = rank, world
        self.micro_batch, self.global_batch, self.per_rank = micro_batch, global_batch, per_rank
        self.accumulation = per_rank // micro_batch
        self.depth = max(1, prefetch // per_rank) if prefetch else 4
        self._thread = None
        self.reset(position)

    def step_samples(self, position):
        start = position + self.rank * self.per_rank
        return [list(range(start + m * self.micro_batch, start + (m + 1) * self.micro_batch))
                for m in range(self.accumulation)]

    def reset(self, position):
        """Restart from global sample `position` (resume, rollback)."""
        self.close()
        self.position = position
        self._queue = queue.Queue(maxsize=self.depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, args=(position, self._stop,
                                                                    self._queue), daemon=True)
        self._thread.start()

    def _produce(self, position, stop, out):
        try:
            while not stop.is_set():
                micro = [(s, self.dataset.batch(s)) for s in self.step_samples(position)]
                while not stop.is_set():
                    try:
                        out.put(micro, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                position += self.global_batch
        except BaseException as e:  # surfaced in the training thread by next_step
            out.put(e)

    def next_step(self):
        t0 = time.perf_counter()
        item = self._queue.get()
        waited = time.perf_counter() - t0
        if isinstance(item, BaseException):
            raise item
        self.position += self.global_batch
        return item, waited

    def state_dict(self):
        return {"position": self.position, "global_batch": self.global_batch}

    def close(self):
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=10)
            self._thread = None
