"""DistributedOptimizer's checkpoints: state_dict / load_state_dict in one process's layout
(index-keyed, each param's whole state gathered from its shards; 8-bit moments exported as
fp32), and the per-rank sharded_state_dict / load_sharded_state_dict (names and slices, for
DCP). A base class of fastllm.distributed.DistributedOptimizer."""

import math
import operator

import torch
import torch.distributed as dist

from fastllm.distributed import failure
from fastllm.optim.adamw8bit import export_state, import_state

# torch 2.13 renamed the flat collectives; older versions only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_LOW_PRECISION = (torch.bfloat16, torch.float16)


_WHO = "fastllm.distributed.DistributedOptimizer"


def _what(value):
    """A short description of a refused value for an error message."""
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


def _check_step(where, step):
    """A saved `step`: one finite count >= 0 (a number or a one-element tensor), as a float."""
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_complex():
        value = float(step.item())
    elif isinstance(step, (int, float)) and not isinstance(step, bool):
        value = float(step)
    else:
        raise ValueError(f"{_WHO}: cannot load state 'step' of {where}: it is {_what(step)}, "
                         f"not one number")
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{_WHO}: cannot load state 'step' of {where}: {value} is not a finite "
                         f"count >= 0")
    return value


def _check_group(where, mine, saved):
    """Saved hyperparameters of a param group: each of the kinds this group holds (a number, a
    flag, a tuple of as many values, a string), so that the next step() can use them."""
    for key, value in saved.items():
        if key == "params" or key not in mine or mine[key] is None:
            continue
        old = mine[key]
        if isinstance(old, bool):
            ok = isinstance(value, bool)
        elif isinstance(old, (int, float, torch.Tensor)):
            ok = (isinstance(value, (int, float)) and not isinstance(value, bool)) or (
                isinstance(value, torch.Tensor) and value.numel() == 1)
        elif isinstance(old, (tuple, list)):
            ok = isinstance(value, (tuple, list)) and len(value) == len(old)
        elif isinstance(old, str):
            ok = isinstance(value, str)
        else:
            ok = True
        if not ok:
            raise ValueError(f"{_WHO}: '{key}' of {where} of the state_dict is {value!r}, this "
                             f"optimizer's {old!r}")



def _need_floating(where, key, value):
    """A saved state tensor (every key but `step`) is a floating-point tensor."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        raise ValueError(f"{_WHO}: state '{key}' of {where} is {_what(value)}, not a "
                         f"floating-point tensor")

class DistributedOptimizerState:
    def _gather_flat(self, b, shard):
        full = torch.empty(b.padded, dtype=shard.dtype, device=shard.device)
        work = _all_gather(full, shard.contiguous(), group=self.group,
                                           async_op=True)
        failure.wait(work, "state_dict all-gather", self.timeout)
        return full

    def _agreed_layout(self):
        """Per bucket ({flat state key: dtype name} to all-gather, {other key: (value, dtype name
        or None)}), the same on every rank. Whether state_dict() gathers a bucket must not
        depend on this rank's own state: a rank holding none (a shard that is only padding,
        state created on some ranks only) would skip collectives the others run. One
        all_gather_object instead makes every rank gather what any rank holds (zeros where it
        holds nothing) and take `step` as the largest any rank saw."""
        mine = []
        for b in self.buckets:
            flat, small = {}, {}
            if not b.replicated:
                inner = export_state(self.optimizer, self.optimizer.state.get(b.shard_param, {}))
                for key, value in inner.items():
                    if isinstance(value, torch.Tensor) and key != "step" and value.dim() > 0:
                        flat[key] = str(value.dtype).split(".")[-1]
                    elif isinstance(value, torch.Tensor):
                        small[key] = (value.item(), str(value.dtype).split(".")[-1])
                    else:
                        small[key] = (value, None)
            mine.append((flat, small))
        everyone = [None] * self.world
        dist.all_gather_object(everyone, mine, group=self.group)
        agreed = []
        for per_rank in zip(*everyone):
            flat, small = {}, {}
            for theirs_flat, theirs_small in per_rank:
                for key, dtype in theirs_flat.items():
                    flat.setdefault(key, dtype)
                for key, value in theirs_small.items():
                    if key not in small or (key == "step" and value[0] > small[key][0]):
                        small[key] = value
            agreed.append((dict(sorted(flat.items())), small))
        return agreed

    def state_dict(self):
        """The consolidated state in single-process fastllm.optim.AdamW layout (collective: every
        rank calls it and gets the same dict). bf16/fp16 params carry fp32 'master_param' as in
        AdamW(master_weights=True). torch.optim.AdamW loads it too. The param groups are the
        inner optimizer's (see DistributedOptimizer: with no_decay [decayed, no_decay], with
        GaLoreAdamW [galore_params, the others] and the projected params' low-rank state), each
        listing its params in model order, and the params are numbered as torch.optim numbers
        them, in group order (one group: index i is the i-th trainable param of
        model.named_parameters()): the state_dict a single-process optimizer with those groups
        saves."""
        self._finish_param_gather()
        index = {id(p): i for i, p in enumerate(p for ps in self._group_params for p in ps)}
        state = {}
        for b, (flat, small) in zip(self.buckets, self._agreed_layout()):
            if b.replicated:
                for p in b.params:
                    if self.optimizer.state.get(p):
                        state[index[id(p)]] = {k: v.detach().clone() if isinstance(
                            v, torch.Tensor) else v for k, v in self.optimizer.state[p].items()}
                continue
            if not flat and not small:
                continue
            inner = export_state(self.optimizer, self.optimizer.state.get(b.shard_param, {}))
            fulls = {}
            for key, dtype in flat.items():
                shard = inner.get(key)
                if shard is None:  # no state here (see _agreed_layout): join with zeros
                    shard = torch.zeros(b.shard_size, dtype=getattr(torch, dtype),
                                        device=b.shard_param.device)
                fulls[key] = self._gather_flat(b, shard.detach().reshape(-1))
            if b.dtype in _LOW_PRECISION:
                fulls["master_param"] = self._gather_flat(b, b.shard_param.detach())
            scalars = {}
            for key, (value, dtype) in small.items():
                mine = inner.get(key)
                scalars[key] = value if dtype is None else torch.tensor(
                    value, dtype=getattr(torch, dtype),
                    device=mine.device if isinstance(mine, torch.Tensor) else "cpu")
            for p, off in zip(b.params, b.offsets):
                entry = {k: v.clone() if isinstance(v, torch.Tensor) else v
                         for k, v in scalars.items()}
                for key, full in fulls.items():
                    entry[key] = full[off:off + p.numel()].view_as(p).clone()
                state[index[id(p)]] = entry
        groups = []
        for g, params in zip(self.optimizer.param_groups, self._group_params):
            group = {k: v for k, v in g.items() if k != "params"}
            group["params"] = [index[id(p)] for p in params]
            groups.append(group)
        out = {"state": state, "param_groups": groups}
        if self.max_grad_norm is not None or self.loss_scaler is not None or any(
                b.dtype in _LOW_PRECISION for b in self.buckets):
            out["fastllm"] = {
                "sr_seed": None, "skipped_steps": self.skipped_steps,
                "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.state_dict(),
            }
        return out

    def load_state_dict(self, state_dict):
        """Load a consolidated state (from state_dict() at any world size, or from a
        single-process fastllm/torch AdamW over the same model); every rank calls it and keeps
        its own slice. Validates everything (types, shapes, steps, group hyperparameters, the
        'fastllm' counters) before changing anything: a refused state leaves it as it was."""
        if not isinstance(state_dict, dict):
            raise ValueError(f"{_WHO}: the state_dict is a {type(state_dict).__name__}, not a dict")
        if "fastllm_lowbyte" in state_dict:  # a single-process AdamW8bit's: per-param blocks
            from fastllm.optim import convert_state

            state_dict = convert_state(state_dict, torch.float32)
        groups, saved = state_dict.get("param_groups", []), state_dict.get("state", {})
        if not isinstance(saved, dict) or not isinstance(groups, (list, tuple)) or not all(
                isinstance(g, dict) and isinstance(g.get("params"), (list, tuple))
                for g in groups):
            raise ValueError(f"{_WHO}: the state_dict must hold a 'state' dict and a "
                             f"'param_groups' list of dicts with 'params' lists")
        want = [len(g) for g in self._group_params]
        if [len(g["params"]) for g in groups] != want:
            raise ValueError(f"{_WHO}: the state_dict must hold param groups of {want} params, "
                             f"got {[len(g['params']) for g in groups]} (another group layout: "
                             f"saved with another no_decay or galore_params?)")
        pid_of = {id(p): pid for g, params in zip(groups, self._group_params)
                  for pid, p in zip(g["params"], params)}
        replicated = {id(p) for b in self.buckets if b.replicated for p in b.params}
        steps = {}  # id(param) -> its saved step as a float
        for i, p in enumerate(self.params):
            where = f"param {i} ({self.param_names[i]})"
            entry = saved.get(pid_of[id(p)], {})
            if id(p) in replicated:
                self._check_replicated_entry(where, p, entry)
            else:
                self._check_entry(where, p, entry)
            if entry and "step" in entry:
                steps[id(p)] = _check_step(where, entry["step"])
        for gi, (mine, group) in enumerate(zip(self.optimizer.param_groups, groups)):
            _check_group(f"param group {gi}", mine, group)
        extra = self._check_extra(state_dict.get("fastllm"))
        self._finish_param_gather()
        for b in self.buckets:
            if b.replicated:
                for p in b.params:
                    entry = saved.get(pid_of[id(p)])
                    if entry:  # low-rank moments and projector stay fp32, as GaLoreAdamW's
                        self.optimizer.state[p] = {
                            k: v.to(p.device, copy=True) if isinstance(v, torch.Tensor) else v
                            for k, v in entry.items()}
                    else:
                        self.optimizer.state.pop(p, None)
                continue
            entries = [saved.get(pid_of[id(p)], {}) for p in b.params]
            if not any(entries):
                self.optimizer.state.pop(b.shard_param, None)
                continue
            keys = {k for e in entries for k in e if k != "step"}
            new = {}
            for key in sorted(keys):
                dtype = torch.float32 if b.dtype in _LOW_PRECISION else b.dtype
                shard = torch.zeros(b.shard_size, dtype=dtype, device=b.param_flat.device)
                for i, e in enumerate(entries):
                    span = b.overlaps(i)
                    if span is None:
                        continue
                    a, c, at = span
                    if key in e:
                        src = e[key].reshape(-1)[a:c]
                    elif key == "master_param":
                        src = b.params[i].detach().reshape(-1)[a:c]
                    else:
                        continue
                    shard[at:at + c - a].copy_(src)
                new[key] = shard
            self._install(b, new, [steps[id(p)] for p in b.params if id(p) in steps])
        for mine, group in zip(self.optimizer.param_groups, groups):
            for key, value in group.items():
                if key != "params":
                    mine[key] = value
        if extra is not None:
            self.skipped_steps = extra["skipped_steps"]
            if extra["loss_scaler"] is not None and self.loss_scaler is not None:
                self.loss_scaler.load_state_dict(extra["loss_scaler"])

    def _check_keys(self, where, entry):
        """A saved state entry is a dict holding the keys the optimizer needs (or is empty)."""
        if not isinstance(entry, dict):
            raise ValueError(f"{_WHO}: the state of {where} is a {type(entry).__name__}, "
                             f"not a dict")
        missing = [k for k in self._required_state if entry and k not in entry]
        if missing:
            raise ValueError(f"{_WHO}: the state of {where} lacks {missing}, which "
                             f"{type(self.optimizer).__name__} needs (another optimizer's "
                             f"state_dict?)")

    def _check_entry(self, where, p, entry):
        """A saved entry of a sharded (flat) param: the keys its optimizer needs, every value
        but `step` a floating tensor of p's shape (copied element by element into the shard)."""
        self._check_keys(where, entry)
        for key, value in entry.items():
            if key == "step":
                continue
            _need_floating(where, key, value)
            if value.shape != p.shape:
                raise ValueError(f"{_WHO}: state '{key}' of {where} has shape "
                                 f"{tuple(value.shape)}, the parameter {tuple(p.shape)}")

    def _check_replicated_entry(self, where, p, entry):
        """A saved entry of a GaLore-projected param: its low-rank moments and projector."""
        if not isinstance(entry, dict):
            raise ValueError(f"{_WHO}: the state of {where} is a {type(entry).__name__}, "
                             f"not a dict")
        if not entry:
            return
        if "projector" not in entry:
            raise ValueError(f"{_WHO}: the state of {where} has no GaLore projector")
        missing = [k for k in ("step", "exp_avg", "exp_avg_sq") if k not in entry]
        if missing:
            raise ValueError(f"{_WHO}: the state of {where} lacks {missing}")
        for key, value in entry.items():
            if key == "step":
                continue
            _need_floating(where, key, value)
            if key in ("projector", "exp_avg", "exp_avg_sq") and value.dim() != 2:
                raise ValueError(f"{_WHO}: state '{key}' of {where} has shape "
                                 f"{tuple(value.shape)}, not a matrix")
        if entry["exp_avg"].shape != entry["exp_avg_sq"].shape:
            raise ValueError(f"{_WHO}: states 'exp_avg' and 'exp_avg_sq' of {where} have shapes "
                             f"{tuple(entry['exp_avg'].shape)} and "
                             f"{tuple(entry['exp_avg_sq'].shape)}")
        if "master_param" in entry and entry["master_param"].shape != p.shape:
            raise ValueError(f"{_WHO}: state 'master_param' of {where} has shape "
                             f"{tuple(entry['master_param'].shape)}, the parameter "
                             f"{tuple(p.shape)}")

    def _check_extra(self, extra):
        """The state_dict's 'fastllm' entry checked, its counters parsed; None when absent."""
        if extra is None:
            return None
        where = f"{_WHO}: the state_dict's 'fastllm' entry"
        if not isinstance(extra, dict):
            raise ValueError(f"{where} is a {type(extra).__name__}, not a dict")
        skipped = extra.get("skipped_steps", 0)
        try:
            skipped = operator.index(skipped)
        except TypeError:
            raise ValueError(f"{where}: 'skipped_steps' is {_what(skipped)}, not an "
                             f"int") from None
        if skipped < 0:
            raise ValueError(f"{where}: 'skipped_steps' is {skipped}, not >= 0")
        scaler = extra.get("loss_scaler")
        if scaler is not None and self.loss_scaler is not None:
            check = getattr(self.loss_scaler, "check_state_dict", None)
            if check is not None:
                check(scaler)  # checked now, loaded only after the optimizer state
        return {"skipped_steps": skipped, "loss_scaler": scaler}

    def _install(self, b, new, steps):
        """Make `new` (state name -> flat shard) bucket b's optimizer state; a missing fp32
        master is taken from the params."""
        new["step"] = torch.tensor(max(steps) if steps else 0.0, dtype=torch.float32)
        master = new.pop("master_param", None)
        if b.dtype in _LOW_PRECISION:
            if master is None:
                master = b.param_flat[b.lo:b.hi].float()
            b.shard_param.copy_(master)
            # a loaded master is the truth, not the params: a model loaded before (as a resume
            # loads model.pt, then the optimizer) must not count as a write _resync_masters takes
            # the bf16-rounded params from (as fastllm.optim.AdamW's load forgets its versions)
            b.versions = [p._version for p in b.params]
        # fp32 moments -> the inner optimizer's low-byte layout (8-bit blocks of this shard).
        self.optimizer.state[b.shard_param] = import_state(self.optimizer, b.shard_param, new)

    def load_sharded_state_dict(self, shards):
        """Load the sharded_state_dict() of every rank of a run at any world size (a list of
        them, or their "state" entries merged into one dict); each rank copies the ranges that
        overlap its own slice. No collective. Validates everything first (range keys, every
        range's tensors against its length, steps, that the ranges of each trainable parameter
        cover it exactly once, the group hyperparameters): a refused load changes nothing.
        Shards that all hold no state (saved before the first step) load as no state yet."""
        self._refuse_sharded_galore("load_sharded_state_dict")
        shards = [shards] if isinstance(shards, dict) else list(shards)
        ranges = self._checked_ranges(shards)
        groups = self._checked_sharded_groups(shards)
        self._finish_param_gather()
        for b in self.buckets:
            # Every rank installs state for every bucket, a shard that is only padding included
            # (zero moments), from what every rank reads alike: the keys and the `step`s of all
            # the bucket's saved ranges, not only those overlapping this shard. One flat shard
            # has one step; where the saved ones differ (another bucket layout, a param whose
            # state started later) the largest is taken, as load_state_dict does, so the ranks
            # agree and the consolidated state_dict() does not depend on who saves it.
            saved = [(st, step) for name in b.names for _, _, st, step in ranges.get(name, [])]
            steps = [step for _, step in saved if step is not None]
            keys = {k for st, _ in saved for k in st if k != "step"}
            dtype = torch.float32 if b.dtype in _LOW_PRECISION else b.dtype
            new = {}
            for key in sorted(keys):
                if key == "master_param":
                    new[key] = b.param_flat[b.lo:b.hi].float()
                else:
                    new[key] = torch.zeros(b.shard_size, dtype=dtype, device=b.param_flat.device)
            for i, name in enumerate(b.names):
                span = b.overlaps(i)
                if span is None:
                    continue
                a, c, at = span
                for sa, sc, st, _ in ranges.get(name, []):
                    lo, hi = max(a, sa), min(c, sc)
                    if lo >= hi:
                        continue
                    for key, value in st.items():
                        if key in new:
                            new[key][at + lo - a:at + hi - a].copy_(value[lo - sa:hi - sa])
            if keys or steps:  # (a bucket never stepped has no state to install, on any rank)
                self._install(b, new, steps)
            elif not ranges:  # shards saved before the first step: none here either
                self.optimizer.state.pop(b.shard_param, None)
        for mine, group in zip(self.optimizer.param_groups, groups):
            for key, value in group.items():
                if key != "params":
                    mine[key] = value

    def _checked_sharded_groups(self, shards):
        """The shards' param groups (the first shard's), checked: as many as the inner
        optimizer's, each listing (where it lists any) the names of this group's params, each
        hyperparameter of the kind this optimizer's holds."""
        groups = shards[0].get("param_groups", [{}]) if shards else [{}]
        if not (isinstance(groups, (list, tuple)) and groups
                and all(isinstance(g, dict) for g in groups)):
            raise ValueError(f"{_WHO}: the shards' 'param_groups' must be a list of dicts")
        names = {id(p): n for n, p in zip(self.param_names, self.params)}
        want = [[names[id(p)] for p in params] for params in self._group_params]
        if len(groups) != len(want) or any(
                "params" in g and list(g["params"]) != w for g, w in zip(groups, want)):
            raise ValueError(f"{_WHO}: the shards hold param groups of "
                             f"{[len(g.get('params', ())) for g in groups]} params, this "
                             f"optimizer {[len(w) for w in want]} (another group layout: saved "
                             f"with another no_decay?)")
        for gi, (mine, group) in enumerate(zip(self.optimizer.param_groups, groups)):
            _check_group(f"param group {gi}", mine, group)
        return groups

    def _checked_ranges(self, shards):
        """{param name: [(first, end, state, step or None)]} of the shards, every range checked:
        its key "<name>[<first>:<end>]" names a trainable param and a range inside it, its state
        is a dict whose values are 1-D floating tensors of end - first elements (`step` one
        number), with the keys the optimizer needs; the ranges of a param tile it exactly."""
        ranges = {}
        numel = {n: p.numel() for n, p in zip(self.param_names, self.params)}
        for si, sd in enumerate(shards):
            if not (isinstance(sd, dict) and isinstance(sd.get("state"), dict)):
                raise ValueError(f"{_WHO}.load_sharded_state_dict: shard {si} is not a dict with "
                                 f"a 'state' dict")
            for key, st in sd["state"].items():
                name, _, span = str(key).rpartition("[")
                try:
                    a, c = (int(v) for v in span.removesuffix("]").split(":"))
                except ValueError:
                    raise ValueError(f"{_WHO}: the sharded state's key {key!r} is not "
                                     f"'<param name>[<first>:<end>]'") from None
                if name not in numel:
                    raise ValueError(f"{_WHO}: the sharded state holds {name!r}, which is not a "
                                     f"trainable parameter here")
                where = f"range {key!r}"
                if not 0 <= a < c <= numel[name]:
                    raise ValueError(f"{_WHO}: the sharded state's {where} is not inside the "
                                     f"{numel[name]} elements of {name}")
                self._check_keys(where, st)
                for k, v in st.items():
                    if k == "step":
                        continue
                    if not (isinstance(v, torch.Tensor) and v.is_floating_point()
                            and v.dim() == 1):
                        raise ValueError(f"{_WHO}: state '{k}' of {where} is {_what(v)}, not "
                                         f"a 1-D floating-point tensor")
                    if v.numel() != c - a:
                        raise ValueError(f"{_WHO}: state '{k}' of {where} has {v.numel()} "
                                         f"elements, the range {c - a}")
                step = _check_step(where, st["step"]) if "step" in st else None
                ranges.setdefault(name, []).append((a, c, st, step))
        if not shards:
            raise ValueError(f"{_WHO}.load_sharded_state_dict: no shards, so no state (an empty "
                             f"list?)")
        if not ranges:  # saved before the first step: no state yet, nothing to tile
            return ranges
        for name, n in numel.items():
            end = 0
            for a, c, _, _ in sorted(ranges.get(name, []), key=lambda r: r[:2]):
                if a != end:
                    raise ValueError(f"{_WHO}: the sharded state of {name} "
                                     f"{'misses' if a > end else 'repeats'} elements "
                                     f"[{min(a, end)}:{max(a, end)}]")
                end = c
            if end != n:
                raise ValueError(f"{_WHO}: the sharded state covers {end} of the {n} elements "
                                 f"of {name}")
        return ranges

    def _refuse_sharded_galore(self, what):
        if any(b.replicated for b in self.buckets):
            raise NotImplementedError(f"fastllm.distributed.DistributedOptimizer.{what}: GaLore's "
                                      f"low-rank state is not sharded; use state_dict()")

    def sharded_state_dict(self):
        """This rank's slice only, keyed "<param name>[<first>:<end>]" (flat element range of that
        param): {"state": {key: {state name: 1-D tensor}}, "param_groups": [...]} (the inner
        optimizer's groups, each with "params": its param names in model order). No
        collective."""
        self._refuse_sharded_galore("sharded_state_dict")
        out = {}
        for b in self.buckets:
            inner = export_state(self.optimizer, self.optimizer.state.get(b.shard_param, {}))
            if b.dtype in _LOW_PRECISION and inner:
                inner["master_param"] = b.shard_param.detach()
            for i, name in enumerate(b.names):
                span = b.overlaps(i)
                if span is None or not inner:
                    continue
                a, c, at = span
                out[f"{name}[{a}:{c}]"] = {
                    k: (v[at:at + c - a].clone() if isinstance(v, torch.Tensor) and v.dim() > 0
                        else v.clone() if isinstance(v, torch.Tensor) else v)
                    for k, v in inner.items()}
        names = {id(p): n for n, p in zip(self.param_names, self.params)}
        groups = [dict({k: v for k, v in g.items() if k != "params"},
                       params=[names[id(p)] for p in params])
                  for g, params in zip(self.optimizer.param_groups, self._group_params)]
        return {"state": out, "param_groups": groups}

