"""pytest-benchmark tests of the ops' benchmarks, at small sizes:

    pytest bench/test_benchmarks.py --benchmark-only      (or `make bench-suite`)

They live here, not in bench_<op>.py, because `fastllm bench` imports those modules and must run
after `pip install fastllm[bench]`, which has no pytest.
"""

import pytest
import torch

import fastllm
from fastllm.bench import bench_adamw, bench_adamw_master, bench_lora_linear


@pytest.mark.parametrize("provider", ["fastllm", "torch fused", "torch foreach"])
def test_adamw_step(benchmark, provider):
    params = bench_adamw._params(1 << 20, 8, "cpu")
    opt = {
        "fastllm": lambda: fastllm.optim.AdamW(params),
        "torch fused": lambda: torch.optim.AdamW(params, fused=True),
        "torch foreach": lambda: torch.optim.AdamW(params, foreach=True),
    }[provider]()
    benchmark(opt.step)


@pytest.mark.parametrize("provider", ["fastllm", "torch sequence", "torch sequence, preallocated",
                                      "fastllm pure bf16 + SR"])
def test_adamw_master_step(benchmark, provider):
    m = bench_adamw_master
    params = m._params(1 << 20, 8, "cpu")
    step = {
        "fastllm": lambda: m._fastllm_step(params, master_weights=True),
        "torch sequence": lambda: m.torch_sequence_step(params),
        "torch sequence, preallocated": lambda: m.torch_preallocated_step(params),
        "fastllm pure bf16 + SR": lambda: m._fastllm_step(params, stochastic_rounding=True),
    }[provider]()
    benchmark(step)


@pytest.mark.parametrize("provider", ["fastllm", "peft", "torch frozen linear"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_linear_fwd_bwd(benchmark, provider, dropout):
    layer = bench_lora_linear._layers(256, 256, 16, torch.float32, dropout, "cpu").get(provider)
    if layer is None:
        pytest.skip("peft is not installed")
    x = torch.randn(512, 256, requires_grad=True)
    g = torch.randn(512, 256)
    benchmark(bench_lora_linear._step(layer.train(), x, g))


@pytest.mark.parametrize("provider", ["fastllm", "torch materialised"])
def test_fused_linear_cross_entropy_fwd_bwd(benchmark, provider):
    from fastllm.bench import bench_fused_linear_cross_entropy as m

    hidden = torch.randn(256, 64, requires_grad=True)
    weight = torch.randn(1024, 64, requires_grad=True)
    labels = torch.randint(0, 1024, (256,))
    loss_fn = (fastllm.ops.fused_linear_cross_entropy if provider == "fastllm"
               else m._materialised)
    benchmark(m._step(loss_fn, hidden, weight, labels))
