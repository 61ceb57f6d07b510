#!/usr/bin/env bash
# Bandwidth simulator, shell entry point: one network namespace per rank behind tbf rate limits.
# Thin wrapper over bench/netsim.py (which does the work, the teardown and the root/iproute2
# checks); see `bench/netsim.sh --help`. Example:
#   sudo bench/netsim.sh --nproc 4 --rate 1gbit -- python -m bench.comm --worker ...
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="${ROOT}${PYTHONPATH:+:${PYTHONPATH}}"
exec "${PYTHON:-python3}" -m bench.netsim "$@"
