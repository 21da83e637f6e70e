"""Moment layouts of fastllm's AdamW family: how each param's optimizer state is kept, checked,
loaded, exported and converted. fastllm.optim.AdamW asks a `Moments` for everything that depends
on the layout; AdamW8bit is AdamW with `Moments(torch.uint8, ...)`.

Layouts (per parameter, in `optimizer.state[p]` and in `state_dict()["state"][i]`):
    torch (state_dtype None / torch.float32): torch.optim.AdamW's keys and dtypes:
        step               0-dim fp32 tensor
        exp_avg, exp_avg_sq, max_exp_avg_sq (amsgrad): the param's dtype and shape; fp32 for a
                           bf16/fp16 param in master or pure mode
        master_param       fp32 master copy (master_weights=True, bf16/fp16 params)
        kahan_comp         the param's dtype (kahan_summation=True)
    bf16 (state_dtype=torch.bfloat16): exp_avg and exp_avg_sq as bf16 tensors of the param's
        shape (torch's keys), step, and master_param as above.
    8-bit (state_dtype=torch.uint8, tensors with at least `min_8bit_size` elements, counted over
        the whole tensor, not this rank's shard; smaller tensors keep the torch layout):
        exp_avg_codes      uint8, the param's shape: indices into the signed dynamic map
        exp_avg_sq_codes   uint8, the param's shape: indices into the unsigned dynamic map
        exp_avg_absmax     fp32 (ceil(numel / block_size),): each block's largest |exp_avg|
        exp_avg_sq_absmax  fp32 (ceil(numel / block_size),)
      exp_avg = code_signed[exp_avg_codes] * absmax of the element's block (block = index //
      block_size of the flattened local tensor); the maps are fastllm.ops.adamw8bit.dynamic_code().
With 8-bit state, state_dict() also holds "fastllm_lowbyte": {"state_dtype": "uint8",
"block_size": ..., "code": "bnb-dynamic-8bit"}. Every layout round-trips bitwise through
state_dict()/load_state_dict(); convert_state() turns any of them into another, so a run can
switch between full and low-byte state at a checkpoint.
"""

import math

import torch

from fastllm._dtensor import is_dtensor, local
from fastllm.ops.adamw8bit import (
    MAX_BLOCK, MIN_BLOCK, build_qmaps, dequantize_blockwise_ref, dynamic_code, n_blocks,
    quantize_blockwise_ref,
)

__all__ = ["Moments", "convert_state", "export_state", "import_state"]

CODE_NAME = "bnb-dynamic-8bit"
Q8_KEYS = ("exp_avg_codes", "exp_avg_sq_codes", "exp_avg_absmax", "exp_avg_sq_absmax")
BLOCK_KEYS = ("exp_avg_absmax", "exp_avg_sq_absmax")  # one value per block, not per element
TORCH_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
# Every key a state of this family may hold; anything else is another optimizer's state.
KNOWN_KEYS = frozenset(("step", "master_param", "kahan_comp") + TORCH_KEYS + Q8_KEYS)
# State tensors kept in fp32 for a low-precision param in master / pure mode.
FP32_STATE_KEYS = ("exp_avg", "exp_avg_sq", "master_param")
LOW_PRECISION = (torch.bfloat16, torch.float16)
_STATE_DTYPES = {None: None, torch.float32: None, torch.bfloat16: torch.bfloat16,
                 torch.uint8: torch.uint8}


def check_block_size(where, block_size):
    if not (isinstance(block_size, int) and MIN_BLOCK <= block_size <= MAX_BLOCK
            and block_size % 16 == 0):
        raise ValueError(f"{where}: block_size must be a multiple of 16 in [{MIN_BLOCK}, "
                         f"{MAX_BLOCK}], got {block_size!r}")


class Moments:
    """The moment layout of one optimizer (see the module docstring).

    state_dtype: None or torch.float32 (torch's layout), torch.bfloat16, torch.uint8 (8-bit).
    block_size, min_8bit_size: the 8-bit layout's block and small-tensor threshold.
    """

    def __init__(self, state_dtype=None, block_size=256, min_8bit_size=4096, *,
                 where="fastllm.optim.AdamW"):
        if state_dtype not in _STATE_DTYPES:
            raise ValueError(f"{where}: state_dtype must be None, torch.float32, torch.bfloat16 "
                             f"or torch.uint8 (8-bit), got {state_dtype!r}")
        check_block_size(where, block_size)
        if not (isinstance(min_8bit_size, int) and min_8bit_size >= 0):
            raise ValueError(f"{where}: min_8bit_size must be an int >= 0, got "
                             f"{min_8bit_size!r}")
        self.state_dtype = _STATE_DTYPES[state_dtype]
        self.block_size = block_size
        self.min_8bit_size = min_8bit_size

    def check_options(self, amsgrad, kahan_summation, capturable):
        if self.state_dtype is None:
            return
        if amsgrad:
            raise ValueError(f"fastllm.optim.AdamW: amsgrad is not supported with low-byte "
                             f"state (state_dtype={self.state_dtype})")
        if kahan_summation:
            raise ValueError("fastllm.optim.AdamW: kahan_summation is not supported with "
                             "low-byte state; use stochastic_rounding or master_weights")
        if capturable:
            raise ValueError("fastllm.optim.AdamW: capturable=True is not supported with "
                             "low-byte state (its kernels read the step counts on the host)")

    def mode(self, p):
        """None (the torch layout), 'q8' or 'bf16': which layout `p` keeps. A DTensor's numel
        is the whole tensor's, so the choice does not depend on the mesh."""
        if self.state_dtype is None:
            return None
        if self.state_dtype == torch.bfloat16:
            return "bf16"
        return "q8" if p.numel() >= self.min_8bit_size else None

    def extra(self):
        """The state_dict's "fastllm_lowbyte" entry, or None."""
        if self.state_dtype != torch.uint8:
            return None
        return {"state_dtype": "uint8", "block_size": self.block_size, "code": CODE_NAME}

    def _expected(self, p, m):
        """{key: (dtype, numel)} of the low-byte moments a param in mode m keeps."""
        if m == "q8":
            # Under FSDP2 the codes are DTensors like p; the absmax covers this rank's shard.
            nb = n_blocks(local(p).numel(), self.block_size)
            return {"exp_avg_codes": (torch.uint8, p.numel()),
                    "exp_avg_sq_codes": (torch.uint8, p.numel()),
                    "exp_avg_absmax": (torch.float32, nb),
                    "exp_avg_sq_absmax": (torch.float32, nb)}
        return {"exp_avg": (torch.bfloat16, p.numel()), "exp_avg_sq": (torch.bfloat16, p.numel())}

    # -- a new param's state -------------------------------------------------------------------

    def init(self, p, state, kind, amsgrad, kahan):
        """Fill `state` (a param's dict) with what layout and kind need; keeps what is there."""
        m = self.mode(p)
        if len(state) == 0:
            # On the param's device, as torch's fused/capturable AdamW: the kernels read it there.
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            if m == "q8":
                nb = n_blocks(local(p).numel(), self.block_size)
                # Code 127 of the signed map and code 0 of the unsigned map are 0.0.
                state["exp_avg_codes"] = torch.full_like(p, 127, dtype=torch.uint8,
                                                         memory_format=torch.contiguous_format)
                state["exp_avg_sq_codes"] = torch.zeros_like(
                    p, dtype=torch.uint8, memory_format=torch.contiguous_format)
                state["exp_avg_absmax"] = torch.zeros(nb, dtype=torch.float32, device=p.device)
                state["exp_avg_sq_absmax"] = torch.zeros(nb, dtype=torch.float32,
                                                         device=p.device)
            elif m == "bf16":
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key] = torch.zeros_like(p, dtype=torch.bfloat16,
                                                  memory_format=torch.contiguous_format)
            else:
                fp32 = kind != "plain"
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key] = (torch.zeros_like(p, dtype=torch.float32) if fp32 else
                                  torch.zeros_like(p, memory_format=torch.preserve_format))
                if amsgrad:
                    state["max_exp_avg_sq"] = torch.zeros_like(
                        p, memory_format=torch.preserve_format)
        elif m is None:
            if amsgrad and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = torch.zeros_like(p)
            if kind != "plain":
                for key in ("exp_avg", "exp_avg_sq"):
                    if state[key].dtype != torch.float32:  # a drop-in state loaded in this mode
                        state[key] = state[key].float()
        if kind == "master" and "master_param" not in state:
            state["master_param"] = p.detach().float()
            if m is not None:
                state["master_param"] = state["master_param"].contiguous()
        if kind == "pure" and kahan and "kahan_comp" not in state:
            state["kahan_comp"] = torch.zeros_like(p)
        return state

    def tensors(self, state, m):
        """(exp_avg, exp_avg_sq, exp_avg_absmax, exp_avg_sq_absmax) the kernel reads, local."""
        if m == "q8":
            return tuple(local(state[k]) for k in Q8_KEYS)
        return local(state["exp_avg"]), local(state["exp_avg_sq"]), None, None

    # -- checks --------------------------------------------------------------------------------

    def check(self, where, p, state, kind, amsgrad):
        """Raise if an existing state is not the layout `p` needs (before a step)."""
        step = state.get("step")
        if not isinstance(step, torch.Tensor) or step.numel() != 1:
            raise RuntimeError(f"fastllm.optim.AdamW: state 'step' of {where} must be a "
                               f"one-element tensor")
        m = self.mode(p)
        if m is not None:
            self._check_entries(where, p, state, m, "the")
            for key in self._expected(p, m):
                t = state[key]
                if t.device != p.device or not t.is_contiguous():
                    raise RuntimeError(f"fastllm.optim.AdamW: state '{key}' of {where} must be "
                                       f"contiguous on {p.device}")
            return
        for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
            t = state.get(key)
            if not isinstance(t, torch.Tensor):
                raise RuntimeError(f"fastllm.optim.AdamW: state '{key}' of {where} is missing")
            if t.shape != p.shape:
                raise RuntimeError(f"fastllm.optim.AdamW: state '{key}' of {where} has shape "
                                   f"{tuple(t.shape)}, expected {tuple(p.shape)}")
            # Mixed-precision params keep fp32 moments (a drop-in state in p.dtype is upcast).
            dtype_ok = t.dtype == p.dtype or (kind != "plain" and t.dtype == torch.float32)
            if t.device != p.device or not dtype_ok:
                raise RuntimeError(f"fastllm.optim.AdamW: state '{key}' of {where} must be a "
                                   f"{p.dtype} tensor on {p.device}, got {t.dtype} "
                                   f"on {t.device}")
        for key, dtype in (("master_param", torch.float32), ("kahan_comp", p.dtype)):
            t = state.get(key)
            if t is None:
                continue
            if (not isinstance(t, torch.Tensor) or t.shape != p.shape or t.dtype != dtype
                    or t.device != p.device):
                raise RuntimeError(f"fastllm.optim.AdamW: state '{key}' of {where} must be a "
                                   f"{dtype} tensor of shape {tuple(p.shape)} on {p.device}")

    def _check_entries(self, where, p, state, m, verb):
        for key, (dtype, numel) in self._expected(p, m).items():
            t = state.get(key)
            if not isinstance(t, torch.Tensor):
                other = "8-bit" if any(k in state for k in Q8_KEYS) else "fp32/bf16"
                raise RuntimeError(
                    f"fastllm.optim.AdamW: {verb} state of {where}: '{key}' is missing (the "
                    f"state holds {other} moments, this optimizer keeps {m} state for it; "
                    f"convert it with fastllm.optim.convert_state)")
            if t.dtype != dtype or t.numel() != numel:
                raise RuntimeError(
                    f"fastllm.optim.AdamW: {verb} state '{key}' of {where}: expected {dtype} "
                    f"with {numel} elements, got {t.dtype} with {t.numel()} (a different "
                    f"state_dtype, block_size or parameter? see fastllm.optim.convert_state)")
        master = state.get("master_param")
        loading = verb == "cannot load:"  # (convert_loaded upcasts a loaded master)
        if master is not None and (not isinstance(master, torch.Tensor) or master.shape != p.shape
                                   or (master.dtype != torch.float32 and not loading)):
            raise RuntimeError(f"fastllm.optim.AdamW: {verb} state 'master_param' of {where} "
                               f"must be an fp32 tensor of shape {tuple(p.shape)}")

    def check_loaded(self, state_dict, param_groups, name):
        """Refuse, before anything changes, a state_dict this optimizer cannot continue from:
        another optimizer's state (SGD's momentum_buffer, no exp_avg_sq), moments of another
        layout, tensors of the wrong shape. name(group, gi, pi, p) describes a param."""
        extra = state_dict.get("fastllm_lowbyte")
        if extra is not None and self.state_dtype == torch.uint8:
            if (extra.get("code") != CODE_NAME
                    or int(extra.get("block_size", -1)) != self.block_size):
                raise ValueError(
                    f"fastllm.optim.AdamW8bit: the state_dict's 8-bit state uses code "
                    f"{extra.get('code')!r} with block_size {extra.get('block_size')}; this "
                    f"optimizer uses {CODE_NAME!r} with block_size {self.block_size}. "
                    f"Requantise it with fastllm.optim.convert_state")
        saved_state = state_dict.get("state", {})
        for gi, (group, saved) in enumerate(zip(param_groups,
                                                state_dict.get("param_groups", []))):
            for pi, (pid, p) in enumerate(zip(saved["params"], group["params"])):
                state = saved_state.get(pid)
                if not state:
                    continue
                where = name(group, gi, pi, p)
                self._check_loaded_param(where, p, state, bool(saved.get("amsgrad", False)))

    def _check_loaded_param(self, where, p, state, amsgrad):
        if not isinstance(state, dict):
            raise RuntimeError(f"fastllm.optim.AdamW: cannot load state of {where}: it is a "
                               f"{type(state).__name__}, not a dict")
        foreign = sorted(str(k) for k in state if k not in KNOWN_KEYS)
        if foreign:
            raise RuntimeError(f"fastllm.optim.AdamW: cannot load state of {where}: unknown "
                               f"keys {foreign} (a state_dict of another optimizer?)")
        step = state.get("step")
        if not isinstance(step, (torch.Tensor, int, float)):
            raise RuntimeError(f"fastllm.optim.AdamW: cannot load state 'step' of {where}: "
                               f"{type(step).__name__}")
        if isinstance(step, torch.Tensor) and step.numel() != 1:
            # (the kernels read one count per param; torch's AdamW would fail at its step)
            raise RuntimeError(f"fastllm.optim.AdamW: cannot load state 'step' of {where}: "
                               f"a tensor of shape {tuple(step.shape)}, not one element")
        count = float(step)
        if not (math.isfinite(count) and count >= 0):  # (the kernels' bias corrections need it)
            raise RuntimeError(f"fastllm.optim.AdamW: cannot load state 'step' of {where}: "
                               f"{count}, not a finite count >= 0")
        master = state.get("master_param")
        if master is not None and not (isinstance(master, torch.Tensor)
                                       and master.is_floating_point()):
            raise RuntimeError(f"fastllm.optim.AdamW: cannot load state 'master_param' of "
                               f"{where}: it is not a floating-point tensor")
        m = self.mode(p)
        if m is not None:
            self._check_entries(where, p, state, m, "cannot load:")
            return
        if any(k in state for k in Q8_KEYS):
            raise RuntimeError(
                f"fastllm.optim.AdamW: cannot load state of {where}: it holds 8-bit moments but "
                f"this optimizer keeps fp32 state for it; convert the state_dict with "
                f"fastllm.optim.convert_state(state_dict, torch.float32)")
        for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
            if not isinstance(state.get(key), torch.Tensor):
                raise RuntimeError(f"fastllm.optim.AdamW: cannot load state of {where}: "
                                   f"'{key}' is missing")
        for key, value in state.items():
            if (key not in ("step",) + BLOCK_KEYS and isinstance(value, torch.Tensor)
                    and value.shape != p.shape):
                raise RuntimeError(f"fastllm.optim.AdamW: cannot load state '{key}' of "
                                   f"{where}: the state_dict has shape {tuple(value.shape)}")

    # -- after torch's load_state_dict ---------------------------------------------------------

    def restore_loaded(self, opt_state, state_dict, params):
        """torch's load casts every floating state tensor to its param's dtype: put the fp32
        masters/moments of low-precision params and the low-byte tensors back as saved, bit for
        bit."""
        saved_state = state_dict.get("state", {})
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        for pid, p in zip(saved_ids, params):
            saved = saved_state.get(pid)
            if not saved:
                continue
            m = self.mode(p)
            keys = FP32_STATE_KEYS if p.dtype in LOW_PRECISION else ()
            for key in keys if m is None else ("master_param",):
                value = saved.get(key)
                if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                    opt_state[p][key] = value.to(device=p.device, copy=True)
            for key in self._expected(p, m) if m is not None else ():
                value = saved[key]
                if m == "bf16":  # (contiguous, as made: a torch state's moments of a transposed
                    value = value.contiguous().view(p.shape)  # param keep its strides)
                opt_state[p][key] = value.to(device=p.device, copy=True)

    def convert_loaded(self, p, state, kind, kahan):
        """Bring a loaded per-param state into this optimizer's mode for `p`.

        Step counts become fp32 tensors on the param's device. A checkpoint of another mode is
        converted, not refused: into plain mode the master copy and Kahan buffer are dropped and
        the moments cast to the param's dtype; into master mode a master of another dtype (one
        that went through torch.optim.AdamW) is upcast to fp32, a Kahan buffer is folded into the
        new master (param + comp is the pure-bf16 run's best value); into pure mode a master is
        turned into the Kahan buffer (master - param) or dropped."""
        step = state.get("step")
        if step is not None:
            if not isinstance(step, torch.Tensor):
                step = torch.tensor(float(step))
            # (a copy: a state_dict of a live optimizer holds its own step tensors, which this
            # optimizer's steps would advance too)
            state["step"] = step.detach().to(device=p.device, dtype=torch.float32, copy=True)
        master, comp = state.get("master_param"), state.get("kahan_comp")
        if kind == "plain":
            state.pop("master_param", None)
            state.pop("kahan_comp", None)
            for key in TORCH_KEYS if self.mode(p) is None else ():
                t = state.get(key)
                if isinstance(t, torch.Tensor) and t.dtype != p.dtype:
                    state[key] = t.to(p.dtype)
        elif kind == "master":
            if master is None and comp is not None:
                state["master_param"] = p.detach().float() + comp.float()
            elif master is not None and master.dtype != torch.float32:
                # (torch.optim.AdamW casts a master it loads to its bf16 param: the same value)
                state["master_param"] = master.float().contiguous()
            state.pop("kahan_comp", None)
        else:  # pure
            if kahan and comp is None and master is not None:
                state["kahan_comp"] = (master - p.detach().float()).to(p.dtype)
            if not kahan:
                state.pop("kahan_comp", None)
            state.pop("master_param", None)


_QMAPS = {}


def qmaps(device):
    """The 8-bit code tables on `device`, built once."""
    device = torch.device(device)
    if device not in _QMAPS:
        _QMAPS[device] = build_qmaps(device)
    return _QMAPS[device]


def export_state(opt, state):
    """One param's state with its moments as fp32 `exp_avg` / `exp_avg_sq` (the layout of
    torch.optim.AdamW), for code that gathers or slices state element by element, such as a
    flat-shard optimizer consolidating its state (fastllm.distributed.DistributedOptimizer):
    8-bit codes are only meaningful with their block's absmax, and the blocks of a shard do not
    fall where a single process's would. Under FSDP2 the fp32 moments are DTensors placed as the
    codes are, so torch.distributed.checkpoint can gather them (it cannot gather the per-rank
    absmax of 8-bit state correctly: that is a plain tensor of this rank's blocks). bf16 moments
    and fp32 state come back as they are; the input is not modified. 8-bit -> fp32 is exact (the
    dequantised values). `opt` is any optimizer (those without fastllm moments pass through)."""
    moments = getattr(opt, "moments", None)
    if (moments is not None and moments.state_dtype == torch.uint8
            and all(k in state for k in Q8_KEYS)):
        codes = state["exp_avg_codes"]
        out = _dequantize_state({k: local(v) if k in Q8_KEYS else v for k, v in state.items()},
                                moments.block_size)
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
    moments = getattr(opt, "moments", None)
    m = None if moments is None else moments.mode(p)
    if m is None or "exp_avg" not in state or "exp_avg_sq" not in state:
        return state
    lp = local(p)
    exp_avg = local(state["exp_avg"]).reshape(lp.shape)
    exp_avg_sq = local(state["exp_avg_sq"]).reshape(lp.shape)
    if m == "bf16":
        state["exp_avg"], state["exp_avg_sq"] = (
            _like(p, t.to(device=lp.device, dtype=torch.bfloat16).contiguous())
            for t in (exp_avg, exp_avg_sq))
        return state
    state["exp_avg"], state["exp_avg_sq"] = exp_avg, exp_avg_sq
    _quantize_state(state, moments.block_size, lp.device)
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


def _like(p, lt):
    """`lt` (this rank's part of a tensor shaped like p) as p is: a DTensor with p's placements
    under FSDP2 (the moments Moments.init makes from p are), else itself."""
    if not is_dtensor(p):
        return lt
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(lt, p.device_mesh, p.placements, run_check=False,
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
    check_block_size("fastllm.optim.convert_state", block_size)
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
        out["fastllm_lowbyte"] = Moments(torch.uint8, block_size, min_8bit_size).extra()
    return out
