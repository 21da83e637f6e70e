"""The package's shape (issue 17): a trainer that reads in one sitting, no oversized files, and
imports that run one way: no cycle between fastllm modules (imports inside functions count),
optim/ below distributed/ and train/, parallel/ below train/."""

import ast
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "fastllm")


def _modules():
    """{module name: path} of every .py file under fastllm/."""
    out = {}
    for folder, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(folder, f)
    return out


MODULES = _modules()
# compiled extensions (fastllm._C): no imports of their own
EXTENSIONS = {"fastllm." + f.split(".")[0] for f in os.listdir(PKG) if f.endswith((".so", ".pyd"))}



def _imports(name, path):
    """The fastllm modules `name` imports, anywhere in the file. `from pkg import x` names the
    submodule pkg.x when there is one, else pkg; parent packages a dotted import runs first are
    not counted (every submodule would otherwise import its package)."""
    tree = ast.parse(open(path).read(), path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in set(MODULES) | EXTENSIONS
                       else base for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in MODULES and t != name}
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _lines(rel):
    with open(os.path.join(ROOT, rel)) as f:
        return sum(1 for _ in f)


def test_trainer_reads_in_one_sitting():
    assert _lines("fastllm/train/trainer.py") < 400


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_file_over_600_lines(name):
    assert _lines(os.path.relpath(MODULES[name], ROOT)) <= 600


def test_no_import_cycle():
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(GRAPH[m]):
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = "done"

    for m in sorted(GRAPH):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def _reaches(src_prefix, dst_prefixes):
    bad = []
    for m, deps in GRAPH.items():
        if m == src_prefix or m.startswith(src_prefix + "."):
            bad += [f"{m} -> {d}" for d in deps
                    if any(d == p or d.startswith(p + ".") for p in dst_prefixes)]
    return bad


def test_optim_imports_neither_distributed_nor_train():
    assert not _reaches("fastllm.optim", ("fastllm.distributed", "fastllm.train"))


def test_parallel_does_not_import_train():
    assert not _reaches("fastllm.parallel", ("fastllm.train",))


def test_no_top_level_package_shadows_an_installed_one():
    """The repository root is on sys.path whenever code runs from a checkout (pytest, `python -c`,
    setup.py), so a package there hides an installed one of the same name. Triton kernels kept
    as a top-level `kernels` package hid Hugging Face's `kernels`, which transformers >= 5.25
    requires and imports: transformers could not be imported and the build failed."""
    from importlib.machinery import PathFinder

    others = [p for p in sys.path if p and os.path.realpath(p) != os.path.realpath(ROOT)]
    ours = [d for d in sorted(os.listdir(ROOT))
            if os.path.isfile(os.path.join(ROOT, d, "__init__.py")) and d != "fastllm"]
    shadowed = {d: PathFinder.find_spec(d, others).origin for d in ours
                if PathFinder.find_spec(d, others) is not None}
    assert not shadowed, f"top-level packages of the checkout hide installed ones: {shadowed}"


def test_a_non_editable_install_ships_every_package(tmp_path):
    """setup.py listed its packages by hand and missed fastllm.parallel.planner and
    fastllm.train.strategies: `pip install .` gave a fastllm whose CLI could not import. Every
    folder of fastllm/ with an __init__.py is in what build_py copies."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "-d", str(tmp_path)],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    want = {os.path.relpath(d, root) for d, _, files in os.walk(os.path.join(root, "fastllm"))
            if "__init__.py" in files}
    got = {os.path.relpath(d, str(tmp_path)) for d, _, files in os.walk(str(tmp_path))
           if "__init__.py" in files}
    assert want <= got, sorted(want - got)
    assert "fastllm/bench" in got


def test_the_sdist_holds_what_a_build_needs(tmp_path):
    """Without MANIFEST.in the sdist held the .cpp files setup.py lists and none of the headers
    they include (nor the CUDA sources, nor examples/): `pip install fastllm-*.tar.gz` failed
    at csrc/cpu/adamw.cpp's #include "cpu/model_io.h"."""
    import subprocess
    import sys
    import tarfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "-e", str(tmp_path),
                          "sdist", "-d", str(tmp_path)], cwd=root, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (archive,) = [n for n in os.listdir(tmp_path) if n.endswith(".tar.gz")]
    with tarfile.open(tmp_path / archive) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    want = {os.path.relpath(os.path.join(d, f), root)
            for top in ("csrc", "examples") for d, _, files in os.walk(os.path.join(root, top))
            for f in files if not f.endswith((".pyc", ".so"))}
    assert want <= names, sorted(want - names)
    assert "fastllm/_build_info.py" not in names  # (the checkout's stamp, not the build's)


def test_distributed_and_parallel_are_reachable_from_import_fastllm():
    """The README's snippets write fastllm.distributed.PowerSGD(...) after `import fastllm`."""
    import fastllm

    assert fastllm.distributed.PowerSGD and fastllm.parallel.clip_grad_norm_
