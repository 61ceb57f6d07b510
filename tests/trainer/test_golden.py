"""Golden digests: every preset in configs/variants/ (plus mode options) trains bit-identically to
the reference code, at P = 1, 2 and 4 on the tiny model.

The digests were first recorded on the code before the sync-scheme refactor (its Distributed Lion
presets used the tie-broken server vote, now `comm.ps_aggregate: vote_tiebreak`, so their keys carry
that override), and every commit reproduced them up to the parent of tests/golden/record.py's
REFERENCE. That commit changed one rounding on purpose (clipping by the global norm the step already
computes, instead of a second norm over the flat buffers, whose summation order depended on their
layout), and the digests were recorded again from it.

Bit identity holds per host kind, not across hosts (tests/golden/host.py: torch's CPU kernels round
by the host's vector width and CPU). digests.json is the AVX-512 host kind's (fingerprint
6a6bdb0f223c486e); tests/golden/digests_<fingerprint>.json holds another host kind's, recorded from
REFERENCE by `python -m tests.golden.record` (the AVX2 kind's, 6dd5f4074dbb6613, on an AVX-512 host
with ATEN_CPU_CAPABILITY=avx2 and comm.kernels=eager: that recipe reproduced the file recorded on a
real AVX2 host, bit for bit; and an Intel Xeon AVX-512 host's, f43221d26393f412, whose kernels round
unlike the AMD EPYC AVX-512 host's, recorded natively on 2026-11-27). A host with its own file is
checked against it, any other host against digests.json.

The suite checks P = 1 and 4 (`make test` must stay under 15 minutes on the 2-core development
machine; the golden runs are its longest tests). P = 2's digests are kept and checked with
LIONCUB_GOLDEN_NPROC=1,2,4: every scheme's P = 2 collectives are also compared with independent
references in tests/optim/test_lioncub.py, test_comm.py and test_overlap.py.
"""
import json
import os
import shutil
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
# one item per (P, variant); every host file holds the same variants (test above), so digests.json names them.
# A P with no digests at all is one item that fails saying so.
_BASE = json.loads((GOLDEN_DIR / "digests.json").read_text())
CASES = [(n, v) for n in GOLDEN_NPROC for v in (sorted(_BASE[str(n)]) if str(n) in _BASE else [None])]
_RUNS: dict[int, dict | BaseException] = {}


@pytest.fixture(scope="module")
def golden_run(tmp_path_factory):
    """{variant: digest} of the current code at P ranks: the worker runs once per P (every variant in one
    process group) and each variant's item reads its own digest; a failed run fails every item of that P."""
    def get(nproc: int, variants: list[str]) -> dict:
        if nproc not in _RUNS:
            out = tmp_path_factory.mktemp(f"golden_p{nproc}") / "digests.json"
            try:
                torchrun(nproc, "golden_digests.py", str(out), ",".join(variants), timeout=600)
                _RUNS[nproc] = json.loads(out.read_text())
                shutil.rmtree(out.parent, ignore_errors=True)
            except BaseException as e:  # noqa: BLE001 - kept and raised again by every item of this P
                _RUNS[nproc] = e
        got = _RUNS[nproc]
        if isinstance(got, BaseException):
            raise AssertionError(f"the golden worker at P = {nproc} failed: {got}") from got
        return got
    return get


@pytest.mark.slow
@pytest.mark.parametrize("nproc,variant", CASES, ids=[f"P{n}-{v}" for n, v in CASES])
def test_every_variant_reproduces_its_golden_digest(nproc, variant, golden, golden_run):
    fp, path, digests = golden
    assert variant is not None and str(nproc) in digests, \
        f"LIONCUB_GOLDEN_NPROC: {path.name} has digests for P = {', '.join(sorted(digests))}"
    expected = digests[str(nproc)]
    got = golden_run(nproc, sorted(expected))
    assert variant in got, f"the golden worker at P = {nproc} recorded no digest for {variant} (it has {sorted(got)})"
    assert got[variant] == expected[variant], (
        f"{variant} at P = {nproc}: parameters differ from the golden run ({path.name}, host fingerprint {fp}). "
        f"If this host rounds differently from the one that recorded {path.name} (no digests_{fp}.json yet), "
        "record its digests from the pre-refactor code with `python -m tests.golden.record` and compare again")
