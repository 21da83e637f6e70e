"""Build fastllm and its one extension, fastllm._C.

C++ CPU kernels are always built; CUDA kernels from csrc/cuda/ are added when the installed
torch is a CUDA build and nvcc is found. Build with the torch already in the environment:

    pip install --no-build-isolation -e .

Environment switches (read at build time):
    FASTLLM_SKIP_CUDA_BUILD=1   build only the C++ CPU kernels even if CUDA is available
    FASTLLM_FORCE_CUDA=1        build the CUDA kernels even if no GPU is visible (CI compile check)
    FASTLLM_CUDA_ONLY=1         with FASTLLM_FORCE_CUDA=1: only csrc/cuda and the module, no C++ CPU
                                kernels (CI's compile check of the CUDA sources: the CPU kernels
                                are compiled by the CPU build; not an importable fastllm)
    FASTLLM_CUDA_ARCHS="8.0;9.0" CUDA architectures (default: TORCH_CUDA_ARCH_LIST, else the visible
                                GPU, else "8.0;9.0")
    FASTLLM_CPU_ARCH=native     -march for the CPU kernels: "native" (default, vectorised for the
                                building machine), "portable" (the compiler's baseline), or any
                                value gcc accepts for -march
    MAX_JOBS=N                  parallel compile jobs (ninja)
"""

import glob
import os

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _cpu_arch_flags():
    arch = os.environ.get("FASTLLM_CPU_ARCH", "native")
    if arch == "portable":
        return []
    return [f"-march={arch}"]


def _want_cuda(torch, cuda_home):
    if os.environ.get("FASTLLM_SKIP_CUDA_BUILD", "0") == "1":
        return False
    if torch.version.cuda is None or cuda_home is None:
        return False
    return torch.cuda.is_available() or os.environ.get("FASTLLM_FORCE_CUDA", "0") == "1"


def _extensions():
    import torch
    from torch.utils import cpp_extension

    sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    cxx = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math"] + _cpu_arch_flags()
    extra = {"cxx": cxx}
    define_macros = []
    with_cuda = _want_cuda(torch, cpp_extension.CUDA_HOME)
    if with_cuda:
        archs = os.environ.get("FASTLLM_CUDA_ARCHS")
        if archs:
            os.environ["TORCH_CUDA_ARCH_LIST"] = archs
        elif not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
        if os.environ.get("FASTLLM_CUDA_ONLY", "0") == "1":
            sources = ["csrc/extension.cpp"]
            define_macros.append(("FASTLLM_CUDA_ONLY", "1"))
        sources += sorted(glob.glob("csrc/cuda/*.cu"))
        extra["nvcc"] = ["-O3", "-lineinfo"]
        define_macros.append(("FASTLLM_WITH_CUDA", "1"))
        ext_cls = cpp_extension.CUDAExtension
    else:
        ext_cls = cpp_extension.CppExtension
    what = "C++ CPU + CUDA" if with_cuda else "C++ CPU"
    if ("FASTLLM_CUDA_ONLY", "1") in define_macros:
        what = "CUDA only"
    print(f"fastllm: building fastllm._C with {what} kernels")
    ext = ext_cls(
        name="fastllm._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args=extra,
        extra_link_args=["-fopenmp"],
        define_macros=define_macros,
    )
    return [ext], {"build_ext": _recording(cpp_extension.BuildExtension)}


def source_hash():
    """fastllm/_sources.py's hash of csrc/, loaded by path (the package is not importable yet)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_fastllm_sources",
                                                  os.path.join(ROOT, "fastllm", "_sources.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.source_hash(ROOT)


def _recording(build_ext):
    """build_ext that, once the extension is built, records the sources' hash in
    fastllm/_build_info.py, so the test suite fails on a stale extension instead of testing it."""

    class RecordingBuildExt(build_ext):
        def run(self):
            built_from = source_hash()  # before compiling: sources edited meanwhile count as new
            super().run()
            # next to the extension it describes: the checkout's (in place, editable installs)
            # and the build tree's, which a wheel packs (a wheel built from a checkout rewrote
            # the checkout's stamp, whose own .so was not rebuilt, and shipped the old one)
            folders = [os.path.join(ROOT, "fastllm")] if self.inplace else []
            if os.path.isdir(os.path.join(self.build_lib, "fastllm")):
                folders.append(os.path.join(self.build_lib, "fastllm"))
            for folder in folders:
                with open(os.path.join(folder, "_build_info.py"), "w") as f:
                    f.write(f'"""Written by setup.py after building fastllm._C."""\n\n'
                            f'SOURCE_HASH = "{built_from}"\n')

    return RecordingBuildExt


ext_modules, cmdclass = _extensions()

setup(
    name="fastllm",
    version="0.1.0",
    description="Fused Triton, C++ and CUDA kernels for LLM training, behind a PyTorch API",
    long_description=open(os.path.join(ROOT, "README.md")).read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",  # (zip(strict=True))
    # every package under fastllm/ (a listed set missed fastllm.parallel.planner and
    # fastllm.train.strategies: a non-editable install could not import fastllm.cli)
    packages=find_packages(include=["fastllm", "fastllm.*"]) + ["fastllm.bench"],
    package_dir={"fastllm.bench": "bench"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    install_requires=["torch>=2.6", "triton>=3.2; platform_system == 'Linux'", "ninja", "pybind11"],
    extras_require={
        "test": ["pytest", "pytest-benchmark", "numpy", "peft", "transformers", "safetensors"],
        "bench": ["matplotlib", "deepspeed", "peft"],
        "lora": ["safetensors"],  # fastllm.lora.save_adapter / load_adapter
        "train": ["transformers", "safetensors", "pyyaml", "tqdm"],  # fastllm train
    },
    entry_points={"console_scripts": ["fastllm=fastllm.cli:main"]},
)
