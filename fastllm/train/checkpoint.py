"""Checkpoints that survive crashes: output_dir/checkpoint-<step>/ with a manifest of sizes and
sha256 checksums, written to a temporary folder, fsynced, then renamed into place.

A crash while writing leaves a `.tmp-checkpoint-*` folder that is never read (and is removed by
the next run, which puts back a checkpoint of the same step it was replacing); a checkpoint
whose files do not match its manifest is refused with the reason, and the next older one is
used. The manifest must list every file the loader reads (trainer_state.pt,
optimizer.pt, and model.pt or the adapter's two files, and READ_IF_PRESENT where there) with its
size and sha256, inside the checkpoint (no symlink out of it); a manifest of any other shape is
an invalid checkpoint, never a crash. Every .pt file is read with
torch.load(weights_only=True): a checkpoint holds tensors and plain containers, no code.
"""

import errno
import hashlib
import json
import os
import re
import shutil
import uuid

import torch

from fastllm.train import faults

__all__ = ["CheckpointError", "save", "verify", "latest_valid", "resume_point", "usable",
           "list_checkpoints", "prune",
           "load_file", "MANIFEST"]

MANIFEST = "manifest.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")
# What save() leaves when interrupted: its temporary folder, and a replaced checkpoint set aside
# (between its two renames).
_TMP = ".tmp-checkpoint-"
_OLD = re.compile(r"^(checkpoint-\d+)\.old-")


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete or corrupt."""


def _sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(root):
    out = []
    for folder, _, names in os.walk(root):
        for name in names:
            full = os.path.join(folder, name)
            out.append(os.path.relpath(full, root))
    return sorted(out)


def save(output_dir, step, writers):
    """Write checkpoint-<step> atomically. writers: {relative name: fn(path)}, each writing one file
    or folder. Returns the checkpoint's path. An existing checkpoint of the same step (after a
    rollback) is replaced only once the new one is complete."""
    final = os.path.join(output_dir, f"checkpoint-{step}")
    tmp = target = os.path.join(output_dir, f".tmp-checkpoint-{step}-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(tmp)
        for name, write in writers.items():
            target = os.path.join(tmp, name)
            write(target)
            faults.after_checkpoint_file()
        entries = {}
        for rel in _files(tmp):
            target = os.path.join(tmp, rel)
            with open(target, "rb") as f:
                os.fsync(f.fileno())
            entries[rel] = {"bytes": os.path.getsize(target), "sha256": _sha256(target)}
        target = os.path.join(tmp, MANIFEST)
        with open(target, "w") as f:
            json.dump({"step": step, "files": entries}, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        for folder, _, _ in os.walk(tmp):
            _fsync_dir(folder)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # (the next run's remove_partial otherwise)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise CheckpointError(f"no space left on device (ENOSPC) while writing {target} "
                                  f"of checkpoint-{step}; free space in {output_dir} (the "
                                  f"previous checkpoints are intact)") from e
        raise
    if os.path.exists(final):
        # A folder cannot be renamed over a non-empty one: the old one steps aside first. Until
        # the new one is in place the old one is the checkpoint: put back if the rename fails,
        # and by remove_partial after a crash between the two renames.
        old = final + f".old-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
        try:
            os.rename(tmp, final)
        except BaseException:
            os.rename(old, final)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(output_dir)
    return final


# The files load_checkpoint reads: all of REQUIRED and one of the model alternatives.
REQUIRED = ("trainer_state.pt", "optimizer.pt")
MODEL_FILES = (("model.pt",), ("adapter/adapter_model.safetensors", "adapter/adapter_config.json"))
# Files the loader reads whenever they exist: listed if there (fastllm.prefix.RESUME_WEIGHTS)
READ_IF_PRESENT = ("adapter/prefix_encoder.safetensors",)


def _read_manifest(path):
    """The manifest's {relative name: {"bytes": int, "sha256": str}}, or CheckpointError."""
    manifest = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest):
        raise CheckpointError(f"{path} has no {MANIFEST} (an incomplete write?)")
    try:
        with open(manifest) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}/{MANIFEST} is unreadable: {e}") from None
    entries = data.get("files") if isinstance(data, dict) else None
    if not isinstance(entries, dict):
        raise CheckpointError(f"{path}/{MANIFEST} is malformed: 'files' must be a mapping of "
                              f"file name to size and sha256")
    for rel, meta in entries.items():
        parts = rel.replace("\\", "/").split("/")
        if os.path.isabs(rel) or ".." in parts:
            raise CheckpointError(f"{path}/{MANIFEST} names {rel!r}, outside the checkpoint")
        if not (isinstance(meta, dict) and type(meta.get("bytes")) is int
                and isinstance(meta.get("sha256"), str)):
            raise CheckpointError(f"{path}/{MANIFEST} is malformed: the entry of {rel!r} needs "
                                  f"an integer 'bytes' and a string 'sha256', got {meta!r}")
    missing = [r for r in REQUIRED if r not in entries]
    if not any(all(r in entries for r in alt) for alt in MODEL_FILES):
        missing.append(" or ".join("+".join(alt) for alt in MODEL_FILES))
    if missing:
        raise CheckpointError(f"{path}/{MANIFEST} does not list {', '.join(missing)}, which the "
                              f"loader reads (every file read must be checksummed)")
    return entries


def verify(path):
    """Raise CheckpointError (saying what is wrong) unless the manifest is well formed, lists
    every file the loader reads, and every listed file matches its size and sha256."""
    entries = _read_manifest(path)
    for rel in READ_IF_PRESENT:
        if rel not in entries and os.path.lexists(os.path.join(path, rel)):
            raise CheckpointError(f"{path}: {rel} is there but not in {MANIFEST}, and the loader "
                                  f"reads it (every file read must be checksummed)")
    root = os.path.realpath(path)
    for rel, meta in entries.items():
        full = os.path.join(path, rel)
        real = os.path.realpath(full)
        if os.path.commonpath([root, real]) != root:  # a symlink (of it or a folder) leads out
            raise CheckpointError(f"{path}/{MANIFEST} names {rel!r}, outside the checkpoint "
                                  f"(a symlink to {real})")
        if not os.path.isfile(full):
            raise CheckpointError(f"{path}: {rel} is missing")
        try:
            size = os.path.getsize(full)
            digest = _sha256(full) if size == meta["bytes"] else None
        except OSError as e:
            # an unreadable file (EIO of a bad disk, EACCES) is a bad checkpoint: the caller
            # falls back to the previous one
            raise CheckpointError(f"{path}: {rel} cannot be read: {e}") from None
        if size != meta["bytes"]:
            raise CheckpointError(f"{path}: {rel} has {size} bytes, the manifest says "
                                  f"{meta['bytes']} (truncated?)")
        if digest != meta["sha256"]:
            raise CheckpointError(f"{path}: {rel} does not match its sha256 checksum (corrupt)")


def list_checkpoints(output_dir):
    """[(step, path)] of the checkpoint-<step> folders, newest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        m = _NAME.match(name)
        if m and os.path.isdir(os.path.join(output_dir, name)):
            found.append((int(m.group(1)), os.path.join(output_dir, name)))
    return sorted(found, reverse=True)


def latest_valid(output_dir, log=print):
    """The newest checkpoint that verifies, as (step, path), or None; each refused one is logged."""
    for step, path in list_checkpoints(output_dir):
        try:
            verify(path)
        except CheckpointError as e:
            log(f"fastllm train: refusing checkpoint: {e}; trying the previous one")
            continue
        return step, path
    return None


def resume_point(output_dir, log=print):
    """latest_valid's (step, path); None where output_dir holds no checkpoint; (None, [paths])
    where it holds checkpoints none of which verifies (usable() refuses that on every rank)."""
    found = latest_valid(output_dir, log)
    if found is None:
        refused = [path for _, path in list_checkpoints(output_dir)]
        return (None, refused) if refused else None
    return found


def usable(found):
    """resume_point's answer, refused where every checkpoint is corrupt: a fresh start would
    train over the run and overwrite the only copies of its state (a fresh run into a folder of
    another run's files needs overwrite_output_dir too)."""
    if found is not None and found[0] is None:
        raise CheckpointError(f"fastllm train: no checkpoint in this output_dir verifies "
                              f"({', '.join(os.path.basename(p) for p in found[1])}; the reasons "
                              f"are logged above): move them away to resume by hand, or start "
                              f"fresh over them with overwrite_output_dir=true")
    return found


def prune(output_dir, keep_last, keep=None):
    """Delete all but the newest keep_last checkpoints, and leftovers of interrupted writes.
    `keep` (the path just saved) is never deleted, whatever its step."""
    kept = os.path.abspath(keep) if keep is not None else None
    for _, path in list_checkpoints(output_dir)[keep_last:]:
        if os.path.abspath(path) != kept:
            shutil.rmtree(path, ignore_errors=True)
    remove_partial(output_dir)


def set_aside(output_dir):
    """The names of the checkpoints save() set aside and never put back (checkpoint-<step>.old-*,
    which remove_partial would restore), sorted."""
    if not os.path.isdir(output_dir):
        return []
    return sorted(n for n in os.listdir(output_dir)
                  if _OLD.match(n) and os.path.isdir(os.path.join(output_dir, n)))


def remove_partial(output_dir):
    """Delete leftovers of interrupted writes; a replaced checkpoint whose replacement never
    arrived (a crash between save's two renames) is put back instead."""
    if not os.path.isdir(output_dir):
        return
    for name in sorted(os.listdir(output_dir)):
        full = os.path.join(output_dir, name)
        old = _OLD.match(name)
        if old and not os.path.lexists(os.path.join(output_dir, old.group(1))):
            os.rename(full, os.path.join(output_dir, old.group(1)))
        elif name.startswith(_TMP) or old:
            shutil.rmtree(full, ignore_errors=True)


def save_file(obj, path):
    # Through a Python file: a full disk is OSError(ENOSPC), not torch's "unexpected pos".
    with open(path, "wb") as f:
        torch.save(obj, f)


def load_file(path):
    return torch.load(path, map_location="cpu", weights_only=True)
