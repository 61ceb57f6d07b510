"""The cached native kernel module (comm/native.py) is verified before it is imported: a truncated,
altered or unrecorded file is named, rebuilt and then used, never loaded (a truncated .so kills the
process with SIGBUS); ranks building at once serialize on the build directory's lock."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

from comm import native
from tests.dist import ROOT

needs_build = pytest.mark.skipif(native._compiler() is None or native._ninja_dir() is None,
                                 reason="no C++ compiler or no ninja")
# prints "ok True" where this process built the module (torch.utils.cpp_extension imported), "ok False"
# where it imported one already built and verified
USE = ("import sys, warnings; warnings.simplefilter('always'); from comm import native; why = native.unavailable(); "
       "assert why is None, why; import torch; o = torch.empty(1, dtype=torch.uint8); "
       "native.sign_bits(torch.ones(8), True, o); assert int(o) == 255; "
       "print('ok', 'torch.utils.cpp_extension' in sys.modules)")


def _run(cache) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", USE], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, native.CACHE_ENV: str(cache)})


def _use(cache) -> subprocess.CompletedProcess:
    p = _run(cache)
    out, err = p.communicate(timeout=300)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def _module(cache):
    """The module file in cache, built (in a process of its own) when missing."""
    if not list(cache.glob("lioncub_native_*/lioncub_native_*.so")):
        r = _use(cache)
        assert r.returncode == 0, r.stderr[-2000:]
    (so,) = cache.glob("lioncub_native_*/lioncub_native_*.so")
    return so


@needs_build
@pytest.mark.parametrize("damage", ["truncate", "alter", "unrecorded"])
def test_a_damaged_cached_module_is_named_rebuilt_and_used(native_cache, damage):
    so = _module(native_cache)
    data = so.read_bytes()
    bad = {"truncate": data[: len(data) // 2], "alter": data[:-16] + b"\0" * 16, "unrecorded": data}[damage]
    if damage == "unrecorded":
        os.unlink(f"{so}.sha256")
    else:  # a new file in its place: this process may hold the old one mapped (tests/optim/test_native.py)
        tmp = so.with_suffix(".damaged")
        tmp.write_bytes(bad)
        os.replace(tmp, so)
    r = _use(native_cache)
    assert r.returncode == 0 and r.stdout.strip() == "ok True", (r.returncode, r.stdout, r.stderr[-2000:])
    assert f"{so} does not match the sha256 recorded when it was built" in r.stderr, r.stderr
    if damage != "unrecorded":
        assert so.read_bytes() != bad
    # the rebuilt file verifies: the next process imports it as it is (as in the test below)
    assert open(f"{so}.sha256").read() == hashlib.sha256(so.read_bytes()).hexdigest()


@needs_build
def test_two_ranks_load_at_once_after_a_build_was_killed(native_cache):
    """Two processes start at once where a build was killed mid-way (the module missing, cpp_extension's
    baton file left behind, which would make its load wait forever): one rebuilds while the other waits
    on the directory's lock, then imports the finished file without building; both run, neither finds
    a damaged file, and no baton is left."""
    so = _module(native_cache)
    so.unlink()
    os.unlink(f"{so}.sha256")
    (so.parent / "lock").write_text("")
    procs = [_run(native_cache) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    assert sorted(out.strip() for out, _ in outs) == ["ok False", "ok True"], outs
    assert not any("does not match" in err for _, err in outs), outs
    assert open(f"{so}.sha256").read() == hashlib.sha256(so.read_bytes()).hexdigest()
    assert not (so.parent / "lock").exists()
