"""Native CPU kernels: the wire kernels of comm.kernels as plain C loops (comm/native_kernels.cpp),
built once per host by torch.utils.cpp_extension into a small pybind11 module.

They are the CPU's fast implementation (what `comm.kernels=auto` runs on CPU, beside the eager
torch reference): the same bytes (checked against the reference in warm-up and by the tests), no
Python compiler stack in the training process (inductor's imports and compiled code cost RSS per
process whatever the model size: docs/fast_path.md), and one small build per host instead of a
compile per kernel.

Kernels (each one pass over its input, no temporary):
    sign_bits      tb(x, step) flags -> packed bits              (== comm.vote.tb_packed's bytes)
    majority       P packed chunks -> packed majority with tie break (== comm.vote.local_majority)
    quant_blocks   Lion Cub eq. 1 of whole QBLOCK blocks, nearest or stochastic rounding, straight
                   into `bits`-wide lanes (== comm.kernels._k_quant_blocks / _k_quant_blocks_stoch)
    tb_lanes       the levels == 0 wire (== comm.kernels._k_tb_lanes)
    unpack_sign    summed wire -> int8 sign of the sum over P ranks (== sign(unpack_sum_reference))

Exactness: the float steps are the reference's, in its order and precision (x converted to the
scale's dtype, one multiply, round half to even or floor + compare, clamp), compiled with
-ffp-contract=off so no multiply and subtract fuse into an fma, and without -ffast-math. A NaN
y converts to the int8 q the reference's float -> int8 conversion gives (0: through int32, where
x86's cvttps2dq gives INT32_MIN, whose low byte is 0); an inf in a tensor makes its scale 0 and
that element's y NaN, so this is reached by an overflowing gradient (tested).

Build: torch.utils.cpp_extension.load compiles native_kernels.cpp (C kernel bodies in a C++
translation unit that includes <pybind11/pybind11.h>, not torch/extension.h, which would cost a
build of minutes) with ninja (from PATH, else the `ninja` package, a dependency of the project) and
the C++ compiler cpp_extension uses ($CXX, else c++). cpp_extension adds -fPIC, its -std=c++ and
include paths and no optimisation flag of its own; FLAGS come after them: -O3 -march=native
-ffp-contract=off -fno-math-errno. The bindings take the tensors' data pointers as integers and
their sizes, as the C functions do, and release the GIL while a loop runs.

Cache: each build has a directory of its own in LIONCUB_NATIVE_CACHE (default
<tempdir>/lioncub_native_<uid>, private to the user), named by a key of the source, FLAGS, the
compiler and its version, torch's version and directory, Python's version and the host's CPU flags,
so a host builds each combination once. One process at a time holds an flock on the directory's
lioncub.lock while it checks, builds and imports the module; concurrent ranks wait for it and then
import the finished file. The build records the module's sha256 beside it (`<module>.sha256`).
Before any import an existing module is checked against it: one that matches is imported as it is
(no cpp_extension, hence no setuptools, in the process; ninja would find it up to date, since the
key names everything it was built from); one that differs (truncated: mapping it would end the
process with SIGBUS; altered; or with nothing recorded) is named in a warning, removed and rebuilt
(ninja relinks it from the object file), never loaded. A cpp_extension baton file found under the
flock was left by a process killed mid-build (it would make every later build wait forever) and is
removed.
LIONCUB_NO_COMPILE=1 turns them off with the compiled kernels.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import warnings

import torch

CACHE_ENV = "LIONCUB_NATIVE_CACHE"
NO_COMPILE_ENV = "LIONCUB_NO_COMPILE"  # comm.kernels.NO_COMPILE_ENV: no kernel is built
QBLOCK = 1024  # elements per quantizer block, comm.kernels.QBLOCK's one definition (passed as -DQBLOCK)
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", f"-DQBLOCK={QBLOCK}"]
SOURCE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native_kernels.cpp")
try:
    with open(SOURCE_FILE) as _f:
        SOURCE: str | None = _f.read()
except OSError:  # an install without the package data: a reason in unavailable(), not an import error
    SOURCE = None
LOCK = "lioncub.lock"  # the flock of a build directory (cpp_extension's own baton file is "lock")
LIB_EXT = ".pyd" if os.name == "nt" else ".so"  # torch.utils.cpp_extension.LIB_EXT, the module's suffix

_mod = None  # the built module
_why: str | None = None
_loaded = False


def _compiler() -> str | None:
    """The C++ compiler torch.utils.cpp_extension builds with (its get_cxx_compiler: $CXX, else c++),
    as a path; None when missing. (Read here, not imported: a process that loads a built module
    never imports cpp_extension, which brings setuptools.)"""
    return shutil.which(os.environ.get("CXX", "c++"))


def _ninja_dir() -> str | None:
    """"" when ninja is on PATH, else the directory of the ninja package's binary; None when neither."""
    if shutil.which("ninja"):
        return ""
    try:
        import ninja
    except ImportError:
        return None
    d = getattr(ninja, "BIN_DIR", "")
    return d if d and shutil.which("ninja", path=d) else None


@contextlib.contextmanager
def _ninja_on_path(d: str):
    """PATH with d in front while cpp_extension runs `ninja` (it looks only on PATH)."""
    old = os.environ.get("PATH")
    if d:
        os.environ["PATH"] = d + os.pathsep + (old or "")
    try:
        yield
    finally:
        if d:
            if old is None:
                os.environ.pop("PATH", None)
            else:
                os.environ["PATH"] = old


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def _private_dir(d: str) -> str:
    """d, created with mode 0700 if missing, refused unless this user owns it and nobody else may
    write to it: a module is loaded from it, so another local user must not be able to plant one."""
    os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.stat(d)
    if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        raise RuntimeError(f"the native kernels' cache {d} is owned by uid {st.st_uid} or writable by others "
                           f"(mode {oct(st.st_mode & 0o777)}); remove it or set {CACHE_ENV} to a directory of "
                           f"your own")
    return d


def cache_dir() -> str:
    """Where the module is built: $LIONCUB_NATIVE_CACHE, else one directory per user in the temp dir."""
    user = os.getuid() if hasattr(os, "getuid") else 0
    return os.environ.get(CACHE_ENV) or os.path.join(tempfile.gettempdir(), f"lioncub_native_{user}")


def _located() -> tuple[str, str, str, str]:
    """(compiler, ninja's directory ("" on PATH), build directory, module name) of this source,
    toolchain, torch and CPU; nothing is built."""
    if SOURCE is None:
        raise RuntimeError(f"the native kernels' source {SOURCE_FILE} is missing (installed without the "
                           f"package's data files); reinstall the project")
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found ($CXX, else c++: the one torch.utils.cpp_extension builds with)")
    ninja_dir = _ninja_dir()
    if ninja_dir is None:
        raise RuntimeError("no ninja found (on PATH, or the ninja package: pip install ninja, a dependency of "
                           "this project) to build with torch.utils.cpp_extension")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, errors="replace").stdout
    key = hashlib.sha256("\0".join([SOURCE, cxx, version, " ".join(FLAGS), torch.__version__,
                                    os.path.dirname(torch.__file__), sys.version, platform.machine(),
                                    _cpu_flags()]).encode()).hexdigest()[:20]
    name = f"lioncub_native_{key}"
    return cxx, ninja_dir, os.path.join(cache_dir(), name), name


def library_path() -> str:
    """The module file the native kernels are (or would be) loaded from here ("" without a compiler
    or ninja)."""
    try:
        _, _, d, name = _located()
    except (RuntimeError, OSError):
        return ""
    return os.path.join(d, name + LIB_EXT)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _verified(so: str) -> bool:
    """Whether `so` exists and matches the sha256 recorded beside it (`<so>.sha256`) when it was
    built. A damaged one (a truncated file kills the process that maps it with SIGBUS; an altered
    one runs other code) is named in a warning and removed, to be rebuilt."""
    if not os.path.exists(so):
        return False
    try:
        with open(so + ".sha256") as f:
            recorded = f.read().strip()
        ok = recorded == _sha256(so)
    except OSError:
        ok = False
    if not ok:
        warnings.warn(f"native kernels: {so} does not match the sha256 recorded when it was built (truncated, "
                      f"altered, or built by an older version); rebuilding it", stacklevel=4)
        for path in (so, so + ".sha256"):
            if os.path.exists(path):
                os.unlink(path)
    return ok


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def _record(so: str) -> None:
    fd, tmp = tempfile.mkstemp(suffix=".sha256.tmp", dir=os.path.dirname(so))
    with os.fdopen(fd, "w") as f:
        f.write(_sha256(so))
    os.replace(tmp, so + ".sha256")


@contextlib.contextmanager
def _locked(path: str):
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when the process ends, however it ends
        yield
    finally:
        os.close(fd)


def _import(name: str, path: str):
    """The extension module at path, imported under name (as cpp_extension.load imports what it built)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _build():
    cxx, ninja_dir, d, name = _located()
    _private_dir(cache_dir())
    _private_dir(d)
    so = os.path.join(d, name + LIB_EXT)
    with _locked(os.path.join(d, LOCK)):
        if _verified(so):  # built before, from what the key names: ninja would find it up to date
            return _import(name, so)
        from torch.utils import cpp_extension

        baton = os.path.join(d, "lock")
        if os.path.exists(baton):  # nobody holds it while we hold the flock: a killed build's leftover
            os.unlink(baton)
        src = os.path.join(d, "native_kernels.cpp")  # in the directory: one path (and mtime) for ninja
        if _read(src) != SOURCE:
            with open(src, "w") as f:
                f.write(SOURCE)
        # cpp_extension renames a module it was asked to load again in this process with other
        # inputs (name_v1, ...): forget it, so the name stays the key's and ninja alone decides
        cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(name, None)
        try:
            with _ninja_on_path(ninja_dir):
                mod = cpp_extension.load(name, [src], extra_cflags=FLAGS, build_directory=d, verbose=False)
        except Exception as e:
            raise RuntimeError(f"building the native kernels with {cxx} (torch.utils.cpp_extension) failed:\n"
                               f"{str(e)[-2000:]}") from e
        _record(so)
    return mod


def unavailable(device: torch.device | str = "cpu") -> str | None:
    """Why the native kernels cannot run on `device` here, or None when they can (built and loaded
    on the first call)."""
    global _mod, _why, _loaded
    if torch.device(device).type != "cpu":
        return f"native kernels run on the CPU only, not on {torch.device(device).type}"
    if os.environ.get(NO_COMPILE_ENV, "0") not in ("", "0"):  # builds nothing, as for inductor
        return f"{NO_COMPILE_ENV}={os.environ[NO_COMPILE_ENV]} is set"
    if not _loaded:
        _loaded = True
        try:
            _mod = _build()
        except Exception as e:  # any failure is a reason, never a silent "available" with no module
            _why = f"{type(e).__name__}: {e}" if not isinstance(e, RuntimeError) else str(e)
    return _why


def _need():
    why = unavailable("cpu")
    if why is not None:
        raise RuntimeError(f"native kernels: {why}; use comm.kernels=eager or compiled")
    return _mod


_SUFFIX = {torch.float32: "f32", torch.float64: "f64", torch.bfloat16: "bf16"}


def supports(x: torch.Tensor) -> bool:
    """Whether the native kernels take x's dtype (float32, float64, bfloat16) on its device."""
    return x.device.type == "cpu" and x.dtype in _SUFFIX


def _ptr(t: torch.Tensor) -> int:
    if not t.is_contiguous():
        raise ValueError("native kernels: tensors must be contiguous")
    return t.data_ptr()


def sign_bits(x: torch.Tensor, odd: bool, out: torch.Tensor) -> None:
    """out[j] (uint8) = packed tb flags of x[8j:8j+8], for j < out.numel() (x holds 8 per byte)."""
    getattr(_need(), f"sign_bits_{_SUFFIX[x.dtype]}")(_ptr(x), out.numel(), int(odd), _ptr(out))


def tb_lanes(x: torch.Tensor, odd: bool, bits: int, out: torch.Tensor) -> None:
    """out[w] = the levels == 0 lanes of x[w*per:(w+1)*per] (per = 8 // bits), bits in 1, 2, 4, 8."""
    getattr(_need(), f"tb_lanes_{_SUFFIX[x.dtype]}")(_ptr(x), out.numel(), int(odd), bits, _ptr(out))


def majority(recv: torch.Tensor, P: int, thr: int, out: torch.Tensor) -> None:
    """out[c] = majority bits over the P rows of recv (uint8[P * c]) with threshold thr."""
    _need().majority(_ptr(recv), P, out.numel(), thr, _ptr(out))


def quant_blocks(x: torch.Tensor, scale: torch.Tensor, levels: int, bits: int, out: torch.Tensor,
                 u: torch.Tensor | None = None) -> None:
    """Lion Cub eq. 1 of x's whole QBLOCK blocks (block b with scale[b], float64 for float64 x,
    else float32) into `bits`-wide lanes of out; u: the uniforms of stochastic rounding (one per
    element, the scale's dtype), None for round half to even."""
    m = _need()
    nb = x.numel() // QBLOCK
    sfx = _SUFFIX[x.dtype]
    if u is None:
        getattr(m, f"quant_{sfx}")(_ptr(x), nb, _ptr(scale), levels, bits, _ptr(out))
    else:
        getattr(m, f"quant_stoch_{sfx}")(_ptr(x), nb, _ptr(scale), _ptr(u), levels, bits, _ptr(out))


def unpack_sign(wire: torch.Tensor, bits: int, mul: int, offset: int, out: torch.Tensor) -> None:
    """out (int8) = sign(mul * lane - offset) of every lane of wire's whole words (uint8, or int32
    words of two 16-bit lanes)."""
    _need().unpack_sign(_ptr(wire), wire.numel(), bits, mul, offset, _ptr(out))


__all__ = ["CACHE_ENV", "cache_dir", "library_path", "majority", "quant_blocks", "sign_bits", "supports",
           "tb_lanes", "unavailable", "unpack_sign"]
