# Set-up and everyday commands. `make test` and `make train` work on a fresh machine with only
# Python (>= 3.10, with its venv module) and the package registries.
#
# Where the packages go: an active virtual environment ($VIRTUAL_ENV), or PYTHON itself when it
# already runs inside one, is used as it is; otherwise the project's own environment $(VENV)
# (.venv, git-ignored) is created on first use. Current Debian and Ubuntu refuse `pip install`
# into the system interpreter (PEP 668, "externally-managed-environment"), so the project never
# installs there unless asked to with VENV= (empty).
#
# `make install` runs pip once per environment: a stamp in the environment records the checksum of
# pyproject.toml (and this checkout's path); the install reruns when either changes, or with
# `make install FORCE=1`.
PYTHON ?= python3
VENV ?= .venv
NPROC ?= 2
CONFIG ?= configs/default.yaml
# torch==2.13.0 is the build verified on our machines; installed only when no torch is importable
# (a CUDA build you installed yourself is kept). TORCH_INDEX serves the CPU wheel: PyPI's Linux
# wheel of the same version pulls several GB of CUDA libraries. TORCH_INDEX= (empty) uses pip's
# own indexes only. torch alone comes from there (--no-deps); its dependencies come with the
# project's install below, from pip's own indexes.
TORCH ?= torch==2.13.0
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

# the environment's interpreter (PY) and its directory (ENV_DIR, where the stamp lives)
ifneq ($(strip $(VIRTUAL_ENV)),)
  PY := $(VIRTUAL_ENV)/bin/python
  ENV_DIR := $(VIRTUAL_ENV)
else
  # PYTHON's own prefix when PYTHON runs inside a virtual environment, else nothing
  PYTHON_VENV := $(shell $(PYTHON) -c 'import sys; sys.prefix != sys.base_prefix and print(sys.prefix)' 2>/dev/null)
  ifneq ($(strip $(PYTHON_VENV)),)
    PY := $(PYTHON)
    ENV_DIR := $(PYTHON_VENV)
    export PATH := $(PYTHON_VENV)/bin:$(PATH)
  else ifneq ($(strip $(VENV)),)
    PY := $(VENV)/bin/python
    ENV_DIR := $(VENV)
    NEW_VENV := 1
    # recipes (and scripts they start, e.g. launch/gpu_check.sh's python3) run inside it
    export VIRTUAL_ENV := $(abspath $(VENV))
    export PATH := $(abspath $(VENV))/bin:$(PATH)
  else
    PY := $(PYTHON)
    ENV_DIR := .cache
  endif
endif
STAMP := $(ENV_DIR)/.lioncub-install
STAMP_TEXT := $(shell cksum < pyproject.toml | cut -d' ' -f1,2) $(CURDIR)

.PHONY: install venv test train clean gpu-check

venv:
ifdef NEW_VENV
	@if [ ! -x "$(PY)" ]; then \
	  if [ -e "$(VENV)" ]; then \
	    echo "make: $(VENV) exists but has no bin/python; remove it (rm -r $(VENV)) and rerun" >&2; exit 2; fi; \
	  echo "make: creating the virtual environment $(VENV) ($(PYTHON) -m venv $(VENV))"; \
	  if ! $(PYTHON) -m venv "$(VENV)" >/dev/null 2>&1; then rm -rf "$(VENV)"; \
	    echo "make: '$(PYTHON) -m venv $(VENV)' failed: install Python's venv module (Debian/Ubuntu: apt-get install python3-venv) or activate a virtual environment of your own, then rerun" >&2; exit 2; fi; \
	fi
endif

install: venv
	@if [ -z "$(FORCE)" ] && [ "$$(cat "$(STAMP)" 2>/dev/null)" = "$(STAMP_TEXT)" ]; then \
	  echo "make: $(ENV_DIR) already has this checkout installed (pyproject.toml unchanged; FORCE=1 reinstalls)"; \
	else \
	  echo "make: installing into $(ENV_DIR) (once per pyproject.toml change)"; \
	  $(PY) -c "import torch" 2>/dev/null || \
	    $(PY) -m pip install --quiet --no-deps $(if $(strip $(TORCH_INDEX)),--extra-index-url $(TORCH_INDEX)) "$(TORCH)" || exit 1; \
	  $(PY) -m pip install --quiet -e ".[dev,hf,wandb,bench,eval,tensorboard,dashboards]" || exit 1; \
	  mkdir -p "$(ENV_DIR)" && echo "$(STAMP_TEXT)" > "$(STAMP)"; \
	fi

# two pytest workers, one test file each at a time (--dist loadfile): the multi-process tests spend
# much of their time starting processes and waiting on sockets, so two files share the 2 cores well
# (measured: 10:42 against 13:54 serially); a file's tests stay in one worker, in order
test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile tests

# launch.torchrun: torchrun that checks the config before starting the ranks (a config error is one
# line and exit code 2, never torchrun's ChildFailedError traceback)
train: install
	OMP_NUM_THREADS=1 $(PY) -m launch.torchrun --standalone --nproc_per_node=$(NPROC) train.py $(CONFIG) $(ARGS)

# On a machine with a CUDA GPU, within 400 s: the CUDA-only tests, gpt2-124m on one GPU (bf16, torch.compile,
# comm.kernels=auto: tokens/s, MFU, Lion's fused step vs AdamW's), 2 and 4 ranks time-sharing the GPU through
# every variant, a sharded run resumed from DCP. PASS/FAIL per stage; the report in $OUT/gc when OUT is set,
# else bench/out/gpu_check/; launch/gpu_check.sh says more.
gpu-check: install
	bash launch/gpu_check.sh

clean:
	rm -rf runs/ .cache/ build/ *.egg-info
