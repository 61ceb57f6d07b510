#!/usr/bin/env bash
# Local launcher: NPROC ranks of train.py on this machine under torchrun (one node), through
# launch.torchrun: the config is checked before any rank starts, and a failing rank's exit code
# and message are kept without torchrun's ChildFailedError traceback.
#
#   launch/run.sh [CONFIG] [section.key=value ...]
#   launch/run.sh configs/default.yaml train.max_steps=100
#   NPROC=4 LOG_RANK=0 launch/run.sh configs/default.yaml optim.name=lion comm.mode=pbit
#
# CONFIG defaults to configs/default.yaml (a first argument containing "=" is an override).
# Environment:
#   NPROC            ranks to start (default 2)
#   LOG_RANK         show only this rank's output (torchrun --tee 3 --local-ranks-filter);
#                    every rank still runs and still writes its own logs. Default: all ranks.
#   OMP_NUM_THREADS  kept when set; otherwise cores / NPROC (at least 1), so the ranks do not
#                    oversubscribe the cores (torchrun alone would force 1).
#   MAX_RESTARTS     how often torchrun restarts all ranks after one fails (default 0); with
#                    restarts, train.resume=auto is added (unless given) so every (re)start
#                    continues from the newest intact checkpoint, after a check that train.out_dir
#                    is free (a new run: pass train.resume=auto yourself to continue one)
#   PYTHON           interpreter (default python3)
#   DRY_RUN=1        print the command and exit without running it
# The exact command is printed before it runs, so a run can be reproduced from its log.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
NPROC="${NPROC:-2}"

die() { echo "launch/run.sh: $*" >&2; exit 2; }

[[ "$NPROC" =~ ^[1-9][0-9]*$ ]] || die "NPROC must be a positive integer, got '$NPROC'"

CONFIG="configs/default.yaml"
if [[ $# -gt 0 && "$1" != *=* ]]; then
  CONFIG="$1"
  shift
fi
if [[ ! -f "$CONFIG" && -f "$ROOT/$CONFIG" ]]; then
  CONFIG="$ROOT/$CONFIG"
fi
[[ -f "$CONFIG" ]] || die "config file '$CONFIG' not found; pass a YAML path, e.g. configs/default.yaml"

if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
  cores="$(nproc 2>/dev/null || echo 1)"
  OMP_NUM_THREADS=$(( cores / NPROC ))
  (( OMP_NUM_THREADS >= 1 )) || OMP_NUM_THREADS=1
fi
export OMP_NUM_THREADS

log_args=()
if [[ -n "${LOG_RANK:-}" ]]; then
  [[ "$LOG_RANK" =~ ^[0-9]+$ ]] && (( LOG_RANK < NPROC )) \
    || die "LOG_RANK must be a rank in 0..$((NPROC - 1)), got '$LOG_RANK'"
  log_args=(--tee 3 --local-ranks-filter "$LOG_RANK")
fi

MAX_RESTARTS="${MAX_RESTARTS:-0}"
[[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]] || die "MAX_RESTARTS must be a non-negative integer, got '$MAX_RESTARTS'"
resume_args=()
# launch.torchrun is found from any working directory, installed or not
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if (( MAX_RESTARTS > 0 )) && [[ " $* " != *" train.resume="* ]]; then
  # a new run, as train.py's train.resume=never would check; then auto, so the restarts continue it
  "$PYTHON" -m launch.preflight --world "$NPROC" --node-size "$NPROC" \
      --fresh "pass train.resume=auto to continue it" "$CONFIG" "$@" || exit 2
  resume_args=(train.resume=auto)
fi
cmd=("$PYTHON" -m launch.torchrun --standalone --nproc_per_node="$NPROC" --max-restarts="$MAX_RESTARTS"
     "${log_args[@]}" "$ROOT/train.py" "$CONFIG" "$@" "${resume_args[@]}")

echo "+ OMP_NUM_THREADS=$OMP_NUM_THREADS $(printf '%q ' "${cmd[@]}")"
[[ "${DRY_RUN:-0}" == 1 ]] && exit 0
exec "${cmd[@]}"
