"""Backend selection: which implementation of an op runs for a given device.

Backends:
    ref     plain PyTorch (`<op>_ref`): the oracle and the last-resort fallback, any device
    cpp     C++ kernels in fastllm._C, CPU tensors
    triton  Triton kernels in fastllm.kernels, CUDA tensors (CPU tensors too under
            TRITON_INTERPRET=1, which is how the test suite runs them without a GPU)
    cuda    CUDA kernels in fastllm._C, CUDA tensors

`FASTLLM_BACKEND=<name>` or `with fastllm.use_backend(name):` forces one backend for every op; a
forced backend that cannot run says why instead of silently falling back. Otherwise each op picks
the first available backend of its preference list for the device.
"""

import contextlib
import functools
import os
import threading

import torch

from fastllm import _extension

BACKENDS = ("ref", "cpp", "triton", "cuda")


class _Local(threading.local):
    """Per-thread state; the class attributes are each new thread's values (a getattr default
    on a plain threading.local raised and caught AttributeError on every read: 0.4 us)."""

    forced = None  # the backend use_backend forces on this thread
    validated = False  # inside validated()


_local = _Local()
_UNSET = object()


@contextlib.contextmanager
def use_backend(name):
    """Force `name` for every fastllm op called inside the block (this thread only)."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"fastllm: unknown backend {name!r}; choose one of {BACKENDS}")
    previous = _local.forced
    _local.forced = name
    try:
        yield
    finally:
        _local.forced = previous


def thread_backend():
    """The backend use_backend forces on this thread, or None."""
    return _local.forced


@contextlib.contextmanager
def validated():
    """Inside the block (this thread), ops skip their per-tensor argument checks: the caller
    (fastllm.optim.AdamW's step) has just checked the same tensors, with better names in its
    messages. Once per step instead of twice is what the Python overhead of a small step was."""
    previous = _local.validated
    _local.validated = True
    try:
        yield
    finally:
        _local.validated = previous


def prevalidated():
    return _local.validated


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def direct(*tensor_lists):
    """Whether an op's functional form may call its implementation directly instead of through
    torch.ops (the dispatcher boxes every tensor of every list, a few microseconds per tensor of
    an optimizer step): only in plain eager code under no_grad, where the dispatcher would do
    nothing but route the call. Under torch.compile, a dispatch or function mode (FakeTensor,
    FlopCounter, ...), a functorch transform or grad mode the op goes through torch.ops as
    before, and so do tensor subclasses (DTensor, a wrapper subclass: the kernels would read
    their data pointers, which are not their values; one segfaulted) in `tensor_lists`, unless
    the caller validated them (fastllm.optim's step plan hands the kernels plain tensors)."""
    if (torch.is_grad_enabled() or intercepted()
            or torch._C._are_functorch_transforms_active()):
        return False
    # Meta tensors (a model built under torch.device("meta")) have no values: through torch.ops
    # their fake kernels run, as torch.optim.AdamW's step on them only makes state. (The first
    # tensor tells: an op refuses tensors on more than one device.)
    first = next((t for tensors in tensor_lists for t in tensors if t is not None), None)
    if first is not None and first.is_meta:
        return False
    return prevalidated() or all(type(t) in _PLAIN for tensors in tensor_lists
                                 for t in tensors if t is not None)


def intercepted():
    """Whether something other than plain eager execution sees an op call, so that it must go
    through torch.ops: torch.compile tracing, a dispatch or function mode (FakeTensor,
    FlopCounter, ...), torch.jit.trace (which records torch.ops, not what an implementation
    calls). The shared part of direct() and fastllm._library.plain_eager."""
    return (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
            or torch._C._is_torch_function_mode_enabled()
            or torch._C._get_tracing_state() is not None)


# os.environ.get costs about 0.7 us (Mapping.get, the key encoded and the value decoded by Python
# methods), and a patched model's step reads FASTLLM_BACKEND and TRITON_INTERPRET hundreds of
# times. os.environ keeps its encoded items in `_data` (CPython's os._Environ, which every set
# and delete updates, monkeypatch.setenv's included): read there in one dict lookup; through
# os.environ.get where it has no such mapping (another implementation, or os.environ replaced
# by a plain mapping, as a test's mock may) and while torch.compile traces (dynamo knows
# os.environ, not its mapping).


def getenv(name, default=None):
    """os.environ.get(name, default), without its per-call Python methods where it can."""
    environ = os.environ
    if type(environ) is not _ENVIRON_TYPE or torch.compiler.is_compiling():
        return environ.get(name, default)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = environ.encodekey(name)
    value = environ._data.get(key)
    return default if value is None else environ.decodevalue(value)


# os._Environ, where its instances keep their items in a dict `_data`; else None (every read
# through os.environ.get)
_ENVIRON_TYPE = type(os.environ) if isinstance(getattr(os.environ, "_data", None), dict) and all(
    callable(getattr(os.environ, f, None)) for f in ("encodekey", "decodevalue")) else None


_ENV_KEYS = {}  # name -> os.environ's encoded key


def env_choice(name, choices):
    """The value of environment variable `name`, one of `choices` ("auto", the first, when unset):
    the CPU policy switches (FASTLLM_CPU_LOWP_MATMUL, FASTLLM_CPU_FP32_MATMUL,
    FASTLLM_CPU_ATTENTION); anything else is refused by name."""
    value = getenv(name) or choices[0]  # (an empty value is unset, as FASTLLM_BACKEND's)
    if value not in choices:
        raise ValueError(f"fastllm: {name}={value!r} is not one of {tuple(choices)}")
    return value


def forced_backend():
    name = _local.forced or getenv("FASTLLM_BACKEND") or None
    if name is not None and name not in BACKENDS:
        raise ValueError(f"fastllm: FASTLLM_BACKEND={name!r} is not one of {BACKENDS}")
    return name


_NO_GUARD = contextlib.nullcontext()


def device_guard(device):
    """Make `device` current for a Triton launch (Triton launches on the current CUDA device,
    and a torch.library Python kernel sets no guard); a no-op for CPU tensors."""
    if not isinstance(device, torch.device):
        device = torch.device(device)
    # (only where the device is not already current: entering and leaving torch.cuda.device
    # costs microseconds, and a patched model's step makes hundreds of such calls)
    # (the index first: None on a CPU device, and cheaper to read than the type)
    index = device.index
    if index is not None and device.type == "cuda" and index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return _NO_GUARD


# what Triton reads as TRITON_INTERPRET set (triton.knobs' env_bool, any case): "1" alone would
# refuse the triton backend on CPU tensors that Triton is interpreting
_TRUE = ("1", "true", "on", "yes", "y")


def triton_interpreting():
    return getenv("TRITON_INTERPRET", "0").lower() in _TRUE


# (import fastllm imports torch._dynamo, which imports triton.language: its functions are made
# for the GPU unless TRITON_INTERPRET was set before; set later, Triton failed on CPU tensors with
# "Cannot call @triton.jit'd outside of the scope of a kernel")
_INTERPRETING_AT_IMPORT = triton_interpreting()


@functools.lru_cache(maxsize=None)
def triton_available():
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def unavailable_reason(backend, device_type):
    """None if `backend` can run on `device_type`, else a sentence saying why not."""
    if backend == "ref":
        return None
    if backend == "cpp":
        if device_type != "cpu":
            return f"the cpp backend runs on CPU tensors, not {device_type}"
        if not _extension.has_cpp():
            error = _extension._ERROR
            if error is not None and not isinstance(error, ModuleNotFoundError):
                # (built, but it does not load: a truncated file, a symbol of another torch)
                return (f"fastllm._C does not import ({error}); rebuild it (pip install "
                        f"--no-build-isolation -e .)")
            return "fastllm._C is not built (pip install --no-build-isolation -e .)"
        return None
    if backend == "cuda":
        if device_type != "cuda":
            return f"the cuda backend runs on CUDA tensors, not {device_type}"
        if not _extension.has_cuda_kernels():
            return "fastllm._C was built without CUDA kernels"
        return None
    if backend == "triton":
        if not triton_available():
            return "triton is not installed"
        if device_type == "cpu" and not (triton_interpreting() and _INTERPRETING_AT_IMPORT):
            late = " (it was set after import)" if triton_interpreting() else ""
            return (f"Triton runs on CPU tensors only with TRITON_INTERPRET=1 set before import"
                    f"{late}")
        if device_type not in ("cpu", "cuda"):
            return f"Triton kernels here target CUDA tensors, not {device_type}"
        return None
    raise ValueError(f"fastllm: unknown backend {backend!r}")


def select(op_name, device_type, preference, forced=_UNSET):
    """The backend to run `op_name` on `device_type`.

    preference: backends in order of preference for that device, e.g. ("cuda", "triton", "ref").
    forced: forced_backend(), where the caller has it already (each read of the environment
    costs microseconds, and a model op selects twice per step).
    """
    if forced is _UNSET:
        forced = forced_backend()
    if forced is not None:
        reason = unavailable_reason(forced, device_type)
        if reason is not None:
            raise RuntimeError(f"fastllm.{op_name}: backend {forced!r} was forced but {reason}")
        return forced
    for backend in preference:
        if unavailable_reason(backend, device_type) is None:
            if backend == "ref":
                _extension.extension()  # warns once that the fast path is missing
            return backend
    return "ref"


# What the compiled kernels of the model ops (rms_norm, swiglu, rotary_embedding, attention, the
# fused loss, lora_linear) take; fp64 runs on the reference.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def implementation(op_name, impls, backend):
    """impls[backend]; a backend the op has no kernel for (only a forced one can be chosen) is
    refused by name, with the backends it has."""
    if backend not in impls:
        raise RuntimeError(f"fastllm.{op_name}: backend {backend!r} was forced but this op has no "
                           f"{backend} kernel (it has {', '.join(sorted(impls))})")
    return impls[backend]


def select_kernel(op_name, device_type, dtype, preference, kernels, *, cpp_entry=None,
                  kernel_dtypes=None):
    """The backend one call of an op runs: `select`'s choice for the device, then the op's limits.

    preference: {device_type: backends in order} (other devices: ("ref",)). kernels: the backends
    the op has; a forced backend not among them is refused. cpp_entry: the fastllm._C function
    the cpp backend calls; an extension built before it existed runs the reference instead.
    kernel_dtypes: {backend: dtypes its kernels take}; other dtypes run the reference. Where the
    backend was forced, each of these says why it cannot run instead of falling back."""
    forced_name = forced_backend()
    if forced_name is None:
        # the unforced choice depends only on these and on what is installed: kept (a model op
        # selects twice per call, and a patched step makes hundreds of calls). An op name has
        # one set of kernels and kernel dtypes; its preference for the device is in the key.
        key = (op_name, device_type, dtype, preference.get(device_type))
        backend = _CHOSEN.get(key)
        if backend is None:
            backend = _CHOSEN[key] = _choose(op_name, device_type, dtype, preference, kernels,
                                             None, kernel_dtypes)
    else:
        backend = _choose(op_name, device_type, dtype, preference, kernels, forced_name,
                          kernel_dtypes)
    if backend == "cpp" and cpp_entry is not None and not hasattr(_extension.extension(),
                                                                  cpp_entry):
        if forced_name is not None:
            raise RuntimeError(f"fastllm.{op_name}: backend 'cpp' was forced but fastllm._C "
                               f"predates {cpp_entry}; rebuild it (make build)")
        return "ref"
    return backend


_CHOSEN = {}  # (op name, device type, dtype, preference) -> the unforced backend


def _choose(op_name, device_type, dtype, preference, kernels, forced_name, kernel_dtypes):
    backend = select(op_name, device_type, preference.get(device_type, ("ref",)), forced_name)
    forced = forced_name == backend
    implementation(op_name, kernels, backend)  # a forced backend the op lacks: refused by name
    dtypes = (kernel_dtypes or {}).get(backend)
    if dtypes is not None and dtype not in dtypes:
        if forced:
            names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise RuntimeError(f"fastllm.{op_name}: backend {backend!r} was forced but its "
                               f"kernels take {names}, not {dtype}")
        return "ref"
    return backend
