"""`fastllm bench`'s checks and reports, the benchmarks stubbed (seconds, not minutes; no test
asserts on a time): settings refused before anything runs, one op failing keeps the other ops'
rows, plot and JSON paths, CUDA-only and CPU-only ops, notes that stay on a terminal, and the
byte accounting of the compression and device benchmarks."""

import json
import subprocess

import pytest
import torch

from fastllm.bench import OPS, bench_adamw, harness


def _stub_runs(monkeypatch, rows_by_op, fail=()):
    """Every op's run() replaced: rows_by_op[op] -> its rows, an op in `fail` raises, any other
    op fails the test if it runs. Returns the list of ops that ran."""
    import importlib

    from fastllm.bench import OPS

    ran = []

    def stub(op):
        def run(device="cpu", full=False, progress=print):
            if op not in rows_by_op and op not in fail:
                pytest.fail(f"{op} ran")
            ran.append(op)
            if op in fail:
                raise RuntimeError(f"{op} broke")
            return [dict(r) for r in rows_by_op[op]]

        return run

    for op, module in OPS.items():
        monkeypatch.setattr(importlib.import_module(module), "run", stub(op))
    return ran


def _row(op, provider="p", time_ms=1.0):
    return dict(op=op, size="s", provider=provider, time_ms=time_ms)


def test_bench_keeps_the_rows_of_the_other_ops_when_one_fails(monkeypatch, tmp_path, capsys):
    from fastllm import cli

    ran = _stub_runs(monkeypatch, {"adamw": [_row("adamw")], "lora_linear": [_row("lora_linear")]},
                     fail=("adamw_master",))
    out = tmp_path / "rows.json"
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--ops", "adamw,adamw_master,lora_linear", "--json", str(out)])
    assert "1 op(s) failed: adamw_master" in str(exc.value.code)
    assert ran == ["adamw", "adamw_master", "lora_linear"]
    saved = json.loads(out.read_text())
    assert [r["op"] for r in saved["rows"]] == ["adamw", "lora_linear"]
    assert saved["failed"] == ["adamw_master: RuntimeError: adamw_master broke"]
    stdout = capsys.readouterr().out
    assert "adamw: s" in stdout and "lora_linear: s" in stdout
    assert "FAILED adamw_master: RuntimeError" in stdout


def test_bench_model_checks_its_model_folder_up_front(monkeypatch, tmp_path):
    from fastllm.bench import bench_model

    folder = tmp_path / "tiny"
    folder.mkdir()
    monkeypatch.setenv("FASTLLM_BENCH_MODEL", str(tmp_path / "missing"))
    with pytest.raises(SystemExit, match="there is no such folder"):
        bench_model.settings()
    monkeypatch.setenv("FASTLLM_BENCH_MODEL", str(folder))
    with pytest.raises(SystemExit, match="readable config.json"):
        bench_model.settings()
    (folder / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    with pytest.raises(SystemExit, match="has 2 layers, 4 asked"):
        bench_model.settings()  # the quick run's 4 layers
    monkeypatch.setenv("FASTLLM_BENCH_LAYERS", "2")
    assert bench_model.settings()[0] == 2
    monkeypatch.setenv("FASTLLM_BENCH_FAMILY", "qwen3")
    with pytest.raises(SystemExit, match="set one of them, not both"):
        bench_model.settings()
    # through the CLI: before any op runs
    _stub_runs(monkeypatch, {})
    with pytest.raises(SystemExit, match="set one of them"):
        from fastllm import cli

        cli.main(["bench", "--ops", "adamw,model"])


def test_bench_model_labels_the_step_with_the_folder_it_ran(monkeypatch, tmp_path):
    transformers = pytest.importorskip("transformers")
    from fastllm.bench import bench_model

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "tiny-llama")
    monkeypatch.setenv("FASTLLM_BENCH_MODEL", str(tmp_path / "tiny-llama"))
    model, what = bench_model._model(2, torch.float32)
    assert len(model.model.layers) == model.config.num_hidden_layers == 2
    assert what == "tiny-llama weights (hidden 32, 4/2 heads, ffn 64, vocab 256), 2 of 3 layers"
    monkeypatch.delenv("FASTLLM_BENCH_MODEL")
    assert bench_model._model(1, torch.float32)[1] == "SmolLM2-135M shape (random init), 1 layers"


@pytest.mark.parametrize("name", ["FASTLLM_BENCH_PROFILE_MAX_S", "FASTLLM_BENCH_SLOW_S"])
def test_bench_model_checks_its_time_limits(monkeypatch, name):
    from fastllm.bench import bench_model

    for bad in ("ten", "nan", "inf", "-1"):
        monkeypatch.setenv(name, bad)
        with pytest.raises(SystemExit, match=f"{name}={bad}: a finite number of seconds >= 0"):
            bench_model.settings()
    monkeypatch.setenv(name, "0")
    bench_model.settings()
    assert 0.0 in bench_model._time_limits()


def test_plot_leaves_out_rows_without_a_time(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    from fastllm.bench import bench_train

    # bench_train's own rows without a time: memory figures, and its 2-process run failing
    monkeypatch.setattr(bench_train, "_train", lambda overrides, cache: {"peak_mem_bytes": 2**20})
    monkeypatch.setattr(bench_train.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 1, b"", b"torchrun: no"))
    untimed = (bench_train._activation_memory("cpu", print, str(tmp_path))
               + bench_train._time_split(print, str(tmp_path)))
    assert untimed and all("time_ms" not in r for r in untimed)
    rows = [_row("train", "fastllm train"), _row("train", "torch loop", 2.0), *untimed,
            dict(op="model/swiglu", size="s", provider="liger", time_ms=None)]
    path = tmp_path / "chart"
    assert harness.plot(rows, str(path), "t") == 1
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # at the path given, as a PNG
    empty = tmp_path / "none.png"
    assert harness.plot(untimed, str(empty), "t") == 0 and not empty.exists()


def test_bench_checks_plot_and_json_paths_up_front(monkeypatch, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from fastllm import cli

    _stub_runs(monkeypatch, {})
    for args, message in ((["--plot", str(tmp_path / "chart.svg")], "the chart is a PNG"),
                          (["--json", str(tmp_path / "x.png"), "--plot", str(tmp_path / "x.png")],
                           "--json and --plot both name")):
        with pytest.raises(SystemExit, match=message):
            cli.main(["bench", "--ops", "adamw", *args])
    _stub_runs(monkeypatch, {"adamw": [_row("adamw")]})
    cli.main(["bench", "--ops", "adamw", "--plot", str(tmp_path / "chart")])
    assert (tmp_path / "chart").read_bytes()[:4] == b"\x89PNG"
    assert f"wrote {tmp_path / 'chart'}" in capsys.readouterr().out


def test_bench_on_cuda_refuses_cpu_only_ops_and_all_runs_the_others(monkeypatch, capsys):
    from fastllm import cli
    from fastllm.bench import bench_host, bench_parallel

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a faked GPU")
    for op in ("host", "parallel"):
        with pytest.raises(SystemExit, match="run it with --device cpu"):
            cli.main(["bench", "--device", "cuda", "--ops", op])
    with pytest.raises(SystemExit, match="run it with --device cpu"):
        bench_host.run("cuda")
    with pytest.raises(SystemExit, match="run it with --device cpu"):
        bench_parallel.settings(False, "cuda")
    cpu_only = ["parallel", "distributed", "compression", "host", "model", "gemm"]
    gpu = [op for op in OPS if op not in cpu_only]
    ran = _stub_runs(monkeypatch, {op: [] for op in gpu})
    with pytest.raises(SystemExit, match="no rows"):  # every op ran and measured nothing
        cli.main(["bench", "--device", "cuda", "--ops", "all"])
    assert ran == gpu
    assert f"note: --ops all on cuda leaves out {', '.join(cpu_only)}" in capsys.readouterr().out


def test_bench_ops_may_have_spaces(monkeypatch):
    from fastllm import cli

    ran = _stub_runs(monkeypatch, {"adamw": [_row("adamw")], "lora_linear": [_row("lora")]})
    cli.main(["bench", "--ops", "adamw, lora_linear "])
    assert ran == ["adamw", "lora_linear"]


def test_a_skipped_provider_stays_on_a_terminal_and_under_the_table(monkeypatch, capsys):
    import io

    from fastllm import cli

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    screen = Terminal()
    progress = cli._Progress(screen)
    progress("adamw: setting up")
    harness.note(progress, "adamw s: skipped peer: no ninja")
    progress("adamw s: fastllm (cpp), torch fused (interleaved)")
    # the note's line is ended: the next progress line's \r\033[K erases a fresh line, not it
    assert "skipped peer: no ninja\n\r\033[K" in screen.getvalue()
    assert progress.notes == ["adamw s: skipped peer: no ninja"]
    messages = []
    harness.note(messages.append, "plain")  # any progress callable
    assert messages == ["plain"]

    # a DeepSpeed CPUAdam that fails to build, through the CLI (as repro_tty_skip.py)
    class Broken:
        def __init__(self, *a, **k):
            raise RuntimeError("cpu_adam op failed to build")

    monkeypatch.setattr(bench_adamw, "_deepspeed_adam", lambda: Broken)
    monkeypatch.setattr(bench_adamw, "_DEEPSPEED_ANNOUNCED", True)
    monkeypatch.setattr(bench_adamw, "QUICK", [(1000, 3, False)])
    measure_many = harness.measure_many
    monkeypatch.setattr(harness, "measure_many", lambda fns, device="cpu", **kw: measure_many(
        fns, device=device, warmup=0, min_reps=1, max_reps=1, min_time_s=0.0))
    cli.main(["bench", "--ops", "adamw"])
    out = capsys.readouterr().out
    assert "note: adamw" in out and "skipped deepspeed cpu_adam: cpu_adam op failed" in out


def test_compression_counts_ring_wire_bytes_for_both_zero2_rows(monkeypatch):
    import fastllm.distributed.launch
    from fastllm.bench import bench_compression, bench_distributed

    numel, sent, distopt_sent = 1 << 20, 1 << 12, 1 << 13
    result = dict(times={"fastllm powersgd_hook": [1.0], "torch powerSGD_hook": [1.0],
                         "dense all-reduce": [1.0]}, sent=sent, numel=numel,
                  distopt_times={"fastllm DistributedOptimizer ZeRO-2": [1.0],
                                 "fastllm DistributedOptimizer ZeRO-2 + PowerSGD": [1.0]},
                  distopt_sent=distopt_sent)
    monkeypatch.setattr(fastllm.distributed.launch, "spawn", lambda *a, **k: [result])
    rows = {r["provider"]: r["note"] for r in bench_compression._powersgd_rows(False, print)}
    w = bench_compression.WORLD
    kib = lambda n: f"{n / 2**10:.0f} KiB"  # noqa: E731
    assert kib(numel * 4 * (w - 1) / w) in rows["fastllm DistributedOptimizer ZeRO-2"]
    assert kib(distopt_sent * 4 * 2 * (w - 1) / w) in rows[
        "fastllm DistributedOptimizer ZeRO-2 + PowerSGD"]
    assert "dense reference" in rows["dense all-reduce"] and "1x" not in rows["dense all-reduce"]
    assert f"{numel // sent}x fewer than dense" in rows["fastllm powersgd_hook"]
    # distributed's accounting, from the same formula
    s = (bench_distributed.WORLD - 1) / bench_distributed.WORLD
    assert bench_distributed._wire_bytes("DistributedOptimizer stage 2", 10) == 2 * s * 40
    assert bench_distributed._wire_bytes("DDP + torch AdamW (fused)", 10) == 2 * s * 40
    assert bench_distributed._wire_bytes("DistributedOptimizer stage 1", 10) == 3 * s * 40
    assert bench_distributed.wire_bytes("reduce_scatter", 40) == s * 40


def test_device_bench_input_sets_rotate_only_their_own_bytes(monkeypatch):
    from fastllm.bench import device_bench

    shared = torch.zeros(1000)  # 4000 B in every set (a weight): not rotated
    monkeypatch.setattr(device_bench, "ROTATE_BYTES", 4 * 400 * 3)
    sets = device_bench._input_sets(lambda: ([torch.zeros(400), shared], [], []), "cuda")
    assert len(sets) == 3  # 3 sets of 1600 own bytes (the shared weight counted: 2)
    assert len(device_bench._input_sets(lambda: ([shared], [], []), "cpu")) == 2
