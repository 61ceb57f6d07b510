"""Golden digests: every preset in configs/variants/ (plus mode options) trains bit-identically to
the code before the sync-scheme refactor, at P = 1, 2 and 4 on the tiny model.

tests/golden/digests.json was written by tests/workers/golden_digests.py on the commit before the
refactor. The Distributed Lion presets then used the tie-broken server vote, which is now named
`comm.ps_aggregate: vote_tiebreak` (`vote` became Distributed Lion eq. 5 exactly), so their keys
carry that override.
"""
import json
from pathlib import Path

import pytest

from tests.dist import torchrun

GOLDEN = json.loads((Path(__file__).parent / "golden" / "digests.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_every_variant_reproduces_its_golden_digest(tmp_path, nproc):
    expected = GOLDEN[str(nproc)]
    out = tmp_path / "digests.json"
    torchrun(nproc, "golden_digests.py", str(out), ",".join(expected), timeout=600)
    got = json.loads(out.read_text())
    assert set(got) == set(expected)
    differ = sorted(k for k in expected if got[k] != expected[k])
    assert not differ, f"parameters differ from the golden run for {differ}"
