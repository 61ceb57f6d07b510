#!/bin/bash
# interleaved before/after rounds of the Keep step_breakdown (ABBA order)
# worktrees first: git worktree add /tmp/wt_before d0fabc9 && git worktree add /tmp/wt_after 2584a59
OUT=${OUT:-/tmp/keep_out}; mkdir -p $OUT
run() { # tree round
  cd /tmp/wt_$1 && uptime > $OUT/$1_r$2.load && OMP_NUM_THREADS=1 /work/main/.venv/bin/python -m bench.step_breakdown \
    --variants lion_fp32,lioncub_1bit,lioncub_4bit --rates 1gbit,100mbit --nproc 4 --steps 10 --warmup 3 --no-calibrate \
    --out $OUT/$1_r$2 > $OUT/$1_r$2.log 2>&1; uptime >> $OUT/$1_r$2.load; echo "$1 r$2 rc=$?" >> $OUT/progress
}
run before 1; run after 1; run after 2; run before 2; run before 3; run after 3
echo done >> $OUT/progress
