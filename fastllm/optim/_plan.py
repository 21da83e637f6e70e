"""The step plan of fastllm.optim.AdamW: what a step does, worked out once and reused.

A step runs one fused op per (param group, device, param dtype, moment layout, kind). Building
those calls means checking every param, grad and state tensor and collecting lists of tensors;
none of it changes from step to step in a training loop, so a Plan keeps it:
    - the calls' tensor lists (local shards for DTensors) and their scalar kind;
    - the step counts of every call on one device as views of one 1-D buffer (`flat_steps`),
      so the per-step increment and a skipped step's decrement are one tiny op each instead of
      one per tensor, or none when the Triton step prologue advances them (not with
      capturable=True, where the step tensors must keep their addresses);
    - the checked hyperparameters of every group (re-checked when a value changes).
`Plan.still_valid` compares the params, their state dicts and grads with the ones the plan was
built for, by identity (a few tens of nanoseconds per tensor), whether each state dict is
empty (`optimizer.state[p].clear()`) and the params' layout; grads that are new tensors
(zero_grad with set_to_none, the default) are checked alone and swapped into the lists. After
each step the plan lets go of the grads (weak references kept: the same grads next step are put
back unchecked), so that zero_grad frees them as it does under torch.optim.
Anything else that changed (a param added or given other memory, a grad appearing or vanishing,
a state created, reset or removed) rebuilds the plan.
Params or grads that are not contiguous, and DTensors, are prepared again every step
(`Call.fast` False), as they were before plans existed.
"""

import itertools
import operator
import weakref

import torch

from fastllm._dtensor import is_dtensor, local
from fastllm.ops.adamw import adamw_step
from fastllm.ops.adamw8bit import PARAM_DTYPES as LOW_BYTE_DTYPES, adamw8bit_step
from fastllm.ops.adamw_master import adamw_master_step
from fastllm.optim._hyper import check_hyperparameters, describe, scalar, slot_name as _slot_name
from fastllm.optim._master_versions import resync_masters as _resync_masters
from fastllm.optim._master_versions import written_versions as _written_versions
from fastllm.optim.state_layout import LOW_PRECISION, qmaps

_MASK64 = (1 << 64) - 1


def mix_seed(*values):
    """A 63-bit seed from integers (splitmix64 steps): the stochastic-rounding key of one call."""
    z = 0
    for value in values:
        z = (z + 0x9E3779B97F4A7C15 + (int(value) & _MASK64)) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
    return z >> 1


# What Plan.grads holds for a grad the plan has let go of (release_grads): not None (a grad
# vanishing rebuilds the plan), not a tensor (any grad is a changed one)
_RELEASED = object()


def _held(ref):
    """What a weak reference of release_grads holds: None for a param without a grad, the grad,
    or _RELEASED once it is gone (a None grad now is a grad vanishing: the plan is rebuilt)."""
    if ref is None:
        return None
    grad = ref()
    return _RELEASED if grad is None else grad


def kind_of(p, master_weights, stochastic_rounding, kahan_summation):
    """'master', 'pure' or 'plain': which update a param gets."""
    if p.dtype in LOW_PRECISION:
        if master_weights:
            return "master"
        if stochastic_rounding or kahan_summation:
            return "pure"
    return "plain"


def check_grad(where, p, grad):
    if grad.is_sparse or grad.layout != torch.strided:
        raise RuntimeError(f"fastllm.optim.AdamW does not support sparse gradients ({where})")
    if torch.is_complex(p) or torch.is_complex(grad):
        raise RuntimeError(f"fastllm.optim.AdamW does not support complex parameters or "
                           f"gradients ({where}); use torch.view_as_real")
    if not p.dtype.is_floating_point:
        raise TypeError(f"fastllm.optim.AdamW: {where} has dtype {p.dtype}")
    if not torch.compiler.is_compiling() and p.is_neg():  # (a grad's is resolved: Call.tensors)
        raise RuntimeError(f"fastllm.optim.AdamW: {where} carries the negative bit (a "
                           f"_neg_view()), which the fused kernels cannot write through")
    if grad.device != p.device:
        raise RuntimeError(f"fastllm.optim.AdamW: the grad of {where} is on {grad.device} but "
                           f"the parameter is on {p.device}")
    if grad.dtype != p.dtype or grad.shape != p.shape:
        raise RuntimeError(f"fastllm.optim.AdamW: the grad of {where} has dtype {grad.dtype} "
                           f"and shape {tuple(grad.shape)}; expected {p.dtype} and "
                           f"{tuple(p.shape)}")


def _is_dense(t):
    """Whether t's elements fill one gap-free block of memory (in some order of its dims)."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _dense_views(tensors, writebacks):
    """(param, grad, states...) as contiguous tensors whose elements correspond one to one.

    Contiguous tensors pass through. A non-contiguous but dense param (channels_last, a
    transposed weight) is stepped in its own memory order: each tensor with the param's strides
    becomes a flat view of its storage, any other is copied into the param's layout first. A
    param with gaps is stepped on contiguous copies. Copies of written tensors are queued in
    `writebacks` as (tensor, copy), to be copied back after the kernels ran (the grad is only
    read)."""
    if all(t is None or t.is_contiguous() for t in tensors):
        return tensors
    p = tensors[0]
    flat = not p.is_contiguous() and _is_dense(p)
    out = []
    for i, t in enumerate(tensors):
        if t is None or (t.is_contiguous() and not flat):
            out.append(t)
            continue
        if flat and t.stride() == p.stride() and _is_dense(t):
            out.append(t.as_strided((t.numel(),), (1,)))
            continue
        copy = torch.empty_like(p, dtype=t.dtype) if flat else t.contiguous()
        if flat:
            copy.copy_(t)
        if i != 1:
            writebacks.append((t, copy))
        out.append(copy.as_strided((copy.numel(),), (1,)) if flat else copy)
    return out


class Call:
    """One fused op: the params of one (device, dtype, moment layout, kind) in one group."""

    __slots__ = ("mode", "kind", "device", "seed_index", "params", "grads", "masters",
                 "exp_avgs", "exp_avg_sqs", "absmax_m", "absmax_v", "extras", "steps", "flat",
                 "fast", "slots", "versions")

    def __init__(self, mode, kind, device, seed_index):
        self.mode, self.kind, self.device, self.seed_index = mode, kind, device, seed_index
        self.params, self.grads, self.masters, self.extras, self.steps = [], [], [], [], []
        self.exp_avgs, self.exp_avg_sqs, self.absmax_m, self.absmax_v = [], [], [], []
        self.flat = False  # steps are views of Plan.flat_steps
        self.fast = True
        self.slots = []  # each param's index in Plan.params
        # master kind: each param's _version right after the optimizer last wrote it (None:
        # never), kept here while the plan lives and in opt._written_versions otherwise.
        self.versions = []

    def tensors(self, opt):
        """(lists for the op, writebacks): the cached lists, or built again for a slow call."""
        if self.fast:
            return (self.params, self.grads, self.masters, self.exp_avgs, self.exp_avg_sqs,
                    self.absmax_m, self.absmax_v, self.extras), ()
        writebacks = []
        lists = ([], [], [], [], [], [], [], [])
        for p in self.params:
            state = opt.state[p]
            m, v, am, av = opt.moments.tensors(state, self.mode)
            extra = local_or_none(_extra(state, self.kind))
            param, grad, master = local(p), local(p.grad), local_or_none(state.get("master_param"))
            grad = grad.resolve_neg()  # the kernels read raw memory, blind to the negative bit
            if self.mode is None:
                param, grad, m, v, extra = _dense_views([param, grad, m, v, extra], writebacks)
            elif not param.is_contiguous():
                # The low-byte moments follow the param's logical order: step a copy.
                contiguous = param.contiguous()
                writebacks.append((param, contiguous))
                param, grad = contiguous, grad.contiguous()
            elif not grad.is_contiguous():
                grad = grad.contiguous()
            for lst, t in zip(lists, (param, grad, master, m, v, am, av, extra)):
                lst.append(t)
        return lists, writebacks


def local_or_none(t):
    return None if t is None else local(t)


def _extra(state, kind):
    """The third state tensor of a torch-layout call: max_exp_avg_sq (plain), the master or the
    Kahan buffer."""
    if kind == "plain":
        return state.get("max_exp_avg_sq")
    return state.get("master_param", state.get("kahan_comp"))


def check_amsgrad(opt, where):
    """Refuse amsgrad where the constructor refuses it (master weights, stochastic rounding,
    Kahan summation, low-byte state): a group may set it (in add_param_group, a loaded
    state_dict, by hand), and those steps would run without it."""
    if opt.master_weights or opt.stochastic_rounding or opt.kahan_summation:
        raise ValueError(f"fastllm.optim.AdamW: {where} has amsgrad=True, which is not "
                         f"supported with master_weights, stochastic_rounding or "
                         f"kahan_summation")
    if opt.moments.state_dtype is not None:
        raise ValueError(f"fastllm.optim.AdamW: {where} has amsgrad=True, which is not "
                         f"supported with low-byte state (state_dtype="
                         f"{opt.moments.state_dtype})")


def _layouts(tensors):
    """(dtype, shape, device index, negative bit) of each tensor (None for None): what
    `p.data = w` or `p.grad.data = g` can change without changing the tensor's identity (the
    kernels read raw memory, blind to a negative bit, on the device they were checked for)."""
    return [None if t is None else (t.dtype, t.shape, t.get_device(), t.is_neg())
            for t in tensors]


def _groups_seen(opt):
    """Each param group's size and amsgrad flag."""
    return [(len(g["params"]), g["amsgrad"]) for g in opt.param_groups]


class Plan:
    """Every call of one step (see the module docstring). Built by checking everything first,
    then initialising missing state: raises before anything changes."""

    def __init__(self, opt, params, grads, cached):
        self.params, self.grads, self.cached = params, grads, cached
        self.grad_refs = None  # release_grads' weak references to the last step's grads
        # what still_valid compares (a traced plan is never reused: torch 2.11's dynamo cannot
        # trace id() of the state's defaultdict)
        self.state_id = id(opt.state) if cached else None
        self.options = _options(opt)
        self.hyper = [None] * len(opt.param_groups)  # per group: (values, their floats, re-read)
        self.groups = []
        self.all_grads, self.grad_slots = [], []  # (each one's param slot)
        self.check_hyper(opt)
        index = 0
        checks = []
        for gi, group in enumerate(opt.param_groups):
            if group["amsgrad"]:
                check_amsgrad(opt, f"param group {gi}")
            for pi, p in enumerate(group["params"]):
                grad = grads[index + pi]
                if grad is None:
                    continue
                where = _LazyName(describe, group, gi, pi, p)
                check_grad(where, p, grad)
                kind = kind_of(p, *self.options)
                if p.dtype == torch.float16 and kind == "pure":
                    raise NotImplementedError(
                        f"fastllm.optim.AdamW: {where} is float16; training without master "
                        f"weights (stochastic_rounding or kahan_summation alone) is implemented "
                        f"for bfloat16 params only. Use master_weights=True for fp16 params")
                if opt.moments.mode(p) is not None and p.dtype not in LOW_BYTE_DTYPES:
                    raise TypeError(f"fastllm.optim.AdamW: {where} is {p.dtype}; low-byte state "
                                    f"(state_dtype={opt.moments.state_dtype}) takes float32, "
                                    f"bfloat16 or float16 params")
                state = opt.state.get(p)
                if state:
                    opt.moments.check(where, p, state, kind, group["amsgrad"])
                checks.append((gi, group, index + pi, p, kind))
            index += len(group["params"])
        if cached:  # (a traced step's fake tensors have no addresses)
            _refuse_overlapping(opt, [(slot, p) for _, _, slot, p, _ in checks])
        # Everything checked: now state may be created.
        calls_of, grad_index = {}, {}
        for gi, group, slot, p, kind in checks:
            state = opt.moments.init(p, opt.state[p], kind, group["amsgrad"],
                                     opt.kahan_summation)
            mode = opt.moments.mode(p)
            key = (gi, local(p).device, p.dtype, mode, kind)
            call = calls_of.get(key)
            if call is None:
                n = sum(1 for k in calls_of if k[0] == gi and (k[3] is None) == (mode is None))
                call = calls_of[key] = Call(mode, kind, key[1], n if mode is None else 1000 + n)
            call.params.append(p)
            call.slots.append(slot)
            grad_index[slot] = len(self.all_grads)
            self.all_grads.append(grads[slot])
            self.grad_slots.append(slot)
            call.steps.append(state["step"])
            tensors = (local(p), local(p.grad), local_or_none(state.get("master_param")),
                       *opt.moments.tensors(state, mode), local_or_none(_extra(state, kind)))
            call.fast = (call.fast and not is_dtensor(p) and not (cached and tensors[1].is_neg())
                         and all(t is None or t.is_contiguous() for t in tensors))
            for lst, t in zip((call.grads, call.masters, call.exp_avgs, call.exp_avg_sqs,
                               call.absmax_m, call.absmax_v, call.extras), tensors[1:]):
                lst.append(t)  # (p itself went into call.params above)
        for gi in range(len(opt.param_groups)):
            self.groups.append([c for k, c in calls_of.items() if k[0] == gi])
        self.flat_steps = {}  # device -> the 1-D buffer the flat calls' steps are views of
        flat_calls = {}
        for calls in self.groups:
            for call in calls:
                if call.fast and cached and not opt.defaults.get("capturable") and all(
                        type(s) is torch.Tensor and s.numel() == 1 for s in call.steps):
                    flat_calls.setdefault(call.steps[0].device, []).append(call)
        for device, calls in flat_calls.items():
            buffer = self.flat_steps[device] = torch.stack(
                [s.reshape(()).float() for call in calls for s in call.steps])
            views = iter(buffer.unbind(0))
            for call in calls:
                call.flat = True
                call.steps = [next(views) for _ in call.steps]
                for slot, step in zip(call.slots, call.steps):
                    opt.state[params[slot]]["step"] = step
        # What still_valid compares besides the params and grads: each param's state dict (a
        # state cleared, removed or replaced by hand must be initialised again, as torch
        # does) and the layout of the params the cached lists hold (`p.data = w` may change it).
        self.states = [opt.state.get(p) for p in params]
        self.filled = [s is not None and len(s) > 0 for s in self.states]  # (dynamo: no bool(dict))
        # and each param's and grad's dtype and shape: `m.to(torch.bfloat16)` or `p.data = w`
        # changes them without changing the tensors' identity, and the plan was checked for
        # these (the ops' own checks are off under it: a stepped state of another dtype or size
        # would be read as this one's, or past its end)
        self.layouts = _layouts(params) + _layouts(grads) if cached else None
        # each group's size and amsgrad (its calls' state lists): a param moved to another group
        # with the flattened order unchanged kept its old group's lr, betas, ...
        self.groups_seen = _groups_seen(opt)
        fast = [c for calls in self.groups for c in calls if c.fast]
        self.fast_lists = [c.params for c in fast] + [c.grads for c in fast]  # (kept current)
        # param slot -> (its call, its index in the call, its index in all_grads)
        self.slot_call = {}
        for calls in self.groups:
            for call in calls:
                if call.kind == "master":
                    call.versions = [opt._written_versions.get(p) for p in call.params]
                for i, slot in enumerate(call.slots):
                    self.slot_call[slot] = (call, i, grad_index[slot])

    def check_hyper(self, opt):
        """Check each group's hyperparameters when they differ from the last checked ones; what
        the kernels take, per group: floats, and a tensor lr as it is (read on the device, so
        an LR scheduler's in-place `fill_` reaches a compiled or graph-captured step; its value
        is checked when the tensor is first seen, as torch.optim checks it when it is set, and
        every step when it is a CPU tensor, whose read costs no device synchronisation: a
        scheduler's in-place `fill_` of nan is refused before the step). Tensor betas, eps and
        weight_decay, which the kernels take as floats, are read and checked every step (an
        in-place `fill_` is seen, as torch.optim.AdamW sees it); a group of plain floats costs
        one comparison with the cached values."""
        out = []
        for gi, group in enumerate(opt.param_groups):
            lr, betas, eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            key = (lr, *betas, eps, wd)  # (a list edited in place is a new key)
            cached = self.hyper[gi]
            if (cached is None or cached[2]
                    or (isinstance(lr, torch.Tensor) and lr.device.type == "cpu")
                    or not _same_values(cached[0], key)):
                check_hyperparameters(f"param group {gi}", lr, betas, eps, wd)
                values = (lr if isinstance(lr, torch.Tensor) else float(lr),
                          scalar(betas[0], "beta"), scalar(betas[1], "beta"),
                          scalar(eps, "eps"), scalar(wd, "weight_decay"))
                # (whether a value read here can change in place: a tensor other than lr)
                reread = any(isinstance(v, torch.Tensor) for v in key[1:])
                cached = self.hyper[gi] = (key, values, reread)
            out.append(cached[1])
        return out

    def still_valid(self, opt, params, grads):
        """Whether this plan can run the step for these params and grads; new grad tensors of
        the same params are checked and swapped in."""
        if (len(params) != len(self.params) or id(opt.state) != self.state_id
                or _options(opt) != self.options
                or not all(map(operator.is_, params, self.params))
                or not all(map(operator.is_, map(opt.state.get, params), self.states))
                or list(map(bool, self.states)) != self.filled  # (a state cleared in place)
                or _groups_seen(opt) != self.groups_seen):
            return False
        refs, self.grad_refs = self.grad_refs, None
        if refs is not None and all(map(operator.is_, grads, map(_held, refs))):
            # the grads release_grads let go of (zero_grad(set_to_none=False)): checked then
            self.grads = grads
            for call in itertools.chain.from_iterable(self.groups):
                if call.fast:
                    call.grads[:] = [grads[slot] for slot in call.slots]
            self.all_grads = [grads[slot] for slot in self.grad_slots]
            return self._layouts_hold()
        if all(map(operator.is_, grads, self.grads)):
            return self._layouts_hold()
        changed = [i for i, (a, b) in enumerate(zip(grads, self.grads)) if a is not b]
        for i in changed:
            grad, p = grads[i], params[i]
            if (grad is None) != (self.grads[i] is None):
                return False
            entry = self.slot_call.get(i)
            if entry is None:
                return False
            call = entry[0]
            # The cheap test first; the named diagnosis only when it fails.
            if not (grad.dtype == p.dtype and grad.shape == p.shape and grad.device == p.device
                    and grad.layout == torch.strided):
                check_grad(_LazyName(_slot_name, opt, i, p), p, grad)
            if call.fast and (grad.is_neg() or not grad.is_contiguous()):
                return False  # a slow call resolves a grad's negative bit each step
        for i in changed:
            call, k, gk = self.slot_call[i]
            if call.fast:
                call.grads[k] = grads[i]
            self.all_grads[gk] = grads[i]
            self.grads[i] = grads[i]
        return self._layouts_hold()

    def _layouts_hold(self):
        """Whether the params and grads still have the dtypes and shapes the plan was checked
        for, and those of the fast calls are still contiguous (`p.data = w` or
        `p.grad.data = g` can change either without changing the tensors' identity)."""
        return (_layouts(self.params) + _layouts(self.grads) == self.layouts
                and all(map(torch.Tensor.is_contiguous,
                            itertools.chain.from_iterable(self.fast_lists))))

    def run(self, opt, hyper, grad_scale, clip_coef, found, plain_scale=None, steps_advanced=False):
        """The fused ops of every call (everything was checked when the plan was built), with
        `hyper`, check_hyper's answer, asked for before the step changed anything.

        grad_scale, clip_coef, found: the scalars the update ops take (None: absent).
        plain_scale: what adamw_step (which divides grads by its grad_scale and takes no
        clip_coef) gets, when the caller has it; else grad_scale / clip_coef, computed here.
        steps_advanced: the flat step buffers were advanced by 1 - found already (the Triton
        step prologue); otherwise this adds 1 before the ops and takes `found` back after."""
        if not steps_advanced:
            for buffer in self.flat_steps.values():
                buffer.add_(1.0)
        loose = [s for calls in self.groups for c in calls if not c.flat for s in c.steps]
        if loose:
            torch._foreach_add_(loose, 1.0)  # one call, not one tiny op per param
        if plain_scale is None and clip_coef is not None:
            # adamw_step divides by grad_scale: fold the clipping factor into it.
            plain_scale = (1.0 / clip_coef) if grad_scale is None else grad_scale / clip_coef
        elif plain_scale is None:
            plain_scale = grad_scale
        scalars = (grad_scale, clip_coef, found, plain_scale)
        done = []
        try:
            for gi, (group, calls) in enumerate(zip(opt.param_groups, self.groups)):
                lr, beta1, beta2, eps, wd = hyper[gi]
                hp = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd,
                          maximize=group["maximize"])
                for call in calls:
                    _run_call(opt, gi, group, call, hp, scalars)
                    done.append(call)
        except BaseException:
            # An op that raised (a kernel this Triton cannot compile, a bad argument) wrote
            # nothing: the calls not done get this step's count back (flat ones: their views of
            # the buffer), so that when none was done the optimizer is as before the step (not
            # after the Triton prologue: the flat counts it advanced stay).
            ran = {id(c) for c in done}
            undo = [s for calls in self.groups for c in calls
                    if id(c) not in ran and not (c.flat and steps_advanced) for s in c.steps]
            if undo:
                torch._foreach_sub_(undo, 1.0)
            raise
        if found is not None and not steps_advanced:
            for device, buffer in self.flat_steps.items():
                buffer.sub_(found if found.device == device
                            else found.to(device, non_blocking=True))
        if not self.cached:
            self.save_versions(opt)  # this plan lives for one step

    def release_grads(self):
        """Let go of the step's grads once it ran, as torch.optim keeps none: zero_grad's
        set_to_none frees them before the next backward (held here, two sets of grads were alive
        through it). Weak references stay for still_valid: the same grads at the next step are
        put back as they were checked; new ones are checked and swapped in."""
        self.grad_refs = [None if g is None else weakref.ref(g) for g in self.grads]
        self.grads = [None if g is None else _RELEASED for g in self.grads]
        self.all_grads = [None] * len(self.all_grads)
        for call in itertools.chain.from_iterable(self.groups):
            call.grads[:] = [None] * len(call.grads)  # (in place: fast_lists holds the lists)

    def save_versions(self, opt):
        """Hand the masters' written versions back to opt._written_versions (the plan is being
        replaced)."""
        for calls in self.groups:
            for call in calls:
                for p, version in zip(call.params, call.versions):
                    if version is not None:
                        opt._written_versions[p] = version


def _run_call(opt, gi, group, call, hp, scalars):
    """The fused op of one call of group gi (hp: the group's hyperparameters as the ops take
    them; scalars: grad_scale, clip_coef, found, plain_scale of Plan.run), then its step-count
    correction and write-backs."""
    scale, coef, skip, plain = (t if t is None or t.device == call.device
                                else t.to(call.device, non_blocking=True) for t in scalars)
    lr = hp["lr"]
    if isinstance(lr, torch.Tensor) and lr.device.type != "cpu" and lr.device != call.device:
        # As torch's fused AdamW: a device lr goes to each params' device (a CPU one is read
        # inside the op).
        hp = dict(hp, lr=lr.to(call.device, non_blocking=True))
    if call.kind == "master":
        _resync_masters(opt, call)
    (ps, gs, masters, ms, vs, ams, avs, extras), writebacks = call.tensors(opt)
    seed = 0
    sr = opt.stochastic_rounding and call.kind != "plain"
    if sr:
        seed = mix_seed(opt._sr_seed, gi, call.seed_index, opt._sr_calls)
    if call.mode is not None:
        adamw8bit_step(
            ps, gs, masters if call.kind == "master" else [], ms, vs,
            ams if call.mode == "q8" else [], avs if call.mode == "q8" else [],
            call.steps, qmaps(call.device), block_size=opt.moments.block_size,
            stochastic_rounding=sr, seed=seed, grad_scale=scale, clip_coef=coef,
            found_inf=skip, **hp)
    elif call.kind == "plain":
        adamw_step(ps, gs, ms, vs, extras if group["amsgrad"] else [], call.steps,
                   amsgrad=group["amsgrad"], grad_scale=plain, found_inf=skip, **hp)
    else:
        adamw_master_step(
            ps, gs, extras if call.kind == "master" else [], ms, vs,
            extras if call.kind == "pure" and opt.kahan_summation else [],
            call.steps, stochastic_rounding=sr, seed=seed, grad_scale=scale,
            clip_coef=coef, found_inf=skip, **hp)
    if skip is not None and not call.flat:
        # As torch's fused AdamW: a skipped step takes its count back, on the device.
        torch._foreach_sub_(call.steps, [skip] * len(call.steps))
    for dst, src in writebacks:
        dst.copy_(src)
    if call.kind == "master":
        call.versions = _written_versions(call)


def _same_values(a, b):
    """Whether two hyperparameter keys are the same: tensors by identity (comparing their
    values would read them on the host), the rest by value."""
    return len(a) == len(b) and all(
        x is y if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor) else x == y
        for x, y in zip(a, b))


def _refuse_overlapping(opt, slots):
    """Two params over the same memory (`nn.Parameter(p.data)` beside p): a fused op updates
    every param of a call at once, so their updates would race (torch.optim applies them one
    after the other). Refused, naming both; params sharing a storage without overlapping (views
    of one flat buffer) are fine."""
    spans = []
    for slot, p in slots:
        t = local(p)
        if t.numel() and t.device.type != "meta":  # (meta tensors have no memory)
            extent = 1 + sum((n - 1) * step for n, step in zip(t.shape, t.stride()))
            start = t.data_ptr()
            spans.append((str(t.device), start, start + extent * t.element_size(), slot, p))
    spans.sort(key=operator.itemgetter(0, 1))
    last = None
    for span in spans:
        if last is not None and span[0] == last[0] and span[1] < last[2]:
            raise ValueError(
                f"fastllm.optim.AdamW: {_slot_name(opt, last[3], last[4])} and "
                f"{_slot_name(opt, span[3], span[4])} overlap in memory: a fused step would "
                f"update both at once (torch.optim one after the other). Make them one "
                f"Parameter (tie the modules' weights) or give each its own memory")
        if last is None or span[0] != last[0] or span[2] > last[2]:
            last = span


def _options(opt):
    return (opt.master_weights, opt.stochastic_rounding, opt.kahan_summation)


class _LazyName:
    """A parameter's description for error messages, built only when a message is formatted."""

    __slots__ = ("args",)

    def __init__(self, *args):
        self.args = args

    def __str__(self):
        name, *rest = self.args
        return name(*rest)

    __format__ = lambda self, spec: format(str(self), spec)  # noqa: E731
