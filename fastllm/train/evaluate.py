"""Evaluation during training: the held-out loss and perplexity, and what the model now says.

    metrics = evaluate_loss(model, eval_dataset, batch_size=8, device="cpu")
    # {"eval_loss": mean token cross-entropy, "eval_ppl": exp(eval_loss), "eval_tokens": n}
    texts = generate_samples(model, tokenizer, ["What is 2 + 2?"], max_new_tokens=32)

The trainer runs both every eval_interval steps (and at the start and the end): the loss goes
to metrics.jsonl as an {"eval_step": s, "eval_loss": ...} line (and into step s's record), the
samples to output_dir/samples.jsonl as {"step": s, "prompt": ..., "output": ...} lines.
"""

import json
import math
import os

import torch

__all__ = ["evaluate_loss", "eval_batches", "generate_samples", "chat_prompt_ids", "read_eval", "read_prompts",
           "read_prompt_records", "template_refusal", "Evaluator"]


def eval_batches(dataset, batch_size, device, max_batches=0):
    """dataset.all_batches(batch_size) (every row once, in order), the first max_batches of them
    (0: all), each without its num_tokens count and on `device`."""
    for k, batch in enumerate(dataset.all_batches(batch_size)):
        if max_batches and k >= max_batches:
            return
        batch.pop("num_tokens")
        yield batch.to(device)


@torch.no_grad()
def evaluate_loss(model, dataset, batch_size, device, autocast=None, max_batches=0):
    """Mean cross-entropy over every target token of `dataset` (an SFTDataset: each row once),
    summed per token over the whole set (so packing and batch size do not change it)."""
    from fastllm.patch import patched

    was_training = model.training
    model.eval()
    # a patched model returns logits in eval (for metrics); the loss alone needs none of the
    # (tokens, vocab) of them, so it keeps the fused loss
    fused = {"skip_logits": True} if patched(model)["cross_entropy"] else {}
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    try:
        for batch in eval_batches(dataset, batch_size, device, max_batches):
            n = int((batch["labels"][:, 1:] != -100).sum())
            if n == 0:
                continue
            # num_items_in_batch=1: transformers' loss is then the sum over tokens
            if autocast is not None:
                with autocast:
                    out = model(**batch, use_cache=False, num_items_in_batch=1, **fused)
            else:
                out = model(**batch, use_cache=False, num_items_in_batch=1, **fused)
            total += out.loss.detach().double().cpu()
            count += n
    finally:
        model.train(was_training)
    if count == 0:  # no target token left (all truncated): no loss, not a perfect one
        return {"eval_loss": math.nan, "eval_ppl": math.nan, "eval_tokens": 0}
    loss = float(total) / count
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)), "eval_tokens": count}


def template_refusal(where, tokenizer_name):
    """The error for a prompt with tools or chat_template_kwargs and a tokenizer without a chat
    template (as a chat training record is refused)."""
    from fastllm.train.sft_data import NO_TEMPLATE_HINT

    return (f"fastllm train: {where}: 'tools' and 'chat_template_kwargs' are rendered by a chat "
            f"template; tokenizer {tokenizer_name} has none {NO_TEMPLATE_HINT}")


def chat_prompt_ids(tokenizer, prompt, template=None):
    """A prompt's token ids as the model expects them: a user turn plus the generation prompt
    when the tokenizer has a chat template, else the plain text. template: the prompt's TRL
    inputs ({"tools", "chat_template_kwargs"}), given to the chat template as a training
    record's are (fastllm.train.sft_data.render_chat); refused without a template."""
    tok = getattr(tokenizer, "tok", tokenizer)
    if getattr(tok, "chat_template", None):
        from fastllm.train.sft_data import render_chat

        text = render_chat(tok, [{"role": "user", "content": prompt}],
                           add_generation_prompt=True, template=template)
        return tok(text, add_special_tokens=False)["input_ids"]
    if template:
        name = getattr(tokenizer, "name", None) or getattr(tok, "name_or_path", "")
        raise ValueError(template_refusal(f"prompt {prompt[:40]!r}", name or type(tok).__name__))
    if not hasattr(tokenizer, "bos_ids"):  # a transformers tokenizer itself
        from fastllm.train.data import HFTokenizer

        tokenizer = HFTokenizer(tok, getattr(tok, "name_or_path", ""))
    # as training tokenises a text or prompt (sft_data): the BOS the tokenizer puts first, not
    # the EOS some put last (Llama's add_eos_token), which would end the prompt
    return list(tokenizer.bos_ids) + tokenizer.encode(prompt)


def stop_ids(eos_token_id):
    """A config's eos_token_id (None, an int or a list of them) as a list of ints."""
    if eos_token_id is None:
        return []
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(i) for i in
                                                                     eos_token_id]


@torch.no_grad()
def generate_samples(model, tokenizer, prompts, max_new_tokens=64, device="cpu",
                     do_sample=False, temperature=1.0, top_p=1.0, templates=None):
    """The model's continuation of each prompt (greedy unless do_sample), as text without the
    prompt. tokenizer: a fastllm tokenizer (fastllm.train.data) or a transformers one.
    templates: None, or each prompt's chat template inputs (chat_prompt_ids' template)."""
    was_training = model.training
    model.eval()
    eos = getattr(tokenizer, "eos_token_id", None)
    # the stop tokens: the tokenizer's EOS and those the model's generation_config lists
    # (Llama-3-Instruct's three), as model.generate stops at any of them
    config = getattr(model, "generation_config", None)
    stops = ([] if eos is None else [eos]) + [
        i for i in stop_ids(getattr(config, "eos_token_id", None)) if i != eos]
    outs = []
    templates = [None] * len(prompts) if templates is None else templates
    try:
        for prompt, template in zip(prompts, templates, strict=True):
            ids = chat_prompt_ids(tokenizer, prompt, template)
            if not ids:  # (torch.tensor([[]]) is a float tensor generate() fails on)
                raise ValueError(f"the prompt {prompt!r} is no tokens (the tokenizer adds no "
                                 f"BOS): there is nothing to continue")
            ids = torch.tensor([ids], dtype=torch.long, device=device)
            kw = dict(do_sample=do_sample)
            if do_sample:
                kw.update(temperature=temperature, top_p=top_p)
            else:  # a checkpoint's own generation_config may ask for sampling
                kw.update(temperature=None, top_p=None, top_k=None)
            # (a prefix-tuned model too: its prefix rides in the KV cache generate() keeps, and
            # generate() applies the generation_config's processors, repetition_penalty and
            # no_repeat_ngram_size among them, on every path)
            # eagerly under torch_compile: decoding token by token through a KV cache, the
            # compiled layers would be compiled again for each layer index (the cache's update
            # is guarded on it) and fill dynamo's recompile limit, which the training step's
            # layers share (one code object): the step would then run uncompiled
            with torch.compiler.set_stance("force_eager"):
                out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                     max_new_tokens=max_new_tokens, use_cache=True,
                                     pad_token_id=stops[0] if stops else None,
                                     eos_token_id=stops or None, **kw)
            new = out[0, ids.shape[1]:].tolist()
            ends = [i for i, t in enumerate(new) if t in stops]
            outs.append(tokenizer.decode(new[:ends[0]] if ends else new))
    finally:
        model.train(was_training)
    return outs


def read_eval(path):
    """The evaluation records of a metrics.jsonl in eval_step order (the last of each step);
    [] when there is no file."""
    from fastllm.train.metrics import read_metrics

    return read_metrics(path, key="eval_step") if os.path.exists(path) else []


def read_prompts(prompts, prompts_file):
    """eval.prompts plus the lines of eval.prompts_file (a .txt: one prompt a line; a .jsonl or
    .json: {"prompt": ...} records, as the training data's), as text."""
    return [text for text, _, _ in read_prompt_records(prompts, prompts_file)]


def read_prompt_records(prompts, prompts_file):
    """eval.prompts plus eval.prompts_file's prompts, each (text, template inputs, where): a
    .jsonl or .json record {"prompt": ..., "tools": [...], "chat_template_kwargs": {...}} (JSON
    Lines, or a .json array, read as the training data is) carries TRL's per-record chat
    template inputs (checked as a training record's, fastllm.train.sft_records.template_inputs;
    {} when it has none); `where` names the line or record."""
    from fastllm.train.sft_records import decode_utf8, is_json_name, parsed, template_inputs

    out = [(p, {}, f"eval.prompts[{i}]") for i, p in enumerate(prompts)]
    for p, _, where in out:
        if not p:
            raise ValueError(f"fastllm train: {where} is empty: a prompt to continue is expected")
    if not prompts_file:
        return out
    given = len(out)
    if is_json_name(prompts_file):
        for where, rec in parsed(prompts_file):
            if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
                raise ValueError(f"fastllm train: {where}: expected {{\"prompt\": a string}}")
            if not rec["prompt"]:
                raise ValueError(f"fastllm train: {where}: the prompt is empty")
            # a prompt is rendered as a user turn: a chat, for the template inputs
            out.append((rec["prompt"], template_inputs(rec, "chat", where), where))
    else:
        with open(prompts_file, "rb") as f:
            raw = f.read()
        # decoded as the training data is: line by line (an error names its line), a byte-order
        # mark allowed on line 1
        for n, line in enumerate(raw.splitlines(), 1):
            where = f"{prompts_file} line {n}"
            line = decode_utf8(line, where, bom=n == 1).strip()
            if line:
                out.append((line, {}, where))
    if len(out) == given:  # (the samples asked for would silently never be written)
        raise ValueError(f"fastllm train: eval.prompts_file {prompts_file} holds no prompts")
    return out


def _truncate(path, key, step):
    """A resumed or rolled-back run redoes the evaluations after its checkpoint: drop their old
    lines."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()
    keep = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get(key, -1) <= step or key not in rec:
            keep.append(line if line.endswith("\n") else line + "\n")
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)


class Evaluator:
    """The trainer's evaluations: due(step) says when, run(step) evaluates and writes."""

    def __init__(self, cfg, dataset, tokenizer, rank):
        self.cfg, self.dataset, self.tokenizer, self.rank = cfg, dataset, tokenizer, rank
        records = read_prompt_records(cfg.eval.prompts, cfg.eval.prompts_file)
        self.prompts = [text for text, _, _ in records]
        self.templates = [template for _, template, _ in records]
        self.metrics_path = os.path.join(cfg.output_dir, "metrics.jsonl")
        self.samples_path = os.path.join(cfg.output_dir, "samples.jsonl")

    @classmethod
    def start(cls, trainer):
        """The trainer's Evaluator (None without an eval set or prompts), its files rewound to
        the trainer's step, and the first evaluation run when the run starts at step 0 (with
        eval.on_start)."""
        cfg = trainer.cfg
        if trainer.eval_dataset is None and not (cfg.eval.prompts or cfg.eval.prompts_file):
            if cfg.eval_interval:
                trainer.log(f"fastllm train: warning: eval_interval={cfg.eval_interval} has "
                            f"nothing to evaluate: no held-out set (data.eval_fraction or "
                            f"data.eval_path, JSONL data) and no eval.prompts")
            return None
        self = cls(cfg, trainer.eval_dataset, trainer.tokenizer, trainer.rank)
        redo_start = trainer.step == 0 and cfg.eval.on_start
        if self.rank == 0:
            # a run that starts at step 0 (fresh, or a restart before the first checkpoint)
            # keeps no evaluation of an earlier attempt, step 0's included: it redoes step 0's
            # (eval.on_start) or has none
            keep = trainer.step if trainer.step else -1
            _truncate(self.metrics_path, "eval_step", keep)
            _truncate(self.samples_path, "step", keep)
        if redo_start:
            self.run(trainer, 0)
        return self

    def rewind(self, step):
        """After a rollback to `step` (with MetricsWriter.rewind, which drops metrics.jsonl's
        evaluation lines): drop the samples of the discarded steps, which will be redone."""
        if self.rank == 0:
            _truncate(self.samples_path, "step", step)

    def due(self, step):
        interval = self.cfg.eval_interval
        return step == self.cfg.max_steps or bool(interval and step % interval == 0)

    def run(self, trainer, step):
        """Evaluate at `step`; returns the eval metrics (every rank), written by rank 0."""
        # the plain module where each rank holds it whole (DDP's forward would sync), else the
        # sharded model on every rank
        whole = trainer.strategy.name in ("none", "ddp", "zero1", "zero2")
        model = trainer.module if whole else trainer.strategy.model
        out = {}
        if self.dataset is not None:
            # objective=dpo|cpo|orpo: the held-out pairs' loss and rewards (preference_step)
            score = (evaluate_loss if trainer.objective is None else
                     trainer.objective.evaluate)
            out = score(model, self.dataset, self.cfg.micro_batch_size, trainer.device,
                        trainer.autocast, self.cfg.eval.batches)
        samples = []
        if self.prompts and self.rank == 0 and whole:
            samples = generate_samples(trainer.module, self.tokenizer, self.prompts,
                                       self.cfg.eval.max_new_tokens, trainer.device,
                                       templates=self.templates)
        if self.rank == 0:
            if out:
                with open(self.metrics_path, "a") as f:
                    f.write(json.dumps(dict(eval_step=step, **out)) + "\n")
            if samples:
                with open(self.samples_path, "a") as f:
                    for p, s in zip(self.prompts, samples):
                        f.write(json.dumps({"step": step, "prompt": p, "output": s},
                                           ensure_ascii=False) + "\n")
        return out
