"""Resuming a sharded run on another mesh (parallel.shard_size 2 -> 1 on the same 2 ranks) keeps
everything a same-mesh resume keeps: compared field by field (tests/workers/remesh_resume.py)."""
from __future__ import annotations

import json

from tests.dist import torchrun


def test_another_mesh_resume_keeps_what_a_same_mesh_resume_keeps(tmp_path):
    torchrun(2, "remesh_resume.py", str(tmp_path), timeout=300)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"fields_{rank}.json").read_text())
        same, other = got["same_mesh"], got["other_mesh"]
        assert same["step"] == 2 and same["tokens_seen"] == 2 * 2 * 2 * 32, same  # 2 steps x 2 ranks x 2 x 32
        assert same["schedule_steps"] == 4, same  # the horizon of the run's start, not the new max_steps
        for key in ("step", "tokens_seen", "schedule_steps", "loader", "skip_batches", "rng_torch", "rng_numpy",
                    "rng_python"):
            assert other[key] == same[key], (key, other[key], same[key])
        if rank == 0:
            note = [x for x in same["lines"] if x.startswith("schedule:")]
            assert note and note == [x for x in other["lines"] if x.startswith("schedule:")], (same, other)
            # written as 1 x 2 (one replica), resumed as 2 x 1: its state copied, nothing averaged
            assert any("resumed as 2 x 1: the one saved replica's optimizer state, copied to every replica" in x
                       for x in other["lines"]), other["lines"]
