"""Checkpoint layouts: every strategy saves and loads one process's layout, so a checkpoint
resumes at any world size and in any strategy.

One process's layout is `module.state_dict()` for the model and an index-keyed
`optimizer.state_dict()` whose indices follow `param_order` (decayed parameters, then the
rest, in model order). Sharded models (FSDP2, tensor parallel) gather it with DCP's full state
dicts; pipeline stages gather their parts to rank 0 over the pipeline group. DCP keys
optimizer state by parameter name: `by_name` / `by_index` are the one remap between the two.
DCP keeps only 'state' and 'param_groups': the optimizer's other top-level entries (EXTRAS) are
carried beside them, so optimizer.pt is the same file in every layout.
"""

import contextlib
import os
import random

import torch
import torch.distributed as dist

from fastllm.train.adapter_checkpoint import adapter_layout, load_adapter, save_adapter

__all__ = ["rng_states", "restore_rng", "param_order", "by_name", "by_index", "full_state",
           "load_full", "optimizer_extras", "extras_restored", "gather_stages",
           "convert_moments", "save_adapter", "load_adapter", "adapter_layout",
           "check_resume_config",
           "non_finite"]

# optim= -> the optimizer state's dtype (fastllm.optim.convert_state's state_dtype)
STATE_DTYPES = {"adamw": torch.float32, "adamw_bf16": torch.bfloat16, "adamw8bit": torch.uint8}

# Top-level entries of an optimizer state_dict that DCP's full state dicts drop: fastllm AdamW's
# 'fastllm' (skip count, stochastic-rounding seed and call count, loss scaler). Not its
# 'fastllm_lowbyte': 8-bit state is refused under sharded layouts (its absmax is per local block).
EXTRAS = ("fastllm",)


def rng_states(device, world):
    """Every rank's random streams (torch, Python, CUDA), gathered: trainer_state.pt["rng"]."""
    rng = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(device)
    rngs = [rng]
    if world > 1:
        rngs = [None] * world
        dist.all_gather_object(rngs, rng)
    return rngs


def restore_rng(rngs, rank, device, seed, step):
    """This rank's streams back; at another world size a fresh stream per rank (per-rank
    streams cannot be carried over)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    if len(rngs) == world:
        rng = rngs[rank]
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        if "cuda" in rng and device.type == "cuda":
            torch.cuda.set_rng_state(rng["cuda"], device)
    else:
        torch.manual_seed(seed * 7919 + rank + 1_000_003 * step)
        random.seed(seed + rank + step)


def param_order(module):
    """module's trainable parameters as (decayed, not decayed) lists of (name, param): matrices
    and embeddings are decayed, vectors (norms, biases) not; each in model order. Their names
    in this order are the indices of optimizer.pt."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    return [(n, p) for n, p in named if p.ndim >= 2], [(n, p) for n, p in named if p.ndim < 2]


def by_name(optim_state, names, keep=None):
    """An index-keyed optimizer state_dict keyed by parameter name instead (DCP's layout), for
    the names in `keep` only (default: all)."""
    def kept(i):
        return keep is None or names[i] in keep

    return {"state": {names[i]: v for i, v in optim_state["state"].items() if kept(i)},
            "param_groups": [dict(g, params=[names[i] for i in g["params"] if kept(i)])
                             for g in optim_state["param_groups"]]}


def by_index(optim_state, names):
    """A name-keyed optimizer state_dict (DCP's) keyed by index in `names` (one process's)."""
    index = {n: i for i, n in enumerate(names)}
    return {"state": {index[n]: v for n, v in optim_state["state"].items()},
            "param_groups": [dict(g, params=[index[n] for n in g["params"]])
                             for g in optim_state["param_groups"]]}


def optimizer_extras(optimizer):
    """The optimizer's EXTRAS entries, from this rank. One process's layout holds one of each:
    rank 0's. The skip and call counts are alike on every rank (the skip follows the grad norm
    over all shards and stages, and every rank steps together); the seed is too wherever the
    optimizers were built from the same random state (fastllm train's are)."""
    state = optimizer.state_dict()
    return {k: state[k] for k in EXTRAS if k in state}


def full_state(model, optimizer, names, cpu_offload=True, trainable_only=False):
    """(model state, index-keyed optimizer state) of a sharded model (FSDP2, tensor parallel)
    in one process's layout, through DCP's full state dicts, with the optimizer's EXTRAS. Every
    rank must call it; with cpu_offload the tensors are gathered on rank 0 only and the others
    get (None, None). trainable_only: the model state without frozen parameters (an adapter
    run gathers its adapter, not the base model)."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload)
    model_state = get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, cpu_offload=cpu_offload, ignore_frozen_params=trainable_only))
    optim_state = get_optimizer_state_dict(model, optimizer, options=opts)
    if cpu_offload and dist.is_initialized() and dist.get_rank() != 0:
        return None, None
    return model_state, dict(by_index(optim_state, names), **optimizer_extras(optimizer))


def load_full(model, optimizer, model_state, optim_state, names):
    """Load one process's layout into a sharded model and its optimizer (DCP's full state
    dicts): only the entries this rank's model holds (a pipeline stage holds some layers). The
    optimizer's EXTRAS reach its own load_state_dict (which checks them) as in one process; a
    checkpoint without them leaves the optimizer's as they are."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True)
    if model_state is not None:  # None: a LoRA run, whose adapter is loaded apart
        local = set(model.state_dict())
        set_model_state_dict(model, {k: v for k, v in model_state.items() if k in local},
                             options=opts)
    n_saved = sum(len(g["params"]) for g in optim_state["param_groups"])
    if n_saved != len(names):
        raise ValueError(f"fastllm train: the checkpoint's optimizer holds {n_saved} "
                         f"parameters, this model {len(names)}")
    mine = {n for n, p in model.named_parameters() if p.requires_grad}
    with extras_restored(optimizer, {k: optim_state[k] for k in EXTRAS if k in optim_state}):
        set_optimizer_state_dict(model, optimizer, by_name(optim_state, names, mine),
                                 options=opts)


@contextlib.contextmanager
def extras_restored(optimizer, extras):
    """Within it, optimizer.load_state_dict also loads `extras` (optimizer_extras' entries):
    DCP's set_state_dict / set_optimizer_state_dict hand the optimizer a state_dict of 'state'
    and 'param_groups' only. The optimizer's own load_state_dict checks them as in one process;
    no extras (a checkpoint without them) leaves the optimizer's as they are."""
    handle = optimizer.register_load_state_dict_pre_hook(
        lambda _, state_dict: dict(state_dict, **extras)) if extras else None
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


def gather_stages(model, optimizer, names, n_decay, pp_group, writer, trainable_only=False):
    """(model state, optimizer state) of the whole pipeline in one process's layout on rank 0
    (None elsewhere). Each stage takes its part with DCP's full state dicts (over its dp/tp
    ranks); the ranks with `writer` True (dp 0, tp 0: the others hold copies) send theirs to
    rank 0 over pp_group; the optimizer's EXTRAS are rank 0's (_extras). names, n_decay: the
    whole model's param_order. trainable_only: as full_state's."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True)
    msd = get_model_state_dict(model, options=StateDictOptions(
        full_state_dict=True, ignore_frozen_params=trainable_only))
    osd = get_optimizer_state_dict(model, optimizer, options=opts)
    if not writer:
        return None, None

    def cpu(t):
        return t.detach().cpu() if isinstance(t, torch.Tensor) else t

    mine = {"model": {k: cpu(v) for k, v in msd.items()},
            "state": {k: {kk: cpu(vv) for kk, vv in v.items()} for k, v in osd["state"].items()},
            "groups": osd["param_groups"]}
    root = dist.get_rank() == 0
    parts = [None] * dist.get_world_size(pp_group) if root else None
    dist.gather_object(mine, parts, dst=0, group=pp_group)
    if not root:
        return None, None
    model_state, state, hyper = {}, {}, {}
    for part in parts:
        model_state.update(part["model"])
        state.update(part["state"])
        for g in part["groups"]:
            for n in g["params"]:
                hyper[n] = {k: v for k, v in g.items() if k != "params"}
    groups = []
    for i, params in enumerate((names[:n_decay], names[n_decay:])):
        if params:
            groups.append(dict(hyper[params[0]], params=params))
            continue
        # an empty group (LoRA trains no norm or bias) is kept, as one process keeps it, with
        # its hyperparameters as the stages hold them
        held = [g for part in parts for g in part["groups"][i:i + 1]]
        if held:
            groups.append(dict({k: v for k, v in held[0].items() if k != "params"}, params=[]))
    return model_state, dict(by_index({"state": state, "param_groups": groups}, names),
                             **optimizer_extras(optimizer))


def _moments_dtype(optim_state):
    """The moments' dtype of an AdamW-style optimizer state_dict: uint8 (8-bit), bf16 or fp32;
    None for other layouts (GaLore/BAdam, per-parameter optimizers)."""
    if not isinstance(optim_state, dict) or "state" not in optim_state:
        return None
    if optim_state.get("fastllm_lowbyte") is not None:
        return torch.uint8
    for entry in optim_state["state"].values():
        avg = entry.get("exp_avg") if isinstance(entry, dict) else None
        if isinstance(avg, torch.Tensor):
            return avg.dtype if avg.dtype == torch.bfloat16 else torch.float32
    return torch.float32


def convert_moments(optim_state, cfg, optimizer, log, path):
    """A checkpoint saved with another optim= (fp32, bf16 or 8-bit moments) converted to this
    run's (fastllm.optim.convert_state): a run can switch optim at a checkpoint."""
    want = torch.float32 if cfg.backend == "torch" else STATE_DTYPES[cfg.optim]
    have = _moments_dtype(optim_state)
    if have is None or have == want:
        return optim_state
    from fastllm.optim import convert_state

    kw = {}
    if want == torch.uint8:
        kw = dict(block_size=optimizer.block_size, min_8bit_size=optimizer.min_8bit_size)
    log(f"fastllm train: {path} holds {have} optimizer moments; converting them to {want} for "
        f"optim={cfg.optim}")
    return convert_state(optim_state, want, **kw)


# Keys whose change makes a checkpoint's tensors not fit this run's (per finetune mode: the
# sections that shape its trainable parameters), and keys whose change only moves the data
# stream (the saved position would index another order or window size).
_LAYOUT_KEYS = ("model", "model_config", "finetune", "optimizer_in_backward", "data.tokenizer",
                "precision")
# why a change of these keys does not fit (the others: the tensors' shapes)
_WHY = {"precision": "bf16/fp16 weights are trained through fp32 master weights in optimizer.pt "
                     "(backend=fastllm) and fp16 through a loss scale, which another precision "
                     "drops or lacks",
        "lora.quantize_base": "its adapter was trained over that base (dense or 4-bit NF4), "
                              "whose weights another setting changes under it",
        "lora.double_quant": "its adapter was trained over that NF4 base, whose absmax (and so "
                             "weights) another setting changes under it"}
# (lora.alpha and lora.dropout: the saved adapter_config.json's, which fastllm's load_adapter
# requires of the layers it loads into)
_MODE_KEYS = {"lora": ("lora.target_modules", "lora.r", "lora.layers", "lora.use_dora",
                       "lora.alpha", "lora.dropout", "lora.quantize_base", "lora.double_quant"),
              "prefix": ("prefix.num_virtual_tokens", "prefix.prefix_projection",
                         "prefix.encoder_hidden_size"),
              "freeze": ("freeze.layers",), "badam": ("badam.blocks",),
              # (the projected side and its rank: the shapes of the low-rank moments)
              "galore": ("galore.rank", "galore.proj_type")}
# Keys whose order does not matter: LoRA wraps the layers target_modules selects in model order
# (inject_lora walks named_modules; PEFT's target_modules is a set), so the adapter's layers and
# the optimizer state's indices (param_order) are the same in any order of the entries.
_UNORDERED_KEYS = ("lora.target_modules",)
# Param-group hyperparameters that come from the config (weight_decay, AdamW's, GaLore's
# refresh gap and scale): a checkpoint's optimizer state brings back its own, which a resume with
# a changed config must not silently keep.
_HYPERPARAMS = ("weight_decay", "betas", "eps", "update_proj_gap", "scale")
_DATA_KEYS = ("seed", "data.path", "data.format", "data.seq_len", "data.packing",
              "data.train_on_prompt", "data.eval_fraction", "data.eval_path")


def _check_rng(rng, device):
    """Why one rank's entry of rng_states() cannot be restored by restore_rng, or None. Each
    state is tried on a scratch generator, so a bad one is refused before anything is loaded
    and the process's own streams are left as they are."""
    if not isinstance(rng, dict):
        return f"it is a {type(rng).__name__}, not a mapping"
    missing = [k for k in ("torch", "python") if k not in rng]
    if missing:
        return f"it has no {' or '.join(missing)} state"
    streams = [("torch", "cpu")]
    # (the CUDA state is read only when this run is on CUDA: restore_rng skips it elsewhere)
    if "cuda" in rng and device is not None and device.type == "cuda":
        streams.append(("cuda", device))
    for key, where in streams:
        t = rng[key]
        if not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8):
            return f"its {key} state is not a uint8 tensor"
        try:
            torch.Generator(device=where).set_state(t)
        except (RuntimeError, TypeError, ValueError) as e:
            return f"its {key} state cannot be restored ({e})"
    try:
        random.Random().setstate(rng["python"])
    except (TypeError, ValueError) as e:
        return f"its python state cannot be restored ({e})"
    return None


def check_trainer_state(state, path, global_batch, device=None):
    """Refuse a trainer_state.pt that is not what save_checkpoint writes (an edited or foreign
    file that passed the manifest), or another global batch, naming the file, before anything
    is loaded. rng must hold one restorable entry per rank of the saving run (rng_states);
    device: this run's, whose CUDA state is then checked too."""
    where = os.path.join(path, "trainer_state.pt")

    def need(ok, what):
        if not ok:
            raise ValueError(f"fastllm train: {where} is malformed: {what}")

    def ints(d, keys):
        return isinstance(d, dict) and all(type(d.get(k)) is int for k in keys)

    need(isinstance(state, dict), f"a {type(state).__name__}, not a mapping")
    need(ints(state, ("step",)) and state["step"] >= 0, "no step count (an int >= 0)")
    need(ints(state.get("data"), ("position", "global_batch")), "data needs int position and "
         "global_batch")
    need(state["data"]["position"] >= 0, f"data position {state['data']['position']} < 0")
    need(ints(state.get("counters"), ("skipped", "bad_in_a_row", "rollbacks")),
         "counters needs int skipped, bad_in_a_row and rollbacks")
    need("rng" in state, "no rng states")
    # a list of one entry per rank: its length is the saving run's world size (restore_rng)
    rngs = state["rng"]
    need(isinstance(rngs, list), f"rng is a {type(rngs).__name__}, not a list of per-rank "
         f"states")
    need(rngs, "rng is an empty list (one state per rank)")
    for rank, rng in enumerate(rngs):
        why = _check_rng(rng, device)
        need(why is None, f"rng of rank {rank}: {why}")
    if state["data"]["global_batch"] != global_batch:
        raise ValueError(f"fastllm train: {path} was trained with global_batch_size="
                         f"{state['data']['global_batch']}, this run has {global_batch}; keep "
                         f"the global batch to resume")


def load_state(strategy, model_state, optim_state, path, log):
    """strategy.load, then this run's group hyperparameters put back over those the checkpoint's
    param groups brought (lr is set every step from the schedule), each change logged. A state
    that does not fit is refused naming the files."""
    from fastllm.train.config import ConfigError

    optimizer = strategy.optimizer
    groups = optim_state.get("param_groups") if isinstance(optim_state, dict) else None
    if isinstance(groups, list) and len(groups) != len(optimizer.param_groups):
        optim_state = _fit_empty_groups(optim_state, optimizer)
        groups = optim_state["param_groups"]
    if isinstance(groups, list) and len(groups) != len(optimizer.param_groups):
        # (every strategy's optimizer has [decayed, not decayed]; ZeRO's had one group before
        # DistributedOptimizer took no_decay)
        raise ConfigError(f"fastllm train: {path}/optimizer.pt holds {len(groups)} param groups, "
                          f"this run's optimizer {len(optimizer.param_groups)}: saved with "
                          f"another group layout (a parallel.strategy=zero1/zero2 checkpoint "
                          f"of one group, weight decay on every param, from before ZeRO's "
                          f"optimizer kept norms and biases undecayed?)")
    configured = group_hyperparams(optimizer)
    try:
        strategy.load(model_state, optim_state)
    except (KeyError, TypeError, ValueError, RuntimeError, AttributeError) as exc:
        files = "optimizer.pt" + ("" if model_state is None else " or model.pt")
        raise ValueError(f"fastllm train: {path}: {files} does not fit this run's model and "
                         f"optimizer ({type(exc).__name__}: {exc})") from exc
    set_group_hyperparams(optimizer, configured, path, log)


def _fit_empty_groups(optim_state, optimizer):
    """optim_state with its param groups matched to the optimizer's where the two differ only
    in empty groups: ZeRO's DistributedOptimizer keeps only the groups that have params (a LoRA
    run has no undecayed vectors), the other strategies' optimizers always [decayed, not
    decayed]. Unchanged when the non-empty groups do not pair up (then refused by count)."""
    saved = [g for g in optim_state["param_groups"] if isinstance(g, dict) and g.get("params")]
    if len(saved) != sum(1 for g in optimizer.param_groups if g["params"]):
        return optim_state
    it = iter(saved)
    groups = [next(it) if g["params"] else dict({k: v for k, v in g.items() if k != "params"},
                                                 params=[])
              for g in optimizer.param_groups]
    return dict(optim_state, param_groups=groups)


def group_hyperparams(optimizer):
    """[{hyperparameter: value} per param group] of the optimizer as this run built it."""
    return [{k: g[k] for k in _HYPERPARAMS if k in g} for g in optimizer.param_groups]


def set_group_hyperparams(optimizer, values, path, log):
    """Put group_hyperparams()'s values back after loading `path`'s optimizer state, logging
    each one that differs from the checkpoint's."""
    changed = {}
    for group, mine in zip(optimizer.param_groups, values):
        for key, value in mine.items():
            old = group.get(key)
            if old != value and not (isinstance(old, (list, tuple)) and tuple(old) == value):
                changed.setdefault(key, (old, value))
            group[key] = value
    for key, (old, new) in changed.items():
        log(f"fastllm train: resuming {path} with {key}={new} (it was trained with {old})")


def _get(config, dotted, missing=None):
    for part in dotted.split("."):
        if not isinstance(config, dict) or part not in config:
            return missing
        config = config[part]
    return config


def _same(key, old, new):
    if key in _UNORDERED_KEYS and isinstance(old, list) and isinstance(new, list):
        return {str(v) for v in old} == {str(v) for v in new}
    if key in ("model", "data.tokenizer") and isinstance(old, str) and isinstance(new, str) and (
            os.path.isdir(new)):
        # a folder, saved as typed (relative) before runs kept it absolute: the same folder
        return os.path.abspath(old) == os.path.abspath(new)
    return old == new


def check_resume_config(path, cfg, log):
    """Compare checkpoint `path`'s config.yaml with this run's cfg before loading it: a change
    that moves the state's layout raises ConfigError naming the key, a change of the data stream
    is logged. A checkpoint without config.yaml passes."""
    import yaml

    from fastllm.train.config import ConfigError

    saved_path = os.path.join(path, "config.yaml")
    if not os.path.isfile(saved_path):
        return
    with open(saved_path) as f:
        saved = yaml.safe_load(f)
    if not isinstance(saved, dict):
        return
    now, defaults = cfg.to_dict(), type(cfg)().to_dict()
    if cfg.data.tokenizer != "bpe" or _get(saved, "data.tokenizer") != "bpe":
        vocab = ()
    else:
        vocab = ("data.vocab_size",)  # the trained BPE's size is the embedding's
    for key in _LAYOUT_KEYS + vocab + _MODE_KEYS.get(cfg.finetune, ()):
        # (a key the checkpoint's run did not have yet: it ran with that key's default)
        old, new = _get(saved, key, _get(defaults, key)), _get(now, key)
        if key == "precision" and _get(saved, "backend") == cfg.backend == "torch" and \
                "fp16" not in (old, new):
            continue  # (torch's: fp32 params under autocast, no masters, no loss scale)
        if not _same(key, old, new):
            why = _WHY.get(key, "its model and optimizer state do not fit")
            raise ConfigError(f"fastllm train: {path} was trained with {key}={old}, this run has "
                              f"{key}={new}: {why}; keep {key}={old} to resume, or start fresh "
                              f"(another output_dir, or overwrite_output_dir=true)")
    old = _get(saved, "objective") or "lm"  # (runs saved before the key: lm)
    if old != cfg.objective:
        raise ConfigError(f"fastllm train: {path} was trained with objective={old}, this run has "
                          f"objective={cfg.objective}: a run's objective holds from its first step "
                          f"(its data, loss and metrics are the objective's; DPO's reference is "
                          f"the model the run started from); keep "
                          f"objective={old} to resume, or start the new objective from the "
                          f"checkpoint's weights in another output_dir (fastllm export RUN DIR "
                          f"--merged, then model=DIR)")
    old = _get(saved, "backend")
    if old not in (None, cfg.backend) and "fp32" != cfg.precision:  # (precision is kept above)
        raise ConfigError(f"fastllm train: {path} was trained with backend={old}, this run has "
                          f"backend={cfg.backend}: at precision={cfg.precision} backend=fastllm "
                          f"keeps fp32 master weights in optimizer.pt that backend=torch "
                          f"neither reads nor updates (the steps of one would be lost on "
                          f"returning to the other); keep backend={old} to resume, or start "
                          f"fresh (another output_dir, or overwrite_output_dir=true)")
    for key in _DATA_KEYS:
        old, new = _get(saved, key), _get(now, key)
        if old != new:
            log(f"fastllm train: warning: {path} was trained with {key}={old}, this run has "
                f"{key}={new}: the resumed data position indexes another stream, so batches "
                f"may repeat or be skipped")


def non_finite(model_state, module, step, log):
    """Whether the weights about to be saved hold inf or nan (then logged, naming them):
    model_state's tensors, or without one (an adapter) module's trainable parameters (a
    DTensor: its local shard)."""
    named = (model_state.items() if model_state is not None else
             [(n, p) for n, p in module.named_parameters() if p.requires_grad])
    bad = []
    for name, t in named:
        t = t.to_local() if hasattr(t, "to_local") else t
        if t.is_floating_point() and not bool(torch.isfinite(t.detach()).all()):
            bad.append(name)
    if bad:
        log(f"fastllm train: step {step}: {len(bad)} tensors hold inf/nan ({', '.join(bad[:3])}"
            f"{', ...' if len(bad) > 3 else ''}); checkpoint not saved")
    return bool(bad)
