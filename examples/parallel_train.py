"""Train a tiny Llama in any dp x tp x pp layout with fastllm.parallel, in one short loop.

    torchrun --nproc_per_node 4 examples/parallel_train.py --dp 2 --tp 2
    torchrun --nproc_per_node 4 examples/parallel_train.py --pp 2 --dp 2 --schedule 1f1b
    torchrun --nproc_per_node 4 examples/parallel_train.py --dp 2 --tp 2 --sequence-parallel
    torchrun --nproc_per_node 4 examples/parallel_train.py --dp 2 --tp 2 --lora-rank 4

The pipeline is built as `fastllm train` builds it (fastllm.parallel.build_pipeline). The tests
(tests/test_parallel.py, tests/test_plan.py) and `fastllm bench --ops parallel` run this loop.

Every layout sees the same global batches (rows split over dp in rank order), so its losses
equal one process's step by step. Prints one line per step on rank 0.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from fastllm.parallel import (
    build_mesh,
    build_pipeline,
    clip_grad_norm_,
    loss_backward,
    mesh_size,
    parallelize,
    vocab_parallel_cross_entropy,
    wrap_activation_checkpointing,
)
from fastllm.train.checkpoint_layout import extras_restored, optimizer_extras

TINY = dict(layers=4, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=128)


def tiny_llama(layers=4, hidden=64, heads=4, kv_heads=2, ffn=160, vocab=128, seed=0,
               dtype=torch.float32):
    """A transformers LlamaForCausalLM with random weights, identical on every rank."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      intermediate_size=ffn, num_hidden_layers=layers, vocab_size=vocab,
                      max_position_embeddings=512, tie_word_embeddings=False,
                      attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).to(dtype)


def make_batches(steps, global_batch, seq_len, vocab, seed=1):
    """[(input_ids, labels)] * steps, each (global_batch, seq_len) int64; labels are shifted.

    Each row counts up by a random stride from a random start (mod vocab), so a model can
    learn it and the loss falls within a few steps.
    """
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        start = torch.randint(0, vocab, (global_batch, 1), generator=g)
        stride = torch.randint(1, 4, (global_batch, 1), generator=g)
        tokens = (start + stride * torch.arange(seq_len + 1)) % vocab
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def train(mesh=None, dp=1, tp=1, pp=1, steps=10, global_batch=8, seq_len=16, lr=3e-3,
          max_norm=1.0, schedule="1f1b", n_microbatches=None, model_kwargs=None,
          optimizer="torch", activation_checkpointing=False, load_dir=None, save_dir=None,
          save_at=None, start_step=0, batch_seed=1, distributed=None, lora_rank=0,
          sequence_parallel=False, quantize_base=False,
          lora_targets=("q_proj", "k_proj", "v_proj", "o_proj")):
    """Train `steps` steps; returns {"losses", "grad_norms", "step_times"} (lists, every rank).

    mesh: a mesh with dims among "pp", "dp", "tp" (default build_mesh(dp, tp, pp)); None and
    world size 1 (or no process group) is one process. load_dir/save_dir: DCP checkpoints
    (model and optimizer, layout-independent names); save_at: the step after which to save.
    start_step: the index of the first batch (for a resumed run). distributed=False runs one
    process even inside a process group. lora_rank > 0: train only fastllm.lora adapters on
    lora_targets (default q/k/v/o; sharded with their projections under tensor parallel).
    quantize_base: QLoRA, every linear layer but the head in 4-bit NF4 first
    (fastllm.quant.quantize_nf4; one process or FSDP2, as fastllm train). sequence_parallel:
    tensor parallel with the norms and residual stream sharded on the sequence. optimizer:
    "torch" or "fastllm" (clipped by fastllm.parallel.clip_grad_norm_), or "fastllm_clip":
    fastllm.optim.AdamW(max_grad_norm=...) clips inside its own step, by the norm it reduces over
    the DTensor shards (no pipeline).
    """
    if distributed is None:
        distributed = dist.is_available() and dist.is_initialized()
    if mesh is None and distributed and dist.get_world_size() > 1:
        mesh = build_mesh(dp, tp, pp)
    pp = mesh_size(mesh, "pp")
    dp = mesh_size(mesh, "dp")
    dp_rank = mesh["dp"].get_local_rank() if dp > 1 else 0
    if global_batch % dp:
        raise ValueError(f"global_batch_size={global_batch} is not divisible by parallel.dp={dp}")
    local_batch = global_batch // dp
    model = tiny_llama(**(model_kwargs or TINY))
    if quantize_base:
        from fastllm.quant import quantize_nf4

        quantize_nf4(model)
    if lora_rank:
        from fastllm.lora import inject_lora

        torch.manual_seed(1234)  # the same adapters on every rank
        inject_lora(model, list(lora_targets), r=lora_rank, alpha=2 * lora_rank)
        for m in model.modules():  # lora_B starts at zero; nonzero makes the test see it
            if hasattr(m, "lora_B"):
                torch.nn.init.normal_(m.lora_B, std=0.02)

    def wrap(module):
        if mesh is not None:
            # (a pipeline stage's FSDP2 keeps its weights gathered through the step, as
            # fastllm train's does)
            parallelize(module, mesh, activation_checkpointing=activation_checkpointing,
                        vocab_parallel_logits=pp == 1, sequence_parallel=sequence_parallel,
                        reshard_after_forward=pp == 1)
        elif activation_checkpointing:
            wrap_activation_checkpointing(module)
        return module

    pipe = None
    if pp > 1:
        n_mb = n_microbatches or pp
        if local_batch % n_mb:
            raise ValueError(f"the per-replica batch ({local_batch} = global_batch_size "
                             f"{global_batch} / dp {dp}) is not divisible by n_microbatches={n_mb}")
        pipe = build_pipeline(model, mesh, n_mb, schedule, seq_len=seq_len, parallelize_fn=wrap,
                              batch_size=local_batch)
        module = pipe.module
    else:
        module = wrap(model)
    params = [p for p in module.parameters() if p.requires_grad]
    if optimizer in ("fastllm", "fastllm_clip"):
        from fastllm.optim import AdamW
        clip_in_step = optimizer == "fastllm_clip"
        if clip_in_step and pp > 1:
            raise ValueError("parallel_train: optimizer='fastllm_clip' reduces the grad "
                             "norm over DTensor shards only, not over pipeline stages")
        opt = AdamW(params, lr=lr, weight_decay=0.1,
                    max_grad_norm=max_norm if clip_in_step else None)
    else:
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.1)

    if load_dir is not None:
        msd, osd = get_state_dict(module, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=load_dir, no_dist=not distributed)
        with extras_restored(opt, _load_extras(load_dir)):
            set_state_dict(module, opt, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])

    batches = make_batches(start_step + steps, global_batch, seq_len, module.config.vocab_size,
                           batch_seed)[start_step:]
    losses, norms, times = [], [], []
    for step, (ids, labels) in enumerate(batches, start=start_step + 1):
        ids = ids[dp_rank * local_batch:(dp_rank + 1) * local_batch]
        labels = labels[dp_rank * local_batch:(dp_rank + 1) * local_batch]
        if distributed:
            dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if pipe is not None:
            mb_losses = pipe.step(ids, labels)
            loss = torch.stack(mb_losses).mean().detach() if pipe.last else torch.zeros(())
            # the last stage owns the loss: sum over pp hands it to every stage
            dist.all_reduce(loss, group=pipe.pp_group)
        else:
            # the root forward, not model.model: FSDP2 gathers the root's parameters in its hook
            out = vocab_parallel_cross_entropy(module(input_ids=ids).logits, labels)
            loss_backward(out)
            loss = (out.full_tensor() if isinstance(out, DTensor) else out).detach()
        if optimizer == "fastllm_clip":
            opt.step()
            norm = opt.grad_norm
        else:
            norm = clip_grad_norm_(params, max_norm,
                                   pp_group=None if pipe is None else pipe.pp_group)
            opt.step()
        if dp > 1:
            dist.all_reduce(loss, group=mesh["dp"].get_group())
            loss = loss / dp
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        norms.append(norm.item())
        if save_dir is not None and step == save_at:
            msd, osd = get_state_dict(module, opt, options=StateDictOptions())
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=save_dir, no_dist=not distributed)
            if not distributed or dist.get_rank() == 0:
                _save_extras(save_dir, optimizer_extras(opt))
    return {"losses": losses, "grad_norms": norms, "step_times": times,
            "skipped_steps": int(getattr(opt, "skipped_steps", 0))}


# DCP's optimizer state holds 'state' and 'param_groups' only: fastllm AdamW's other entries
# (its 'fastllm' skip count, stochastic-rounding seed and call count, loss scaler: plain
# numbers, alike on every rank) go beside it in a JSON file, which loading does not unpickle.
EXTRAS_FILE = "fastllm_extras.json"


def _save_extras(save_dir, extras):
    path = os.path.join(save_dir, EXTRAS_FILE)
    with open(path + ".tmp", "w") as f:  # a crash mid-write leaves the old file whole
        json.dump(extras, f)
    os.replace(path + ".tmp", path)


def _load_extras(load_dir):
    path = os.path.join(load_dir, EXTRAS_FILE)
    if not os.path.exists(path):  # a checkpoint of torch's AdamW, or of before this file
        return {}
    with open(path) as f:
        return json.load(f)


def main(argv=None):
    p = argparse.ArgumentParser(prog="examples/parallel_train.py")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved"])
    p.add_argument("--microbatches", type=int, default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--sequence-parallel", action="store_true",
                   help="shard norms and the residual stream on the sequence under --tp")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="train only LoRA adapters of this rank on q/k/v/o")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        out = train(dp=args.dp, tp=args.tp, pp=args.pp, steps=args.steps,
                    global_batch=args.global_batch, seq_len=args.seq_len,
                    schedule=args.schedule, n_microbatches=args.microbatches,
                    sequence_parallel=args.sequence_parallel, lora_rank=args.lora_rank)
        if dist.get_rank() == 0:
            for i, (loss, norm, t) in enumerate(zip(out["losses"], out["grad_norms"],
                                                    out["step_times"]), 1):
                print(f"step {i:3d}  loss {loss:.6f}  grad_norm {norm:.6f}  {1e3 * t:.1f} ms")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
