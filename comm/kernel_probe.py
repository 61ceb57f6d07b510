"""comm.kernels=auto's measurement on CPU, in a child process.

Timing the compiled candidate means importing inductor and compiling, which costs a process
60-150 MiB of RSS that it keeps (measured: torch 220 MiB; + sympy, dynamo and inductor's
compile_fx 120 MiB of imports; + the compiled code), whatever the model size. So on CPU
`comm.kernels.warmup` under auto asks a child: `python -m comm.kernel_probe` runs the same
warm-up (byte checks of every candidate, then `choose` on the run's real layout, at the parent's
thread count; `python -m comm.kernel_probe_child`, apart so that this module imports nothing of
comm.kernels) and prints the records of its choices as JSON; the parent adopts them and then
builds and checks only the candidates that won. A rank imports inductor only where a compiled
kernel was fastest. Inductor's on-disk cache makes the parent's compile of a kernel the child
compiled a cache hit.

LIONCUB_KERNEL_PROBE=0 measures in the training process instead (the child is then never
started); a child that fails is reported with its error and the measurement runs in-process; a
child killed by a signal (`ChildCrashed`) never leads to loading the native library it may have
crashed on: comm.kernels.warmup names the file and leaves native out in this process.

The child's answer (and an in-process measurement's: CUDA, or LIONCUB_KERNEL_PROBE=0, through
comm.kernels.warmup) is cached per host, device (CPU model and flags; GPU model, capability and
CUDA version), torch version, thread count,
layout and warm-up configuration (`cache_key`), one JSON file per key in the user's cache
directory ($LIONCUB_KERNEL_CACHE, else $XDG_CACHE_HOME/lioncub/kernels, else
~/.cache/lioncub/kernels; LIONCUB_KERNEL_CACHE=off disables it), so only the first run on a host
measures. Like the native library's cache (comm/native.py) the file records a sha256 of its
contents; a file that does not match it, is unreadable, or holds another key is named in a
warning, removed and measured again. A cached choice is only a choice: the parent still builds
and byte-checks what it follows, and the ranks still agree on one (comm.kernels.agree_choices).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
import warnings

import torch

ENV = "LIONCUB_KERNEL_PROBE"  # "0": measure in-process; "child": set in the child itself
TIMEOUT_S = 300  # under comm.timeout_s's default (600): the other ranks wait in the agreement meanwhile
CACHE_ENV = "LIONCUB_KERNEL_CACHE"  # a directory, or "off"
CACHE_VERSION = 1  # bump when a record's meaning changes: older files then miss


def inside() -> bool:
    """Whether this process is a probe child, or probing is switched off (measure here)."""
    return os.environ.get(ENV, "1") in ("0", "child")


def _enc(v):
    if isinstance(v, float) and math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if isinstance(v, torch.dtype):
        return str(v).removeprefix("torch.")
    return v


def _dec_p(v):
    return float(v) if isinstance(v, str) else v


class ChildCrashed(RuntimeError):
    """The probe child was killed by a signal (SIGBUS, SIGSEGV: a damaged library, a crashing kernel)."""

    def __init__(self, signum: int, stderr: str) -> None:
        super().__init__(f"killed by signal {signum}" + (f" ({stderr})" if stderr else ""))
        self.signum = signum


def cache_dir() -> str | None:
    """Where measured choices are kept (None: caching is off)."""
    own = os.environ.get(CACHE_ENV)
    if own:
        return None if own.lower() in ("0", "off", "none") else own
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "lioncub", "kernels")


def _device_id() -> str:
    """The CPU the timings were taken on: its model and flags (a cache copied to another host kind misses)."""
    from . import native  # the CPU flags that key the native library's cache key this one as well

    return hashlib.sha256(f"{platform.machine()}\0{platform.processor()}\0{native._cpu_flags()}".encode()).hexdigest()


def _gpu_id(device: torch.device) -> str:
    """A GPU's model, compute capability and the CUDA build the kernels were compiled for."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"{device.type} {torch.cuda.get_device_name(device)} sm{major}{minor} cuda {torch.version.cuda}"


def request(layout: list[tuple[int, int]], cfg: dict) -> dict:
    """The measurement's request (what the child reads): layout, thread count, encoded configuration."""
    return {"layout": layout, "threads": torch.get_num_threads(),
            "cfg": {k: [_enc(x) for x in v] if isinstance(v, (tuple, list)) else _enc(v) for k, v in cfg.items()}}


def cache_key(request: dict, device: torch.device | str = "cpu") -> dict:
    """What a measurement depends on: host, device, torch version, threads, layout, configuration."""
    device = torch.device(device)
    return {"version": CACHE_VERSION, "host": socket.gethostname(),
            "device": "cpu " + _device_id() if device.type == "cpu" else _gpu_id(device),
            "torch": torch.__version__, "threads": request["threads"],
            "layout": hashlib.sha256(json.dumps(request["layout"]).encode()).hexdigest(),
            "numel": sum(int(m) for _, m in request["layout"]), "cfg": request["cfg"]}


def _body_sha(key: dict, records: list) -> str:
    return hashlib.sha256(json.dumps({"key": key, "records": records}, sort_keys=True).encode()).hexdigest()


def cache_file(key: dict) -> str | None:
    d = cache_dir()
    if d is None:
        return None
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return os.path.join(d, f"kernel_choice_{name}.json")


def cached(key: dict) -> list[dict] | None:
    """The records cached for `key`, or None (a damaged or foreign file: a warning naming it, removed)."""
    path = cache_file(key)
    if path is None or not os.path.exists(path):
        return None
    problem = ""
    try:
        with open(path) as f:
            doc = json.load(f)
        if not (isinstance(doc, dict) and isinstance(doc.get("records"), list) and isinstance(doc.get("key"), dict)):
            problem = "not a cache record"
        elif doc.get("sha256") != _body_sha(doc["key"], doc["records"]):
            problem = "its contents do not match the sha256 recorded with them (truncated or altered)"
        elif doc["key"] != key:
            problem = "it was written for another host, device, torch version or layout"
        elif not all(isinstance(r, dict) and "chosen" in r and "kernel" in r for r in doc["records"]):
            problem = "its records are not choice records"
    except (OSError, ValueError) as e:
        problem = f"unreadable ({type(e).__name__}: {str(e)[:120]})"
    if problem:
        warnings.warn(f"kernels: ignoring the cached kernel choice {path}: {problem}; measuring again", stacklevel=3)
        try:
            os.unlink(path)
        except OSError:
            pass
        return None
    return doc["records"]


def store(key: dict, records: list[dict]) -> None:
    """Write the records for `key` atomically (temp file + rename); a cache that cannot be written is
    a warning, never an error (the next run measures again)."""
    path = cache_file(key)
    if path is None:
        return
    records = [{k: v for k, v in r.items() if k not in ("line", "agreed")} for r in records]
    doc = {"key": key, "records": records, "sha256": _body_sha(key, records)}
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, path)
    except OSError as e:
        warnings.warn(f"kernels: could not cache the kernel choice in {path} ({e}); the next run measures again",
                      stacklevel=3)


def measure(layout: list[tuple[int, int]], cfg: dict) -> list[dict] | None:
    """Run the auto measurement for `layout` and the warm-up configuration `cfg` (comm.kernels.warmup's
    keywords) in a child process; its choice records, or None (with a warning naming the error)
    when the child failed. A measurement cached for the same key (`cache_key`) is returned instead,
    its records marked "cached" with the file's path; no child is started."""
    req = request(layout, cfg)
    key = cache_key(req)
    hit = cached(key)
    if hit is not None:
        for rec in hit:
            rec["probe"], rec["cached"] = True, cache_file(key)
        return hit
    env = dict(os.environ, **{ENV: "child"})
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    try:  # the child runs comm/kernel_probe_child.py (which imports comm.kernels: no import back from here)
        done = subprocess.run([sys.executable, "-m", "comm.kernel_probe_child"], input=json.dumps(req),
                              capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        warnings.warn(f"kernels: the auto measurement's child process failed ({e}); measuring in this "
                      f"process", stacklevel=3)
        return None
    lines = done.stdout.strip().splitlines()
    if done.returncode < 0:  # killed by a signal: what crashed it must not be loaded in this process
        raise ChildCrashed(-done.returncode, done.stderr.strip()[-500:])
    if done.returncode != 0 or not lines:
        warnings.warn(f"kernels: the auto measurement's child process exited with {done.returncode}: "
                      f"{done.stderr.strip()[-1500:]}; measuring in this process", stacklevel=3)
        return None
    try:
        records = json.loads(lines[-1])
        if not isinstance(records, list) or not all(isinstance(r, dict) and "chosen" in r for r in records):
            raise ValueError("not a list of choice records")
    except ValueError as e:  # something else wrote to stdout: measure here rather than guess
        warnings.warn(f"kernels: the auto measurement's child process answered {lines[-1][:200]!r} ({e}); "
                      f"measuring in this process", stacklevel=3)
        return None
    for rec in records:
        rec["probe"] = True  # the caller (comm.kernels.warmup) adds each record's line
    store(key, records)
    return records
