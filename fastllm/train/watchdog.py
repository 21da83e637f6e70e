"""parallel.timeout_s: after the first step, a collective that waits longer than this for a
hung or dead peer becomes an error naming the step and the collective, and the process exits
nonzero, so that `torchrun --max-restarts N` restarts the job and it auto-resumes from the last
checkpoint.

    dist.init_process_group(backend, timeout=watchdog.pg_timeout(cfg))  # init_timeout_s
    try:
        ...  # the training loop, calling watchdog.after_step(cfg) after each step (timeout_s)
    except RuntimeError as e:
        watchdog.reraise(e, steps_done, cfg)   # CollectiveTimeout naming step and collective

torchtitan calls it train_timeout_seconds, Hugging Face ddp_timeout. Without it Gloo waits 30
minutes, and a process blocked in a collective never gets to run its SIGTERM handler.
"""

import datetime
import re

__all__ = ["CollectiveTimeout", "pg_timeout", "after_step", "is_timeout", "reraise"]

# Gloo: "Timed out waiting 2000ms for recv operation"; NCCL's watchdog: "Watchdog caught
# collective operation timeout"; the c10d store: "Socket Timeout", "wait timeout".
_TIMEOUT = re.compile(r"Timed out waiting|collective operation timeout|Socket Timeout|"
                      r"wait timeout|timed out after", re.IGNORECASE)


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than parallel.timeout_s: a peer is hung or dead."""


def pg_timeout(cfg):
    """The init_process_group timeout: parallel.init_timeout_s (None: torch's default), which
    covers the set-up (rank 0 tokenizing while the others wait) and the first step."""
    seconds = cfg.parallel.init_timeout_s
    return datetime.timedelta(seconds=seconds) if seconds else None


def after_step(cfg):
    """Once a step is done: every process group of this process waits at most
    parallel.timeout_s from now on (torchtitan's init/train timeout split). Local, no
    communication; cheap enough to call every step."""
    import torch.distributed as dist

    seconds = cfg.parallel.timeout_s
    if not seconds or not dist.is_initialized():
        return
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=seconds)
    for group in list(c10d._world.pg_map):
        if not c10d._rank_not_in_group(group):
            c10d._set_pg_timeout(timeout, group)


def is_timeout(exc):
    """Whether a distributed error is a backend's timeout (torch raises RuntimeError or
    DistBackendError with the backend's message, not a type of its own). fastllm's own
    DistributedFailure (a peer raised and said so) is not one."""
    from fastllm.distributed.failure import DistributedFailure

    return (isinstance(exc, RuntimeError) and not isinstance(exc, DistributedFailure)
            and bool(_TIMEOUT.search(str(exc))))


def _where(exc, step):
    """(what, step) for the message: the innermost torch.distributed call in the traceback (the
    collective), else the gradient reduction inside backward; a checkpoint or an evaluation in
    progress belongs to the step just done, anything else to the next one."""
    what, in_checkpoint, in_eval = None, False, False
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        path = code.co_filename.replace("\\", "/")
        if "/torch/distributed/" in path and not code.co_name.startswith("_"):
            what = f"torch.distributed.{code.co_name}"
        elif "/torch/nn/parallel/distributed.py" in path:
            what = f"DistributedDataParallel's {code.co_name.lstrip('_')}"
        elif "/torch/autograd/" in path:
            what = "the gradient reduction in backward (DDP/FSDP hooks)"
        if code.co_name in ("save_checkpoint", "_rollback"):
            in_checkpoint = True
        in_eval = in_eval or (code.co_name == "run" and path.endswith("/train/evaluate.py"))
        tb = tb.tb_next
    what = what or "a collective"
    if in_checkpoint:
        return f"the checkpoint of step {step}: {what}"
    return f"the evaluation at step {step}: {what}" if in_eval else f"step {step + 1}: {what}"


def reraise(exc, step, cfg):
    """Re-raise `exc` (a RuntimeError caught around the loop, `step` steps done) as
    CollectiveTimeout when it is a timeout, unchanged otherwise."""
    if isinstance(exc, CollectiveTimeout) or not is_timeout(exc):
        raise exc
    seconds = cfg.parallel.timeout_s
    raise CollectiveTimeout(
        f"fastllm train: {_where(exc, step)} timed out"
        f"{f' after parallel.timeout_s={seconds:g} s' if seconds else ''}: a peer rank is hung "
        f"or dead. Exiting nonzero so that torchrun --max-restarts can restart the job, which "
        f"resumes from the last checkpoint ({str(exc).splitlines()[0][-200:]})") from exc
