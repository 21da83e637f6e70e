"""What a run's config names, checked before the run writes anything (no run folder, no
config.yaml, no checkpoint touched), where the config's values alone cannot tell:

    preflight.check(cfg)   # ConfigError naming the key and the problem

the batch (global_batch_size in whole micro-batches per data-parallel rank, given the layout),
the model (a preset or a folder; a preset's model_config values, as LlamaConfig validates them;
a lora.target_modules entry that selects no layer of it, found on its meta-device skeleton, so no
weights are read), the files (TrainConfig.check_files), chat
training records with a tokenizer that has no chat template (the first record of each data file,
not the whole dataset) and the eval prompts (eval.prompts_file's records; tools or
chat_template_kwargs with a tokenizer that has no chat template). The trainer runs the same checks
again later (inject_lora, tokenising, generation) for callers that skip these, and for a chat
record that follows other records in its file.
"""

from torch import nn

from fastllm.train.config import ConfigError
from fastllm.train.model import check_model, is_model_dir, lora_targets, model_skeleton

__all__ = ["check", "check_backend_env", "check_badam_blocks", "check_batch", "check_chat_data",
           "check_lora_targets", "check_prompts", "tokenizer_folder"]


def check(cfg, layout=None):
    """Every check of this module, the cheap ones first; layout (a ParallelLayout): also the
    batch arithmetic (check_batch)."""
    if layout is not None:
        check_batch(cfg, layout)
        if cfg.objective != "lm" and layout.dp > 1 and cfg.parallel.strategy == "none":
            raise ConfigError(f"fastllm train: objective={cfg.objective} with "
                              f"parallel.strategy=none on "
                              f"{layout.describe()}: each rank would train alone; use "
                              f"parallel.strategy=ddp (or auto)")
    check_backend_env(cfg)
    check_model(cfg)
    cfg.check_files()
    check_lora_targets(cfg)
    check_badam_blocks(cfg)
    check_chat_data(cfg)
    check_prompts(cfg)
    return cfg


def check_backend_env(cfg):
    """FASTLLM_BACKEND (a backend forced on every op): one of fastllm's names, and one that can
    run on the run's device (triton on a CPU needs TRITON_INTERPRET=1); it was read at the
    first op, after the run folder was written."""
    from fastllm import _backend

    try:
        name = _backend.forced_backend()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if name is None:
        return
    why = _backend.unavailable_reason(name, "cuda" if cfg.uses_cuda() else "cpu")
    if why is not None:
        raise ConfigError(f"fastllm train: FASTLLM_BACKEND={name} cannot run here: {why}")


def check_batch(cfg, layout):
    """global_batch_size a whole number of micro-batches per data-parallel rank (and enough for
    the pipeline schedule), as the data loader and the schedule will need."""
    try:
        layout.micro_batches(cfg.resolved_global_batch(layout), cfg.micro_batch_size)
    except ValueError as e:
        raise ConfigError(f"fastllm train: {e}") from None


def _adaptable(backend):
    """The layer types lora.target_modules may select: fastllm's LoRA wraps nn.Linear; PEFT's
    (backend=torch) also adapts embeddings, convolutions and attention (the types of
    peft.tuners.lora.layer.dispatch_default)."""
    if backend != "torch":
        return (nn.Linear,), "nn.Linear"
    from transformers.pytorch_utils import Conv1D

    return ((nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.MultiheadAttention,
             Conv1D), "nn.Linear, nn.Embedding or convolution")


def check_lora_targets(cfg):
    """finetune=lora: refuse an empty lora.target_modules, all-linear among other entries (it
    would be taken as a module name and select nothing), and each entry that selects no layer
    of the model (a typo), as the trainer would select them (all-linear expanded, lora.layers
    applied), naming the entry and the layer names there are (fastllm.lora.no_match_message, the
    message inject_lora gives)."""
    from fastllm.lora import ALL_LINEAR, matches, no_match_message

    if cfg.finetune != "lora":
        return
    entries = list(cfg.lora.target_modules)
    where = "fastllm train: lora.target_modules"
    if not entries:
        raise ConfigError(f"{where} is empty: name the layers to adapt (e.g. [q_proj, v_proj]) or "
                          f"give {ALL_LINEAR}")
    if len(entries) > 1 and any(t.lower() == ALL_LINEAR for t in entries):
        raise ConfigError(f"{where}: {ALL_LINEAR!r} (every nn.Linear but the output layer) stands "
                          f"alone; got {entries}")
    model = model_skeleton(cfg)
    types, kind = _adaptable(cfg.backend)
    names = [n for n, m in model.named_modules() if n and isinstance(m, types)]
    note = (f" (lora.layers={cfg.lora.layers}: the last {cfg.lora.layers} decoder layers only)"
            if cfg.lora.layers > 0 else "")
    for entry in entries:
        targets = lora_targets(model, cfg, [entry])
        if not any(matches(n, targets) for n in names):
            raise ConfigError(no_match_message(where, entry, names, kind) + note)


def check_badam_blocks(cfg):
    """finetune=badam with badam.blocks: every block names a parameter of the model, as
    fastllm.optim.BAdam requires (it refused a typo after the run folder was made)."""
    if cfg.finetune != "badam" or not cfg.badam.blocks:
        return
    from fastllm.optim.badam import _matches

    names = [n for n, _ in model_skeleton(cfg).named_parameters()]
    for bi, block in enumerate(cfg.badam.blocks):
        if not any(_matches(n, prefix) for n in names for prefix in block):
            raise ConfigError(f"fastllm train: badam.blocks[{bi}] {block} matches no parameter "
                              f"of the model (its names: {', '.join(names[:4])}, ...)")


def tokenizer_folder(cfg):
    """The folder whose tokenizer the run loads (fastllm.train.data.build_tokenizer's choice), or
    None for byte and bpe (fastllm's own, which have no chat template)."""
    spec = cfg.data.tokenizer
    if is_model_dir(cfg.model) and spec == "byte":
        return cfg.model
    return None if spec in ("byte", "bpe") else spec


def _has_chat_template(cfg):
    """Whether the run's tokenizer has a chat template (AutoTokenizer finds it in
    tokenizer_config.json or chat_template.jinja as the trainer's does)."""
    folder = tokenizer_folder(cfg)
    if folder is None:
        return False
    from transformers import AutoTokenizer

    return bool(AutoTokenizer.from_pretrained(folder, local_files_only=True).chat_template)


def check_chat_data(cfg):
    """JSONL data (data.path as data.format reads it, and data.eval_path): refuse a file whose
    first record is a chat ('messages', or TRL's 'prompt' and 'completion' message lists) when
    the run's tokenizer has no chat template, naming the file and the line (the message the
    tokenising gives, fastllm.train.sft_data.chat_refusal). Alpaca records need none (without
    one they take Stanford Alpaca's prompt). Also refused here (by the readers): a table or
    archive data.path, and a data.path folder holding another split's files
    (fastllm.train.sft_records.data_format, check_splits)."""
    from fastllm.train.sft_data import chat_refusal, data_format
    from fastllm.train.sft_records import first_records

    data = cfg.data
    if data_format(data.path, data.format) != "jsonl":
        return
    chats = [where for path, train in ((data.path, True), (data.eval_path, False)) if path
             for where, kind in first_records(path, train) if kind in ("chat", "chat_completion")]
    if chats and not _has_chat_template(cfg):
        raise ConfigError(chat_refusal(chats[0], tokenizer_folder(cfg) or data.tokenizer))


def check_prompts(cfg):
    """Read eval.prompts and eval.prompts_file (a malformed record is refused by its line) and
    refuse records carrying tools or chat_template_kwargs when the run's tokenizer has no chat
    template to render them with (as chat training records are)."""
    from fastllm.train.evaluate import read_prompt_records, template_refusal

    if not (cfg.eval.prompts or cfg.eval.prompts_file):
        return
    records = read_prompt_records(cfg.eval.prompts, cfg.eval.prompts_file)
    first = next((where for _, template, where in records if template), None)
    if first is None:
        return
    if not _has_chat_template(cfg):
        raise ConfigError(template_refusal(first, tokenizer_folder(cfg) or cfg.data.tokenizer))
