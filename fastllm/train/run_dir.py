"""The run folder (output_dir) of one `fastllm train` run: an exclusive lock, and the rules for
a fresh run into a folder that already holds one.

    run_dir.check(cfg)                 # rank 0, read only: before the data is built
    lock = run_dir.prepare(cfg, log)   # rank 0, after: before anything is written
    run_dir.save_run_files(cfg.output_dir, cfg, tokenizer)   # rank 0, after the resume checks
    ...
    run_dir.release(lock)

The lock is `fcntl.flock` on output_dir/.lock, held for the run's life (the OS drops it when the
process dies, so a crashed run never leaves a stale lock); the file holds the holder's PID, which
a refused second run names. Only rank 0 of a job takes it (the other ranks write nothing there).

A fresh run (checkpoint.auto_resume=false) into a folder that holds checkpoints or metrics of
another run is refused unless overwrite_output_dir=true (Hugging Face's name), which clears them
first; otherwise their checkpoints would be pruned instead of the new run's and their metrics
lines mixed with the new ones.
"""

import errno
import fcntl
import os
import shutil

from fastllm.train import checkpoint as ckpt

__all__ = ["RunDirError", "check", "lock", "prepare", "release", "previous_run"]

LOCK = ".lock"
# What a run leaves besides checkpoint-<step>/ folders (config.yaml is not one: every run
# rewrites it, and a user's own config file may sit there). samples.jsonl: eval.prompts'
# answers; tokenizer/: an HF tokenizer's files (a later run may use another tokenizer or none).
_RUN_FILES = ("metrics.jsonl", "samples.jsonl", "summary.json", "report.png", "tensorboard",
              "tokenizer")


class RunDirError(RuntimeError):
    """The output_dir is in use by another run, or holds one that would be destroyed."""


def lock(output_dir):
    """Take the exclusive lock on output_dir/.lock and write this PID into it; returns the open
    file (keep it open for the run). Raises RunDirError naming the holder's PID if it is taken."""
    try:
        os.makedirs(output_dir, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # it, or a folder above it, is a file
        raise RunDirError(f"fastllm train: output_dir {output_dir} cannot be a folder: it or a "
                          f"folder above it is a file") from None
    path = os.path.join(output_dir, LOCK)
    f = open(path, "a+")
    try:
        taken = _taken(f, fcntl.LOCK_EX)
    except OSError:
        f.close()
        raise
    if taken:
        f.seek(0)
        holder = f.read().strip()
        f.close()
        _in_use(output_dir, path, holder)
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def save_run_files(output_dir, cfg, tokenizer=None):
    """Rank 0, once the run's resume checks passed (a refused resume leaves the run's own
    files): config.yaml (cfg, the config as given) and the tokenizer (a
    fastllm.train.data.HFTokenizer; byte and None save nothing) in output_dir/tokenizer, which
    fastllm export and generate read."""
    cfg.save(output_dir)
    if hasattr(tokenizer, "tok"):
        tokenizer.tok.save_pretrained(os.path.join(output_dir, "tokenizer"))


def release(handle):
    """Drop the lock taken by lock() (closing the file releases the flock)."""
    if handle is not None and not handle.closed:
        handle.close()


def previous_run(output_dir):
    """The checkpoint folders and run files another run left in output_dir (names, sorted). A
    checkpoint save() set aside (checkpoint-<step>.old-*) is one of them: remove_partial would
    put it back, and a fresh run would then resume from it."""
    if not os.path.isdir(output_dir):
        return []
    found = [os.path.basename(p) for _, p in ckpt.list_checkpoints(output_dir)]
    found += ckpt.set_aside(output_dir)
    found += [n for n in _RUN_FILES if os.path.exists(os.path.join(output_dir, n))]
    return sorted(found)


def check(cfg):
    """What prepare() would refuse, checked without creating, locking or deleting anything: a
    running run's lock; another run's files when this run starts fresh without
    overwrite_output_dir. For a command that runs several runs (`--compare torch`), before the
    first one trains. Raises RunDirError."""
    out = cfg.output_dir
    if os.path.lexists(out) and not os.path.isdir(out):
        raise RunDirError(f"fastllm train: output_dir {out} exists and is not a folder")
    path = os.path.join(out, LOCK)
    if os.path.isfile(path):
        with open(path) as f:  # a shared lock, dropped on close: refused while a run holds it
            if _taken(f, fcntl.LOCK_SH):
                _in_use(out, path, f.read().strip())
    if not cfg.checkpoint.auto_resume and not cfg.overwrite_output_dir:
        _refuse_another_run(out, previous_run(out))


def _taken(f, how):
    """Whether another process holds a lock on f that `how` (fcntl.LOCK_EX / LOCK_SH) conflicts
    with; else takes it (without waiting)."""
    try:
        fcntl.flock(f.fileno(), how | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            raise
        return True
    return False


def _in_use(output_dir, path, holder):
    raise RunDirError(f"fastllm train: output_dir {output_dir} is in use by another fastllm "
                      f"train run (PID {holder or 'unknown'}, holding {path}); wait for it to "
                      f"finish or pick another output_dir") from None


def _refuse_another_run(output_dir, old):
    if old:
        raise RunDirError(
            f"fastllm train: output_dir {output_dir} holds another run "
            f"({', '.join(old[:4])}{', ...' if len(old) > 4 else ''}) and "
            f"checkpoint.auto_resume=false starts a fresh one: set "
            f"overwrite_output_dir=true to delete it, or pick another output_dir")


def prepare(cfg, log=print):
    """Rank 0 at the start of a run, once its data and model are built (a refused record leaves
    output_dir as it was: no folder made, nothing cleared): lock output_dir, refuse (or with
    overwrite_output_dir clear) another run's checkpoints and metrics when this run starts fresh
    (auto_resume=false or overwrite_output_dir=true), remove leftovers of interrupted checkpoint
    writes (after a clear, .tmp-checkpoint-* only: the set-aside checkpoints went with the run).
    Returns the lock handle for release()."""
    handle = lock(cfg.output_dir)
    try:
        # overwrite_output_dir wins over auto_resume (HF's meaning): the trainer starts fresh
        if not cfg.checkpoint.auto_resume or cfg.overwrite_output_dir:
            old = previous_run(cfg.output_dir)
            if not cfg.overwrite_output_dir:
                _refuse_another_run(cfg.output_dir, old)
            if old:
                for name in old:
                    full = os.path.join(cfg.output_dir, name)
                    if os.path.isdir(full):
                        shutil.rmtree(full)
                    else:
                        os.remove(full)
                log(f"fastllm train: overwrite_output_dir=true: removed {len(old)} entries of "
                    f"the previous run in {cfg.output_dir}")
        ckpt.remove_partial(cfg.output_dir)
    except BaseException:
        release(handle)
        raise
    return handle
