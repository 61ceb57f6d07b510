"""Reproduction suite: Lion Cub's findings re-measured with this tool's own training.

    python -m bench.reproduce --list
    python -m bench.reproduce toy                      # App. C.1 toy (its own loop, minutes)
    python -m bench.reproduce table2 [--quick] [--seeds 1337,1338] [--out DIR] [--work DIR]

Studies register themselves in `STUDIES` (bench.reproduce.framework.register): toy (App. C.1 /
Fig. 11), table2, fig10, table3, fig5, fig6_17, compressors (Fig. 20) and dion_ef. See framework.py
for the run / restart / store / output rules; finished runs are kept in <results>/store/ so that a
later session adds seeds without retraining the earlier ones.
"""
from __future__ import annotations

from . import studies, toy  # noqa: F401  (registration)
from .framework import STUDIES, Options, Run, RunResult, Scale, Study, StudyUnavailable, register

__all__ = ["STUDIES", "Options", "Run", "RunResult", "Scale", "Study", "StudyUnavailable", "register", "main"]


def main(argv: list[str] | None = None) -> int:
    from .__main__ import main as _main

    return _main(argv)
