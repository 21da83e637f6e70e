"""The `fastllm` command.

    fastllm bench [--device cpu|cuda] [--full] [--ops adamw,...] [--json PATH] [--plot PATH]

Runs each op's benchmark (bench/bench_<op>.py) against PyTorch and the field's best peer in the
same run, measures this machine's memory bandwidth, and prints one table: time, GB/s, % of the
measured copy and read-modify-write bandwidth, and the ratio to each case's baseline.
"""

import argparse
import datetime
import importlib
import json
import sys
import time

import torch


def _progress_printer(stream):
    start = time.perf_counter()
    interactive = stream.isatty()

    def progress(message):
        line = f"[{time.perf_counter() - start:6.1f}s] {message}"
        if interactive:
            stream.write("\r\033[K" + line)
        else:
            stream.write(line + "\n")
        stream.flush()

    def done():
        if interactive:
            stream.write("\r\033[K")
            stream.flush()

    return progress, done


def bench(args):
    from fastllm.bench import OPS, harness

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("fastllm bench: --device cuda but torch sees no GPU")
    ops = list(OPS) if args.ops is None else args.ops.split(",")
    unknown = [op for op in ops if op not in OPS]
    if unknown:
        sys.exit(f"fastllm bench: unknown op(s) {unknown}; available: {list(OPS)}")
    progress, done = _progress_printer(sys.stderr)
    progress(f"measuring memory bandwidth on {device}")
    bandwidth = harness.memory_bandwidth(device)
    rows = []
    for op in ops:
        module = importlib.import_module(OPS[op])
        rows += module.run(device=device, full=args.full, progress=progress)
    done()
    harness.annotate(rows, bandwidth)
    machine = harness.machine_description(device)
    date = datetime.date.today().isoformat()
    print(f"fastllm bench on {device}: {machine}; {date}")
    print(f"measured bandwidth: copy {bandwidth['copy']:.1f} GB/s, "
          f"read-modify-write {bandwidth['rmw']:.1f} GB/s")
    print(harness.format_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": device, "machine": machine, "date": date,
                       "bandwidth_gbps": bandwidth, "rows": rows}, f, indent=1)
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
    p.add_argument("--ops", default=None, help="comma-separated ops (default: all)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG bar chart")
    args = parser.parse_args(argv)
    if args.command == "bench":
        bench(args)


if __name__ == "__main__":
    main()
