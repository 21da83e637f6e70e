"""fastllm.distributed.DistributedOptimizer: ZeRO-1/2 over contiguous flat gradient buckets.

Layout (Megatron-LM's distributed optimizer, written here for torch.distributed):
    - The trainable params, in reverse registration order (about the order backward produces
      their grads), are cut into buckets of at most bucket_cap_mb, one dtype per bucket. Each
      bucket owns a flat param buffer and a flat grad buffer of `padded` elements; every param
      becomes a view into the param buffer, starting at a multiple of ALIGN elements, and
      `padded` is a multiple of W * ALIGN (W the world size), so every param and every rank's
      shard starts 16-byte aligned (vector loads in the optimizer's kernels, cuBLAS's aligned
      paths for the params' matmuls); the gaps are zeros that stay zeros.
    - Rank r owns elements [r * padded / W, (r + 1) * padded / W) of every bucket: each rank
      holds exactly the same number of elements (the pads, fewer than ALIGN per param and
      W * ALIGN per bucket, included), independent of tensor boundaries
      (ZeroRedundancyOptimizer assigns whole tensors).
    - A post-accumulate-grad hook per param counts the bucket's grads; when a bucket is complete
      (and all earlier buckets have been launched, so every rank issues collectives in the same
      order) its all-reduce (stage 1) or reduce-scatter (stage 2) starts asynchronously, while
      backward continues. `step()` waits only for what is still in flight.
    - The optimizer (optimizer_class, default fastllm.optim.AdamW) runs over one flat shard per
      bucket: one fused pass each. For bf16/fp16 params the shard it updates is an fp32 master
      copy and grads are reduced in fp32; the params are rewritten from the masters by
      fastllm::scaled_copy. fp64 params keep fp64 buckets, scaled by plain torch ops (params of
      other dtypes are refused at construction). Updated shards are all-gathered bucket by
      bucket, either at once or (overlap_param_gather) waited for by the forward pre-hook of the
      module that owns them (fastllm/distributed/param_gather.py says exactly which forward
      reads are current).

Where a grad cannot be a view of its bucket (fp32 reduction of bf16 grads, or a grad that a user
replaced before its hook fired), it is packed into the bucket by fastllm::scaled_copy then.

grad_compression (a fastllm.distributed.PowerSGD, the same state the DDP hook takes): from its
start_iter on, each complete bucket is averaged by PowerSGD.compressed_average_ (the matrices of
the bucket batched, vectors and small matrices uncompressed, error feedback on the bucket) instead
of the all-reduce / reduce-scatter of sums: every rank then holds the whole approximate average,
and uses its shard of it (stage 1 and 2 alike). Before start_iter the plain path runs.

GaLore (optimizer_class=fastllm.optim.GaLoreAdamW): the projection needs the whole reduced
gradient matrix, identical on every rank. Projected params get buckets of their own that are
all-reduced (not reduce-scattered, also at stage 2) and are not sharded: every rank computes the
same projector (the same seeded range finder on the same averaged grad) and the same small
low-rank Adam state (r x cols or rows x r), and updates the whole param, so these buckets skip
the param all-gather. Their traffic, one all-reduce, equals stage 2's reduce-scatter plus
all-gather; the replicated state is the low-rank moments and the projector only.
"""

import contextlib
import math

import torch
import torch.distributed as dist

from fastllm.distributed import failure
from fastllm.distributed.optimizer_args import (_check_arguments, _check_param_dtypes,
                                                _check_same_model, _galore_options,
                                                _galore_param_ids, _group_layout,
                                                _no_decay_ids)
from fastllm.distributed.optimizer_state import _LOW_PRECISION, DistributedOptimizerState
from fastllm.distributed.param_gather import DistributedParamGather
from fastllm.ops.scaled_copy import scaled_copy
from fastllm.optim.grad_norm import clip_coefficient, global_grad_norm

__all__ = ["DistributedOptimizer"]

_WHO = "fastllm.distributed.DistributedOptimizer"

# torch 2.13 renamed the flat collectives; older versions only have the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# Every param of a bucket and every rank's shard starts at a multiple of this many elements: 16
# bytes of bf16/fp16 params, 32 of fp32 ones and of fp32 grads and masters.
ALIGN = 8


def _scaled_copy(dst, src, factor, divisor=None):
    """dst = src * factor / divisor: fastllm::scaled_copy (one fp32 factor) for its dtypes, and
    for fp64 buckets plain torch ops in fp64 (factor 1/W is exact for W a power of two)."""
    if dst.dtype != torch.float64:
        scaled_copy([dst], [src], factor, divisor)
        return
    torch.mul(src.reshape(dst.shape), factor, out=dst)
    if divisor is not None:
        dst.div_(divisor.to(device=dst.device, dtype=dst.dtype))


def _divisor(scale, coef, dtype):
    """The loss scale over the clip coefficient as a one-element `dtype` tensor on the CPU
    (None when neither applies): what a bucket of grads of `dtype` is divided by."""
    if scale is None and coef is None:
        return None
    divisor = torch.ones((), dtype=dtype)
    if scale is not None:
        divisor = divisor * scale.to(dtype).cpu()
    if coef is not None:
        divisor = divisor / coef.to(dtype).cpu()
    return divisor


class _Bucket:
    """One flat bucket: params (views into `param_flat`), their grads, this rank's shard."""

    def __init__(self, index, params, names, dtype, grad_dtype, world, rank, device,
                 replicated=False, decayed=True):
        self.index = index
        # Replicated (GaLore-projected params): all-reduced and updated whole on every rank.
        self.replicated = replicated
        self.decayed = decayed  # False: its params are no_decay's (weight_decay 0)
        self.params = params
        self.names = names
        self.dtype = dtype
        self.offsets = []
        numel = 0
        for p in params:
            numel = -(-numel // ALIGN) * ALIGN
            self.offsets.append(numel)
            numel += p.numel()
        self.numel = numel
        self.padded = -(-numel // (world * ALIGN)) * (world * ALIGN)
        self.shard_size = self.padded // world
        self.lo = rank * self.shard_size
        self.hi = self.lo + self.shard_size
        self.param_flat = torch.zeros(self.padded, dtype=dtype, device=device)
        self.grad_flat = torch.zeros(self.padded, dtype=grad_dtype, device=device)
        for p, off in zip(params, self.offsets):
            self.param_flat[off:off + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.param_flat[off:off + p.numel()].view_as(p)
        self.grad_views = [self.grad_flat[off:off + p.numel()].view_as(p)
                           for p, off in zip(params, self.offsets)]
        self.views_are_grads = grad_dtype == dtype
        self.ready = set()
        self.work = None
        self.launched = False
        self.gather_work = None
        self.shard_grad = None  # the reduced (summed) grad of this rank's shard once launched
        self.launch_version = None  # grad_flat's version when its reduction was launched

    def overlaps(self, i):
        """(param index i's element range inside this rank's shard) as (lo, hi) in param
        coordinates and the shard offset, or None."""
        off, n = self.offsets[i], self.params[i].numel()
        a, b = max(off, self.lo), min(off + n, self.hi)
        if a >= b:
            return None
        return a - off, b - off, a - self.lo


class DistributedOptimizer(DistributedOptimizerState, DistributedParamGather):
    """ZeRO-1/2 data parallel training with one fused optimizer pass per rank's flat shard.

    Args:
        model: the nn.Module, identical on every rank (checked at construction: the error names
            the first parameter whose name, shape or dtype differs).
        optimizer_class: runs the update on the flat shards (default fastllm.optim.AdamW; any
            torch.optim.Optimizer taking a list of tensors works, e.g. torch.optim.AdamW).
        stage: 1 (grads all-reduced, each rank updates its shard) or 2 (grads reduce-scattered:
            each rank receives only its shard's grads; p.grad keeps the local, unreduced grad).
        process_group: the data-parallel group (None: the default group).
        bucket_cap_mb: bucket size limit in MiB of param dtype.
        overlap_grad_reduce: start each bucket's reduction from the grad hooks during backward
            (False: all at step()).
        overlap_param_gather: opt-in (default False, as Megatron's): after step(), all-gather
            asynchronously and let the next forward wait per module. Inside model's forward a
            param is current when read in its own module's forward, or when its module's
            forward never ran (waited for at model's forward start); read before its own
            module runs in the same forward, or in any way outside model's forward (e.g.
            model.parameters() for an EMA or a metric), it may be the previous step's, or half
            updated, until finish_param_sync() or model.state_dict(); writing them directly
            (p.data.copy_, swapping EMA weights in) also needs finish_param_sync() first, or the
            gather lands over what was written (model.load_state_dict() waits itself). False:
            step() returns with every param updated.
        timeout: seconds or timedelta; a collective that does not finish in time raises
            fastllm.distributed.DistributedFailure naming the rank that failed.
        grad_compression: a fastllm.distributed.PowerSGD (None: exact reduction). Its
            process_group must be this one; not with loss_scaler (the error feedback would mix
            loss scales and keep inf/nan).
        no_decay: names of trainable parameters trained without weight decay (biases and norm
            weights, as Hugging Face's Trainer and fastllm.optim.BAdam's no_decay; the same on
            every rank): their buckets hold no decayed params, and their shards form an inner
            param group of their own with weight_decay 0.
        **optimizer_kwargs: passed to optimizer_class (lr, betas, weight_decay, ...), except
            max_grad_norm (clip by the global norm over all ranks), loss_scaler (a
            fastllm.amp.LossScaler: grads are unscaled and inf/nan steps skipped on every rank
            together) and master_weights (always on for bf16/fp16 params), applied here.
            With optimizer_class=fastllm.optim.GaLoreAdamW: rank, update_proj_gap, scale and
            proj_type form the projected param group, galore_params (default: every 2-D
            trainable param; fp32 only) picks its params, power_iters and seed are
            GaLoreAdamW's; the other params are sharded and get its plain AdamW update. The
            inner optimizer is then one GaLoreAdamW with groups [galore_params, flat shards]:
            the same projectors and updates as a single-process GaLoreAdamW with groups
            [galore_params, the other params] (model order in both; with no_decay, each of the
            two split into its decayed params, then its no_decay ones).

    `optimizer.grad_norm`, `step_skipped`, `skipped_steps` are as in fastllm.optim.AdamW; the
    inner optimizer is `self.optimizer` (wrap it in an LR scheduler). Its param groups, each only
    if it has params: [GaLore-projected decayed, projected no_decay, decayed, no_decay] (one
    group without GaLore and no_decay); state_dict() has the same groups, each with its params
    in model order, as a single-process optimizer built with those groups saves it.

    Grads: between zero_grad() and step() each p.grad is a view of its bucket (bf16/fp16 params:
    a grad of their own, packed into the fp32 bucket when it is complete). After the reduction
    the bucket holds the sum over ranks (stage 1, GaLore-projected params) or still the local
    grads (stage 2), or with grad_compression the approximate average (both stages); read
    `grad_norm` rather than p.grad after step(). Params unused in a step get a zero grad and are
    still stepped (torch.optim.AdamW skips a None grad). Clip with max_grad_norm: step() refuses
    (both stages) grads edited in place or replaced (p.grad = ...) after their bucket's
    reduction was launched in backward (bf16 grads are packed, p.grad None). Rank 0's params and
    buffers are broadcast at construction, as by DDP (buffers are not re-broadcast at every
    forward, unlike DDP's default broadcast_buffers=True); a bf16 param written through gets
    its master resynced. After step() the params are being all-gathered: the next forward
    (overlap_param_gather), model.state_dict() or model.load_state_dict() waits for them; call
    finish_param_sync() before reading or writing them any other way.
    """

    def __init__(self, model, optimizer_class=None, stage=2, process_group=None,
                 bucket_cap_mb=25, overlap_grad_reduce=True, overlap_param_gather=False,
                 timeout=None, grad_compression=None, no_decay=(), **optimizer_kwargs):
        if optimizer_class is None:
            from fastllm.optim import AdamW as optimizer_class
        galore = _galore_options(optimizer_class, optimizer_kwargs)
        _check_arguments(model, stage, process_group, bucket_cap_mb, grad_compression,
                         optimizer_kwargs)
        self.stage = stage
        self.grad_compression = grad_compression
        self.group = process_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.timeout = timeout
        self.overlap_grad_reduce = bool(overlap_grad_reduce)
        self.overlap_param_gather = bool(overlap_param_gather)
        self.max_grad_norm = optimizer_kwargs.pop("max_grad_norm", None)
        self.loss_scaler = optimizer_kwargs.pop("loss_scaler", None)
        optimizer_kwargs.pop("master_weights", None)
        if self.max_grad_norm is not None:
            self.max_grad_norm = float(self.max_grad_norm)
            if not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
                raise ValueError(f"fastllm.distributed.DistributedOptimizer: max_grad_norm must "
                                 f"be finite and > 0, got {self.max_grad_norm}")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("fastllm.distributed.DistributedOptimizer: the model has no "
                             "parameters that require grad")
        _check_param_dtypes(named)
        no_decay_ids = _no_decay_ids(no_decay, named)
        _check_same_model(named, list(model.named_buffers()), self.world, self.rank,
                          self.group, no_decay_ids)
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        galore_ids = set() if galore is None else _galore_param_ids(galore, named)
        # The inner param groups as (params in model order, projected, decayed): the params of
        # each are state_dict's group layout.
        layout = _group_layout(self.params, galore_ids, no_decay_ids)
        self._group_params = [params for params, _, _ in layout]
        self.grad_norm = None
        self.step_skipped = False
        self.skipped_steps = 0
        self._sync = True
        self._gathers_pending = False

        self.buckets = self._make_buckets(named, bucket_cap_mb, galore_ids, no_decay_ids)
        # rank 0's values everywhere, as DDP broadcasts them at construction: ranks seeded
        # differently would each update their own shard of their own model (a splice of both)
        src = dist.get_global_rank(self.group or dist.group.WORLD, 0)
        for b in self.buckets:
            dist.broadcast(b.param_flat, src=src, group=self.group)
        # and its buffers, as DDP at construction (not again at every forward, as DDP's
        # broadcast_buffers=True does): a buffer drawn at random would differ across ranks
        with torch.no_grad():
            for buf in model.buffers():
                flat = buf if buf.is_contiguous() else buf.contiguous()
                dist.broadcast(flat, src=src, group=self.group)
                if flat is not buf:
                    buf.copy_(flat)
        self._where = {}  # id(param) -> (bucket, index in bucket)
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._where[id(p)] = (b, i)
        shard_params = {True: [], False: []}  # decayed -> the flat shards, in bucket order
        for b in self.buckets:
            shard = b.param_flat[b.lo:b.hi]
            if b.dtype in _LOW_PRECISION:
                b.shard_param = shard.float()  # the fp32 master of this rank's shard
                b.versions = [p._version for p in b.params]  # (what _resync_masters compares)
            else:
                b.shard_param = shard  # a view: the update lands in the params directly
            if not b.replicated:
                shard_params[b.decayed].append(b.shard_param)
        if len(layout) == 1 and layout[0][1:] == (False, True):  # one plain group: a list
            self.optimizer = optimizer_class(shard_params[True], **optimizer_kwargs)
        else:
            groups = []
            for params, projected, decayed in layout:
                group = (dict(params=params, **galore) if projected
                         else {"params": shard_params[decayed]})
                if not decayed:
                    group["weight_decay"] = 0.0
                groups.append(group)
            self.optimizer = optimizer_class(groups, **optimizer_kwargs)
        self._attach_grads()
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready)
                       for p in self.params]
        # Reading the params (state_dict) must not race with an all-gather still in flight, nor
        # writing them (model.load_state_dict): the gather would land over the loaded values.
        def sync(*args, **kwargs):
            self.finish_param_sync()

        self._state_dict_hook = model.register_state_dict_pre_hook(sync)
        self._load_state_dict_hook = model.register_load_state_dict_pre_hook(sync)
        self._register_gather_waits(model)

    @property
    def _required_state(self):
        """The per-param state keys a loaded entry must hold: Adam's moments for the AdamW
        family (whose step() would fail on a state without them), nothing otherwise."""
        if "Adam" in type(self.optimizer).__name__:
            return ("step", "exp_avg", "exp_avg_sq")
        return ()

    # construction ------------------------------------------------------------------------------
    def _make_buckets(self, named, bucket_cap_mb, replicated_ids=(), no_decay_ids=()):
        cap_bytes = bucket_cap_mb * 1024 * 1024
        open_buckets, done = {}, []
        for name, p in reversed(named):
            # (one decay flag per bucket: its flat shard belongs to one inner param group)
            key = (p.dtype, p.device, id(p) in replicated_ids, id(p) not in no_decay_ids)
            cur = open_buckets.setdefault(key, ([], [], 0))
            size = p.numel() * p.element_size()
            if cur[0] and cur[2] + size > cap_bytes:
                done.append((key, cur))
                cur = ([], [], 0)
            cur[0].append(p)
            cur[1].append(name)
            open_buckets[key] = (cur[0], cur[1], cur[2] + size)
        done.extend(open_buckets.items())
        # Order buckets by the position of their first param in reverse registration order, so
        # they are launched in about the order backward completes them.
        order = {id(p): i for i, (_, p) in enumerate(reversed(named))}
        done.sort(key=lambda kv: order[id(kv[1][0][0])])
        buckets = []
        for i, ((dtype, device, replicated, decayed), (params, names, _)) in enumerate(done):
            grad_dtype = torch.float32 if dtype in _LOW_PRECISION else dtype
            buckets.append(_Bucket(i, params, names, dtype, grad_dtype, self.world, self.rank,
                                   device, replicated, decayed))
        return buckets

    def _attach_grads(self):
        for b in self.buckets:
            for p, view in zip(b.params, b.grad_views):
                p.grad = view if b.views_are_grads else None

    # backward ----------------------------------------------------------------------------------
    def _grad_ready(self, p):
        if not self._sync:
            return
        b, i = self._where[id(p)]
        if b.launched:
            # This grad was just added into a bucket whose reduction is already in flight.
            raise RuntimeError(
                "fastllm.distributed.DistributedOptimizer: a second backward reached "
                f"{b.names[i]} before step(); accumulate gradients inside optimizer.no_sync() "
                "and call backward outside it only for the last micro-batch")
        if p.grad is not None and p.grad.data_ptr() != b.grad_views[i].data_ptr():
            self._pack(b, i, p)
        b.ready.add(i)
        if len(b.ready) == len(b.params) and self.overlap_grad_reduce:
            self._launch_ready()

    def _launch_ready(self, force=False):
        """Launch buckets in index order: every rank issues collectives in the same order."""
        for b in self.buckets:
            if b.launched:
                continue
            if not force and len(b.ready) < len(b.params):
                return
            self._launch(b)

    def _launch(self, b):
        comp = self.grad_compression
        if comp is not None and comp.compressing:
            # Synchronous, as in the DDP hook; every rank gets the whole approximate average.
            comp.compressed_average_(b.grad_flat, b.grad_views, b.index)
            b.shard_grad = b.grad_flat[b.lo:b.hi]
        elif self.stage == 1 or b.replicated:
            b.work = dist.all_reduce(b.grad_flat, group=self.group, async_op=True)
            b.shard_grad = b.grad_flat[b.lo:b.hi]
        else:
            b.shard_grad = torch.empty(b.shard_size, dtype=b.grad_flat.dtype,
                                       device=b.grad_flat.device)
            b.work = _reduce_scatter(b.shard_grad, b.grad_flat, group=self.group,
                                     async_op=True)
        # Edits of the grads after this are not reduced, or race with the reduction: taken
        # after the call, so that whatever the collective itself counts is included (Gloo's
        # all_reduce and reduce-scatter leave the version as it is; PowerSGD's synchronous
        # average writes the bucket in place).
        b.launch_version = b.grad_flat._version
        b.launched = True

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate grads without reducing them (gradient accumulation); the backward after
        the block reduces the sum."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def finish_grad_sync(self):
        """Launch what backward did not (buckets with unused params, overlap off) and wait."""
        for b in self.buckets:  # grads that arrived while hooks were off (no_sync, set by hand)
            if b.launched:
                continue
            for i, p in enumerate(b.params):
                if p.grad is None:
                    if i not in b.ready:
                        # no grad since it was cleared (model.zero_grad() sets .grad to None and
                        # leaves the bucket): it adds nothing, not the last step's values (a
                        # packed grad, whose .grad is None too, is ready)
                        b.grad_views[i].zero_()
                elif p.grad.data_ptr() != b.grad_views[i].data_ptr():
                    self._pack(b, i, p)
        self._launch_ready(force=True)
        for b in self.buckets:
            if b.work is not None:
                failure.wait(b.work, f"gradient reduction of bucket {b.index}", self.timeout)
                b.work = None

    def _pack(self, b, i, p):
        """A grad that is not a view of its bucket (fp32 reduction of a bf16 grad, or a .grad
        someone replaced) is copied in; the bucket view becomes the grad where dtypes allow."""
        _scaled_copy(b.grad_views[i], p.grad.detach().contiguous(), 1.0)
        p.grad = b.grad_views[i] if b.views_are_grads else None

    # step --------------------------------------------------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @torch.no_grad()
    def step(self, closure=None):
        """Reduce the grads still in flight, update this rank's shard, all-gather the params.
        Returns closure's loss, if any."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._finish_param_gather()
        self._refuse_grads_edited_after_reduction()
        self.finish_grad_sync()
        self._resync_masters()
        # every bucket of this step was compressed iff the iteration it ran in compresses
        comp = self.grad_compression
        averaged = comp is not None and comp.compressing
        if comp is not None:
            comp.end_iteration()
        scale = None if self.loss_scaler is None else self.loss_scaler.scale_tensor()
        # Exact reductions leave sums, PowerSGD averages.
        factor = 1.0 if averaged else 1.0 / self.world
        coef = None
        needs_norm = (self.max_grad_norm is not None or self.loss_scaler is not None
                      or any(b.dtype in _LOW_PRECISION for b in self.buckets))
        if needs_norm:
            # One pass over the local shard grads, one tiny all-reduce: every rank sees the same
            # global norm, so clipping and the inf/nan skip are decided identically everywhere.
            try:
                group = self.group if self.group is not None else dist.group.WORLD
                # (fp32, fp64 when every shard is: an fp64 model clips as in fp64)
                norm = global_grad_norm(flat_shards=[b.shard_grad for b in self.buckets],
                                        flat_group=group) * factor
            except RuntimeError as exc:  # a peer failed: say which
                raise failure.collective_error("grad-norm all-reduce", exc) from exc
            if scale is not None:
                norm = norm / scale.to(norm.device)
            self.grad_norm = norm
            if not bool(torch.isfinite(norm)):
                self.step_skipped = True
                self.skipped_steps += 1
                if self.loss_scaler is not None:
                    self.loss_scaler.update(found_inf=True)
                self._reset_buckets()
                return loss
            if self.max_grad_norm is not None:
                coef = clip_coefficient(norm, self.max_grad_norm)
        self.step_skipped = False
        divisors = {dtype: _divisor(scale, coef, dtype)
                    for dtype in {b.grad_flat.dtype for b in self.buckets}}
        for b in self.buckets:
            divisor = divisors[b.grad_flat.dtype]
            if b.replicated:
                # The whole averaged grad, in place: its params' grads are views of it.
                _scaled_copy(b.grad_flat, b.grad_flat, factor, divisor)
                continue
            # The 1/W average, unscale and clip in one pass, into the grad the optimizer reads.
            grad = b.shard_grad
            if grad.dtype != b.shard_param.dtype:
                grad = torch.empty_like(b.shard_param)
            _scaled_copy(grad, b.shard_grad, factor, divisor)
            b.shard_param.grad = grad
        self.optimizer.step()
        for b in self.buckets:
            if b.replicated:
                continue
            b.shard_param.grad = None
            if b.shard_param.data_ptr() != b.param_flat[b.lo:b.hi].data_ptr():
                scaled_copy([b.param_flat[b.lo:b.hi]], [b.shard_param], 1.0)
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf=False)
        self._start_param_gather()
        if not self.overlap_param_gather:
            self._finish_param_gather()
        self._reset_buckets()
        return loss

    def _resync_masters(self):
        """A bf16/fp16 param written through since the last step (model.load_state_dict) gets
        its fp32 master's share of this shard from it, as fastllm.optim.AdamW resyncs (the step
        wrote the stale master back over it). Our own writes leave the param's version alone."""
        for b in self.buckets:
            if b.dtype not in _LOW_PRECISION or b.replicated:
                continue
            for i, p in enumerate(b.params):
                if p._version == b.versions[i]:
                    continue
                b.versions[i] = p._version
                where = b.overlaps(i)
                if where is not None:
                    lo, hi, at = where
                    b.shard_param[at:at + hi - lo].copy_(p.detach().reshape(-1)[lo:hi])

    def _refuse_grads_edited_after_reduction(self):
        """A bucket's reduction starts once its grads are complete, during backward: an edit of
        p.grad after that (clip_grad_norm_, p.grad = p.grad.clamp(...)) would never reach the
        update (stage 2 reduces into a shard of its own), or race with the all-reduce writing
        the bucket (stage 1). Refused before step() changes anything."""
        for b in self.buckets:
            if not b.launched:
                continue
            if b.grad_flat._version != b.launch_version:
                raise RuntimeError(
                    f"{_WHO}: grads of bucket {b.index} ({', '.join(b.names[:3])}"
                    f"{', ...' if len(b.names) > 3 else ''}) were changed in place after their "
                    f"reduction was launched (torch.nn.utils.clip_grad_norm_ "
                    f"between backward() and step()?), which the update would not see: clip "
                    f"with DistributedOptimizer(max_grad_norm=...) instead")
            for p, view, name in zip(b.params, b.grad_views, b.names):
                if p.grad is None or p.numel() == 0:
                    continue
                # (bf16/fp16 params: their grads were packed into the fp32 bucket, p.grad None)
                if not b.views_are_grads or p.grad.data_ptr() != view.data_ptr():
                    raise RuntimeError(
                        f"{_WHO}: the grad of {name} was replaced (p.grad = ...) after its "
                        f"bucket's reduction was launched in backward(), which the update would "
                        f"not see: clip with DistributedOptimizer(max_grad_norm=...) instead")

    def _reset_buckets(self):
        for b in self.buckets:
            b.ready.clear()
            b.launched = False
            b.shard_grad = None
            b.launch_version = None

    def zero_grad(self, set_to_none=True):
        """Zero the grad buckets (grads stay views of them; set_to_none is accepted for torch
        compatibility and makes no difference)."""
        for b in self.buckets:
            if b.work is not None:  # a reduction launched by a backward nobody stepped on
                failure.wait(b.work, f"gradient reduction of bucket {b.index}", self.timeout)
                b.work = None
            b.grad_flat.zero_()
        self._reset_buckets()
        self._attach_grads()

    def shard_numel(self):
        """Elements of this rank's shards (the pad included): the size of its optimizer state
        per state tensor."""
        return sum(b.shard_size for b in self.buckets)
