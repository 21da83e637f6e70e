"""Start W local processes with a Gloo (CPU) or NCCL group and collect what each returns, with a
timeout on everything: what the tests and `fastllm bench --ops distributed` use.

    results = fastllm.distributed.launch.spawn(fn, world_size=2, args=(...), timeout=120)

fn(rank, world_size, *args) runs inside failure_guard() with one CPU thread per rank; its return
value comes back (pickled through a file) as results[rank]. If a rank raises, the error is
re-raised here naming it; if the processes do not all finish in `timeout` seconds they are
killed and a TimeoutError says which were still running.
"""

import datetime
import os
import pickle
import shutil
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastllm.distributed.failure import failure_guard

__all__ = ["spawn"]


def _entry(rank, fn, world_size, args, folder, backend, pg_timeout):
    torch.set_num_threads(1)  # the ranks share the cores; more threads only contend
    out = os.path.join(folder, f"rank{rank}.pkl")
    try:
        dist.init_process_group(
            backend, init_method=f"file://{os.path.join(folder, 'store')}", rank=rank,
            world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout))
        with failure_guard():
            result = fn(rank, world_size, *args)
        payload = ("ok", result)
    except BaseException:
        payload = ("error", _describe())
    try:
        data = pickle.dumps(payload)
    except BaseException:  # a result that does not pickle (a lambda): its error instead
        payload = ("error", f"the result of rank {rank} cannot be returned: {_describe()}")
        data = pickle.dumps(payload)
    with open(out + ".tmp", "wb") as f:
        f.write(data)
    os.replace(out + ".tmp", out)
    if payload[0] == "error":
        open(os.path.join(folder, f"rank{rank}.error"), "w").close()
    # No destroy_process_group or interpreter teardown: after a peer failed, either can block on
    # the broken Gloo pairs; the result is already on disk.
    os._exit(0)


def _describe():
    """The exception being handled, as 'Type: message' and its traceback (the message itself
    may fail to format: then its type alone)."""
    kind, exc, _ = sys.exc_info()
    try:
        text = str(exc)
    except BaseException:
        text = "<its message could not be formatted>"
    return f"{kind.__name__}: {text}\n{traceback.format_exc()}"


def _any_failed(folder, procs):
    """Whether a rank raised (its error marker exists) or died without a result."""
    for r, p in enumerate(procs):
        if os.path.exists(os.path.join(folder, f"rank{r}.error")):
            return True
        if p.exitcode not in (None, 0):
            return True
    return False


def spawn(fn, world_size, args=(), timeout=300, backend="gloo", pg_timeout=None, grace=15):
    """Run fn(rank, world_size, *args) in world_size processes; returns the list of results.

    Raises RuntimeError naming every rank that raised (with its traceback), TimeoutError when
    the processes are not done after `timeout` seconds. fn must be importable (module level).
    pg_timeout: the process group's own timeout in seconds (default: timeout).
    grace: seconds the other ranks get to finish once one has raised, before they are killed.
    """
    # 0 or fewer processes would return [] as if fn had run; bool is an int to Python
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"fastllm.distributed.launch.spawn: world_size must be an int >= 1, "
                         f"got {world_size!r}")
    folder = tempfile.mkdtemp(prefix="fastllm-dist-")
    ctx = mp.start_processes(
        _entry, args=(fn, world_size, args, folder, backend, pg_timeout or timeout),
        nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    procs = ctx.processes
    failed_at = None
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
        if failed_at is None and _any_failed(folder, procs):
            # The others may be blocked in a collective the failed rank never joins: give them
            # a grace period to fail on their own, then stop them.
            failed_at = time.monotonic()
            deadline = min(deadline, failed_at + grace)
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(5)
    results, errors = [], []
    for r in range(world_size):
        path = os.path.join(folder, f"rank{r}.pkl")
        if not os.path.exists(path):
            results.append(None)
            if r not in alive:
                errors.append(f"rank {r} exited with code {procs[r].exitcode} and no result")
            continue
        with open(path, "rb") as f:
            status, value = pickle.load(f)
        if status == "ok":
            results.append(value)
        else:
            results.append(None)
            errors.append(f"rank {r} raised {value}")
    shutil.rmtree(folder, ignore_errors=True)
    if alive and failed_at is None:
        raise TimeoutError(f"fastllm.distributed.spawn: ranks {alive} were still running after "
                           f"{timeout} s and were killed" + "".join("\n" + e for e in errors))
    if alive:
        errors.append(f"ranks {alive} were killed {grace} s after the first failure")
    if errors:
        raise RuntimeError("fastllm.distributed.spawn: " + "\n".join(errors))
    return results
