"""DPO with LoRA in a loop of your own: fastllm.preference on a Hugging Face model folder.

    python examples/dpo_lora.py MODEL_DIR [--data examples/data/capital_preferences.jsonl]
        [--steps 20] [--pairs 4] [--lr 1e-4] [--beta 0.1] [--loss-type sigmoid] [--r 16]
        [--eval-pairs 6] [--max-length 256] [--threads 2] [--out runs/dpo/adapter]
        [--prompt "What is the capital of Kenya?"]

The data: TRL's explicit-prompt preference records ({"prompt", "chosen", "rejected"}, strings or
message lists; fastllm.train.preference_data). The given file prefers a terse "Capital: ...
Country: ... Continent: ..." answer to the same facts in a sentence. The model gets LoRA on every
linear layer but the head (fastllm.lora) and fastllm.patch; each step scores its pairs' chosen
and rejected completions under the policy and, with the adapters disabled, under the reference
(fastllm.preference.sequence_logps: no logits), and steps fastllm.optim.AdamW on
fastllm.preference.dpo_loss (with --rpo-alpha, plus that weight times the chosen completions'
mean NLL per token: RPO, which keeps DPO from lowering the chosen answers' likelihood along with
the rejected ones'). Held-out pairs (seeded) are scored before and after: their DPO loss,
chosen NLL, reward accuracy (chosen reward above rejected) and mean margin, which say whether the
preference carried over to prompts it was not trained on. The adapter is saved in PEFT's format.
"""

import argparse
import json
import random
import sys
import time


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--data", default="examples/data/capital_preferences.jsonl")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--pairs", type=int, default=4, help="pairs per step")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--loss-type", default="sigmoid")
    p.add_argument("--rpo-alpha", type=float, default=0.0,
                   help="weight of the chosen completions' NLL added to the loss (RPO; TRL's "
                        "loss_type=['sigmoid', 'sft'])")
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--eval-pairs", type=int, default=6)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for the PEFT adapter")
    p.add_argument("--prompt", action="append", default=[],
                   help="a prompt to answer greedily before and after (repeatable)")
    return p.parse_args(argv)


def _score(model, batch, beta, loss_type, grad):
    """(dpo_loss's result, the chosen completions' mean NLL per token) for one batch."""
    import torch

    from fastllm.adapters import disable_adapters
    from fastllm.preference import dpo_loss, sequence_logps

    ids, labels, mask = batch["input_ids"], batch["labels"], batch["attention_mask"]
    with torch.set_grad_enabled(grad):
        logps = sequence_logps(model, ids, labels, attention_mask=mask)
    with torch.no_grad(), disable_adapters(model):
        ref = sequence_logps(model, ids, labels, attention_mask=mask)
    lengths = (labels[:, 1:] != -100).sum(-1).chunk(2)
    nll = -logps.chunk(2)[0].sum() / lengths[0].sum()
    return dpo_loss(*logps.chunk(2), *ref.chunk(2), beta=beta, loss_type=loss_type,
                    chosen_lengths=lengths[0], rejected_lengths=lengths[1]), nll


def _evaluate(model, batch, args):
    import torch

    model.eval()
    with torch.no_grad():
        out, nll = _score(model, batch, args.beta, args.loss_type, grad=False)
    model.train()
    margin = out.chosen_rewards - out.rejected_rewards
    return {"loss": round(float(out.loss.mean()), 5), "chosen_nll": round(float(nll), 5),
            "reward_accuracy": round(float((margin > 0).float().mean()), 4),
            "margin": round(float(margin.mean()), 5)}


def main(argv=None):
    args = _args(sys.argv[1:] if argv is None else argv)
    import torch
    import transformers

    import fastllm
    from fastllm.lora import inject_lora, save_adapter
    from fastllm.train.data import HFTokenizer
    from fastllm.train.evaluate import generate_samples
    from fastllm.train.preference_data import encode_pair, pair_batch, read_pairs

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    hf_tok = transformers.AutoTokenizer.from_pretrained(args.model_dir)
    tok = HFTokenizer(hf_tok, args.model_dir)
    pairs, wheres = read_pairs(args.data)
    encoded = [encode_pair(p, tok, w) for p, w in zip(pairs, wheres)]
    order = list(range(len(encoded)))
    random.Random(args.seed).shuffle(order)
    if not 0 < args.eval_pairs < len(order):
        sys.exit(f"dpo_lora: --eval-pairs must be between 1 and {len(order) - 1}")
    held, train = order[:args.eval_pairs], order[args.eval_pairs:]
    pad = hf_tok.pad_token_id if hf_tok.pad_token_id is not None else tok.eos_token_id

    def batch(indices):
        return pair_batch([encoded[i] for i in indices], pad, args.max_length,
                          [wheres[i] for i in indices])

    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir,
                                                              dtype=torch.float32)
    inject_lora(model, target_modules="all-linear", r=args.r, alpha=2 * args.r)
    fastllm.patch(model)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = fastllm.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    eval_batch = batch(held)
    answers = {p: [a] for p, a in zip(args.prompt, generate_samples(model, tok, args.prompt, 24))}
    before = _evaluate(model, eval_batch, args)
    print(json.dumps({"step": 0, "eval": before}), flush=True)
    stream = random.Random(args.seed + 1)
    for step in range(1, args.steps + 1):
        chosen = stream.sample(train, min(args.pairs, len(train)))
        t = time.perf_counter()
        out, nll = _score(model, batch(chosen), args.beta, args.loss_type, grad=True)
        (out.loss.mean() + args.rpo_alpha * nll).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        margin = out.chosen_rewards - out.rejected_rewards
        print(json.dumps({"step": step, "loss": round(out.loss.mean().item(), 5),
                          "chosen_nll": round(nll.item(), 5),
                          "reward_accuracy": round(float((margin > 0).float().mean()), 4),
                          "margin": round(float(margin.mean()), 5),
                          "step_s": round(time.perf_counter() - t, 2)}), flush=True)
    after = _evaluate(model, eval_batch, args)
    for p, a in zip(args.prompt, generate_samples(model, tok, args.prompt, 24)):
        answers[p].append(a)
    summary = {"step": args.steps, "eval": after, "eval_before": before,
               "answers_before_after": answers}
    print(json.dumps(summary), flush=True)
    if args.out:
        save_adapter(model, args.out)
    return summary


if __name__ == "__main__":
    main()
