"""comm.native: the build (torch.utils.cpp_extension; cached per source, toolchain and CPU), its failure modes, and the
dispatch around it. The bytes of every native kernel are checked in tests/comm/test_kernels.py (each
wire-kernel test runs on native too) and a distributed step in tests/workers/optim_dist.py."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from comm import kernels as K
from comm import native

ROOT = Path(__file__).resolve().parents[2]
needs_cc = pytest.mark.skipif(native._compiler() is None, reason="no C++ compiler")
needs_build = pytest.mark.skipif(native._compiler() is None or native._ninja_dir() is None,
                                 reason="no C++ compiler or no ninja")


@pytest.fixture
def fresh_native(monkeypatch):
    """comm.native as if never loaded in this process, restored after the test."""
    monkeypatch.setattr(native, "_loaded", False)
    monkeypatch.setattr(native, "_mod", None)
    monkeypatch.setattr(native, "_why", None)


@needs_build
def test_the_module_is_built_once_into_its_cache_and_reused(native_cache, monkeypatch, fresh_native):
    monkeypatch.setenv(native.CACHE_ENV, str(native_cache))
    assert native.unavailable("cpu") is None
    mods = list(native_cache.glob("lioncub_native_*/lioncub_native_*.so"))
    assert len(mods) == 1 and not list(native_cache.rglob("*.tmp")) and not list(native_cache.rglob("lock"))
    assert str(mods[0]) == native.library_path()
    mtime = mods[0].stat().st_mtime_ns
    # built with our flags after cpp_extension's own, and nothing that would change a float step
    (cflags,) = [ln.split()[2:] for ln in (mods[0].parent / "build.ninja").read_text().splitlines()
                 if ln.startswith("cflags =")]
    assert set(native.FLAGS) <= set(cflags) and "-ffast-math" not in cflags and "-Ofast" not in cflags
    assert [f for f in cflags if f.startswith("-O")][-1] == "-O3"
    assert [f for f in cflags if f.startswith("-ffp-contract")] == ["-ffp-contract=off"]
    assert "-march=native" in cflags and "-fno-math-errno" in cflags
    assert "#include <torch/extension.h>" not in native.SOURCE
    # another process with the same cache imports that file: it builds nothing (no cpp_extension)
    code = ("import sys; from comm import native; assert native.unavailable() is None; "
            "import torch; o = torch.empty(1, dtype=torch.uint8); native.sign_bits(torch.ones(8), True, o); "
            "assert int(o) == 255; assert 'torch.utils.cpp_extension' not in sys.modules")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, native.CACHE_ENV: str(native_cache)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert [p.stat().st_mtime_ns for p in native_cache.glob("lioncub_native_*/lioncub_native_*.so")] == [mtime]


def test_the_toolchain_is_the_one_cpp_extension_builds_with(monkeypatch):
    """comm.native names cpp_extension's compiler and module suffix without importing it (a loaded
    module costs no setuptools import): the two agree."""
    from torch.utils import cpp_extension

    assert native.LIB_EXT == cpp_extension.LIB_EXT
    for cxx in (None, "g++", "/nonexistent/c++-for-test"):
        if cxx is None:
            monkeypatch.delenv("CXX", raising=False)
        else:
            monkeypatch.setenv("CXX", cxx)
        assert native._compiler() == shutil.which(cpp_extension.get_cxx_compiler())


def test_no_compiler_or_no_compile_names_the_reason(monkeypatch, fresh_native):
    monkeypatch.setenv("CXX", "/nonexistent/c++-for-test")
    monkeypatch.setattr(native.shutil, "which", lambda c, *a, **k: None)
    why = native.unavailable("cpu")
    assert why is not None and "no C++ compiler" in why
    x = torch.randn(1000)
    with pytest.raises(RuntimeError, match=r"impl='native'.*no C\+\+ compiler"):
        K.sign_pack(x, 1, impl="native")
    monkeypatch.setattr(native, "_loaded", False)
    monkeypatch.setattr(native, "_why", None)
    monkeypatch.setattr(native, "SOURCE", None)  # installed without native_kernels.cpp
    assert f"{native.SOURCE_FILE} is missing" in native.unavailable("cpu")
    monkeypatch.setattr(native, "_loaded", False)
    monkeypatch.setattr(native, "_why", None)
    monkeypatch.setenv(native.NO_COMPILE_ENV, "1")
    assert "LIONCUB_NO_COMPILE=1" in native.unavailable("cpu")
    assert "CPU only" in native.unavailable("cuda")


@needs_cc
def test_ninja_comes_from_path_or_its_package_and_its_absence_is_named(monkeypatch, fresh_native):
    real = shutil.which
    no_path = lambda c, *a, path=None, **k: None if c == "ninja" and path is None else real(c, *a, path=path, **k)  # noqa: E731
    monkeypatch.setattr(native.shutil, "which", no_path)
    try:
        import ninja
    except ImportError:
        pass
    else:  # not on PATH (a venv's python run without activating it): the package's binary
        assert native._ninja_dir() == ninja.BIN_DIR and real("ninja", path=ninja.BIN_DIR)
    monkeypatch.setitem(sys.modules, "ninja", None)  # the package missing too
    assert native._ninja_dir() is None
    why = native.unavailable("cpu")
    assert why is not None and "no ninja found" in why and "pip install ninja" in why


@needs_build
def test_a_failing_build_reports_the_compiler_error(tmp_path, monkeypatch, fresh_native):
    monkeypatch.setenv(native.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(native, "SOURCE", native.SOURCE + "\nthis is not C;\n")
    why = native.unavailable("cpu")
    assert why is not None and "building the native kernels" in why and "error" in why
    assert not list(tmp_path.rglob("*.so")) and not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob("lock"))


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
