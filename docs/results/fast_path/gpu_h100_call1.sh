# The fast path's GPU checks (wire kernels and Lion Cub on CUDA), device call 1: environment, kernel tests on CUDA, packing bench, a smoke
# step-breakdown run with every rank on the one GPU (gloo). Run from the repo root; $OUT collects.
export PYTHONPATH=$PWD:$PWD/.devsite PYTHONUNBUFFERED=1 WANDB_MODE=disabled LIONCUB_CACHE=/tmp/lcache
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch,triton;print('torch',torch.__version__,'triton',triton.__version__,torch.cuda.get_device_name())"
which g++ ip tc; nproc
python3 -c "from data.builtin import prepare_builtin; print(prepare_builtin())" &
timeout 260 python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_kernels.py -k cuda -rs 2>&1 | tee $OUT/pytest_kernels_cuda.txt | tail -25
wait
timeout 110 python3 -m bench.packing --device cuda --repeats 51 2>&1 | tee $OUT/packing_cuda_25M.txt
timeout 20 python3 -m launch.netsim --nproc 2 --rate 1gbit -- true 2>&1 | tail -3
S=/tmp/sbs; timeout 150 python3 -m bench.step_breakdown --launcher torchrun --shared-gpu --rates unlimited --nproc 4 --steps 3 --warmup 1 --no-calibrate --variants lion_fp32,lioncub_1bit --out $S 2>&1 | tail -30
cp $S/results.md $OUT/smoke_results.md; for f in $S/logs/unlimited/*/torchrun.log; do echo "== $f"; tail -15 $f; done
