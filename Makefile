# Set-up and the commands of the README. Everything installs into .venv on first use.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch first and pinned: 2.13.0 is the CPU build these machines carry; an unpinned torch pulls
# a multi-GB CUDA build. FlashInfer is a dependency of moeshard (pip install moeshard on a GPU
# machine brings it with its CUDA packages); a CPU machine needs only its pure-torch layout index
# functions, so it is installed last and without its CUDA-only dependencies (installed last, pip's
# resolver has nothing to warn about), with the few small packages its import needs.
TORCH ?= torch==2.13.0
FLASHINFER ?= flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2
FLASHINFER_IMPORT_DEPS ?= numpy packaging einops tqdm requests tabulate nvidia-ml-py click
# moeshard's other dependencies and its test extra, read from pyproject.toml (written once there).
DEPS = $(shell $(PY) -c 'import shlex, tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
	print(" ".join(shlex.quote(d) for d in p["dependencies"] + p["optional-dependencies"]["test"] \
	if not d.startswith("flashinfer")))')

.PHONY: install demo test test-gpu lint clean

$(BIN)/moeshard: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q $(DEPS) $(FLASHINFER_IMPORT_DEPS)
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/pip install -q --no-deps $(FLASHINFER)
	touch $@

install: $(BIN)/moeshard

demo: install
	$(BIN)/moeshard demo -o demo-out

test: install lint
	$(BIN)/python -m pytest -q --ignore=tests/gpu tests

lint: install
	$(BIN)/ruff check moeshard tests bench

# On a CUDA machine (the device tool: no network there): a venv over the machine's own CUDA torch
# and FlashInfer (--system-site-packages), moeshard from this tree; CUDA kernels against the CPU layouts.
GPU_VENV ?= .venv-gpu
test-gpu:
	$(PY) -m venv --system-site-packages $(GPU_VENV)
	PYTHONPATH=$(CURDIR):$$PYTHONPATH $(GPU_VENV)/bin/python -m pytest -q tests/gpu

clean:
	rm -rf $(VENV) $(GPU_VENV) demo-out
