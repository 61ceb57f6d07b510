# The fast path's GPU checks (wire kernels and Lion Cub on CUDA), device call 4: what makes up Lion Cub's peak device memory. The same
# 4-rank shared-GPU runs with rank 0's CUDA allocation history recorded (LIONCUB_MEMORY_SNAPSHOT=1).
export PYTHONPATH=$PWD:$PWD/.devsite PYTHONUNBUFFERED=1 WANDB_MODE=disabled LIONCUB_CACHE=/tmp/lcache LIONCUB_MEMORY_SNAPSHOT=1
python3 -c "from data.builtin import prepare_builtin; print(prepare_builtin())" >/dev/null
S=/tmp/sbm; timeout 200 python3 -m bench.step_breakdown --launcher torchrun --shared-gpu --rates unlimited --nproc 4 --steps 3 --warmup 1 --no-calibrate --variants lion_fp32,lioncub_1bit@comm.kernels=eager,lioncub_1bit,lioncub_8bit_l1 --out $S > $OUT/sbm_stdout.txt 2>&1
cp $S/results.md $OUT/sbm_results.md; grep -A7 "^| variant" $S/results.md | head -8
for v in lion_fp32 lioncub_1bit@comm.kernels=eager lioncub_1bit lioncub_8bit_l1; do f=$S/runs/unlimited/$v/memory_snapshot.pickle; ls -la $f; gzip -c $f > $OUT/snap_$(echo $v | tr -c 'a-z0-9_\n' '_').pickle.gz; done; ls -la $OUT
