# Set-up and everyday commands. `make test` and `make train` work on a fresh machine with only
# Python, pip and the package registries.
PYTHON ?= python3
NPROC ?= 2
CONFIG ?= configs/default.yaml

.PHONY: install test train clean gpu-check

# torch==2.13.0 is the CPU build verified on our machines; an importable torch is kept as is.
install:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install --quiet torch==2.13.0
	@$(PYTHON) -m pip install --quiet -e ".[dev,hf,wandb,bench,eval]"  # the extras the test suite exercises

# two pytest workers, one test file each at a time (--dist loadfile): the multi-process tests spend
# much of their time starting processes and waiting on sockets, so two files share the 2 cores well
# (measured: 10:42 against 13:54 serially); a file's tests stay in one worker, in order
test: install
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest -q -n 2 --dist loadfile tests

train: install
	OMP_NUM_THREADS=1 $(PYTHON) -m torch.distributed.run --standalone --nproc_per_node=$(NPROC) train.py $(CONFIG) $(ARGS)

# On a machine with a CUDA GPU: the CUDA-only tests, gpt2-124m on one GPU (bf16, torch.compile, compiled
# kernels: tokens/s, MFU, peak memory, step breakdown), the packing kernels at 25M/250M, Lion Cub's
# device memory against Lion's. Reports in bench/out/gpu_check/; launch/gpu_check.sh says more.
gpu-check: install
	bash launch/gpu_check.sh

clean:
	rm -rf runs/ .cache/ build/ *.egg-info
