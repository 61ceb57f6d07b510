"""comm.ef_compressed_allreduce: the multi-process contract (tests/workers/comm_compressed.py at
P = 1..4: bitwise equal to a single-process simulation of P workers, identical on every rank,
CommStats = compressed_bytes, error feedback converges), plus in-process checks at P = 1 (no
process group): hand-computed values, resume, shapes, the byte formula and bad options."""
from __future__ import annotations

import math

import pytest
import torch

import comm
from comm import Compressor
from tests.checks import Worker

COMPRESSED = Worker("comm_compressed.py", timeout=240)


@pytest.mark.parametrize("nproc,check", COMPRESSED.cases([1, 2, 3, 4]))
def test_comm_compressed(nproc: int, check: str) -> None:
    COMPRESSED.check(nproc, check)


def _run(x: torch.Tensor, comp, calls: int = 1, **kw) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    wn, sn = comm.ef_buffer_sizes(x.numel(), 1, comp)
    werr, serr = torch.zeros(wn), torch.zeros(sn)
    outs = [comm.ef_compressed_allreduce(x, werr, serr, comp, **kw) for _ in range(calls)]
    return outs, werr, serr


def test_p1_scaled_sign_by_hand() -> None:
    # mean |x| = (1 + 3 + 0 + 2) / 4 = 1.5; sign(0) = +1; the server re-compresses the already
    # sign-coded vector to itself, so its error stays 0
    x = torch.tensor([1.0, -3.0, 0.0, 2.0])
    (res,), werr, serr = _run(x, "scaled_sign")
    assert torch.equal(res, torch.tensor([1.5, -1.5, 1.5, 1.5]))
    assert torch.equal(werr, x - res) and not serr.any()
    # DeepSpeed's scale ||x||_2 / sqrt(n)
    (res,), _, _ = _run(x, Compressor("scaled_sign", scale="l2"))
    s = math.sqrt(1 + 9 + 0 + 4) / 2
    assert torch.allclose(res, torch.tensor([s, -s, s, s]), rtol=1e-6)
    # one scale per block of 8: the second block is all zeros and decodes to 0
    x16 = torch.cat([torch.arange(1.0, 9.0), torch.zeros(8)])
    (res,), _, _ = _run(x16, Compressor("scaled_sign", block=8))
    assert torch.equal(res, torch.cat([torch.full((8,), 4.5), torch.zeros(8)]))


def test_p1_int4_by_hand_and_error_feedback() -> None:
    # amax 1.75: step 0.25, so x / step = [7, -2.5, 1, 0]; -2.5 rounds half to even -> -2
    x = torch.tensor([1.75, -0.625, 0.25, 0.0])
    (r1, r2), werr, serr = _run(x, "int4", calls=2)
    assert torch.equal(r1, torch.tensor([1.75, -0.5, 0.25, 0.0]))
    # the -0.125 carried by the worker error is sent on the second call: -0.75 = -3 steps
    assert torch.equal(r2, torch.tensor([1.75, -0.75, 0.25, 0.0]))
    assert torch.equal((r1 + r2) / 2, x) and not werr.any() and not serr.any()
    # LoCo's moving average keeps only (1 - beta) of the new error
    (r1,), werr, _ = _run(x, "int4", err_beta=0.8)
    assert torch.allclose(werr, torch.tensor([0.0, -0.125 * 0.2, 0.0, 0.0]))


def test_p1_binary_stochastic_unbiased_and_resumable() -> None:
    # BinSGDM's Q on values inside the bound: codes +-1, mean over draws -> the value
    n = 20_000
    x = torch.linspace(-1.0, 1.0, 8).repeat(n // 8)
    g = torch.Generator().manual_seed(0)
    wn, sn = comm.ef_buffer_sizes(n, 1, "binary_stochastic")
    res = comm.ef_compressed_allreduce(x, torch.zeros(wn), torch.zeros(sn), "binary_stochastic",
                                       generator=g)
    assert set(res.unique().tolist()) <= {-1.0, 1.0}
    # worker and server Q both unbiased: per level, the mean of 2500 codes has std <= 1/50
    per_level = res.view(-1, 8).mean(0)
    assert (per_level - x[:8]).abs().max() < 5 / 50, per_level
    # exact resume: generator state and error buffers restore the same sequence
    werr, serr = torch.randn(wn) * 0.1, torch.zeros(sn)
    g = torch.Generator().manual_seed(3)
    state = (g.get_state(), werr.clone(), serr.clone())
    first = [comm.ef_compressed_allreduce(x, werr, serr, "binary_stochastic", generator=g)
             for _ in range(3)]
    g.set_state(state[0])
    werr2, serr2 = state[1].clone(), state[2].clone()
    again = [comm.ef_compressed_allreduce(x, werr2, serr2, "binary_stochastic", generator=g)
             for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert torch.equal(werr, werr2) and torch.equal(serr, serr2)


def test_shapes_dtypes_and_stats_p1() -> None:
    x = torch.randn(3, 5, dtype=torch.bfloat16)
    s = comm.CommStats()
    (res,), _, _ = _run(x, "int4", stats=s)
    assert res.shape == (3, 5) and res.dtype == torch.bfloat16
    rec = s.calls[-1]
    assert s.totals()["calls"] == 1 and rec.name == "ef_compressed_allreduce[int4]"
    assert (rec.bytes_sent, rec.bytes_recv) == (0, 0) and rec.coll_s == 0 and rec.pack_s > 0
    (empty,), _, _ = _run(torch.zeros(0), "scaled_sign")
    assert empty.shape == (0,)
    # out=: into a given tensor, or in place (x is read before it is written)
    x = torch.randn(1001)
    for comp in ("scaled_sign", "int4"):
        (ref,), w_ref, s_ref = _run(x, comp)
        buf = torch.empty_like(x)
        (got,), w1, s1 = _run(x, comp, out=buf)
        assert got is buf and torch.equal(buf, ref) and torch.equal(w1, w_ref)
        x2 = x.clone()
        (got,), w2, s2 = _run(x2, comp, out=x2)
        assert got is x2 and torch.equal(x2, ref) and torch.equal(w2, w_ref) and torch.equal(s2, s_ref)


def _independent_bytes(n: int, P: int, kind: str, block: int | None, bound_scale: bool,
                       m: int) -> tuple[int, int]:
    """Per-rank wire bytes derived from the padded vector: N = P*c elements, each chunk carrying
    its codes and one fp32 per scale block."""
    if P == 1 or n == 0:
        return 0, 0
    bits = 4 if kind == "int4" else 1
    unit = block or 8 // bits
    c = unit * math.ceil(math.ceil(n / P) / unit)
    scales = (c // block if block else 1) if (kind != "binary_stochastic" or bound_scale) else 0
    chunk = c * bits // 8 + 4 * scales
    k = P // m
    a2a_ag = lambda Q: ((Q + 1) * chunk, 2 * Q * chunk)  # noqa: E731  all-to-all + all-gather
    if m == 1:
        return a2a_ag(P)
    sent = 4 * P * c + k * chunk            # fp32 reduce-scatter in, packed shard into all-gather
    recv = 4 * k * c + P * chunk
    if k > 1:
        s2, r2 = a2a_ag(k)
        sent, recv = sent + s2, recv + r2
    return sent, recv


def test_compressed_bytes_formula() -> None:
    for P in (1, 2, 3, 4, 5, 8, 16, 64):
        for n in (0, 1, 7, 8, 9, 63, 64, 65, 1000, 100_003, 25_000_000):
            for kind, block, bound_scale in (("scaled_sign", None, True), ("scaled_sign", 64, True),
                                             ("binary_stochastic", None, False),
                                             ("binary_stochastic", 16, True), ("int4", None, True),
                                             ("int4", 32, True)):
                comp = Compressor(kind, block=block, bound=None if bound_scale else 1.0)
                for m in [d for d in (1, 2, 4, 8) if P % d == 0]:
                    assert comm.compressed_bytes(n, P, comp, node_size=m) == \
                        _independent_bytes(n, P, kind, block, bound_scale, m), (P, n, comp, m)
    # 25M parameters over 4 ranks, 1-bit: 6.25M-element chunks of 781,250 bytes + one fp32 scale
    assert comm.compressed_bytes(25_000_000, 4, "scaled_sign") == (5 * 781_254, 8 * 781_254)
    # vs an fp32 ring allreduce moving 2 (P-1)/P * 100 MB per rank: ~25x fewer bytes at P = 4
    sent, _ = comm.compressed_bytes(25_000_000, 4, "scaled_sign")
    assert 2 * 3 / 4 * 100e6 / sent > 25


def test_buffer_sizes() -> None:
    assert comm.ef_buffer_sizes(1000, 4, "scaled_sign") == (1000, 256)      # 250 -> 256 (x8)
    assert comm.ef_buffer_sizes(1000, 4, "int4") == (1000, 250)             # 250 is even
    assert comm.ef_buffer_sizes(1000, 4, Compressor("int4", block=64)) == (1000, 256)
    assert comm.ef_buffer_sizes(1000, 4, "int4", node_size=2) == (500, 250)  # a 2-chunk shard
    assert comm.ef_buffer_sizes(0, 4, "int4") == (0, 0)


@pytest.mark.parametrize("make, needle", [
    (lambda: Compressor("topk"), "'topk'"),
    (lambda: comm.as_compressor("sign"), "'sign'"),
    (lambda: comm.as_compressor(3), "3"),
    (lambda: Compressor("scaled_sign", scale="linf"), "'linf'"),
    (lambda: Compressor("binary_stochastic", bound=0.0), "bound=0.0"),
    (lambda: Compressor("binary_stochastic", bound=float("inf")), "bound=inf"),
    (lambda: Compressor("scaled_sign", block=12), "block=12"),
    (lambda: Compressor("int4", block=3), "block=3"),
])
def test_bad_compressor(make, needle: str) -> None:
    with pytest.raises(ValueError) as e:
        make()
    assert needle in str(e.value) and ("use" in str(e.value) or "must" in str(e.value))


def test_bad_buffers_and_options() -> None:
    x = torch.randn(100)
    good_w, good_s = torch.zeros(100), torch.zeros(104)
    f = comm.ef_compressed_allreduce
    cases = [
        (lambda: f(x, torch.zeros(99), good_s, "scaled_sign"), ["worker_error", "99", "100"]),
        (lambda: f(x, good_w.double(), good_s, "scaled_sign"), ["worker_error", "float64"]),
        (lambda: f(x, good_w, torch.zeros(100), "scaled_sign"), ["server_error", "104",
                                                                 "ef_buffer_sizes"]),
        (lambda: f(x, good_w, torch.zeros(208)[::2], "scaled_sign"), ["not contiguous"]),
        (lambda: f(x.int(), good_w, good_s, "scaled_sign"), ["floating-point", "int32"]),
        (lambda: f(x, good_w, good_s, "scaled_sign", err_beta=1.0), ["err_beta=1.0"]),
        (lambda: f(x, good_w, good_s, "scaled_sign", node_size=2), ["node_size=2", "1"]),
        (lambda: f(x, good_w, good_s, "bogus"), ["'bogus'", "scaled_sign"]),
        (lambda: f(x, good_w, good_s, "int4", out=torch.empty(100, dtype=torch.float64)),
         ["out is", "float64", "torch.float32"]),
    ]
    for call, needles in cases:
        with pytest.raises(ValueError) as e:
            call()
        assert all(s in str(e.value) for s in needles), (needles, str(e.value))
    # a good call leaves the checked buffers usable
    f(x, good_w, good_s, "scaled_sign")
