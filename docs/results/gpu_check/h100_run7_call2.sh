# Run 7, device call 2 (nvidia-h100-x1, timeout_s 280, carry .probe): the command as sent.
# .probe = `git archive 1846e41 | tar -x -C .probe` plus .cache/gpu_site, plus .probe/.glpatch/sitecustomize.py
# (below), meant to make the trainer's Lion step through optim.lion_cuda.GraphedLionStep. It did not take
# effect: bench.step_breakdown gives its training processes PYTHONPATH=<repo root>, so sitecustomize was never
# imported there (no "lion step graphed" line in the training log).
cd .probe && export PYTHONPATH=$PWD/.glpatch LION_GRAPHED=1 STAGES="mfu train" MFU_PROFILE=all \
  MFU_VARIANTS="legacy:default current:default current:default::FLASH_ATTENTION legacy:default::FLASH_ATTENTION current:reduce-overhead" \
  GPU_CHECK_BUDGET=250 TRAIN_LIMIT=100 TRAIN_NEXT_LIMIT=60 MFU_LIMIT=120 GPU_CHECK_OUT=/tmp/gc
timeout 265 bash launch/gpu_check.sh > /tmp/gc_stdout.log 2>&1; rc=$?; cp /tmp/gc_stdout.log /tmp/gc/stdout.log
for x in $(grep -rlE "def triton_poi_fused\w*cat\w*neg" /tmp/torchinductor_* 2>/dev/null | head -4); do
  echo "## $x"; grep -nE -B22 -A30 "def triton_poi_fused\w*cat\w*neg" $x | head -60; done > /tmp/gc/kernel.txt
tar czf $OUT/gc.tgz -C /tmp gc; cat /tmp/gc/summary.txt; echo rc=$rc

# .glpatch/sitecustomize.py:
# import os, sys
# if os.environ.get("LION_GRAPHED") == "1":
#     try:
#         import optim.lion as _L
#         from optim.lion_cuda import GraphedLionStep as _G
#         class _Graphed(_G):
#             fits = staticmethod(_L.FusedLionStep.fits)
#             def __call__(self, *a, **k):
#                 before = self.captures
#                 super().__call__(*a, **k)
#                 if self.captures != before or self.calls in (10, 20):
#                     print(f"lion step graphed: call {self.calls}, captures {self.captures}", file=sys.stderr, flush=True)
#         _L.FusedLionStep = _Graphed
#     except Exception as e:
#         print("lion step graphed: patch FAILED", type(e).__name__, e, file=sys.stderr)
# (GraphedLionStep then took (device, fma); it now takes the FusedLionStep to wrap)
