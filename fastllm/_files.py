"""Files replaced whole or not at all (adapter folders): each written under a hidden temporary
name in its folder, flushed to disk, then os.replace'd into place, as checkpoints are; a refused
or failed save leaves the files already there as they were. And the data files under a folder
(files_under)."""

import glob
import json
import os


def files_under(folder, extensions):
    """The files under `folder` (recursively, sorted) whose names end in one of `extensions`, in
    any case (NOTES.TXT, train.JSONL); the folder's path taken literally (data[1] is no glob
    character class), folders skipped (a folder named site.md is no file)."""
    return sorted(f for f in glob.glob(os.path.join(glob.escape(folder), "**", "*"),
                                       recursive=True)
                  if f.lower().endswith(extensions) and os.path.isfile(f))


def write_replacing(folder, writers):
    """writers: {file name: write(temporary path)}. Every file is written before any is
    replaced; on an error the temporary files are removed and nothing in `folder` has changed
    (a crash between two replaces can still leave a new file next to an old one)."""
    os.makedirs(folder, exist_ok=True)
    tmp = {name: os.path.join(folder, f".{name}.tmp-{os.getpid()}") for name in writers}
    try:
        for name, write in writers.items():
            write(tmp[name])
        for name, file in tmp.items():
            with open(file, "rb") as f:
                os.fsync(f.fileno())
            os.replace(file, os.path.join(folder, name))
    finally:
        for file in tmp.values():
            if os.path.exists(file):
                os.remove(file)


def json_writer(obj):
    """A writer for write_replacing: obj as indented JSON with sorted keys."""
    def write(file):
        with open(file, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
    return write
