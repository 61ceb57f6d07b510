# gpu-check run 4 (one device call): the narrowed fp-fusion fix (comm.kernels.eager_float: only the two
# quantizer kernels compile with Triton's fp fusion off on CUDA) on a GPU for the first time. Code as of
# 3bff81b (the same Python as fe7b10c). Stages: env; the CUDA-only tests (compiled == eager byte for byte,
# the stochastic 8-bit quantizer that failed in run 3 call 1 among them); which kernels got fusion off on
# this machine's inductor; bench.packing at 25M and 250M (are the integer unpack kernels back at call 1's
# fusion-on speed?). Run from the repo root; $OUT collects.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 WANDB_MODE=disabled
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  nproc; uptime; } 2>&1 | tee $OUT/env.log
timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts= tests/optim/test_kernels.py tests/optim/test_optim.py -k cuda -rf 2>&1 | tee $OUT/tests.log | tail -8
echo "tests rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 )) s"
timeout 60 python3 - <<'PY' 2>&1 | tee $OUT/options.log
from comm import kernels as K
marked = sorted(n for n, f in vars(K).items() if callable(f) and getattr(f, "eager_float", False) is True)
print("eager_float kernels:", marked)
print("CUDA options for them:", K._INDUCTOR_OPTIONS_EAGER_FLOAT_CUDA)
print("options for the rest:", K._INDUCTOR_OPTIONS)
PY
timeout 110 bash -c "python3 -m bench.packing --device cuda --repeats 21 --n 25M && python3 -m bench.packing --device cuda --repeats 7 --n 250M" 2>&1 | tee $OUT/packing.log | tail -50
echo "packing rc ${PIPESTATUS[0]}; whole call $(( $(date +%s) - T0 )) s"
