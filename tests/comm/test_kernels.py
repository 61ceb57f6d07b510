"""comm.kernels and optim.lion's fused passes: the compiled kernels give the eager reference's bytes, sums and updates.

Every compiled-kernel test runs on each device here (the `dev` fixture): on CPU (inductor's C++
backend) always, and on CUDA (Triton) where a GPU is visible; inputs are drawn on the CPU and
moved, so both devices check the same values, and the independent references run on the CPU.

Every kernel compiles once with dynamic shapes and is reused across the parametrisations below
(lengths, P, steps, levels), so compile time is paid once per kernel. Besides compiled == eager,
the tests check against independent references (plain integer arithmetic for sums and votes,
exact rational arithmetic for the fused multiply-add), so a shared bug cannot pass.
"""
from __future__ import annotations

import math
import time
import warnings
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from comm import max_levels
from comm import quantize as Q
from comm.packing import unpack_bits, unpack_signs
from comm.quantize import lp_mean, lp_quantize, segment_lp_means
from comm import kernels as K
from comm import kernel_bodies as KB
from comm import kernel_choice as KC
from comm import kernel_quant as KQ
from comm import native
from comm.vote import local_majority, tb_packed
from optim import lion as Lion
from optim.lion import apply_update_, lion_direction, momentum_update_

compiled = pytest.mark.skipif(K.compile_unavailable("cpu") is not None,
                              reason=f"no compiled kernels here: {K.compile_unavailable('cpu')}")


@pytest.fixture(params=["cpu", "cuda"])
def dev(request) -> torch.device:
    """The device a compiled-kernel test runs on: CPU, and CUDA when a GPU is visible."""
    d = torch.device(request.param)
    if d.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device visible")
    why = K.compile_unavailable(d)
    if why is not None:
        pytest.skip(f"no compiled kernels for {d}: {why}")
    return d


@pytest.fixture(params=[("cpu", "compiled"), ("cuda", "compiled"), ("cpu", "native")], ids=lambda p: "-".join(p))
def kdev(request) -> tuple[torch.device, str]:
    """(device, impl) of a wire-kernel test: the compiled kernels on CPU and CUDA (where a GPU is
    visible), and comm.native's C loops on CPU."""
    d, impl = torch.device(request.param[0]), request.param[1]
    if d.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device visible")
    why = K.compile_unavailable(d) if impl == "compiled" else native.unavailable(d)
    if why is not None:
        pytest.skip(f"no {impl} kernels for {d}: {why}")
    return d, impl


LENGTHS = [0, 1, 7, 9, 65, 71, 1000003]
WIRE_BITS = [1, 2, 4, 8, 16]


def _gen(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _values(kind: str, n: int, seed: int = 0) -> torch.Tensor:
    """random (with exact zeros), zero, or tie: +-1 only, so M_1 = 1 exactly and x * L / 2 lands
    exactly halfway between integers for every odd L (round half to even decides)."""
    g = _gen(seed)
    if kind == "zero":
        return torch.zeros(n)
    if kind == "tie":
        return torch.randint(0, 2, (n,), generator=g).float() * 2 - 1
    x = torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g))
    x[::11] = 0.0
    return x


def _bits(x: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a float32 tensor with every NaN mapped to one value (payloads may differ)."""
    return torch.where(torch.isnan(x), torch.full_like(x, float("nan")), x).view(torch.int32)


# ---- sign -> packed bits ---------------------------------------------------------------------
@compiled
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("kind", ["random", "zero", "tie"])
def test_sign_pack_matches_tb_packed(n, kind, kdev):
    dev, impl = kdev
    x = _values(kind, n, seed=n)
    if n > 20:
        x[3], x[4], x[5], x[6] = float("nan"), float("inf"), -float("inf"), -0.0
    xd = x.to(dev)
    for step in (1, 2, 7):
        for length in (None, -(-n // 40) * 40 + 40):
            got = K.sign_pack(xd, step, length, impl=impl)
            ref = tb_packed(xd, step, length)
            assert got.dtype == torch.uint8 and got.device == xd.device and torch.equal(got, ref)
            got = got.cpu()
            assert torch.equal(got, tb_packed(x, step, length))  # the same bytes on every device
            # independent: bit i of byte j is tb(x[8j+i]); padding bits are 0
            flags = unpack_bits(got, got.numel() * 8)
            want = (x >= 0) if step % 2 else (x > 0)
            assert torch.equal(flags[:n], want) and not flags[n:].any()


@compiled
def test_sign_pack_bfloat16(kdev):
    dev, impl = kdev
    x = _values("random", 1003, seed=3).to(dev, torch.bfloat16)
    for step in (1, 2):
        assert torch.equal(K.sign_pack(x, step, impl=impl), tb_packed(x, step))


# ---- quantize -> packed lanes ------------------------------------------------------------------
def _segments(n: int) -> list[tuple[int, int]]:
    """Uneven tensor sizes, none a multiple of 8, one below kernels.SMALL (runs the reference)."""
    if n < 200:
        return [(0, n)]
    sizes = [n // 2 + 3, 5, n // 5 + 1, 129]
    sizes.append(n - sum(sizes))
    out, off = [], 0
    for m in sizes:
        out.append((off, m))
        off += m
    return out


def _independent_wire_values(q: torch.Tensor, levels: int) -> torch.Tensor:
    return (q > 0).to(torch.int64) if levels == 0 else q.to(torch.int64) + levels


def _unpack_wire(wire: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Lane values of a wire by plain shifts (independent of comm.packing)."""
    if bits == 16:
        w = wire.to(torch.int64) & 0xFFFFFFFF
        lanes = torch.stack([w & 0xFFFF, w >> 16], 1)
    else:
        per = 8 // bits
        w = wire.to(torch.int64)
        lanes = torch.stack([(w >> (i * bits)) & ((1 << bits) - 1) for i in range(per)], 1)
    return lanes.reshape(-1)


@compiled
@pytest.mark.parametrize("bits", WIRE_BITS)
@pytest.mark.parametrize("n", LENGTHS)
def test_quantize_pack_signs_only(bits, n, kdev):
    """levels = 0: tie-broken signs as 0/1 lanes, every lane width, every length."""
    dev, impl = kdev
    for kind in ("random", "zero"):
        c = _values(kind, n, seed=n + bits)
        cd = c.to(dev)
        for step in (1, 2):
            got = K.quantize_pack(cd, _segments(n), 0, None, bits=bits, tie_step=step, impl=impl)
            q = K.quantize_q(cd, _segments(n), 0, None, tie_step=step)
            ref = K.wire_of(q, 0, bits)
            assert got.dtype == ref.dtype and torch.equal(got, ref)
            lanes = _unpack_wire(got.cpu(), bits, n)
            want = (c > 0) | ((c == 0) & bool(step % 2))
            assert torch.equal(lanes[:n], want.to(torch.int64)) and not lanes[n:].any()


QUANT_CASES = [(b, L) for b in (2, 4, 8, 16) for L in sorted({1, max_levels(1, b) if b < 16 else 127})]


@compiled
@pytest.mark.parametrize("bits,levels", QUANT_CASES)
@pytest.mark.parametrize("kind", ["random", "zero", "tie"])
@pytest.mark.parametrize("p", [1.0, math.inf, None])
def test_quantize_pack_lp(bits, levels, kind, p, kdev):
    """Lion Cub eq. 1 per segment, nearest rounding, at the smallest and largest levels of
    each lane width (L = 1 and L = 127 are odd, so the tie input rounds exactly half). The
    reference runs on the same device (M_p is a reduction: its rounding is the device's)."""
    dev, impl = kdev
    for n in (9, 1000003):
        c = _values(kind, n, seed=bits * levels + n).to(dev)
        segs = _segments(n)
        got = K.quantize_pack(c, segs, levels, p, 2.0, bits, impl=impl)
        q = K.quantize_q(c, segs, levels, p)
        assert torch.equal(got, K.wire_of(q, levels, bits))
        q = q.cpu()
        lanes = _unpack_wire(got.cpu(), bits, n)
        assert torch.equal(lanes[:n], _independent_wire_values(q, levels)) and not lanes[n:].any()
    if kind == "tie" and p == 1.0:  # half to even: +-L/2 -> the even neighbour
        half = torch.round(torch.tensor([levels / 2.0]))
        assert set(q.abs().unique().tolist()) <= {int(half)}


@compiled
@pytest.mark.parametrize("bits,levels", [(2, 1), (4, 7), (16, 127)])
def test_quantize_pack_many_short_segments(bits, levels, kdev):
    """Segments of 1..150 elements: most packed words are shared by several tensors (the
    boundary pass), some are filled by one tensor alone (the kernel)."""
    dev, impl = kdev
    sizes = torch.randint(1, 151, (80,), generator=_gen(bits)).tolist()
    segs, off = [], 0
    for m in sizes:
        segs.append((off, m))
        off += m
    c = _values("random", off, seed=3)
    c[segs[7][0]:segs[7][0] + segs[7][1]] = 0.0  # a tensor of zeros: M_p = 0, q = 0
    c = c.to(dev)
    for p in (1.0, 2.0):
        got = K.quantize_pack(c, segs, levels, p, 2.0, bits, impl=impl)
        assert torch.equal(got, K.wire_of(K.quantize_q(c, segs, levels, p), levels, bits))
    if bits == 4:  # a bfloat16 update direction: M_p and the scaling in float32, as lp_quantize
        cb = c.to(torch.bfloat16)
        got = K.quantize_pack(cb, segs, levels, 1.0, 2.0, bits, impl=impl)
        assert torch.equal(got, K.wire_of(K.quantize_q(cb, segs, levels, 1.0), levels, bits))


def _layout(sizes: list[int]) -> list[tuple[int, int]]:
    segs, off = [], 0
    for m in sizes:
        segs.append((off, m))
        off += m
    return segs


@compiled
@pytest.mark.parametrize("bits,levels", [(4, 7), (8, 127), (16, 127)])
def test_quantize_pack_one_pass_matches_the_per_tensor_reference(bits, levels, kdev):
    """The one-pass quantizer (whole blocks of the flat vector in one kernel, the boundary blocks
    gathered) against quantize_q's per-tensor lp_quantize: tensors of tiny (1e-30) and huge
    (1e30) norm side by side, a zero tensor, a tie tensor (+-1: x * L / 2 exactly halfway),
    tensors of odd lengths that straddle block boundaries or fit inside one, one tensor alone,
    and a layout of 300 small tensors; p = 0, 0.5, 1, 2, inf."""
    dev, impl = kdev
    B = K.QBLOCK
    sizes = [3 * B + 1, 7, B - 3, 2 * B + 5, 1, B, 129, 5 * B + 11]
    scale = [1e-30, 1.0, 1e30, 0.0, 3.0, -1.0, 1e-3, 1e3]
    parts = []
    for i, (m, sc) in enumerate(zip(sizes, scale)):
        v = _values("tie" if i == 6 else "random", m, seed=i)
        parts.append(v * sc if sc else torch.zeros(m))
    cases = [(torch.cat(parts), _layout(sizes)), (_values("random", 4 * B + 3, seed=9), [(0, 4 * B + 3)])]
    small = torch.randint(1, 60, (300,), generator=_gen(11)).tolist()
    cases.append((_values("random", sum(small), seed=12), _layout(small)))
    for c, segs in cases:
        c = c.to(dev)
        for p in (0.0, 0.5, 1.0, 2.0, math.inf):
            got = K.quantize_pack(c, segs, levels, p, 2.0, bits, impl=impl)
            want = K.wire_of(K.quantize_q(c, segs, levels, p), levels, bits)
            assert got.dtype == want.dtype and torch.equal(got, want), (p, len(segs))
            if dev.type == "cpu":  # and the spec itself: lp_quantize tensor by tensor, its own lp_mean
                spec = torch.cat([lp_quantize(c[o:o + m], levels, p, 2.0) for o, m in segs])
                assert torch.equal(want, K.wire_of(spec, levels, bits)), (p, len(segs))


def _count_kernel_calls(monkeypatch) -> list[str]:
    """The names of the compiled kernels called from now on (appended as they run)."""
    calls: list[str] = []
    real = K.compiled_kernel

    def counting(fn, *static):
        k = real(fn, *static)
        return lambda *a: (calls.append(fn.__name__), k(*a))[1]

    monkeypatch.setattr(K, "compiled_kernel", counting)
    monkeypatch.setattr(KQ, "compiled_kernel", counting)  # the quantizers' blocks are called from there
    return calls


@compiled
def test_quantize_pack_launches_do_not_grow_with_the_number_of_tensors(monkeypatch):
    """The quantize-and-pack pass is one kernel call whatever the number of tensors (the norms'
    calls: test_norm_calls_do_not_grow_with_the_number_of_tensors)."""
    calls = _count_kernel_calls(monkeypatch)
    for ntensors in (1, 40, 400):
        sizes = [257 + 31 * i for i in range(ntensors)] if ntensors > 1 else [4099]
        c = _values("random", sum(sizes), seed=ntensors)
        calls.clear()
        got = K.quantize_pack(c, _layout(sizes), 7, 1.0, 2.0, 4, impl="compiled")
        assert calls == ["_k_quant_blocks"], calls
        assert torch.equal(got, K.wire_of(K.quantize_q(c, _layout(sizes), 7, 1.0), 7, 4))


# ---- per-tensor norms in calls per distinct size ------------------------------------------------
def _norm_cases() -> list[tuple[str, torch.Tensor, list[tuple[int, int]]]]:
    """(name, c, layout) for segment_lp_means: tensors of tiny (1e-30), huge (1e30), zero and
    tie (+-1) values and odd lengths side by side; 300 small tensors of random lengths; a
    transformer-like layout (sizes repeating per layer, evenly spaced: strided rows); equal sizes
    unevenly spaced (gathered rows); rows from ATen's thread-split size (32768) up; 70 tensors of
    one size (70 rows: ATen's vectorized loop, not its scalar tail, would take most of the means'
    final pow / exp, and round differently from lp_mean's 0-d tensors)."""
    sizes = [3073, 7, 1021, 0, 2053, 1, 1024, 129, 5131]
    scale = [1e-30, 1.0, 1e30, 0.0, 0.0, 3.0, -1.0, 1e-3, 1e3]
    parts = []
    for i, (m, sc) in enumerate(zip(sizes, scale)):
        v = _values("tie" if i == 6 else "random", m, seed=i)
        parts.append(v * sc if sc else torch.zeros(m))
    small = torch.randint(1, 60, (300,), generator=_gen(11)).tolist()
    layers = [768, 2305, 768, 3 * 1001] * 12
    uneven = [5, 7, 5, 7, 9, 5, 13, 7, 5, 70_000, 33_000, 70_000, 1, 33_000]
    out = [("mixed", torch.cat(parts), _layout(sizes))]
    for name, sz in (("300 small", small), ("layers", layers), ("uneven", uneven), ("70 equal", [97] * 70)):
        c = _values("random", sum(sz), seed=len(sz))
        c[:sz[0]] *= 1e-30
        out.append((name, c, _layout(sz)))
    return out


@pytest.mark.parametrize("threads", [1, 2])
def test_segment_lp_means_is_lp_mean_per_tensor(threads):
    """On CPU every segment's M_p from the row reductions has lp_mean's bits, for p = 0, 0.5, 1,
    1.5, 2, 3, inf, float32 / bfloat16 / float64 inputs, on one thread and on two (where ATen
    splits the reference's reductions and loops of 32768+ elements across threads; float32 and
    the layouts with such tensors, to stay fast on a shared machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    dtypes = (torch.float32, torch.bfloat16, torch.float64) if threads == 1 else (torch.float32,)
    try:
        for name, c, segs in _norm_cases():
            if threads > 1 and max(m for _, m in segs) < 32768:
                continue
            for dt in dtypes:
                x = c.to(dt)
                for p in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, math.inf):
                    got = segment_lp_means(x, segs, p)
                    want = torch.stack([lp_mean(x[o:o + m], p) for o, m in segs])
                    assert got.dtype == want.dtype and torch.equal(got, want), (name, dt, p)
    finally:
        torch.set_num_threads(before)


def test_segment_lp_means_on_cuda_is_close_to_lp_mean():
    """On CUDA a row reduction may round differently from lp_mean's whole-tensor one, so there
    segment_lp_means defines the norms (quantize_q and quantize_pack share it, checked byte for
    byte by the quantize_pack tests); it must still be M_p to float32 accuracy."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible")
    for name, c, segs in _norm_cases():
        x = c.cuda()
        for p in (0.0, 1.0, 2.0, math.inf):
            got = segment_lp_means(x, segs, p).cpu()
            want = torch.stack([lp_mean(c[o:o + m], p) for o, m in segs])
            assert torch.allclose(got, want, rtol=1e-5, atol=0), (name, p)


class _CountOps(TorchDispatchMode):
    """Counts the ATen calls made inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def test_norm_calls_do_not_grow_with_the_number_of_tensors(monkeypatch):
    """A transformer-like layout of 1, 40 and 400 tensors (sizes repeating per layer): the norms
    of every tensor take the same number of ATen calls for 40 tensors as for 400, and fewer than
    one per tensor (they grow with the distinct sizes and with the elements past one CPU chunk,
    comm.quantize.CPU_CHUNK, not with the tensors; the per-tensor loop this replaces made 5+
    calls per tensor), no per-tensor lp_mean runs, and the values stay lp_mean's."""
    per_tensor = []
    monkeypatch.setattr(Q, "lp_mean", lambda *a: per_tensor.append(1) or lp_mean(*a))
    for p in (0.0, 1.0, 2.0):
        counts = {}
        for ntensors in (1, 40, 400):
            sizes = [[7, 129, 301, 61][i % 4] for i in range(ntensors)]
            segs = _layout(sizes)
            c = _values("random", sum(sizes), seed=ntensors)
            segment_lp_means(c, segs, p)  # the layout's plan is built once, outside the count
            with _CountOps() as mode:
                got = segment_lp_means(c, segs, p)
            counts[ntensors] = mode.calls
            assert torch.equal(got, torch.stack([lp_mean(c[o:o + m], p) for o, m in segs]))
        assert counts[1] <= counts[40] == counts[400] < 400, (p, counts)
    assert not per_tensor
    c = _values("random", 40 * 300, seed=1)
    K.quantize_q(c, _layout([300] * 40), 7, 1.0)  # the reference's norms: no per-tensor lp_mean either
    assert not per_tensor


@compiled
@pytest.mark.parametrize("bits,levels", [(4, 7), (8, 127)])
def test_quantize_pack_stochastic_consumes_the_same_randoms(bits, levels, kdev):
    dev, impl = kdev
    n = 1000003
    c = _values("random", n, seed=5).to(dev)
    segs = _segments(n)
    g1, g2 = _gen(42, dev), _gen(42, dev)
    for _ in range(2):  # two steps: the generators must stay in lockstep
        got = K.quantize_pack(c, segs, levels, 1.0, 2.0, bits, "stochastic", g1, impl=impl)
        ref = K.wire_of(K.quantize_q(c, segs, levels, 1.0, 2.0, "stochastic", g2), levels, bits)
        assert torch.equal(got, ref)
    assert torch.equal(g1.get_state(), g2.get_state())


@compiled
@pytest.mark.parametrize("bits,levels", [(2, 1), (4, 7), (16, 127)])
def test_quantize_pack_stochastic_one_stream_over_the_flat_vector(bits, levels, monkeypatch):
    """Stochastic rounding draws its uniforms chunk by chunk over the flat vector (chunks of 2
    blocks here, so many chunks and boundaries), in the fused path and in the reference
    quantize_q. On CPU both equal the per-tensor draws of lp_quantize (today's reference: bytes and
    generator state), for mixed, tiny/huge-norm, zero and 300-small-tensor layouts and p = 0, 1, 2,
    inf; and the kernel calls follow the chunks, not the tensors."""
    monkeypatch.setattr(KQ, "STOCH_CHUNK", 2)
    B = K.QBLOCK
    sizes = [3 * B + 1, 7, B - 3, 2 * B + 5, 1, B, 129, 5 * B + 11, 0, 9000]
    mixed = _values("random", sum(sizes), seed=3)
    mixed[:3 * B + 1] *= 1e-30
    mixed[3 * B + 8:4 * B + 5] *= 1e30
    mixed[4 * B + 5:6 * B + 10] = 0.0
    small = torch.randint(1, 60, (300,), generator=_gen(4)).tolist()
    for c, segs in ((mixed, _layout(sizes)), (_values("random", sum(small), seed=5), _layout(small))):
        for p in (0.0, 1.0, 2.0, math.inf):
            g1, g2, g3 = _gen(42), _gen(42), _gen(42)
            for _ in range(2):
                got = K.quantize_pack(c, segs, levels, p, 2.0, bits, "stochastic", g1, impl="compiled")
                q = K.quantize_q(c, segs, levels, p, 2.0, "stochastic", g2)
                assert torch.equal(got, K.wire_of(q, levels, bits)), (len(segs), p)
                per_tensor = torch.cat([lp_quantize(c[o:o + m], levels, p, 2.0, "stochastic", g3) for o, m in segs])
                assert torch.equal(q, per_tensor), (len(segs), p)
            assert torch.equal(g1.get_state(), g2.get_state())
            assert torch.equal(g2.get_state(), g3.get_state())
    calls = _count_kernel_calls(monkeypatch)
    monkeypatch.setattr(KQ, "STOCH_CHUNK", 256)
    for ntensors in (1, 40, 400):
        sz = [257 + 31 * i for i in range(ntensors)] if ntensors > 1 else [4099]
        c = _values("random", sum(sz), seed=ntensors)
        calls.clear()
        K.quantize_pack(c, _layout(sz), levels, 1.0, 2.0, bits, "stochastic", _gen(1), impl="compiled")
        assert calls == ["_k_quant_blocks_stoch"] * -(-(sum(sz) // B) // 256), (ntensors, calls)


@compiled
@pytest.mark.parametrize("bits,levels", [(4, 3), (8, 31), (16, 127)])
def test_quantize_pack_inf_and_nan_inputs(bits, levels, kdev):
    """An overflowing gradient: +-inf makes its tensor's M_p inf (scale 0, y = inf * 0 = NaN there)
    and a NaN makes it NaN (scale 0). The reference converts that NaN to q = 0; the kernels must
    give the same lane, not INT32_MIN's low bits (a full negative vote), in whole blocks and in the
    gathered boundary words, with nearest and stochastic rounding."""
    dev, impl = kdev
    B = K.QBLOCK
    sizes = [3 * B + 5, 2 * B - 7, 4 * B]
    c = _values("random", sum(sizes), seed=9)
    c[5], c[3 * B + 1], c[3 * B + 20] = float("inf"), float("-inf"), float("nan")  # blocks and boundaries
    c[5 * B + 100] = float("nan")
    c = c.to(dev)
    segs = _layout(sizes)
    for p in (1.0, 2.0, math.inf):
        for rnd in ("nearest", "stochastic"):
            g1, g2 = _gen(3, dev), _gen(3, dev)
            got = K.quantize_pack(c, segs, levels, p, 2.0, bits, rnd, g1, impl=impl)
            want = K.wire_of(K.quantize_q(c, segs, levels, p, 2.0, rnd, g2), levels, bits)
            assert torch.equal(got, want), (p, rnd, (got != want).nonzero()[:5].tolist())


def test_stochastic_bounds_cut_whole_blocks_and_follow_the_device():
    """The chunks of the stochastic stream: whole blocks, the partial block in the last chunk, no
    chunk of one block, one chunk under 2 blocks; CUDA's chunks are STOCH_CHUNK_CUDA blocks."""
    B = K.QBLOCK
    assert K.stochastic_bounds(0, "cpu") == [0, 0]
    assert K.stochastic_bounds(2 * B - 1, "cpu") == [0, 2 * B - 1]
    n = (2 * KQ.STOCH_CHUNK + 1) * B + 7  # the last chunk would be one block: it joins the one before
    assert K.stochastic_bounds(n, "cpu") == [0, KQ.STOCH_CHUNK * B, n]
    n = (KQ.STOCH_CHUNK + 2) * B + 7
    assert K.stochastic_bounds(n, "cpu") == [0, KQ.STOCH_CHUNK * B, n]
    n = (KQ.STOCH_CHUNK_CUDA + 5) * B
    assert K.stochastic_bounds(n, "cuda") == [0, KQ.STOCH_CHUNK_CUDA * B, n]
    assert len(K.stochastic_bounds(n, "cpu")) - 1 == -(-(KQ.STOCH_CHUNK_CUDA + 5) // KQ.STOCH_CHUNK)


def test_lp_quantize_rounds_with_given_uniforms():
    x = _values("random", 5000, seed=11)
    g1, g2 = _gen(5), _gen(5)
    u = torch.rand(5000, generator=g2)
    assert torch.equal(lp_quantize(x, 3, 1.0, 2.0, "stochastic", g1), lp_quantize(x, 3, 1.0, 2.0, "stochastic",
                                                                              uniforms=u))
    with pytest.raises(ValueError, match="uniforms"):
        lp_quantize(x, 3, 1.0, 2.0, "stochastic", uniforms=u[:10])


def test_quantize_pack_bad_arguments():
    c = torch.randn(100)
    with pytest.raises(ValueError, match="segments"):
        K.quantize_pack(c, [(0, 50)], 1, 1.0, impl="eager")
    with pytest.raises(ValueError, match="bits"):
        K.quantize_pack(c, [(0, 100)], 1, 1.0, bits=3, impl="eager")
    with pytest.raises(ValueError, match="levels"):
        K.quantize_pack(c, [(0, 100)], 8, 1.0, bits=4, impl="eager")


# ---- unpack -> sum -----------------------------------------------------------------------------
def _summed_wire(qs: list[torch.Tensor], levels: int, bits: int) -> torch.Tensor:
    """SUM of the ranks' wires as the allreduce computes it (int32 words wrap around)."""
    wires = [K.wire_of(q, levels, bits).to(torch.int64) for q in qs]
    total = sum(wires)
    if bits == 16:
        return ((total + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32)
    assert total.numel() == 0 or int(total.max()) < 256  # no lane carried
    return total.to(torch.uint8)


@compiled
@pytest.mark.parametrize("bits", WIRE_BITS)
@pytest.mark.parametrize("n", [0, 9, 71, 1000003])
def test_unpack_sum(bits, n, kdev):
    dev, impl = kdev
    for P in (1, 2, 3, 4, 5):
        for levels in (0, max_levels(P, bits) if bits < 16 else 127):
            if levels == 0 and P > (1 << bits) - 1 or levels < 0:
                continue
            qs = []
            for r in range(P):
                if levels == 0:
                    qs.append(torch.randint(0, 2, (n,), generator=_gen(r + n)).to(torch.int8) * 2 - 1)
                else:
                    qs.append(torch.randint(-levels, levels + 1, (n,), generator=_gen(r + n)).to(torch.int8))
            wire = _summed_wire(qs, levels, bits).to(dev)
            want = sum(q.to(torch.int32) for q in qs) if qs else torch.zeros(n, dtype=torch.int32)
            got = K.unpack_sum(wire, bits, n, levels, P, impl=impl)
            assert got.dtype == torch.int32 and got.device == wire.device and torch.equal(got.cpu(), want)
            assert torch.equal(got, K.unpack_sum_reference(wire, bits, n, levels, P))
            sgn = K.unpack_sum(wire, bits, n, levels, P, sign=True, impl=impl)
            assert sgn.dtype == torch.float32 and torch.equal(_bits(sgn.cpu()), _bits(torch.sign(want).float()))
            for dt in (torch.float32, torch.int8):  # the eager sign: one-byte lanes against the offset
                sgn = K.unpack_sum(wire, bits, n, levels, P, sign=True, dtype=dt, impl="eager")
                assert sgn.dtype == dt and torch.equal(sgn.cpu(), torch.sign(want).to(dt))
            if bits == 4:  # an int8 update buffer (one more graph; one lane width is enough)
                buf = torch.empty(n, dtype=torch.int8, device=dev)
                K.unpack_sum(wire, bits, n, levels, P, sign=True, dtype=torch.int8, out=buf, impl=impl)
                assert torch.equal(buf.cpu(), torch.sign(want).to(torch.int8))


@compiled
@pytest.mark.parametrize("bits", [2, 4, 8, 16])
def test_unpack_sum_all_zero_votes_and_exact_ties(bits, kdev):
    """Sums of exactly zero (every rank sends 0, or +L and -L cancel, or +1 and -1 signs) give
    sum 0 and sign 0, not +-1."""
    dev, impl = kdev
    n, P = 1001, 2
    L = max_levels(P, bits) if bits < 16 else 127
    cases = [([torch.zeros(n, dtype=torch.int8)] * P, L),
             ([torch.full((n,), L, dtype=torch.int8), torch.full((n,), -L, dtype=torch.int8)], L),
             ([torch.ones(n, dtype=torch.int8), -torch.ones(n, dtype=torch.int8)], 0)]
    for qs, levels in cases:
        if levels == 0 and bool((qs[0] == 0).any()):  # L = 0 lanes carry signs only
            continue
        wire = _summed_wire(qs, levels, bits).to(dev)
        assert not K.unpack_sum(wire, bits, n, levels, P, impl=impl).any()
        assert not K.unpack_sum(wire, bits, n, levels, P, sign=True, impl=impl).any()
        assert not K.unpack_sum(wire, bits, n, levels, P, sign=True, impl="eager").any()


# ---- unpack -> majority --------------------------------------------------------------------------
def _majority_independent(recv: torch.Tensor, P: int, step: int) -> torch.Tensor:
    """tb(sum of the P signs, step) from the Lion Cub App. B.1 definition, in int64."""
    c = recv.numel() // P
    votes = unpack_bits(recv, recv.numel() * 8).view(P, c * 8).to(torch.int64) * 2 - 1
    s = votes.sum(0)
    flags = (s > 0) | ((s == 0) & bool(step % 2))
    return tb_packed(flags.float() * 2 - 1, 1) if c else torch.empty(0, dtype=torch.uint8)


@compiled
@pytest.mark.parametrize("P", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("c", [0, 1, 9, 300, 125001])
def test_unpack_majority(P, c, kdev):
    dev, impl = kdev
    g = _gen(P * 1000 + c)
    half = torch.randint(0, 256, (P // 2, c), generator=g, dtype=torch.uint8)
    odd = torch.randint(0, 256, (P % 2, c), generator=g, dtype=torch.uint8)
    inputs = {
        "random": torch.randint(0, 256, (P * c,), generator=g, dtype=torch.uint8),
        "zero": torch.zeros(P * c, dtype=torch.uint8),
        # complementary row pairs: exactly P/2 "+" votes everywhere for even P (the tie break)
        "tie": torch.cat([half, 255 - half, odd]).reshape(-1),
    }
    for name, recv in inputs.items():
        rd = recv.to(dev)
        for step in (1, 2):
            got = K.unpack_majority(rd, P, step, impl=impl)
            assert torch.equal(got, local_majority(rd, P, step)), name
            assert torch.equal(got.cpu(), _majority_independent(recv, P, step)), name


# ---- the Lion passes ----------------------------------------------------------------------------
def _rational_fma32(a: float, b: float, c: float) -> float:
    """Correctly rounded float32 of a*b + c, by exact rational arithmetic (ties to even)."""
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    r = np.float32(float(exact))
    best = None
    for cand in (np.nextafter(r, np.float32(-np.inf)), r, np.nextafter(r, np.float32(np.inf))):
        if not np.isfinite(cand):
            continue
        d = abs(Fraction(float(cand)) - exact)
        even = int(np.array(cand).view(np.int32)) % 2 == 0
        if best is None or d < best[0] or (d == best[0] and even):
            best = (d, cand)
    return float(best[1])


@compiled
def test_fma32_is_correctly_rounded(dev):
    """Crafted double-rounding traps (the float64 sum is a float32 midpoint, the exact value is
    not) plus random cases, against exact rational arithmetic and against eager add_(alpha).
    On CUDA _fma32 is add-with-alpha, which inductor must lower to a hardware fma (as eager)."""
    # a*b = +-(1 - 2**-36) * 2**-24 next to c = +-(1 + 2**-23): the exact value is 2**-60 off the
    # float32 midpoint, which float64 cannot hold
    e, u, v = 2.0 ** -12, 1 + 2 ** -18, 1 - 2 ** -18
    a_trap = [u * e, -u * e, -u * e, u * e]
    b_trap = [v * e] * 4
    c_trap = [1 + 2 ** -23, 1 + 2 ** -23, -(1 + 2 ** -23), -(1 + 2 ** -23)]
    g = _gen(9)
    a = torch.cat([torch.tensor(a_trap), torch.randn(3000, generator=g) * 1e3])
    b = torch.cat([torch.tensor(b_trap), torch.randn(3000, generator=g) * 1e-3])
    c = torch.cat([torch.tensor(c_trap), torch.randn(3000, generator=g)])
    # the traps really are traps: float64 sum, then float32, is wrong there
    naive = (a[:4].double() * b[:4].double() + c[:4].double()).float()
    want = torch.tensor([_rational_fma32(*v) for v in zip(a.tolist(), b.tolist(), c.tolist())])
    assert (naive != want[:4]).all()
    fma = torch.compile(lambda a, b, c: Lion._fma32(a, b, c), dynamic=True)
    ad, cd = a.to(dev), c.to(dev)
    got = torch.stack([fma(ad[i:i + 1].expand(64).contiguous(), float(b[i]), cd[i:i + 1].expand(64).contiguous())[0]
                       for i in range(4)]).cpu()
    assert torch.equal(got, want[:4])
    for bv in (1e-3, 0.1, 0.9, 0.01):
        bb = K.f32(bv)
        got = fma(ad, bb, cd)
        want = torch.tensor([_rational_fma32(x, bb, z) for x, z in zip(a.tolist(), c.tolist())])
        assert torch.equal(got.cpu(), want)
        assert torch.equal(got, cd.clone().add_(ad, alpha=bv))  # eager CPU and CUDA round as one fma


def _lion_state(n: int, kind: str, seed: int):
    g = _gen(seed)
    if kind == "zero":
        return torch.zeros(n), torch.zeros(n)
    m = torch.randn(n, generator=g) * torch.exp(3 * torch.randn(n, generator=g))
    gr = torch.randn(n, generator=g) * torch.exp(3 * torch.randn(n, generator=g))
    if kind == "special" and n > 20:
        m[:8] = torch.tensor([0.0, -0.0, float("inf"), 3.0e38, -3.0e38, 1e-45, float("nan"), 1.0])
        gr[:8] = torch.tensor([-0.0, -0.0, 1.0, 3.0e38, 3.0e38, -1e-45, 1.0, float("inf")])
        gr[8:16] = -m[8:16] * 9.0  # b1*m + (1-b1)*g cancels to ~0
    return m, gr


@compiled
@pytest.mark.parametrize("kind", ["random", "zero", "special"])
def test_lion_passes_bit_identical(kind, dev):
    shapes = [(1000, 257), (7,), (33, 3), (100003,)]
    tensors = [_lion_state(math.prod(s), kind, i) for i, s in enumerate(shapes)]
    moms = [m.view(s).to(dev) for (m, _), s in zip(tensors, shapes)]
    grads = [g.view(s).to(dev) for (_, g), s in zip(tensors, shapes)]
    flat = torch.empty(sum(m.numel() for m in moms), device=dev)
    offs = np.cumsum([0] + [m.numel() for m in moms])
    outs = [flat[offs[i]:offs[i + 1]].view(s) for i, s in enumerate(shapes)]
    for beta1, beta2 in ((0.9, 0.99), (0.95, 0.98)):
        m_ref = [m.clone() for m in moms]
        m_fused = [m.clone() for m in moms]
        m_sep = [m.clone() for m in moms]
        ref = lion_direction(m_ref, grads, beta1, out=[torch.empty_like(o) for o in outs])
        momentum_update_(m_ref, grads, beta2)
        Lion.fused_lion_direction_momentum_(m_fused, grads, beta1, beta2, outs, impl="compiled")
        for a, b in zip(outs, ref):
            assert torch.equal(_bits(a), _bits(b))
        for a, b in zip(m_fused, m_ref):
            assert torch.equal(_bits(a), _bits(b))
        Lion.fused_lion_direction_(m_sep, grads, beta1, outs, impl="compiled")
        Lion.fused_momentum_update_(m_sep, grads, beta2, impl="compiled")
        for a, b, c, d in zip(outs, ref, m_sep, m_ref):
            assert torch.equal(_bits(a), _bits(b)) and torch.equal(_bits(c), _bits(d))
        for lr, wd in ((1e-3, 0.1), (3e-4, 0.0), (6e-5, 1.0)):
            for upd, is_sign in (([torch.sign(o) for o in ref], True), (ref, False),
                                 ([torch.sign(o).to(torch.int8) for o in ref], True),
                                 ([o / 3 for o in ref], False)):
                p_ref = [m.clone() for m in moms]
                p_got = [m.clone() for m in moms]
                apply_update_(p_ref, upd, lr, wd)
                Lion.fused_apply_update_(p_got, upd, lr, wd, u_is_sign=is_sign, impl="compiled")
                for a, b in zip(p_got, p_ref):
                    assert torch.equal(_bits(a), _bits(b))


# ---- dispatch, compile once -----------------------------------------------------------------
@compiled
def test_no_recompiles_across_lengths_and_hyperparameters(dev):
    """After a warm-up, new lengths, steps, P, levels and learning rates reuse the kernels."""
    seconds = K.warmup(dev, bits=(4,), levels=(1, 3), p=(1.0,), world_sizes=(2, 3), impl="compiled", check=True)
    Lion.warmup_fused_passes(dev, impl="compiled")
    assert seconds > 0
    with torch.compiler.set_stance("fail_on_recompile"):
        for n in (1000, 4099):
            x = torch.randn(n, device=dev)
            K.sign_pack(x, n, impl="compiled")
            K.quantize_pack(x, [(0, 100), (100, n - 100)], 3, 1.0, 2.0, 4, impl="compiled")
            K.quantize_pack(x, [(0, n)], 1, 1.0, 2.0, 4, impl="compiled")
            recv = torch.randint(0, 256, (4 * n,), dtype=torch.uint8, device=dev)
            K.unpack_majority(recv, 4, n, impl="compiled")
            m, g, o = torch.randn(n, device=dev), torch.randn(n, device=dev), torch.empty(n, device=dev)
            Lion.fused_lion_direction_momentum_([m], [g], 0.9 - 1e-3 * n / 1000, 0.99, [o], impl="compiled")
            Lion.fused_apply_update_([m], [torch.sign(o)], 1e-4 * n, 0.1, u_is_sign=True, impl="compiled")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")
def test_lion_passes_run_foreach_on_cuda(monkeypatch):
    """On CUDA Triton contracts fl(m*b1) + g*(1-b1) into an fma eager does not (1 ulp off):
    every impl keeps the Lion passes on the foreach kernels there."""
    monkeypatch.setattr(K, "compiled_kernel", lambda *a: pytest.fail("a Lion pass was compiled on CUDA"))
    m, g, out = (torch.randn(1000, device="cuda") for _ in range(3))
    for impl in ("auto", "compiled"):
        Lion.fused_lion_direction_momentum_([m], [g], 0.9, 0.99, [out], impl=impl)
        Lion.fused_apply_update_([m], [torch.sign(out)], 1e-3, 0.1, u_is_sign=True, impl=impl)


def test_every_kernel_has_its_own_code_object_and_source_file():
    """Dynamo's compiled-graph cache (8 graphs) is per code object, and some torch versions wrap a
    function without a source file (made by exec) in one shared frame, which would put all kernels
    on one code object. Each kernel is a distinct code object whose source file is
    comm/kernel_compile.py (where `_bound`, the code it copies, lives)."""
    import inspect

    ks = [K.compiled_kernel(KB._k_pack_v, b) for b in (1, 2, 4)] + [
        K.compiled_kernel(KB._k_tb_lanes, 4), K.compiled_kernel(KB._k_majority), K.compiled_kernel(KB._k_unpack, 4, 4, None, None)]
    assert K.compiled_kernel(KB._k_pack_v, 2) is ks[1]  # cached per (kernel, static arguments)
    assert len({id(k.fn.__code__) for k in ks}) == len(ks)
    for k in ks:
        assert inspect.isfunction(k.fn) and inspect.getsourcefile(k.fn) == inspect.getsourcefile(K.compiled_kernel.__wrapped__)


def test_dispatch_and_fallback(monkeypatch):
    x = torch.randn(1000)
    with pytest.raises(ValueError, match="impl"):
        K.sign_pack(x, 1, impl="fast")
    with pytest.raises(ValueError, match="impl"):
        K.Kernels("fast")
    assert torch.equal(K.sign_pack(x, 1), tb_packed(x, 1)) and K.resolve_impl(None) == "eager"  # None: the reference
    monkeypatch.setenv(K.NO_COMPILE_ENV, "1")
    assert "LIONCUB_NO_COMPILE" in K.compile_unavailable("cpu")
    with pytest.raises(RuntimeError, match="LIONCUB_NO_COMPILE"):
        K.sign_pack(x, 1, impl="compiled")
    with pytest.raises(RuntimeError, match="impl='native'.*LIONCUB_NO_COMPILE"):
        K.sign_pack(x, 1, impl="native")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        k = K.Kernels("auto", "cpu")  # the run's Kernels says it once, when it is built
        assert torch.equal(k.sign_pack(x, 1), tb_packed(x, 1)) and torch.equal(k.sign_pack(x, 2), tb_packed(x, 2))
    assert len([w for w in caught if "LIONCUB_NO_COMPILE" in str(w.message)]) == 1
    assert {k.which(name) for name in K.KERNELS} == {"eager"}
    assert k.warmup(bits=(4,), levels=(1,), layout=[(0, 4096)]) == 0.0
    monkeypatch.delenv(K.NO_COMPILE_ENV)
    # "auto" leaves the Lion passes on the foreach kernels on CPU (compiled they are slower)
    with monkeypatch.context() as mp:
        mp.setattr(K, "compiled_kernel", lambda *a: pytest.fail("auto compiled a Lion pass on CPU"))
        m, g, out = torch.randn(100), torch.randn(100), torch.empty(100)
        Lion.fused_lion_direction_momentum_([m], [g], 0.9, 0.99, [out], impl="auto")
        Lion.fused_apply_update_([m], [torch.sign(out)], 1e-3, 0.1, u_is_sign=True, impl="auto")


# ---- comm.kernels=auto: the device's fast implementation, timed only where that pays ----------
def test_a_setting_string_gets_a_kernels_of_its_own_call_and_no_module_state(monkeypatch):
    """The kernel choice lives in a Kernels object a run builds once and passes; a call given the
    setting "auto" builds one for that call: a choice another Kernels made (here a rejection) does
    not reach it, and comm.kernels keeps no Kernels at module level."""
    k = K.Kernels("auto", "cpu")
    assert K.of(k, "cpu") is k
    a, b = K.of("auto", "cpu"), K.of("auto", "cpu")
    assert a is not b and a.setting == b.setting == "auto"
    k.chosen["sign_pack"] = "eager"  # what a warm-up's rejection leaves
    fast = "eager" if native.unavailable("cpu") else "native"
    assert K.kernel_impl("auto", "cpu", "sign_pack") == fast and K.kernel_impl(k, "cpu", "sign_pack") == "eager"
    x = torch.randn(5000)
    assert torch.equal(K.sign_pack(x, 3, impl="auto"), tb_packed(x, 3))

    def holds_kernels(v) -> bool:
        vals = v.values() if isinstance(v, dict) else v if isinstance(v, (list, set, tuple)) else [v]
        return any(isinstance(x, K.Kernels) for x in vals)

    assert [n for n, v in vars(K).items() if holds_kernels(v)] == []


def test_auto_on_cpu_runs_native_checked_and_never_timed(monkeypatch):
    """On CPU auto runs the native loops (the eager reference where they cannot be built), checks them
    against the reference in warm-up once per configuration (the 1-bit and the p-bit kernels), and
    times nothing."""
    why = native.unavailable("cpu")
    k = K.Kernels("auto", "cpu")
    assert {k.which(name) for name in K.KERNELS} == {"eager" if why else "native"}
    timed, checked = [], []
    monkeypatch.setattr(K.Kernels, "choose", lambda self, kernel, *a, **kw: timed.append(kernel))
    real = K.check_against_reference
    monkeypatch.setattr(K, "check_against_reference", lambda kk, cfg: checked.append(kk.setting) or real(kk, cfg))
    layout = _layout([40_000, 999, 30_001])
    for _ in range(2):
        k.warmup(bits=(4,), levels=(1,), p=(1.0,), world_sizes=(4,), layout=layout)
        k.warmup(world_sizes=(4,), layout=layout)
    assert timed == [] and checked == ([] if why else ["native", "native"]) and k.lines() == []  # once per configuration
    assert K.kernel_impl("auto", "cpu", "quantize_pack") == k.which("quantize_pack")  # a call's own Kernels agrees


def test_choose_never_keeps_a_candidate_whose_bytes_differ():
    x = torch.randn(100_000)
    x[::7] = 0.0
    ref = lambda: tb_packed(x, 1)  # noqa: E731
    wrong = tb_packed(x, 2)  # other bytes (the zeros' tie break differs), returned at no cost
    assert not torch.equal(ref(), wrong)
    k = K.Kernels("auto", "cpu")
    got = k.choose("sign_pack", {"eager": ref, "fast_but_wrong": lambda: wrong}, repeats=3, n=x.numel())
    assert got == "eager" and k.which("sign_pack") == "eager"
    (rec,) = k.records
    assert rec["rejected"] == ["fast_but_wrong"] and rec["chosen"] == "eager" and "bytes differ" in rec["line"]
    # a right candidate that is faster is kept, and the Kernels then dispatches to it
    slow = lambda: (time.sleep(0.01), tb_packed(x, 1))[1]  # noqa: E731
    got = k.choose("sign_pack", {"eager": slow, "compiled": ref, "fast_but_wrong": lambda: wrong}, repeats=3)
    assert got == "compiled" and k.which("sign_pack") == "compiled"
    assert k.lines() == [k.records[-1]["line"]] and "sign_pack on cpu: compiled" in k.lines()[0]
    assert K.Kernels("eager").which("sign_pack") == "eager"  # eager stays eager


@compiled
def test_auto_times_the_real_size_where_it_measures_and_rejects_wrong_bytes(monkeypatch):
    """Where auto measures (CUDA's sign packing and majority: `_measure`, run here on CPU's compiled
    kernels) it times eager against compiled on inputs of the layout's size, and a compiled
    sign_pack that is right at the warm-up check's small size but wrong at the real size is
    rejected: the reference runs."""
    real = K.Kernels.sign_pack

    def broken(self, x, step, length=None):
        out = real(self, x, step, length)
        if self.setting == "compiled" and x.numel() > 10_000:
            out = out.clone()
            out[0] ^= 1
        return out

    monkeypatch.setattr(K.Kernels, "sign_pack", broken)
    k = K.Kernels("auto", "cpu")
    k.chosen = dict.fromkeys(K.KERNELS, "compiled")  # what auto starts from on CUDA
    cfg = dict(bits=(), world_sizes=(3,))
    k._measure(_layout([40_000, 999, 30_001]), cfg, 2.0, 2)
    recs = {r["kernel"]: r for r in k.records}
    assert set(recs) == set(K.MEASURED_ON_CUDA)
    assert recs["sign_pack"]["chosen"] == "eager" and recs["sign_pack"]["rejected"] == ["compiled"]
    assert recs["sign_pack"]["n"] == 71_000 and k.which("sign_pack") == "eager"
    assert recs["unpack_majority"]["rejected"] == [] and set(recs["unpack_majority"]["ms"]) == {"eager", "compiled"}
    assert k.which("unpack_majority") == KC.fastest(recs["unpack_majority"]["ms"])
    k._measure(_layout([5000]), dict(bits=(4,), world_sizes=(3,)), 2.0, 2)  # the p-bit kernels: compiled, untimed
    assert len(k.records) == 2 and k.which("quantize_pack") == "compiled"


def test_a_mismatch_under_auto_runs_eager_and_a_named_setting_raises():
    """The warm-up's check found fast-path bytes that differ: under auto those kernels run the
    reference (recorded, so every rank of a group agrees on eager); a setting that names the
    implementation raises instead."""
    k = K.Kernels("auto", "cpu")
    fast = k.which("sign_pack")
    with pytest.warns(UserWarning, match="differ from the reference"):
        k.reject(["sign_pack[torch.float32]", "unpack_majority[P=2]"], fast)
    assert k.which("sign_pack") == "eager" and k.which("unpack_majority") == "eager"
    assert k.which("quantize_pack") == fast
    mine = {f"{r['kernel']}|{r['device']}": {"ms": r["ms"]} for r in k.records}
    other = {"sign_pack|cpu": {"ms": {"eager": 5.0, "compiled": 1.0}}}
    assert KC.merge_choices([mine, other])["sign_pack|cpu"] == "eager"
    with pytest.raises(RuntimeError, match="differ from the reference"):
        K.Kernels("compiled").reject(["sign_pack[torch.float32]"], "compiled")
    with pytest.raises(RuntimeError, match="differ from the reference"):
        K.report_mismatch(["p[2]"], torch.device("cpu"), "compiled")


# ---- no 4-byte-per-element temporaries in pack / unpack -------------------------------------
def _allocations(fn) -> list[int]:
    """Bytes of every tensor allocation fn makes on the CPU (inside compiled code too), from
    torch.profiler's memory profile, largest first."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        fn()
    timeline = prof._memory_profile().timeline
    return sorted((nbytes for _, action, _, nbytes in timeline if action.name == "CREATE"), reverse=True)


@compiled
def test_pack_and_unpack_allocate_at_most_one_byte_per_element():
    """No pack or unpack path of the wire, compiled, native or eager, allocates a float32 / int32 (or any
    4-byte) temporary of the vector's length: every allocation is at most n bytes (int8 signs,
    one-byte lanes, packed words). The one exception, checked apart: Lp with p = 1 keeps |c| of the
    largest tensor (or of a 1 MiB chunk of smaller ones) in a float buffer, because M_1 must be
    the reference's own .mean() over each tensor's |c| to give its bytes (a caller may pass that
    buffer in as `scratch` and reuse it)."""
    n, P = 3_000_017, 4  # more than the cache-blocked loops' fixed 1 MiB buffers (comm.packing.CPU_BLOCK)
    x = _values("random", n, seed=1)
    sizes = [900_001, 7, 750_000, 129, n - 1_650_137]
    segs = _layout(sizes)
    length = -(-n // (8 * P)) * 8 * P
    recv = torch.randint(0, 256, (length // 8,), generator=_gen(2), dtype=torch.uint8)
    L4 = max_levels(P, 4)
    wire4 = K.quantize_pack(x, segs, L4, math.inf, 2.0, 4, impl="compiled")
    wire1 = K.quantize_pack(x, segs, 0, None, 2.0, 4, impl="compiled")
    scratch = torch.empty(max(sizes))
    paths = {
        "sign_pack compiled": lambda: K.sign_pack(x, 1, length, impl="compiled"),
        "sign_pack eager": lambda: K.sign_pack(x, 1, length, impl="eager"),
        "unpack_majority compiled": lambda: K.unpack_majority(recv, P, 1, impl="compiled"),
        "unpack_majority eager": lambda: K.unpack_majority(recv, P, 1, impl="eager"),
        "unpack_signs": lambda: unpack_signs(recv, n),
        "quantize_pack signs only": lambda: K.quantize_pack(x, segs, 0, None, 2.0, 4, impl="compiled"),
        "quantize_pack signs only eager": lambda: K.quantize_pack(x, segs, 0, None, 2.0, 4, impl="eager"),
        "quantize_pack sign quantizer eager": lambda: K.quantize_pack(x, segs, L4, None, 2.0, 4, impl="eager"),
        "quantize_pack sign quantizer": lambda: K.quantize_pack(x, segs, L4, None, 2.0, 4, impl="compiled"),
        "quantize_pack linf": lambda: K.quantize_pack(x, segs, L4, math.inf, 2.0, 4, impl="compiled"),
        "quantize_pack l1 with scratch": lambda: K.quantize_pack(x, segs, L4, 1.0, 2.0, 4, impl="compiled",
                                                                scratch=scratch),
        "quantize_pack 8-bit l1 with scratch": lambda: K.quantize_pack(x, segs, 127, 1.0, 2.0, 8, impl="compiled",
                                                                      scratch=scratch),
    }
    native_ok = native.unavailable("cpu") is None
    if native_ok:  # comm.native's loops write straight into their outputs
        paths.update({
            "sign_pack native": lambda: K.sign_pack(x, 1, length, impl="native"),
            "unpack_majority native": lambda: K.unpack_majority(recv, P, 1, impl="native"),
            "quantize_pack signs only native": lambda: K.quantize_pack(x, segs, 0, None, 2.0, 4, impl="native"),
            "quantize_pack linf native": lambda: K.quantize_pack(x, segs, L4, math.inf, 2.0, 4, impl="native"),
            "quantize_pack l1 stochastic native": lambda: K.quantize_pack(x, segs, L4, 1.0, 2.0, 4, "stochastic",
                                                                         _gen(3), impl="native", scratch=scratch),
        })
    for impl in ("compiled", "eager") + (("native",) if native_ok else ()):
        for w, L in ((wire4, L4), (wire1, 0)):
            paths[f"unpack_sum sign int8 {impl} L={L}"] = (
                lambda w=w, L=L, impl=impl: K.unpack_sum(w, 4, n, L, P, sign=True, dtype=torch.int8, impl=impl))
    for fn in paths.values():  # compiled once, outside the measurement
        fn()
    limit = length + 64  # one byte per element of the padded vector
    big = {name: [b for b in _allocations(fn) if b > limit] for name, fn in paths.items()}
    assert not {name: b for name, b in big.items() if b}, big
    # the measurement sees a 4-byte temporary when there is one: the reference and L1 without scratch
    assert max(_allocations(lambda: K.unpack_sum_reference(wire4, 4, n, L4, P))) >= 4 * n
    assert [b for b in _allocations(lambda: K.quantize_pack(x, segs, L4, 1.0, 2.0, 4, impl="compiled"))
            if b > limit] == [4 * max(sizes)]


def test_merge_choices_agrees_on_what_every_rank_accepted():
    """Ranks that exchange follow one choice per kernel: among the candidates every rank accepted,
    the one whose slowest rank is fastest; a candidate some rank rejected (bytes differ there) is
    never chosen, however fast elsewhere."""
    a = {"sign_pack|cuda": {"ms": {"eager": 3.0, "compiled": 1.0}}, "unpack_sum|cuda": {"ms": {"eager": 2.0, "compiled": 1.5}}}
    b = {"sign_pack|cuda": {"ms": {"eager": 2.5, "compiled": 4.0}}, "unpack_sum|cuda": {"ms": {"eager": 2.2}}}
    got = KC.merge_choices([a, b])
    assert got == {"sign_pack|cuda": "eager", "unpack_sum|cuda": "eager"}  # 3.0 < 4.0 at the slowest rank; compiled rejected on b
    assert KC.merge_choices([a, a]) == {"sign_pack|cuda": "compiled", "unpack_sum|cuda": "compiled"}
    assert KC.merge_choices([a, {}]) == {}  # measured on one rank only: left alone
    K.Kernels("auto", "cpu").agree()  # no process group: nothing to agree, and no collective is attempted


def test_fastest_gives_ties_to_the_cheaper_candidate():
    """Within TIE of the fastest, eager beats native beats compiled (no compiler stack in the process);
    outside it, the fastest wins."""
    t = KC.TIE
    assert K.fastest({"eager": 10.0, "compiled": 1.0, "native": 5.0}) == "compiled"
    assert K.fastest({"eager": 10.0, "compiled": 1.0, "native": 1 + 0.9 * t}) == "native"
    assert K.fastest({"eager": 1 + 0.8 * t, "compiled": 1.0, "native": 1 + 0.5 * t}) == "eager"
    assert K.fastest({"compiled": 1.0, "native": 1 + 1.2 * t}) == "compiled"
    # the ranks' agreement: the slowest rank's times, then the same tie rule
    assert KC.merge_choices([{"k|cpu": {"ms": {"compiled": 50.0, "native": 50.0 * (1 + 0.9 * t)}}},
                            {"k|cpu": {"ms": {"compiled": 40.0, "native": 49.0}}}]) == {"k|cpu": "native"}


def test_the_quantizers_compile_without_fp_fusion_on_cuda_and_only_they():
    """Triton's fp fusion would turn stochastic rounding's y - floor(y) into an fma, off the
    reference's rounding (docs/results/gpu_check/README.md); the integer kernels have no float
    arithmetic to fuse and keep the default. Checked on the installed inductor:
    the options each kernel compiles with give Triton fp fusion off exactly for the quantizers,
    and CPU options are the same for every kernel."""
    from torch._inductor import config
    from torch._inductor.codegen.triton import TritonKernel

    def fusion(kernel: K.Kernel, device_type: str) -> bool:
        with config.patch(kernel.options(device_type)):
            return TritonKernel.triton_meta_common()["enable_fp_fusion"]

    floats = [K.compiled_kernel(KB._k_quant_blocks, b) for b in (4, 8)]
    floats += [K.compiled_kernel(KB._k_quant_blocks_stoch, b) for b in (4, 8)]
    ints = [K.compiled_kernel(KB._k_majority), K.compiled_kernel(KB._k_sign_bits),
            K.compiled_kernel(KB._k_unpack, 4, 1, None, None)]
    assert [fusion(k, "cuda") for k in floats] == [False] * 4
    assert [fusion(k, "cuda") for k in ints] == [True] * 3
    assert all(k.options("cpu") == KB.INDUCTOR_OPTIONS for k in floats + ints)
