"""The benchmark harness's logic (not its timings: tests never assert on wall-clock times).

% ceiling is at most 100 by construction, the table fits in 120 columns, the memory probe moves
the bytes it says it moves, `fastllm bench` runs without pytest installed, a DeepSpeed build
is announced before it starts, every provider of a table does the same update and is credited the
bytes of the state it keeps, and an op named twice is refused.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import fastllm
from fastllm.bench import DEFAULT_OPS, OPS, bench_adamw, harness

LONG_PROVIDERS = ["fastllm (cuda) pure bf16 + Kahan", "peft (fp32 adapter, its default)",
                  "torch sequence, preallocated", "deepspeed cpu_adam"]


def _case(op, size, times, nbytes=1 << 30, probe_ms=None, baseline=None):
    rows = [dict(op=op, size=size, provider=name, time_ms=t, bytes=nbytes,
                 baseline=baseline or next(iter(times))) for name, t in times.items()]
    if probe_ms is not None:
        rows.append(dict(op=op, size=size, provider=harness.PROBE, time_ms=probe_ms,
                         bytes=nbytes, baseline=baseline or next(iter(times)), probe=True))
    return rows


@pytest.mark.parametrize("probe_ms", [0.5, 1.0, 3.0, 100.0])
def test_pct_ceiling_never_passes_100(probe_ms):
    # A probe slower than every provider is what drift or a weak probe gives; the fraction must
    # still be at most 100 and exactly 100 for the fastest row.
    gen = torch.Generator().manual_seed(0)
    times = {f"p{i}": 1.0 + 5 * torch.rand((), generator=gen).item() for i in range(5)}
    rows = harness.annotate(_case("adamw", "x", times, probe_ms=probe_ms))
    pcts = [r["pct_ceiling"] for r in rows]
    assert max(pcts) == pytest.approx(100.0)
    assert all(0 < p <= 100.0 + 1e-9 for p in pcts)
    fastest = min(rows, key=lambda r: r["time_ms"])
    assert fastest["pct_ceiling"] == pytest.approx(100.0)
    assert all(r["ceiling_by"] == fastest["provider"] for r in rows)
    for r in rows:
        assert r["pct_ceiling"] == pytest.approx(100.0 * fastest["time_ms"] / r["time_ms"])


def test_pct_ceiling_uses_gbps_when_bytes_differ():
    rows = [dict(op="m", size="s", provider="a", time_ms=1.0, bytes=30),
            dict(op="m", size="s", provider="b", time_ms=1.0, bytes=24),
            dict(op="m", size="s", provider=harness.PROBE, time_ms=1.0, bytes=60, probe=True)]
    harness.annotate(rows)
    assert [r["pct_ceiling"] for r in rows] == pytest.approx([50.0, 40.0, 100.0])


def test_no_ceiling_without_probe_and_ratios_per_case():
    rows = _case("adamw", "small", {"torch fused": 2.0, "fastllm (cpp)": 1.0},
                 baseline="torch fused")
    rows += _case("adamw", "big", {"torch fused": 10.0, "fastllm (cpp)": 20.0}, probe_ms=8.0,
                  baseline="torch fused")
    harness.annotate(rows)
    small = [r for r in rows if r["size"] == "small"]
    assert all("pct_ceiling" not in r for r in small)
    assert [r["ratio_to_baseline"] for r in small] == pytest.approx([1.0, 0.5])
    big = {r["provider"]: r for r in rows if r["size"] == "big"}
    assert big["fastllm (cpp)"]["ratio_to_baseline"] == pytest.approx(2.0)
    assert "ratio_to_baseline" not in big[harness.PROBE]
    assert big[harness.PROBE]["pct_ceiling"] == pytest.approx(100.0)


def _wide_rows():
    rows = []
    lora = "x 8192x4096, W 4096x4096, r=128, bfloat16, dropout 0.1 " * 3
    for op, size in [("adamw_master", "256M bf16 params / 64 tensors, scale+clip"),
                     ("lora_linear", lora)]:
        times = {name: 1000.0 + i for i, name in enumerate(LONG_PROVIDERS)}
        case = _case(op, size, times, nbytes=10**12, probe_ms=1.0)
        for i, r in enumerate(case):
            r["flops"] = 10**15
            r["note"] = f"saved activations {i}.25 MiB, x1.49 vs peft; " * 4
        rows += case
    rows.append(dict(op="x", size="y", provider="p" * 200, time_ms=1.0))
    return harness.annotate(rows)


def test_table_fits_in_120_columns_and_notes_go_below():
    table = harness.format_table(_wide_rows())
    lines = table.splitlines()
    assert max(len(line) for line in lines) <= 120
    header = next(line for line in lines if line.lstrip().startswith("provider"))
    for column in ("time ms", "GB/s", "% ceiling", "TFLOP/s", "x base"):
        assert column in header
    assert "note" not in header
    # each note is printed under its case, after the case's last provider line
    first_note = next(i for i, line in enumerate(lines) if "saved activations" in line)
    assert lines[first_note].startswith("  - ")
    assert "memory probe" in lines[first_note - 1]


def test_table_has_only_the_columns_a_case_has():
    rows = harness.annotate(_case("adamw", "s", {"a": 1.0, "b": 2.0}, baseline="a"))
    header = harness.format_table(rows).splitlines()[1]
    assert header.split() == ["provider", "time", "ms", "GB/s", "x", "base"]


def test_measure_many_interleaves():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abc"}
    timings = harness.measure_many(fns, warmup=1, min_reps=3, max_reps=3, min_time_s=0.0)
    assert calls == list("abc") + list("abc") * 3
    assert {name: t.reps for name, t in timings.items()} == dict.fromkeys("abc", 3)


def test_memory_probe_moves_what_it_says():
    ext = fastllm._extension.extension()
    if ext is None or not hasattr(ext, "stream_probe_cpu"):
        pytest.fail("fastllm._C has no stream_probe_cpu: rebuild it (make build)")
    fn, moved = harness.memory_probe(28 * 1000 + 5, "cpu")
    assert moved == 28 * 1000
    fn()
    # The C++ probe's arithmetic, checked on small arrays (4097 elements: a partial chunk).
    n = 4097
    rw = [torch.randn(n) for _ in range(3)]
    ro = [torch.randn(n)]
    expected = [a * 0.5 + ro[0] for a in rw]
    before_ro = ro[0].clone()
    ext.stream_probe_cpu(rw, ro)
    for a, e in zip(rw, expected):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    assert torch.equal(ro[0], before_ro)
    # the generic pattern (one array read and written, two read)
    a, b, c = torch.randn(7), torch.randn(7), torch.randn(7)
    expected = a * 0.5 + b + c
    ext.stream_probe_cpu([a], [b, c])
    torch.testing.assert_close(a, expected)


def test_memory_probe_refuses_bad_input():
    ext = fastllm._extension.extension()
    if ext is None or not hasattr(ext, "stream_probe_cpu"):
        pytest.fail("fastllm._C has no stream_probe_cpu: rebuild it (make build)")
    with pytest.raises(RuntimeError, match="at least one read_write"):
        ext.stream_probe_cpu([], [torch.zeros(3)])
    with pytest.raises(RuntimeError, match="contiguous fp32 CPU tensors of one size"):
        ext.stream_probe_cpu([torch.zeros(3)], [torch.zeros(4)])
    with pytest.raises(RuntimeError, match="contiguous fp32 CPU tensors of one size"):
        ext.stream_probe_cpu([torch.zeros(3, dtype=torch.float64)], [])
    with pytest.raises(RuntimeError, match="contiguous fp32 CPU tensors of one size"):
        ext.stream_probe_cpu([torch.zeros(3, 2).t()], [])


def test_memory_probe_without_extension(monkeypatch):
    monkeypatch.setattr(fastllm._extension, "extension", lambda: None)
    fn, moved = harness.memory_probe(12 * 50, "cpu")
    assert moved == 12 * 50
    fn()


def test_deepspeed_build_is_announced_before_it_starts(monkeypatch):
    messages = []

    class FakeCPUAdam(torch.optim.AdamW):
        # weight_decay without a default: DeepSpeedCPUAdam's own is 0, the other rows' 0.01
        def __init__(self, params, *, weight_decay, adamw_mode, fp32_optimizer_states):
            # what DeepSpeedCPUAdam does first: build its op (here: check it was announced)
            assert any("building DeepSpeed CPUAdam (first use, ~60 s)" in m for m in messages)
            super().__init__(params, weight_decay=weight_decay)

    monkeypatch.setattr(bench_adamw, "_deepspeed_adam", lambda: FakeCPUAdam)
    monkeypatch.setattr(bench_adamw, "_deepspeed_cpu_adam_built", lambda: False)
    monkeypatch.setattr(bench_adamw, "_DEEPSPEED_ANNOUNCED", False)
    monkeypatch.setattr(bench_adamw, "QUICK", [(1000, 3, False), (10, 1, False)])
    measure_many = harness.measure_many
    monkeypatch.setattr(harness, "measure_many", lambda fns, device: measure_many(
        fns, device=device, warmup=1, min_reps=1, max_reps=1, min_time_s=0.0))
    rows = bench_adamw.run("cpu", progress=messages.append)
    assert sum("DeepSpeed CPUAdam" in m for m in messages) == 1  # once per process
    assert {r["provider"] for r in rows} >= {"deepspeed cpu_adam", harness.PROBE, "torch fused"}
    assert sum(r.get("probe", False) for r in rows) == 2


def test_every_adamw_provider_decays_the_same(monkeypatch):
    """The table compares one update: DeepSpeedCPUAdam (default weight_decay 0) is handed the
    weight decay the fastllm and torch rows use."""
    made = {}

    class FakeCPUAdam(torch.optim.AdamW):
        def __init__(self, params, weight_decay=0.0, **kwargs):
            super().__init__(params, weight_decay=weight_decay)

    monkeypatch.setattr(bench_adamw, "_DEEPSPEED_ANNOUNCED", True)
    params = [torch.nn.Parameter(torch.zeros(3))]
    for name, make, _ in bench_adamw._providers("cpu", False, progress=lambda m: None) + [
            ("deepspeed cpu_adam", bench_adamw._make_deepspeed(FakeCPUAdam, None), None)]:
        made[name] = make(params).defaults["weight_decay"]
    assert set(made) >= {"fastllm (cpp)", "torch fused", "torch foreach", "deepspeed cpu_adam"}
    assert set(made.values()) == {torch.optim.AdamW(params).defaults["weight_decay"]}


def test_adamw8bit_floors_match_the_state_each_row_keeps(monkeypatch):
    """Bytes per param credited to each row of `fastllm bench --ops adamw8bit` (GB/s = bytes /
    time), against the state its optimizer really keeps: the grad read once; the param read and
    written, or with a master only written and the fp32 master read and written; the moments
    read and written (8-bit: uint8 codes and an fp32 absmax per 256). The 8-bit peers keep no
    master, so in the master case they are labelled so and credited their own bytes."""
    from fastllm.bench import bench_adamw8bit

    class FakePeer(torch.optim.AdamW):  # bitsandbytes/torchao AdamW8bit: bf16 params, no master
        pass

    monkeypatch.setattr(bench_adamw8bit, "_peer", lambda module, attr: FakePeer)
    total = 1 << 13  # one tensor of 8192: 8-bit state (min_8bit_size 4096), whole blocks
    monkeypatch.setattr(bench_adamw8bit, "QUICK", [(total, 1, torch.float32, False),
                                                   (total, 1, torch.bfloat16, True)])
    measure_many = harness.measure_many
    monkeypatch.setattr(harness, "measure_many", lambda fns, device, **kw: measure_many(
        fns, device=device, warmup=0, min_reps=1, max_reps=1, min_time_s=0.0))
    rows = bench_adamw8bit.run("cpu", progress=lambda m: None)
    q8 = 16 + 16 / 256
    expected = {
        False: {"fastllm AdamW8bit (cpp)": q8, "fastllm AdamW bf16 state (cpp)": 20,
                "torch fused": 28, "bitsandbytes AdamW8bit": q8, "torchao AdamW8bit": q8},
        True: {"fastllm AdamW8bit (cpp)": q8, "fastllm AdamW bf16 state (cpp)": 20,
               "fastllm AdamW fp32 state, master": 28,
               "bitsandbytes AdamW8bit (no masters)": 10 + 16 / 256,
               "torchao AdamW8bit (no masters)": 10 + 16 / 256}}
    for master, want in expected.items():
        case = {r["provider"]: r for r in rows if ("master" in r["size"]) == master}
        probe = case.pop(harness.PROBE)
        assert {name: r["bytes"] / total for name, r in case.items()} == want
        # the probe streams the 8-bit step's bytes (to its 20-byte element)
        assert 0 <= case["fastllm AdamW8bit (cpp)"]["bytes"] - probe["bytes"] < 20
    # what the byte counts assume, read off the optimizers' state
    p = torch.nn.Parameter(torch.zeros(total, dtype=torch.bfloat16))
    p.grad = torch.ones_like(p)
    for make, per_param in ((lambda: fastllm.optim.AdamW8bit([p], master_weights=True),
                             4 + 2 + 8 / 256),
                            (lambda: fastllm.optim.AdamW([p], state_dtype=torch.bfloat16,
                                                         master_weights=True), 4 + 4),
                            (lambda: fastllm.optim.AdamW([p], master_weights=True), 4 + 8)):
        opt = make()
        opt.step()
        state = sum(t.numel() * t.element_size() for t in opt.state[p].values()
                    if isinstance(t, torch.Tensor) and t.dim())
        assert state / total == per_param


def test_bench_refuses_an_op_named_twice(monkeypatch):
    # two runs of one op in one table: their rows would share a case, its baseline and ceiling
    from fastllm import cli

    monkeypatch.setattr(bench_adamw, "run", lambda **kw: pytest.fail("an op ran"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--ops", "adamw,adamw_master,adamw"])
    assert "['adamw'] more than once" in str(exit_info.value.code)


def test_bench_refuses_a_json_path_that_is_a_folder_before_running(monkeypatch, tmp_path):
    """--json DIR passed the up-front check (its parent exists), ran every benchmark, then
    failed to open DIR for writing: the results were lost."""
    from fastllm import cli

    monkeypatch.setattr(bench_adamw, "run", lambda **kw: pytest.fail("an op ran"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--ops", "adamw", "--json", str(tmp_path)])
    assert "is a folder" in str(exit_info.value.code)


def test_bench_parallel_needs_the_source_trees_example_before_anything_runs(monkeypatch):
    """A wheel install has no examples/: `--ops all` ran four benchmarks, then failed at
    parallel's example and lost their rows."""
    from fastllm import cli
    from fastllm.bench import harness

    monkeypatch.setattr(bench_adamw, "run", lambda **kw: pytest.fail("an op ran"))
    monkeypatch.setattr(harness.os.path, "isfile", lambda path: False)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "--ops", "adamw,parallel"])
    assert "examples/parallel_train.py" in str(exit_info.value.code)


# Run in a fresh interpreter in which pytest cannot be imported, as after
# `pip install fastllm[bench]`: every module in OPS imports, and `fastllm bench` runs end to end
# (at tiny sizes) for the ops this file knows how to shrink.
_NO_PYTEST = textwrap.dedent("""
    import json, sys
    for name in ("pytest", "_pytest", "pytest_benchmark"):
        sys.modules[name] = None
    import importlib
    import torch
    torch.set_num_threads(1)
    from fastllm.bench import OPS, harness
    for module in OPS.values():
        importlib.import_module(module)
    from fastllm.bench import bench_adamw, bench_adamw_master, bench_lora_linear
    bench_adamw.QUICK = [(1000, 3, False)]
    bench_adamw._deepspeed_adam = lambda: None
    bench_adamw_master.QUICK = [(1000, 3)]
    bench_lora_linear.QUICK = [(8, 16, 24, 4, torch.float32, 0.1)]
    measure_many = harness.measure_many
    harness.measure_many = lambda fns, device, **kw: measure_many(
        fns, device=device, warmup=1, min_reps=2, max_reps=2, min_time_s=0.0)
    from fastllm import cli
    cli.main(["bench", "--ops", "adamw,adamw_master,lora_linear", "--json", sys.argv[1]])
""")


def test_fastllm_bench_runs_without_pytest(tmp_path):
    out = tmp_path / "rows.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _NO_PYTEST, str(out)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "memory bandwidth" not in proc.stderr
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines if not line.startswith("fastllm bench on")) <= 120
    rows = json.loads(out.read_text())["rows"]
    assert {r["op"] for r in rows} == {"adamw", "adamw_master", "lora_linear"}
    with_ceiling = [r for r in rows if "pct_ceiling" in r]
    assert {r["op"] for r in with_ceiling} == {"adamw", "adamw_master"}
    assert all(r["pct_ceiling"] <= 100.0 + 1e-9 for r in with_ceiling)
    assert set(DEFAULT_OPS) <= set(OPS)


def test_device_bench_packed_attention_smoke():
    # bench/device_bench.py's packed-attention case at its --smoke sizes on the CPU: its three
    # providers, the two with the same work rated in TFLOP/s against the masked SDPA
    from fastllm.bench import device_bench

    rows = []
    device_bench.packed("cpu", 64, rows)
    harness.annotate(rows)
    by = {r["provider"]: r for r in rows}
    assert set(by) == {"torch sdpa + document mask", "fastllm", "torch sdpa causal, no documents"}
    assert all(r["time_ms"] > 0 and r["op"] == "attention (packed)" for r in rows)
    assert by["fastllm"]["tflops"] > 0 and "tflops" not in by["torch sdpa causal, no documents"]
    assert by["fastllm"]["ratio_to_baseline"] > 0


def test_device_bench_qlora_case_smoke():
    # bench/device_bench.py's qlora case at its --smoke sizes on the CPU: the dequantisation
    # rated in GB/s against a copy of its output, and QLoRA's forward + backward beside the
    # frozen GEMM and LoRA on the dense weight
    from fastllm.bench import device_bench

    rows = []
    device_bench.qlora("cpu", 64, rows)
    harness.annotate(rows)
    by = {(r["op"], r["provider"]): r for r in rows}
    assert by[("nf4_dequantize", "fastllm")]["gbps"] > 0
    assert by[("nf4_dequantize", "fastllm")]["ratio_to_baseline"] > 0
    lora = {p for op, p in by if op == "qlora_linear"}
    assert {"torch frozen linear", "fastllm LoRA (dense bf16 base)",
            "fastllm QLoRA (NF4 base)"} <= lora
    assert all(r["time_ms"] > 0 and (r["op"] != "qlora_linear" or r["tflops"] > 0)
               for r in rows)


def test_device_bench_model_case_smoke():
    # bench/device_bench.py's model case (issue 19) at its --smoke sizes on the CPU: a row per op
    # and provider, both training steps with the same first loss on every side, and Liger-Kernel
    # reported as left out (it runs on a GPU only).
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from fastllm.bench import device_bench

    rows = []
    device_bench.model("cpu", 64, rows)
    harness.annotate(rows)
    ops = ["rms_norm", "rotary_embedding", "swiglu", "geglu", "fused_linear_cross_entropy",
           "token_logps"]
    assert list(dict.fromkeys(r["op"] for r in rows)) == [f"model/{op}" for op in ops] + [
        "model step"]
    for r in rows:
        if r["provider"].startswith(("liger-kernel", "HF + Liger-Kernel")):
            assert r["time_ms"] is None and r["note"]
        else:
            assert r["time_ms"] > 0
    for op in ops:
        providers = {r["provider"] for r in rows if r["op"] == f"model/{op}"}
        assert {"fastllm (cpp)", "torch eager", "liger-kernel"} <= providers
    steps = {}
    for r in rows:
        if r["op"] == "model step":
            finetune = "lora" if ", lora r=16 on q/v," in r["size"] else "full"
            if r["size"].endswith(", the torch.compile part"):
                finetune = "compiled"
            steps.setdefault(finetune, {})[r["provider"]] = r
    # (the compiled part: each decoder layer through dynamo and AOTAutograd on the CPU)
    for finetune, hf in (("full", "HF"), ("lora", "HF + PEFT"), ("compiled", "HF")):
        case = steps[finetune]
        peft = " + PEFT" if finetune == "lora" else ""
        mine = {"fastllm"} | ({device_bench.COMPILED} if finetune == "compiled" else set())
        assert set(case) == mine | {hf, "HF + Liger-Kernel" + peft}
        for name in mine:
            assert case[name]["first_loss"] == pytest.approx(case[hf]["first_loss"], rel=1e-3)
            assert case[name]["ratio_to_baseline"] > 0


def test_device_bench_graph_keeps_what_it_captured(monkeypatch):
    # A CUDA graph holds no reference to the tensors it replays on: device_bench's replay callable
    # must keep the captured step (its optimizer, params and state) alive, or the next case's
    # allocations reuse that memory under the graph. CUDA's graph API faked on the CPU.
    import contextlib
    import gc
    import weakref

    from fastllm.bench import device_bench

    class Fake:
        def __init__(self, *args, **kwargs):
            self.replays = 0

        def wait_stream(self, other):
            pass

        def replay(self):
            self.replays += 1

    monkeypatch.setattr(torch.cuda, "Stream", Fake)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: Fake())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Fake)
    monkeypatch.setattr(torch.cuda, "graph", lambda g, **k: contextlib.nullcontext())
    held = []

    def make_step():
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-3)
        held.append(weakref.ref(opt))
        return opt.step

    replay = device_bench._graphed(make_step, "cuda")
    gc.collect()
    assert held[0]() is not None, "the optimizer the graph replays on was freed"
    replay()


def test_device_bench_keeps_a_case_whose_baseline_failed():
    # On the GPU a provider that raises becomes a FAILED row (time None) instead of losing the
    # case; the other rows, whose baseline it may be, are still annotated and tabled.
    from fastllm.bench import device_bench

    note = device_bench._failure("torch eager", RuntimeError("boom"), "cuda", ("liger-kernel",))
    assert note.startswith("FAILED: RuntimeError: boom")
    with pytest.raises(RuntimeError, match="boom"):  # off the GPU (CI's smoke run) it raises
        device_bench._failure("torch eager", RuntimeError("boom"), "cpu", ("liger-kernel",))
    rows = [dict(op="model/swiglu", size="s", provider="fastllm", time_ms=2.0, bytes=4e6,
                 baseline="torch eager"),
            dict(op="model/swiglu", size="s", provider="torch eager", time_ms=None, note=note)]
    harness.annotate(rows)
    assert rows[0]["gbps"] == pytest.approx(2.0) and "ratio_to_baseline" not in rows[0]
    assert "FAILED" in harness.format_table(rows)


def test_host_bench_model_op_peers_compute_the_same_maths():
    """`fastllm bench --ops host` times each model op against torch eager code of the same maths:
    the two give the same result (a peer of other maths would make the comparison meaningless)."""
    from fastllm.bench import bench_host

    for op, (ours, theirs) in bench_host.model_op_pairs().items():
        torch.testing.assert_close(ours().float(), theirs().float(), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, op=op: f"{op}: {m}")


def test_host_bench_gpu_path_runs_the_triton_kernels():
    """bench/host_gpu_path.py (the GPU path's host work, Triton launches stubbed) times what it
    says: each model op's fastllm side and the patched step launch their Triton kernels (a
    preference left on cpp would launch none), one forward launch per RMSNorm, rotary and
    SwiGLU of the 30 layers (+ the final norm), and with LoRA's frozen base no weight-grad
    work for the frozen norms."""
    for module in ("transformers", "peft", "triton"):
        pytest.importorskip(module)
    from fastllm.bench.bench_host import gpu_path_env

    command = [sys.executable, "-m", "fastllm.bench.host_gpu_path", "--launches"]
    # (`fastllm bench --ops host` run by hand, without TRITON_INTERPRET=1: the module set it
    # after `python -m` had imported fastllm, and the ops ran their reference, no launch)
    bare = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=bare)
    assert done.returncode != 0 and "TRITON_INTERPRET=1" in done.stderr, done.stderr[-3000:]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env=gpu_path_env(bare))
    assert done.returncode == 0, done.stderr[-3000:]
    # (and the parent's environment is left alone: the benchmarks after `host` in one `fastllm
    # bench` run read FASTLLM_CPU_ATTENTION / FASTLLM_CPU_FP32_MATMUL at each call)
    assert "fastllm.bench.host_gpu_path" not in sys.modules
    assert os.environ.get("FASTLLM_CPU_FP32_MATMUL") == bare.get("FASTLLM_CPU_FP32_MATMUL")
    counts = json.loads(done.stdout)
    for op in ("rms_norm", "rotary_embedding", "swiglu", "lora_linear",
               "fused_linear_cross_entropy"):
        (ours,) = [v for k, v in counts.items() if k.startswith(op + " ")]
        assert sum(ours.values()) >= 1, (op, ours)
    step = counts["step full"]
    assert step["_rms_norm_fwd_kernel"] == 61 and step["_rotary_kernel"] == 60
    # down_proj's weight grad reads the SwiGLU product from the backward kernel's pass: no
    # second forward launch per layer to recompute it
    assert step["_swiglu_fwd_kernel"] == 30 and step["_swiglu_bwd_kernel"] == 30
    assert step["_flce_row_kernel"] >= 1
    # LoRA (frozen base): no dweight work for the norms
    lora = counts["step lora"]
    assert "_rms_norm_dw_kernel" not in lora and lora["_swiglu_bwd_kernel"] == 30, lora


def test_host_side_grid_arithmetic_matches_triton():
    """fastllm.kernels.cdiv / next_power_of_2 (plain Python for the launchers) compute what
    triton.cdiv / triton.next_power_of_2 do."""
    triton = pytest.importorskip("triton")
    from fastllm.kernels import cdiv, next_power_of_2

    for n in list(range(0, 300)) + [65535, 65536, 65537, 2**31 + 1000]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for b in (1, 2, 3, 16, 1024):
            assert cdiv(n, b) == triton.cdiv(n, b), (n, b)


def test_cli_refuses_bad_settings_before_any_benchmark_runs(monkeypatch, tmp_path):
    """A typo in FASTLLM_BENCH_* or an unwritable --json was found after the benchmarks had run
    (minutes), or never: now before the first one starts."""
    from fastllm import cli
    from fastllm.bench import bench_model

    ran = []
    monkeypatch.setattr(bench_model, "run", lambda **kw: ran.append(kw) or [])
    for env, args, message in (
            ({"FASTLLM_BENCH_FAMILY": "qwen"}, [], "use smollm2, qwen3, gemma3 or phi4mini"),
            ({"FASTLLM_BENCH_LAYERS": "four"}, [], "an integer >= 1"),
            ({}, ["--json", str(tmp_path / "missing" / "rows.json")], "there is no folder"),
            # a name twice ran its cases twice into one table, each against the last baseline
            ({"FASTLLM_BENCH_DTYPES": "fp32,fp32"}, [], "use fp32, bf16 or fp32,bf16"),
            ({"FASTLLM_BENCH_FINETUNES": "full,full"}, [], "use lora, full or lora,full")):
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            with pytest.raises(SystemExit, match=message):
                cli.main(["bench", "--ops", "model", *args])
    assert ran == []
    # --device cuda: refused by the model benchmark's settings, before the others ran (their
    # results were thrown away)
    with pytest.raises(SystemExit, match="the CPU benchmark"):
        bench_model.settings(False, "cuda")


def test_generate_refuses_out_of_range_arguments(capsys):
    from fastllm import cli

    for args in (["--max-new-tokens", "0"], ["--do-sample", "--temperature", "0"],
                 ["--top-p", "5"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(["generate", "no-such-model", "hi", *args])
        assert exc.value.code == 2  # argparse's usage error, before any model is loaded
        assert "must be" in capsys.readouterr().err


def test_export_and_generate_name_a_missing_folder(tmp_path, monkeypatch):
    import transformers

    from fastllm import cli

    with pytest.raises(SystemExit, match="no such run folder"):
        cli.main(["export", str(tmp_path / "nope"), str(tmp_path / "out")])

    def asks_the_hub(*args, **kwargs):  # (offline: five retries, 30 s, before the same error)
        raise AssertionError("from_pretrained of a model neither here nor in the cache")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", asks_the_hub)
    for name in (str(tmp_path / "nope"), "no-such-model", "org/no-such-model"):
        with pytest.raises(SystemExit, match="is not a folder"):
            cli.main(["generate", name, "hi"])
