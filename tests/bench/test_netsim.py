"""bench.netsim: rate limits are real, exit codes and timeouts propagate, and nothing is left behind.

The multi-namespace tests need root and iproute2 (`ip netns`, `tc`); they skip with the reason
otherwise (CI runs as root and installs iproute2).
"""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from bench import netsim
from tests.dist import ROOT, WORKERS

SKIP_REASON = netsim.unavailable_reason(need_tc=True)
needs_netsim = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

ENV = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TORCH_CPP_LOG_LEVEL": "ERROR"}


def _ours(tag: str) -> list[str]:
    return [ns for ns in netsim.list_namespaces() if f"_{tag}_" in ns]


def _root_links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":")[1].strip().split("@")[0] for line in out.splitlines()}


def test_parse_rate_and_burst() -> None:
    assert netsim.parse_rate("1gbit") == 1e9
    assert netsim.parse_rate("100mbit") == 1e8
    assert netsim.parse_rate("2.5gbit") == 2.5e9
    assert netsim.parse_rate("unlimited") is None
    with pytest.raises(ValueError, match="1gbit"):
        netsim.parse_rate("1GB/s")
    # the recipe: burst >= 128kb at 1gbit and 64kb at 100mbit, growing with the rate.
    assert netsim.default_burst(1e9) == 128 * 1024
    assert netsim.default_burst(1e8) == 64 * 1024
    assert netsim.default_burst(1e10) >= 1e10 / 8 * 1e-3
    assert netsim.parse_bytes("128kb") == 131072


def test_refuses_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(netsim.NetsimUnavailable, match="root.*1000"):
        netsim.check_available()
    assert netsim.main(["--nproc", "2", "--", "true"]) == 2


def test_refuses_without_ip(monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() != 0:
        pytest.skip("the root check fires first when not root")
    monkeypatch.setattr(netsim.shutil, "which", lambda name: None)
    with pytest.raises(netsim.NetsimUnavailable, match="iproute2"):
        netsim.check_available()


@needs_netsim
def test_rate_limited_allreduce_and_teardown(tmp_path) -> None:
    """2 ranks at 100mbit: a 2.5 MB fp32 allreduce takes about what the rate allows, then all is gone."""
    links_before = _root_links()
    n = 625_000                                   # 2.5 MB of fp32
    rate = 100e6
    # Ring allreduce at P ranks: each rank sends (and receives) 2 (P-1)/P * N*4 bytes over its link.
    ideal = 2 * (2 - 1) / 2 * n * 4 * 8 / rate   # 0.2 s
    codes = netsim.run(2, [sys.executable, str(WORKERS / "netsim_allreduce.py"), str(tmp_path), str(n)],
                       rate="100mbit", timeout=60, env=ENV, cwd=ROOT, tag="tnsar", stream=io.StringIO())
    assert codes == [0, 0]
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["ifname"] for r in res] == ["nsv0", "nsv1"]
    assert res[1]["master"] == "10.213.0.1"
    for r in res:
        # Not faster than the link allows (the limit is real) and not pathologically slower.
        assert 0.8 * ideal <= r["seconds"] <= 2.5 * ideal, (r, ideal)
    assert _ours("tnsar") == [], "namespaces left behind"
    assert _root_links() == links_before, "links left in the root namespace"


@needs_netsim
def test_exit_codes_timeout_env_and_rate_change(tmp_path) -> None:
    out = io.StringIO()
    with netsim.Netsim(3, "unlimited", tag="tnsrc") as net:
        assert len(_ours("tnsrc")) == 4          # switch + 3 ranks
        env_dump = 'echo "$RANK $WORLD_SIZE $MASTER_ADDR $GLOO_SOCKET_IFNAME $NETSIM_RATE_BPS"; test "$RANK" != 2 || exit 3'
        assert net.run(["sh", "-c", env_dump], timeout=20, stream=out) == [0, 0, 3]
        assert "[r2] 2 3 10.213.0.1 nsv2 0" in out.getvalue()
        assert "[r0] 0 3 10.213.0.1 nsv0 0" in out.getvalue()
        # A rank that fails makes the others be killed after the grace period, not hang forever.
        codes = net.run(["sh", "-c", 'test "$RANK" = 0 && exit 5; sleep 30'], timeout=60, fail_grace=0.5,
                        stream=out)
        assert codes[0] == 5 and all(c != 0 for c in codes[1:]), codes
        assert net.run(["sleep", "30"], timeout=0.5, stream=out) == [netsim.TIMEOUT_RC] * 3
        # Loopback is up inside each namespace, and the rate can change between runs.
        lo_check = ("import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); "
                    "socket.create_connection(s.getsockname(), timeout=2)")
        assert net.run([sys.executable, "-c", lo_check], timeout=20, stream=out) == [0, 0, 0], out.getvalue()
        net.set_rate("1gbit")
        qd = subprocess.run(["tc", "-n", net.switch_ns, "qdisc", "show", "dev", "nsp1"],
                            capture_output=True, text=True).stdout
        assert "tbf" in qd and "1Gbit" in qd, qd
        qd = subprocess.run(["tc", "-n", net.rank_ns[1], "qdisc", "show", "dev", "nsv1"],
                            capture_output=True, text=True).stdout
        assert "tbf" in qd and "1Gbit" in qd, qd
        net.set_rate("unlimited")
        qd = subprocess.run(["tc", "-n", net.rank_ns[1], "qdisc", "show", "dev", "nsv1"],
                            capture_output=True, text=True).stdout
        assert "tbf" not in qd, qd
    assert _ours("tnsrc") == []


@needs_netsim
def test_cli_tears_down_on_sigterm(tmp_path) -> None:
    """Killing the launcher with SIGTERM mid-run still deletes its namespaces."""
    import signal
    import time
    p = subprocess.Popen([sys.executable, "-m", "bench.netsim", "--nproc", "2", "--rate", "unlimited",
                          "--", "sleep", "30"], cwd=ROOT, env={**os.environ, **ENV},
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tag_ns: list[str] = []
    for _ in range(100):
        tag_ns = [ns for ns in netsim.list_namespaces() if ns.startswith(f"{netsim.NS_PREFIX}{p.pid}_")]
        if len(tag_ns) == 3:
            break
        time.sleep(0.05)
    assert len(tag_ns) == 3, tag_ns
    time.sleep(0.3)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=20)
    assert p.returncode == 130, err
    left = [ns for ns in netsim.list_namespaces() if ns.startswith(f"{netsim.NS_PREFIX}{p.pid}_")]
    assert left == [], left


@needs_netsim
def test_bench_comm_under_netsim(tmp_path) -> None:
    """bench.comm launches itself under netsim; its table carries bytes that match the wire formats
    and an fp32 time the 100mbit links allow."""
    from bench import comm as bench_comm

    n = 250_000
    out = tmp_path / "bench"
    rc = bench_comm.main(["--nproc", "2", "--rate", "100mbit", "--sizes", str(n), "--repeats", "1",
                          "--modes", "fp32,pbit:bits=4:levels=0,onebit", "--alpha", "0", "--beta", "1e-8",
                          "--out", str(out), "--timeout", "120"])
    assert rc == 0
    rows = {r["mode"]: r for r in __import__("csv").DictReader(open(out / "results.csv"))}
    assert set(rows) == {"fp32", "pbit:bits=4:levels=0", "onebit"}
    assert int(rows["fp32"]["bytes_sent_max"]) == 4 * n
    assert int(rows["pbit:bits=4:levels=0"]["bytes_sent_max"]) == n // 2
    # all-to-all of ceil(n/8P)*P bytes plus the all-gather of one chunk (n = 250000 divides evenly)
    assert int(rows["onebit"]["bytes_sent_max"]) == n // 8 + n // 16
    assert all(r["bytes_match_formula"] == "True" for r in rows.values()), rows
    ideal = n * 4 * 8 / 100e6                    # ring allreduce at P=2 sends N*4 bytes per rank
    assert 0.8 * ideal <= float(rows["fp32"]["coll_s"]) <= 4 * ideal + 0.05, rows["fp32"]
    assert float(rows["fp32"]["model_s"]) == pytest.approx(2 * 0.5 * n * 32 * 1e-8)   # given alpha, beta
    assert (out / "time_vs_n.png").stat().st_size > 1000
    assert "onebit" in (out / "results.md").read_text()
