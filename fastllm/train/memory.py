"""Peak tensor memory of one training step on any device (a TorchDispatchMode).

On CUDA torch.cuda.max_memory_allocated answers this; on the CPU nothing does, so the step is run
under PeakMemory: bytes held when it starts (every tensor passed to track: params, grads,
optimizer state) plus the highest total of the storages the step itself allocates and still
holds, each counted once however many views share it, released when its storage is freed.
A DTensor counts by its local shard (the mode sees a DTensor op's output, not the local ops inside
it); a storage already freed by resizing (FSDP2's unsharded parameters) is not counted.
"""

import resource
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # torch built without distributed
    _DTensor = None

__all__ = ["PeakMemory", "step_peak"]


def step_peak(device, tracked_peak):
    """A step's peak_mem_bytes: on CUDA max_memory_allocated since its reset; else the first
    step's PeakMemory peak (tracked_peak) where one was tracked; else the process's peak RSS."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if tracked_peak is not None:
        return tracked_peak
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class PeakMemory(TorchDispatchMode):
    def __init__(self, *tracked):
        super().__init__()
        self._known = set()
        self.baseline = 0
        for obj in tracked:
            for t in _tensors(obj):
                st = _local(t).untyped_storage()
                if st.data_ptr() not in self._known:
                    self._known.add(st.data_ptr())
                    self.baseline += st.nbytes()
        self.current = 0
        self.peak_new = 0
        self._live = weakref.WeakKeyDictionary()

    @property
    def peak(self):
        return self.baseline + self.peak_new

    def _release(self, nbytes):
        self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # where the inputs' storages are before the op: an output there is a view of one or an
        # in-place op's (no allocation); one that moved was (re)allocated (out=, resize_)
        inputs = {_storage_ptr(a) for a in tree_flatten((args, kwargs))[0]}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            t = _local(t)
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            try:
                st.data_ptr()
            except RuntimeError:  # resized away (FSDP2 frees an unsharded parameter so)
                continue
            if st in self._live or st.data_ptr() in self._known:
                continue
            if st.nbytes() == 0 or st.data_ptr() in inputs:
                continue  # (an input's: a tensor made before the step, viewed or written)
            self._live[st] = st.nbytes()
            weakref.finalize(st, self._release, st.nbytes())
            self.current += st.nbytes()
            self.peak_new = max(self.peak_new, self.current)
        return out


def _local(t):
    """A DTensor's local shard (what this rank holds), anything else as it is."""
    return t._local_tensor if _DTensor is not None and isinstance(t, _DTensor) else t


def _storage_ptr(t):
    t = _local(t)
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        for p in obj.parameters():
            yield p
            if p.grad is not None:
                yield p.grad
        yield from obj.buffers()
    elif hasattr(obj, "state") and hasattr(obj, "param_groups"):
        for state in obj.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    yield v
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
