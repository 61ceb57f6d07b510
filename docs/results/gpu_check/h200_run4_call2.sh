# gpu-check run 4, call 2: call 1's compiled unpack + majority at 250M took 3.11 ms (6.0x copy_), where
# run 3 call 1, with the same inductor options for that kernel, took 0.32 ms (0.66x). Is it the process
# (inductor's autotuning of the pointwise configs at first call) rather than the code? bench.packing at
# 250M in three fresh processes, inductor's caches off so each compiles and tunes on its own.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 WANDB_MODE=disabled TORCHINDUCTOR_FORCE_DISABLE_CACHES=1
T0=$(date +%s)
for i in 1 2 3; do
  echo "=== process $i"
  timeout 75 python3 -m bench.packing --device cuda --repeats 7 --n 250M 2>&1 \
    | grep -E "copy_ of|eager ms|sign ->|quantize|majority|sum" | tee -a $OUT/processes.log
done
echo "whole call $(( $(date +%s) - T0 )) s"
