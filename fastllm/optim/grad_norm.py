"""The global gradient norm: one function for every way fastllm holds gradients.

    global_grad_norm(tensors, *, flat_shards=(), flat_group=None, groups=(), device=None)
        -> Tensor   # 0-dim, on the device, fp64 when every input is fp64, else fp32
    clip_coefficient(norm, max_norm) -> Tensor   # torch.nn.utils.clip_grad_norm_'s factor
    grad_norm_step(grads, out, ...) -> bool      # fastllm.optim.AdamW's one-launch prologue

sqrt(sum of x^2 over every element of every gradient of the model), equal on every rank to the
single-process torch.nn.utils.clip_grad_norm_(..., norm_type=2) of the whole model, wherever the
gradients live:
    - plain tensors: this rank's whole tensors (one fastllm::l2norm pass per device);
    - DTensors (FSDP2, tensor parallel): their local shards, summed over each mesh dimension they
      are sharded on (Replicate dims counted once; Partial dims are reduced first, as DTensor's
      own norm does);
    - flat shards: plain tensors that are this rank's slices of buffers partitioned over
      `flat_group` (ZeRO-1/2 shards of fastllm.distributed.DistributedOptimizer): their sum of
      squares is all-reduced over flat_group;
    - `groups`: extra process groups whose ranks hold different parts of the model (pipeline
      stages): the whole sum is all-reduced over each.
The result stays on the device: nothing is read back to the host, so a step that clips or skips
on it needs no synchronisation. Squares of fp64 gradients are summed in fp64; every partial sum
is carried in fp64 through the all-reduces (a 0-dim tensor), so ranks agree on the dtype of every
collective whatever their grads' dtypes. Every rank must make the same calls: a rank with no
gradients passes empty lists and still takes part in the all-reduces.

`grad_norm_step` is the single-process, single-device case of the same norm fused with the rest
of a mixed-precision optimizer step's scalar work (clip factor, skip flag, step counts, loss
scaler) in one Triton launch whose last program reduces the per-program fp64 partials in a fixed
order (fastllm/kernels/l2norm.py). fastllm.optim.AdamW uses it where it applies and global_grad_norm
everywhere else.
"""

import torch
import torch.distributed as dist

from fastllm import _backend
from fastllm._dtensor import SHARDED, Replicate, is_dtensor
from fastllm.ops.l2norm import l2norm

__all__ = ["clip_coefficient", "global_grad_norm", "grad_norm_step"]

# The step prologue is a Triton kernel: the default on a GPU, on the CPU only when forced (the
# test suite, through the interpreter).
_STEP_PREFERENCE = {"cuda": ("triton", "ref")}


def _dense_flat(t):
    """t as a tensor l2norm accepts (dense, contiguous), the same elements in any order: a flat
    view of a dense permuted tensor (a transposed grad), a copy of one with gaps."""
    if t.is_contiguous():
        return t
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz != 1):
        if stride != expected:
            return t.contiguous()
        expected *= size
    return t.as_strided((t.numel(),), (1,))


def _sum_squares(tensors, device):
    """Sum of squares of `tensors` (any devices) as a 0-dim fp64 tensor on `device`."""
    by_device = {}
    for t in tensors:
        if t.numel():
            by_device.setdefault(t.device, []).append(_dense_flat(t))
    total = torch.zeros((), dtype=torch.float64, device=device)
    for ts in by_device.values():
        total += l2norm(ts).to(device=device, dtype=torch.float64).square()
    return total


def _dtensor_parts(dtensors):
    """DTensors grouped by (mesh, sharded mesh dims): [(mesh, dims, local tensors)]."""
    parts = {}
    for g in dtensors:
        if any(p.is_partial() for p in g.placements):
            # An unreduced sum: its norm is the norm of the reduced tensor, so reduce it first.
            g = g.redistribute(g.device_mesh, [Replicate() if p.is_partial() else p
                                               for p in g.placements])
        dims = tuple(i for i, p in enumerate(g.placements) if isinstance(p, SHARDED))
        parts.setdefault((id(g.device_mesh), dims), (g.device_mesh, dims, []))[2].append(
            g.to_local())
    return list(parts.values())


def global_grad_norm(tensors=(), *, flat_shards=(), flat_group=None, groups=(), device=None):
    """The L2 norm of every element of every gradient across the ranks that hold them.

    tensors: grads, plain tensors (counted whole) and/or DTensors (their shards); any float dtypes,
        any layout (non-contiguous grads are read through a flat view or a copy).
    flat_shards: plain tensors, this rank's slices of buffers partitioned over `flat_group`.
    flat_group: the process group of flat_shards (all-reduced over it whenever it is given, also
        when this rank's flat_shards are empty).
    groups: process groups over which the total is summed as well (pipeline stages).
    device: where the result lives; default the first tensor's (local) device, else the CPU.
    Returns a 0-dim tensor on `device`: fp64 when every input tensor is fp64, else fp32. It is
    inf/nan when any element is (fastllm's optimizers skip such a step).
    """
    tensors = list(tensors)
    if not flat_shards and flat_group is None and not groups and tensors:
        # The common one-process case, cheaply recognised: one l2norm pass, nothing else.
        first = tensors[0]
        if type(first) is torch.Tensor and (device is None or device == first.device):
            dev = first.device
            if all(type(t) is torch.Tensor and t.is_contiguous() and t.device == dev
                   for t in tensors):
                return l2norm(tensors)
    flat_shards = list(flat_shards)
    groups = [g for g in groups if g is not None]
    dtensors = [t for t in tensors if is_dtensor(t)]
    plain = [t for t in tensors if not is_dtensor(t)]
    if device is None:
        first = next(iter(tensors + flat_shards), None)
        device = torch.device("cpu") if first is None else (
            first.to_local() if is_dtensor(first) else first).device
    inputs = tensors + flat_shards
    fp64 = bool(inputs) and all(t.dtype == torch.float64 for t in inputs)
    out_dtype = torch.float64 if fp64 else torch.float32
    total = _sum_squares(plain, device)
    for mesh, dims, local in _dtensor_parts(dtensors):
        sq = _sum_squares(local, device)
        for dim in dims:
            dist.all_reduce(sq, group=mesh.get_group(dim))
        total += sq
    if flat_group is not None:
        sq = _sum_squares(flat_shards, device)
        dist.all_reduce(sq, group=flat_group)
        total += sq
    elif flat_shards:
        raise ValueError("fastllm.optim.global_grad_norm: flat_shards need their flat_group")
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(total, group=group)
    return total.sqrt().to(out_dtype)


def clip_coefficient(norm, max_norm):
    """min(1, max_norm / (norm + 1e-6)): torch.nn.utils.clip_grad_norm_'s factor, on norm's
    device and in its dtype (nan when norm is nan, 0 when inf)."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def grad_norm_step(grads, out, *, skipped, skipped_steps, grad_scale=None, found_inf=None,
                   max_norm=None, steps=None, scaler=None):
    """The global norm of `grads` and a mixed-precision step's scalars, in one launch
    (fastllm.kernels.l2norm.grad_norm_step_triton has the outputs), where that applies: grads are
    plain dense contiguous tensors on one device, not all fp64, Triton is the backend for that
    device and nothing is being traced. Returns False, having done nothing, elsewhere (DTensor
    or sharded grads, several devices, torch.compile, a forced non-Triton backend, a CUDA graph
    capture before the launch's table exists): the caller then uses global_grad_norm."""
    if not grads or torch.compiler.is_compiling():
        return False
    device = grads[0].device
    if _backend.select("grad_norm_step", device.type,
                       _STEP_PREFERENCE.get(device.type, ("ref",))) != "triton":
        return False
    if not all(type(t) is torch.Tensor and t.device == device and t.is_contiguous()
               for t in grads):
        return False
    if all(t.dtype == torch.float64 for t in grads):
        return False  # the norm must stay fp64: global_grad_norm
    from fastllm.kernels.l2norm import grad_norm_step_triton

    with _backend.device_guard(device):
        return grad_norm_step_triton(grads, out, skipped=skipped, skipped_steps=skipped_steps,
                                     grad_scale=grad_scale, found_inf=found_inf,
                                     max_norm=max_norm, steps=steps, scaler=scaler)
