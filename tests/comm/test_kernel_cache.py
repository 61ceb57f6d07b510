"""comm.kernels=auto's measured choice is cached per host, device, torch version, threads, layout
and configuration (comm/kernel_probe.py): a second warm-up with the same key starts no timing
child, a changed key measures, and a damaged or foreign cache file is named, ignored and measured
again. The child is replaced by a fake `subprocess.run` that counts its starts."""
from __future__ import annotations

import json
import subprocess

import pytest
import torch

from comm import kernel_probe
from comm import kernels as K


def _layout(sizes):
    segs, off = [], 0
    for m in sizes:
        segs.append((off, m))
        off += m
    return segs


@pytest.fixture
def child(monkeypatch, tmp_path):
    """A fake timing child (counts its starts) and a private cache directory; auto state restored."""
    monkeypatch.setattr(K, "_auto", {})
    monkeypatch.setattr(K, "_auto_log", [])
    monkeypatch.setattr(K, "_rejected", {})
    monkeypatch.setattr(K, "_warmups", [])
    monkeypatch.delenv(kernel_probe.ENV, raising=False)
    monkeypatch.delenv("LIONCUB_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    starts = []
    real = subprocess.run

    def run(cmd, input=None, **kw):  # noqa: A002 - subprocess.run's own keyword
        if "comm.kernel_probe_child" not in cmd:  # another program (the native build's compiler)
            return real(cmd, input=input, **kw)
        req = json.loads(input)
        starts.append(req)
        n = sum(m for _, m in req["layout"])
        recs = [{"kernel": k, "device": "cpu", "n": n, "chosen": "eager", "ms": {"eager": 1.0, "compiled": 2.0},
                 "rejected": []} for k in ("sign_pack", "unpack_majority")]
        return subprocess.CompletedProcess(cmd, 0, json.dumps(recs) + "\n", "")

    monkeypatch.setattr(kernel_probe.subprocess, "run", run)
    monkeypatch.setattr(K, "use_compiled", lambda impl, device, kernel=None: True)  # auto's child path on any host
    return starts


def _warm(layout):
    K.warmup("cpu", world_sizes=(4,), impl="auto", layout=layout, repeats=1)
    return {r["kernel"]: r for r in K.auto_choices()}


def test_the_second_run_with_the_same_key_does_not_measure(child, tmp_path):
    layout = _layout([40_000, 999])
    first = _warm(layout)
    assert len(child) == 1 and "timed in a child process" in first["sign_pack"]["line"]
    files = list((tmp_path / "xdg" / "lioncub" / "kernels").glob("kernel_choice_*.json"))
    assert len(files) == 1
    second = _warm(layout)
    assert len(child) == 1  # no timing child started
    assert second["sign_pack"]["chosen"] == "eager" and second["sign_pack"]["ms"] == {"eager": 1.0, "compiled": 2.0}
    assert f"cached in {files[0]}" in second["sign_pack"]["line"]
    # a changed key measures: another layout size, another thread count
    _warm(_layout([40_000, 1000]))
    assert len(child) == 2
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        _warm(layout)
    finally:
        torch.set_num_threads(threads)
    assert len(child) == 3
    assert len(list(files[0].parent.glob("kernel_choice_*.json"))) == 3


@pytest.mark.parametrize("damage", ["truncate", "edit", "foreign", "garbage"])
def test_a_damaged_or_foreign_cache_file_is_named_and_measured_again(child, tmp_path, damage):
    layout = _layout([5000, 77])
    _warm(layout)
    (f,) = (tmp_path / "xdg" / "lioncub" / "kernels").glob("kernel_choice_*.json")
    doc = json.loads(f.read_text())
    if damage == "truncate":
        f.write_text(f.read_text()[:40])
    elif damage == "edit":  # the choice changed, the recorded sha256 not
        doc["records"][0]["chosen"] = "compiled"
        f.write_text(json.dumps(doc))
    elif damage == "foreign":  # a consistent file written on another host
        doc["key"]["host"] = "elsewhere"
        doc["sha256"] = kernel_probe._body_sha(doc["key"], doc["records"])
        f.write_text(json.dumps(doc))
    else:
        f.write_text("[1, 2, 3]")
    with pytest.warns(UserWarning, match=f"ignoring the cached kernel choice {f}"):
        recs = _warm(layout)
    assert len(child) == 2 and "timed in a child process" in recs["sign_pack"]["line"]
    assert recs["sign_pack"]["chosen"] == "eager"
    _warm(layout)  # re-measured and cached again, intact
    assert len(child) == 2


def test_the_cache_lives_in_the_users_cache_dir_and_can_be_switched_off(child, tmp_path, monkeypatch):
    assert kernel_probe.cache_dir() == str(tmp_path / "xdg" / "lioncub" / "kernels")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert kernel_probe.cache_dir() == str(tmp_path / "home" / ".cache" / "lioncub" / "kernels")
    monkeypatch.setenv(kernel_probe.CACHE_ENV, "off")
    layout = _layout([300])
    _warm(layout)
    _warm(layout)
    assert len(child) == 2 and not (tmp_path / "home" / ".cache").exists()


def test_an_in_process_measurement_is_cached_too(child, tmp_path, monkeypatch):
    """Where auto measures in the training process (CUDA; LIONCUB_KERNEL_PROBE=0 on CPU) its own
    choice is cached under the same key rules: the second warm-up times nothing."""
    monkeypatch.setenv(kernel_probe.ENV, "0")
    monkeypatch.setattr(K, "_check_candidate", lambda *a, **k: None)
    timed = []

    def measure(device, segs, **kw):
        timed.append(sum(m for _, m in segs))
        for k in ("sign_pack", "unpack_majority"):
            K._auto[(k, "cpu")] = "eager"
            K._auto_log.append({"kernel": k, "device": "cpu", "n": timed[-1], "chosen": "eager",
                                "ms": {"eager": 1.0, "compiled": 3.0}, "rejected": [], "line": ""})

    monkeypatch.setattr(K, "_measure", measure)
    layout = _layout([1234, 5678])
    first = _warm(layout)
    assert timed == [6912] and not child and "cached" not in first["sign_pack"]["line"]
    second = _warm(layout)
    assert timed == [6912] and not child  # nothing timed, no child started
    assert "measured by an earlier run on this host" in second["sign_pack"]["line"]
    _warm(_layout([1234, 5679]))  # another layout: measured
    assert timed == [6912, 6913]
