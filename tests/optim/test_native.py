"""comm.native: the build (cached per source, compiler and CPU; atomic), its failure modes, and the
dispatch around it. The bytes of every native kernel are checked in tests/comm/test_kernels.py (each
wire-kernel test runs on native too) and a distributed step in tests/workers/optim_dist.py."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from comm import kernels as K
from comm import native

ROOT = Path(__file__).resolve().parents[2]
needs_cc = pytest.mark.skipif(native._compiler() is None, reason="no C compiler")


@pytest.fixture
def fresh_native(monkeypatch):
    """comm.native as if never loaded in this process, restored after the test."""
    monkeypatch.setattr(native, "_loaded", False)
    monkeypatch.setattr(native, "_lib", None)
    monkeypatch.setattr(native, "_why", None)


@needs_cc
def test_the_library_is_built_once_into_its_cache_and_reused(tmp_path, monkeypatch, fresh_native):
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    assert native.unavailable("cpu") is None
    libs = list(tmp_path.glob("lioncub_native_*.so"))
    assert len(libs) == 1 and not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*.c"))
    mtime = libs[0].stat().st_mtime_ns
    # another process with the same cache loads that file and builds nothing
    code = ("from comm import native; assert native.unavailable() is None; "
            "import torch; o = torch.empty(1, dtype=torch.uint8); native.sign_bits(torch.ones(8), True, o); "
            "assert int(o) == 255")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, native.CACHE_ENV: str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert [p.stat().st_mtime_ns for p in tmp_path.glob("lioncub_native_*.so")] == [mtime]


def test_no_compiler_or_no_compile_names_the_reason(monkeypatch, fresh_native):
    monkeypatch.setenv("CC", "/nonexistent/cc-for-test")
    monkeypatch.setattr(native.shutil, "which", lambda c: None)
    why = native.unavailable("cpu")
    assert why is not None and "no C compiler" in why
    x = torch.randn(1000)
    with pytest.raises(RuntimeError, match="impl='native'.*no C compiler"):
        K.sign_pack(x, 1, impl="native")
    monkeypatch.setattr(native, "_loaded", False)
    monkeypatch.setattr(native, "_why", None)
    monkeypatch.setenv(native.NO_COMPILE_ENV, "1")
    assert "LIONCUB_NO_COMPILE=1" in native.unavailable("cpu")
    assert "CPU only" in native.unavailable("cuda")


@needs_cc
def test_a_failing_build_reports_the_compiler_error(tmp_path, monkeypatch, fresh_native):
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(native, "SOURCE", native.SOURCE + "\nthis is not C;\n")
    why = native.unavailable("cpu")
    assert why is not None and "building the native kernels" in why and "error" in why
    assert not list(tmp_path.glob("*.so")) and not list(tmp_path.glob("*.tmp"))


def test_comm_kernels_native_is_refused_where_it_cannot_run(monkeypatch):
    """The optimizer refuses comm.kernels=native at construction, naming why (here: the parameters'
    device is reported unsupported, as a GPU's would be), instead of failing at the first step."""
    import optim

    seen = []
    monkeypatch.setattr(native, "unavailable", lambda d="cpu": seen.append(torch.device(d).type) or
                        "native kernels run on the CPU only, not on cuda")
    p = torch.nn.Parameter(torch.randn(10))
    with pytest.raises(ValueError, match="comm.kernels=native: native kernels run on the CPU only"):
        optim.build_optimizer("lion", [{"params": [p], "names": ["w"], "role": "mlp", "lr": 1e-3, "weight_decay": 0.0,
                                        "lr_mult": 1.0}], comm_mode="onebit",
                              kernels="native")
    assert seen == ["cpu"]  # asked about the parameters' device


def test_native_follows_the_quantizers_it_has():
    """The sign quantizer (p None) has no native loop: quantize_pack runs the reference's bytes."""
    x = torch.randn(5000)
    assert not K.native_quantizes(x, 3, None, 4) and K.native_quantizes(x, 3, 1.0, 4)
    assert K.native_quantizes(x, 0, None, 8) and not K.native_quantizes(x, 0, None, 16)
    assert not K.native_quantizes(x.half(), 3, 1.0, 4)
    if native.unavailable("cpu") is None:
        segs = [(0, 5000)]
        assert torch.equal(K.quantize_pack(x, segs, 3, None, bits=4, impl="native"),
                           K.wire_of(K.quantize_q(x, segs, 3, None), 3, 4))
        assert torch.equal(K.quantize_pack(x.half(), segs, 3, 1.0, bits=4, impl="native"),
                           K.wire_of(K.quantize_q(x.half(), segs, 3, 1.0), 3, 4))


def test_a_cache_directory_others_may_write_to_is_refused(tmp_path, monkeypatch, fresh_native):
    """The library is loaded from the cache: a directory another user could plant a file in is refused,
    naming the fix, and a new one is made private (0700)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv(native.CACHE_ENV, str(shared))
    why = native.unavailable("cpu")
    assert why is not None and "writable by others" in why and native.CACHE_ENV in why
    assert not list(shared.iterdir())
    fresh = tmp_path / "fresh"
    native._private_dir(str(fresh))
    assert fresh.stat().st_mode & 0o777 == 0o700
