# The fast path's GPU checks (wire kernels and Lion Cub on CUDA), device call 5: the same 4-rank shared-GPU breakdown at a per-rank batch of
# 8 x 256 tokens (instead of 1 x 64), where activations, not the optimizer, set the peak.
export PYTHONPATH=$PWD:$PWD/.devsite PYTHONUNBUFFERED=1 WANDB_MODE=disabled LIONCUB_CACHE=/tmp/lcache
python3 -c "from data.builtin import prepare_builtin; print(prepare_builtin())" >/dev/null
S=/tmp/sbb; timeout 240 python3 -m bench.step_breakdown --launcher torchrun --shared-gpu --rates unlimited --nproc 4 --steps 5 --warmup 2 --no-calibrate --overrides "model.preset=tiny model.tie_embeddings=false data.batch_size=8 data.seq_len=256" --variants lion_fp32,lion_fp32+overlap,lioncub_1bit,lioncub_4bit,lioncub_8bit_l1,lioncub_1bit@comm.kernels=eager --out $S > $OUT/sbb_stdout.txt 2>&1
cp $S/results.md $OUT/sbb_results.md; cp $S/results.csv $OUT/sbb_results.csv; tail -28 $S/results.md
