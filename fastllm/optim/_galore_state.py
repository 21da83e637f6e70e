"""fastllm.optim.GaLoreAdamW's state against its params: checked before a step and at
load_state_dict (before anything changes), and restored after torch's load.

A projected param (rows, cols) keeps `step`, `exp_avg` and `exp_avg_sq` (the low-rank shape of
its group's rank and side), `projector` ((rows, r) left, (cols, r) right), all in fp32 (fp64
for an fp64 param), and `master_param` (fp32, the param's local shape) with master weights.
Any other param keeps torch.optim.AdamW's state, checked by fastllm.optim.AdamW's own check
(state_layout.Moments.check): moments of the param's shape and dtype, fp32 where it has a
master.
"""

import torch

from fastllm._dtensor import local
from fastllm.optim.state_layout import Moments

_OWNER = "fastllm.optim.GaLoreAdamW"
_TORCH_LAYOUT = Moments()  # (torch's layout: no low-byte state)


def check_step_state(opt, group, where, p):
    """Raise RuntimeError naming `where` (the param) when p's existing state is not what the
    step needs: the shape, device and dtype of every state tensor (the param was resized, cast
    by model.to(), or moved since the state was made)."""
    state = opt.state.get(p)
    if not state:
        return
    if not opt._projected(group, p):
        kind = "master" if opt._has_master(p) else "plain"
        try:
            _TORCH_LAYOUT.check(where, local(p), state, kind, amsgrad=False)
        except RuntimeError as e:  # (AdamW's message, under this optimizer's name)
            raise RuntimeError(_OWNER + str(e).removeprefix("fastllm.optim.AdamW")) from None
        return
    step = state.get("step")
    if not isinstance(step, torch.Tensor) or step.numel() != 1:
        raise RuntimeError(f"{_OWNER}: state 'step' of {where} must be a one-element tensor")
    opmath = torch.float64 if p.dtype == torch.float64 else torch.float32
    low = opt._low_shape(group, p)
    left = opt._left(group, p)
    rank = low[0] if left else low[1]
    expected = {"exp_avg": (low, opmath), "exp_avg_sq": (low, opmath),
                "projector": ((p.shape[0] if left else p.shape[1], rank), opmath),
                "master_param": (tuple(local(p).shape), torch.float32)}
    for key, (shape, dtype) in expected.items():
        t = state.get(key)
        if t is None and key in ("projector", "master_param"):
            continue  # (made by this step: the first refresh, _add_master)
        if (not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape)
                or t.dtype != dtype or t.device != p.device):
            got = (f"{t.dtype} of shape {tuple(t.shape)} on {t.device}"
                   if isinstance(t, torch.Tensor) else type(t).__name__)
            raise RuntimeError(f"{_OWNER}: state '{key}' of {where} must be a {dtype} tensor of "
                               f"shape {tuple(shape)} on {p.device}, got {got}")


def check_loaded(opt, state_dict):
    """Refuse, before anything changes, a state_dict whose entries do not fit this optimizer's
    params (keys, low-rank and full shapes: the state of another model or optimizer) or whose
    groups set what GaLoreAdamW does not do (maximize, amsgrad: torch.optim.AdamW's)."""
    where = f"{_OWNER}.load_state_dict"
    if not (isinstance(state_dict, dict) and isinstance(state_dict.get("state"), dict)
            and isinstance(state_dict.get("param_groups"), list)):
        raise ValueError(f"{where}: expected a dict with 'state' and 'param_groups'")
    groups = state_dict["param_groups"]
    if [len(g.get("params", ())) for g in groups] != [len(g["params"])
                                                      for g in opt.param_groups]:
        raise ValueError(f"{where}: the state_dict's param groups have "
                         f"{[len(g.get('params', ())) for g in groups]} params, this "
                         f"optimizer's {[len(g['params']) for g in opt.param_groups]}")
    for gi, (saved_group, group) in enumerate(zip(groups, opt.param_groups)):
        refuse_unsupported(f"{where}: the state_dict's param group {gi}", saved_group)
        if ("rank" in saved_group) != ("rank" in group):
            raise ValueError(f"{where}: param group {gi} is projected in one of the "
                             f"state_dict and this optimizer only")
        for pi, (pid, p) in enumerate(zip(saved_group["params"], group["params"])):
            entry = state_dict["state"].get(pid)
            if entry:
                _check_loaded_param(opt, where, f"param {pi} of param group {gi} (shape "
                                    f"{tuple(p.shape)})", group, p, entry)


def _check_loaded_param(opt, where, name, group, p, entry):
    projected = opt._projected(group, p)
    need = ("step", "exp_avg", "exp_avg_sq") + (("projector",) if projected else ())
    missing = [k for k in need if not isinstance(entry.get(k), torch.Tensor)]
    if missing:
        raise ValueError(f"{where}: the state of {name} lacks {missing}")
    full = tuple(local(p).shape)
    if not projected:
        shapes = {"exp_avg": full, "exp_avg_sq": full}
    else:
        rows, cols = p.shape
        rank = entry["projector"].shape[-1]
        left = opt._left(group, p)
        shapes = {"projector": (rows if left else cols, rank)}
        low = entry["exp_avg"].shape
        if not (rank <= min(rows, cols) and (
                (left and tuple(low) == (rank, cols))
                or (not left and tuple(low) == (full[0], rank)))):
            raise ValueError(f"{where}: the low-rank moments of {name} have shape "
                             f"{tuple(low)}, which no rank-{rank} "
                             f"{'left' if left else 'right'} projection of it has")
        shapes["exp_avg_sq"] = tuple(low)
    if "master_param" in entry:
        shapes["master_param"] = full
    for key, shape in shapes.items():
        if tuple(entry[key].shape) != shape:
            raise ValueError(f"{where}: state '{key}' of {name} has shape "
                             f"{tuple(entry[key].shape)}, expected {shape} (the "
                             f"state of another model?)")


def restore_loaded(opt, state_dict, saved_ids):
    """After torch's load_state_dict, which casts every floating state tensor to its param's
    dtype: a projected param's low-rank state and projector, and every fp32 master and the
    fp32 moments beside it, as saved (on the param's device). A param without a master keeps
    torch's cast (its moments in its dtype, as torch.optim.AdamW loads them) and loses a saved
    master (saved with master weights, loaded without: the param is the weight again)."""
    params = [(g, p) for g in opt.param_groups for p in g["params"]]
    for pid, (group, p) in zip(saved_ids, params):
        saved = state_dict["state"].get(pid)
        if not saved:
            continue
        state = opt.state[p]
        master = opt._has_master(p)
        keys = (("exp_avg", "exp_avg_sq") if master or opt._projected(group, p) else ()) + (
            ("projector",) if opt._projected(group, p) else ()) + (
            ("master_param",) if master else ())
        for key in keys:
            if key in saved:
                state[key] = saved[key].to(device=p.device, copy=True)
        if not master:
            state.pop("master_param", None)


def refuse_unsupported(where, group):
    """ValueError when a param group sets torch.optim.AdamW's maximize or amsgrad, which
    GaLoreAdamW does not do (they came in a group or a torch state_dict, and were ignored)."""
    flags = [k for k in ("maximize", "amsgrad") if isinstance(group, dict) and group.get(k)]
    if flags:
        raise ValueError(f"{where} sets {flags[0]}=True, which fastllm.optim.GaLoreAdamW does "
                         f"not support")


def saved_skips(extra):
    """The skip count of a state_dict's 'fastllm' entry (0 without one: saved before it was
    kept, or by torch's AdamW); ValueError when it is not a count."""
    if extra is None:
        return 0
    skipped = extra.get("skipped_steps", 0) if isinstance(extra, dict) else None
    if isinstance(skipped, bool) or not isinstance(skipped, int) or skipped < 0:
        raise ValueError(f"{_OWNER}.load_state_dict: the state_dict's 'fastllm' entry must be a "
                         f"dict whose skipped_steps is an int >= 0, got {extra!r}")
    return skipped
