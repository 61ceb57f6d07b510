"""Record this host's golden digests from the code before the sync-scheme refactor.

    python -m tests.golden.record [--force]

Checks out the commit the first digests were recorded on (PRE_REFACTOR, into a temporary git
worktree), runs its tests/workers/golden_digests.py at P = 1, 2 and 4 on this host, renames the
Distributed Lion keys as tests/golden/digests.json does (their tie-broken server vote is now
`comm.ps_aggregate=vote_tiebreak`), and writes tests/golden/digests_<fingerprint>.json for this
host's fingerprint (tests/golden/host.py). tests/trainer/test_golden.py then checks the current code
against the old code's digests on the same kind of host. An existing file is kept unless --force.
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
PRE_REFACTOR = "04b7fa1"  # "tests/golden: parameter digests ... recorded before the sync-scheme refactor"
RENAMED = {"dlion_mavo": "dlion_mavo@comm.ps_aggregate=vote_tiebreak"}


def host_fingerprint(**env: str) -> str:
    """tests/golden/host.py's fingerprint, computed in a fresh one-thread process as the workers run
    (`env`: extra variables, e.g. ATEN_CPU_CAPABILITY to force another kernel path)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    out = subprocess.run([sys.executable, "-m", "tests.golden.host"], cwd=ROOT, env=env, check=True,
                         capture_output=True, text=True)
    return out.stdout.strip()


def old_key(key: str) -> str:
    """A digests.json key as the pre-refactor worker names it."""
    for old, new in RENAMED.items():
        if key == new or key.startswith(new + "@"):
            return old + key[len(new):]
    return key


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--force", action="store_true", help="replace this host's existing digests file")
    args = ap.parse_args(argv)
    fp = host_fingerprint()
    dest = GOLDEN_DIR / f"digests_{fp}.json"
    if dest.exists() and not args.force:
        print(f"error: {dest.relative_to(ROOT)} exists (this host's digests are recorded); pass --force to "
              "record them again", file=sys.stderr)
        return 2
    keys = json.loads((GOLDEN_DIR / "digests.json").read_text())
    digests: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        wt = Path(tmp) / "pre_refactor"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(wt), PRE_REFACTOR], check=True)
        try:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(wt), "WANDB_MODE": "disabled",
                   "TORCH_CPP_LOG_LEVEL": "ERROR"}
            env.pop("RANK", None)
            for n in ("1", "2", "4"):
                names = {old_key(k): k for k in keys[n]}
                out = Path(tmp) / f"digests_{n}.json"
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                       str(wt / "tests" / "workers" / "golden_digests.py"), str(out), ",".join(names)]
                print(f"P = {n}: {len(names)} variants on the code of {PRE_REFACTOR} ...", flush=True)
                subprocess.run(cmd, cwd=wt, env=env, check=True)
                digests[n] = {names[k]: v for k, v in json.loads(out.read_text()).items()}
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(wt)], check=False)
    dest.write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
    print(f"wrote {dest.relative_to(ROOT)} (host fingerprint {fp})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
