# Run 7, device call 1 (nvidia-h100-x1, timeout_s 420, carry .probe): the command as sent.
# .probe = `git archive 2021f47 | tar -x -C .probe` plus .cache/gpu_site (the GPT-2 BPE package).
cd .probe && export STAGES="env tests mfu lionopt shard train" BACKGROUND=shard TESTS_LIMIT=140 MFU_LIMIT=220 \
  MFU_VARIANTS="legacy:default current:default current:reduce-overhead" GPU_CHECK_BUDGET=390 TRAIN_LIMIT=125 \
  TRAIN_NEXT_LIMIT=60 GPU_CHECK_OUT=/tmp/gc
timeout 405 bash launch/gpu_check.sh > /tmp/gc_stdout.log 2>&1; rc=$?
cp /tmp/gc_stdout.log /tmp/gc/stdout.log; tar czf $OUT/gc.tgz -C /tmp gc; cp /tmp/gc/summary.txt /tmp/gc/probe.log $OUT/
cat /tmp/gc/summary.txt; grep "^PROBE" /tmp/gc/probe.log | cut -c1-300; echo rc=$rc
# (in that commit `--rope legacy` was the rotation after the transpose and `current` the one before it)
