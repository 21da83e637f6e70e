"""The `fastllm` command.

    fastllm bench [--device cpu|cuda] [--full] [--ops adamw,...|all] [--json PATH] [--plot PATH]

Runs each op's benchmark (bench/bench_<op>.py) against PyTorch and the field's best peer in the
same run, with a memory probe timed in the same interleaved rounds, and prints one table: time,
GB/s, % of the ceiling (the probe's or the fastest provider's GB/s), and the ratio to each case's
baseline.
"""

import argparse
import datetime
import importlib
import importlib.util
import json
import os
import shutil
import sys
import textwrap
import time

import torch


def _progress_printer(stream):
    start = time.perf_counter()
    interactive = stream.isatty()

    def progress(message):
        line = f"[{time.perf_counter() - start:6.1f}s] {message}"
        if interactive:
            # a line wider than the terminal wraps, and \r would then rewrite only its last part
            width = shutil.get_terminal_size().columns - 1
            stream.write("\r\033[K" + (line if len(line) <= width else line[:width - 3] + "..."))
        else:
            stream.write(line + "\n")
        stream.flush()

    def done():
        if interactive:
            stream.write("\r\033[K")
            stream.flush()

    return progress, done


def bench(args):
    from fastllm.bench import DEFAULT_OPS, OPS, harness

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("fastllm bench: --device cuda but torch sees no GPU")
    if args.ops is None:
        ops = list(DEFAULT_OPS)
    else:
        ops = list(OPS) if args.ops == "all" else args.ops.split(",")
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        sys.exit(f"fastllm bench: unknown op(s) {unknown}; available: {list(OPS)}")
    # A second run of an op would land in the first one's cases: its rows compared with the
    # other run's baseline and ceiling, which were timed in other rounds.
    repeated = sorted({op for op in ops if ops.count(op) > 1})
    if repeated:
        sys.exit(f"fastllm bench: --ops names {repeated} more than once; each op runs once per "
                 f"table")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):  # known before the benchmarks run, not after
            sys.exit(f"fastllm bench: {flag} {path}: there is no folder {folder}")
        if path and os.path.isdir(path):
            sys.exit(f"fastllm bench: {flag} {path} is a folder; give a file name in it")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        sys.exit("fastllm bench: --plot needs matplotlib (pip install matplotlib)")
    for op in ops:  # a benchmark's own settings (FASTLLM_BENCH_*), checked before any runs
        check = getattr(importlib.import_module(OPS[op]), "settings", None)
        if check is not None:
            check(args.full, args.device)
    progress, done = _progress_printer(sys.stderr)
    rows = []
    for op in ops:
        progress(f"{op}: setting up")
        module = importlib.import_module(OPS[op])
        rows += module.run(device=device, full=args.full, progress=progress)
    done()
    harness.annotate(rows)
    machine = harness.machine_description(device)
    date = datetime.date.today().isoformat()
    print(f"fastllm bench on {device}: {machine}; {date}\n")
    print(harness.format_table(rows))
    print("\n" + textwrap.fill(harness.LEGEND, width=100))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "machine": machine, "date": date, "rows": rows}, f,
                      indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        try:
            harness.plot(rows, args.plot, f"fastllm bench, {machine}, {date}")
        except ImportError:
            sys.exit("fastllm bench: --plot needs matplotlib (pip install matplotlib)")
        print(f"wrote {args.plot}")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="fastllm")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("bench", help="benchmark fastllm's kernels against PyTorch and peers")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--full", action="store_true", help="also run the large sizes")
    p.add_argument("--ops", default=None,
                   help="comma-separated ops, or 'all' (default: the per-kernel benchmarks, "
                        "about a minute; see fastllm.bench.DEFAULT_OPS)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG bar chart")
    # `fastllm train`, `fastllm report` (fastllm/train/cli.py)
    from fastllm.train.cli import add_train_commands

    add_train_commands(sub)
    # `fastllm export`, `fastllm generate` (fastllm/export.py)
    from fastllm.export import add_export_commands

    add_export_commands(sub)
    # `fastllm plan` (fastllm/parallel/planner/)
    from fastllm.parallel.planner.cli import add_plan_arguments, plan_command

    p = sub.add_parser("plan", help="size a dp x tp x pp training run: memory, step time, MFU")
    add_plan_arguments(p)
    p.set_defaults(handler=plan_command)
    args = parser.parse_args(argv)
    if args.command == "bench":
        bench(args)
    elif getattr(args, "handler", None) is not None:  # train, report, export, generate, plan
        args.handler(args)


if __name__ == "__main__":
    main()
