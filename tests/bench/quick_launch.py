"""Launch the quick studies' runs the way the rest of the suite launches train.py on several ranks.

bench.reproduce starts every run as `python -m torch.distributed.run --standalone --nproc_per_node=P
train.py ...`: a launcher process and P fresh interpreters, each importing torch (and, through
torch.optim, torch._dynamo). On the 2-core development machine those imports, not the few training
steps, are most of a quick run's time. `DirectLaunches` stands in for the `subprocess` module of
bench.reproduce.framework: the first `first_real` torchrun commands run as written (so the command the
framework builds is still launched by torchrun in every end-to-end test), the later ones run the same
train.py arguments with the same environment and working directory through tests.dist.torchrun (ranks
forked from a zygote that has imported torch: the same gloo process group as torchrun --standalone).
Their output goes to the run's log as before. Anything that is not a torchrun command runs as written.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.dist import ROOT, torchrun

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
NPROC = "--nproc_per_node="


class DirectLaunches:
    def __init__(self, first_real: int = 1):
        self.real_left = first_real
        self.real = 0    # torchrun commands run as written
        self.direct = 0  # torchrun commands run through tests.dist.torchrun

    def __getattr__(self, name: str):
        return getattr(subprocess, name)

    def run(self, cmd, **kw) -> subprocess.CompletedProcess:
        cmd = [str(c) for c in cmd]
        if cmd[:4] != TORCHRUN:
            return subprocess.run(cmd, **kw)
        if self.real_left > 0:
            self.real_left -= 1
            self.real += 1
            return subprocess.run(cmd, **kw)
        assert cmd[4].startswith(NPROC) and cmd[5] == "train.py", \
            f"tests/bench/quick_launch.py does not know this torchrun command: {cmd[:6]}"
        out = kw["stdout"]
        assert kw.get("stderr") == subprocess.STDOUT and hasattr(out, "write"), kw
        cwd = Path(kw["cwd"])
        assert cwd.resolve() == ROOT, cwd  # tests.dist.torchrun starts its ranks in the repository root
        proc = torchrun(int(cmd[4][len(NPROC):]), cwd / cmd[5], *cmd[6:], env=kw["env"], check=False, timeout=900)
        out.write(proc.stdout + proc.stderr)
        out.flush()
        self.direct += 1
        return subprocess.CompletedProcess(cmd, proc.returncode)


def direct_launches(monkeypatch, first_real: int = 1) -> DirectLaunches:
    """Install DirectLaunches in bench.reproduce.framework for one test; returns it (its counts)."""
    from bench.reproduce import framework

    launches = DirectLaunches(first_real)
    monkeypatch.setattr(framework, "subprocess", launches)
    return launches
