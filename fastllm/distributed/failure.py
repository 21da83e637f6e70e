"""Loud failures: a rank that raises tells the others who it was, and nothing waits forever.

Each rank runs its training code inside `failure_guard()`: an exception is written to the
process group's store (key "fastllm/failure": "rank R: Type: message") before it propagates.
fastllm's collectives wait with a timeout (`wait(work, timeout)`); when one fails or times out,
the error raised names the rank that reported a failure, or says that no rank did (a peer that
died without reporting, or one stuck outside a collective).
"""

import contextlib
import datetime
import threading
import time
import traceback

import torch.distributed as dist

FAILURE_KEY = "fastllm/failure"
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


class DistributedFailure(RuntimeError):
    """A collective failed or timed out because another rank failed or stopped responding."""


def as_timedelta(timeout):
    """seconds (int/float) or a timedelta -> timedelta; None -> DEFAULT_TIMEOUT."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))


def _store():
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # no default group, or its store is gone with rank 0
        return None


def report_failure(exc):
    """Record on the default group's store that this rank failed with `exc` (best effort)."""
    store = _store()
    if store is None:
        return
    rank = dist.get_rank() if dist.is_initialized() else -1
    line = traceback.format_exception_only(type(exc), exc)[-1].strip()
    try:
        if not store.check([FAILURE_KEY]):
            store.set(FAILURE_KEY, f"rank {rank}: {line}")
    except Exception:
        pass


def reported_failure():
    """The first failure any rank reported ("rank R: Type: message"), or None."""
    store = _store()
    if store is None:
        return None
    try:
        if store.check([FAILURE_KEY]):
            return store.get(FAILURE_KEY).decode()
    except Exception:
        return None
    return None


@contextlib.contextmanager
def failure_guard():
    """Run a rank's training code; an exception is reported to the other ranks, then re-raised."""
    try:
        yield
    except BaseException as exc:
        if not isinstance(exc, DistributedFailure):
            report_failure(exc)
        raise


def collective_error(what, exc=None, timeout=None):
    """The DistributedFailure to raise when collective `what` failed (exc) or timed out; give
    timeout only when the deadline passed (the message then says "after N s")."""
    rank = dist.get_rank() if dist.is_initialized() else -1
    reason = reported_failure()
    after = f" after {as_timedelta(timeout).total_seconds():g} s" if timeout is not None else ""
    if reason is not None:
        msg = (f"fastllm.distributed: {what} on rank {rank} failed{after} because {reason} "
               f"(reported by that rank)")
    else:
        msg = (f"fastllm.distributed: {what} on rank {rank} failed{after}; no rank reported an "
               f"exception, so a peer died or is stuck outside the collective")
    if exc is not None:
        msg += f" [{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}]"
    return DistributedFailure(msg)


def wait(work, what, timeout=None):
    """Wait for `work` (an async collective); raise DistributedFailure naming the failed rank as
    soon as one reports a failure, when the collective errors, or after `timeout`.

    Gloo's work.wait ignores its timeout argument and its reduce-scatter never reports
    is_completed(), so the blocking wait runs in a helper thread while this one checks the store
    for reported failures every 0.2 s and the deadline.
    """
    if work.is_completed():
        try:
            work.wait()
        except Exception as exc:
            raise collective_error(what, exc) from exc
        return
    done, errors = threading.Event(), []

    def block():
        try:
            work.wait()
        except BaseException as exc:  # handed to the waiting thread
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=block, daemon=True, name="fastllm-collective-wait").start()
    deadline = time.monotonic() + as_timedelta(timeout).total_seconds()
    while not done.wait(0.2):
        if reported_failure() is not None:
            raise collective_error(what)
        if time.monotonic() >= deadline:
            raise collective_error(what, None, timeout)
    if errors:
        raise collective_error(what, errors[0]) from errors[0]
