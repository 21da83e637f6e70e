"""DistributedOptimizer's checkpoints: state_dict / load_state_dict in one process's layout
(index-keyed, each param's whole state gathered from its shards; 8-bit moments exported as
fp32), and the per-rank sharded_state_dict / load_sharded_state_dict (names and slices, for
DCP). A base class of fastllm.distributed.DistributedOptimizer."""

import torch
import torch.distributed as dist

from fastllm.distributed import failure
from fastllm.optim.adamw8bit import export_state, import_state

# torch 2.13 renamed the flat collectives; older versions only have the old names.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_LOW_PRECISION = (torch.bfloat16, torch.float16)


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
        rank calls it and gets the same dict). Param index i is the i-th trainable param of
        model.named_parameters(); bf16/fp16 params carry fp32 'master_param' as in
        AdamW(master_weights=True). torch.optim.AdamW loads it too. With GaLoreAdamW: two param
        groups, [galore_params, the others], and the projected params' low-rank state, as a
        single-process GaLoreAdamW with those groups saves it."""
        self._finish_param_gather()
        index = {id(p): i for i, p in enumerate(self.params)}
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
        its own slice. Validates everything before changing anything."""
        if "fastllm_lowbyte" in state_dict:  # a single-process AdamW8bit's: per-param blocks
            from fastllm.optim import convert_state

            state_dict = convert_state(state_dict, torch.float32)
        groups = state_dict.get("param_groups", [])
        saved = state_dict.get("state", {})
        want = [len(g) for g in self._group_params]
        if [len(g["params"]) for g in groups] != want:
            raise ValueError(f"fastllm.distributed.DistributedOptimizer: the state_dict must hold "
                             f"param groups of {want} params, got "
                             f"{[len(g['params']) for g in groups]}")
        pid_of = {id(p): pid for g, params in zip(groups, self._group_params)
                  for pid, p in zip(g["params"], params)}
        replicated = {id(p) for b in self.buckets if b.replicated for p in b.params}
        for i, p in enumerate(self.params):
            if id(p) in replicated:
                entry = saved.get(pid_of[id(p)], {})
                if entry and "projector" not in entry:
                    raise ValueError(f"fastllm.distributed.DistributedOptimizer: the state of "
                                     f"{self.param_names[i]} has no GaLore projector")
                continue
            entry = saved.get(pid_of[id(p)], {})
            missing = [k for k in self._required_state if entry and k not in entry]
            if missing:
                raise ValueError(f"fastllm.distributed.DistributedOptimizer: the state of "
                                 f"{self.param_names[i]} lacks {missing}, which "
                                 f"{type(self.optimizer).__name__} needs (another optimizer's "
                                 f"state_dict?)")
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and key != "step" and value.shape != p.shape:
                    raise ValueError(f"fastllm.distributed.DistributedOptimizer: state '{key}' of "
                                     f"{self.param_names[i]} has shape {tuple(value.shape)}, the "
                                     f"parameter {tuple(p.shape)}")
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
            keys = {k for e in entries for k, v in e.items()
                    if isinstance(v, torch.Tensor) and k != "step"}
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
            self._install(b, new, [float(e["step"]) for e in entries if "step" in e])
        for mine, group in zip(self.optimizer.param_groups, groups):
            for key, value in group.items():
                if key != "params":
                    mine[key] = value
        extra = state_dict.get("fastllm")
        if extra is not None:
            self.skipped_steps = int(extra.get("skipped_steps", 0))
            if extra.get("loss_scaler") is not None and self.loss_scaler is not None:
                self.loss_scaler.load_state_dict(extra["loss_scaler"])

    def _install(self, b, new, steps):
        """Make `new` (state name -> flat shard) bucket b's optimizer state; a missing fp32
        master is taken from the params."""
        new["step"] = torch.tensor(max(steps) if steps else 0.0, dtype=torch.float32)
        master = new.pop("master_param", None)
        if b.dtype in _LOW_PRECISION:
            if master is None:
                master = b.param_flat[b.lo:b.hi].float()
            b.shard_param.copy_(master)
        # fp32 moments -> the inner optimizer's low-byte layout (8-bit blocks of this shard).
        self.optimizer.state[b.shard_param] = import_state(self.optimizer, b.shard_param, new)

    def load_sharded_state_dict(self, shards):
        """Load the sharded_state_dict() of every rank of a run at any world size (a list of
        them, or their "state" entries merged into one dict); each rank copies the ranges that
        overlap its own slice. No collective. Raises, before changing anything, when a range
        names an unknown parameter or a trainable parameter is not covered."""
        self._refuse_sharded_galore("load_sharded_state_dict")
        shards = [shards] if isinstance(shards, dict) else list(shards)
        ranges = {}
        for sd in shards:
            for key, st in sd["state"].items():
                name, _, span = key.rpartition("[")
                a, c = (int(v) for v in span.rstrip("]").split(":"))
                ranges.setdefault(name, []).append((a, c, st))
        numel = {n: p.numel() for n, p in zip(self.param_names, self.params)}
        if numel and not ranges:
            raise ValueError("fastllm.distributed.DistributedOptimizer.load_sharded_state_dict: "
                             "the shards hold no state (an empty list?)")
        for name, spans in ranges.items():
            if name not in numel:
                raise ValueError(f"fastllm.distributed.DistributedOptimizer: the sharded state "
                                 f"holds {name!r}, which is not a trainable parameter here")
        for name, n in numel.items():
            covered = sum(c - a for a, c, _ in ranges.get(name, []))
            if ranges and covered != n:
                raise ValueError(f"fastllm.distributed.DistributedOptimizer: the sharded state "
                                 f"covers {covered} of the {n} elements of {name}")
        self._finish_param_gather()
        for b in self.buckets:
            # Every rank installs state for every bucket, a shard that is only padding included
            # (zero moments), from what every rank reads alike: the keys and the `step`s of all
            # the bucket's saved ranges, not only those overlapping this shard. One flat shard
            # has one step; where the saved ones differ (another bucket layout, a param whose
            # state started later) the largest is taken, as load_state_dict does, so the ranks
            # agree and the consolidated state_dict() does not depend on who saves it.
            saved = [st for name in b.names for _, _, st in ranges.get(name, [])]
            steps = [float(st["step"]) for st in saved if "step" in st]
            keys = {k for st in saved for k, v in st.items()
                    if k != "step" and isinstance(v, torch.Tensor) and v.dim() > 0}
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
                for sa, sc, st in ranges.get(name, []):
                    lo, hi = max(a, sa), min(c, sc)
                    if lo >= hi:
                        continue
                    for key, value in st.items():
                        if key in new:
                            new[key][at + lo - a:at + hi - a].copy_(value[lo - sa:hi - sa])
            if keys or steps:  # (a bucket never stepped has no state to install, on any rank)
                self._install(b, new, steps)
        group = shards[0].get("param_groups", [{}])[0] if shards else {}
        for key, value in group.items():
            if key != "params":
                self.optimizer.param_groups[0][key] = value

    def _refuse_sharded_galore(self, what):
        if any(b.replicated for b in self.buckets):
            raise NotImplementedError(f"fastllm.distributed.DistributedOptimizer.{what}: GaLore's "
                                      f"low-rank state is not sharded; use state_dict()")

    def sharded_state_dict(self):
        """This rank's slice only, keyed "<param name>[<first>:<end>]" (flat element range of that
        param): {"state": {key: {state name: 1-D tensor}}, "param_groups": [...]}. No collective."""
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
        group = {k: v for k, v in self.optimizer.param_groups[0].items() if k != "params"}
        return {"state": out, "param_groups": [group]}

