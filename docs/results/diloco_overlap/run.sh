#!/bin/bash
# the wall time Streaming DiLoCo's overlap hides (tau = 1 vs 0), two interleaved rounds
OUT=${OUT:-/tmp/overlap}; mkdir -p $OUT
cd "$(dirname "$0")/../../.."
for r in 1 2; do for t in 1 0; do
  uptime > $OUT/r${r}_tau$t.load
  OMP_NUM_THREADS=1 python -m bench.step_breakdown --config-dir docs/results/diloco_overlap --variants sd_tau$t \
    --rates 100mbit,1gbit --nproc 4 --nodes 2 --steps 12 --warmup 4 --no-calibrate --out $OUT/r${r}_tau$t \
    > $OUT/r${r}_tau$t.log 2>&1
  echo "r$r tau$t rc=$?" >> $OUT/progress; uptime >> $OUT/r${r}_tau$t.load
done; done
echo done >> $OUT/progress
