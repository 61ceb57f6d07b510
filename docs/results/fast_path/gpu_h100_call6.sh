# The fast path's GPU checks, device-machine call 6: the CPU side of the changed tests on the device machine's 16 cores
# (torch 2.11 there): test_kernels' CPU parametrisations, test_optim, the update-sync and overlap
# multi-process tests (gloo, CPU).
export PYTHONPATH=$PWD:$PWD/.devsite PYTHONUNBUFFERED=1 WANDB_MODE=disabled LIONCUB_CACHE=/tmp/lcache OMP_NUM_THREADS=1
timeout 280 python3 -m pytest -q -p no:cacheprovider -o addopts= -n 12 tests/test_kernels.py tests/test_optim.py tests/test_lioncub.py tests/test_overlap.py tests/test_bench_breakdown.py -k "not cuda and not smoke" 2>&1 | tee $OUT/pytest_cpu_on_device.txt | tail -15
