"""Low-byte optimizer state: fastllm.optim.AdamW8bit, the state of
fastllm.optim.AdamW(state_dtype=torch.bfloat16 | torch.uint8), and convert_state.

State layout (per parameter, in `optimizer.state[p]` and in `state_dict()["state"][i]`):
    8-bit (state_dtype=torch.uint8, tensors with at least `min_8bit_size` elements):
        step               0-dim fp32 tensor, as torch.optim.AdamW
        exp_avg_codes      uint8, the param's shape: indices into the signed dynamic map
        exp_avg_sq_codes   uint8, the param's shape: indices into the unsigned dynamic map
        exp_avg_absmax     fp32 (ceil(numel / block_size),): each block's largest |exp_avg|
        exp_avg_sq_absmax  fp32 (ceil(numel / block_size),)
        master_param       fp32, with master_weights=True for bf16/fp16 params
      exp_avg = code_signed[exp_avg_codes] * absmax of the element's block (block = index //
      block_size of the flattened tensor); the maps are fastllm.ops.adamw8bit.dynamic_code().
      Smaller tensors keep torch.optim.AdamW's fp32 state (exp_avg, exp_avg_sq).
    bf16 (state_dtype=torch.bfloat16): exp_avg and exp_avg_sq as bf16 tensors of the param's
      shape (torch's keys), step, and master_param as above.
With 8-bit state, state_dict() also holds "fastllm_lowbyte": {"state_dtype": "uint8",
"block_size": ..., "code": "bnb-dynamic-8bit"}. The state round-trips bitwise through
state_dict()/load_state_dict(); convert_state() turns it into a plain fp32 AdamW state_dict and
back, so a run can switch between full and low-byte state at a checkpoint.
"""

import torch

from fastllm.ops.adamw8bit import (
    MAX_BLOCK, MIN_BLOCK, adamw8bit_step, build_qmaps, dequantize_blockwise_ref, dynamic_code,
    n_blocks, quantize_blockwise_ref,
)
from fastllm.optim.adamw import AdamW, _local, _mix_seed, _scalar

__all__ = ["AdamW8bit", "convert_state", "export_state", "import_state"]

CODE_NAME = "bnb-dynamic-8bit"
Q8_KEYS = ("exp_avg_codes", "exp_avg_sq_codes", "exp_avg_absmax", "exp_avg_sq_absmax")
_STATE_DTYPES = {None: None, torch.float32: None, torch.bfloat16: torch.bfloat16,
                 torch.uint8: torch.uint8}
_LOW_PRECISION = (torch.bfloat16, torch.float16)


def check_options(opt, state_dtype, amsgrad, kahan_summation, block_size=256,
                  min_8bit_size=4096, capturable=False):
    """Validate and record the low-byte options on `opt` (called by AdamW.__init__)."""
    if state_dtype not in _STATE_DTYPES:
        raise ValueError(f"fastllm.optim.AdamW: state_dtype must be None, torch.float32, "
                         f"torch.bfloat16 or torch.uint8 (8-bit), got {state_dtype!r}")
    state_dtype = _STATE_DTYPES[state_dtype]
    if state_dtype is not None and amsgrad:
        raise ValueError("fastllm.optim.AdamW: amsgrad is not supported with low-byte state "
                         f"(state_dtype={state_dtype})")
    if state_dtype is not None and kahan_summation:
        raise ValueError("fastllm.optim.AdamW: kahan_summation is not supported with low-byte "
                         "state; use stochastic_rounding or master_weights")
    if state_dtype is not None and capturable:
        raise ValueError("fastllm.optim.AdamW: capturable=True is not supported with low-byte "
                         "state (its kernels read the step counts on the host)")
    if not (isinstance(block_size, int) and MIN_BLOCK <= block_size <= MAX_BLOCK
            and block_size % 16 == 0):
        raise ValueError(f"fastllm.optim.AdamW8bit: block_size must be a multiple of 16 in "
                         f"[{MIN_BLOCK}, {MAX_BLOCK}], got {block_size!r}")
    if not (isinstance(min_8bit_size, int) and min_8bit_size >= 0):
        raise ValueError(f"fastllm.optim.AdamW8bit: min_8bit_size must be an int >= 0, got "
                         f"{min_8bit_size!r}")
    opt.state_dtype = state_dtype
    opt.block_size = block_size
    opt.min_8bit_size = min_8bit_size


def mode(opt, p):
    """None (torch's fp32 state), 'q8' or 'bf16': which state `p` keeps."""
    state_dtype = getattr(opt, "state_dtype", None)
    if state_dtype is None:
        return None
    if state_dtype == torch.bfloat16:
        return "bf16"
    return "q8" if p.numel() >= opt.min_8bit_size else None


def _expected(opt, p, m):
    """{key: (dtype, numel)} of the state a param in mode m keeps (besides step/master)."""
    if m == "q8":
        # Under FSDP2 the codes are DTensors like p; the absmax covers this rank's shard.
        nb = n_blocks(_local(p).numel(), opt.block_size)
        return {"exp_avg_codes": (torch.uint8, p.numel()),
                "exp_avg_sq_codes": (torch.uint8, p.numel()),
                "exp_avg_absmax": (torch.float32, nb), "exp_avg_sq_absmax": (torch.float32, nb)}
    return {"exp_avg": (torch.bfloat16, p.numel()), "exp_avg_sq": (torch.bfloat16, p.numel())}


def _check_entries(opt, where, p, state, m, verb):
    for key, (dtype, numel) in _expected(opt, p, m).items():
        t = state.get(key)
        if not isinstance(t, torch.Tensor):
            other = "8-bit" if any(k in state for k in Q8_KEYS) else "fp32/bf16"
            raise RuntimeError(
                f"fastllm.optim.AdamW: {verb} state of {where}: '{key}' is missing (the state "
                f"holds {other} moments, this optimizer keeps {m} state for it; convert it with "
                f"fastllm.optim.convert_state)")
        if t.dtype != dtype or t.numel() != numel:
            raise RuntimeError(
                f"fastllm.optim.AdamW: {verb} state '{key}' of {where}: expected {dtype} with "
                f"{numel} elements, got {t.dtype} with {t.numel()} (a different state_dtype, "
                f"block_size or parameter? see fastllm.optim.convert_state)")
    master = state.get("master_param")
    if master is not None and (not isinstance(master, torch.Tensor) or master.dtype != torch.float32
                               or master.shape != p.shape):
        raise RuntimeError(f"fastllm.optim.AdamW: {verb} state 'master_param' of {where} must be "
                           f"an fp32 tensor of shape {tuple(p.shape)}")
    step = state.get("step")
    if step is not None and not isinstance(step, (torch.Tensor, int, float)):
        raise RuntimeError(f"fastllm.optim.AdamW: {verb} state 'step' of {where} is "
                           f"{type(step).__name__}")


def check_state(opt, where, p, state):
    """Raise if a low-byte param's state is not the layout its mode needs (before a step)."""
    _check_entries(opt, where, p, state, mode(opt, p), "the")
    for key in _expected(opt, p, mode(opt, p)):
        t = state[key]
        if t.device != p.device or not t.is_contiguous():
            raise RuntimeError(f"fastllm.optim.AdamW: state '{key}' of {where} must be "
                               f"contiguous on {p.device}")


def check_loaded(opt, state_dict):
    """Refuse, before anything changes, a state_dict whose moments do not match this
    optimizer's state layout (called first by AdamW.load_state_dict)."""
    extra = state_dict.get("fastllm_lowbyte")
    if extra is not None and getattr(opt, "state_dtype", None) == torch.uint8:
        if extra.get("code") != CODE_NAME or int(extra.get("block_size", -1)) != opt.block_size:
            raise ValueError(f"fastllm.optim.AdamW8bit: the state_dict's 8-bit state uses code "
                             f"{extra.get('code')!r} with block_size {extra.get('block_size')}; "
                             f"this optimizer uses {CODE_NAME!r} with block_size "
                             f"{opt.block_size}. Requantise it with fastllm.optim.convert_state")
    saved_state = state_dict.get("state", {})
    for gi, (group, saved) in enumerate(zip(opt.param_groups, state_dict.get("param_groups", []))):
        for pi, (pid, p) in enumerate(zip(saved["params"], group["params"])):
            state = saved_state.get(pid)
            if not state:
                continue
            where = AdamW._name(group, gi, pi, p)
            m = mode(opt, p)
            if m is not None:
                _check_entries(opt, where, p, state, m, "cannot load:")
            elif any(k in state for k in Q8_KEYS):
                raise RuntimeError(
                    f"fastllm.optim.AdamW: cannot load state of {where}: it holds 8-bit moments "
                    f"but this optimizer keeps fp32 state for it; convert the state_dict with "
                    f"fastllm.optim.convert_state(state_dict, torch.float32)")


def restore_loaded(opt, state_dict):
    """After torch's load (which casts floating state to the param's dtype): put the low-byte
    tensors back exactly as saved."""
    saved_state = state_dict.get("state", {})
    saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    for pid, p in zip(saved_ids, params):
        saved = saved_state.get(pid)
        m = mode(opt, p)
        if not saved or m is None:
            continue
        for key in _expected(opt, p, m):
            value = saved[key]
            if m == "bf16":
                value = value.view(p.shape)
            opt.state[p][key] = value.to(device=p.device, copy=True)


def _kind(opt, p):
    if p.dtype in _LOW_PRECISION:
        if opt.master_weights:
            return "master"
        if opt.stochastic_rounding:
            return "pure"
    return "plain"


def _init_state(opt, p, m, kind):
    state = opt.state[p]
    if len(state) == 0:
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        if m == "q8":
            nb = n_blocks(_local(p).numel(), opt.block_size)
            # Code 127 of the signed map and code 0 of the unsigned map are 0.0.
            state["exp_avg_codes"] = torch.full_like(p, 127, dtype=torch.uint8,
                                                     memory_format=torch.contiguous_format)
            state["exp_avg_sq_codes"] = torch.zeros_like(p, dtype=torch.uint8,
                                                         memory_format=torch.contiguous_format)
            state["exp_avg_absmax"] = torch.zeros(nb, dtype=torch.float32, device=p.device)
            state["exp_avg_sq_absmax"] = torch.zeros(nb, dtype=torch.float32, device=p.device)
        else:
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16,
                                                memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16,
                                                   memory_format=torch.contiguous_format)
    if kind == "master" and "master_param" not in state:
        state["master_param"] = p.detach().float().contiguous()
    return state


def step(opt, group, gi, params, grad_scale, clip_coef, found_inf):
    """The low-byte part of AdamW.step for one param group: one fused op per
    (device, dtype, state mode, master/pure/plain). found_inf: fp32 flag, nonzero = no-op."""
    buckets = {}
    writebacks = []
    for p in params:
        m = mode(opt, p)
        kind = _kind(opt, p)
        state = _init_state(opt, p, m, kind)
        if kind == "master":
            opt._resync_master(p, state)
        lists = buckets.setdefault((p.device, p.dtype, m, kind), ([], [], [], [], [], [], [], []))
        param, grad = _local(p), _local(p.grad)
        if not param.is_contiguous():
            # The moments follow the param's logical (contiguous) order: step a copy.
            contiguous = param.contiguous()
            writebacks.append((param, contiguous))
            param, grad = contiguous, grad.contiguous()
        elif not grad.is_contiguous():
            grad = grad.contiguous()
        if m == "q8":
            moments = (state["exp_avg_codes"], state["exp_avg_sq_codes"],
                       state["exp_avg_absmax"], state["exp_avg_sq_absmax"])
        else:
            moments = (state["exp_avg"], state["exp_avg_sq"], None, None)
        for lst, t in zip(lists, (param, grad, _local_or_none(state.get("master_param")))
                          + tuple(_local_or_none(t) for t in moments) + (state["step"],)):
            lst.append(t)
    steps = [s for lists in buckets.values() for s in lists[7]]
    if steps:
        torch._foreach_add_(steps, 1.0)
    beta1, beta2 = (_scalar(b, "beta") for b in group["betas"])
    lr = _scalar(group["lr"], "lr")
    for bi, ((device, _, m, kind), (ps, gs, masters, ms, vs, ams, avs, st)) in enumerate(
            buckets.items()):
        scale = grad_scale
        if scale is not None and scale.device != device:
            scale = scale.to(device, non_blocking=True)
        coef = clip_coef
        if coef is not None and coef.device != device:
            coef = coef.to(device, non_blocking=True)
        skip = found_inf
        if skip is not None and skip.device != device:
            skip = skip.to(device, non_blocking=True)
        seed = 0
        sr = opt.stochastic_rounding and kind in ("pure", "master")
        if sr:
            seed = _mix_seed(opt._sr_seed, gi, 1000 + bi, opt._sr_calls)
        adamw8bit_step(
            ps, gs, masters if kind == "master" else [], ms, vs,
            ams if m == "q8" else [], avs if m == "q8" else [], st,
            _qmaps(device),
            lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
            weight_decay=group["weight_decay"], block_size=opt.block_size,
            maximize=group["maximize"], stochastic_rounding=sr, seed=seed,
            grad_scale=scale, clip_coef=coef, found_inf=skip,
        )
        if skip is not None:
            torch._foreach_sub_(st, [skip] * len(st))  # a skipped step takes its count back
    for dst, src in writebacks:
        dst.copy_(src)


def _local_or_none(t):
    return None if t is None else _local(t)


_QMAPS = {}


def _qmaps(device):
    device = torch.device(device)
    if device not in _QMAPS:
        _QMAPS[device] = build_qmaps(device)
    return _QMAPS[device]


class AdamW8bit(AdamW):
    """AdamW with 8-bit block-quantised moments: a drop-in for bitsandbytes.optim.AdamW8bit and
    torchao.optim.AdamW8bit (the arguments they share: lr, betas, eps, weight_decay, amsgrad;
    block_size as torchao, min_8bit_size as bitsandbytes).

    Each tensor with at least `min_8bit_size` elements keeps both moments as one byte per element
    (bitsandbytes' dynamic map, signed for exp_avg, unsigned for exp_avg_sq) plus one fp32 absmax
    per `block_size` elements: about 2.03 bytes per parameter instead of torch's 8. Smaller tensors
    keep fp32 state. The update is fastllm::adamw8bit_step (dequantise, AdamW, requantise in one
    pass). The state layout is in this module's docstring; convert_state() converts to and from
    torch AdamW's fp32 state.

    Every keyword option of fastllm.optim.AdamW combines with it (master_weights,
    stochastic_rounding, max_grad_norm, loss_scaler, GradScaler), except amsgrad (refused, as
    bitsandbytes does not implement it either) and kahan_summation.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 amsgrad=False, *, block_size=256, min_8bit_size=4096, **kwargs):
        if "state_dtype" in kwargs:
            raise TypeError("fastllm.optim.AdamW8bit: state_dtype is always torch.uint8; use "
                            "fastllm.optim.AdamW(state_dtype=...) for other state types")
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, state_dtype=torch.uint8,
                         **kwargs)
        check_options(self, torch.uint8, amsgrad, self.kahan_summation, block_size,
                      min_8bit_size)

    def state_dict(self):
        state_dict = super().state_dict()
        state_dict["fastllm_lowbyte"] = {"state_dtype": "uint8", "block_size": self.block_size,
                                         "code": CODE_NAME}
        return state_dict


def export_state(opt, state):
    """One param's state with its moments as fp32 `exp_avg` / `exp_avg_sq` (the layout of
    torch.optim.AdamW), for code that gathers or slices state element by element, such as a
    flat-shard optimizer consolidating its state (fastllm.distributed.DistributedOptimizer):
    8-bit codes are only meaningful with their block's absmax, and the blocks of a shard do not
    fall where a single process's would. Under FSDP2 the fp32 moments are DTensors placed as the
    codes are, so torch.distributed.checkpoint can gather them (it cannot gather the per-rank
    absmax of 8-bit state correctly: that is a plain tensor of this rank's blocks). bf16 moments
    and fp32 state come back as they are; the input is not modified. 8-bit -> fp32 is exact (the
    dequantised values)."""
    if getattr(opt, "state_dtype", None) == torch.uint8 and all(k in state for k in Q8_KEYS):
        codes = state["exp_avg_codes"]
        local = {k: _local(v) if k in Q8_KEYS else v for k, v in state.items()}
        out = _dequantize_state(local, opt.block_size)
        for key in ("exp_avg", "exp_avg_sq"):
            out[key] = _like(codes, out[key])
        return out
    return dict(state)


def import_state(opt, p, state):
    """In place: fp32 (or other float) `exp_avg` / `exp_avg_sq` in param p's state dict turned
    into the moments `opt` keeps for p (8-bit codes and absmax per block of p's local tensor, or
    bf16), the inverse of export_state for state installed without load_state_dict (a flat
    shard's slice of a consolidated state_dict). A state export_state made from 8-bit moments
    with the same blocks comes back bit for bit where the block's largest value is stored as
    +1.0 times its absmax: always for exp_avg_sq, and for exp_avg where the block's largest |m|
    is positive. The signed map has no -1.0 (its most negative code is -0.993), so a block whose
    largest |m| is negative gets a smaller absmax and is requantised once (each value moves by
    at most half a code gap of the absmax). Returns state."""
    m = mode(opt, p)
    if m is None or "exp_avg" not in state or "exp_avg_sq" not in state:
        return state
    local = _local(p)
    exp_avg = _local(state["exp_avg"]).reshape(local.shape)
    exp_avg_sq = _local(state["exp_avg_sq"]).reshape(local.shape)
    if m == "bf16":
        state["exp_avg"], state["exp_avg_sq"] = (
            _like(p, t.to(device=local.device, dtype=torch.bfloat16).contiguous())
            for t in (exp_avg, exp_avg_sq))
        return state
    state["exp_avg"], state["exp_avg_sq"] = exp_avg, exp_avg_sq
    _quantize_state(state, opt.block_size, local.device)
    for key in ("exp_avg_codes", "exp_avg_sq_codes"):
        state[key] = _like(p, state[key])
    return state


def _quantize_state(state, block_size, device):
    """In place: fp32 exp_avg / exp_avg_sq replaced by their 8-bit codes and per-block absmax
    (the reference quantiser) on `device`. Returns state."""
    codes, absmax = quantize_blockwise_ref(state.pop("exp_avg").cpu(), dynamic_code(True),
                                           block_size)
    sq_codes, sq_absmax = quantize_blockwise_ref(state.pop("exp_avg_sq").cpu(),
                                                 dynamic_code(False), block_size)
    state.update(exp_avg_codes=codes.to(device), exp_avg_sq_codes=sq_codes.to(device),
                 exp_avg_absmax=absmax.to(device), exp_avg_sq_absmax=sq_absmax.to(device))
    return state


def _like(p, local):
    """`local` (this rank's part of a tensor shaped like p) as p is: a DTensor with p's placements
    under FSDP2 (the moments _init_state makes from p are), else itself."""
    if _local(p) is p:
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                              shape=p.shape, stride=p.stride())


def _dequantize_state(state, block_size):
    out = dict(state)
    codes = out.pop("exp_avg_codes")
    sq_codes = out.pop("exp_avg_sq_codes")
    absmax, sq_absmax = out.pop("exp_avg_absmax"), out.pop("exp_avg_sq_absmax")
    out["exp_avg"] = dequantize_blockwise_ref(codes, absmax.cpu(), dynamic_code(True),
                                              block_size, torch.float32).to(codes.device)
    out["exp_avg_sq"] = dequantize_blockwise_ref(sq_codes, sq_absmax.cpu(), dynamic_code(False),
                                                 block_size, torch.float32).to(codes.device)
    return out


def convert_state(state_dict, state_dtype, *, block_size=256, min_8bit_size=4096):
    """An optimizer state_dict with its moments converted to `state_dtype`; the input is not
    modified.

    state_dtype: torch.float32 (torch.optim.AdamW's layout: loads into torch.optim.AdamW,
    fastllm.optim.AdamW), torch.bfloat16 (fastllm.optim.AdamW(state_dtype=torch.bfloat16)) or
    torch.uint8 (fastllm.optim.AdamW8bit(block_size=block_size, min_8bit_size=min_8bit_size);
    smaller tensors stay fp32). The input may hold any of these layouts (per parameter).
    8-bit -> fp32 is exact (the dequantised values); fp32 -> 8-bit quantises to the nearest code.
    """
    if state_dtype not in (torch.float32, torch.bfloat16, torch.uint8):
        raise ValueError(f"fastllm.optim.convert_state: state_dtype must be torch.float32, "
                         f"torch.bfloat16 or torch.uint8, got {state_dtype!r}")
    if not (isinstance(block_size, int) and MIN_BLOCK <= block_size <= MAX_BLOCK
            and block_size % 16 == 0):
        raise ValueError(f"fastllm.optim.convert_state: block_size must be a multiple of 16 in "
                         f"[{MIN_BLOCK}, {MAX_BLOCK}], got {block_size!r}")
    if "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("fastllm.optim.convert_state: not an optimizer state_dict (needs "
                         "'state' and 'param_groups')")
    extra = state_dict.get("fastllm_lowbyte")
    saved_block = int(extra["block_size"]) if extra is not None else None
    new_state = {}
    for pid, state in state_dict["state"].items():
        state = dict(state)
        if any(k in state for k in Q8_KEYS):
            if saved_block is None:
                raise ValueError(f"fastllm.optim.convert_state: state {pid} holds 8-bit moments "
                                 f"but the state_dict has no 'fastllm_lowbyte' entry (block "
                                 f"size unknown)")
            missing = [k for k in Q8_KEYS if not isinstance(state.get(k), torch.Tensor)]
            if missing:
                raise ValueError(f"fastllm.optim.convert_state: state {pid} lacks {missing}")
            state = _dequantize_state(state, saved_block)
        if "exp_avg" in state:
            exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
            if state_dtype == torch.uint8 and exp_avg.numel() >= min_8bit_size:
                _quantize_state(state, block_size, exp_avg.device)
            elif state_dtype == torch.bfloat16:
                state["exp_avg"] = exp_avg.to(torch.bfloat16)
                state["exp_avg_sq"] = exp_avg_sq.to(torch.bfloat16)
            else:
                state["exp_avg"] = exp_avg.float()
                state["exp_avg_sq"] = exp_avg_sq.float()
        new_state[pid] = state
    out = {k: v for k, v in state_dict.items() if k not in ("state", "fastllm_lowbyte")}
    out["state"] = new_state
    out["param_groups"] = [dict(g) for g in state_dict["param_groups"]]
    if state_dtype == torch.uint8:
        out["fastllm_lowbyte"] = {"state_dtype": "uint8", "block_size": block_size,
                                  "code": CODE_NAME}
    return out
