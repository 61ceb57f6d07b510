"""tests/dist.py's launcher: a rank forked from a zygote (tests/zygote.py) behaves as `python script.py`
started fresh; a launch that sets a variable torch reads at import gets ranks that imported torch with it."""
import json
import os
import signal
import threading
import time

import pytest

from tests import dist
from tests.dist import torchrun


def _records(proc) -> list[dict]:
    return sorted((json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")), key=lambda r: r["rank"])


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")
def test_forked_ranks_look_like_fresh_processes(monkeypatch):
    monkeypatch.delenv("LIONCUB_TEST_FORK", raising=False)
    forked = _records(torchrun(2, "launch_probe.py", "0", env={"LAUNCH_PROBE": "x"}))
    monkeypatch.setenv("LIONCUB_TEST_FORK", "0")
    plain = _records(torchrun(2, "launch_probe.py", "0", env={"LAUNCH_PROBE": "x"}))
    assert [r["torch_preloaded"] for r in forked] == [True, True]   # the zygote served them...
    assert [r["torch_preloaded"] for r in plain] == [False, False]  # ...and LIONCUB_TEST_FORK=0 turns it off
    for f, p in zip(forked, plain):
        for key in ("rank", "name", "argv", "path0", "cwd", "probe"):
            assert f[key] == p[key], key
    assert forked[0]["name"] == "__main__" and forked[0]["path0"] == str(dist.WORKERS) and forked[0]["probe"] == "x"
    # ranks of one launch differ in str hash order (one zygote per rank index) and in random state
    assert forked[0]["hash"] != forked[1]["hash"] and forked[0]["random"] != forked[1]["random"]
    # the zygote's environment does not leak into a rank: a variable the request leaves out is absent
    monkeypatch.delenv("LIONCUB_TEST_FORK")
    again = _records(torchrun(2, "launch_probe.py", "0"))
    assert [r["probe"] for r in again] == [None, None] and again[0]["torch_preloaded"]
    # a second launch from the same zygotes still draws new random numbers
    assert again[0]["random"] != forked[0]["random"]


def test_exit_codes_errors_and_signals_are_reported_as_for_a_process(tmp_path):
    assert torchrun(2, "launch_probe.py", "3", check=False).returncode == 3
    proc = torchrun(2, "launch_probe.py", "raise", check=False)
    assert proc.returncode == 1 and "RuntimeError: probe asked to fail" in proc.stderr
    with pytest.raises(AssertionError, match=r"launch_probe.py x2 failed \(rc=5\)"):
        torchrun(2, "launch_probe.py", "5")
    # a rank stopped by SIGTERM reports -15, as Popen does
    pid_file = tmp_path / "pid"
    result = {}
    t = threading.Thread(target=lambda: result.update(
        proc=torchrun(1, "launch_probe.py", "sleep", str(pid_file), check=False, timeout=90)))
    t.start()
    deadline = time.monotonic() + 60
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(int(pid_file.read_text()), signal.SIGTERM)
    t.join(90)
    assert result["proc"].returncode == -signal.SIGTERM


def test_a_launch_that_sets_a_torch_import_variable_gets_ranks_that_imported_torch_with_it():
    """ATEN_CPU_CAPABILITY is read when torch is imported: the ranks must run torch's default kernels, which
    a zygote that imported torch without it cannot give (they are plain processes); the zygotes of the
    ordinary launches stay, and the next ordinary launch is forked from them again."""
    before = _records(torchrun(2, "launch_probe.py", "0"))
    forced = _records(torchrun(2, "launch_probe.py", "0", env={"ATEN_CPU_CAPABILITY": "default"}))
    assert [r["cpu_capability"] for r in forced] == ["DEFAULT", "DEFAULT"]
    normal = _records(torchrun(2, "launch_probe.py", "0"))
    import torch
    assert [r["cpu_capability"] for r in normal] == [torch.backends.cpu.get_cpu_capability()] * 2
    if os.environ.get("LIONCUB_TEST_FORK", "1") != "0":
        assert [r["torch_preloaded"] for r in forced] == [False, False]
        assert [r["torch_preloaded"] for r in normal] == [True, True]
        assert [r["hash"] for r in normal] == [r["hash"] for r in before]  # the same zygotes (hash seed per zygote)


def test_a_variable_torch_compile_sets_in_the_test_process_keeps_the_zygotes(monkeypatch):
    """torch.compile in the pytest process sets TORCHINDUCTOR_CACHE_DIR there, which every later launch
    inherits; it is read only when compiling, so the ranks are still forked."""
    if os.environ.get("LIONCUB_TEST_FORK", "1") == "0":
        pytest.skip("LIONCUB_TEST_FORK=0")
    first = _records(torchrun(2, "launch_probe.py", "0"))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/torchinductor_launch_probe")
    second = _records(torchrun(2, "launch_probe.py", "0"))
    assert [r["torch_preloaded"] for r in second] == [True, True]
    assert [r["hash"] for r in second] == [r["hash"] for r in first]  # the same zygotes (hash seed per zygote)
