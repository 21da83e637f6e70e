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
import traceback

import torch


class _Progress:
    """progress(message): a status line, rewritten in place on a terminal (each line replaces
    the last); progress.note(message): a line that stays (a provider skipped, an op left out),
    also kept in `notes` for the lines under the table. Benchmarks call the latter as
    harness.note(progress, message)."""

    def __init__(self, stream):
        self.stream = stream
        self.start = time.perf_counter()
        self.interactive = stream.isatty()
        self.notes = []

    def _line(self, message):
        return f"[{time.perf_counter() - self.start:6.1f}s] {message}"

    def __call__(self, message):
        line = self._line(message)
        if self.interactive:
            # a line wider than the terminal wraps, and \r would then rewrite only its last part
            width = shutil.get_terminal_size().columns - 1
            self.stream.write("\r\033[K" + (line if len(line) <= width else
                                             line[:width - 3] + "..."))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def note(self, message):
        self.notes.append(message.strip())
        self.say(message)

    def say(self, message):
        """A line that stays, not listed under the table."""
        # whole and ended: the next progress line starts below it instead of erasing it
        self.stream.write(("\r\033[K" if self.interactive else "") + self._line(message) + "\n")
        self.stream.flush()

    def done(self):
        if self.interactive:
            self.stream.write("\r\033[K")
            self.stream.flush()


def _ops(args, device):
    """(ops to run, the ops `all` leaves out on this device); SystemExit for a name that is not
    an op or is named twice."""
    from fastllm.bench import DEFAULT_OPS, OPS

    if args.ops is None:
        return list(DEFAULT_OPS), []
    if args.ops.strip() == "all":
        # on a GPU, `all` is the ops that run there; each left out is named under the table
        ops = [op for op in OPS if device in getattr(
            importlib.import_module(OPS[op]), "DEVICES", ("cpu", "cuda"))]
        return ops, [op for op in OPS if op not in ops]
    ops = [op.strip() for op in args.ops.split(",")]
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        sys.exit(f"fastllm bench: unknown op(s) {unknown}; available: {list(OPS)}")
    # A second run of an op would land in the first one's cases: its rows compared with the
    # other run's baseline and ceiling, which were timed in other rounds.
    repeated = sorted({op for op in ops if ops.count(op) > 1})
    if repeated:
        sys.exit(f"fastllm bench: --ops names {repeated} more than once; each op runs once per "
                 f"table")
    return ops, []


def _check_paths(args):
    """--json and --plot, checked before any benchmark runs (not after minutes of them)."""
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder and not os.path.isdir(folder):
            sys.exit(f"fastllm bench: {flag} {path}: there is no folder {folder}")
        if path and os.path.isdir(path):
            sys.exit(f"fastllm bench: {flag} {path} is a folder; give a file name in it")
    if args.plot:
        suffix = os.path.splitext(args.plot)[1]
        if suffix and suffix.lower() != ".png":  # a PNG under another format's name
            sys.exit(f"fastllm bench: --plot {args.plot}: the chart is a PNG; name it .png "
                     "(or give no suffix)")
        if importlib.util.find_spec("matplotlib") is None:
            sys.exit("fastllm bench: --plot needs matplotlib (pip install matplotlib)")
    if args.json and args.plot and os.path.realpath(args.json) == os.path.realpath(args.plot):
        sys.exit(f"fastllm bench: --json and --plot both name {args.plot}; the chart would "
                 "overwrite the rows")


def bench(args):
    from fastllm.bench import OPS, harness

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("fastllm bench: --device cuda but torch sees no GPU")
    ops, left_out = _ops(args, device)
    _check_paths(args)
    for op in ops:  # a benchmark's own settings (FASTLLM_BENCH_*), checked before any runs
        check = getattr(importlib.import_module(OPS[op]), "settings", None)
        if check is not None:
            check(args.full, args.device)
    progress = _Progress(sys.stderr)
    if left_out:
        progress.note(f"--ops all on {device} leaves out {', '.join(left_out)} (CPU only)")
    rows, failed = [], []
    for op in ops:
        progress(f"{op}: setting up")
        module = importlib.import_module(OPS[op])
        try:
            rows += module.run(device=device, full=args.full, progress=progress)
        except KeyboardInterrupt:
            failed.append(f"{op}: interrupted; the ops after it did not run")
            break
        except (Exception, SystemExit) as exc:  # one op failing must not lose the others' rows
            progress.done()
            traceback.print_exc()
            failed.append(f"{op}: {type(exc).__name__}: {exc}")
            progress.say(f"{op} FAILED ({type(exc).__name__}: {exc}); going on with the others")
    progress.done()
    harness.annotate(rows)
    machine = harness.machine_description(device)
    date = datetime.date.today().isoformat()
    print(f"fastllm bench on {device}: {machine}; {date}\n")
    print(harness.format_table(rows))
    print("\n" + textwrap.fill(harness.LEGEND, width=100))
    notes = progress.notes
    if notes or failed:
        print()
    for line in [f"note: {n}" for n in notes] + [f"FAILED {f}" for f in failed]:
        print(textwrap.fill(line, width=100, subsequent_indent="    "))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "machine": machine, "date": date, "rows": rows,
                       "notes": notes, "failed": failed}, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        try:
            plotted = harness.plot(rows, args.plot, f"fastllm bench, {machine}, {date}")
        except ImportError:
            sys.exit("fastllm bench: --plot needs matplotlib (pip install matplotlib)")
        print(f"wrote {args.plot}" if plotted else f"no row has a time: {args.plot} not written")
    if failed:
        sys.exit(f"fastllm bench: {len(failed)} op(s) failed: "
                 + "; ".join(f.split(":", 1)[0] for f in failed))
    if not rows:
        sys.exit(f"fastllm bench: no rows: none of {', '.join(ops)} measured anything on "
                 f"{device}")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="fastllm")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("bench", help="benchmark fastllm's kernels against PyTorch and peers")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--full", action="store_true", help="also run the large sizes")
    p.add_argument("--ops", default=None,
                   help="comma-separated ops, or 'all' (on cuda: those that run there) "
                        "(default: the per-kernel benchmarks, about a minute; see "
                        "fastllm.bench.DEFAULT_OPS)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON")
    p.add_argument("--plot", default=None, metavar="PATH",
                   help="write a PNG bar chart (PATH ends in .png or has no suffix)")
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
