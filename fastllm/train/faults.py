"""Deterministic fault injection for the training runtime, read from the FASTLLM_FAULT variable.

    FASTLLM_FAULT="sigkill_after_step=5" fastllm train ...     # dies right after step 5
    FASTLLM_FAULT="sigkill_after_checkpoint_file=6,rank=0"    # dies after the 6th checkpoint file

A test that kills a run "at step k" sets the fault, so step k is exact instead of a poller racing
the run. Faults (comma-separated key=value; at most one of each):

    sigkill_after_step=N             SIGKILL this process once step N is complete (logged, and
                                     checkpointed when due)
    sigterm_after_step=N             send SIGTERM to this process once step N is complete: the
                                     runtime's handler saves a checkpoint at step N + 1 and stops
    sigkill_after_checkpoint_file=K  SIGKILL this process right after the K-th file written by
                                     fastllm.train.checkpoint.save (counted over the whole run:
                                     a checkpoint of 4 files at steps 3, 6, ... puts K=6 in the
                                     second file of checkpoint-6)
    sigstop_before_step=N            SIGSTOP this process before step N starts: a hung peer (its
                                     collectives never arrive)
    rank=R                           only the process with RANK=R (default: every process)

Nothing here runs unless the variable is set.
"""

import os
import signal

__all__ = ["after_step", "before_step", "after_checkpoint_file", "parse"]

_KEYS = ("sigkill_after_step", "sigterm_after_step", "sigkill_after_checkpoint_file",
         "sigstop_before_step", "rank")

_files_written = 0


def parse(text):
    """{key: int} from FASTLLM_FAULT's text; an unknown or repeated key or a non-integer value
    is refused (a repeated key would fire at one of its values only)."""
    faults = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in _KEYS:
            raise ValueError(f"FASTLLM_FAULT: {item!r} is not one of {', '.join(_KEYS)} (=int)")
        if key in faults:
            raise ValueError(f"FASTLLM_FAULT: {key} is given twice ({text!r}); give each fault "
                             f"at most once")
        try:
            faults[key] = int(value)
        except ValueError:
            raise ValueError(f"FASTLLM_FAULT: {key} needs an integer, got {value!r}") from None
    return faults


def _active():
    text = os.environ.get("FASTLLM_FAULT")
    if not text:
        return {}
    faults = parse(text)
    if "rank" in faults and faults["rank"] != int(os.environ.get("RANK", "0")):
        return {}
    return faults


def _die(sig):
    os.kill(os.getpid(), sig)


def after_step(step):
    """Called once step `step` is complete (logged, and checkpointed when due)."""
    faults = _active()
    if faults.get("sigkill_after_step") == step:
        _die(signal.SIGKILL)
    if faults.get("sigterm_after_step") == step:
        _die(signal.SIGTERM)


def before_step(step):
    """Called before step `step` (1-based) starts."""
    if _active().get("sigstop_before_step") == step:
        _die(signal.SIGSTOP)


def after_checkpoint_file():
    """Called after each file (or folder) a checkpoint writes."""
    global _files_written
    faults = _active()
    if not faults:
        return
    _files_written += 1
    if faults.get("sigkill_after_checkpoint_file") == _files_written:
        _die(signal.SIGKILL)
