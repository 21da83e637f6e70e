"""`fastllm train` and `fastllm report`, added to the `fastllm` command by fastllm/cli.py.

    fastllm train [--config run.yaml] [--compare torch|hf] [key=value ...]
    fastllm report RUN_DIR [--out PATH.png]
"""

import argparse
import copy
import sys

__all__ = ["add_train_commands"]


def add_train_commands(sub):
    p = sub.add_parser("train", help="train a Llama-style model (default: a built-in one on "
                                     "built-in text, about a minute on a CPU)",
                       epilog=_keys_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None, metavar="YAML", action=_Once, help="a config file")
    p.add_argument("--compare", default=None, choices=["torch", "hf"], action=_Once,
                   help="also run the same model, data and seed with plain PyTorch parts "
                        "(torch: torch.optim.AdamW fused, PEFT LoRA, autocast; hf: Hugging "
                        "Face's Trainer + PEFT) and compare")
    # REMAINDER, then _split_options: options may come after the overrides too.
    p.add_argument("overrides", nargs=argparse.REMAINDER, metavar="key=value",
                   help="config overrides, e.g. max_steps=200 lora.r=16 checkpoint.interval=50")
    p.set_defaults(handler=_train, train_parser=p)
    p = sub.add_parser("report", help="plot a training run's curves and time split")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None, metavar="PNG",
                   help="where to write the PNG (default RUN_DIR/report.png)")
    p.set_defaults(handler=_report)


def _keys_epilog():
    """Every config key fastllm train accepts, read from the config's dataclasses (so the help
    cannot name a key the config lacks), and the Hugging Face names it maps."""
    import dataclasses
    import textwrap

    from fastllm.train.config import HF_NAMES, TrainConfig

    cfg = TrainConfig()
    plain, sections = [], []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            keys = ", ".join(g.name for g in dataclasses.fields(value))
            sections.append(f"{f.name}.{{{keys}}}")
        else:
            plain.append(f.name)
    hf = ", ".join(f"{k} ({v})" for k, v in HF_NAMES.items())
    text = (f"config keys (fastllm/train/config.py): {', '.join(plain)}; "
            f"{'; '.join(sections)}. Hugging Face names: {hf}.")
    return "\n".join(textwrap.wrap(text, 79))


_OPTIONS = {"--config": None, "--compare": ("torch", "hf")}


def _given_twice(name, first, second):
    sys.exit(f"fastllm train: {name} is given twice ({first} and {second}); give it once (one "
             f"config file; override its keys with key=value)")


class _Once(argparse.Action):
    """An option that may be given once: argparse would keep the last silently."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest) is not None:
            _given_twice(option_string, getattr(namespace, self.dest), values)
        setattr(namespace, self.dest, values)


def _split_options(args):
    """Take --config/--compare (as `--opt value` or `--opt=value`) out of the overrides, where
    argparse leaves them when they follow a key=value; -h/--help there prints the help."""
    rest = []
    items = iter(args.overrides)
    for item in items:
        if item in ("-h", "--help"):
            args.train_parser.print_help()
            sys.exit(0)
        name, eq, value = item.partition("=")
        if name not in _OPTIONS:
            rest.append(item)
            continue
        if not eq:
            value = next(items, None)
            if value is None:
                sys.exit(f"fastllm train: {name} needs a value")
        choices = _OPTIONS[name]
        if choices is not None and value not in choices:
            sys.exit(f"fastllm train: {name} must be one of {', '.join(choices)}, got {value!r}")
        if getattr(args, name[2:]) is not None:
            _given_twice(name, getattr(args, name[2:]), value)
        setattr(args, name[2:], value)
    args.overrides = rest


def _train(args):
    import yaml

    from fastllm.train.checkpoint import CheckpointError
    from fastllm.train.config import ConfigError, TrainConfig
    from fastllm.train import run_dir
    from fastllm.train.run_dir import RunDirError
    from fastllm.train.trainer import Trainer
    from fastllm.train.watchdog import CollectiveTimeout

    _split_options(args)
    try:
        cfg = TrainConfig.from_args(args.overrides, args.config)
    except (ConfigError, OSError) as e:
        sys.exit(str(e))
    except yaml.YAMLError as e:
        sys.exit(f"fastllm train: {args.config} is not valid YAML: {e}")
    # One-line errors and a nonzero exit (torchrun restarts on it). ValueError: what the
    # trainer refuses once it sees the data, model or checkpoint (ConfigError is one).
    clear = (RunDirError, CheckpointError, CollectiveTimeout, ValueError, FileNotFoundError)
    if args.compare is None:
        try:
            summary = Trainer(cfg).train()
        except clear as e:
            sys.exit(str(e))
        if summary.get("status") == "stopped":
            sys.exit(0)
        return
    if args.compare == "hf":
        from fastllm.train.compare_hf import compare_hf

        try:
            return compare_hf(cfg)
        except clear as e:
            sys.exit(str(e))
    # both configs checked before either trains: an option only fastllm has must not fail
    # after the whole fastllm run
    configs = []
    for backend in ("fastllm", "torch"):
        c = copy.deepcopy(cfg)
        c.backend = backend
        c.checkpoint.auto_resume = False
        c.checkpoint.interval = 0
        c.output_dir = cfg.output_dir if backend == "fastllm" else cfg.output_dir + "-torch"
        try:
            configs.append((backend, c.validate()))
        except ConfigError as e:
            sys.exit(f"{e} (--compare torch runs the same config with backend=torch)")
    # and both output folders (read only: nothing created or deleted yet), so that a leftover
    # <output_dir>-torch is refused before the fastllm run trains, not after
    for _, c in configs:
        try:
            run_dir.check(c)
        except RunDirError as e:
            sys.exit(f"{e} (--compare torch starts both runs fresh: fastllm in output_dir, "
                     f"torch in output_dir-torch)")
    runs = []
    for backend, c in configs:
        if c.torch_compile:  # each run compiles its layers (the torch run reused fastllm's graphs)
            import torch._dynamo

            torch._dynamo.reset()
        trainer = Trainer(c)
        try:
            runs.append((backend, trainer.train()))
        except clear as e:
            sys.exit(str(e))
        if trainer.status == "stopped":  # a stop signal: the run saved a checkpoint; no more
            if runs[-1][1]:
                print(f"fastllm train --compare torch: the {backend} run stopped; not compared")
            sys.exit(0)
    if not runs[0][1]:
        return  # not rank 0
    print(f"\nfastllm train --compare torch ({cfg.model}, finetune={cfg.finetune}, "
          f"precision={cfg.precision}, {runs[0][1]['steps']} steps, same data and seed):")
    print(f"  {'':8} {'tokens/s':>10} {'ms/step':>9} {'first loss':>11} {'final loss':>11}")
    for backend, s in runs:
        print(f"  {backend:8} {s['tokens_per_s']:10,.0f} {s['step_time_s'] * 1e3:9.1f} "
              f"{s['first_loss']:11.4f} {s['final_loss']:11.4f}")
    ratio = runs[0][1]["tokens_per_s"] / runs[1][1]["tokens_per_s"]
    print(f"  fastllm / torch tokens/s: {ratio:.2f}x")
    if cfg.torch_compile:
        print("  (torch_compile: each run compiled its layers afresh; the timing leaves out the "
              "steps that compiled)")


def _report(args):
    from fastllm.train.report import report

    try:
        report(args.run_dir, args.out)
    except (FileNotFoundError, NotADirectoryError, ValueError) as e:  # (--out under a file)
        sys.exit(f"fastllm report: {e}")
