"""Many tensors in one launch: the device-side table the persistent optimizer kernels read.

One int64 buffer per set of tensors (NVIDIA/apex's multi_tensor_apply packs the same facts into
kernel arguments, which caps a launch at a few dozen tensors; a table in device memory has no
cap):
    tensors: FIELDS int64 per tensor: the base address (data_ptr) of each of its arrays (0 for
             an array the kernel does not read, or that this tensor does not have), the address
             of its fp32 step count (0 for a kernel without steps), its element count;
    chunks:  2 int64 per chunk: (tensor index, first element). A chunk is `chunk` elements of
             one tensor, its last one shorter; empty tensors have none.
A persistent grid (`programs`) strides over the chunks; each program reads a chunk's row, casts
the addresses to typed pointers and updates the chunk. The table is built on the host once per
set of addresses and kept (`table`): a training loop hands the same storages to every step, so
the upload happens on the first step and again only when an address changes.
"""

import collections

import torch
import triton
import triton.language as tl

from fastllm._backend import triton_interpreting

_CACHE = collections.OrderedDict()
_CACHE_SIZE = 16  # distinct tensor sets alive at once (param groups x dtypes), LRU beyond
_SMS = {}
# Tables a captured CUDA graph launches with: its replays read them, so the LRU must not free them.
_CAPTURED = set()
# The per-tensor fallback kernels loaded for a capture (load_fallback)
_LOADED = set()


class Table:
    """The uploaded table: `tensors` and `chunks` int64 views, `n_chunks`, and `aligned`, True
    when every address is a multiple of 16 bytes (the kernels may then use 128-bit accesses)."""

    __slots__ = ("buffer", "tensors", "chunks", "n_chunks", "aligned", "fallback_loaded")

    def __init__(self, buffer, n_tensor_words, n_chunks, aligned):
        self.buffer = buffer
        self.tensors = buffer[:n_tensor_words]
        self.chunks = buffer[n_tensor_words:]
        self.n_chunks, self.aligned = n_chunks, aligned
        # whether the caller's per-tensor fallback kernels are loaded for these tensors
        # (load_fallback)
        self.fallback_loaded = False


def load_fallback(found, device, launch, key):
    """Load the per-tensor fallback kernels of a table's tensors, on a GPU: a CUDA graph
    captured with tensors the table cache has not seen (grads created in the capture, after
    zero_grad(set_to_none=True)) launches the fallback, and CUDA refuses to load a module while
    a stream captures. launch() makes the fallback's launches with a grid of 0 programs: Triton
    compiles and loads each kernel for those arguments' specialisation and launches nothing.
    key(): what fixes those specialisations besides the addresses' alignment (the kernel,
    dtypes, sizes, flags): once per key and alignment in the process, so a table rebuilt for
    new addresses of the same tensors costs no launches."""
    if device.type != "cuda" or found.fallback_loaded:
        return
    loaded = (device, found.aligned, key())
    if loaded not in _LOADED:
        launch()
        _LOADED.add(loaded)
    found.fallback_loaded = True


def table(arrays, steps, chunk, device, sizes=None):
    """The Table of len(arrays[0]) tensors, or None when none can be used (the caller then
    launches once per tensor).

    arrays: lists of tensors, one list per array the kernel reads (a None list: not read; a None
    entry: that tensor has no such array), all on `device`; steps: one fp32 one-element tensor
    per tensor, on `device`, or None; chunk: elements per chunk; sizes: the tensors' element
    counts (default: those of arrays[0]). None while a CUDA graph is being captured and the
    table is not cached yet: an upload then would be captured as a copy from a host buffer that
    the replay reads again. A table used in a capture is kept for the life of the process (the
    graph's replays read it)."""
    if sizes is None:
        sizes = [t.numel() for t in arrays[0]]
    addresses = []
    for lst in arrays:
        addresses.append([0] * len(sizes) if lst is None else
                         [0 if t is None else t.data_ptr() for t in lst])
    step_addresses = [0] * len(sizes) if steps is None else [s.data_ptr() for s in steps]
    key = (device, chunk, tuple(sizes), tuple(step_addresses), *map(tuple, addresses))
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    found = _CACHE.get(key)
    if found is not None:
        _CACHE.move_to_end(key)
        if capturing:
            _CAPTURED.add(found)
        return found
    if capturing:
        return None
    words = []
    for i, n in enumerate(sizes):
        words += [a[i] for a in addresses]
        words += [step_addresses[i], n]
    n_tensor_words = len(words)
    n_chunks = 0
    for i, n in enumerate(sizes):
        for start in range(0, n, chunk):
            words += [i, start]
            n_chunks += 1
    aligned = all(a % 16 == 0 for lst in addresses for a in lst)
    host = torch.tensor(words, dtype=torch.int64)
    if device.type == "cuda":
        buffer = host.pin_memory().to(device, non_blocking=True)
    else:
        buffer = host.to(device)
    found = _CACHE[key] = Table(buffer, n_tensor_words, n_chunks, aligned)
    if len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return found


def programs(device, n_chunks):
    """The persistent grid: a few programs per SM on a GPU (enough to hide memory latency, few
    enough that each loops over many chunks); two under the interpreter, which runs programs one
    after another, so the grid-stride loop is exercised without a cost."""
    if triton_interpreting():
        return max(1, min(n_chunks, 2))
    if device.type == "cuda":
        sms = _SMS.get(device.index)
        if sms is None:
            sms = _SMS[device.index] = torch.cuda.get_device_properties(
                device).multi_processor_count
    else:
        sms = 132  # the static check (CPU tensors, compiled only): an H200's SM count
    return max(1, min(n_chunks, 4 * sms))


def one_device(device, *lists):
    """Whether every tensor in lists is on `device`: the table's addresses all point into one
    device's memory. The ops check this; the launchers are also called directly."""
    return all(t.device == device for lst in lists if lst for t in lst)


@triton.jit
def address(row_ptr, field: tl.constexpr, DTYPE: tl.constexpr, ALIGNED: tl.constexpr):
    """The field'th address of a table row as a pointer to DTYPE (16-byte aligned when
    ALIGNED, which the host checked)."""
    ptr = tl.load(row_ptr + field).to(tl.pointer_type(DTYPE))
    if ALIGNED:
        # On the pointer, not the integer: Triton 3.9 drops a hint on the int64 at the cast.
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def chunks_to_run(n_chunks, found_inf_ptr, HAS_FOUND_INF: tl.constexpr):
    """The loop bound of a persistent kernel over the chunk list: n_chunks, or 0 when the step is
    skipped (found_inf nonzero). A skipped step is an empty loop: one uniform scalar test, the
    accesses stay unmasked."""
    n = n_chunks
    if HAS_FOUND_INF:
        n = tl.where(tl.load(found_inf_ptr) == 0, n_chunks, 0)
    return n


@triton.jit
def chunk_at(tensors_ptr, chunks_ptr, c, FIELDS: tl.constexpr):
    """Chunk c of the list: its tensor's index, that tensor's table row, and its first element."""
    chunk = chunks_ptr + 2 * c  # c < 2^30: the table would not fit in memory first
    index = tl.load(chunk)
    return index, tensors_ptr + index * FIELDS, tl.load(chunk + 1)
