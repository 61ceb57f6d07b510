"""Record this host's golden digests from the reference commit.

    python -m tests.golden.record [--force]

Checks out REFERENCE (into a temporary git worktree), runs its tests/workers/golden_digests.py at
P = 1, 2 and 4 on this host, and writes tests/golden/digests_<fingerprint>.json for this host's
fingerprint (tests/golden/host.py). tests/trainer/test_golden.py then checks the current code
against the reference's digests on the same kind of host. An existing file is kept unless --force.

The reference: the digests were first recorded on the code before the sync-scheme refactor
(04b7fa1), and every later commit reproduced them bit for bit, up to REFERENCE's parent. REFERENCE
changed one rounding on purpose (gradient clipping scales by the global norm the step already
computes, per-tensor norms summed in layout order, instead of a second norm over the flat buffers)
and the digests were recorded again from it, for both host kinds (this module run natively on an
AVX-512 host, and with ATEN_CPU_CAPABILITY=avx2, which gives the AVX2 host kind's fingerprint).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GOLDEN_DIR = Path(__file__).resolve().parent
REFERENCE = "4b21d69"  # "Clipping scales by _grad_norms' global norm ...": the digests' code


def host_fingerprint(**env: str) -> str:
    """tests/golden/host.py's fingerprint, computed in a fresh one-thread process as the workers run
    (`env`: extra variables, e.g. ATEN_CPU_CAPABILITY to force another kernel path)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    out = subprocess.run([sys.executable, "-m", "tests.golden.host"], cwd=ROOT, env=env, check=True,
                         capture_output=True, text=True)
    return out.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--force", action="store_true", help="replace this host's existing digests file")
    ap.add_argument("--commit", default=REFERENCE, help=f"the code to record (default {REFERENCE})")
    ap.add_argument("--set", dest="sets", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                    help="overrides for every run, e.g. comm.kernels=eager (see AVX2 below)")
    ap.add_argument("--out", type=Path, default=None, help="write here instead of tests/golden/digests_<fp>.json")
    args = ap.parse_args(argv)
    fp = host_fingerprint()
    dest = args.out or GOLDEN_DIR / f"digests_{fp}.json"
    if dest.exists() and not args.force:
        print(f"error: {dest} exists (this host's digests are recorded); pass --force to "
              "record them again", file=sys.stderr)
        return 2
    keys = json.loads((GOLDEN_DIR / "digests.json").read_text())
    digests: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        wt = Path(tmp) / "reference"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(wt), args.commit], check=True)
        try:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(wt), "WANDB_MODE": "disabled",
                   "TORCH_CPP_LOG_LEVEL": "ERROR"}
            env.pop("RANK", None)
            for n in ("1", "2", "4"):
                names = sorted(keys[n])
                out = Path(tmp) / f"digests_{n}.json"
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                       str(wt / "tests" / "workers" / "golden_digests.py"), str(out), ",".join(names), *args.sets]
                print(f"P = {n}: {len(names)} variants on the code of {args.commit} ...", flush=True)
                subprocess.run(cmd, cwd=wt, env=env, check=True)
                digests[n] = json.loads(out.read_text())
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(wt)], check=False)
    dest.write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
    print(f"wrote {dest} (host fingerprint {fp})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
