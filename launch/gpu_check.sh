#!/usr/bin/env bash
# The GPU check: everything the CPU machines cannot verify, in one command on one CUDA GPU.
#
#   make gpu-check                              # every stage, reports in bench/out/gpu_check/
#   STAGES="tests packing" make gpu-check       # a subset (env, tests, train, packing, memory)
#   GPU_CHECK_OUT=/some/dir make gpu-check      # where the logs and tables go
#
# Stages (each has its own time limit; a failing stage is reported and the next one still runs):
#   env      the GPU, driver, torch / Triton versions
#   tests    the CUDA-only tests (compiled Triton kernels == eager reference byte for byte, the
#            Lion passes, the optimizer on CUDA): pytest -k cuda over the kernel and optimizer tests
#   train    gpt2-124m on this one GPU with bf16 autocast, torch.compile of the model and the compiled
#            kernels, for lion_fp32, adamw_fp32 and Lion Cub 1-bit / 8-bit L1 (P = 1): the step
#            breakdown (bench.step_breakdown) with tokens/s, MFU and peak device memory per variant
#   packing  bench.packing on the GPU at 25M and 250M elements: every hot path against copy_
#   memory   peak device memory per rank of the Lion Cub variants against lion_fp32 at the 1x64
#            benchmark batch, 4 ranks time-sharing the GPU (--shared-gpu: gloo between ranks)
# At the end a summary names every stage PASS or FAIL with the log to read. Exit status: the number
# of failed stages (0 = all passed). The stage limits add up to 8 minutes (measured on an H200: env 4 s,
# tests 56-66 s, train 146 s for four variants, packing 42-44 s, memory ~20 s a variant).
set -u
cd "$(dirname "$0")/.."
OUT_DIR=${GPU_CHECK_OUT:-bench/out/gpu_check}
STAGES=${STAGES:-"env tests train packing memory"}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled TORCH_CPP_LOG_LEVEL=ERROR
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT_DIR"
declare -a SUMMARY=()
FAILED=0
T0=$(date +%s)

stage() {  # stage NAME LIMIT_S CMD...: run CMD under a time limit, log to $OUT_DIR/NAME.log
  local name=$1 limit=$2; shift 2
  case " $STAGES " in *" $name "*) ;; *) return 0 ;; esac
  local t=$(date +%s)
  echo "=== [$name] $* (limit ${limit} s)"
  timeout --signal=TERM --kill-after=15 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  local rc=${PIPESTATUS[0]}
  local took=$(( $(date +%s) - t ))
  if [ "$rc" -eq 0 ]; then
    SUMMARY+=("PASS  $name (${took} s)")
  else
    local why="exit $rc"; [ "$rc" -eq 124 ] && why="timed out after ${limit} s"
    SUMMARY+=("FAIL  $name: $why; read $OUT_DIR/$name.log")
    FAILED=$((FAILED + 1))
  fi
}

if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu-check: torch.cuda.is_available() is False: this command needs a CUDA GPU (it checks what CPU runs cannot)" >&2
  exit 2
fi
# the built-in corpus, tokenized once (seconds), so every training stage finds it
$PY -c "from data.builtin import prepare_builtin; prepare_builtin()" || { echo "gpu-check: could not prepare the built-in corpus" >&2; exit 2; }

stage env 20 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; \
  $PY -c \"import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())\""

stage tests ${TESTS_LIMIT:-100} $PY -m pytest -q -p no:cacheprovider -o addopts= tests/optim/test_kernels.py tests/optim/test_optim.py -k cuda -rf

TRAIN_VARIANTS=${TRAIN_VARIANTS:-lion_fp32,adamw_fp32,lioncub_1bit,lioncub_8bit_l1}
stage train ${TRAIN_LIMIT:-200} $PY -m bench.step_breakdown --launcher torchrun --rates unlimited --nproc 1 --no-calibrate \
  --config-dir configs/gpt2_124m --variants "$TRAIN_VARIANTS" --steps 15 --warmup 6 --timeout 120 \
  --overrides "data.dataset=builtin train.compile=true comm.kernels=auto train.ckpt_every=0 train.dtype=bfloat16" \
  --out "$OUT_DIR/train"

stage packing ${PACKING_LIMIT:-70} bash -c "$PY -m bench.packing --device cuda --repeats 21 --n 25M && \
  $PY -m bench.packing --device cuda --repeats 7 --n 250M"

stage memory ${MEMORY_LIMIT:-90} $PY -m bench.step_breakdown --launcher torchrun --shared-gpu --rates unlimited --nproc 4 --no-calibrate \
  --variants lion_fp32,lioncub_1bit,lioncub_4bit,lioncub_8bit_l1 --steps 3 --warmup 2 --timeout 120 --out "$OUT_DIR/memory"

for d in train memory; do
  [ -f "$OUT_DIR/$d/results.md" ] && { echo "=== $d: $OUT_DIR/$d/results.md"; sed -n '/^| variant | step (ms) | compute/,/^$/p' "$OUT_DIR/$d/results.md"; }
  # a failed run's reason: the last lines of its log
  for f in "$OUT_DIR/$d"/logs/*/*/torchrun.log; do
    [ -f "$f" ] && grep -q "Traceback\|Error" "$f" && { echo "--- errors in $f"; grep -B2 -A6 "Error" "$f" | tail -20; }
  done
done
echo "=== gpu-check summary ($(( $(date +%s) - T0 )) s)"
printf '%s\n' "${SUMMARY[@]}"
exit $FAILED
