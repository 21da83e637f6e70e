"""PowerSGD gradient compression with error feedback (Vogels et al. 2019, arXiv:1905.13727).

    state = fastllm.distributed.PowerSGD(rank=4, start_iter=10)
    ddp.register_comm_hook(state, fastllm.distributed.powersgd_hook)
    # or: fastllm.distributed.DistributedOptimizer(model, ..., grad_compression=state)

The same maths and defaults as torch's `powerSGD_hook` (torch/distributed/algorithms/
ddp_comm_hooks/powerSGD_hook.py), so the two can be compared one to one. Per bucket (a flat
buffer holding several gradients):
    - the first `start_iter` iterations: a plain all-reduce average (divide, then all-reduce);
    - then, with the previous step's local error added back (error feedback), each gradient seen
      as a matrix M = grad.view(shape[0], -1) of shape (n, m) is compressed when
      (n + m) * r * min_compression_rate < n * m (r = min(n, m, rank)); the others (vectors,
      small matrices) are all-reduced uncompressed in one flat buffer of their own;
    - for the compressed ones: P = M Q, one all-reduce of every P of the bucket, orthogonalise
      P, Q = M^T P, one all-reduce of every Q, M ~ P Q^T / world.
      Q is warm-started from the previous step, and drawn from N(0, 1) (the same seeded draws as
      torch) the first time.
The local error is the paper's (arXiv:1905.13727, Algorithm 1): error = M - P Q_local^T =
(I - P P^T) M with this rank's own Q_local = M^T P, zero for uncompressed tensors. torch's hook
stores M - P Q^T / world (local minus averaged approximation) instead, which adds
P P^T (M - mean(M)) to it and local - mean to the uncompressed ones: terms that sum to zero over
the ranks, so the averaged gradients, the Ps and the Qs are the same in exact arithmetic, but
that local error grows without bound as a random walk; this one stays below ||M||.
The orthogonalisation (fastllm::orthogonalize) and the decompression with the error update
(fastllm::powersgd_decompress, which needs no copy of the bucket) are fastllm kernels, one call
per bucket; the projections are BLAS matmuls. bf16/fp16 buckets are compressed in fp32 (P, Q and
the error are fp32) and the result rounded back once.

Non-finite gradients: an inf/nan in a compressed matrix on any one rank makes that bucket's P or Q
non-finite, identically on every rank since both are all-reduced, and the averaged bucket carries
it, so an optimizer that skips such steps (fastllm.optim.AdamW with max_grad_norm or a loss
scaler, DistributedOptimizer) skips it. That bucket's error and warm-started P/Q are then dropped
on every rank alike, with no extra collective (the next step starts them afresh, Q drawn from the
seeded generator as on a first step, so the ranks stay identical and runs reproducible): only
that step is lost. torch's hook keeps them, and every later step is non-finite too. An inf/nan in
an uncompressed tensor leaves no state behind. Other buckets keep the error of the skipped step.

Other differences from torch: with orthogonalization_epsilon 0 a zero column stays zero instead of
becoming nan; a warm-started Q column that is zero (the averaged gradient of the step that left
it was zero; a rank-deficient one leaves its dependent columns zero) gets fixed generic values
before it is orthogonalised, the same on every rank (`_refill_zero_columns_`): kept, it would
stay zero for good, that direction never sent again while the error grows (torch's hook, where it
orthogonalises by Gram-Schmidt (rank <= 2, half precision), gives nan there with epsilon 0 and
stays stuck with epsilon > 0; its QR, used otherwise, makes unit columns of zero ones);
start_iter may be 0 or 1 (torch refuses that with error feedback or warm start because DDP
rebuilds its buckets after the first iteration): the hook passes each bucket's parameters, whose
error and Q follow them into their new buckets. All collectives of a bucket run before the hook
returns (an already completed future), which is how they are ordered on Gloo anyway.
"""

import math
import numbers
import operator
import weakref

import numpy as np
import torch
import torch.distributed as dist

from fastllm.ops.orthogonalize import orthogonalize
from fastllm.ops.powersgd_decompress import powersgd_decompress

__all__ = ["PowerSGD", "powersgd_hook"]

_WORK_DTYPES = (torch.float32, torch.float64)


class PowerSGD:
    """State of PowerSGD compression: the per-bucket errors, the warm-started P and Q, the
    iteration count and the random generator of the first Q, all in `state_dict()`.

    Args (torch's PowerSGDState names in brackets):
        rank (matrix_approximation_rank): the rank r of the approximation.
        start_iter (start_powerSGD_iter): iterations of plain all-reduce before compressing.
        min_compression_rate: compress a matrix only when it shrinks by more than this factor.
        error_feedback (use_error_feedback): add the local compression error back next step.
        warm_start: start each step's Q from the previous step's.
        orthogonalization_epsilon: added to column norms in the orthogonalisation.
        process_group: the group to average over (default: the world).
        seed (random_seed): seeds the first Q, the same on every rank.
        module: the model (or its DDP) of the hook's buckets: state_dict() saves their parameter
            names, by which a resumed run matches saved states to parameters (see state_dict()).
    """

    def __init__(self, rank=4, start_iter=10, min_compression_rate=2, error_feedback=True,
                 warm_start=True, orthogonalization_epsilon=0.0, *, process_group=None, seed=0,
                 module=None):
        who = "fastllm.distributed.PowerSGD"
        # bool is an int to Python, but rank=True or seed=False is a slip, not a setting
        if not _is_int(rank) or rank < 1:
            raise ValueError(f"{who}: rank must be an int >= 1, got {rank!r}")
        if not _is_int(start_iter) or start_iter < 0:
            raise ValueError(f"{who}: start_iter must be an int >= 0, got {start_iter!r}")
        for name, value in (("min_compression_rate", min_compression_rate),
                            ("orthogonalization_epsilon", orthogonalization_epsilon)):
            # `not value >= 0` also refuses nan; the type is checked first so that a string or
            # None is named here rather than failing inside the comparison; inf zeroes all
            if (not isinstance(value, numbers.Real) or isinstance(value, bool)
                    or not value >= 0 or not math.isfinite(value)):
                raise ValueError(f"{who}: {name} must be a finite real number >= 0, got {value!r}")
        # numpy's RandomState takes seeds in [0, 2**32) and refuses others with its own TypeError
        if not (isinstance(seed, numbers.Integral) and not isinstance(seed, bool)
                and 0 <= seed < 2 ** 32):
            raise ValueError(f"{who}: seed must be an int in [0, 2**32), got {seed!r}")
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            module = module.module  # its names, without DDP's "module." prefix
        if module is not None and not isinstance(module, torch.nn.Module):
            raise ValueError(f"{who}: module must be an nn.Module, got {type(module).__name__}")
        self.module = module
        self._name_of = {}  # id(param) -> (weak reference to it, its name in module)
        self.rank = rank
        self.start_iter = start_iter
        self.min_compression_rate = min_compression_rate
        self.error_feedback = bool(error_feedback)
        self.warm_start = bool(warm_start)
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.process_group = process_group
        self.seed = int(seed)
        self.rng = np.random.RandomState(seed)
        self.iter = 0
        self.errors = {}
        self.p_memory = {}
        self.q_memory = {}
        self._fillers = {}  # (shape, device, dtype) -> _filler's matrix, made once
        self._layouts = {}
        # key -> (its params' names or id()s, their offsets, weak references to them or None)
        self._owners = {}
        self._orphans = []  # states displaced this iteration, kept for their params' new buckets
        self._touched = set()  # keys the hook's buckets used this iteration
        # Elements before and after compression, summed over every bucket and step (torch's
        # PowerSGDState counts the same), and the elements the last reduce sent per rank.
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.last_numel_sent = 0

    # ---- checkpointing -------------------------------------------------------------------

    def state_dict(self):
        """Everything the next step depends on: iteration, errors, P and Q, the generator.

        States are kept per bucket index; a fresh DDP's first buckets are in another order than
        its later ones. With `module`, 'params' holds each bucket's parameter names and offsets,
        and a loaded state goes to the parameters of those names wherever they are. Without
        ('params' None), as torch's PowerSGDState, a loaded state applies to the bucket of the
        same index and layout: another parameter's state where DDP's order changed."""
        return {
            "config": dict(rank=self.rank, start_iter=self.start_iter,
                           min_compression_rate=self.min_compression_rate,
                           error_feedback=self.error_feedback, warm_start=self.warm_start,
                           orthogonalization_epsilon=self.orthogonalization_epsilon,
                           seed=self.seed),
            "iter": self.iter,
            "rng": _rng_state_to_torch(self.rng.get_state()),
            "errors": {k: v.clone() for k, v in self.errors.items()},
            "p_memory": {k: v.clone() for k, v in self.p_memory.items()},
            "q_memory": {k: v.clone() for k, v in self.q_memory.items()},
            "layouts": {k: (n, str(dtype), shapes) for k, (n, dtype, shapes)
                        in self._layouts.items()},
            "numel": (self.total_numel_before_compression, self.total_numel_after_compression),
            "params": None if self.module is None else {
                k: {"names": list(t), "offsets": list(o)} for k, (t, o, refs)
                in self._owners.items() if refs is None},
        }

    def load_state_dict(self, state_dict):
        """Load a state_dict() saved with the same settings. Everything is checked first (every
        key present, the generator's state, each bucket's error, P and Q against its saved
        layout): a refused state_dict changes nothing."""
        loaded = self._checked(state_dict)
        self.iter = loaded["iter"]
        self.rng.set_state(loaded["rng"])
        self.errors = {k: v.clone() for k, v in loaded["errors"].items()}
        self.p_memory = {k: v.clone() for k, v in loaded["p_memory"].items()}
        self.q_memory = {k: v.clone() for k, v in loaded["q_memory"].items()}
        self._layouts = loaded["layouts"]
        self._owners = {k: (tuple(v["names"]), tuple(v["offsets"]), None)
                        for k, v in (loaded["params"] or {}).items() if self.module is not None}
        self._orphans, self._touched = [], set()
        self.total_numel_before_compression, self.total_numel_after_compression = loaded["numel"]

    def _checked(self, state_dict):
        """state_dict's entries, checked and parsed (the rng state as numpy's, the layouts'
        dtypes as torch dtypes); raises ValueError naming the first bad entry."""
        who = "fastllm.distributed.PowerSGD.load_state_dict"
        if not isinstance(state_dict, dict):
            raise ValueError(f"{who}: the state_dict is a {type(state_dict).__name__}, not a dict")
        # 'params' is new: states saved before it load as they did, unless names are needed
        missing = [k for k in self.state_dict() if k not in state_dict and k != "params"]
        if missing:
            raise ValueError(f"{who}: the state_dict lacks {missing} (not a PowerSGD state, or "
                             f"one of another version)")
        config = state_dict["config"]
        if not isinstance(config, dict):
            raise ValueError(f"{who}: 'config' is a {type(config).__name__}, not a dict")
        mine = self.state_dict()["config"]
        # over both sets of keys: a setting absent from either side is not known to agree (a
        # config of {"rank": 2} says nothing of error feedback or start_iter), and one this
        # version lacks may change what the saved state means
        missing = sorted(k for k in mine if k not in config)
        extra = sorted((k for k in config if k not in mine), key=str)
        different = {k: (v, mine[k]) for k, v in config.items() if k in mine and mine[k] != v}
        wrong = ([f"missing {missing}"] * bool(missing) + [f"unknown {extra}"] * bool(extra)
                 + [f"different (saved, this state) {different}"] * bool(different))
        if wrong:
            raise ValueError(f"fastllm.distributed.PowerSGD: the state_dict was saved with other "
                             f"settings: {'; '.join(wrong)}")
        out = {"iter": _count(who, "iter", state_dict["iter"])}
        numel = state_dict["numel"]
        if not (isinstance(numel, (tuple, list)) and len(numel) == 2):
            raise ValueError(f"{who}: 'numel' must be a pair of counts, got {numel!r}")
        out["numel"] = tuple(_count(who, f"numel[{i}]", v) for i, v in enumerate(numel))
        try:
            rng = _rng_state_from_torch(state_dict["rng"])
            if rng[1].shape != (624,):  # (MT19937's state; numpy reads past a short one)
                raise ValueError(f"'keys' has shape {rng[1].shape}, not (624,)")
            np.random.RandomState(0).set_state(rng)  # (numpy's own checks, on a scratch one)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError) as e:
            raise ValueError(f"{who}: 'rng' is not a saved generator state: "
                             f"{type(e).__name__}: {e}") from None
        out["rng"] = rng
        layouts = state_dict["layouts"]
        if not isinstance(layouts, dict):
            raise ValueError(f"{who}: 'layouts' is a {type(layouts).__name__}, not a dict")
        out["layouts"] = {k: _layout(who, k, v) for k, v in layouts.items()}
        for name in ("errors", "p_memory", "q_memory"):
            memory = state_dict[name]
            if not isinstance(memory, dict):
                raise ValueError(f"{who}: '{name}' is a {type(memory).__name__}, not a dict")
            for key, value in memory.items():
                if key not in out["layouts"]:
                    raise ValueError(f"{who}: '{name}' holds bucket {key!r}, which 'layouts' "
                                     f"does not")
                n, dtype, shapes = out["layouts"][key]
                want = n if name == "errors" else self._pq_sizes(shapes)[name == "q_memory"]
                if not (isinstance(value, torch.Tensor) and value.dtype == dtype
                        and tuple(value.shape) == (want,)):
                    got = (f"a {value.dtype} tensor of shape {tuple(value.shape)}"
                           if isinstance(value, torch.Tensor) else f"a {type(value).__name__}")
                    raise ValueError(f"{who}: '{name}' of bucket {key!r} is {got}, its layout "
                                     f"needs a {dtype} tensor of shape ({want},)")
            out[name] = memory
        if out["p_memory"].keys() != out["q_memory"].keys():
            raise ValueError(f"{who}: 'p_memory' holds buckets {sorted(out['p_memory'], key=str)}"
                             f", 'q_memory' {sorted(out['q_memory'], key=str)}")
        out["params"] = self._checked_params(who, state_dict.get("params"), out["layouts"])
        return out

    def _checked_params(self, who, params, layouts):
        """'params' (None: saved without names), checked against the layouts."""
        if params is None and self.module is not None and layouts:
            raise ValueError(f"{who}: the state_dict has no parameter names (saved without "
                             f"module=, or by an older fastllm): its bucket states cannot be "
                             f"matched to this module's parameters once DDP's buckets change; "
                             f"load it without module= (by bucket index, as torch) or start anew")
        if not isinstance(params, (dict, type(None))):
            raise ValueError(f"{who}: 'params' is a {type(params).__name__}, not a dict")
        for key, value in (params or {}).items():
            try:
                n, _, shapes = layouts[key]
                offsets = [operator.index(o) for o in value["offsets"]]
                ok = (len(value["names"]) == len(offsets) == len(shapes)
                      and all(isinstance(name, str) for name in value["names"])
                      and all(0 <= o <= n - math.prod(s) for o, s in zip(offsets, shapes)))
            except (TypeError, KeyError):
                ok = False
            if not ok:
                raise ValueError(f"{who}: 'params' of bucket {key!r} is not the names and "
                                 f"offsets of the gradients its 'layouts' entry holds")
        return params

    def _split(self, shape):
        """(n, m, r, compressed): a gradient of this shape seen as an n x m matrix, the rank of
        its approximation, and whether it is compressed."""
        numel = math.prod(shape)
        n = shape[0] if len(shape) > 0 else 1
        m = numel // n if n > 0 else 0
        r = min(n, m, self.rank)
        return n, m, r, (n + m) * r * self.min_compression_rate < n * m

    def _pq_sizes(self, shapes):
        """The elements of a bucket's P and Q memories, for its gradients' shapes."""
        split = [self._split(s) for s in shapes]
        return (sum(n * r for n, _, r, c in split if c), sum(m * r for _, m, r, c in split if c))

    # ---- the reduction -------------------------------------------------------------------

    @property
    def group(self):
        """The process group it averages over (the default group when none was given)."""
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def end_iteration(self):
        """Count one iteration: what a DistributedOptimizer step calls after the buckets of a
        step were reduced with compressed_average_ (which counts none)."""
        self.iter += 1
        # DDP reduces every bucket each iteration: the hook's buckets not seen are gone
        for key in [k for k in self._owners if self._touched and k not in self._touched]:
            self._drop(key), self._owners.pop(key), self._layouts.pop(key, None)
        self._touched, self._orphans = set(), []

    def reduce_(self, buffer, grads, key, is_last=True, params=None):
        """Average `buffer` across the group in place (compressed once start_iter is reached).

        buffer: flat 1-D gradient buffer (fp32, fp64, bf16 or fp16); grads: views into it, one
        per parameter, in buffer order (a DDP bucket's `gradients()`); key: the bucket's index,
        which names its state; is_last: counts an iteration after the last bucket of a step;
        params: the bucket's parameters, in grads' order (a DDP bucket's `parameters()`), whose
        state follows them when the buckets change (None: the bucket never changes). Returns buffer.
        """
        if self.compressing:
            self.compressed_average_(buffer, grads, key, params)
        else:
            group = self.group
            buffer.div_(dist.get_world_size(group))
            dist.all_reduce(buffer, group=group)
            self.last_numel_sent = buffer.numel()
        if is_last:
            self.end_iteration()
        return buffer

    def _offsets(self, buffer, grads):
        base = buffer.data_ptr()
        size = buffer.element_size()
        offsets = []
        for i, g in enumerate(grads):
            offset, rem = divmod(g.data_ptr() - base, size)
            if (rem or offset < 0 or offset + g.numel() > buffer.numel() or g.dtype != buffer.dtype
                    or not g.is_contiguous()):
                raise ValueError(f"fastllm.distributed.PowerSGD: gradient {i} (shape "
                                 f"{tuple(g.shape)}) is not a contiguous view into the bucket "
                                 f"buffer")
            offsets.append(offset)
        return offsets

    @property
    def compressing(self):
        """Whether this iteration is compressed (start_iter reached)."""
        return self.iter >= self.start_iter

    def _drop(self, key):
        for memory in (self.errors, self.p_memory, self.q_memory):
            memory.pop(key, None)

    def _owner(self, params):
        """(tokens, refs): a bucket's params by name in `module` (alike in every process), else
        by id(): DDP's rebuild re-buckets the same Parameter objects; data_ptr() would not tell
        empty params apart nor follow a new .data. refs tell a dead param (its id may recur)."""
        if self.module is None:
            return tuple(id(p) for p in params), tuple(weakref.ref(p) for p in params)
        if not all(self._name_of.get(id(p), (lambda: None,))[0]() is p for p in params):
            self._name_of = {id(q): (weakref.ref(q), name)
                             for name, q in self.module.named_parameters()}
        if not all(id(p) in self._name_of for p in params):
            raise ValueError("fastllm.distributed.PowerSGD: a bucket holds a parameter that is "
                             "not in the module given")
        return tuple(self._name_of[id(p)][1] for p in params), None

    def _claim(self, key, layout, offsets, params, device):
        """Make the state under `key` this bucket's: kept if its layout and params are the same,
        else each param's error and Q taken from where they are now; zero for the others (their
        Q refilled by _refill_zero_columns_), a first Q drawn as torch's where none is found."""
        same, old = self._layouts.get(key) == layout, self._owners.get(key)
        if params is not None:
            tokens, refs = self._owner(params)
            self._touched.add(key)
            self._owners[key] = (tokens, tuple(offsets), refs)
        # without params (fixed buckets) or loaded without names: by index and layout
        if same and (params is None or old is None
                     or (old[0] == tokens and all(r() is not None for r in old[2] or ()))):
            return
        # sources: (owner, layout, error, Q); this key's own old state first
        displaced = (old, self._layouts.get(key), self.errors.get(key), self.q_memory.get(key))
        self._drop(key)
        self._layouts[key] = layout
        if params is None:
            return
        sources = [displaced] + self._orphans + [
            (self._owners[k], self._layouts[k], self.errors.get(k), self.q_memory.get(k))
            for k in self._owners if k != key]
        self._orphans.append(displaced)
        where = {t: (src, j) for src in reversed(sources)  # (the first source wins)
                 if src[0] is not None and src[1] is not None
                 and all(r() is not None for r in src[0][2] or ())
                 for j, t in enumerate(src[0][0])}
        n, dtype, shapes = layout
        if self.error_feedback:
            self.errors[key] = torch.zeros(n, device=device, dtype=dtype)
        q, slots = None, self._q_slots(shapes)
        for i, t in enumerate(tokens):
            if t not in where:
                continue
            ((_, at, _), (_, src_dtype, src_shapes), src_error, src_q), j = where[t]
            if src_dtype != dtype or src_shapes[j] != shapes[i]:
                continue
            size, slot = math.prod(shapes[i]), self._q_slots(src_shapes)[j]
            if key in self.errors and src_error is not None:
                self.errors[key][offsets[i]:offsets[i] + size].copy_(src_error[at[j]:at[j] + size])
            if q is None and self.warm_start:
                p_size, q_size = self._pq_sizes(shapes)
                self.p_memory[key] = torch.empty(p_size, device=device, dtype=dtype)
                q = self.q_memory[key] = torch.zeros(q_size, device=device, dtype=dtype)
            if slot is not None and src_q is not None and q is not None:
                size = slot[1] * slot[2]
                q[slots[i][0]:slots[i][0] + size].copy_(src_q[slot[0]:slot[0] + size])

    def _q_slots(self, shapes):
        """(start, m, r) of each gradient's Q in its bucket's Q memory (None: not compressed)."""
        split, first, slots, start = [self._split(s) for s in shapes], {}, [None] * len(shapes), 0
        for i, (n, m, r, _) in enumerate(split):
            first.setdefault((n, m, r), i)
        for i in sorted((i for i, c in enumerate(split) if c[3]),
                        key=lambda i: first[split[i][:3]]):
            slots[i], start = (start, split[i][1], split[i][2]), start + split[i][1] * split[i][2]
        return slots

    def compressed_average_(self, buffer, grads, key, params=None):
        """The compressed average of `buffer` across the group, in place, whatever the
        iteration and without counting one (reduce_ after start_iter; what
        fastllm.distributed.DistributedOptimizer calls per bucket). Elements of `buffer` outside
        every grad (padding) are left as they are. Arguments as reduce_; returns buffer."""
        group = self.group
        world = dist.get_world_size(group)
        offsets = self._offsets(buffer, grads)
        work = buffer if buffer.dtype in _WORK_DTYPES else buffer.float()
        layout = (work.numel(), work.dtype, tuple(tuple(g.shape) for g in grads))
        self._claim(key, layout, offsets, params, work.device)
        error = None
        if self.error_feedback:
            error = self.errors.get(key)
            if error is None:
                error = self.errors[key] = torch.zeros_like(work)
            else:
                work.add_(error)

        split = [self._split(g.shape) for g in grads]
        uncompressed = [(o, g.numel()) for o, g, c in zip(offsets, grads, split) if not c[3]]
        self.total_numel_before_compression += sum(n * m for n, m, _, _ in split)
        self.total_numel_after_compression += sum((n + m) * r if c else n * m
                                                  for n, m, r, c in split)
        # Batched by shape, in order of first appearance (_q_slots): the layout of torch's P and
        # Q memory, so that the seeded first Q is the same matrix as torch's.
        slots = self._q_slots(layout[2])
        ordered = [(offsets[i],) + split[i][:3] for i in sorted(
            (i for i, slot in enumerate(slots) if slot), key=lambda i: slots[i][0])]
        mats = [work[o:o + n * m].view(n, m) for o, n, m, _ in ordered]
        p_size = sum(n * r for _, n, _, r in ordered)
        q_size = sum(m * r for _, _, m, r in ordered)

        need_random_q = (not self.warm_start or key not in self.p_memory
                         or self.p_memory[key].numel() != p_size)
        if need_random_q:
            self.p_memory[key] = torch.empty(p_size, device=work.device, dtype=work.dtype)
            self.q_memory[key] = torch.empty(q_size, device=work.device, dtype=work.dtype)
        p_mem, q_mem = self.p_memory[key], self.q_memory[key]
        ps, qs = [], []
        p_idx = q_idx = 0
        for _, n, m, r in ordered:
            ps.append(p_mem[p_idx:p_idx + n * r].view(n, r))
            qs.append(q_mem[q_idx:q_idx + m * r].view(m, r))
            p_idx += n * r
            q_idx += m * r
        if need_random_q:
            # Drawn even when the bucket compresses nothing (torch's hook does): a bucket of
            # vectors only would otherwise shift every later bucket's first Q off torch's.
            seed = self.rng.randint(1_000_000_000)
        if need_random_q and qs:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                for q in qs:
                    q.copy_(torch.randn(1, *q.shape, device="cpu", dtype=work.dtype)[0])
        elif qs:
            _refill_zero_columns_(qs, self._fillers)
        orthogonalize(qs, self.orthogonalization_epsilon)

        # Vectors and small matrices: one flat all-reduce, overlapped with the P matmuls.
        flat = (torch.cat([work[o:o + k] for o, k in uncompressed]) if uncompressed
                else work.new_empty(0))
        handle = dist.all_reduce(flat, group=group, async_op=True) if uncompressed else None
        for mat, q, p in zip(mats, qs, ps):
            torch.mm(mat, q, out=p)
        if handle is not None:
            handle.wait()
            flat.div_(world)
            idx = 0
            for o, k in uncompressed:
                work[o:o + k].copy_(flat[idx:idx + k])
                idx += k
        if ordered:
            dist.all_reduce(p_mem, group=group)
            orthogonalize(ps, self.orthogonalization_epsilon)
            for mat, p, q in zip(mats, ps, qs):
                torch.mm(mat.t(), p, out=q)
            local_qs, errors = [], []
            if error is not None:
                local_q_mem = q_mem.clone()
                idx = 0
                for o, n, m, r in ordered:
                    local_qs.append(local_q_mem[idx:idx + m * r].view(m, r))
                    errors.append(error[o:o + n * m].view(n, m))
                    idx += m * r
            dist.all_reduce(q_mem, group=group)
            q_mem.div_(world)
            powersgd_decompress(mats, ps, qs, local_qs, errors, 1.0)
            # P and Q are all-reduced, so every rank reaches the same verdict without another
            # collective; kept, a non-finite error or warm start would spoil every later step.
            if not bool(torch.isfinite(p_mem).all() & torch.isfinite(q_mem).all()):
                self._drop(key)
        self.last_numel_sent = flat.numel() + p_size + q_size
        if work is not buffer:
            buffer.copy_(work)
        if not self.warm_start:
            self.p_memory.pop(key, None)
            self.q_memory.pop(key, None)
        return buffer


def _filler(shape, device, dtype):
    """A fixed (m, r) matrix of generic values in [-0.5, 0.5): a multiplicative hash of each
    element's index (Knuth's), computed where Q lives, the same on every rank and every run."""
    index = torch.arange(shape[0] * shape[1], device=device, dtype=torch.int64)
    hashed = (index * 2654435761 + 40503) % 4294967296  # < 2^63 for any index below 2^31
    return (hashed.to(torch.float64) / 4294967296.0 - 0.5).to(dtype).view(shape)


def _refill_zero_columns_(qs, fillers):
    """Give every all-zero column of the warm-started Qs the filler's column, before they are
    orthogonalised: a zero Q column (the step that left it had a zero average, or a rank-
    deficient one, whose dependent columns orthogonalize zeroes) would otherwise stay zero for
    good, that direction never sent again while its error grows. On the device and without a
    host read (no synchronisation per bucket): a column that is not zero is kept as it is. Q
    was all-reduced, so every rank refills the same columns with the same values. fillers: a
    cache of _filler's matrices (the same every step)."""
    for q in qs:
        zero = (q == 0).all(dim=0)
        key = (tuple(q.shape), q.device, q.dtype)
        if key not in fillers:
            fillers[key] = _filler(q.shape, q.device, q.dtype)
        q.copy_(torch.where(zero, fillers[key], q))


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _count(who, name, value):
    """A saved count (an int, or a one-element integer tensor) >= 0."""
    try:
        count = operator.index(value)
    except TypeError:
        raise ValueError(f"{who}: '{name}' is a {type(value).__name__}, not an int") from None
    if count < 0:
        raise ValueError(f"{who}: '{name}' is {count}, not >= 0")
    return count


def _layout(who, key, saved):
    """A saved bucket layout (elements, dtype name, gradient shapes) as compressed_average_
    keeps it: (int, torch.dtype, tuple of shape tuples)."""
    try:
        n, dtype, shapes = saved
        n = operator.index(n)
        torch_dtype = getattr(torch, str(dtype).split(".")[-1], None)
        shapes = tuple(tuple(operator.index(d) for d in s) for s in shapes)
    except (TypeError, ValueError):
        torch_dtype = None
    if not (isinstance(torch_dtype, torch.dtype) and torch_dtype.is_floating_point and n >= 0
            and all(d >= 0 for s in shapes for d in s)):
        raise ValueError(f"{who}: 'layouts' of bucket {key!r} is {saved!r}, not (elements, "
                         f"floating dtype name, gradient shapes)")
    return n, torch_dtype, shapes


def _rng_state_to_torch(state):
    """numpy's RandomState state as tensors and numbers (loadable with weights_only=True)."""
    name, keys, pos, has_gauss, cached = state
    return {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def _rng_state_from_torch(state):
    return (state["name"], state["keys"].numpy().astype(np.uint32), state["pos"],
            state["has_gauss"], state["cached_gaussian"])


def powersgd_hook(state, bucket):
    """DDP communication hook: `ddp.register_comm_hook(state, powersgd_hook)`.

    state: a fastllm.distributed.PowerSGD; bucket: torch.distributed.GradBucket. Returns a
    completed future holding the bucket's averaged (compressed) gradients.
    """
    if not isinstance(state, PowerSGD):
        raise TypeError(f"fastllm.distributed.powersgd_hook: state must be a "
                        f"fastllm.distributed.PowerSGD, got {type(state).__name__}")
    buffer = bucket.buffer()
    state.reduce_(buffer, bucket.gradients(), bucket.index(), bucket.is_last(),
                  bucket.parameters())
    fut = torch.futures.Future()
    fut.set_result(buffer)
    return fut
