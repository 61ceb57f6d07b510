"""Stopping a run on a signal: SIGTERM, SIGUSR1 or a first Ctrl-C (SIGINT) sets a stop flag, the
trainer hands it to the optimizer's step, whose guard collective carries it to every rank, and the
run checkpoints at the end of that step and stops (continue with train.resume=auto). A second
Ctrl-C leaves at once."""
from __future__ import annotations

import os
import signal

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class StopSignals:
    """The stop flag a signal handler sets, and how many signals arrived."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.signum = None  # the last signal received; None: no stop asked for on this rank
        self.count = 0

    def handle(self, signum, _frame) -> None:
        self.count += 1
        if signum == signal.SIGINT and self.count > 1:  # a second Ctrl-C: leave at once
            raise KeyboardInterrupt
        if self.signum is None:  # os.write: safe inside a handler (print could re-enter buffered I/O)
            more = "; Ctrl-C again to leave at once without one" if signum == signal.SIGINT else ""
            os.write(2, f"rank {self.rank}: signal {signum} received: checkpointing at the end of this "
                        f"step, then stopping{more}\n".encode())
        self.signum = signum

    def install(self) -> None:
        for sig in SIGNALS:
            signal.signal(sig, self.handle)


def restore_defaults() -> None:
    """The default handlers again, once the run is over: a dying run must die on a signal."""
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
