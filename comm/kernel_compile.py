"""comm.kernels' compiled-kernel machinery: whether a compiler exists, one code object per
(kernel body, static arguments), and the `Kernel` wrapper that compiles it and times its first call."""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import time
import types
from collections.abc import Callable

import torch

from . import native
from .kernel_bodies import INDUCTOR_OPTIONS, INDUCTOR_OPTIONS_EAGER_FLOAT_CUDA

NO_COMPILE_ENV = native.NO_COMPILE_ENV  # "LIONCUB_NO_COMPILE": neither compiled nor native kernels


def compile_unavailable(device: torch.device | str = "cpu") -> str | None:
    """Why torch.compile cannot build kernels for `device` here, or None when it can."""
    device = torch.device(device)
    if os.environ.get(NO_COMPILE_ENV, "0") not in ("", "0"):
        return f"{NO_COMPILE_ENV}={os.environ[NO_COMPILE_ENV]} is set"
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    if device.type == "cpu":
        cxx = os.environ.get("CXX")
        if not (shutil.which(cxx) if cxx else any(shutil.which(c) for c in ("g++", "c++", "clang++"))):
            return "no C++ compiler found (CXX, g++, c++, clang++) for inductor's CPU backend"
    elif device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "Triton is not installed (inductor's GPU backend)"
    else:
        return f"no compiled kernels for device type {device.type!r}"
    return None


def _plain(t: torch.Tensor) -> torch.Tensor:
    """t as a tensor of its own (no view base, storage offset 0) over the same memory.

    Dynamo specialises a view's storage offset on 0 / 1 / other and its base's size on 1 / other,
    so the views a step passes (parameter slices of a flat buffer) would compile up to 2**k
    graphs of a k-argument kernel, some inside a timed step, and past 8 run uncompiled. A DLPack
    round trip shares the memory (writes land in t) and costs a few microseconds."""
    if t.requires_grad:  # a parameter: the kernel writes its data, outside autograd
        t = t.detach()
    if t._base is None and t.storage_offset() == 0:
        return t
    return torch.from_dlpack(t)


class Kernel:
    """A traced function compiled once per device type with dynamic shapes; the first call per key
    (device type, dtypes: what its graph is specialised on) is timed (`seconds`)."""

    def __init__(self, name: str, fn: Callable, eager_float: bool = False) -> None:
        self.name, self.fn, self.eager_float = name, fn, eager_float
        self._compiled: dict[str, Callable] = {}  # per device type: an eager_float one differs on CUDA
        self.seconds: dict[tuple, float] = {}  # key -> seconds of its first (compiling) call

    def options(self, device_type: str) -> dict:
        """The inductor options this kernel compiles with on `device_type`."""
        return INDUCTOR_OPTIONS_EAGER_FLOAT_CUDA if self.eager_float and device_type == "cuda" else INDUCTOR_OPTIONS

    def __call__(self, key: tuple, *args):
        """key: (device type, what else the graph is specialised on)."""
        args = tuple(_plain(a) if isinstance(a, torch.Tensor) else a for a in args)
        run = self._compiled.get(key[0])
        if run is None:
            run = self._compiled[key[0]] = torch.compile(self.fn, dynamic=True, fullgraph=True,
                                                         options=self.options(key[0]))
        if key in self.seconds:
            return run(*args)
        devs = {a.device for a in args if isinstance(a, torch.Tensor) and a.device.type == "cuda"}
        for d in devs:  # compile-time bookkeeping only, never on a warm path
            torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        out = run(*args)
        for d in devs:
            torch.cuda.synchronize(d)
        self.seconds[key] = time.perf_counter() - t0
        return out


_BOUND_FN: Callable | None = None  # set in the globals of each copy of _bound (see compiled_kernel)


_BOUND_STATIC: tuple = ()


def _bound(*args):
    return _BOUND_FN(*args, *_BOUND_STATIC)


@functools.cache
def compiled_kernel(fn: Callable, *static) -> Kernel:
    """The compiled kernel of `fn` with its trailing arguments fixed to `static` (lane width,
    flags). Dynamo keeps its compiled graphs per code object, and a code object past 8 graphs
    runs uncompiled (or, with fullgraph, raises), so every static tuple gets a code object of
    its own, made once per process (this memo: dynamo's graphs hang off that code object, so a
    second copy would compile again); within it dynamic shapes make one graph per (device,
    dtypes) serve every length. Each is a renamed copy of `_bound`'s code with `fn` and `static`
    in globals of its own (globals, not a closure: dynamo specialises on a global's value, as it
    must for lane widths and bit patterns). The copy keeps this file as its source: some torch
    versions wrap a function with no source file (one made by exec) in one shared frame, which
    would put every kernel on one code object."""
    name = "bound_" + "_".join([fn.__name__.removeprefix("_k_")] + [str(s).replace("-", "m") for s in static])
    code = _bound.__code__.replace(co_name=name)  # a new code object, same file and line
    if hasattr(code, "co_qualname"):
        code = code.replace(co_qualname=name)
    scope = {"_BOUND_FN": fn, "_BOUND_STATIC": static, "__name__": __name__, "__builtins__": __builtins__}
    key = (fn.__name__.removeprefix("_k_"),) + static
    return Kernel("/".join(str(k) for k in key), types.FunctionType(code, scope, name), getattr(fn, "eager_float", False))


def dtype_key(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")
