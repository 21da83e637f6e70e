"""Evidence for FASTLLM_CPU_ATTENTION=auto on this CPU: fastllm's CPU attention against what a
patched model runs without it, interleaved in one process.

    python bench/attention_policy.py ops     # the op, fwd + bwd, 9 / 3 heads of 64
    python bench/attention_policy.py step    # the patched SmolLM2-135M-shaped step, 30 layers

ops: plain causal rows (8 x 512 to 1 x 4096 tokens) and packed rows (8 and 16 documents) in fp32
and bf16, fastllm.ops.attention against PyTorch's attention as fastllm.patch calls it there
(F.scaled_dot_product_attention; for bf16 the fp32 flash kernel of fastllm/_lowp.py where it
widens bf16; packed rows with transformers' dense block-diagonal mask). step: fastllm.patch +
fastllm.lora (r=16 q/v) or full fine-tuning + fastllm.optim.AdamW, fp32 and bf16, 8 x 512 tokens,
one model stepping with FASTLLM_CPU_ATTENTION=torch and =fastllm in alternate steps (the
variable is read at each call): medians of ROUNDS (default 2) steps each, and the peak the CPU
allocator held over one step of each (bench/harness.py). Prints one line per case.
"""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import bench_model, harness  # noqa: E402
from fastllm import _lowp  # noqa: E402
from fastllm.ops.attention import attention, doc_start_from_position_ids  # noqa: E402


def _median_ms(fns, reps, warmup):
    """{name: median ms} of fns in `reps` interleaved rounds after `warmup` calls of each."""
    times = harness.measure_many(fns, warmup=warmup, min_reps=reps, max_reps=reps, min_time_s=0)
    return {name: t.median_ms for name, t in times.items()}


def _torch_side(q, k, v, dtype, mask):
    qq, kk, vv = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if _lowp.widens("cpu", dtype):
        return _lowp.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask,
                                                  is_causal=mask is None, scale=0.125)
    if mask is not None:  # (as transformers: the key/value heads repeated for a mask)
        kk, vv = kk.repeat_interleave(3, 1), vv.repeat_interleave(3, 1)
    return F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, is_causal=mask is None,
                                          scale=0.125, enable_gqa=mask is None)


def ops():
    for dtype in (torch.float32, torch.bfloat16):
        for b, t, docs in ((8, 512, 1), (4, 1024, 1), (2, 2048, 1), (1, 4096, 1), (1, 4096, 8),
                           (1, 8192, 16)):
            torch.manual_seed(0)
            q, k, v = (torch.randn(b, t, h, 64, dtype=dtype, requires_grad=True)
                       for h in (9, 3, 3))
            lens = [t // docs] * docs
            pos = torch.cat([torch.arange(n) for n in lens])[None].expand(b, t)
            ds = doc_start_from_position_ids(pos) if docs > 1 else None
            i = torch.arange(t)
            mask = (None if ds is None else
                    ((i[None, :] <= i[:, None]) & (i[None, :] >= ds[0][:, None]))[None, None])
            ms = _median_ms({
                "fastllm": lambda: attention(q, k, v, scale=0.125, doc_start=ds).sum().backward(),
                "torch": lambda: _torch_side(q, k, v, dtype, mask).sum().backward()},
                reps=3 if t * docs > 8192 else 7, warmup=1)
            print(f"attention fwd+bwd {str(dtype)[6:]} {b} x {t} tokens, {docs} document(s) a "
                  f"row: fastllm {ms['fastllm']:.0f} ms, PyTorch's {ms['torch']:.0f} ms, "
                  f"ratio {ms['fastllm'] / ms['torch']:.2f}", flush=True)


def _with_attention(mode, fn):
    def run():
        os.environ["FASTLLM_CPU_ATTENTION"] = mode  # (read at each call)
        fn()
    return run


def step(rounds):
    for dtype in (torch.float32, torch.bfloat16):
        for finetune in ("lora", "full"):
            setups, _ = bench_model._setups(30, dtype, finetune)
            model, opt = setups.pop("fastllm (patched)")
            setups.clear()
            torch.manual_seed(2)
            ids = torch.randint(0, bench_model.VOCAB, (8, 512))
            one = bench_model._train_step(model, opt, ids)
            one()  # (the optimizer's state made)
            fns = {mode: _with_attention(mode, one) for mode in ("torch", "fastllm")}
            peak = {m: harness.allocator_peak_bytes(fn) / 2**20 for m, fn in fns.items()}
            ms = _median_ms(fns, reps=rounds, warmup=0)  # (warm: the steps above)
            print(f"step {str(dtype)[6:]} {finetune}: attention=torch {ms['torch']:,.0f} ms, "
                  f"=fastllm {ms['fastllm']:,.0f} ms, ratio {ms['fastllm'] / ms['torch']:.3f}; "
                  f"allocator peak {peak['torch']:,.0f} / {peak['fastllm']:,.0f} MiB", flush=True)
            del model, opt, one, fns


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("THREADS", os.cpu_count() or 1)))
    what = sys.argv[1:] or ["ops"]
    if what not in (["ops"], ["step"]):
        raise SystemExit("usage: python bench/attention_policy.py ops|step")
    ops() if what == ["ops"] else step(int(os.environ.get("ROUNDS", "2")))
