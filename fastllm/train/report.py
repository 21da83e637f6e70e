"""`fastllm report RUN_DIR`: loss, learning rate, throughput and the per-step time split of a
run (its metrics.jsonl) drawn to one PNG, and the run's summary table printed."""

import os
import sys

from fastllm.train.metrics import format_summary, read_metrics, summarize

__all__ = ["report"]

_SPLIT = (("data_wait_s", "data wait"), ("fwd_bwd_s", "forward+backward"),
          ("bubble_s", "pipeline bubble"), ("comm_s", "exposed comm"), ("optim_s", "optimizer"))


def report(run_dir, out=None):
    """Write the PNG (default RUN_DIR/report.png), print the summary; returns the PNG's path
    (None without matplotlib: then only the summary and the table are printed, and why)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist (is {run_dir} a fastllm train output_dir?)")
    records = read_metrics(path)
    if not records:
        raise ValueError(f"{path} holds no steps")
    try:
        import matplotlib
    except ImportError:
        _print_table(records, run_dir)
        print("fastllm report: matplotlib is not installed (pip install matplotlib), so no PNG "
              "was written; the table above has the numbers", file=sys.stderr)
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    ax = axes[0][0]
    ax.plot(steps, [r["loss"] if not r["skipped"] else float("nan") for r in records])
    skipped = [r["step"] for r in records if r["skipped"]]
    if skipped:
        ax.scatter(skipped, [0] * len(skipped), marker="x", color="red", label="skipped")
        ax.legend()
    from fastllm.train.evaluate import read_eval

    evals = read_eval(path)
    if evals:  # held-out loss of SFT runs (fastllm.train.evaluate)
        ax.plot([e["eval_step"] for e in evals], [e["eval_loss"] for e in evals], marker="o",
                label="eval")
        ax.legend()
    ax.set(title="loss", xlabel="step")
    ax = axes[0][1]
    ax.plot(steps, [r["lr"] for r in records])
    ax.set(title="learning rate", xlabel="step")
    ax = axes[1][0]
    ax.plot(steps, [r["tokens_per_s"] for r in records])
    ax.set(title="tokens/s", xlabel="step")
    ax = axes[1][1]
    bottom = [0.0] * len(records)
    for key, label in _SPLIT:
        if key == "bubble_s" and not any(key in r for r in records):
            continue
        vals = [(r.get(key) or 0.0) * 1e3 for r in records]
        ax.bar(steps, vals, bottom=bottom, width=1.0, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set(title="step time split (ms)", xlabel="step")
    ax.legend(fontsize="small")
    fig.suptitle(f"fastllm train: {os.path.abspath(run_dir)}")
    fig.tight_layout()
    out = out or os.path.join(run_dir, "report.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    _print_table(records, run_dir)
    print(f"wrote {out}")
    return out


def _print_table(records, run_dir):
    s = summarize(records)
    print(format_summary(s, f"fastllm report: {run_dir}"))
    print(f"{'':2}{'step':>6} {'loss':>8} {'lr':>9} {'tokens/s':>10} {'step ms':>8} "
          f"{'data %':>7} {'comm %':>7} {'optim %':>8}")
    stride = max(1, len(records) // 10)
    for r in records[::stride] + ([records[-1]] if (len(records) - 1) % stride else []):
        t = r["step_time_s"] or 1e-12
        loss = f"{r['loss']:8.4f}" if not r["skipped"] else f"{'skip':>8}"
        print(f"  {r['step']:6d} {loss} {r['lr']:9.2e} {r['tokens_per_s']:10.0f} "
              f"{t * 1e3:8.1f} {100 * (r.get('data_wait_s') or 0) / t:7.1f} "
              f"{100 * (r.get('comm_s') or 0) / t:7.1f} {100 * (r.get('optim_s') or 0) / t:8.1f}")
    from fastllm.train.evaluate import read_eval

    for e in read_eval(os.path.join(run_dir, "metrics.jsonl")):
        if "eval_pairs" in e:  # objective=dpo|cpo|orpo
            print(f"  eval at step {e['eval_step']}: loss {e['eval_loss']:.4f}, reward accuracy "
                  f"{e['eval_rewards/accuracies']:.3f}, margin {e['eval_rewards/margins']:.4f} "
                  f"({e['eval_pairs']} pairs)")
            continue
        print(f"  eval at step {e['eval_step']}: loss {e['eval_loss']:.4f}, perplexity "
              f"{e['eval_ppl']:.2f} ({e['eval_tokens']} tokens)")
