#!/usr/bin/env bash
# A short probe of a lent GPU (at most $PROBE_BUDGET seconds, default 180): what the several-ranks-on-one-
# device launcher, the fused Lion update and the MFU work need to know. Needs only this repository and
# an installed torch with CUDA. Every part runs under `timeout`; a failed or timed-out part is reported
# ("=== part: FAILED ...") and the next one still runs. Result lines start with "PROBE <part>:".
#
#   bash launch/gpu_probe.sh                      # from the repository root
#   PROBE_BUDGET=300 MFU_VARIANTS="12:default 24:default 12:max-autotune-no-cudagraphs" bash launch/gpu_probe.sh
#
# Parts: env (versions); lion (fused Lion candidates vs the foreach kernels vs fused AdamW on gpt2-124m's
# shapes); then, the 2-rank parts (nccl: two ranks on one device; gloo: every collective of the comm
# layer on CUDA tensors; fsdp: fully_shard + DCP over gloo) in the background while the first MFU variant
# compiles (they use the GPU for milliseconds); mfu: gpt2-124m forward + backward, bf16 autocast,
# torch.compile, per micro-batch:mode (the first with a kernel profile).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
BUDGET=${PROBE_BUDGET:-180}
MFU_VARIANTS=${MFU_VARIANTS:-"12:default 24:default"}  # micro-batch:compile mode[:SDPBackend name]
PRESET=${PROBE_PRESET:-gpt2-124m}  # PROBE_PRESET=debug LIONCUB_PROBE_DEVICE=cpu: a dry run of the script on CPU
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TORCH_CPP_LOG_LEVEL=ERROR
T0=$(date +%s)
TMP=$(mktemp -d)

left() { echo $(( BUDGET - ($(date +%s) - T0) - 2 )); }

part() {  # part NAME LIMIT CMD...: run under min(LIMIT, time left); never aborts the script
  local name=$1 limit=$2; shift 2
  local l; l=$(left)
  [ "$l" -lt "$limit" ] && limit=$l
  if [ "$limit" -lt 5 ]; then echo "=== $name: SKIPPED (budget of ${BUDGET} s spent)"; return 0; fi
  local t=$(date +%s)
  echo "=== $name (limit ${limit} s): $*"
  timeout --signal=TERM --kill-after=5 "$limit" "$@" 2>&1
  local rc=$?
  local took=$(( $(date +%s) - t ))
  if [ $rc -eq 0 ]; then echo "=== $name: done in ${took} s"
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then echo "=== $name: FAILED (timed out after ${limit} s)"
  else echo "=== $name: FAILED (exit $rc after ${took} s)"; fi
}

part env 30 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; $PY -m launch.gpu_probe env"
part lion 80 $PY -m launch.gpu_probe lion --preset "$PRESET"

# the 2-rank parts in the background (their output is printed after the first MFU variant)
( part nccl 30 $PY -m launch.gpu_probe nccl > "$TMP/nccl" 2>&1 ) &
( part gloo 40 $PY -m launch.gpu_probe gloo > "$TMP/gloo" 2>&1 ) &
( part fsdp 40 $PY -m launch.gpu_probe fsdp > "$TMP/fsdp" 2>&1 ) &
first=1
for v in $MFU_VARIANTS; do
  IFS=: read -r mb mode sdpa <<< "$v"
  extra=""; [ $first -eq 1 ] && extra="--profile"
  [ -n "${sdpa:-}" ] && extra="$extra --sdpa $sdpa"
  limit=75; [ $first -eq 1 ] || limit=50
  part "mfu mb=$mb mode=$mode ${sdpa:-}" $limit $PY -m launch.gpu_probe mfu --preset "$PRESET" --mb "$mb" --mode "$mode" $extra
  if [ $first -eq 1 ]; then
    first=0
    wait
    cat "$TMP/nccl" "$TMP/gloo" "$TMP/fsdp"
  fi
done
wait
rm -rf "$TMP"
echo "=== probe finished in $(( $(date +%s) - T0 )) s (budget ${BUDGET} s)"
