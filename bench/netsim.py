"""Bandwidth simulator: run N ranks on one machine, one network namespace each, behind real rate limits.

Topology (docs/architecture.md, "Measuring communication on one machine"): a switch namespace holds a Linux
bridge; every rank namespace is joined to it by a veth pair, and both ends of every pair get a
token-bucket filter `tc qdisc ... root tbf rate R burst B latency 100ms`, so a rank's upload (its own
end) and its download (the switch's end) are each limited to R, as on a switched Ethernet with one
NIC per host. Ranks talk to each other only over their veth (GLOO_SOCKET_IFNAME), with 10.213.0.x
addresses that exist only inside the namespaces created here.

    python -m bench.netsim --nproc 4 --rate 1gbit -- python -m bench.comm --worker ...
    python -m bench.netsim --nproc 2 --rate unlimited -- python my_worker.py

Each rank runs `ip netns exec <ns> CMD...` with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR (rank 0's address), MASTER_PORT and GLOO_SOCKET_IFNAME set; the exit status is non-zero
when any rank failed or timed out. Namespaces and links are always deleted on exit (finally +
SIGINT/SIGTERM/SIGHUP handlers); `--cleanup-stale` removes those left by a run that was SIGKILLed.

Latency is NOT emulated: the kernels we run on have no netem, so every message sees only the
veth/bridge latency (tens of microseconds). Where a per-message latency matters, model it:
`--latency-model 0.5ms` exports NETSIM_LATENCY_MODEL_S to every rank, and bench/comm.py adds
alpha = that value to its cost-model predictions (measured times are never padded).

`--ranks-per-ns K` puts K ranks in each namespace (one emulated node with one NIC): traffic between
ranks of the same node goes over that namespace's loopback (unlimited), traffic between nodes over
the rate-limited links; LOCAL_RANK / LOCAL_WORLD_SIZE then describe the node. `--nodes M` says the
same as `--ranks-per-ns nproc/M` (two nodes of 2 ranks: `--nproc 4 --nodes 2`).

Python API: `run(nproc, cmd, rate, timeout) -> list[int]` for one command, or
`with Netsim(nproc, rate) as net: net.run(cmd); net.set_rate("100mbit"); net.run(cmd)` to reuse a
topology across commands and rates. Needs root and iproute2 (`ip netns`, `tc`).
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Sequence

from util import pid_alive

SUBNET = "10.213.0"                  # /24 used only inside namespaces we create
NS_PREFIX = "lcnet"                  # every namespace we make is named lcnet<pid>_<tag>_...
BRIDGE = "nsbr0"
TBF_LATENCY = "100ms"                # max queueing delay tbf allows before dropping
MIN_BURST_BYTES = 64 * 1024          # 64kb is enough at 100mbit
TIMEOUT_RC = 124                     # exit code reported for a rank killed by the timeout

_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_BYTE_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1024, "m": 1024 ** 2, "mb": 1024 ** 2}


_SEQ = itertools.count()


class NetsimUnavailable(RuntimeError):
    """This machine cannot run the simulator (not root, or iproute2 / network namespaces missing)."""


class _Interrupted(BaseException):
    """Raised from a signal handler so that `finally` blocks tear the topology down."""


def parse_rate(rate: str | float | None) -> float | None:
    """'1gbit' / '100mbit' / '2.5gbit' / a number of bit/s -> bit/s; 'unlimited' or None -> None."""
    if rate is None:
        return None
    if isinstance(rate, (int, float)):
        if rate <= 0:
            raise ValueError(f"rate must be positive bit/s, got {rate}")
        return float(rate)
    s = rate.strip().lower()
    if s in ("unlimited", "none", "inf", ""):
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([kmgt]?bit)", s)
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"cannot parse rate {rate!r}: use e.g. '1gbit', '100mbit', '500kbit' "
                         f"(bits per second, SI prefixes) or 'unlimited'")
    return float(m.group(1)) * _UNITS[m.group(2)]


def parse_bytes(size: str | int) -> int:
    """'128kb' / '64k' / '1mb' / '200000' -> bytes (k = 1024, as tc reads burst sizes)."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"([0-9]+)\s*([kmb]{0,2})", size.strip().lower())
    if not m or m.group(2) not in _BYTE_UNITS:
        raise ValueError(f"cannot parse size {size!r}: use e.g. '128kb', '64k', '1mb' or plain bytes")
    return int(m.group(1)) * _BYTE_UNITS[m.group(2)]


def default_burst(rate_bps: float) -> int:
    """Bucket size for rate R: about 1 ms worth of bytes rounded up to a power-of-two KiB, >= 64 KiB.

    This gives the sizes (128kb at 1gbit, 64kb at 100mbit) and scales with the rate; a
    bucket much smaller than 1 ms of traffic starves tbf at high rates (one timer tick per refill).
    """
    kib = max(1, math.ceil(rate_bps / 8 / 1000 / 1024))
    return max(MIN_BURST_BYTES, 1024 * 2 ** math.ceil(math.log2(kib)))


def _sh(args: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"netsim: `{' '.join(args)}` failed (rc={proc.returncode}): "
                           f"{proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def unavailable_reason(need_tc: bool = True) -> str | None:
    """Why the simulator cannot run here (for a skip message), or None when it can."""
    try:
        check_available(need_tc=need_tc)
    except NetsimUnavailable as e:
        return f"netsim unavailable here: {e}"
    return None


def check_available(need_tc: bool = True) -> None:
    """Raise NetsimUnavailable with the reason and what to do when the simulator cannot run here."""
    if os.name != "posix" or not sys.platform.startswith("linux"):
        raise NetsimUnavailable(f"netsim needs Linux network namespaces; this is {sys.platform}")
    if os.geteuid() != 0:
        raise NetsimUnavailable(f"netsim must run as root (euid is {os.geteuid()}): creating network "
                                f"namespaces and tc qdiscs needs CAP_NET_ADMIN; rerun with sudo")
    if shutil.which("ip") is None:
        raise NetsimUnavailable("netsim needs `ip` from iproute2, which is not on PATH; "
                                "install it (apt-get install iproute2)")
    probe = _sh(["ip", "netns", "list"], check=False)
    if probe.returncode != 0:
        raise NetsimUnavailable(f"`ip netns` does not work here (rc={probe.returncode}: "
                                f"{probe.stderr.strip()}); this ip or kernel lacks network namespaces")
    if need_tc and shutil.which("tc") is None:
        raise NetsimUnavailable("netsim needs `tc` from iproute2 for rate limits, which is not on PATH; "
                                "install iproute2, or use --rate unlimited")


def list_namespaces() -> list[str]:
    out = _sh(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def cleanup_stale(verbose: bool = True) -> list[str]:
    """Delete namespaces of earlier netsim runs whose owning process is gone (e.g. SIGKILLed)."""
    removed = []
    for ns in list_namespaces():
        m = re.fullmatch(rf"{NS_PREFIX}(\d+)_.*", ns)
        if not m:
            continue
        if pid_alive(int(m.group(1))):
            continue                      # owner still alive: not stale
        _kill_ns_processes(ns)
        _sh(["ip", "netns", "del", ns], check=False)
        removed.append(ns)
    if verbose and removed:
        print(f"netsim: removed stale namespaces {removed}", file=sys.stderr)
    return removed


def _kill_ns_processes(ns: str) -> None:
    # `ip netns del` only drops the name: a process still inside keeps the namespace (and its veth
    # and addresses) alive, so stragglers are killed first.
    pids = _sh(["ip", "netns", "pids", ns], check=False).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


class Netsim:
    """One emulated cluster: `n_ns` rank namespaces joined by rate-limited veth links to a bridge.

    Use as a context manager; `run()` may be called several times and `set_rate()` between runs.
    """

    def __init__(self, nproc: int, rate: str | float | None = "1gbit", *, burst: str | int | None = None,
                 ranks_per_ns: int = 1, tag: str | None = None, verbose: bool = False) -> None:
        if nproc < 1:
            raise ValueError(f"nproc must be >= 1, got {nproc}")
        if ranks_per_ns < 1 or nproc % ranks_per_ns:
            raise ValueError(f"ranks_per_ns={ranks_per_ns} must be >= 1 and divide nproc={nproc}")
        self.nproc = nproc
        self.ranks_per_ns = ranks_per_ns
        self.n_ns = nproc // ranks_per_ns
        if self.n_ns > 250:
            raise ValueError(f"at most 250 namespaces fit in {SUBNET}.0/24, asked for {self.n_ns}")
        self.rate_bps = parse_rate(rate)
        self.burst = burst
        self.verbose = verbose
        tag = tag or f"{next(_SEQ)}t{int(time.time()) % 10**6}"     # unique within this process
        if not re.fullmatch(r"[A-Za-z0-9]{1,12}", tag):
            raise ValueError(f"tag must be 1-12 letters/digits, got {tag!r}")
        self.prefix = f"{NS_PREFIX}{os.getpid()}_{tag}_"
        self.switch_ns = self.prefix + "sw"
        self.rank_ns = [f"{self.prefix}r{i}" for i in range(self.n_ns)]
        self.created: list[str] = []
        self._up = False

    # --- topology -------------------------------------------------------------------------
    def ifname(self, node: int) -> str:
        """Name of node `node`'s veth end inside its own namespace (its GLOO_SOCKET_IFNAME)."""
        return f"nsv{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def _ip(self, ns: str, *args: str) -> None:
        _sh(["ip", "-n", ns, *args])

    def up(self) -> "Netsim":
        check_available(need_tc=self.rate_bps is not None)
        try:
            for ns in [self.switch_ns, *self.rank_ns]:
                _sh(["ip", "netns", "add", ns])
                self.created.append(ns)
            self._ip(self.switch_ns, "link", "add", BRIDGE, "type", "bridge")
            self._ip(self.switch_ns, "link", "set", BRIDGE, "up")
            self._ip(self.switch_ns, "link", "set", "lo", "up")
            for i, ns in enumerate(self.rank_ns):
                port = f"nsp{i}"
                # Created directly inside the namespaces, so names never touch the root namespace and
                # concurrent runs cannot collide.
                self._ip(ns, "link", "add", self.ifname(i), "type", "veth", "peer", "name", port,
                         "netns", self.switch_ns)
                self._ip(self.switch_ns, "link", "set", port, "master", BRIDGE)
                self._ip(self.switch_ns, "link", "set", port, "up")
                self._ip(ns, "addr", "add", f"{self.address(i)}/24", "dev", self.ifname(i))
                self._ip(ns, "link", "set", self.ifname(i), "up")
                self._ip(ns, "link", "set", "lo", "up")
            self._up = True
            self.set_rate(self.rate_bps, self.burst)
        except BaseException:
            self.down()
            raise
        return self

    def links(self) -> list[tuple[str, str]]:
        """(namespace, device) of both ends of every link: where the tbf qdiscs live."""
        out = []
        for i, ns in enumerate(self.rank_ns):
            out += [(ns, self.ifname(i)), (self.switch_ns, f"nsp{i}")]
        return out

    def set_rate(self, rate: str | float | None, burst: str | int | None = None) -> None:
        """Change the rate limit on both ends of every link (None / 'unlimited' removes it)."""
        rate_bps = parse_rate(rate)
        if rate_bps is not None:
            check_available(need_tc=True)
        burst_b = parse_bytes(burst) if burst is not None else (default_burst(rate_bps) if rate_bps else 0)
        for ns, dev in self.links():
            # Start from the device default each time so a rate can be removed as well as changed.
            _sh(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
            if rate_bps is not None:
                _sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(rate_bps)}bit",
                     "burst", f"{burst_b}b", "latency", TBF_LATENCY])
        self.rate_bps, self.burst = rate_bps, burst
        if self.verbose:
            shown = "unlimited" if rate_bps is None else f"{rate_bps / 1e6:g} Mbit/s, burst {burst_b} B"
            print(f"netsim: {self.n_ns} namespaces x {self.ranks_per_ns} ranks, links {shown}", file=sys.stderr)

    def down(self) -> None:
        """Delete every namespace this object made (their veths and bridge go with them). Idempotent."""
        for ns in reversed(self.created):
            _kill_ns_processes(ns)
            _sh(["ip", "netns", "del", ns], check=False)
        left = set(self.created) & set(list_namespaces())
        self.created = [ns for ns in self.created if ns in left]
        self._up = False
        if left:
            print(f"netsim: WARNING could not delete namespaces {sorted(left)}", file=sys.stderr)

    def __enter__(self) -> "Netsim":
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.down()

    # --- running a command ----------------------------------------------------------------
    def rank_env(self, rank: int, master_port: int) -> dict[str, str]:
        node = rank // self.ranks_per_ns
        env = {
            "RANK": str(rank), "WORLD_SIZE": str(self.nproc),
            "LOCAL_RANK": str(rank % self.ranks_per_ns), "LOCAL_WORLD_SIZE": str(self.ranks_per_ns),
            "GROUP_RANK": str(node), "MASTER_ADDR": self.address(0), "MASTER_PORT": str(master_port),
            "GLOO_SOCKET_IFNAME": self.ifname(node),
            "NETSIM_RATE_BPS": "0" if self.rate_bps is None else str(int(self.rate_bps)),
        }
        return env

    def run(self, cmd: Sequence[str], *, timeout: float = 600.0, master_port: int = 29500,
            env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
            log_dir: str | os.PathLike | None = None, fail_grace: float = 15.0,
            stream: IO[str] | None = None) -> list[int]:
        """Run `cmd` once per rank in its namespace; return the per-rank exit codes.

        A rank still running after `timeout` seconds is killed and reports 124. When one rank fails,
        the others get `fail_grace` seconds to finish (they are usually blocked in a collective
        waiting for the dead one) and are then killed (-9). Output lines are prefixed with
        `[rN] ` and written to `stream` (default sys.stdout); with `log_dir`, rank N's output also
        goes to log_dir/rankN.log.
        """
        if not self._up:
            raise RuntimeError("Netsim.run() called before up() / outside `with Netsim(...)`")
        if not cmd:
            raise ValueError("empty command: pass the program and its arguments to run on every rank")
        stream = stream or sys.stdout
        base = {**os.environ, **(env or {})}
        procs: list[subprocess.Popen] = []
        threads: list[threading.Thread] = []
        lock = threading.Lock()
        if log_dir is not None:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
        try:
            for rank in range(self.nproc):
                node = rank // self.ranks_per_ns
                p = subprocess.Popen(["ip", "netns", "exec", self.rank_ns[node], *cmd], cwd=cwd,
                                     env={**base, **self.rank_env(rank, master_port)},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                                     start_new_session=True, bufsize=1)
                procs.append(p)
                log = open(Path(log_dir) / f"rank{rank}.log", "w") if log_dir is not None else None
                t = threading.Thread(target=_pump, args=(p.stdout, f"[r{rank}] ", stream, log, lock), daemon=True)
                t.start()
                threads.append(t)
            codes = self._wait(procs, timeout, fail_grace)
        finally:
            for p in procs:
                if p.poll() is None:
                    _killpg(p)
            for t in threads:
                t.join(timeout=5)
        return codes

    def _wait(self, procs: list[subprocess.Popen], timeout: float, fail_grace: float) -> list[int]:
        t0 = time.monotonic()
        deadline = t0 + timeout
        codes: list[int | None] = [None] * len(procs)
        while any(c is None for c in codes):
            now = time.monotonic()
            for i, p in enumerate(procs):
                if codes[i] is None and p.poll() is not None:
                    codes[i] = p.returncode
                    if p.returncode != 0:
                        deadline = min(deadline, now + fail_grace)
            if now > deadline:
                timed_out = now - t0 >= timeout
                for i, p in enumerate(procs):
                    if codes[i] is None:
                        _killpg(p)
                        codes[i] = TIMEOUT_RC if timed_out else p.wait()
                        why = f"timeout {timeout:g}s" if timed_out else "another rank failed"
                        print(f"netsim: rank {i} killed ({why})", file=sys.stderr)
                break
            time.sleep(0.02)
        return [int(c) for c in codes]  # type: ignore[arg-type]


def _pump(pipe: IO[str], prefix: str, stream: IO[str], log: IO[str] | None, lock: threading.Lock) -> None:
    try:
        for line in pipe:
            with lock:
                stream.write(prefix + line)
                stream.flush()
            if log is not None:
                log.write(line)
    finally:
        if log is not None:
            log.close()


def _killpg(p: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(timeout=3)
            return
        except subprocess.TimeoutExpired:
            continue


class _SignalTeardown:
    """Turn SIGINT/SIGTERM/SIGHUP into an exception (so `finally` tears down); restore on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __enter__(self) -> None:
        self.saved = {}
        if threading.current_thread() is not threading.main_thread():
            return                                       # handlers can only be set from the main thread
        for s in self.SIGNALS:
            self.saved[s] = signal.signal(s, self._raise)

    @staticmethod
    def _raise(signum: int, frame: object) -> None:
        raise _Interrupted(f"signal {signal.Signals(signum).name}")

    def __exit__(self, *exc: object) -> None:
        for s, h in self.saved.items():
            signal.signal(s, h)


def run(nproc: int, cmd: Sequence[str], rate: str | float | None = "1gbit", timeout: float = 600.0, *,
        burst: str | int | None = None, ranks_per_ns: int = 1, master_port: int = 29500,
        env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
        log_dir: str | os.PathLike | None = None, latency_model: float | None = None,
        tag: str | None = None, stream: IO[str] | None = None, verbose: bool = False) -> list[int]:
    """Build the topology, run `cmd` on `nproc` ranks, tear everything down; return per-rank exit codes.

    Raises NetsimUnavailable when not root or when `ip netns` / `tc` are missing.
    """
    env = dict(env or {})
    if latency_model is not None:
        env["NETSIM_LATENCY_MODEL_S"] = repr(float(latency_model))
    with _SignalTeardown():
        net = Netsim(nproc, rate, burst=burst, ranks_per_ns=ranks_per_ns, tag=tag, verbose=verbose)
        try:
            net.up()
            return net.run(cmd, timeout=timeout, master_port=master_port, env=env, cwd=cwd,
                           log_dir=log_dir, stream=stream)
        finally:
            net.down()


def parse_seconds(s: str) -> float:
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(s|ms|us)?", s.strip().lower())
    if not m:
        raise argparse.ArgumentTypeError(f"cannot parse duration {s!r}: use e.g. '0.5ms', '50us', '0.001'")
    return float(m.group(1)) * {None: 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}[m.group(2)]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.netsim", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 usage="%(prog)s --nproc N [--rate 1gbit] [options] -- CMD [ARGS...]")
    ap.add_argument("--nproc", type=int, help="number of ranks")
    ap.add_argument("--rate", default="1gbit", help="per-link rate each way, e.g. 1gbit, 100mbit, or 'unlimited'")
    ap.add_argument("--burst", default=None, help="tbf bucket, e.g. 128kb (default: ~1 ms of traffic, >= 64kb)")
    ap.add_argument("--latency-model", type=parse_seconds, default=None, metavar="SECONDS",
                    help="per-message latency to MODEL (exported as NETSIM_LATENCY_MODEL_S; not emulated)")
    ap.add_argument("--ranks-per-ns", type=int, default=1, help="ranks per namespace (= per emulated node)")
    ap.add_argument("--nodes", type=int, default=None,
                    help="emulated nodes (= --ranks-per-ns nproc / nodes): unlimited loopback inside a node, the rate "
                         "limit only between nodes (hybrid sharding: parallel.shard_size = ranks per node)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before each rank is killed")
    ap.add_argument("--master-port", type=int, default=29500)
    ap.add_argument("--log-dir", default=None, help="also write rank N's output to LOG_DIR/rankN.log")
    ap.add_argument("--cleanup-stale", action="store_true",
                    help="delete namespaces left by netsim runs whose process is gone, then exit")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="command to run on every rank (after --)")
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    try:
        if args.cleanup_stale:
            check_available(need_tc=False)
            cleanup_stale()
            return 0
        if not args.nproc or not cmd:
            ap.error("need --nproc N and a command after --")
        if args.nodes is not None:
            if args.nodes < 1 or args.nproc % args.nodes:
                ap.error(f"--nodes {args.nodes} must be >= 1 and divide --nproc {args.nproc}")
            args.ranks_per_ns = args.nproc // args.nodes
        codes = run(args.nproc, cmd, args.rate, args.timeout, burst=args.burst, ranks_per_ns=args.ranks_per_ns,
                    master_port=args.master_port, log_dir=args.log_dir, latency_model=args.latency_model,
                    verbose=True)
    except (NetsimUnavailable, ValueError) as e:
        print(f"netsim: {e}", file=sys.stderr)
        return 2
    except _Interrupted as e:
        print(f"netsim: interrupted ({e}); namespaces torn down", file=sys.stderr)
        return 130
    failed = {r: c for r, c in enumerate(codes) if c != 0}
    if failed:
        print(f"netsim: ranks failed (rank: exit code) {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
