# The fast path's GPU checks (wire kernels and Lion Cub on CUDA), device call 3 (after the kernels.py and lioncub.py fixes): tests on CUDA
# (+ two CPU tests on this machine's torch), packing bench alone on the GPU, then the 4-rank
# shared-GPU step breakdown (device memory, CUDA-event times, overlap, fine timing on/off).
export PYTHONPATH=$PWD:$PWD/.devsite PYTHONUNBUFFERED=1 WANDB_MODE=disabled LIONCUB_CACHE=/tmp/lcache
python3 -c "from data.builtin import prepare_builtin; print(prepare_builtin())" >/dev/null &
(timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_kernels.py -k "cpu and (recompiles or lion_passes)" > $OUT/pytest_kernels_cpu_torch211.txt 2>&1) &
timeout 120 python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_kernels.py tests/test_optim.py -k "cuda or own_code" -rs 2>&1 | tee $OUT/pytest_cuda.txt | tail -4
wait; tail -3 $OUT/pytest_kernels_cpu_torch211.txt
timeout 60 python3 -m bench.packing --device cuda --repeats 51 2>&1 | tee $OUT/packing_cuda_25M.txt | tail -13
timeout 60 python3 -m bench.packing --device cuda --repeats 11 --n 250M 2>&1 | tee $OUT/packing_cuda_250M.txt | tail -12
S=/tmp/sb4; timeout 280 python3 -m bench.step_breakdown --launcher torchrun --shared-gpu --rates unlimited --nproc 4 --steps 5 --warmup 2 --no-calibrate --variants lion_fp32,lion_fp32+overlap,lioncub_1bit,lioncub_4bit,lioncub_8bit_l1,lioncub_1bit@comm.kernels=eager,lioncub_1bit@comm.fine_timing=false --out $S > $OUT/sb4_stdout.txt 2>&1
cp $S/results.md $OUT/sb4_results.md; cp $S/results.csv $OUT/sb4_results.csv; tail -24 $S/results.md
for f in $S/logs/unlimited/*/torchrun.log; do grep -q Traceback $f && echo "== $f" && grep -A8 "Error" $f | head -20; done
