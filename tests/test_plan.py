"""The planner's cost model: hand-computed cases, published Megatron-LM results, the activation
count against what autograd really saves, and the `fastllm plan` command."""

import json
import math
import os
import re

import pytest
import torch

from fastllm.parallel.layout import ParallelLayout
from fastllm.parallel.planner import (
    GPUS,
    MODELS,
    GPUSpec,
    Layout,
    ModelSpec,
    activation_bytes_per_layer,
    bubble_fraction,
    check_layout,
    estimate,
    model_from_hf_config,
    plan,
)
from fastllm.parallel.planner.cost import _collective_time

# an fp32 host with round figures, for the memory counts (time does not matter there)
CPU = GPUSpec("cpu", 24e9, 60e9, 30e9, 10e9, 10e9, reserved=0, dtype_bytes=4)


def test_param_counts_match_published():
    # Llama 2 7B: 6,738,415,616 parameters (the Hugging Face checkpoint's count)
    assert MODELS["llama2-7b"].params() == 6_738_415_616
    # Llama 2 70B: 68,976,648,192
    assert MODELS["llama2-70b"].params() == 68_976_648_192


def test_hf_config_reading(tmp_path):
    import json

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 32, "hidden_size": 4096,
                                "num_attention_heads": 32, "num_key_value_heads": 8,
                                "intermediate_size": 14336, "vocab_size": 128256}))
    assert model_from_hf_config(str(path)).params() == MODELS["llama3-8b"].params()
    with pytest.raises(ValueError, match="vocab_size"):
        model_from_hf_config({"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2})
    # null, as older or hand-written configs have it: transformers reads the attention heads
    mha = {"num_hidden_layers": 2, "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 10}
    assert model_from_hf_config({**mha, "num_key_value_heads": None}).kv_heads == 2


def test_bubble_and_collectives_by_hand():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 12) == pytest.approx(3 / 15)
    assert bubble_fraction(4, 12, chunks=2) == pytest.approx(3 / 27)
    # ring all-reduce of 1 GB over 8 ranks at 100 GB/s: 2 * 7/8 * 10 ms, plus 14 latencies
    assert _collective_time("all_reduce", 1e9, 8, 100e9, latency=0) == pytest.approx(17.5e-3)
    assert _collective_time("all_gather", 1e9, 8, 100e9, latency=0) == pytest.approx(8.75e-3)
    assert _collective_time("all_reduce", 1e9, 1, 100e9) == 0.0


def test_memory_by_hand():
    # 2 layers, hidden 64, 4 heads (2 kv), ffn 128, vocab 100, no tp/pp
    m = ModelSpec("t", 2, 64, 4, 2, 128, 100)
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
    n = 2 * per_layer + 2 * 100 * 64 + 64
    assert m.params() == n
    gpu = GPUSpec("g", 1e12, 1e12, 1e12, 1e11, 1e10, reserved=0)  # bf16, mixed precision
    r = estimate(m, Layout(dp=4, zero=1), 32, 8, gpu)
    assert r["memory"]["weights"] == pytest.approx(2 * n)
    assert r["memory"]["grads"] == pytest.approx(2 * n)
    assert r["memory"]["optimizer"] == pytest.approx(12 * n / 4)  # master + 2 moments, sharded
    r3 = estimate(m, Layout(dp=4, zero=3), 32, 8, gpu)
    assert r3["memory"]["weights"] == pytest.approx(2 * n / 4)
    # activations per layer per token, bf16: norms 2 (8h + 4), attention 4h + 4 kv + 4 heads,
    # SwiGLU 8 ffn; micro-batch 1 x 32 tokens
    per_token = 2 * (8 * 64 + 4) + 4 * 64 + 4 * 32 + 4 * 4 + 8 * 128
    assert activation_bytes_per_layer(m, 1, 32, 2) == pytest.approx(32 * per_token)
    # tensor parallel 2 halves attention and MLP, keeps the norms whole
    half = 2 * (8 * 64 + 4) + (4 * 64 + 4 * 32 + 4 * 4 + 8 * 128) / 2
    assert activation_bytes_per_layer(m, 1, 32, 2, tp=2) == pytest.approx(32 * half)


def test_pipeline_memory_by_hand():
    """What torch.distributed.pipelining holds beyond activations (FASTLLM runtime only): a
    receive buffer per micro-batch on each end stage, and while micro-batches accumulate, one
    fresh gradient of the stage's largest parameter beside the accumulated one."""
    from fastllm.parallel.planner import FASTLLM

    m = ModelSpec("t", 4, 64, 4, 2, 128, 100)
    lo = Layout(pp=2, schedule="1f1b", micro_batch=1)
    ours = estimate(m, lo, 32, 8, CPU, runtime=FASTLLM)["memory"]
    megatron = estimate(m, lo, 32, 8, CPU)["memory"]
    assert ours["pipeline_buffers"] == 8 * 32 * 64 * 4  # 8 micro-batches x (32, 64) fp32
    assert "pipeline_buffers" not in megatron
    assert ours["backward_workspace"] == 64 * 128 * 4  # an MLP matrix beats the 100 x 64 head
    one = estimate(m, Layout(micro_batch=8), 32, 8, CPU, runtime=FASTLLM)["memory"]
    assert one["backward_workspace"] == 0  # one micro-batch: nothing accumulates


def test_plan_keeps_fastllm_rules_on_the_vocabulary():
    """`fastllm plan` priced pipelines of a tied model (fastllm train refuses them) and split a
    tied or undivided embedding, head and logits over tp (fastllm keeps them whole on every tp
    rank, ParallelLayout.vocab_parallel): it recommended layouts that could not run or fit.
    estimate() without the rules prices Megatron-LM's layouts as before."""
    tied, gpu, seq = MODELS["qwen3-0.6b"], GPUS["A100"], 256
    assert all(r["layout"].pp == 1 for r in plan(tied, seq, 16, gpu, 16)[1])
    with pytest.raises(ValueError, match=r"parallel.pp=2 needs untied embeddings"):
        check_layout(tied, Layout(dp=8, pp=2), seq, 16, fastllm_rules=True)
    check_layout(tied, Layout(dp=8, pp=2), seq, 16)
    for m in (tied, ModelSpec("odd", 2, 4096, 32, 32, 11008, 32001)):  # tp2 divides no 32001
        ours, megatron = (estimate(m, Layout(tp=2), seq, 1, gpu, fastllm_rules=r)["memory"]
                          for r in (True, False))
        half = (m.embedding_params() + m.head_params()) / 2
        assert ours["weights"] - megatron["weights"] == pytest.approx(2 * half)
        logits = seq * m.vocab * (2 + 4 + 4)  # bf16 logits, their fp32 copy, log-softmax
        assert ours["activations"] - megatron["activations"] == pytest.approx(logits / 2)
    # untied and divided: split as before, but a pipeline's last stage gathers the logits whole
    ours, megatron = (estimate(ModelSpec("t", 4, 64, 4, 2, 128, 4096), Layout(tp=2, pp=2), 32,
                               4, CPU, fastllm_rules=r)["memory"]  # (the last stage peaks)
                      for r in (True, False))
    assert ours["weights"] == megatron["weights"]
    assert ours["activations"] - megatron["activations"] == 32 * 4096 * (4 + 4) / 2


def test_pipeline_memory_prices_the_middle_stage():
    """The reported memory is the largest stage's. pp4 1F1B: rank i holds pp - i micro-batches
    in flight (Schedule1F1B's warm-up), a middle rank a receive buffer for the activation and
    one for the gradient of every micro-batch; with many micro-batches and a small vocabulary
    rank 1 is the largest."""
    from fastllm.parallel.planner import FASTLLM

    m = ModelSpec("t", 4, 64, 4, 2, 128, 16)
    seq, mbs = 32, 256
    act = activation_bytes_per_layer(m, 1, seq, 4)
    layer_input = seq * 64 * 4
    r = estimate(m, Layout(pp=4, schedule="1f1b"), seq, mbs, CPU, runtime=FASTLLM)
    layer = m.layer_params()  # one layer a stage, no embedding or head in the middle
    assert r["memory"] == pytest.approx({
        "weights": 4 * layer, "grads": 4 * layer, "optimizer": 8 * layer,
        "activations": 3 * act, "pipeline_buffers": 2 * mbs * layer_input,
        "backward_workspace": 64 * 128 * 4})
    assert r["memory_total"] == pytest.approx(sum(r["memory"].values()))


def test_interleaved_last_stage_memory():
    """Interleaved, pp2 x 2 chunks, a large vocabulary (the last rank is the largest): that
    rank runs (v - 1) pp = 2 chunk forwards of warm-up and one more before its first backward
    (ScheduleInterleaved1F1B), 1.5 stages' worth, and its two chunks receive 3 boundary
    tensors per micro-batch (no gradient into the model's last chunk)."""
    from fastllm.parallel.planner import FASTLLM

    m, seq = ModelSpec("t", 4, 64, 4, 2, 128, 4096), 32
    act = activation_bytes_per_layer(m, 1, seq, 4)  # one layer: one chunk here
    layer_input = seq * 64 * 4
    r = estimate(m, Layout(pp=2, schedule="interleaved", chunks=2), seq, 8, CPU,
                 runtime=FASTLLM)["memory"]
    logits = seq * 4096 * (4 + 4)  # fp32: the logits and the loss's log-softmax
    assert r["activations"] == pytest.approx(3 * act + logits + 7 * seq * 4096 * 4)
    assert r["pipeline_buffers"] == 8 * 3 * layer_input


def test_layout_errors_name_the_setting():
    m = MODELS["llama2-70b"]
    with pytest.raises(ValueError, match="parallel.tp=16 does not divide num_key_value_heads=8"):
        check_layout(m, Layout(tp=16), 4096, 64)
    with pytest.raises(ValueError, match="parallel.pp=3 .*num_hidden_layers=80"):
        check_layout(m, Layout(pp=3), 4096, 64)
    with pytest.raises(ValueError, match="global_batch_size=63 .*parallel.dp=2"):
        check_layout(m, Layout(dp=2), 4096, 63)
    with pytest.raises(ValueError, match="needs at least parallel.pp=4 micro-batches per step, "
                                         "got .* = 2"):
        check_layout(m, Layout(dp=8, pp=4, micro_batch=4), 4096, 64)


@pytest.mark.parametrize("kw,match", [
    (dict(dp=True), r"parallel.dp must be a positive integer, got True"),
    (dict(pp=2, tp=False), r"parallel.tp must be a positive integer, got False"),
    (dict(chunks=1.5), r"parallel.chunks must be a positive integer, got 1.5"),
    (dict(chunks="2"), r"parallel.chunks must be a positive integer, got '2'"),
    (dict(chunks=-1, schedule="interleaved"), r"parallel.chunks .* got -1"),
    (dict(chunks=True, schedule="interleaved"), r"parallel.chunks .* got True"),
])
def test_parallel_layout_refuses_bad_sizes(kw, match):
    with pytest.raises(ValueError, match=match):
        ParallelLayout(**kw)


def test_parallel_layout_chunks_only_with_the_interleaved_schedule():
    """Several model chunks a rank are the interleaved schedule's: with 1F1B or GPipe the
    runtime builds one stage a rank, which `stages` would miscount."""
    for schedule in ("1f1b", "gpipe"):
        with pytest.raises(ValueError, match=rf"parallel.chunks=2 needs parallel.schedule="
                                             rf"interleaved, got parallel.schedule={schedule}"):
            ParallelLayout(pp=2, schedule=schedule, chunks=2)
        assert ParallelLayout(pp=2, schedule=schedule).stages == 2  # chunks 0: 1 by default
        assert ParallelLayout(pp=2, schedule=schedule, chunks=1).stages == 2
    assert ParallelLayout(pp=2, schedule="interleaved").stages == 4
    assert ParallelLayout(pp=2, schedule="interleaved", chunks=3).stages == 6


@pytest.mark.parametrize("global_batch,micro_batch,match", [
    (0, 2, r"global_batch_size must be a positive integer, got 0"),
    (-4, 2, r"global_batch_size must be a positive integer, got -4"),
    (4, 0, r"micro_batch_size must be a positive integer, got 0"),
    (4, -2, r"micro_batch_size must be a positive integer, got -2"),
    (4.0, 2, r"global_batch_size must be a positive integer, got 4.0"),
])
def test_micro_batches_refuses_empty_batches(global_batch, micro_batch, match):
    for layout in (ParallelLayout(), ParallelLayout(dp=2, pp=2)):
        with pytest.raises(ValueError, match=match):
            layout.micro_batches(global_batch, micro_batch)
    assert ParallelLayout(dp=2, pp=2).micro_batches(8, 2) == 2


def test_recompute_zero_and_lora_lower_memory():
    m, gpu = MODELS["llama2-70b"], GPUS["H100"]
    base = Layout(dp=8, tp=8, pp=8, micro_batch=1)
    full = estimate(m, base, 4096, 512, gpu)
    rec = estimate(m, Layout(**{**base.__dict__, "recompute": True}), 4096, 512, gpu)
    zero = estimate(m, Layout(**{**base.__dict__, "zero": 1}), 4096, 512, gpu)
    lora = estimate(m, Layout(**{**base.__dict__, "lora_rank": 16}), 4096, 512, gpu)
    assert rec["memory"]["activations"] < full["memory"]["activations"] / 5
    assert rec["step_time"] > full["step_time"]  # a fourth pass
    assert zero["memory"]["optimizer"] == pytest.approx(full["memory"]["optimizer"] / 8)
    assert lora["memory"]["optimizer"] < full["memory"]["optimizer"] / 50
    assert lora["step_time"] < full["step_time"]


def test_qlora_prices_the_frozen_base_in_nf4():
    """Layout(lora_rank, nf4): the decoder layers' linear weights at NF4's 0.5625 bytes an
    element (double-quantised 0.5159), one layer's q/k/v or gate/up dequantised at a time, the
    dequantisation's traffic on every pass; only the layouts fastllm train runs QLoRA in (tp =
    pp = 1, DDP or FSDP2). Llama-2-70B's QLoRA fits one H100 where its LoRA does not."""
    import dataclasses

    model, gpu = MODELS["llama2-70b"], GPUS["H100"]
    quantised = model.layers * model.layer_linear_params()
    lo = Layout(micro_batch=1, recompute=True, lora_rank=16)
    lora, qlora, dq = (estimate(model, dataclasses.replace(lo, **kw), 2048, 16, gpu)
                       for kw in ({}, {"nf4": True}, {"nf4": True, "double_quant": True}))
    assert lora["memory"]["weights"] - qlora["memory"]["weights"] == pytest.approx(
        quantised * (2 - 0.5625))
    assert qlora["memory"]["weights"] - dq["memory"]["weights"] == pytest.approx(
        quantised * (0.5625 - (0.5 + (1 + 4 / 256) / 64)))
    assert qlora["memory"]["dequantized"] == 2 * 2 * model.hidden * model.ffn  # gate + up, bf16
    assert "dequantized" not in lora["memory"]
    assert qlora["time_compute"] > lora["time_compute"]  # (the dequantisation's bytes)
    assert not lora["fits"] and qlora["fits"] and dq["memory_total"] < qlora["memory_total"]
    assert qlora["layout"].describe().endswith("recompute qlora16")
    assert dq["layout"].describe().endswith("qlora16+dq")
    # FSDP2 shards the 4-bit base and gathers it layer by layer, in NF4
    fsdp = [estimate(model, Layout(dp=8, zero=3, lora_rank=16, nf4=n), 2048, 16, gpu)["memory"]
            for n in (False, True)]
    assert fsdp[0]["weights"] - fsdp[1]["weights"] == pytest.approx(quantised * 1.4375 / 8)
    assert fsdp[1]["gathered"] < fsdp[0]["gathered"]
    for kw, says in (({"tp": 2}, "tp=2 pp=1 zero0"), ({"pp": 2}, "tp=1 pp=2 zero0"),
                     ({"dp": 2, "zero": 1}, "tp=1 pp=1 zero1")):
        with pytest.raises(ValueError, match=f"QLoRA \\(nf4\\) runs with .*got {says}"):
            check_layout(model, Layout(**kw, lora_rank=16, nf4=True), 2048, 16)
    for kw in ({"nf4": True}, {"lora_rank": 16, "double_quant": True}):
        with pytest.raises(ValueError, match="nf4 \\(QLoRA\\) needs lora_rank > 0"):
            check_layout(model, Layout(**kw), 2048, 16)
    best, every = plan(model, 2048, 16, gpu, 8, lora_rank=16, nf4=True)
    assert best and every and all(
        e["layout"].tp == e["layout"].pp == 1 and e["layout"].zero in (0, 3) and e["layout"].nf4
        for e in every)


def test_fsdp_prices_an_untied_embedding_as_its_own_unit():
    """apply_fsdp makes an untied embedding a unit of its own: not held in the root all step;
    under full fine-tuning gathered again, with its whole grad, for its backward (the last)."""
    model, gpu = MODELS["llama3-8b"], GPUS["H100"]
    assert not model.tied_embeddings
    e = g = gpu.dtype_bytes
    layer, emb = model.layer_params(), model.embedding_params()
    root = model.head_params() + model.hidden  # (the head and the final norm)
    full, lora = (estimate(model, Layout(dp=8, zero=3, lora_rank=r), 4096, 64, gpu)["memory"]
                  for r in (0, 16))
    assert emb * (e + g) > 2 * layer * e + layer * g  # (a vocabulary of 128256: it is the peak)
    assert full["gathered"] == pytest.approx(emb * (e + g) + root * (e + g))
    from fastllm.parallel.planner.memory import lora_params_per_layer

    assert lora["gathered"] == pytest.approx(2 * layer * e + root * e
                                             + lora_params_per_layer(model, 16) * g)


# Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
# Megatron-LM" (SC 2021), Table 1: GPT models, sequence 2048, vocabulary 51200, A100 80GB (312
# TFLOP/s bf16 peak), DGX A100 nodes of 8, full activation recomputation. Columns: parameters
# (billions), heads, hidden, layers, tensor-parallel, pipeline-parallel, GPUs, batch, achieved
# TFLOP/s per GPU (their FLOP count includes the recomputation).
MEGATRON_TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def megatron_prediction(row):
    """The planner's best fitting layout at the published tp/pp/dp: (params, TFLOP/s, layout)."""
    billions, heads, hidden, layers, tp, pp, gpus, batch, _ = row
    m = ModelSpec(f"gpt-{billions}b", layers, hidden, heads, heads, 4 * hidden, 51200,
                  gated_mlp=False, tied_embeddings=True)
    best = None
    for mb in (1, 2, 4, 8):
        schedules = [("1f1b", 1)] if pp == 1 else [("1f1b", 1), ("interleaved", 2),
                                                     ("interleaved", 3)]
        for sched, v in schedules:
            lo = Layout(dp=gpus // (tp * pp), tp=tp, pp=pp, micro_batch=mb, recompute=True,
                        schedule=sched, chunks=v)
            try:
                # 2021 Megatron: no fused attention; gradient all-reduce not overlapped
                r = estimate(m, lo, 2048, batch, GPUS["A100"], 8, flash=False, dp_overlap=0.0)
            except ValueError:
                continue
            if r["fits"] and (best is None or r["step_time"] < best["step_time"]):
                best = r
    return m.params() / 1e9, best["achieved_flops_per_gpu"] / 1e12, best["layout"]


def test_against_megatron_lm_table():
    within = 0
    for row in MEGATRON_TABLE_1:
        billions, published = row[0], row[-1]
        params, predicted, _ = megatron_prediction(row)
        # the shapes are read right (the paper also counts biases and position embeddings)
        assert params == pytest.approx(billions, rel=0.04)
        if abs(predicted / published - 1) <= 0.25:
            within += 1
    assert within >= 5


def test_activation_count_matches_autograd():
    """Bytes saved for backward by a real transformers Llama against the planner's count."""
    from fastllm.parallel.loss import vocab_parallel_cross_entropy
    from parallel_train import make_batches, tiny_llama

    torch.set_num_threads(1)
    shape = dict(layers=3, hidden=96, heads=6, kv_heads=3, ffn=256, vocab=200)
    model = tiny_llama(**shape)
    ids, labels = make_batches(1, 4, 48, 200)[0]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()  # one storage counts once
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        vocab_parallel_cross_entropy(model(input_ids=ids).logits, labels)
    measured = sum(saved.values())
    spec = ModelSpec("tiny", 3, 96, 6, 3, 256, 200)
    r = estimate(spec, Layout(micro_batch=4), 48, 4, CPU)
    assert sum(p.numel() for p in model.parameters()) == spec.params()
    assert r["memory"]["activations"] == pytest.approx(measured, rel=0.10)
    # fp32 training without master weights: 4 weight + 4 grad + 8 Adam bytes per parameter
    state = r["memory"]["weights"] + r["memory"]["grads"] + r["memory"]["optimizer"]
    assert state == 16 * spec.params()


def test_plan_prefers_fitting_and_warns():
    best, everything = plan("llama2-70b", 4096, 512, "A100", 64, node_size=8, top=3)
    assert best and all(r["fits"] for r in best)
    assert [r["step_time"] for r in best] == sorted(r["step_time"] for r in best)
    assert all(r["layout"].tp <= 8 for r in everything)
    assert any(not r["fits"] for r in everything)  # e.g. 70B fully replicated on dp64
    for r in everything:
        if r["comm_share"] > 0.15:
            assert any("communication" in w for w in r["warnings"])
        if r["bubble_share"] > 0.15:
            assert any("bubble" in w for w in r["warnings"])
    assert math.isclose(sum(r["n_gpus"] for r in best) / len(best), 64)


def test_plan_tells_no_valid_layout_from_none_fitting(capsys):
    from fastllm.cli import main

    # 32 heads and layers, batch 1 on 3 GPUs: no dp/tp/pp can split them, whatever the memory
    with pytest.raises(ValueError, match=r"no valid layout of 3 GPUs.*dp3 tp1 pp1: "
                                         r"global_batch_size=1 .*dp1 tp1 pp3: parallel.pp=3 .*"
                                         r"num_hidden_layers=32.*dp1 tp3 pp1: parallel.tp=3 "
                                         r"does not divide num_attention_heads=32"):
        plan("llama2-7b", 4096, 1, "H100", 3)
    with pytest.raises(SystemExit, match="fastllm plan: no valid layout"):
        main(["plan", "--model", "llama2-7b", "--seq-len", "4096", "--global-batch", "1",
              "--gpus", "3"])
    # 70B on one GPU is a valid layout that does not fit
    main(["plan", "--model", "llama2-70b", "--seq-len", "4096", "--global-batch", "1",
          "--gpus", "1"])
    assert "no layout fits in memory" in capsys.readouterr().out


def test_plan_cli_refuses_efficiency_as_percent(tmp_path):
    from fastllm.cli import main

    gpu = tmp_path / "gpu.json"
    spec = {"memory_gb": 80, "peak_tflops": 989, "hbm_gbps": 3350, "intra_node_gbps": 450,
            "inter_node_gbps": 50}
    for field in ("matmul_efficiency", "comm_efficiency"):
        gpu.write_text(json.dumps({**spec, field: 75}))
        with pytest.raises(SystemExit, match=rf"{field} is a fraction .* in \(0, 1\].* got 75"):
            main(["plan", "--model", "llama2-7b", "--seq-len", "4096", "--global-batch", "64",
                  "--gpus", "8", "--gpu", str(gpu)])
    gpu.write_text(json.dumps({**spec, "matmul_efficiency": 1, "comm_efficiency": 0.5}))
    main(["plan", "--model", "llama2-7b", "--seq-len", "4096", "--global-batch", "64",
          "--gpus", "8", "--gpu", str(gpu)])


def test_plan_cli(capsys, tmp_path):
    from fastllm.cli import main

    main(["plan", "--model", "llama3-70b", "--seq-len", "8192", "--global-batch", "1024",
          "--gpu", "H100", "--gpus", "512"])
    out = capsys.readouterr().out
    assert "llama3-70b" in out and "tokens/s" in out and "dp" in out
    main(["plan", "--model", "llama2-70b", "--seq-len", "2048", "--global-batch", "16",
          "--gpu", "H100", "--gpus", "1", "--lora", "16", "--qlora", "--double-quant"])
    assert "dp1 tp1 pp1 mb1 recompute qlora16+dq" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="neither a known name"):
        main(["plan", "--model", "nope", "--seq-len", "1", "--global-batch", "1", "--gpus", "8"])


def test_plan_cli_refuses_bad_arguments_and_files(tmp_path):
    from fastllm.cli import main

    base = ["plan", "--model", "llama3-8b", "--seq-len", "4096", "--global-batch", "64",
            "--gpus", "8"]
    for extra, says in ((["--qlora"], "--qlora quantises LoRA's frozen base: give --lora"),
                        (["--lora", "8", "--double-quant"], "--double-quant .*give --qlora")):
        with pytest.raises(SystemExit, match=says):
            main(base + extra)
    for option, value in (("--gpus", "-8"), ("--seq-len", "-1"), ("--global-batch", "0"),
                          ("--node-size", "0"), ("--dp-overlap", "2")):
        args = list(base)
        if option in args:
            args[args.index(option) + 1] = value
        else:
            args += [option, value]
        with pytest.raises(SystemExit, match=f"{option} must be"):
            main(args)
    gpu = tmp_path / "gpu.json"
    for data, says in (({"memory_gb": 80}, "missing key 'peak_tflops'"),
                       ({"memory_gb": 80, "peak_tflops": 0, "hbm_gbps": 1, "intra_node_gbps": 1,
                         "inter_node_gbps": 1}, "peak_flops must be a finite number > 0"),
                       ([1, 2], "expected a JSON object")):
        gpu.write_text(json.dumps(data))
        with pytest.raises(SystemExit, match=says):
            main(base + ["--gpu", str(gpu)])
    # a negative wait priced negative step times; 2.7 bytes ran as 2; true GB as 1
    spec = dict.fromkeys(("memory_gb", "peak_tflops", "hbm_gbps", "intra_node_gbps",
                          "inter_node_gbps"), 50)
    entry = r"sync_costs entries must be \[group size \(an integer >= 1\), seconds"
    for extra, says in (({"sync_costs": [[2, -1.0]]}, entry + r".*got \[2, -1.0\]"),
                        ({"sync_costs": [[2.5, 1]]}, entry), ({"sync_costs": [[0, 0]]}, entry),
                        ({"sync_costs": [[True, 1]]}, entry), ({"sync_costs": 3}, "sync_cost"),
                        ({"dtype_bytes": 2.7}, "dtype_bytes must be an integer .*got 2.7"),
                        ({"memory_gb": True}, "memory_gb must be a number, got True")):
        gpu.write_text(json.dumps({**spec, **extra}))
        with pytest.raises(SystemExit, match=re.escape(f"--gpu {gpu}: ") + says):
            main(base + ["--gpu", str(gpu)])
    gpu.write_text("{not json")
    with pytest.raises(SystemExit, match="cannot read it as JSON"):
        main(base + ["--gpu", str(gpu)])
    model = tmp_path / "config.json"
    for data, says in (({"hidden_size": 64}, "none of"),
                       ({"hidden_size": 64, "num_attention_heads": 0, "num_hidden_layers": 2,
                         "vocab_size": 100}, "heads must be a finite number > 0"),
                       ({"hidden_size": 64, "num_attention_heads": 5, "num_hidden_layers": 2,
                         "vocab_size": 100}, "do not divide")):
        model.write_text(json.dumps(data))
        with pytest.raises(SystemExit, match=says):
            main(["plan", "--model", str(model)] + base[3:])
    shape = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 1}
    for key, value in (("num_hidden_layers", True), ("num_hidden_layers", 2.5), ("head_dim", 8.0)):
        model.write_text(json.dumps({**shape, key: value}))
        with pytest.raises(SystemExit, match=re.escape(f"--model {model}: {key} must be an "
                                                       f"integer, got {value!r}")):
            main(["plan", "--model", str(model)] + base[3:])


# --- the cost model against real runs on this machine -------------------------------------------

SMALL = dict(layers=2, hidden=128, heads=4, kv_heads=2, ffn=344, vocab=512)


def _small_spec(shape=SMALL):
    return ModelSpec("small", shape["layers"], shape["hidden"], shape["heads"], shape["kv_heads"],
                     shape["ffn"], shape["vocab"])


def test_runtime_op_counts():
    """FASTLLM's eager op count per decoder layer (forward, backward, optimizer) is what a
    one-process step of examples/parallel_train.py really dispatches: the difference of 1 and 2
    layers, and of 1 and 2 steps (so model building is left out)."""
    from fastllm.bench.probes import count_ops
    from fastllm.parallel.planner import FASTLLM
    from parallel_train import train

    torch.set_num_threads(1)

    def ops(layers, steps):
        shape = dict(SMALL, layers=layers, hidden=64, ffn=160, vocab=128)
        return count_ops(lambda: train(steps=steps, global_batch=2, seq_len=8,
                                        model_kwargs=shape))

    per_layer = (ops(2, 2) - ops(2, 1)) - (ops(1, 2) - ops(1, 1))
    expected = FASTLLM.ops_layer + _small_spec().layer_tensors() * FASTLLM.ops_param
    assert per_layer == pytest.approx(expected, rel=0.05)


@pytest.mark.parametrize("recompute", [False, True])
def test_memory_estimate_matches_peak(recompute):
    """The planner's weights + grads + optimizer state + activations against the peak bytes of
    tensor storage over two real training steps of one process (fastllm.train.memory)."""
    from fastllm.bench.probes import measure_peak_memory
    from parallel_train import train

    torch.set_num_threads(1)
    peak = measure_peak_memory(lambda: train(steps=2, global_batch=4, seq_len=64,
                                             model_kwargs=SMALL,
                                             activation_checkpointing=recompute))
    est = estimate(_small_spec(), Layout(micro_batch=4, recompute=recompute), 64, 4, CPU)
    print("mem", sum(est["memory"].values()), peak)
    assert sum(est["memory"].values()) == pytest.approx(peak, rel=0.10)


@pytest.mark.parametrize("nf4", [False, True])
def test_lora_and_qlora_memory_estimates_match_peak(nf4):
    """LoRA (r=8, every linear layer, as the planner prices it) and QLoRA over the same model:
    the planner's memory against two real steps' tensor peak. QLoRA's estimate may be high by
    up to 15%: it prices one layer's gate and up dequantised at once (fastllm.patch's fused
    path), where the unpatched model here dequantises one weight at a time."""
    from fastllm.bench.probes import measure_peak_memory
    from parallel_train import train

    torch.set_num_threads(1)
    shape = dict(SMALL, hidden=256, ffn=688)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    peak = measure_peak_memory(lambda: train(steps=2, global_batch=4, seq_len=64,
                                             model_kwargs=shape, lora_rank=8, lora_targets=targets,
                                             quantize_base=nf4))
    est = sum(estimate(_small_spec(shape), Layout(micro_batch=4, lora_rank=8, nf4=nf4), 64, 4,
                       CPU)["memory"].values())
    print("mem", nf4, est, peak)
    if nf4:
        assert peak <= est <= 1.15 * peak
    else:
        assert est == pytest.approx(peak, rel=0.10)


@pytest.mark.skipif(os.environ.get("FASTLLM_TIMING_TESTS") != "1", reason=(
    "compares measured step times, so it depends on the machine being quiet (it failed under "
    "load: 0.79 measured against 1.30 predicted); not in the default suite. Run with "
    "FASTLLM_TIMING_TESTS=1 on an idle machine"))
def test_step_time_ratio_against_measured():
    """Two layouts of one process, with and without activation recomputation, timed in the
    same run (alternating steps, medians); the planner on this machine's measured figures
    (bench/probes.py measure_host) must predict their ratio within 25%. A ratio of
    two measurements, not a time limit."""
    import statistics

    from fastllm.bench.probes import machine_spec, measure_host
    from fastllm.parallel.planner import FASTLLM
    from parallel_train import train

    torch.set_num_threads(1)
    shape = dict(SMALL, hidden=256, ffn=688)
    seq, batch = 128, 4
    host = measure_host(shape["hidden"], shape["ffn"], seq * batch)
    spec = machine_spec(host, {2: {"latency": 1e-4, "bus_bandwidth": 1e9, "sync_cost": 0.0}},
                        ranks=1, cores=1)
    times = {False: [], True: []}
    for _ in range(3):
        for rec in (False, True):
            out = train(steps=3, global_batch=batch, seq_len=seq, model_kwargs=shape,
                        activation_checkpointing=rec)
            times[rec] += out["step_times"][1:]
    measured = statistics.median(times[True]) / statistics.median(times[False])
    model = _small_spec(shape)
    est = {rec: estimate(model, Layout(micro_batch=batch, recompute=rec), seq, batch, spec,
                         runtime=FASTLLM)["step_time"] for rec in (False, True)}
    print("ratio", est[True] / est[False], measured)
    assert est[True] / est[False] == pytest.approx(measured, rel=0.25)


# name -> (mesh shape, mesh dims, train() kwargs, planner Layout); "rep" runs two copies
LAYOUTS = {
    "tp2": ((2, 2), ("rep", "tp"), {}, Layout(tp=2, micro_batch=8)),
    "pp2_gpipe": ((2, 2), ("rep", "pp"), {"schedule": "gpipe", "n_microbatches": 4},
                  Layout(pp=2, schedule="gpipe", micro_batch=2)),
    "pp2_1f1b": ((2, 2), ("rep", "pp"), {"schedule": "1f1b", "n_microbatches": 4},
                 Layout(pp=2, schedule="1f1b", micro_batch=2)),
    "dp2_tp2": ((1, 2, 2), ("pp", "dp", "tp"), {}, Layout(dp=2, tp=2, zero=3, micro_batch=4)),
    "pp2_dp2": ((2, 2, 1), ("pp", "dp", "tp"), {"schedule": "1f1b", "n_microbatches": 2},
                Layout(pp=2, dp=2, zero=3, schedule="1f1b", micro_batch=2)),
    "dp4": ((4,), ("dp",), {}, Layout(dp=4, zero=3, micro_batch=2)),
}
LAYOUT_SEQ, LAYOUT_BATCH = 64, 8


def _layout_peaks(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from fastllm.bench.probes import measure_peak_memory
    from parallel_train import train

    peaks = {}
    for name, (shape, dims, kwargs, _) in LAYOUTS.items():
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
        peaks[name] = measure_peak_memory(lambda: train(
            mesh=mesh, steps=2, global_batch=LAYOUT_BATCH, seq_len=LAYOUT_SEQ,
            model_kwargs=SMALL, **kwargs))
    return peaks


@pytest.fixture(scope="module")
def layout_peaks():
    from fastllm.distributed.launch import spawn

    return spawn(_layout_peaks, 4, timeout=300)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_memory_estimate_matches_peak_per_layout(layout_peaks, name):
    """Per GPU: the planner's memory against the highest rank's peak bytes over two steps of
    each layout (one 4-rank Gloo world, spawned once for all layouts)."""
    peak = max(r[name] for r in layout_peaks)
    from fastllm.parallel.planner import FASTLLM

    est = estimate(_small_spec(), LAYOUTS[name][3], LAYOUT_SEQ, LAYOUT_BATCH, CPU, node_size=4,
                   runtime=FASTLLM)
    print("layoutmem", name, sum(est["memory"].values()), [r[name] for r in layout_peaks])
    assert sum(est["memory"].values()) == pytest.approx(peak, rel=0.10)


def test_lora_memory_is_sharded_by_zero_as_full_fine_tuning_is():
    """--lora under ZeRO: optimizer state / dp from stage 1, the adapters' grads from stage 2,
    the frozen weights from stage 3 (with a layer gathered whole); it was priced as no ZeRO."""
    model, gpu = MODELS["llama2-13b"], GPUS["H100"]
    mem = {z: estimate(model, Layout(dp=8, zero=z, lora_rank=16), 4096, 64, gpu)["memory"]
           for z in range(4)}
    assert mem[1]["optimizer"] == pytest.approx(mem[0]["optimizer"] / 8)
    assert mem[2]["grads"] == pytest.approx(mem[0]["grads"] / 8)
    assert mem[3]["weights"] == pytest.approx(mem[0]["weights"] / 8)
    assert 0 < mem[3]["gathered"] < mem[0]["weights"]


def test_lora_counts_the_mlp_the_model_has_and_zero3_gathers_the_frozen_weights():
    """A GPT-2-shaped model has two MLP matrices (LoRA counted a gate it has not: 28% more
    adapter); ZeRO-3 with LoRA gathers the sharded frozen weights every pass (it gathered only
    the adapters and ranked as the fastest layout)."""
    import dataclasses

    from fastllm.parallel.planner.memory import lora_params_per_layer

    llama = MODELS["llama2-7b"]
    gpt = dataclasses.replace(llama, gated_mlp=False)
    h, f, q, kv = llama.hidden, llama.ffn, llama.q_dim, llama.kv_dim
    assert lora_params_per_layer(gpt, 16) == 16 * (2 * (h + q) + 2 * (h + kv) + 2 * (h + f))
    assert lora_params_per_layer(llama, 16) == lora_params_per_layer(gpt, 16) + 16 * (h + f)
    gpu = GPUS["H100"]
    full, lora = (estimate(llama, Layout(dp=8, zero=3, lora_rank=r), 4096, 64, gpu)
                  for r in (0, 16))
    assert lora["time_dp"] > 0.5 * full["time_dp"]


def test_gpu_file_honours_every_key_and_refuses_unknown_ones():
    from fastllm.parallel.planner.catalog import gpu_from_dict

    base = {"memory_gb": 80, "peak_tflops": 989, "hbm_gbps": 3350, "intra_node_gbps": 450,
            "inter_node_gbps": 50}
    gpu = gpu_from_dict(dict(base, latency=0.01, op_overhead=1e-3, cores=4,
                             sync_costs=[[2, 1e-4]]))
    assert (gpu.latency, gpu.op_overhead, gpu.cores, gpu.sync_costs) == (0.01, 1e-3, 4.0,
                                                                         ((2, 1e-4),))
    with pytest.raises(ValueError, match=r"unknown GPU keys \['latncy'\]"):
        gpu_from_dict(dict(base, latncy=0.01))


def test_plans_only_layouts_fastllm_train_runs():
    """fastllm train shards data parallel beside tp or pp with FSDP2: the planner ranked zero1
    layouts there first, which the run it plans does not run."""
    model, gpu = MODELS["llama3-70b"], GPUS["H100"]
    check_layout(model, Layout(dp=2, tp=4, pp=2, zero=3, lora_rank=16), 4096, 64,
                 fastllm_rules=True)
    # data parallel beside tp or pp is FSDP2's in fastllm train: the planner priced zero0/1
    # there (the README's example ranked dp16 tp4 pp8 zero1 first), the run was ZeRO-3
    for zero in (0, 1, 2):
        with pytest.raises(ValueError, match=rf"dp=2 beside tp=4 x pp=2 is FSDP2 \(zero3\) "
                                             rf"in fastllm train, not zero{zero}"):
            check_layout(model, Layout(dp=2, tp=4, pp=2, zero=zero), 4096, 64,
                         fastllm_rules=True)
    check_layout(model, Layout(dp=2, tp=4, pp=2, zero=1), 4096, 64)  # (Megatron's layout)
    best, _ = plan(model, 4096, 64, gpu, 16, lora_rank=16)
    assert best and all(e["layout"].zero == 3 for e in best
                        if e["layout"].dp > 1 and e["layout"].tp * e["layout"].pp > 1)
    best, _ = plan(MODELS["llama2-70b"], 4096, 1024, gpu, 512)
    assert any(e["layout"].pp > 1 and e["layout"].dp > 1 for e in best)
    assert all(e["layout"].zero == 3 for e in best
               if e["layout"].dp > 1 and e["layout"].tp * e["layout"].pp > 1)


def test_a_pipeline_stage_keeps_its_fsdp2_weights_gathered_through_the_step():
    """fastllm train shards a pipeline stage with FSDP2 without resharding after forward
    (torchtitan's policy): one all-gather a step, not one per micro-batch, for the whole
    weights and grads kept all step. The README's 512-GPU example then runs as fast as
    Megatron-LM's ZeRO-1 layout; resharding, it was priced 43% slower (11.89 s a step)."""
    model, gpu = MODELS["llama2-70b"], GPUS["H100"]

    def est(zero):
        return estimate(model, Layout(dp=16, tp=4, pp=8, zero=zero, micro_batch=1), 4096, 1024,
                        gpu)

    fsdp, zero1 = est(3), est(1)
    assert fsdp["step_time"] == pytest.approx(8.309, rel=1e-3)
    assert fsdp["time_dp"] == pytest.approx(zero1["time_dp"], rel=1e-9)
    assert fsdp["tokens_per_s"] == pytest.approx(zero1["tokens_per_s"], rel=1e-9)
    # whole weights and grads as ZeRO-1's, plus the weight shards
    mem, mem1 = fsdp["memory"], zero1["memory"]
    assert mem["weights"] == pytest.approx(mem1["weights"] * (1 + 1 / 16))
    assert mem["grads"] == pytest.approx(mem1["grads"])
    assert mem["optimizer"] == pytest.approx(mem1["optimizer"]) and "gathered" not in mem
