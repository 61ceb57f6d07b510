"""What the workers that train in-process share (tests/workers/ is the script's directory)."""
from __future__ import annotations


def fit(tr) -> dict:
    """`tr.fit()`'s result; the trainer's log is closed and its resources released also when it raises."""
    try:
        return tr.fit()
    finally:
        tr.logger.close()
        tr.release()
