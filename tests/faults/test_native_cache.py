"""The cached native kernel library (comm/native.py) is verified before it is loaded: a truncated
or altered file is named, rebuilt and then used, never loaded (a truncated .so kills the process
with SIGBUS). A crash of comm.kernels=auto's timing child never leads to loading the same library
in the training process: the warning names the file and the native candidate is left out."""
from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest

from comm import kernel_probe, native
from comm import kernels as K
from tests.dist import ROOT

needs_cc = pytest.mark.skipif(native._compiler() is None, reason="no C compiler")
USE = ("import warnings; warnings.simplefilter('always'); from comm import native; why = native.unavailable(); "
       "assert why is None, why; import torch; o = torch.empty(1, dtype=torch.uint8); "
       "native.sign_bits(torch.ones(8), True, o); assert int(o) == 255; print('ok')")


def _use(cache) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", USE], cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, native.CACHE_ENV: str(cache)})


@needs_cc
@pytest.mark.parametrize("damage", ["truncate", "alter"])
def test_a_damaged_cached_library_is_named_rebuilt_and_used(tmp_path, damage):
    assert _use(tmp_path).returncode == 0
    (so,) = tmp_path.glob("lioncub_native_*.so")
    data = so.read_bytes()
    so.write_bytes(data[: len(data) // 2] if damage == "truncate" else data[:-16] + b"\0" * 16)
    r = _use(tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", (r.returncode, r.stderr[-2000:])
    assert f"{so} does not match the sha256 recorded when it was built" in r.stderr, r.stderr
    assert so.read_bytes() != (data[: len(data) // 2] if damage == "truncate" else data[:-16] + b"\0" * 16)
    assert _use(tmp_path).stderr.count("does not match") == 0  # the rebuilt file verifies


@needs_cc
def test_a_crashed_timing_child_never_leads_to_loading_the_library_here(tmp_path, monkeypatch):
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv("LIONCUB_KERNEL_CACHE", "off")  # a cached kernel choice would start no timing child
    for name, value in (("_loaded", False), ("_lib", None), ("_why", None)):
        monkeypatch.setattr(native, name, value)
    for name in ("_auto", "_rejected"):
        monkeypatch.setattr(K, name, {})
    for name in ("_auto_log", "_warmups"):
        monkeypatch.setattr(K, name, [])
    monkeypatch.delenv(kernel_probe.ENV, raising=False)
    real_run = subprocess.run

    def run(cmd, *a, **k):  # the timing child dies of SIGBUS; every other subprocess (inductor's) runs
        if any("kernel_probe" in str(x) for x in cmd):
            return subprocess.CompletedProcess(cmd, -7, "", "")
        return real_run(cmd, *a, **k)

    monkeypatch.setattr(kernel_probe.subprocess, "run", run)
    checked = []
    real = K._check_candidate
    monkeypatch.setattr(K, "_check_candidate", lambda cand, *a: checked.append(cand) or real(cand, *a))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        K.warmup("cpu", world_sizes=(4,), impl="auto", layout=[(0, 4096)], repeats=1)
    text = " ".join(str(w.message) for w in got)
    assert "killed by signal 7" in text and native.library_path() in text, text
    assert "native" not in checked and native._lib is None  # never loaded in this process
    assert all(r["chosen"] != "native" for r in K.auto_choices())
