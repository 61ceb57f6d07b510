# The fast path's GPU checks (wire kernels and Lion Cub on CUDA), device call 2 (after the kernels.py fix): kernel tests on CUDA, packing
# bench alone on the GPU, then the 4-rank shared-GPU step breakdown (memory + times).
export PYTHONPATH=$PWD:$PWD/.devsite PYTHONUNBUFFERED=1 WANDB_MODE=disabled LIONCUB_CACHE=/tmp/lcache
python3 -c "from data.builtin import prepare_builtin; print(prepare_builtin())" >/dev/null &
timeout 200 python3 -m pytest -q -p no:cacheprovider -o addopts= tests/test_kernels.py -k "cuda or own_code" -rs 2>&1 | tee $OUT/pytest_kernels_cuda.txt | tail -4
wait
timeout 100 python3 -m bench.packing --device cuda --repeats 51 2>&1 | tee $OUT/packing_cuda_25M.txt | tail -14
timeout 100 python3 -m bench.packing --device cuda --repeats 21 --n 250M 2>&1 | tee $OUT/packing_cuda_250M.txt | tail -14
S=/tmp/sb4; timeout 260 python3 -m bench.step_breakdown --launcher torchrun --shared-gpu --rates unlimited --nproc 4 --steps 5 --warmup 2 --no-calibrate --variants lion_fp32,lioncub_1bit,lioncub_4bit,lioncub_8bit_l1,lioncub_1bit@comm.kernels=eager --out $S > $OUT/sb4_stdout.txt 2>&1
cp $S/results.md $OUT/sb4_results.md; cp $S/results.csv $OUT/sb4_results.csv; tail -32 $S/results.md
for f in $S/logs/unlimited/*/torchrun.log; do grep -l "Error\|error" $f && grep -B2 -A12 "Traceback" $f | head -40; done
