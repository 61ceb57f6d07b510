"""Per-rank checks of comm.ef_compressed_allreduce against a single-process simulation of the P
workers written here from the contract (chunk routing, padding, draw order, error updates), run
under torchrun at P = 1, 2, 3, 4 by tests/comm/test_compressed.py.

    python -m torch.distributed.run --standalone --nproc_per_node=4 \\
        tests/workers/comm_compressed.py [--bench N]

--bench N times one call at n = N per compressor against comm.allreduce_mean fp32 instead.
Each `test_*` function is one named check (CHECKS; tests/workers/_checks.py records its outcome).
"""
from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

import comm
from comm import Compressor
from ef_sim import layout, sim_call, sim_exchange  # noqa: E402  (this folder is the script's sys.path[0])

dist.init_process_group("gloo")
P, RANK = dist.get_world_size(), dist.get_rank()
LENGTHS = (0, 1, 7, 8 * P - 1, 8 * P + 1, 1000, 100_003)
ASSERTIONS = 0
CHECKS = ("flat_against_simulation", "small_cache_pieces", "hierarchical_against_simulation",
          "error_feedback_is_real", "bytes_formula", "subgroup")

# every compressor option the collective has, each at least once
VARIANTS: dict[str, tuple[Compressor, float]] = {
    "scaled_sign": (Compressor("scaled_sign"), 0.0),
    "scaled_sign_l2_block64": (Compressor("scaled_sign", scale="l2", block=64), 0.0),
    "binary": (Compressor("binary_stochastic"), 0.0),
    "binary_bound0.5": (Compressor("binary_stochastic", bound=0.5), 0.0),
    "binary_maxbound_block16": (Compressor("binary_stochastic", bound=None, block=16), 0.0),
    "int4": (Compressor("int4"), 0.0),
    "int4_block32_loco0.8": (Compressor("int4", block=32), 0.8),
}


def check(cond: bool, msg: str) -> None:
    global ASSERTIONS
    ASSERTIONS += 1
    assert cond, f"[rank {RANK}/{P}] {msg}"


def gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(P)]
    dist.all_gather(out, t.contiguous())
    return out


def inputs(kind: str, n: int, seed: int, rank: int) -> torch.Tensor:
    """x of rank `rank` (every rank can build every rank's input, for the simulation)."""
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if kind == "random":
        return torch.randn(n, generator=g) * 0.4
    if kind == "zeros":
        return torch.zeros(n)
    if kind == "ties":  # exact zeros and equal magnitudes of both signs: sign(0), equal scales
        x = torch.full((n,), 0.25 if rank % 2 == 0 else -0.25)
        x[::3] = 0.0
        return x
    if kind == "dyadic":  # k/64: node sums and their halves/quarters are exact in fp32
        return torch.randint(-64, 65, (n,), generator=g).float() / 64
    raise ValueError(kind)


# ------------------------------------------------------------------------------------------------
# the simulation: P workers and P servers in one process, straight from the contract
# ------------------------------------------------------------------------------------------------

def run_against_sim(name: str, comp: Compressor, beta: float, n: int, kind: str, m: int,
                    calls: int = 3) -> None:
    wn, sn = comm.ef_buffer_sizes(n, P, comp, node_size=m)
    xs = [inputs(kind, n, seed=n + 17 * len(name), rank=r) for r in range(P)]
    werr, serr = torch.zeros(wn), torch.zeros(sn)
    s_werrs, s_serrs = [torch.zeros(wn) for _ in range(P)], [torch.zeros(sn) for _ in range(P)]
    gen = torch.Generator().manual_seed(4242 + RANK)
    s_gens = [torch.Generator().manual_seed(4242 + r) for r in range(P)]
    for call in range(calls):
        stats = comm.CommStats()
        res = comm.ef_compressed_allreduce(xs[RANK], werr, serr, comp, step=call, stats=stats,
                                           generator=gen, err_beta=beta, node_size=m)
        ref = sim_call(xs, s_werrs, s_serrs, comp, s_gens, beta, m)
        what = f"{name} m={m} n={n} kind={kind} call={call}"
        check(res.dtype == torch.float32 and res.shape == (n,), f"{what}: {res.dtype} {res.shape}")
        check(torch.equal(res, ref), f"{what}: result differs from the simulation in "
                                     f"{int((res != ref).sum())} elements")
        check(torch.equal(werr, s_werrs[RANK]), f"{what}: worker_error differs in "
                                                f"{int((werr != s_werrs[RANK]).sum())} elements")
        check(torch.equal(serr, s_serrs[RANK]), f"{what}: server_error differs")
        for r, other in enumerate(gather(res)):
            check(torch.equal(other, res), f"{what}: rank {r} result differs from rank {RANK}")
        rec = stats.calls[-1]
        exp = comm.compressed_bytes(n, P, comp, node_size=m)
        check(stats.totals()["calls"] == 1 and rec.name == f"ef_compressed_allreduce[{comp.kind}]",
              f"{what}: one stats call expected, got {stats.calls}")
        check((rec.bytes_sent, rec.bytes_recv) == exp, f"{what}: CommStats bytes "
              f"{(rec.bytes_sent, rec.bytes_recv)} != compressed_bytes {exp}")
        moved = P > 1 and n > 0
        check((rec.coll_s > 0) == moved and (rec.pack_s > 0) == (n > 0), f"{what}: seconds {rec}")
    if kind == "random" and n >= 1000 and comp.kind != "binary_stochastic":
        check(bool(werr.abs().sum() > 0), f"{name} n={n}: a lossy compressor left no worker error")


def test_flat_against_simulation() -> None:
    large = ("scaled_sign", "binary_maxbound_block16", "int4_block32_loco0.8")
    for name, (comp, beta) in VARIANTS.items():
        for n in LENGTHS:
            if n > 1000 and name not in large:  # keep the test fast: one large n per code path
                continue
            for kind in (("random", "zeros", "ties") if n <= 1000 else ("random",)):
                run_against_sim(name, comp, beta, n, kind, m=1, calls=3 if kind == "random" else 2)


def test_small_cache_pieces() -> None:
    """The CPU paths work through cache-sized pieces (comm.packing.CPU_BLOCK elements): shrink
    them so pieces split rows (chunk-wide blocks, block=64) and span several rows (block=16/32)
    at small n; results must not depend on the piece size."""
    saved = comm.compressed.CPU_BLOCK
    comm.compressed.CPU_BLOCK = 48
    try:
        for name, (comp, beta) in VARIANTS.items():
            for n in (8 * P + 1, 1000):
                run_against_sim(name, comp, beta, n, "random", m=1, calls=2)
        run_against_sim("int4", VARIANTS["int4"][0], 0.0, 1000, "dyadic", m=P)
    finally:
        comm.compressed.CPU_BLOCK = saved


def test_hierarchical_against_simulation() -> None:
    for m in [d for d in range(2, P + 1) if P % d == 0]:
        for name in ("scaled_sign", "binary", "int4_block32_loco0.8"):
            comp, beta = VARIANTS[name]
            for n in (0, 1, 8 * P + 1, 1000, 100_003):
                run_against_sim(name, comp, beta, n, "dyadic", m=m)
        # shard entries past the real elements are never touched
        comp = VARIANTS["scaled_sign"][0]
        n = 8 * P + 1
        wn, sn = comm.ef_buffer_sizes(n, P, comp, node_size=m)
        werr = torch.full((wn,), 7.0)
        comm.ef_compressed_allreduce(torch.ones(n), werr, torch.zeros(sn), comp, node_size=m)
        L, l = wn, RANK % m
        nr = max(0, min(L, n - l * L))
        check(bool((werr[nr:] == 7.0).all()), f"hierarchical m={m}: padding of the shard error written")
    if P == 1:
        return
    # node_size=1 is the flat form, byte for byte
    x = inputs("random", 999, seed=3, rank=RANK)
    outs = []
    for m in (None, 1):
        wn, sn = comm.ef_buffer_sizes(999, P, "int4", node_size=m)
        s = comm.CommStats()
        outs.append((comm.ef_compressed_allreduce(x, torch.zeros(wn), torch.zeros(sn), "int4",
                                                  stats=s, node_size=m), s.calls[-1].bytes_sent))
    check(torch.equal(outs[0][0], outs[1][0]) and outs[0][1] == outs[1][1], "node_size=1 != flat")


def test_error_feedback_is_real() -> None:
    """A fixed x over T calls: sum_t result_t = T * mean_i x_i - mean_i e_i,T - e_s,T exactly
    (telescoping), so the running mean misses the mean by (|mean_i e_i| + |e_s|) / T -> 0 while
    the errors stay bounded. With the errors zeroed every call it keeps a bias (deterministic
    compressors) or only averages noise out at 1/sqrt(T) (stochastic)."""
    n, T = 1000, 50
    xs = [(inputs("random", n, seed=99, rank=r)).clamp(-0.9, 0.9) for r in range(P)]
    a = torch.stack(xs).double().mean(0)
    for name in ("scaled_sign", "binary", "int4"):
        comp, _ = VARIANTS[name]
        rms = {}
        for ef in (True, False):
            wn, sn = comm.ef_buffer_sizes(n, P, comp)
            werr, serr = torch.zeros(wn), torch.zeros(sn)
            gen = torch.Generator().manual_seed(7 + RANK)
            acc = torch.zeros(n, dtype=torch.float64)
            for t in range(1, T + 1):
                if not ef:
                    werr.zero_()
                    serr.zero_()
                acc += comm.ef_compressed_allreduce(xs[RANK], werr, serr, comp, generator=gen).double()
                if t == 10:
                    rms[(ef, 10)] = float((acc / t - a).norm() / a.norm())
            rms[(ef, T)] = float((acc / T - a).norm() / a.norm())
            if ef:  # the telescoping identity, with this rank's share of the server error
                c, _ = layout(n, P, comp)
                e_s = torch.cat([e[:max(0, min(c, n - r * c))] for r, e in enumerate(gather(serr))])
                e_w = torch.stack(gather(werr)).double().mean(0)
                gap = (T * a - e_w - e_s.double() - acc).abs().max()
                # fp32 rounding of ~T additions of O(10) errors: ~1e-5 measured
                check(float(gap) < 1e-4, f"{name}: telescoping identity off by {float(gap)}")
        if RANK == 0:
            print(f"  EF {name} P={P}: relative rms of running mean - mean at T=10/{T}: "
                  f"with EF {rms[(True, 10)]:.4f}/{rms[(True, T)]:.4f}, "
                  f"without {rms[(False, 10)]:.4f}/{rms[(False, T)]:.4f}", flush=True)
        check(rms[(True, T)] < 0.3 * rms[(False, T)],
              f"{name}: with EF {rms[(True, T)]:.4f} not well below without {rms[(False, T)]:.4f}")
        check(rms[(True, T)] < 0.5 * rms[(True, 10)],
              f"{name}: EF running mean does not converge ({rms[(True, 10)]:.4f} -> {rms[(True, T)]:.4f})")


def test_bytes_formula() -> None:
    """CommStats equals compressed_bytes for more lengths, every compressor, every node size."""
    for name, (comp, beta) in VARIANTS.items():
        for m in [d for d in range(1, P + 1) if P % d == 0]:
            for n in (9, 64, 65, 4097):
                wn, sn = comm.ef_buffer_sizes(n, P, comp, node_size=m)
                s = comm.CommStats()
                comm.ef_compressed_allreduce(torch.randn(n), torch.zeros(wn), torch.zeros(sn), comp,
                                             stats=s, err_beta=beta, node_size=m)
                got = (s.calls[-1].bytes_sent, s.calls[-1].bytes_recv)
                check(got == comm.compressed_bytes(n, P, comp, node_size=m),
                      f"{name} m={m} n={n}: {got} != {comm.compressed_bytes(n, P, comp, node_size=m)}")


def test_subgroup() -> None:
    """Ranks 1..P-1 as the group: chunk owners are group ranks."""
    if P < 3:
        return
    members = list(range(1, P))
    sub = dist.new_group(members)
    if RANK not in members:
        return
    Q, n, comp = len(members), 501, VARIANTS["int4"][0]
    c, B = layout(n, Q, comp)
    xs = [inputs("random", n, seed=5, rank=r) for r in members]
    werr, serr = torch.zeros(n), torch.zeros(c)
    res = comm.ef_compressed_allreduce(xs[RANK - 1], werr, serr, comp, group=sub)
    s_w, s_s = [torch.zeros(n) for _ in members], [torch.zeros(c) for _ in members]
    ref = sim_exchange(xs, s_w, s_s, comp, c, B, [None] * Q, 0.0)[:n]
    check(torch.equal(res, ref) and torch.equal(serr, s_s[RANK - 1]), "subgroup result/server error")


def bench(n: int, repeats: int = 3) -> None:
    x = torch.randn(n, generator=torch.Generator().manual_seed(RANK))
    rows = []
    for name in ("fp32 allreduce_mean", "scaled_sign", "binary_stochastic", "int4"):
        stats = comm.CommStats()
        times = []
        if name.startswith("fp32"):
            fn = lambda: comm.allreduce_mean(x, stats=stats)  # noqa: E731
        else:
            wn, sn = comm.ef_buffer_sizes(n, P, name)
            werr, serr, gen = torch.zeros(wn), torch.zeros(sn), torch.Generator().manual_seed(RANK)
            fn = lambda: comm.ef_compressed_allreduce(x, werr, serr, name, stats=stats,  # noqa: E731
                                                      generator=gen)
        fn()  # warm-up
        stats.reset()
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        tot = stats.totals()
        worst = torch.tensor([min(times)], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        rows.append((name, float(worst), tot["coll_s"] / repeats, tot["pack_s"] / repeats,
                     tot["bytes_sent"] // repeats))
    if RANK == 0:
        print(f"bench n={n:,} P={P} (best of {repeats}, max over ranks; coll/pack: rank 0 means)")
        for name, t, coll, pack, sent in rows:
            print(f"  {name:22s} {t * 1e3:9.1f} ms/call  coll {coll * 1e3:8.1f} ms  "
                  f"pack {pack * 1e3:8.1f} ms  sent {sent / 2**20:8.2f} MiB/rank")


if __name__ == "__main__":
    from _exit import exit_cleanly  # tests/workers/ is the script's directory
    t0 = time.time()
    if "--bench" in sys.argv:
        bench(int(float(sys.argv[sys.argv.index("--bench") + 1])))
    else:
        from _checks import Checks
        checks = Checks(CHECKS)
        for name in CHECKS:
            checks.run(name, globals()[f"test_{name}"])
    dist.barrier()
    if RANK == 0:
        print(f"comm_compressed P={P}: {ASSERTIONS} assertions in {time.time() - t0:.1f}s", flush=True)
    dist.destroy_process_group()
    exit_cleanly()
