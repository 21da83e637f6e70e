# The two commands a fresh machine needs (README.md):
#   make train   set up .venv, build fastllm, run the default `fastllm train` on the CPU
#   make test    set up .venv, build fastllm, run the test suite (Triton kernels via the interpreter)
# Other targets: bench (`fastllm bench`: kernels against PyTorch and the peers installed), build
# (incremental rebuild of fastllm._C), cuda-check (nvcc builds csrc/cuda against a CUDA build of
# torch; no GPU needed), bench-suite (pytest-benchmark over bench/), kernel-check (Triton kernels
# compiled for sm_90), device-rehearsal (the GPU machine's software, on the CPU).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
# Runtime and test dependencies, resolved in one pass with torch pinned (nothing can pull in
# another build of it).
DEPS := "triton>=3.2" ninja pybind11 numpy pytest pytest-benchmark matplotlib
DEPS += pyyaml tqdm  # fastllm train (config files, progress bar)
TEST_EXTRAS := peft transformers safetensors
# Appended to Python's CFLAGS when fastllm._C is compiled. Python's own carry -g, and debug info
# for ATen's templates is half of the C++ compile time; -g does not change the generated code.
# `make build EXT_CFLAGS=` for a build a debugger can step through.
EXT_CFLAGS ?= -g0
# Written by setup.py after each build of fastllm._C: the build's stamp.
BUILT := fastllm/_build_info.py

.PHONY: setup build test bench bench-suite cuda-check kernel-check device-rehearsal

$(VENV)/.deps: Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH) $(DEPS) $(TEST_EXTRAS)
	touch $@

setup: $(VENV)/.deps

# Rebuilt when a file under csrc/, setup.py or the environment changed since the last build, so
# that targets run side by side (CI: tests and kernel-check) never reinstall under each other.
# A file added, deleted or renamed under csrc/ changes $(SOURCES), which is rewritten only then.
# flock: helpers and CI may build concurrently; the in-place extension must be built by one at a time.
SOURCES := build/csrc-files.txt
# (each make writes a file of its own and renames it: two makes started side by side raced on
# one .new file, and one said "mv: cannot stat")
$(shell mkdir -p build && t=$(SOURCES).$$$$ && find csrc -type f | LC_ALL=C sort > $$t && \
	(cmp -s $$t $(SOURCES) && rm $$t || mv $$t $(SOURCES)))
$(BUILT): $(VENV)/.deps setup.py $(SOURCES) $(shell find csrc -type f)
	CFLAGS="$$CFLAGS $(EXT_CFLAGS)" flock /tmp/fastllm-build.lock \
		$(PY) -m pip install -q --no-build-isolation --no-deps -e .

build: $(BUILT)

test: build
	TRITON_INTERPRET=1 $(VENV)/bin/pytest -q --durations=15 tests

# The benchmark peers: DeepSpeed builds its CPU Adam op on first use (cached afterwards).
$(VENV)/.bench-deps: $(VENV)/.deps
	DS_BUILD_OPS=0 $(PY) -m pip install -q --no-build-isolation deepspeed $(TORCH) || \
		echo "fastllm: DeepSpeed could not be installed; the benchmark runs without it"
	# 8-bit optimizer peers of `fastllm bench --ops adamw8bit` (optional)
	$(PY) -m pip install -q bitsandbytes torchao $(TORCH) || \
		echo "fastllm: bitsandbytes/torchao could not be installed; adamw8bit runs without them"
	# GaLore and BAdam peers of `fastllm bench --ops compression` (optional; --no-deps
	# keeps pip from replacing torch)
	$(PY) -m pip install -q --no-deps galore-torch badam || \
		echo "fastllm: galore-torch/badam could not be installed; compression runs without them"
	touch $@

# the default training run (built-in model and text, about a minute on 2 cores)
.PHONY: train
train: build
	$(VENV)/bin/fastllm train

bench: build $(VENV)/.bench-deps
	$(VENV)/bin/fastllm bench

bench-suite: build
	$(VENV)/bin/pytest -q bench --benchmark-only

cuda-check:
	bash .ci/cuda_build_check.sh

# The GPU machine's Python, torch, Triton and transformers in .venv-device: build, CUDA compile,
# tests and the device bench's smoke run against them, on the CPU (bench/device_rehearsal.sh).
device-rehearsal:
	bash bench/device_rehearsal.sh

# Triton kernels compiled for sm_90 without a GPU: 128-bit loads, no spills, launches per step.
# Twice: with this venv's Triton, then with the GPU machine's (bench/device_check.sh builds and
# runs there), whose compiler refuses code a newer one takes (3.6 rejected an fp32 constant below
# fp32's normal range and a jit function's default string that 3.9 accepted). That Triton goes
# into a venv of its own, which sees torch and fastllm through this venv's site-packages.
DEVICE_TRITON ?= 3.6.0
TRITON_VENV := .venv-triton-$(DEVICE_TRITON)

$(TRITON_VENV)/.deps: $(VENV)/.deps
	$(PYTHON) -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/python -m pip install -q "triton==$(DEVICE_TRITON)"
	echo "import site; site.addsitedir('$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')')" \
		> "$$($(TRITON_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz_fastllm_venv.pth"
	touch $@

kernel-check: build $(TRITON_VENV)/.deps
	$(PY) .ci/kernel_check.py
	@echo "== with triton $(DEVICE_TRITON), the GPU machine's =="
	$(TRITON_VENV)/bin/python .ci/kernel_check.py
