"""A DPO step on a real checkpoint: the policy's and the reference's sequence log-probabilities
with the logits materialised, through TRL's fused LM head, and through fastllm.preference.

    [PYTHONPATH=<trl>] python bench/bench_dpo.py MODEL_DIR [--providers a,b,...] [--rounds 1]
        [--steps 2] [--pairs 4] [--length 512] [--threads 2] [--json PATH]

One step of every provider does what TRL's DPOTrainer does with a LoRA adapter and no separate
reference model: the policy's log-probabilities of the chosen and rejected completions (one
forward over the 2 x pairs rows, chosen first), the reference's with the adapters disabled (no
grad), DPO's sigmoid loss (beta 0.1, mean over pairs), backward, torch.optim.AdamW(fused=True)
at lr 1e-4. LoRA r=16, alpha=32 on every linear layer but the head; fp32. Providers:
    hf-logits     transformers + PEFT; model(...).logits, then log_softmax and gather over them
                  (TRL's selective_log_softmax where trl is importable, the same loop otherwise):
                  what a hand-written DPO loop, and TRL before its fused head, does
    hf-trl        transformers + PEFT + TRL's fused LM head (trl.trainer.utils.add_fused_lm_head,
                  `fused_lm_head=True`), what DPOTrainer runs since trl 1.x; needs trl
    fastllm-trl   fastllm.patch + fastllm.lora, TRL's fused LM head on top; needs trl
    fastllm       fastllm.patch + fastllm.lora + fastllm.preference.sequence_logps (the head and
                  log-softmax in fastllm's fused loss), fastllm.adapters.disable_adapters
The batch: random tokens (seeded), a prompt of length/4 tokens masked out of the labels, chosen
and rejected completions of length/2 to 3 length/4 tokens, right-padded. Each (round, provider)
is its own process: one warm-up step, then `--steps` timed steps. "tensor peak" is
fastllm.train.memory.PeakMemory over one more step (live tensors' bytes at the step's peak);
peak RSS the process's VmHWM over the steps. Every provider starts from B = 0, so the first
step's policy log-probabilities (printed) must agree across providers. Not a pytest test
(`__test__`): it needs a checkpoint folder (`python ../shared/models/prepare_smollm2.py DIR`).
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_qlora import (_anonymous, _peak_rss_mib, _reset_peak_rss,  # noqa: E402
                         chosen_providers, print_rows, run_rounds)

__test__ = False

PROVIDERS = ("hf-logits", "hf-trl", "fastllm-trl", "fastllm")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _batch(vocab, pairs, length, seed=0):
    """(input_ids, labels, attention_mask), 2 x pairs rows, chosen rows first."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2 * pairs, length), generator=g)
    prompt = length // 4
    ids[pairs:, :prompt] = ids[:pairs, :prompt]  # a pair shares its prompt
    ends = prompt + torch.randint(length // 2, 3 * length // 4 + 1, (2 * pairs,), generator=g)
    mask = (torch.arange(length) < ends.clamp(max=length)[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :prompt] = -100
    return ids, labels, mask


def _logits_logps(model, ids, labels, mask):
    import torch

    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    target = labels[:, 1:]
    keep = target != -100
    try:
        from trl.trainer.utils import selective_log_softmax
    except ImportError:
        def selective_log_softmax(z, index):
            return torch.stack([row.log_softmax(-1).gather(-1, i.unsqueeze(-1)).squeeze(-1)
                                for row, i in zip(z, index)])
    return (selective_log_softmax(logits, target.where(keep, 0)) * keep).sum(-1)


def _build(provider, model_dir):
    """(model, policy_logps(ids, labels, mask), reference context)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if provider.startswith("hf"):
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(
            r=16, lora_alpha=32, target_modules=TARGETS, task_type="CAUSAL_LM"))
        reference = model.disable_adapter
        inner = model.get_base_model()
    else:
        import fastllm
        from fastllm.adapters import disable_adapters
        from fastllm.lora import inject_lora

        inject_lora(model, target_modules=TARGETS, r=16, alpha=32)
        fastllm.patch(model)
        reference, inner = (lambda: disable_adapters(model)), model
    if provider.endswith("trl"):
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(inner)

        def logps(ids, labels, mask):
            out = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True)
            return out.log_probs.sum(-1)
    elif provider == "fastllm":
        from fastllm.preference import sequence_logps

        def logps(ids, labels, mask):
            return sequence_logps(model, ids, labels, attention_mask=mask)
    else:
        def logps(ids, labels, mask):
            return _logits_logps(model, ids, labels, mask)
    return model, logps, reference


def run_one(args):
    """One provider's steps in this process; prints one JSON line."""
    import warnings

    import torch

    from fastllm.preference import dpo_loss

    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, logps, reference = _build(args.one, args.model_dir)
    _anonymous(model)
    _reset_peak_rss()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    ids, labels, mask = _batch(model.config.vocab_size, args.pairs, args.length)

    def step():
        policy = logps(ids, labels, mask)
        with torch.no_grad(), reference():
            ref = logps(ids, labels, mask)
        out = dpo_loss(*policy.chunk(2), *ref.chunk(2), beta=0.1)
        loss = out.loss.mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item(), policy.detach(), out

    times, losses = [], []
    for i in range(args.steps + 1):
        t = time.perf_counter()
        loss, policy, out = step()
        times.append(time.perf_counter() - t)
        losses.append(loss)
        if i == 0:
            first_logps = [round(v, 3) for v in policy.tolist()]
    step_s = statistics.median(times[1:])
    from fastllm.train.memory import PeakMemory

    with PeakMemory(list(model.parameters()), list(model.buffers()), opt.state) as tracker:
        step()
    tokens = int(mask.sum())
    print(json.dumps({
        "provider": args.one, "step_s": round(step_s, 3),
        "tokens_per_s": round(tokens / step_s, 1), "tokens": tokens,
        "step_times_s": [round(t, 3) for t in times], "losses": [round(v, 6) for v in losses],
        "first_policy_logps": first_logps,
        "last_margin": round(float((out.chosen_rewards - out.rejected_rewards).mean()), 6),
        "peak_rss_mib": round(_peak_rss_mib(), 1),
        "tensor_peak_mib": round(tracker.peak / 2**20, 1)}))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_dir")
    p.add_argument("--providers", default=",".join(PROVIDERS))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json")
    p.add_argument("--one", help=argparse.SUPPRESS)  # (internal: run this provider here)
    args = p.parse_args()
    if args.one:
        return run_one(args)
    providers = chosen_providers(args.providers, PROVIDERS, "bench_dpo")
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        print("bench_dpo: trl is not importable; its providers skipped")
        providers = [name for name in providers if not name.endswith("trl")]
    rows = run_rounds(os.path.abspath(__file__), args.model_dir, providers, args.rounds,
                      ["--steps", str(args.steps), "--pairs", str(args.pairs), "--length",
                       str(args.length), "--threads", str(args.threads)], "bench_dpo")
    print(f"\n{args.model_dir}, DPO (sigmoid, beta 0.1), LoRA r=16 all-linear, fp32, "
          f"{args.pairs} pairs x {args.length} tokens, {args.threads} threads, "
          f"{platform.processor() or platform.machine()}")
    keys = ("provider", "step_s", "tokens_per_s", "tensor_peak_mib", "peak_rss_mib", "losses")
    headers = ("provider", "step s (median)", "tokens/s", "tensor peak MiB", "peak RSS MiB",
               "losses")
    print_rows(rows, [(h, lambda r, k=k: r[k]) for h, k in zip(headers, keys)]
               + [("first policy logps", lambda r: r["first_policy_logps"][:2])], args.json)


if __name__ == "__main__":
    main()
