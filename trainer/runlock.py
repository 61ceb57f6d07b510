"""One live run per run directory: a lock file `<out_dir>/.lock` held by rank 0 for the run's life.

The lock records the holder's pid, host, boot id, process start time and wall-clock start. A
second run refuses the directory unless the holder is provably dead on this host: same host and
boot, and either no process with that pid or one that started at another time (a reused pid).
A holder on another host cannot be checked from here: the message says how to remove the lock
once you know that run is gone. Taking over a dead holder's lock is atomic (write a temp file,
rename) and reported.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from util import atomic_write, pid_alive

LOCK = ".lock"


class LockError(RuntimeError):
    """The run directory is held by a live (or unverifiable) run."""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> int | None:
    """Start time of process `pid` in clock ticks since boot (None: no such process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the name in parens may hold spaces


def holder_record() -> dict:
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "boot_id": _boot_id(), "start_ticks": _start_ticks(pid),
            "started": time.strftime("%Y-%m-%d %H:%M:%S")}


def dead_reason(rec: dict) -> str:
    """Why the recorded holder is provably dead on this host ("" when it is not provably dead)."""
    if rec.get("host") != socket.gethostname() or (rec.get("boot_id") and rec.get("boot_id") != _boot_id()):
        if rec.get("host") == socket.gethostname():
            return "this host rebooted since it took the lock"
        return ""
    pid = int(rec.get("pid", -1))
    if pid <= 0 or not pid_alive(pid):
        return f"process {pid} is gone"
    ticks = _start_ticks(pid)
    if rec.get("start_ticks") is not None and ticks is not None and ticks != rec["start_ticks"]:
        return f"pid {pid} now belongs to another process"
    return ""


class RunLock:
    def __init__(self, out_dir: Path) -> None:
        self.path = Path(out_dir) / LOCK
        self.held = False

    def read(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable: treated like an unverifiable holder

    def acquire(self) -> str:
        """Take the lock; returns a note when a dead holder's lock was taken over, else ""."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        rec = holder_record()
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            old = self.read()
            if old is None:  # released in between: try once more
                return self.acquire()
            why = dead_reason(old) if old else ""
            if not why:
                who = (f"pid {old.get('pid')} on host {old.get('host')} since {old.get('started')}" if old
                       else "an unreadable lock")
                raise LockError(f"run directory {self.path.parent} is in use by {who} (lock {self.path}); wait "
                                f"for that run to finish or stop it. If you know it is gone (e.g. it ran on another "
                                f"machine), delete {self.path} and retry") from None
            atomic_write(self.path, json.dumps(rec), suffix=f".{rec['pid']}.tmp")
            self.held = True
            return f"took over the lock of a dead run ({why})"
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(rec))
        self.held = True
        return ""

    def release(self) -> None:
        if self.held:
            rec = self.read() or {}
            if rec.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
            self.held = False
