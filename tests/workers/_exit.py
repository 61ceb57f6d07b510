"""Leave a worker process without interpreter teardown, where gloo can abort ("terminate called
without an active exception") after a clean shutdown and turn exit code 0 into SIGABRT; train.py
does the same. Call it only after the worker's checks passed and its process group is destroyed."""
import os
import sys


def exit_cleanly(code: int = 0) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
