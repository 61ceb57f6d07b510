"""Golden digests: every preset in configs/variants/ (plus mode options) trains bit-identically to
the code before the sync-scheme refactor, at P = 1, 2 and 4 on the tiny model.

tests/golden/digests.json was written by tests/workers/golden_digests.py on the commit before the
refactor. The Distributed Lion presets then used the tie-broken server vote, which is now named
`comm.ps_aggregate: vote_tiebreak` (`vote` became Distributed Lion eq. 5 exactly), so their keys
carry that override.

Bit identity holds per host kind, not across hosts (tests/golden/host.py: torch's CPU kernels round
by the host's vector width and CPU). digests.json is the first development host's (its fingerprint
was not recorded); tests/golden/digests_<fingerprint>.json holds another host kind's, recorded on
that host from the same pre-refactor commit by `python -m tests.golden.record`. A host with its own
file is checked against it, any other host against digests.json.

The suite checks P = 1 and 4 (`make test` must stay under 15 minutes on the 2-core development
machine; the golden runs are its longest tests). P = 2's digests are kept and checked with
LIONCUB_GOLDEN_NPROC=1,2,4: every scheme's P = 2 collectives are also compared with independent
references in tests/optim/test_lioncub.py, test_comm.py and test_overlap.py.
"""
import json
import os
from pathlib import Path

import pytest

from tests.dist import torchrun
from tests.golden.record import host_fingerprint

GOLDEN_DIR = Path(__file__).parents[1] / "golden"


@pytest.fixture(scope="module")
def golden() -> tuple[str, Path, dict]:
    fp = host_fingerprint()
    path = GOLDEN_DIR / f"digests_{fp}.json"
    if not path.exists():
        path = GOLDEN_DIR / "digests.json"
    return fp, path, json.loads(path.read_text())


def test_host_fingerprint_is_stable_and_sees_the_kernels():
    """The key is a function of the host's rounding: the same in every process, and another when torch's
    CPU kernels are forced to another capability (the non-vectorized 'default' path)."""
    fp = host_fingerprint()
    assert len(fp) == 16 and fp == host_fingerprint()
    forced = host_fingerprint(ATEN_CPU_CAPABILITY="default")
    import torch
    if torch.backends.cpu.get_cpu_capability() != "DEFAULT":
        assert forced != fp


def test_every_host_file_has_the_same_variants():
    base = json.loads((GOLDEN_DIR / "digests.json").read_text())
    for path in GOLDEN_DIR.glob("digests_*.json"):
        other = json.loads(path.read_text())
        assert {n: set(v) for n, v in other.items()} == {n: set(v) for n, v in base.items()}, path.name


GOLDEN_NPROC = [int(n) for n in os.environ.get("LIONCUB_GOLDEN_NPROC", "1,4").split(",") if n]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", GOLDEN_NPROC)
def test_every_variant_reproduces_its_golden_digest(tmp_path, nproc, golden):
    fp, path, digests = golden
    assert str(nproc) in digests, f"LIONCUB_GOLDEN_NPROC: {path.name} has digests for P = {', '.join(sorted(digests))}"
    expected = digests[str(nproc)]
    out = tmp_path / "digests.json"
    torchrun(nproc, "golden_digests.py", str(out), ",".join(expected), timeout=600)
    got = json.loads(out.read_text())
    assert set(got) == set(expected)
    differ = sorted(k for k in expected if got[k] != expected[k])
    assert not differ, (f"parameters differ from the golden run ({path.name}, host fingerprint {fp}) for {differ}. "
                        f"If this host rounds differently from the one that recorded {path.name} (no "
                        f"digests_{fp}.json yet), record its digests from the pre-refactor code with "
                        "`python -m tests.golden.record` and compare again")
