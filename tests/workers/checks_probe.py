"""A worker for tests/harness/test_checks.py: three named checks, no process group. argv[1] names
the check that fails on purpose ("-": none); argv[2] = "crash" leaves with exit code 3 before it
instead; argv[3] (optional) limits either to that rank. With CHECKS_PROBE=sequence the checks are
steps of one function marked with `checks.begin` (run through `checks.guard`)."""
import os
import sys

from _checks import Checks  # tests/workers/ is the script's directory

CHECKS = ("first", "second", "third")


def run(name: str) -> None:
    target, how = sys.argv[1], sys.argv[2]
    only = sys.argv[3] if len(sys.argv) > 3 else os.environ["RANK"]
    if name == target and os.environ["RANK"] == only:
        if how == "crash":
            os._exit(3)
        assert 1 + 1 == 3, f"deliberate failure of {name}"


def sequence(checks: Checks) -> None:
    for name in CHECKS:
        checks.begin(name)
        run(name)


if __name__ == "__main__":
    checks = Checks(CHECKS)
    if os.environ.get("CHECKS_PROBE") == "sequence":
        checks.guard(sequence, checks)
    else:
        for name in CHECKS:
            checks.run(name, run, name)
