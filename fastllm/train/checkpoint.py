"""Checkpoints that survive crashes: output_dir/checkpoint-<step>/ with a manifest of sizes and
sha256 checksums, written to a temporary folder, fsynced, then renamed into place.

A crash while writing leaves a `.tmp-checkpoint-*` folder that is never read (and is removed by
the next run); a checkpoint whose files do not match its manifest is refused with the reason, and
the next older one is used.
"""

import hashlib
import json
import os
import re
import shutil
import uuid

import torch

__all__ = ["CheckpointError", "save", "verify", "latest_valid", "list_checkpoints", "prune",
           "load_file", "MANIFEST"]

MANIFEST = "manifest.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")


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
    tmp = os.path.join(output_dir, f".tmp-checkpoint-{step}-{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    for name, write in writers.items():
        write(os.path.join(tmp, name))
    entries = {}
    for rel in _files(tmp):
        full = os.path.join(tmp, rel)
        with open(full, "rb") as f:
            os.fsync(f.fileno())
        entries[rel] = {"bytes": os.path.getsize(full), "sha256": _sha256(full)}
    manifest = os.path.join(tmp, MANIFEST)
    with open(manifest, "w") as f:
        json.dump({"step": step, "files": entries}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    for folder, _, _ in os.walk(tmp):
        _fsync_dir(folder)
    if os.path.exists(final):
        old = final + f".old-{uuid.uuid4().hex[:8]}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(output_dir)
    return final


def verify(path):
    """Raise CheckpointError (saying what is wrong) unless every file matches the manifest."""
    manifest = os.path.join(path, MANIFEST)
    if not os.path.isfile(manifest):
        raise CheckpointError(f"{path} has no {MANIFEST} (an incomplete write?)")
    try:
        with open(manifest) as f:
            entries = json.load(f)["files"]
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"{path}/{MANIFEST} is unreadable: {e}") from None
    for rel, meta in entries.items():
        full = os.path.join(path, rel)
        if not os.path.isfile(full):
            raise CheckpointError(f"{path}: {rel} is missing")
        size = os.path.getsize(full)
        if size != meta["bytes"]:
            raise CheckpointError(f"{path}: {rel} has {size} bytes, the manifest says "
                                  f"{meta['bytes']} (truncated?)")
        if _sha256(full) != meta["sha256"]:
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


def prune(output_dir, keep_last):
    """Delete all but the newest keep_last checkpoints, and leftovers of interrupted writes."""
    for _, path in list_checkpoints(output_dir)[keep_last:]:
        shutil.rmtree(path, ignore_errors=True)
    remove_partial(output_dir)


def remove_partial(output_dir):
    if not os.path.isdir(output_dir):
        return
    for name in os.listdir(output_dir):
        if name.startswith(".tmp-checkpoint-") or re.match(r"^checkpoint-\d+\.old-", name):
            shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)


def save_file(obj, path):
    torch.save(obj, path)


def load_file(path):
    return torch.load(path, map_location="cpu", weights_only=True)
