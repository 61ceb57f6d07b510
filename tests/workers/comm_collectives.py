"""Per-rank checks of every comm/ collective against references built from all_gather of the raw
inputs, plus CommStats byte formulas. Launched by tests/comm/test_comm.py at P = 1, 2, 3, 4.

Each `test_*` function is one named check (CHECKS; tests/workers/_checks.py records its outcome).
"""
from __future__ import annotations

import math
import os
import time

import torch
import torch.distributed as dist

import comm
from comm import cost_model

dist.init_process_group("gloo")
P, RANK = dist.get_world_size(), dist.get_rank()
LARGE = 100_003
LENGTHS = (0, 1, 7, 8 * P - 1, 8 * P + 1, LARGE)
ASSERTIONS = 0
CHECKS = ("sign_vote", "hierarchical", "int_allreduce", "allreduce_mean", "stats", "subgroup",
          "cost_model_calibrate", "kernel_choice_agreed", "kernel_native_votes_as_eager")


def gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(P)]
    dist.all_gather(out, t.contiguous())
    return out


def tb(v: torch.Tensor, step: int) -> torch.Tensor:
    """Reference tie-broken sign, written independently of comm/ (Lion Cub App. B.1)."""
    zero_as = 1 if step % 2 else -1
    return torch.where(v > 0, 1, torch.where(v < 0, -1, zero_as)).to(torch.int64)


def check(cond: bool, msg: str) -> None:
    global ASSERTIONS
    ASSERTIONS += 1
    assert cond, f"[rank {RANK}/{P}] {msg}"


def same_on_all_ranks(res: torch.Tensor, what: str) -> None:
    allres = gather(res)
    for r, other in enumerate(allres):
        check(torch.equal(other, allres[0]), f"{what}: rank {r} result differs from rank 0")


def inputs(kind: str, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + RANK)
    if kind == "random":
        return torch.randn(n, generator=g)
    if kind == "zeros":
        return torch.zeros(n)
    if kind == "small_ints":  # many exact zeros and many exact ties in sums
        return torch.randint(-1, 2, (n,), generator=g).float()
    if kind == "ties":  # half the ranks +, half -, some zeros: exact ties at even P
        x = torch.full((n,), 1.0 if RANK < P // 2 else -1.0)
        x[::5] = 0.0
        return x
    raise ValueError(kind)


KINDS = ("random", "zeros", "small_ints") + (("ties",) if P % 2 == 0 else ())


def test_sign_vote() -> None:
    for n in LENGTHS:
        for kind in KINDS:
            for step in (1, 2):
                x = inputs(kind, n, seed=n + step)
                X = torch.stack(gather(x)) if n else torch.zeros(P, 0)
                ref = tb(sum(tb(X[i], step) for i in range(P)), step) if n else torch.zeros(0)
                for name, fn in (("sign_vote_1bit", lambda: comm.sign_vote_1bit(x, step)),
                                 ("ps_vote naive", lambda: comm.ps_vote(x, step, "vote", "naive")),
                                 ("ps_vote tree", lambda: comm.ps_vote(x, step, "vote", "tree"))):
                    res = fn()
                    check(res.dtype == torch.int8 and res.shape == (n,),
                          f"{name} n={n}: dtype/shape {res.dtype} {tuple(res.shape)}")
                    check(torch.equal(res.to(torch.int64), ref.to(torch.int64)),
                          f"{name} n={n} kind={kind} step={step}: "
                          f"{int((res.to(torch.int64) != ref).sum())} mismatches")
                    same_on_all_ranks(res, f"{name} n={n} {kind}")
                # avg: mean of tie-broken votes, no tie break on the mean
                cnt = sum((tb(X[i], step) > 0).to(torch.int64) for i in range(P)) if n else torch.zeros(0)
                ref_avg = (2 * cnt - P).to(torch.float32) / P if n else torch.zeros(0)
                for topo in ("naive", "tree"):
                    res = comm.ps_vote(x, step, "avg", topo)
                    check(res.dtype == torch.float32 and torch.equal(res, ref_avg),
                          f"ps_vote avg {topo} n={n} kind={kind} step={step}")
                    same_on_all_ranks(res, f"ps_vote avg {topo} n={n}")
                # sign: Distributed Lion eq. 5 exactly, sign of the sum of ternary signs, 0 on a tie
                ref_sign = torch.sign(sum(torch.sign(X[i]) for i in range(P))) if n else torch.zeros(0)
                for topo in ("naive", "tree"):
                    res = comm.ps_vote(x, step, "sign", topo)
                    check(res.dtype == torch.int8 and torch.equal(res.to(torch.int64), ref_sign.to(torch.int64)),
                          f"ps_vote sign {topo} n={n} kind={kind} step={step}")
                    same_on_all_ranks(res, f"ps_vote sign {topo} n={n}")
                    if kind == "zeros":  # every worker's exact zero stays 0 (no tie break)
                        check(not res.any(), f"ps_vote sign {topo}: zeros must stay zeros")
    # at even P the 'ties' kind must really produce ties, and both parities must resolve them
    if P % 2 == 0:
        x = inputs("ties", 64, seed=0)
        check(torch.equal(comm.sign_vote_1bit(x, 1)[1:5], torch.ones(4, dtype=torch.int8)),
              "tie at odd step must give +1")
        check(torch.equal(comm.sign_vote_1bit(x, 2)[1:5], -torch.ones(4, dtype=torch.int8)),
              "tie at even step must give -1")


def test_hierarchical() -> None:
    node_sizes = [m for m in range(1, P + 1) if P % m == 0]
    for m in node_sizes:
        k = P // m
        for n in LENGTHS:
            # random floats only where the float node sum is sign-exact (sums of <= 2 terms)
            kinds = ("small_ints", "zeros") + (("random",) if m <= 2 else ()) + \
                    (("ties",) if P % 2 == 0 else ())
            for kind in kinds:
                for step in (1, 2):
                    x = inputs(kind, n, seed=7 * n + step)
                    res = comm.hierarchical_sign_vote(x, step, node_size=m)
                    if n:
                        X = torch.stack(gather(x)).double()
                        S = [X[j * m:(j + 1) * m].sum(0) for j in range(k)]
                        ref = tb(sum(tb(s, step) for s in S), step)
                    else:
                        ref = torch.zeros(0, dtype=torch.int64)
                    check(torch.equal(res.to(torch.int64), ref),
                          f"hierarchical m={m} n={n} kind={kind} step={step}: "
                          f"{int((res.to(torch.int64) != ref).sum())} mismatches")
                    same_on_all_ranks(res, f"hierarchical m={m} n={n}")
        # integer signs give the vote of node-level votes, and m=1 equals sign_vote_1bit
        q = torch.randint(-1, 2, (999,), generator=torch.Generator().manual_seed(RANK)).to(torch.int8)
        if m == 1:
            check(torch.equal(comm.hierarchical_sign_vote(q, 3, node_size=1),
                              comm.sign_vote_1bit(q, 3)), "hierarchical m=1 != sign_vote_1bit")
    # default node size: LOCAL_WORLD_SIZE (torchrun sets it to P on one machine) -> one node
    x = inputs("small_ints", 333, seed=5)
    X = torch.stack(gather(x)).double()
    check(os.environ.get("LOCAL_WORLD_SIZE") == str(P), "torchrun should set LOCAL_WORLD_SIZE")
    check(torch.equal(comm.hierarchical_sign_vote(x, 2).to(torch.int64), tb(X.sum(0), 2)),
          "hierarchical default node_size")
    if P == 4:
        try:
            comm.hierarchical_sign_vote(x, 1, node_size=3)
            check(False, "node_size=3 at P=4 must raise")
        except ValueError as e:
            check("node_size=3" in str(e) and "4" in str(e), f"message: {e}")


def test_int_allreduce() -> None:
    for bits in (1, 2, 4, 8, 16):
        top = (1 << bits) - 1
        L = top // (2 * P) if P <= top else -1
        check(comm.max_levels(P, bits) == L, f"max_levels({P},{bits})={comm.max_levels(P, bits)} != {L}")
        dtype = torch.int32 if bits == 16 else torch.int8
        if L >= 0:
            for n in LENGTHS:
                g = torch.Generator().manual_seed(bits * 100 + n + RANK)
                if L == 0:
                    q = (torch.randint(0, 2, (n,), generator=g) * 2 - 1).to(dtype)
                else:
                    q = torch.randint(-L, L + 1, (n,), generator=g).to(dtype)
                    if n >= 3:  # extreme lanes: every rank at +L / -L sums to the lane maximum
                        q[0], q[1], q[2] = L, -L, 0
                res = comm.int_allreduce(q, L, bits)
                ref = torch.stack(gather(q.to(torch.int64))).sum(0) if n else torch.zeros(0, dtype=torch.int64)
                check(res.dtype == torch.int32 and torch.equal(res.to(torch.int64), ref),
                      f"int_allreduce bits={bits} L={L} n={n}: "
                      f"{int((res.to(torch.int64) != ref).sum()) if n else 0} mismatches")
                same_on_all_ranks(res, f"int_allreduce bits={bits}")
            # all ranks at +L everywhere: every lane sums to P*2L, the largest legal value
            q = torch.full((LARGE,), L if L else 1, dtype=dtype)
            res = comm.int_allreduce(q, L, bits)
            check(torch.equal(res, torch.full((LARGE,), P * (L if L else 1), dtype=torch.int32)),
                  f"int_allreduce bits={bits} at lane maximum")
        # one level more must raise, naming the numbers
        bad = L + 1
        try:
            comm.int_allreduce(torch.zeros(8, dtype=dtype) + (1 if bad == 0 else 0), bad, bits)
            check(False, f"int_allreduce bits={bits} levels={bad} P={P} must raise")
        except ValueError as e:
            check(str(P) in str(e) and str(bad) in str(e) and str(top) in str(e),
                  f"overflow message lacks the numbers: {e}")
    # levels=0 carries signs only: a zero must raise, not be silently counted
    try:
        comm.int_allreduce(torch.tensor([1, 0, -1], dtype=torch.int8), 0, 8)
        check(False, "levels=0 with a zero must raise")
    except ValueError:
        check(True, "")
    try:
        comm.int_allreduce(torch.tensor([3], dtype=torch.int8), 2, 8)
        check(False, "q out of [-L, L] must raise")
    except ValueError as e:
        check("[-2, 2]" in str(e), f"message: {e}")


def test_allreduce_mean() -> None:
    for n in LENGTHS:
        for kind in ("random", "zeros"):
            x = inputs(kind, n, seed=3 * n) * 3
            X = torch.stack(gather(x)).double() if n else torch.zeros(P, 0, dtype=torch.float64)
            ref = X.mean(0)
            r32 = comm.allreduce_mean(x)
            check(r32.dtype == torch.float32 and r32.shape == x.shape, "allreduce_mean dtype/shape")
            check(torch.allclose(r32.double(), ref, rtol=1e-5, atol=1e-5),
                  f"allreduce_mean fp32 n={n}: max err {(r32.double() - ref).abs().max() if n else 0}")
            same_on_all_ranks(r32, f"allreduce_mean fp32 n={n}")
            r16 = comm.allreduce_mean(x, wire_dtype=torch.bfloat16)
            # bf16 has 8 significant bits: each input and each partial sum rounds by <= 2**-8
            tol = (X.abs().sum(0) / P) * (P + 1) * 2.0 ** -8 + 1e-6
            check(r16.dtype == torch.float32 and bool(((r16.double() - ref).abs() <= tol).all()),
                  f"allreduce_mean bf16 n={n}")
            same_on_all_ranks(r16, f"allreduce_mean bf16 n={n}")
            if n == LARGE and kind == "random":
                check(not torch.equal(r16, r32), "bf16 wire should round (else it was not used)")
            for wd, expect in ((torch.float32, r32), (torch.bfloat16, r16)):
                y = x.clone()
                out = comm.allreduce_mean(y, wire_dtype=wd, inplace=True)
                check(out.data_ptr() == y.data_ptr() and torch.equal(y, expect),
                      f"allreduce_mean inplace {wd} n={n} equals the copying result, written into x")
    xd = torch.randn(5, 3, dtype=torch.float64)
    check(comm.allreduce_mean(xd).dtype == torch.float64, "allreduce_mean keeps x.dtype")


def test_stats() -> None:
    B = lambda n, d=8: -(-n // d)  # noqa: E731
    for n in (1, 8 * P + 1, LARGE):
        s = comm.CommStats()
        x = torch.randn(n)
        s.begin_step()
        comm.sign_vote_1bit(x, 1, stats=s)
        npad = B(n, 8 * P) * 8 * P
        exp_sent = 0 if P == 1 else npad // 8 + npad // (8 * P)
        exp_recv = 0 if P == 1 else 2 * (npad // 8)
        rec = s.calls[-1]
        check(rec.name == "sign_vote_1bit" and (rec.bytes_sent, rec.bytes_recv) == (exp_sent, exp_recv),
              f"sign_vote_1bit bytes n={n}: {rec} expected {exp_sent}/{exp_recv}")
        check(rec.pack_s > 0 and (rec.coll_s > 0) == (P > 1), f"sign_vote_1bit seconds {rec}")
        for bits in (1, 4, 8, 16):
            L = comm.max_levels(P, bits)
            if L < 0:
                continue
            q = torch.zeros(n, dtype=torch.int32) + (1 if L == 0 else 0)
            comm.int_allreduce(q, L, bits, stats=s)
            wire = 4 * B(n, 2) if bits == 16 else B(n * bits)
            rec = s.calls[-1]
            check((rec.bytes_sent, rec.bytes_recv) == ((wire, wire) if P > 1 else (0, 0)),
                  f"int_allreduce bits={bits} n={n}: {rec}, expected {wire}")
        for wd, size in ((torch.float32, 4), (torch.bfloat16, 2)):
            comm.allreduce_mean(x, wd, stats=s)
            rec = s.calls[-1]
            check((rec.bytes_sent, rec.bytes_recv) == ((n * size,) * 2 if P > 1 else (0, 0)),
                  f"allreduce_mean {wd} bytes {rec}")
        nb = max(1, P.bit_length())
        for agg, up, back in (("vote", B(n), B(n)), ("avg", B(n), nb * B(n)), ("sign", 2 * B(n), 2 * B(n))):
            comm.ps_vote(x, 2, agg, "naive", stats=s)
            rec = s.calls[-1]
            exp = ((P - 1) * back, (P - 1) * up) if RANK == 0 else (up, back)
            check((rec.bytes_sent, rec.bytes_recv) == (exp if P > 1 else (0, 0)),
                  f"ps naive {agg} rank {RANK}: {rec}, expected {exp}")
            comm.ps_vote(x, 2, agg, "tree", stats=s)
            rec = s.calls[-1]
            exp = tree_bytes(n, agg)
            check((rec.bytes_sent, rec.bytes_recv) == exp, f"ps tree {agg}: {rec}, expected {exp}")
        for m in [d for d in range(1, P + 1) if P % d == 0]:
            k = P // m
            comm.hierarchical_sign_vote(x, 1, node_size=m, stats=s)
            rec = s.calls[-1]
            sent = recv = 0
            if m > 1:  # reduce-scatter of fp32 words, then all-gather of my packed shard
                sent += npad * 4 + npad // (8 * m)
                recv += npad * 4 // m + npad // 8
            if k > 1:  # 1-bit vote of my shard across nodes
                sent += npad // (8 * m) + npad // (8 * m * k)
                recv += 2 * npad // (8 * m)
            check((rec.bytes_sent, rec.bytes_recv) == (sent, recv),
                  f"hierarchical m={m} n={n}: {rec}, expected {sent}/{recv}")
        summ, tot = s.step_summary(), s.totals()
        check(summ["calls"] == len(s.calls) and summ["bytes_sent"] == sum(c.bytes_sent for c in s.calls),
              f"step_summary {summ}")
        check(summ == tot, "one step: summary equals totals")
        s.begin_step()
        check(s.step_summary()["calls"] == 0 and s.totals()["calls"] == tot["calls"], "begin_step")
        with s.timed_pack():
            time.sleep(0.01)
        check(s.step_summary()["pack_s"] >= 0.01 and s.step_summary()["calls"] == 0, "timed_pack")
        s.reset()
        check(s.totals()["calls"] == 0 and not s.calls, "reset")
    # stats=None books into the process-wide default
    before = comm.default_stats().totals()["calls"]
    comm.sign_vote_1bit(torch.randn(10), 1)
    check(comm.default_stats().totals()["calls"] == before + 1, "default_stats")


def tree_bytes(n: int, agg: str) -> tuple[int, int]:
    """Expected (sent, recv) of ps_vote tree at this rank, from descendants counted directly."""
    if P == 1:
        return 0, 0
    B = -(-n // 8)

    def size(r: int) -> int:  # descendants of r in heap order, by walking levels
        total, lo, hi = 0, r, r
        while lo < P:
            total += min(hi, P - 1) - lo + 1
            lo, hi = 2 * lo + 1, 2 * hi + 2
        return total

    def planes(s: int) -> int:
        return math.ceil(math.log2(s + 1))

    children = [c for c in (2 * RANK + 1, 2 * RANK + 2) if c < P]
    unit = 2 if agg == "sign" else 1  # a ternary sign sends sign + 1 in [0, 2]
    back = B * {"vote": 1, "avg": planes(P), "sign": 2}[agg]
    recv = sum(B * planes(unit * size(c)) for c in children) + (back if RANK else 0)
    sent = (B * planes(unit * size(RANK)) if RANK else 0) + back * len(children)
    return sent, recv


def test_cost_model_calibrate() -> None:
    # the fit recovers known parameters from exact model times (more cases: tests/comm/test_comm.py)
    sizes = (1 << 10, 1 << 16, 1 << 22)
    for Pm in (2, 3, 8):
        times = [cost_model.ring_allreduce(Pm, s // 4, 32, 3e-5, 1e-9) for s in sizes]
        a, b = cost_model.fit_alpha_beta(Pm, sizes, times)
        check(abs(a - 3e-5) < 1e-9 and abs(b - 1e-9) < 1e-13, f"fit_alpha_beta P={Pm}: {a} {b}")
    # live sweep, kept cheap: 4 KB, 1 MB, 8 MB (two large sizes, so beta is their slope)
    sizes = (1 << 12, 1 << 20, 1 << 23)
    alpha, beta = cost_model.calibrate(sizes=sizes, repeats=2)
    if P == 1:
        check((alpha, beta) == (0.0, 0.0), "calibrate at P=1")
        return
    # loopback gloo moves 0.1-100 Gbit/s per rank, but a sweep this short is noisy on a loaded
    # machine (one slow small-size repeat flattens the slope: 250 Gbit/s was seen); a clamped
    # (beta = 0) or absurd fit still falls outside
    check(0 <= alpha < 0.1 and 0 < beta < 1e-7, f"calibrate: alpha={alpha} beta={beta}")
    same_on_all_ranks(torch.tensor([alpha, beta], dtype=torch.float64), "calibrate")
    t = cost_model.measure_allreduce_seconds(sizes, repeats=2)
    check(len(t) == 3 and all(x > 0 for x in t), f"measure_allreduce_seconds: {t}")
    same_on_all_ranks(torch.tensor(t, dtype=torch.float64), "measure_allreduce_seconds")
    a, b = cost_model.fit_alpha_beta(P, sizes, t)
    model = cost_model.ring_allreduce(P, sizes[-1] // 4, 32, a, b)
    check(model >= t[-1] * (1 - 1e-9), f"model {model} s below the largest measured {t[-1]} s")


def test_subgroup() -> None:
    """Collectives on a subgroup of ranks 1..P-1: group-relative ranks must map to the right
    peers (ps_vote's P2P, hierarchical's node subgroups)."""
    if P < 3:
        return
    members = list(range(1, P))
    sub = dist.new_group(members)  # every rank of the world takes part in creating it
    n, step = 1001, 3
    x = inputs("small_ints", n, seed=11)
    X = torch.stack(gather(x)).double()[members]
    if RANK not in members:
        return
    Q = len(members)
    ref = tb(sum(tb(X[i], step) for i in range(Q)), step)
    for name, res in (("sign_vote_1bit", comm.sign_vote_1bit(x, step, group=sub)),
                      ("ps naive", comm.ps_vote(x, step, "vote", "naive", group=sub)),
                      ("ps tree", comm.ps_vote(x, step, "vote", "tree", group=sub)),
                      ("hierarchical m=1", comm.hierarchical_sign_vote(x, step, 1, group=sub))):
        check(torch.equal(res.to(torch.int64), ref), f"subgroup {name}")
    res = comm.hierarchical_sign_vote(x, step, Q, group=sub)
    check(torch.equal(res.to(torch.int64), tb(X.sum(0), step)), "subgroup hierarchical one node")
    q = x.to(torch.int8)
    check(torch.equal(comm.int_allreduce(q, 1, 8, group=sub).to(torch.int64),
                      X.sum(0).to(torch.int64)), "subgroup int_allreduce")
    if Q == 3:  # a node size that does not divide the subgroup's 3 ranks
        try:
            comm.hierarchical_sign_vote(x, step, 2, group=sub)
            check(False, "node_size=2 over 3 ranks must raise")
        except ValueError:
            check(True, "")


def test_kernel_choice_agreed() -> None:
    """comm.kernels=auto where it measures: each rank times its candidates alone (here rank 0 finds
    "b" fastest, the others "a", and the last rank rejects "c", as fast elsewhere: without agreement
    rank 0 and the last rank differ); after Kernels.agree every rank follows the same one, never a
    candidate some rank rejected."""
    from comm import kernels as K

    x = torch.arange(64, dtype=torch.float32)
    slow = lambda: (time.sleep(0.004), x.clone())[1]  # noqa: E731
    fast = lambda: x.clone()  # noqa: E731
    wrong = lambda: x + (1 if RANK == P - 1 else 0)  # noqa: E731 - bytes differ on the last rank only
    cands = {"eager": slow, "a": fast if RANK else slow, "b": slow if RANK else fast}
    if P > 1:
        cands["c"] = wrong
    k = K.Kernels("auto", "cpu")
    k.choose("sign_pack", cands, repeats=3)
    k.agree()
    chosen = k.which("sign_pack")
    allc: list = [None] * P
    dist.all_gather_object(allc, chosen)
    check(len(set(allc)) == 1, f"ranks follow different kernels after agree: {allc}")
    check(P == 1 or allc[0] != "c", "a candidate rejected on one rank was chosen")
    check(P == 1 or f"agreed by {P} ranks" in k.lines()[0], f"the choice's line does not say it was agreed: {k.lines()}")


def test_kernel_native_votes_as_eager() -> None:
    """The votes of every rank through comm.kernels=auto (the native loops on CPU where they build)
    equal the eager reference's, bit for bit, on every rank: 1-bit votes and a 4-bit L1 sum."""
    from comm import kernels as K

    k = K.Kernels("auto", "cpu")
    k.warmup(bits=(4,), levels=(comm.max_levels(max(P, 2), 4),), p=(1.0,), world_sizes=(max(P, 2),), layout=[(0, 40_000)])
    g = torch.Generator().manual_seed(100 + RANK)
    x = torch.randn(40_000, generator=g)
    x[::9] = 0.0
    npad = -(-x.numel() // (8 * P)) * 8 * P
    for step in (1, 2):
        got = comm.sign_vote_packed(k.sign_pack(x, step, npad), step, local_majority=k.unpack_majority)
        want = comm.sign_vote_packed(comm.vote.tb_packed(x, step, npad), step)
        same_on_all_ranks(got, "1-bit vote through the run's Kernels")
        check(torch.equal(got, want),
              f"1-bit vote via {k.which('sign_pack')} / {k.which('unpack_majority')} differs")
    L = comm.max_levels(P, 4)
    wire = k.quantize_pack(x, [(0, 17_000), (17_000, 23_000)], L, 1.0, 2.0, 4)
    check(torch.equal(wire, K.wire_of(K.quantize_q(x, [(0, 17_000), (17_000, 23_000)], L, 1.0), L, 4)),
          f"4-bit L1 wire via {k.which('quantize_pack')} differs")
    dist.all_reduce(wire, op=dist.ReduceOp.SUM)
    got = k.unpack_sum(wire, 4, x.numel(), L, P, sign=True, dtype=torch.int8)
    ref = torch.sign(K.unpack_sum_reference(wire, 4, x.numel(), L, P)).to(torch.int8)
    same_on_all_ranks(got, "the summed 4-bit update")
    check(torch.equal(got, ref), f"the summed 4-bit update via {k.which('unpack_sum')} differs")


if __name__ == "__main__":
    from _checks import Checks  # tests/workers/ is the script's directory
    from _exit import exit_cleanly
    checks, t0 = Checks(CHECKS), time.time()
    for name in CHECKS:
        checks.run(name, globals()[f"test_{name}"])
    dist.barrier()
    if RANK == 0:
        print(f"comm_collectives P={P}: {ASSERTIONS} assertions in {time.time() - t0:.1f}s", flush=True)
    dist.destroy_process_group()
    exit_cleanly()
