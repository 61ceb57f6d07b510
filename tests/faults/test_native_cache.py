"""The cached native kernel library (comm/native.py) is verified before it is loaded: a truncated
or altered file is named, rebuilt and then used, never loaded (a truncated .so kills the process
with SIGBUS)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from comm import native
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
