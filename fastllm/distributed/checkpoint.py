"""Atomic checkpoint files: written under a temporary name, fsynced, renamed into place, so a
half-written checkpoint is never picked up (a crash leaves the previous file or none). load()
never runs code from the file (torch.load with weights_only=True)."""

import contextlib
import os
import tempfile

import torch

__all__ = ["save_atomic", "load"]


def save_atomic(obj, path):
    """torch.save(obj) to `path` atomically: temp file in the same folder, fsync, os.replace,
    fsync of the folder (so the rename itself survives a power cut)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # what a plain open() would have given, not mkstemp's 0600
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load(path, map_location="cpu"):
    """torch.load of a file written by save_atomic (never a temporary), with weights_only=True:
    tensors, numbers, strings and plain containers load; a pickle that would run code (a
    `__reduce__` of any other type) is refused with torch's UnpicklingError. fastllm's own
    state holds nothing else; a type of your own in the saved object needs
    torch.serialization.add_safe_globals([YourType]) before load."""
    return torch.load(os.fspath(path), map_location=map_location, weights_only=True)

