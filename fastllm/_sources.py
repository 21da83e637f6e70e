"""The hash of the C++/CUDA sources that fastllm._C is built from.

setup.py records it in fastllm/_build_info.py after each successful build; tests/test_extension.py
compares it with the checkout's, so a stale extension fails the test suite instead of being
tested (or skipped). Plain Python with no imports from the package: setup.py loads it by path.
"""

import glob
import hashlib
import os


def source_hash(root):
    """sha256 over the relative path and contents of every file under root/csrc/."""
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(root, "csrc", "**", "*"), recursive=True)):
        if os.path.isfile(path):
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()
