"""fastllm.optim.GaLoreAdamW: AdamW with gradients projected onto a low-rank subspace (GaLore,
Zhao et al. 2024, arXiv:2403.03507), a drop-in for galore-torch's `GaLoreAdamW`.

    groups = [{"params": matrices, "rank": 128, "update_proj_gap": 200, "scale": 0.25,
               "proj_type": "std"},
              {"params": others}]
    opt = fastllm.optim.GaLoreAdamW(groups, lr=1e-3, weight_decay=0.0)

Param groups with a `rank` key are projected: each 2-D param W (rows, cols) keeps an orthonormal
projector P and its Adam moments in the projected space, (r, cols) or (rows, r) instead of (rows,
cols). Every `update_proj_gap` steps (from the first) P is refreshed from the current gradient by a
randomised range finder: a few power iterations, warm-started from the previous P (a Gaussian start
the first time, from a generator seeded by `seed` and the param's position, so every data-parallel
rank draws the same), each orthonormalised by fastllm::orthogonalize. That costs a few (rows x cols
x r) matmuls instead of a full SVD, and does not fail to converge on ill-conditioned or
low-precision gradients. The step itself is one fastllm::galore_adam_step per matrix: project, Adam
in the low-rank space, back-project times `scale`, decoupled weight decay. Params of other groups
(and non-matrix params of rank groups) get fastllm's AdamW update (fastllm::adamw_step) in the same
step.

proj_type (galore-torch's): "std" projects from the shorter side (left, P (rows, r), when
rows < cols; else right, P (cols, r)), "reverse_std" the other way, "left"/"right" always that
side. The update rule is torch.optim.AdamW's (eps added after the bias correction, weight decay
applied before the update), which galore-torch's differs from in those two details; the
defaults (eps 1e-6, weight_decay 0) are galore-torch's. Gradients must be the full matrices:
under DDP the projection is computed from the averaged gradient, identical on every rank.
State per projected param: `step`, `exp_avg`, `exp_avg_sq` (low-rank, fp32) and `projector`
(fp32), in `state_dict()`.

Under FSDP2 (`fully_shard`: params and grads are DTensors sharded on dim 0 over a 1-D mesh, the
grads already averaged): a projector refresh all-gathers the gradient (`full_tensor()`, once per
update_proj_gap steps), so every rank runs the same range finder on the same matrix as one process
would. Between refreshes, with the rows sharded, a right projection (P (cols, r)) is row-local (the
low-rank grad G_local P, its moments (local rows, r) and the update: the fused step on the local
shard, no communication); a left one (P (rows, r)) all-reduces P^T G, the sum over ranks of
P_local^T G_local, (r, cols) per param and step, its moments replicated, each rank writing its rows
P_local N of the update. Under fastllm.distributed.DistributedOptimizer projected params are
all-reduced and updated whole on every rank (see its docstring).

Every step first takes the global grad norm (one fastllm::l2norm pass; over the mesh for DTensor
grads). A step whose grads hold an inf or nan changes nothing: no param, moment, projector or step
count moves, `step_skipped` is True and `skipped_steps` counts it, as fastllm.optim.AdamW with its
mixed-precision options. The keyword-only options are AdamW's: max_grad_norm clips by that norm,
loss_scaler (a fastllm.amp.LossScaler) unscales the grads inside the step and is updated by it,
master_weights keeps an fp32 copy (state 'master_param') of every bf16/fp16 param and steps that.
torch.amp.GradScaler works as with any optimizer (it unscales the grads and skips step() on inf/nan
itself).
"""

import math

import torch
import torch.distributed as dist

from fastllm._dtensor import is_dtensor, local
from fastllm.amp import LossScaler
from fastllm.ops.adamw import adamw_step
from fastllm.ops.adamw_master import adamw_master_step
from fastllm.ops.galore_adam_step import galore_adam_step, low_rank_adam_update_
from fastllm.ops.orthogonalize import orthogonalize
from fastllm.optim._galore_state import (check_loaded, check_step_state, refuse_unsupported,
                                          restore_loaded, saved_skips)
from fastllm.optim._hyper import check_hyperparameters, refuse_duplicates
from fastllm.optim._master_versions import (versions_after_copy, versions_in_sync,
                                            written_version)
from fastllm.optim.adamw import held_back
from fastllm.optim.grad_norm import global_grad_norm

__all__ = ["GaLoreAdamW", "range_finder"]

_PROJ_TYPES = ("std", "reverse_std", "left", "right")
_LOW_PRECISION = (torch.bfloat16, torch.float16)
_OWNER = "fastllm.optim.GaLoreAdamW"
_GROUP_KEYS = ("rank", "update_proj_gap", "scale", "proj_type")


def range_finder(a, rank, previous=None, power_iters=2, generator=None):
    """An orthonormal (rows, rank) basis of the dominant column space of a (rows, cols).

    Subspace iteration (Halko, Martinsson and Tropp 2011, Algorithm 4.4): start from `previous`
    (rows, rank) or from A times a Gaussian (cols, rank) matrix, then `power_iters` times
    Z = orth(A^T Y), Y = orth(A Z). Computed in fp32 (fp64 for fp64 input). The columns are
    orthonormal even when A has rank < `rank` (completed by a QR, as an SVD's would be).
    """
    dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
    a = a.to(dtype)
    if previous is None:
        omega = torch.randn(a.shape[1], rank, generator=generator, dtype=dtype)
        y = a @ omega.to(a.device)
        orthogonalize([y])
        power_iters += 1  # a random start is further from the answer than a warm one
    else:
        y = previous.to(dtype).contiguous()
    for _ in range(power_iters):
        z = a.t() @ y
        orthogonalize([z])
        y = a @ z
        orthogonalize([y])
    # Gram-Schmidt keeps a zero column zero and turns a column inside the span of earlier ones
    # (a gradient of rank < `rank`, or zero) into normalised rounding noise in that span: P
    # is then not orthonormal (P P^T doubles what it projects), and a zero column, warm-started,
    # stays zero at every later refresh (a zero first gradient froze the matrix for good).
    # Householder QR returns orthonormal columns whatever the rank, as galore-torch's SVD does.
    gram = y.t() @ y
    gram.diagonal().sub_(1.0)
    if not bool(gram.abs().max() <= (1e-4 if dtype == torch.float32 else 1e-10)):
        y = torch.linalg.qr(y).Q
    return y


class GaLoreAdamW(torch.optim.Optimizer):
    """AdamW whose `rank` param groups keep their moments in a low-rank gradient subspace.

    Args: params (iterable of tensors or param groups; groups may set rank, update_proj_gap,
    scale, proj_type), lr, betas, eps, weight_decay as torch.optim.AdamW (defaults as
    galore-torch: eps 1e-6, weight_decay 0); correct_bias must stay True (galore-torch's flag);
    power_iters: power iterations per projector refresh; seed: seeds the first projectors;
    max_grad_norm, loss_scaler, master_weights: as fastllm.optim.AdamW (module docstring).
    torch.optim.AdamW's maximize and amsgrad are not supported: a group (or a loaded
    state_dict's) that sets either is refused.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.0,
                 correct_bias=True, no_deprecation_warning=True, *, power_iters=2, seed=0,
                 max_grad_norm=None, loss_scaler=None, master_weights=False):
        if not correct_bias:
            raise ValueError("fastllm.optim.GaLoreAdamW: correct_bias=False is not supported")
        check_hyperparameters("defaults", lr, betas, eps, weight_decay, _OWNER)
        if not (isinstance(power_iters, int) and power_iters >= 1):
            raise ValueError(f"fastllm.optim.GaLoreAdamW: power_iters must be an int >= 1, got "
                             f"{power_iters!r}")
        if max_grad_norm is not None:
            max_grad_norm = float(max_grad_norm)
            if not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
                raise ValueError(f"fastllm.optim.GaLoreAdamW: max_grad_norm must be finite and "
                                 f"> 0, got {max_grad_norm}")
        if loss_scaler is not None and not isinstance(loss_scaler, LossScaler):
            raise TypeError(f"fastllm.optim.GaLoreAdamW: loss_scaler must be a "
                            f"fastllm.amp.LossScaler, got {type(loss_scaler).__name__}")
        self.power_iters = power_iters
        self.seed = seed
        self.max_grad_norm = max_grad_norm
        self.loss_scaler = loss_scaler
        self.master_weights = bool(master_weights)
        self.grad_norm = None
        self.step_skipped = False
        self.skipped_steps = 0
        # param -> written_version (fastllm/optim/_master_versions.py) right after this
        # optimizer last wrote it from its master
        self._written_versions = {}
        self._sides = {}  # projected param -> left, as its low-rank state was made or loaded
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def __getstate__(self):
        """All attributes but torch's hooks (torch's own __getstate__ leaves them behind too),
        so that a deep copy or a pickle (torch.save) of the optimizer steps on as it would."""
        state = {k: v for k, v in self.__dict__.items() if not k.startswith("_optimizer_")}
        state["_written_versions"] = versions_in_sync(self._written_versions)
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._written_versions = versions_after_copy(self._written_versions)

    def add_param_group(self, param_group):
        """torch's add_param_group, with a `rank` group's GaLore keys defaulted and checked
        before the group is added (torch.optim.Optimizer.__init__ calls it for every group)."""
        gi = len(self.param_groups)
        refuse_unsupported(f"{_OWNER}: param group {gi}", param_group)
        if isinstance(param_group, dict) and "rank" in param_group:
            group = param_group
            group.setdefault("update_proj_gap", 200)
            group.setdefault("scale", 0.25)
            group.setdefault("proj_type", "std")
            _check_rank_group(gi, group)
        elif isinstance(param_group, dict):
            stray = [k for k in _GROUP_KEYS if k in param_group]
            if stray:
                raise ValueError(f"fastllm.optim.GaLoreAdamW: param group {gi} sets {stray} "
                                 f"without 'rank' (only rank groups are projected)")
        refuse_duplicates("fastllm.optim.GaLoreAdamW", param_group, gi)
        super().add_param_group(param_group)

    @staticmethod
    def _left(group, p):
        rows, cols = p.shape
        kind = group["proj_type"]
        if kind in ("left", "right"):
            return kind == "left"
        return (rows < cols) if kind == "std" else (rows >= cols)

    def _low_shape(self, group, p):
        """The shape of a projected param's low-rank moments under its group's rank and proj_type
        (the local rows of a row-sharded DTensor)."""
        rows, cols = p.shape
        rank = min(group["rank"], rows, cols)
        return (rank, cols) if self._left(group, p) else (
            _row_shard(p)[1] if is_dtensor(p) else rows, rank)

    def _projected(self, group, p):
        # (a zero-size matrix has no subspace: stepped as torch's AdamW, a no-op on no elements)
        return "rank" in group and p.dim() == 2 and p.numel() > 0

    def _validate(self):
        """Everything a step needs, checked before anything changes."""
        for gi, group in enumerate(self.param_groups):
            check_hyperparameters(f"param group {gi}", group["lr"], group["betas"],
                                  group["eps"], group["weight_decay"], _OWNER)
            refuse_unsupported(f"{_OWNER}: param group {gi}", group)
            if "rank" in group:  # (its keys may have been set since add_param_group)
                _check_rank_group(gi, group)
            for pi, p in enumerate(group["params"]):
                g = p.grad
                if g is None:
                    continue
                where = f"param {pi} of param group {gi} (shape {tuple(p.shape)})"
                if g.is_sparse:
                    raise RuntimeError(f"fastllm.optim.GaLoreAdamW does not support sparse "
                                       f"gradients ({where})")
                if g.shape != p.shape or g.dtype != p.dtype or g.device != p.device:
                    raise RuntimeError(f"fastllm.optim.GaLoreAdamW: the grad of {where} does not "
                                       f"match its param's shape, dtype and device")
                if not p.dtype.is_floating_point:
                    raise TypeError(f"fastllm.optim.GaLoreAdamW: {where} has dtype {p.dtype}")
                if p.is_meta:  # (fastllm.optim.AdamW steps them, as torch.optim.AdamW does)
                    raise RuntimeError(f"fastllm.optim.GaLoreAdamW: {where} is on the meta "
                                       f"device: no values to project (materialise the model, "
                                       f"e.g. model.to_empty(device=...), first)")
                if self._projected(group, p):
                    # (_row_shard refuses a DTensor layout the projected step cannot shard)
                    low, shape = self.state.get(p, {}).get("exp_avg"), self._low_shape(group, p)
                    left = self._left(group, p)  # (the side too: a square one's shapes agree)
                    if low is not None and (tuple(low.shape) != shape
                                            or self._sides.get(p, left) != left):
                        raise ValueError(
                            f"fastllm.optim.GaLoreAdamW: {where} has low-rank moments of shape "
                            f"{tuple(low.shape)}; its group's rank {group['rank']} and proj_type "
                            f"{group['proj_type']!r} now make {shape}: they cannot change once "
                            f"a param has state (start a new optimizer)")
                check_step_state(self, group, where, p)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._validate()
        norm, factor = self._grad_factor()
        # Every projector refresh (the range finders) before anything is written, so that one
        # that fails leaves the optimizer and the params as they were.
        projectors = {} if factor is None else self._new_projectors()
        self.grad_norm, self.step_skipped = norm, factor is None
        if factor is None:  # inf/nan: nothing changes but the skip count
            self.skipped_steps += 1
            if self.loss_scaler is not None:
                self.loss_scaler.update(found_inf=True)
            return loss
        # Every state (and a master missing from a state saved without master weights) before
        # the first update, so that nothing is stepped when one cannot be made.
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if self._projected(group, p):
                        self._projected_state(group, p)
                    else:
                        self._plain_state(p)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            plain = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self._projected(group, p):
                    plain.setdefault((p.device, p.dtype, self._has_master(p)), []).append(p)
                    continue
                self._projected_step(group, p, projectors.get(p), beta1, beta2, factor)
            for (device, _, master), params in plain.items():
                states = [self.state[p] for p in params]  # (made by the loop above)
                for s in states:
                    # moments loaded from torch.optim.AdamW's (or fastllm AdamW's) state of a
                    # non-contiguous param are in its strides; the kernels take contiguous ones
                    for key in ("exp_avg", "exp_avg_sq"):
                        if not s[key].is_contiguous():
                            s[key] = s[key].contiguous()
                    s["step"] += 1
                hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                             weight_decay=group["weight_decay"])
                # the kernels divide by grad_scale: 1 / factor folds unscaling and clipping
                scale = (None if factor == 1.0 else
                         torch.tensor(1.0 / factor, dtype=torch.float32, device=device))
                # DTensors (FSDP2): the elementwise update runs on the local shards; a
                # non-contiguous param is stepped as a contiguous copy, copied back after.
                targets = [_contiguous(local(p)) for p in params]
                grads = [local(p.grad).contiguous() for p in params]
                if master:
                    for p, s in zip(params, states):
                        self._resync_master(p, s)
                    adamw_master_step(targets, grads, [s["master_param"] for s in states],
                                      [s["exp_avg"] for s in states],
                                      [s["exp_avg_sq"] for s in states], [],
                                      [s["step"] for s in states], grad_scale=scale, **hyper)
                else:
                    adamw_step(targets, grads, [s["exp_avg"] for s in states],
                               [s["exp_avg_sq"] for s in states], [],
                               [s["step"] for s in states], grad_scale=scale, **hyper)
                for p, target in zip(params, targets):
                    if target is not local(p):
                        local(p).copy_(target)
                    if master:
                        self._written_versions[p] = written_version(p)
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf=False)
        return loss

    def _has_master(self, p):
        return self.master_weights and p.dtype in _LOW_PRECISION

    def _resync_master(self, p, state):
        """Copy p into its fp32 master when something outside the optimizer wrote p since this
        optimizer last did (model.load_state_dict, `p.data = w`): as fastllm.optim.AdamW, so
        that the step does not write the stale master back over the change."""
        version = self._written_versions.get(p)
        if version is not None and written_version(p) != version:
            state["master_param"].copy_(local(p).detach())

    def _grad_factor(self):
        """(the global grad norm, unscaled and before clipping, or None without grads; the
        factor each grad is multiplied by in the update, 1 / loss scale x clip coefficient, or
        None when the norm is inf/nan). Records nothing: step() does, once nothing can fail."""
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        scale = self.loss_scaler.get_scale() if self.loss_scaler is not None else 1.0
        if not grads:
            return None, 1.0
        norm = global_grad_norm(grads) / scale
        value = float(norm)  # the step already reads the step count back each matrix
        if not math.isfinite(value):
            return norm, None
        factor = 1.0 / scale
        if self.max_grad_norm is not None:
            # torch.nn.utils.clip_grad_norm_'s coefficient
            factor *= min(1.0, self.max_grad_norm / (value + 1e-6))
        return norm, factor

    def _new_projectors(self):
        """param -> its refreshed projector, for every projected param due a refresh this step
        (every update_proj_gap steps from the first); computed, not stored."""
        out, index = {}, 0
        for group in self.param_groups:
            for p in group["params"]:
                index += 1
                if p.grad is None or not self._projected(group, p):
                    continue
                state = self.state.get(p) or {}
                step = int(state["step"].item()) if "step" in state else 0
                previous = state.get("projector")
                if previous is not None and step % group["update_proj_gap"] != 0:
                    continue
                # sharded: the same full matrix on every rank, once per refresh
                grad = p.grad.full_tensor() if is_dtensor(p) else p.grad.contiguous()
                left = self._left(group, p)
                generator = None
                if previous is None:
                    generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index - 1)
                opmath = torch.float64 if p.dtype == torch.float64 else torch.float32
                out[p] = range_finder(grad if left else grad.t(), min(group["rank"], *p.shape),
                                      previous, self.power_iters, generator).to(opmath).contiguous()
        return out

    def _plain_state(self, p):
        state = self.state[p]
        fp32 = self._has_master(p)
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            zeros = (lambda: torch.zeros_like(local(p), dtype=torch.float32)) if fp32 else (
                lambda: torch.zeros_like(local(p), memory_format=torch.contiguous_format))
            state["exp_avg"] = zeros()
            state["exp_avg_sq"] = zeros()
        for key in ("exp_avg", "exp_avg_sq"):
            if fp32 and state[key].dtype != torch.float32:
                # (a state saved without master weights: its moments become fp32, as in AdamW)
                state[key] = state[key].float()
        self._add_master(p, state)
        return state

    def _add_master(self, p, state):
        """Give a low-precision param its fp32 master when master weights are on and its state
        has none (new, or saved without master weights: fastllm.optim.AdamW does the same)."""
        if self._has_master(p) and "master_param" not in state:
            state["master_param"] = local(p).detach().float().contiguous()

    def _projected_state(self, group, p):
        state = self.state[p]
        if not state:
            opmath = torch.float64 if p.dtype == torch.float64 else torch.float32
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            low_shape = self._low_shape(group, p)
            self._sides[p] = self._left(group, p)
            state["exp_avg"] = torch.zeros(low_shape, dtype=opmath, device=p.device)
            state["exp_avg_sq"] = torch.zeros(low_shape, dtype=opmath, device=p.device)
        self._add_master(p, state)
        return state

    def _projected_step(self, group, p, projector, beta1, beta2, factor=1.0):
        """The step of a projected param; `projector`: its refreshed projector (None: keep). Its
        state was made by step()'s first loop (_projected_state)."""
        state = self.state[p]
        left = self._left(group, p)
        sharded = is_dtensor(p)
        if sharded:
            offset, local_rows, process_group = _row_shard(p)
        grad = p.grad if sharded else p.grad.contiguous()
        step = int(state["step"].item())
        if projector is not None:
            state["projector"] = projector
        state["step"] += 1
        master = state.get("master_param")
        if master is not None:
            self._resync_master(p, state)
        if sharded:
            self._row_sharded_step(group, p, state, step + 1, left, beta1, beta2, offset,
                                   local_rows, process_group, factor, master)
        else:
            target = _contiguous(p) if master is None else master
            # unscaled/clipped in fp32 at least (in fp16 a loss-scaled grad's small entries were 0)
            work = target if factor == 1.0 or target.dtype.itemsize >= 4 else target.float()
            grad = grad.to(work.dtype) if factor == 1.0 else (grad.to(work.dtype) * factor)
            galore_adam_step(work, grad.contiguous(), state["projector"], state["exp_avg"],
                             state["exp_avg_sq"], step=step + 1, left=left, lr=group["lr"],
                             beta1=beta1, beta2=beta2, eps=group["eps"],
                             weight_decay=group["weight_decay"], scale=group["scale"])
            for dst, src in ((target, work), (p, target)):
                if dst is not src:
                    dst.copy_(src)
        if master is not None:
            self._written_versions[p] = written_version(p)

    @staticmethod
    def _row_sharded_step(group, p, state, step, left, beta1, beta2, offset, local_rows,
                          process_group, factor=1.0, master=None):
        """The projected step on this rank's rows [offset, offset + local_rows) of a DTensor
        (on its fp32 master rows when there is one); grads times `factor`."""
        param, grad = p.to_local(), p.grad.to_local()
        target = param if master is None else master
        proj = state["projector"]
        hyper = dict(step=step, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                     weight_decay=group["weight_decay"], scale=group["scale"])
        if not left:  # G P, its moments and P N^T are row-local
            grad = grad.to(target.dtype) if factor == 1.0 else grad.to(target.dtype) * factor
            galore_adam_step(target, grad.contiguous(), proj, state["exp_avg"],
                             state["exp_avg_sq"], left=False, **hyper)
        else:
            rows_proj = proj[offset:offset + local_rows]
            low = rows_proj.t() @ grad.to(proj.dtype)
            dist.all_reduce(low, group=process_group)  # P^T G, (r, cols)
            if factor != 1.0:
                low.mul_(factor)
            low_rank_adam_update_(target, low, rows_proj, state["exp_avg"], state["exp_avg_sq"],
                                  left=True, **hyper)
        if master is not None:
            param.copy_(master)

    def state_dict(self):
        """torch.optim.Optimizer.state_dict with a 'fastllm' entry holding the skip count (as
        fastllm.optim.AdamW's), so that a resumed run keeps counting; the state-dict post-hooks
        see the whole of it."""
        with held_back(self, "_optimizer_state_dict_post_hooks") as (post_hooks,):
            state_dict = super().state_dict()
        state_dict["fastllm"] = {"skipped_steps": int(self.skipped_steps)}
        for hook in post_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        return state_dict

    def load_state_dict(self, state_dict):
        """torch.optim.Optimizer.load_state_dict, keeping the low-rank state, fp32 masters and
        their moments as saved (torch casts every floating state tensor to its param's dtype;
        other params' moments keep that cast, as torch.optim.AdamW's). Every entry is checked
        against this optimizer's params first (keys, low-rank and full shapes; maximize and
        amsgrad, which GaLoreAdamW does not do, are refused): a state of another model or
        optimizer is refused before anything changes. The load-state-dict hooks run where torch
        runs them (fastllm.optim.AdamW.load_state_dict)."""
        state_dict = state_dict.copy()  # (shallow, as torch's: the pre-hooks may edit it)
        for hook in self._optimizer_load_state_dict_pre_hooks.values():
            result = hook(self, state_dict)
            if result is not None:
                state_dict = result
        check_loaded(self, state_dict)
        skipped = saved_skips(state_dict.get("fastllm"))
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        with held_back(self, "_optimizer_load_state_dict_pre_hooks",
                       "_optimizer_load_state_dict_post_hooks") as (_, post_hooks):
            super().load_state_dict(state_dict)
        self._written_versions.clear()  # a loaded master is the truth, not the param
        self._sides = {p: self._left(g, p) for g in self.param_groups for p in g["params"]
                       if self._projected(g, p) and "exp_avg" in self.state.get(p, {})}
        self.skipped_steps = skipped
        restore_loaded(self, state_dict, saved_ids)
        for hook in post_hooks.values():  # (they see the state as restored here, as in torch)
            hook(self)


def _check_rank_group(gi, group):
    """A projected group's keys, at add_param_group and before each step (a bad one set since
    failed mid-step, after the step count and projector had moved)."""
    where = f"fastllm.optim.GaLoreAdamW: param group {gi}"
    rank, gap, scale = group["rank"], group["update_proj_gap"], group["scale"]
    if not (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1):
        raise ValueError(f"{where}: rank must be an int >= 1, got {rank!r}")
    if not (isinstance(gap, int) and not isinstance(gap, bool) and gap >= 1):
        raise ValueError(f"{where}: update_proj_gap must be an int >= 1, got {gap!r}")
    if not (isinstance(scale, (int, float)) and not isinstance(scale, bool)
            and math.isfinite(scale) and scale >= 0):
        raise ValueError(f"{where}: scale must be a finite number >= 0, got {scale!r}")
    if group["proj_type"] not in _PROJ_TYPES:
        raise ValueError(f"{where}: proj_type {group['proj_type']!r} is not one of {_PROJ_TYPES}")


def _contiguous(t):
    """t, or a contiguous copy of it (stepped, then copied back into t)."""
    return t if t.is_contiguous() else t.contiguous()


def _row_shard(p):
    """(first row, local rows, process group) of a DTensor param sharded on dim 0 over a 1-D mesh
    (FSDP2's layout); anything else is refused."""
    from torch.distributed.tensor import Shard

    if p.device_mesh.ndim != 1 or len(p.placements) != 1 or p.placements[0] != Shard(0):
        raise NotImplementedError(f"fastllm.optim.GaLoreAdamW: a projected DTensor param must be "
                                  f"sharded on dim 0 over a 1-D mesh (FSDP2), got placements "
                                  f"{p.placements} on a {p.device_mesh.ndim}-D mesh")
    rows = p.shape[0]
    # Shard(0) splits as torch.chunk: ceil(rows / world) rows per rank, the last ones fewer.
    chunk = -(-rows // p.device_mesh.size())
    offset = min(p.device_mesh.get_local_rank(0) * chunk, rows)
    return offset, p.to_local().shape[0], p.device_mesh.get_group(0)
