"""The model ops and a whole training step: fastllm.patch against plain Hugging Face.

    fastllm bench --ops model [--full]

1. Each op, forward + backward, against torch eager and torch.compile of the same maths (what
   HF's LlamaRMSNorm, apply_rotary_pos_emb, LlamaMLP's act * up (and GemmaMLP's tanh-GELU
   one), nn.Linear and its sdpa attention compute), at SmolLM2-135M's sizes for 8 x 512
   tokens: time, GB/s (the bytes the op must move at least) or TFLOP/s (linear, attention),
   and the peak of the tensors it allocates (PeakMemory). "fastllm" for linear and attention is
   what fastllm.patch runs: fastllm.ops.linear, and fastllm.ops.attention where
   FASTLLM_CPU_ATTENTION says (else the fp32 flash attention of fastllm/_lowp.py where it widens
   bf16, else torch's own).
2. A training step of a SmolLM2-135M-shaped LlamaForCausalLM (hidden 576, 9 / 3 heads, ffn 1536,
   vocab 49152, tied embeddings; random init, or the real weights from FASTLLM_BENCH_MODEL=DIR,
   a folder made by examples/prepare_smollm2.py), LoRA (r=16 on q/v) and full
   fine-tuning, fp32 and bf16 (pure bf16 weights):
       fastllm   fastllm.patch + fastllm.lora + fastllm.optim.AdamW
       HF        the unpatched model (+ PEFT for LoRA) + torch.optim.AdamW(fused=True)
   on the same batch, interleaved: tokens/s, the peak tensor memory of the first step (params,
   grads, optimizer state and activations: fastllm.train.memory.PeakMemory), and the top of a
   torch profile of one step of each (self CPU time by op).
The quick run uses 4 layers, 8 x 256 tokens, 2 timed steps; --full (or FASTLLM_BENCH_LAYERS,
FASTLLM_BENCH_SEQ, FASTLLM_BENCH_STEPS) the whole 30 layers at 8 x 512; FASTLLM_BENCH_DTYPES=fp32
(or bf16) runs one precision, FASTLLM_BENCH_FINETUNES=full (or lora) one kind of fine-tuning,
FASTLLM_BENCH_STEPS=0 the ops only. With FASTLLM_BENCH_MODEL the step runs the folder's first
layers (at most as many as it has) and the table names the folder and its shape.
FASTLLM_BENCH_FAMILY=qwen3 (not with FASTLLM_BENCH_MODEL) steps
a Qwen3-0.6B-shaped Qwen3ForCausalLM instead (hidden 1024, 16 / 8 heads of 128, q/k norms, ffn
3072, vocab 151936, tied embeddings; random init): the vocabulary where the logits weigh most;
FASTLLM_BENCH_FAMILY=gemma3 a Gemma-3-270M-shaped Gemma3ForCausalLM (hidden 640, 4 / 1 heads of
256, q/k norms, GeGLU ffn 2048, vocab 262144, tied embeddings, sliding window 512 on 5 layers of
6; random init), where fastllm.patch swaps the norms, the attention's rotary embedding, the
GeGLU MLPs (fastllm.ops.geglu) and the loss; FASTLLM_BENCH_FAMILY=phi4mini a
Phi-4-mini-shaped Phi3ForCausalLM (hidden 3072, 24 / 8 heads of 128 in one qkv_proj, rotary
on 3/4 of each head, gate_up_proj ffn 8192, vocab 200064, tied embeddings; random init; LoRA on
qkv_proj, Phi-3 having no q_proj or v_proj; its config's sliding window of 262144).
"""

import copy
import gc
import json
import math
import os
import time

import torch
import torch.nn.functional as F

import fastllm
from fastllm.bench import harness

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 576, 9, 3, 1536, 49152
HEAD_DIM = HIDDEN // HEADS
# the CPU benchmark (bench/device_bench.py is the GPU one): `--ops all --device cuda` leaves it out
DEVICES = ("cpu",)


# --- 1. the ops -------------------------------------------------------------------------------

def _rms_norm_torch(x, w, eps=1e-5):  # LlamaRMSNorm.forward
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rotary_torch(q, k, cos, sin):  # apply_rotary_pos_emb on (B, S, H, D), unsqueeze_dim=2
    def rot(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), -1)

    c, s = cos[:, :, None], sin[:, :, None]
    return q * c + rot(q) * s, k * c + rot(k) * s


def _swiglu_torch(gate, up):  # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)
    return F.silu(gate) * up


def _geglu_torch(gate, up):  # GemmaMLP: act_fn gelu_pytorch_tanh
    return F.gelu(gate, approximate="tanh") * up


def _attention_torch(q, k, v):  # what HF's sdpa attention calls for a causal batch, no mask
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _attention_fastllm(q, k, v):  # fastllm.patch's attention
    from fastllm import _lowp
    from fastllm.ops.attention import attention, cpu_attention_enabled

    if cpu_attention_enabled():  # fastllm.ops.attention, in its (B, T, H, D) layout
        return attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    if _lowp.widen(q):  # fp32 flash on widened q, k, v
        return _lowp.scaled_dot_product_attention(q, k, v, None, True, None)
    return _attention_torch(q, k, v)


def _rope_tables(b, s, dtype):
    inv = 1.0 / 100000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM)
    freqs = torch.arange(s, dtype=torch.float32)[:, None] * inv
    emb = torch.cat((freqs, freqs), -1)
    return (emb.cos()[None].expand(b, s, HEAD_DIM).to(dtype),
            emb.sin()[None].expand(b, s, HEAD_DIM).to(dtype))


def _op_cases(b, s, dtype):
    """[(op, size, inputs needing grad, other inputs, fastllm fn, torch fn, work)]; work is
    {"bytes": moved at least} or {"flops": of forward + backward}."""
    es = torch.tensor([], dtype=dtype).element_size()
    t = b * s
    x = torch.randn(t, HIDDEN, dtype=dtype, requires_grad=True)
    w = (1 + 0.1 * torch.randn(HIDDEN)).to(dtype).requires_grad_()
    q = torch.randn(b, s, HEADS, HEAD_DIM, dtype=dtype, requires_grad=True)
    k = torch.randn(b, s, KV_HEADS, HEAD_DIM, dtype=dtype, requires_grad=True)
    cos, sin = _rope_tables(b, s, dtype)
    gate = torch.randn(t, FFN, dtype=dtype, requires_grad=True)
    up = torch.randn(t, FFN, dtype=dtype, requires_grad=True)
    x_lin = torch.randn(t, HIDDEN, dtype=dtype, requires_grad=True)
    w_lin = (torch.randn(FFN, HIDDEN) / HIDDEN ** 0.5).to(dtype).requires_grad_()
    qa = torch.randn(b, HEADS, s, HEAD_DIM, dtype=dtype, requires_grad=True)
    ka = torch.randn(b, KV_HEADS, s, HEAD_DIM, dtype=dtype, requires_grad=True)
    va = torch.randn(b, KV_HEADS, s, HEAD_DIM, dtype=dtype, requires_grad=True)
    dt = str(dtype).split(".")[-1]
    return [
        ("attention", f"q {b}x{HEADS}x{s}x{HEAD_DIM}, k, v {KV_HEADS} heads, causal, {dt}",
         [qa, ka, va], [], _attention_fastllm, _attention_torch,
         # causal: half of the T x T products; forward 2 products, backward 5 (S recomputed)
         dict(flops=7 * b * HEADS * s * s * HEAD_DIM)),
        ("linear", f"x {t}x{HIDDEN}, W {FFN}x{HIDDEN} (gate_proj), {dt}", [x_lin, w_lin], [],
         fastllm.ops.linear, F.linear, dict(flops=3 * 2 * t * HIDDEN * FFN)),  # y, dX, dW
        ("rms_norm", f"x {t}x{HIDDEN}, {dt}", [x, w], [],
         lambda x, w: fastllm.ops.rms_norm(x, w, 1e-5), _rms_norm_torch,
         dict(bytes=5 * x.numel() * es)),  # fwd: x in, y out; bwd: x, dy in, dx out
        ("rotary_embedding", f"q {b}x{s}x{HEADS}x{HEAD_DIM}, k {KV_HEADS} heads, {dt}", [q, k],
         [cos, sin], lambda q, k, c, s_: fastllm.ops.rotary_embedding(q, k, c, s_), _rotary_torch,
         dict(bytes=4 * (q.numel() + k.numel()) * es)),  # fwd and bwd: q, k in and out
        ("swiglu", f"gate, up {t}x{FFN}, {dt}", [gate, up], [],
         lambda g, u: fastllm.ops.swiglu(g, u), _swiglu_torch,
         dict(bytes=8 * gate.numel() * es)),  # fwd: 2 in 1 out; bwd: 3 in 2 out
        ("geglu", f"gate, up {t}x{FFN}, {dt}", [gate, up], [],
         lambda g, u: fastllm.ops.geglu(g, u), _geglu_torch, dict(bytes=8 * gate.numel() * es)),
    ]


def _fwd_bwd(fn, grad_inputs, other):
    def step():
        out = fn(*grad_inputs, *other)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        torch.autograd.grad(outs, grad_inputs, [torch.ones_like(o) for o in outs])

    return step


def _peak_mib(step):
    """Peak MiB the CPU allocator held beyond the start (the profiler's allocation events):
    not a TorchDispatchMode, under which a torch.compile'd function runs its aten ops one by
    one as eager does (its row read eager's peak), and which misses a C++ kernel's own
    allocations."""
    gc.collect()
    return harness.allocator_peak_bytes(step) / 2**20


def run_ops(b, s, dtypes, progress):
    rows = []
    for dtype in dtypes:
        for op, size, grad_inputs, other, ours, theirs, work in _op_cases(b, s, dtype):
            compiled = torch.compile(theirs)
            fns = {"fastllm (cpp)": _fwd_bwd(ours, grad_inputs, other),
                   "torch eager": _fwd_bwd(theirs, grad_inputs, other),
                   "torch.compile": _fwd_bwd(compiled, grad_inputs, other)}
            progress(f"model/{op} {size}: compiling the torch.compile peer")
            fns["torch.compile"]()
            progress(f"model/{op} {size}: {', '.join(fns)} (interleaved)")
            timings = harness.measure_many(fns, min_reps=5, min_time_s=1.0)
            for provider, fn in fns.items():
                peak = _peak_mib(fn)
                rows.append(dict(op=f"model/{op}", size=f"{size}, fwd+bwd", provider=provider,
                                 time_ms=timings[provider].median_ms, **work,
                                 baseline="torch eager", peak_mib=peak,
                                 note=f"peak allocated {peak:.1f} MiB"))
    return rows


# --- 2. the training step ---------------------------------------------------------------------

QWEN3_VOCAB = 151936
GEMMA3_VOCAB = 262144
PHI4_MINI_VOCAB = 200064
# the random-init shapes FASTLLM_BENCH_FAMILY names (smollm2, the default, is VOCAB's Llama)
_RANDOM_FAMILIES = {"qwen3": "Qwen3-0.6B", "gemma3": "Gemma-3-270M", "phi4mini": "Phi-4-mini"}
_VOCABS = {"qwen3": QWEN3_VOCAB, "gemma3": GEMMA3_VOCAB, "phi4mini": PHI4_MINI_VOCAB}


def _family():
    family = os.environ.get("FASTLLM_BENCH_FAMILY", "smollm2")
    if family not in ("smollm2", *_RANDOM_FAMILIES):
        raise SystemExit(f"FASTLLM_BENCH_FAMILY={family}: use smollm2, "
                         f"{', '.join(list(_RANDOM_FAMILIES)[:-1])} or "
                         f"{list(_RANDOM_FAMILIES)[-1]}")
    return family


def _model_folder(layers):
    """(folder, its config.json as a dict) named by FASTLLM_BENCH_MODEL, or (None, None); checked:
    a folder of Hugging Face weights with at least `layers` layers, and not with
    FASTLLM_BENCH_FAMILY=qwen3, gemma3 or phi4mini (whose steps are random-init shapes)."""
    path = os.environ.get("FASTLLM_BENCH_MODEL")
    if not path:
        return None, None
    family = _family()
    if family in _RANDOM_FAMILIES:
        raise SystemExit(f"FASTLLM_BENCH_FAMILY={family} and FASTLLM_BENCH_MODEL={path}: the "
                         f"{family} step is a random-init {_RANDOM_FAMILIES[family]} shape; set "
                         "one of them, not both")
    if not os.path.isdir(path):
        raise SystemExit(f"FASTLLM_BENCH_MODEL={path}: there is no such folder (make one with "
                         "examples/prepare_smollm2.py)")
    try:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        why = f"{type(exc).__name__}: {exc}"
        raise SystemExit(f"FASTLLM_BENCH_MODEL={path}: a folder of Hugging Face weights with a "
                         f"readable config.json is expected ({why})") from None
    have = config.get("num_hidden_layers")
    if isinstance(have, int) and layers > have:
        raise SystemExit(f"FASTLLM_BENCH_MODEL={path} has {have} layers, {layers} asked "
                         f"(FASTLLM_BENCH_LAYERS, else 4, or 30 with --full): set "
                         f"FASTLLM_BENCH_LAYERS={have} or fewer")
    return path, config


def _model(layers, dtype):
    """(model, what it is: shape, weights and layers, for the table's size)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if _family() == "qwen3":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(0)
        config = Qwen3Config(vocab_size=QWEN3_VOCAB, hidden_size=1024, intermediate_size=3072,
                             num_hidden_layers=layers, num_attention_heads=16,
                             num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                             tie_word_embeddings=True, attn_implementation="sdpa")
        return (Qwen3ForCausalLM(config).to(dtype),
                f"Qwen3-0.6B shape (random init), {layers} layers")
    if _family() == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        torch.manual_seed(0)
        config = Gemma3TextConfig(vocab_size=GEMMA3_VOCAB, hidden_size=640,
                                  intermediate_size=2048, num_hidden_layers=layers,
                                  num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                  query_pre_attn_scalar=256, sliding_window=512,
                                  max_position_embeddings=32768, tie_word_embeddings=True,
                                  attn_implementation="sdpa")
        return (Gemma3ForCausalLM(config).to(dtype),
                f"Gemma-3-270M shape (random init), {layers} layers")
    if _family() == "phi4mini":
        from transformers import Phi3Config, Phi3ForCausalLM

        torch.manual_seed(0)
        config = Phi3Config(vocab_size=PHI4_MINI_VOCAB, hidden_size=3072, intermediate_size=8192,
                            num_hidden_layers=layers, num_attention_heads=24,
                            num_key_value_heads=8, partial_rotary_factor=0.75,
                            max_position_embeddings=4096, tie_word_embeddings=True,
                            sliding_window=262144,  # (Phi-4-mini's config: longer than any row)
                            pad_token_id=199999, bos_token_id=199999, eos_token_id=199999,
                            attn_implementation="sdpa")
        return (Phi3ForCausalLM(config).to(dtype),
                f"Phi-4-mini shape (random init), {layers} layers")
    path, config = _model_folder(layers)
    if path:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     attn_implementation="sdpa")
        have = len(model.model.layers)
        model.model.layers = model.model.layers[:layers]
        model.config.num_hidden_layers = len(model.model.layers)
        c = model.config
        shape = (f"hidden {c.hidden_size}, {c.num_attention_heads}/"
                 f"{getattr(c, 'num_key_value_heads', None) or c.num_attention_heads} heads, "
                 f"ffn {c.intermediate_size}, vocab {c.vocab_size}")
        return (model.to(dtype), f"{os.path.basename(os.path.normpath(path))} weights ({shape}), "
                                 f"{len(model.model.layers)} of {have} layers")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                         num_hidden_layers=layers, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, max_position_embeddings=2048,
                         rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=100000.0,
                         attn_implementation="sdpa")
    return (LlamaForCausalLM(config).to(dtype),
            f"SmolLM2-135M shape (random init), {layers} layers")


def _setups(layers, dtype, finetune):
    """{provider: (model, optimizer)}: the same weights on both sides."""
    base, what = _model(layers, dtype)
    base.train()
    hf = copy.deepcopy(base)
    ours = base
    if finetune == "lora":
        import peft

        # (Phi-3's q, k and v are one projection)
        targets = ["qkv_proj"] if _family() == "phi4mini" else ["q_proj", "v_proj"]
        config = peft.LoraConfig(r=16, lora_alpha=32, target_modules=targets, lora_dropout=0.0)
        hf = peft.get_peft_model(hf, config, autocast_adapter_dtype=False)
        fastllm.lora.inject_lora(ours, targets, r=16, alpha=32)
        # the same adapter on both sides (PEFT's B starts at zero, so does ours: make it nonzero)
        torch.manual_seed(1)
        for name, layer in fastllm.lora.lora_modules(ours):
            theirs = hf.base_model.model.get_submodule(name)
            with torch.no_grad():
                layer.lora_B.normal_(0, 0.02)
                theirs.lora_A["default"].weight.copy_(layer.lora_A)
                theirs.lora_B["default"].weight.copy_(layer.lora_B)
    fastllm.patch(ours)
    trainable = lambda m: [p for p in m.parameters() if p.requires_grad]  # noqa: E731
    return {
        "fastllm (patched)": (ours, fastllm.optim.AdamW(trainable(ours), lr=1e-5)),
        "HF + torch AdamW(fused)" if finetune == "full" else "HF + PEFT + torch AdamW(fused)":
            (hf, torch.optim.AdamW(trainable(hf), lr=1e-5, fused=True)),
    }, what


def _train_step(model, opt, ids):
    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def _profile_top(step, n=6):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = [e for e in prof.key_averages() if not e.key.startswith("ProfilerStep")]
    total = sum(e.self_cpu_time_total for e in events) or 1
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:n]
    return ", ".join(f"{e.key} {100 * e.self_cpu_time_total / total:.0f}%" for e in top)


# A provider whose step takes longer than this is not profiled (one more step), and a case where
# any provider's warm-up step took longer is timed over one step: Hugging Face's bf16 step on a
# CPU without native bf16 GEMMs takes many minutes (fastllm/_lowp.py).
# FASTLLM_BENCH_PROFILE_MAX_S overrides it.
PROFILE_MAX_S = 120.0
# A provider whose warm-up step took longer than this is not stepped again: that step's time is
# its time (the first step's one-off costs, optimizer state allocation, are milliseconds next to
# it), and the other providers are timed on their own. Saves ~20 min per bf16 case of HF there.
# FASTLLM_BENCH_SLOW_S overrides it.
SLOW_S = 600.0


def _time_limits():
    """(profile_max_s, slow_s): PROFILE_MAX_S and SLOW_S or their FASTLLM_BENCH_* overrides,
    each a finite number of seconds >= 0 (0: profile none, time every provider by its warm-up
    step)."""
    out = []
    for name, default in (("FASTLLM_BENCH_PROFILE_MAX_S", PROFILE_MAX_S),
                          ("FASTLLM_BENCH_SLOW_S", SLOW_S)):
        text = os.environ.get(name)
        try:
            value = default if text is None else float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= 0):
            raise SystemExit(f"{name}={text}: a finite number of seconds >= 0 is expected")
        out.append(value)
    return tuple(out)


def run_steps(layers, b, s, steps, dtypes, finetunes, progress):
    """The training step of each provider: the first (warm-up) step measured for its peak memory
    (PeakMemory; it also allocates the optimizer state, as every first step does), then `steps`
    timed steps interleaved across providers (one when a warm-up step took over PROFILE_MAX_S),
    then one profiled step."""
    rows = []
    profile_max_s, slow_s = _time_limits()
    torch.manual_seed(0)
    config = _model_folder(layers)[1]
    vocab = (_VOCABS.get(_family()) or
             (config.get("vocab_size", VOCAB) if config else VOCAB))
    ids = torch.randint(0, vocab, (b, s))
    for dtype in dtypes:
        for finetune in finetunes:
            dt = str(dtype).split(".")[-1]
            setups, what = _setups(layers, dtype, finetune)
            size = f"{what}, {b}x{s} tokens, {finetune}, {dt}"
            fns = {name: _train_step(m, o, ids) for name, (m, o) in setups.items()}
            losses, peaks, warmup_s = {}, {}, {}
            for name, fn in fns.items():
                progress(f"model step {size}: {name}: warm-up step (peak memory)")
                from fastllm.train.memory import PeakMemory

                model, opt = setups[name]
                gc.collect()
                start = time.perf_counter()
                with PeakMemory(model, opt) as mem:
                    losses[name] = float(fn())
                warmup_s[name] = time.perf_counter() - start
                peaks[name] = mem.peak / 2**20
            slow = {n for n, t in warmup_s.items() if t > slow_s}
            timed = {n: f for n, f in fns.items() if n not in slow}
            reps = (steps if max((warmup_s[n] for n in timed), default=0) <= profile_max_s
                    else 1)
            load = os.getloadavg()[0]
            timings = {}
            if timed:
                progress(f"model step {size}: {', '.join(timed)} "
                         f"({'interleaved, ' if len(timed) > 1 else ''}{reps} steps)")
                timings = harness.measure_many(timed, warmup=0, min_reps=reps, max_reps=reps,
                                               min_time_s=0.0)
            for name, fn in fns.items():
                ms = (warmup_s[name] * 1e3 if name in slow else timings[name].median_ms)
                how = ("its one step (the warm-up; a step takes over "
                       f"{slow_s:.0f} s)" if name in slow else f"median of {reps} steps")
                if ms / 1e3 <= profile_max_s:
                    progress(f"model step {size}: {name}: profile")
                    top = _profile_top(fn)
                else:
                    top = f"not profiled (a step takes {ms / 1e3:.0f} s > {profile_max_s:.0f} s)"
                peak = peaks[name]
                rows.append(dict(op="model step", size=size, provider=name, time_ms=ms,
                                 tokens_per_s=b * s / ms * 1e3, peak_mib=peak,
                                 first_loss=losses[name], timed_from=how,
                                 load_avg=[round(load, 1), round(os.getloadavg()[0], 1)],
                                 baseline=[p for p in fns if p.startswith("HF")][0],
                                 note=(f"{b * s / ms * 1e3:.0f} tokens/s ({how}), "
                                       f"peak {peak:.0f} MiB "
                                       f"(params, grads, optimizer state and activations), "
                                       f"first loss {losses[name]:.4f}; profile: {top}")))
            del setups, fns
            gc.collect()
    hf_rows = {r["size"]: r for r in rows if r["provider"].startswith("HF")}
    for r in rows:
        if not r["provider"].startswith("HF"):
            theirs = hf_rows[r["size"]]
            r["note"] += (f"; vs HF: x{r['tokens_per_s'] / theirs['tokens_per_s']:.2f} tokens/s, "
                          f"{100 * r['peak_mib'] / theirs['peak_mib']:.0f}% of its memory")
    return rows


def _env_int(name, default, least):
    text = os.environ.get(name)
    try:
        value = default if text is None else int(text)
    except ValueError:
        raise SystemExit(f"{name}={text}: an integer >= {least} is expected") from None
    if value < least:
        raise SystemExit(f"{name}={text}: an integer >= {least} is expected")
    return value


def settings(full=False, device="cpu"):
    """(layers, seq, steps, dtypes, finetunes) from the FASTLLM_BENCH_* variables, every one
    checked, and the device: fastllm bench calls this before any benchmark runs, so a typo
    costs nothing (not the other benchmarks' results)."""
    if torch.device(device).type != "cpu":
        raise SystemExit("fastllm bench --ops model: the CPU benchmark; on a GPU run "
                         "bench/device_check.sh")
    layers = _env_int("FASTLLM_BENCH_LAYERS", 30 if full else 4, 1)
    seq = _env_int("FASTLLM_BENCH_SEQ", 512 if full else 256, 2)
    steps = _env_int("FASTLLM_BENCH_STEPS", 3 if full else 2, 0)
    _family()
    _model_folder(layers)
    _time_limits()
    names = os.environ.get("FASTLLM_BENCH_DTYPES", "fp32,bf16").split(",")
    known = {"fp32": torch.float32, "bf16": torch.bfloat16}
    # (a name twice would run its cases twice into one table, each row against the last
    # duplicate's baseline)
    if not names or any(n not in known for n in names) or len(set(names)) < len(names):
        raise SystemExit(f"FASTLLM_BENCH_DTYPES={','.join(names)}: use fp32, bf16 or fp32,bf16")
    finetunes = os.environ.get("FASTLLM_BENCH_FINETUNES", "lora,full").split(",")
    if not finetunes or any(f not in ("lora", "full") for f in finetunes) or len(
            set(finetunes)) < len(finetunes):
        raise SystemExit(f"FASTLLM_BENCH_FINETUNES={','.join(finetunes)}: use lora, full or "
                         "lora,full")
    return layers, seq, steps, [known[n] for n in names], finetunes


def run(device="cpu", full=False, progress=print):
    layers, seq, steps, dtypes, finetunes = settings(full, device)
    rows = run_ops(8, 512, dtypes, progress)
    if steps > 0:  # FASTLLM_BENCH_STEPS=0: the ops only
        rows += run_steps(layers, 8, seq, steps, dtypes, finetunes, progress)
    return rows
