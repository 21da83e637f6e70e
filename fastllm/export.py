"""`fastllm export` and `fastllm generate`: a training run as a Hugging Face folder, and a quick
look at what a model says.

    fastllm export RUN_DIR OUT_DIR [--merged]
    fastllm generate MODEL_OR_RUN "prompt" [--max-new-tokens 64] [--do-sample --temperature 0.7]

export writes transformers' save_pretrained layout (model.safetensors, config.json,
generation_config.json, the tokenizer files with its chat template; for the byte tokenizer, which
has no files, a transformers tokenizer that gives its ids: byte_tokenizer) from the run's newest
valid checkpoint. --merged folds LoRA (and DoRA) into the weights: the folder is a plain model that
AutoModelForCausalLM.from_pretrained and `fastllm train model=OUT_DIR` load as is. Without it an
adapter run (LoRA, DoRA, prefix-tuning) is written as a PEFT adapter (adapter_config.json +
adapter_model.safetensors) naming its base model (the run's model folder; a built-in model's
random-init base is written to OUT_DIR/base_model); other runs are whole models either way.
A QLoRA run (lora.quantize_base=nf4) loads as it trained, on the NF4 base; merged, the adapter
is folded into that base's dequantised weights (the trained model's outputs); a built-in model's
base_model is those weights too.

    from fastllm.export import load_run
    model, tokenizer, cfg = load_run("runs/sft")   # the trained model, as fastllm trains it
"""

import math
import os

import torch

from fastllm.adapters import load_adapter, save_adapter

__all__ = ["load_run", "export", "load_model", "add_export_commands"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ADAPTER_MODES = ("lora", "prefix")


def _checkpoint(run_dir):
    from fastllm.train import checkpoint as ckpt

    if os.path.exists(os.path.join(run_dir, "trainer_state.pt")):
        # a checkpoint-<step> folder itself: checked as a run's newest one would be, so a
        # corrupt or half-copied one is refused, not exported
        ckpt.verify(run_dir)
        return run_dir
    found = ckpt.latest_valid(run_dir, log=lambda *_: None)
    if found is None:
        raise FileNotFoundError(f"{run_dir} holds no valid checkpoint-<step> (is it a fastllm "
                                f"train output_dir?)")
    return found[1]


def run_tokenizer(run_dir, cfg):
    """The tokenizer a run trained with: RUN_DIR/tokenizer (saved by fastllm train), the model
    folder's, data.tokenizer's folder, or the byte tokenizer."""
    from fastllm.train.data import ByteTokenizer, HFTokenizer
    from fastllm.train.model import is_model_dir

    # (a built-in model name and the byte / bpe tokenizers are no folders, whatever is here)
    for folder in (os.path.join(run_dir, "tokenizer"), is_model_dir(cfg.model) and cfg.model,
                   cfg.data.tokenizer not in ("byte", "bpe") and cfg.data.tokenizer):
        if _has_tokenizer(folder):
            from transformers import AutoTokenizer

            return HFTokenizer(AutoTokenizer.from_pretrained(folder, local_files_only=True),
                               folder)
    if cfg.data.tokenizer == "byte":
        return ByteTokenizer()
    raise FileNotFoundError(f"fastllm export: cannot find the tokenizer of {run_dir} (no "
                            f"{run_dir}/tokenizer folder)")


def _has_tokenizer(folder):
    names = ("tokenizer.json", "tokenizer_config.json")
    return bool(folder) and os.path.isdir(folder) and any(
        os.path.exists(os.path.join(folder, n)) for n in names)


_BYTE_EOS = "<|endoftext|>"  # the BPE's (fastllm.train.data.build_tokenizer) and GPT-2's


def _byte_chars():
    """{byte: character}: GPT-2's table of bytes as printable characters (openai/gpt-2
    src/encoder.py, bytes_to_unicode), the alphabet of the tokenizers library's ByteLevel."""
    # the printable ones as themselves ("!".."~", "¡".."¬", "®".."ÿ"), the others from U+0100
    keep = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    extra = iter(range(256, 512))
    return {b: chr(b if b in keep else next(extra)) for b in range(256)}


def byte_tokenizer():
    """A transformers tokenizer with fastllm.train.data.ByteTokenizer's ids: byte b of the UTF-8
    text is id b, EOS (<|endoftext|>) 256; a literal "<|endoftext|>" in the text is its bytes, as
    there (split_special_tokens). An export of a byte-tokenizer run writes it, so AutoTokenizer,
    fastllm generate and `fastllm train model=OUT_DIR` read the folder with the run's ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: b for b, c in _byte_chars().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))  # no merges: one token a byte
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=_BYTE_EOS,
                                   split_special_tokens=True)


def _tokenizer_files(tokenizer):
    """The transformers tokenizer export saves for a run's tokenizer, None for none."""
    from fastllm.train.data import ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        return byte_tokenizer()
    return getattr(tokenizer, "tok", None)


def load_run(run_dir):
    """(model, tokenizer, cfg) of a run's newest valid checkpoint: the model built as fastllm
    train builds it (fastllm's LoRA/DoRA/prefix modules), on the CPU, in eval mode."""
    from fastllm.train import checkpoint as ckpt
    from fastllm.train.config import TrainConfig
    from fastllm.train.model import PRESETS, build_model

    import pickle

    import yaml

    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"no such run folder: {run_dir}")
    path = _checkpoint(run_dir)
    config = os.path.join(path, "config.yaml")
    try:
        cfg = TrainConfig.load(config)
    except (yaml.YAMLError, TypeError, AttributeError) as e:
        raise ValueError(f"{config} is not a readable training config: {e}") from None
    if cfg.precision not in _DTYPES:
        raise ValueError(f"{config} has precision={cfg.precision!r}; one of "
                         f"{sorted(_DTYPES)} was expected")
    if cfg.model not in PRESETS and not os.path.isdir(cfg.model):
        # (runs before 2026-12-05 kept a model folder as typed: relative to where they ran)
        raise FileNotFoundError(f"{config} names model={cfg.model!r}, which is no folder from "
                                f"here ({os.getcwd()}): run this command from the folder "
                                f"fastllm train ran in, or edit the path in {config}")
    root = run_dir if path != run_dir else os.path.dirname(os.path.abspath(run_dir))
    tokenizer = run_tokenizer(root, cfg)
    dtype = _DTYPES[cfg.precision] if cfg.backend == "fastllm" else torch.float32
    model = build_model(cfg, tokenizer.vocab_size, dtype)  # (QLoRA: on its NF4 base)
    adapter = os.path.join(path, "adapter")
    if os.path.isdir(adapter):
        load_adapter(model, adapter)
    else:
        weights = os.path.join(path, "model.pt")
        try:
            model.load_state_dict(ckpt.load_file(weights))
        except pickle.UnpicklingError:  # (torch's message suggests weights_only=False)
            raise ValueError(f"{weights} holds objects other than tensors; nothing is "
                             f"unpickled from a checkpoint (torch.load(weights_only=True)), so "
                             f"it is refused") from None
    model.eval()
    return model, tokenizer, cfg


def _has_lora(model):
    from fastllm.lora import lora_modules

    return bool(lora_modules(model))


def _finish_config(model, tokenizer, from_folder=False):
    """The model's config and generation config with the run tokenizer's special tokens (a
    built-in model's LlamaConfig defaults, bos 1 / eos 2, are not the tokenizer's). A model
    from a folder keeps its own: its stop tokens may be several (Llama-3-Instruct's
    generation_config lists three), and the tokenizer's EOS is added to them when missing."""
    from fastllm.train.evaluate import stop_ids

    eos = tokenizer.eos_token_id
    tok = getattr(tokenizer, "tok", None)
    bos = getattr(tok, "bos_token_id", None)
    pad = getattr(tok, "pad_token_id", None)
    for c in (model.config, model.generation_config):
        if from_folder and getattr(c, "eos_token_id", None) is not None:
            stops = stop_ids(c.eos_token_id)
            if eos is not None and eos not in stops:
                c.eos_token_id = stops + [eos]
        else:
            c.eos_token_id, c.bos_token_id = eos, bos
        if getattr(c, "pad_token_id", None) is None or not from_folder:
            c.pad_token_id = pad if pad is not None else eos
    # (a built-in model trains without a cache; its generation_config kept use_cache=False, so
    # transformers' generate fed the whole sequence at every step)
    model.config.use_cache = model.generation_config.use_cache = True


def export(run_dir, out_dir, merged=False):
    """Write the run's model (see the module docstring). Returns out_dir.

    Everything is written to a hidden staging folder inside out_dir (the same filesystem, and
    writable where out_dir is) and moved in once all of it is written, so a refused or failed
    export leaves out_dir as it was (a folder it had to make is removed again); then the files of
    an earlier export that this one does not write (a chat template, weight shards, base_model)
    are removed: transformers' save_pretrained leaves them, and they would load with this one."""
    import shutil
    import tempfile

    model, tokenizer, cfg = load_run(run_dir)
    prefix = hasattr(model, "_fastllm_prefix")
    if merged and prefix:
        raise ValueError("fastllm export: a prefix-tuning adapter cannot be merged into the "
                         "weights; export it without --merged (a PEFT adapter)")
    _check_out_dir(out_dir, adapter=(_has_lora(model) and not merged) or prefix)
    _refuse_the_runs_own(out_dir, run_dir, cfg)
    made = not os.path.exists(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    stage = None
    try:
        stage = tempfile.mkdtemp(prefix=".fastllm-export-", dir=out_dir)
        _write(model, tokenizer, cfg, stage, out_dir, merged, prefix)
        _publish(stage, out_dir)
    except BaseException:
        if made:  # (nothing of ours was moved in: the publish's moves come last)
            shutil.rmtree(out_dir, ignore_errors=True)
        raise
    finally:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
    return out_dir


def _write(model, tokenizer, cfg, stage, out_dir, merged, prefix):
    """export's files, into `stage` (paths inside them name out_dir, where they will be)."""
    from fastllm.train.model import is_model_dir

    _finish_config(model, tokenizer, from_folder=is_model_dir(cfg.model))
    tok = _tokenizer_files(tokenizer)
    if tok is not None:
        tok.save_pretrained(stage)
    if _has_lora(model) and merged:
        from fastllm.lora import merge_and_unload
        from fastllm.quant import dequantize_nf4

        # (QLoRA: merged into the NF4 weights it trained on, dequantised: the trained model)
        merge_and_unload(dequantize_nf4(model))
    if _has_lora(model) or prefix:
        base = cfg.model if is_model_dir(cfg.model) else None
        if base is None:  # a built-in model: its random-init base goes beside the adapter
            base = os.path.join(out_dir, "base_model")
            plain = _base_copy(model, prefix)
            _finish_config(plain, tokenizer)
            plain.save_pretrained(os.path.join(stage, "base_model"))
            if tok is not None:
                tok.save_pretrained(os.path.join(stage, "base_model"))
        model.config._name_or_path = os.path.abspath(base)
        save_adapter(model, stage)
        model.generation_config.save_pretrained(stage)
    else:
        model.save_pretrained(stage)


# What an export writes (transformers' and PEFT's names): removed from out_dir when this export
# does not write them. Anything else there (a README, the user's files) is left alone.
_EXPORT_NAMES = ("config.json", "generation_config.json", "model.safetensors",
                 "model.safetensors.index.json", "model-*-of-*.safetensors", "pytorch_model*.bin",
                 "pytorch_model.bin.index.json", "adapter_config.json",
                 "adapter_model.safetensors", "adapter_model.bin", "base_model",
                 "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "added_tokens.json", "chat_template.jinja", "chat_template.json",
                 "additional_chat_templates", "tokenizer.model", "vocab.json", "merges.txt",
                 "vocab.txt")


def _publish(stage, out_dir):
    """Move the staged files into out_dir (the stage is inside it: os.replace, one filesystem),
    replacing what they replace; then remove an earlier export's files this one has not written.
    A folder being replaced is first moved aside into the stage, removed with it."""
    import fnmatch
    import shutil

    written = sorted(os.listdir(stage))
    for name in written:
        target = os.path.join(out_dir, name)
        if os.path.isdir(target) and not os.path.islink(target):
            os.replace(target, os.path.join(stage, f".old-{name}"))
        os.replace(os.path.join(stage, name), target)
    for name in os.listdir(out_dir):
        path = os.path.join(out_dir, name)
        if name in written or not any(fnmatch.fnmatch(name, p) for p in _EXPORT_NAMES):
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.remove(path)


# The files of one layout that make a folder read as the other: transformers' from_pretrained
# applies an adapter_config.json it finds beside config.json on top of the weights, and
# load_model takes a folder with one for an adapter.
_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
_MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json",
                "pytorch_model.bin", "pytorch_model.bin.index.json")


def _check_out_dir(out_dir, adapter):
    """Refuse, before writing anything, an out_dir holding another export's files of the other
    layout (a model over an adapter, or the reverse): the two mixed load as neither."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"fastllm export: {out_dir} is a file, not a folder")
    stale = [n for n in (_MODEL_FILES if adapter else _ADAPTER_FILES)
             if os.path.exists(os.path.join(out_dir, n))]
    if stale:
        kind = "an adapter" if adapter else "a whole model"
        raise ValueError(f"fastllm export: {out_dir} holds {', '.join(stale)} of another export; "
                         f"writing {kind} beside them would load as neither (transformers "
                         f"applies an adapter_config.json on top of the weights): remove them or "
                         f"pick an empty out_dir")


def _refuse_the_runs_own(out_dir, run_dir, cfg):
    """An out_dir that is the run's model folder (a merged export would replace the base the
    run, its adapter and every later load of it build on), or the run (checkpoint) folder."""
    from fastllm.train.model import is_model_dir

    out = os.path.realpath(out_dir)
    run = os.path.realpath(run_dir)
    if is_model_dir(cfg.model) and out == os.path.realpath(cfg.model):
        raise ValueError(f"fastllm export: {out_dir} is the run's own model folder "
                         f"(model={cfg.model}): exporting there would replace the base it trained "
                         f"on; pick another out_dir")
    if out == run:
        raise ValueError(f"fastllm export: {out_dir} is the run folder {run_dir} itself; pick "
                         f"another out_dir (a folder inside it will do)")


def _base_copy(model, prefix):
    import copy

    from fastllm.lora import unload
    from fastllm.quant import dequantize_nf4

    plain = copy.deepcopy(model)
    if prefix:
        from fastllm.prefix import remove_prefix

        return remove_prefix(plain)
    return dequantize_nf4(unload(plain))  # (a QLoRA base: the NF4 weights, dequantised)


def load_model(name):
    """(model, tokenizer) of a fastllm run, an HF model folder, or a PEFT adapter folder (its base
    from base_model_name_or_path, the adapter in fastllm's modules)."""
    from fastllm.train.data import HFTokenizer

    # a run (or one of its checkpoints), not a model folder that also holds a config.yaml (a
    # training config kept beside an export)
    if os.path.exists(os.path.join(name, "trainer_state.pt")) or (
            os.path.exists(os.path.join(name, "config.yaml"))
            and not os.path.exists(os.path.join(name, "config.json"))):
        model, tokenizer, _ = load_run(name)
        return model, tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = os.path.exists(os.path.join(name, "adapter_config.json"))
    base = name
    if adapter:
        from fastllm.adapter_files import read_config  # load_adapter's reader: ValueError

        base = read_config(name).get("base_model_name_or_path")
        if not base or not os.path.isdir(base):
            raise FileNotFoundError(f"fastllm generate: the adapter {name} names base model "
                                    f"{base!r}, which is not a folder here")
    missing = FileNotFoundError(f"fastllm generate: {base} is not a folder (a model, a PEFT "
                                f"adapter or a fastllm run) nor a model in the Hugging Face "
                                f"cache")
    if not os.path.isdir(base) and not os.environ.get("TRANSFORMERS_CACHE") and not _in_hub_cache(
            base):
        # (from_pretrained(local_files_only=True) still asked the Hub for an adapter config:
        # five retries, 30 s offline, before this same error)
        raise missing
    try:
        from fastllm.quant import from_pretrained as nf4_pretrained

        # (a bitsandbytes 4-bit NF4 folder, or an adapter trained on one: read without
        # bitsandbytes; FP4 is left to transformers, which needs bitsandbytes for it)
        model = (nf4_pretrained(base) if _nf4_folder(base)
                 else AutoModelForCausalLM.from_pretrained(base, local_files_only=True))
    except (OSError, ValueError) as e:
        if os.path.isdir(base):
            raise
        raise missing from e
    if adapter:
        load_adapter(model, name)
    tok_dir = name if os.path.exists(os.path.join(name, "tokenizer_config.json")) else base
    try:
        tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
    except (ValueError, OSError) as e:
        if _has_tokenizer(name) or _has_tokenizer(base):
            raise
        # transformers' own message asks for sentencepiece or tiktoken
        raise FileNotFoundError(
            f"fastllm generate: {name} has no tokenizer files (tokenizer.json or "
            f"tokenizer_config.json){f', nor has its base model {base}' if adapter else ''}; "
            "an export of a run trained with the byte tokenizer (data.tokenizer=byte) by a "
            "fastllm export before it wrote one has none: export the run again, or generate from "
            "the run folder") from e
    model.eval()
    return model, HFTokenizer(tok, tok_dir)


def _nf4_folder(name):
    from fastllm.quant import bnb_4bit_config

    try:
        return os.path.isdir(name) and bnb_4bit_config(name) is not None
    except ValueError:  # (FP4)
        return False


def _in_hub_cache(name):
    """Whether the Hugging Face cache holds a config.json of model `name` (no network;
    huggingface_hub's cache: transformers 4's TRANSFORMERS_CACHE is left to from_pretrained)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except ValueError:  # not a repo id (HFValidationError)
        return False


def _checked(kind, ok, what):
    """An argparse type: `kind` of the text, refused (naming `what`) unless ok(value)."""
    import argparse

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind.__name__}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"{text} must be {what}")
        return value
    return parse


def add_export_commands(sub):
    p = sub.add_parser("export", help="write a training run as a Hugging Face model folder")
    p.add_argument("run_dir")
    p.add_argument("out_dir")
    p.add_argument("--merged", action="store_true",
                   help="fold LoRA/DoRA into the weights (a plain model); default: a PEFT adapter")
    p.set_defaults(handler=_export)
    p = sub.add_parser("generate", help="complete a prompt with a model folder or training run")
    p.add_argument("model", metavar="MODEL_OR_RUN")
    p.add_argument("prompt")
    p.add_argument("--max-new-tokens", type=_checked(int, lambda v: v >= 1, ">= 1"), default=64)
    p.add_argument("--do-sample", action="store_true", help="sample (default: greedy)")
    p.add_argument("--temperature", type=_checked(float, lambda v: 0 < v < math.inf, "> 0"),
                   default=0.7)
    p.add_argument("--top-p", type=_checked(float, lambda v: 0 < v <= 1, "in (0, 1]"),
                   default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=_generate)


def _export(args):
    import sys

    from fastllm.train.checkpoint import CheckpointError

    try:
        out = export(args.run_dir, args.out_dir, merged=args.merged)
    except (FileNotFoundError, NotADirectoryError, FileExistsError, PermissionError,
            ValueError, CheckpointError) as e:  # (OSErrors: an OUT_DIR under a file, unwritable)
        sys.exit(str(e) if str(e).startswith("fastllm export:") else f"fastllm export: {e}")
    kind = ("merged model" if args.merged else "adapter" if os.path.isfile(
        os.path.join(out, "adapter_config.json")) else "model")
    names = sorted(n for n in os.listdir(out) if not n.startswith("."))
    print(f"fastllm export: wrote {kind} {out}: {', '.join(names)}")


def _generate(args):
    import sys

    from fastllm.train.checkpoint import CheckpointError
    from fastllm.train.evaluate import generate_samples

    try:
        model, tokenizer = load_model(args.model)
    except (FileNotFoundError, ValueError, OSError, CheckpointError) as e:
        sys.exit(str(e) if str(e).startswith("fastllm generate:") else f"fastllm generate: {e}")
    torch.manual_seed(args.seed)
    try:
        text = generate_samples(model, tokenizer, [args.prompt], args.max_new_tokens,
                                do_sample=args.do_sample, temperature=args.temperature,
                                top_p=args.top_p)[0]
    except ValueError as e:  # (an empty prompt, a template input the tokenizer cannot render)
        sys.exit(f"fastllm generate: {e}")
    print(text)
