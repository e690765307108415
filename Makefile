# Set-up and the two commands of the README. Everything installs into .venv on first use.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch first and pinned: 2.13.0 is the CPU build these machines carry; an unpinned torch pulls
# a multi-GB CUDA build. FlashInfer is installed without its CUDA-only dependencies: moeshard
# uses its pure-torch layout index functions, which need only apache-tvm-ffi and a few small
# packages at import.
TORCH ?= torch==2.13.0
FLASHINFER ?= flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2
FLASHINFER_IMPORT_DEPS ?= numpy packaging einops tqdm requests tabulate nvidia-ml-py click

.PHONY: install demo test test-gpu bench clean

$(BIN)/moeshard: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q --no-deps $(FLASHINFER)
	$(BIN)/pip install -q $(FLASHINFER_IMPORT_DEPS)
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(BIN)/moeshard

demo: install
	$(BIN)/moeshard demo -o demo-out

test: install
	$(BIN)/python -m pytest -q --ignore=tests/gpu tests

# On a CUDA machine (the device tool): FlashInfer's CUDA kernels against the CPU layouts.
test-gpu:
	$(PY) -m pytest -q tests/gpu

clean:
	rm -rf $(VENV) demo-out
