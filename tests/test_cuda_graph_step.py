"""A patched model's whole training step (forward with labels, backward, capturable AdamW)
captured in one CUDA graph: nothing on fastllm's GPU path reads the GPU back (the fused loss
keeps ignored tokens in place under capture instead of gathering the valid ones), and each
replay equals an eager step (on a GPU). On a CPU: that GPU path (the Triton backends, under the
interpreter) makes no host read from fastllm's or transformers' Python; the sync-free loss
itself is checked by tests/test_fused_linear_cross_entropy.py (test_sync_free_*).
"""

import copy
import importlib
import os
import sys
import traceback

import pytest
import torch

import fastllm

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

VOCAB = 300


def _model(finetune, device="cuda"):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
        tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device).train()
    if finetune == "lora":
        fastllm.lora.inject_lora(model, ["q_proj", "v_proj"], r=8, alpha=16)
        with torch.no_grad():  # B starts at zero: make the adapters do something
            for _, layer in fastllm.lora.lora_modules(model):
                layer.lora_B.normal_(0, 0.02)
    # (linear=False: on a CPU the patched nn.Linear would first ask the CPU matmul policies)
    return fastllm.patch(model, linear=device == "cuda")


# what reads a tensor's value back to the host (on a GPU: waits for it; refused in a capture)
_READS = ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__")


@pytest.mark.skipif(not os.environ.get("TRITON_INTERPRET"), reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_gpu_path_reads_nothing_back_while_captured(finetune, monkeypatch):
    """The patched step on fastllm's GPU path, run on a CPU: the model ops take their CUDA
    backends (Triton, interpreted), attention is transformers' SDPA (as on a GPU for plain causal
    rows), and the fused loss takes its capture form. No value is read back by fastllm's or
    transformers' Python (a CUDA graph capture would refuse it); the eager loss form does read
    (the spy can fail)."""
    flce = sys.modules["fastllm.ops.fused_linear_cross_entropy"]
    for name in ("rms_norm", "rotary_embedding", "swiglu", "fused_linear_cross_entropy",
                 "lora_linear"):
        preference = importlib.import_module(f"fastllm.ops.{name}")._PREFERENCE
        monkeypatch.setitem(preference, "cpu", preference["cuda"])
    monkeypatch.setattr(fastllm._backend, "_CHOSEN", {})
    monkeypatch.setenv("FASTLLM_CPU_ATTENTION", "torch")
    model = _model(finetune, "cpu")
    ids = torch.randint(0, VOCAB, (2, 16))
    reads = []

    def spy(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            caller = traceback.extract_stack(limit=2)[0].filename
            if "/fastllm/" in caller or "/transformers/" in caller:
                reads.append(f"{name} at {caller}")
            return original(self, *args, **kwargs)
        return read

    for name in _READS:
        monkeypatch.setattr(torch.Tensor, name, spy(name))
    for capturing in (True, False):
        monkeypatch.setattr(flce, "_capturing", lambda t, c=capturing: c)
        reads.clear()
        model(input_ids=ids, labels=ids).loss.backward()
        assert (reads == []) == capturing, reads


@needs_gpu
@pytest.mark.parametrize("finetune,optim_backend", [("full", None), ("lora", None),
                                                    ("full", "triton")])
def test_patched_step_captured_in_a_cuda_graph_matches_eager(finetune, optim_backend):
    """optim_backend "triton": the grads created in the capture are new to the optimizer's
    table cache, so the captured step launches the per-tensor fallback, whose kernel the eager
    step loaded (tensor_table.load_fallback; CUDA refuses a module load during a capture)."""
    graphed = _model(finetune)
    eager = copy.deepcopy(graphed)
    ids = torch.randint(0, VOCAB, (2, 32), device="cuda")
    labels = ids.clone()
    labels[:, :4] = -100  # a prompt: ignored tokens, as SFT masks them
    opts = {m: fastllm.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3,
                                   capturable=True) for m in (graphed, eager)}

    def step(model):
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        with fastllm.use_backend(optim_backend):
            opts[model].step()
        return loss.detach()

    # one eager step each (kernels compiled, optimizer state allocated), grads then None
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(graphed)
        opts[graphed].zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(side)
    step(eager)
    opts[eager].zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(graphed)
    for _ in range(3):
        new = torch.randint(0, VOCAB, ids.shape, device="cuda")
        ids.copy_(new)
        labels.copy_(new)
        labels[:, :4] = -100
        graph.replay()
        want = step(eager)
        opts[eager].zero_grad(set_to_none=True)
        torch.testing.assert_close(captured, want, rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(graphed.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
