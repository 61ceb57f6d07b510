"""Single-process tests of comm/: packing layout and round trips, 1-rank collectives (no
process group), CommStats bookkeeping and the Table 1 cost formulas."""
from __future__ import annotations

import math

import pytest
import torch

import comm
from comm import cost_model
from comm.packing import pack_words16, unpack_words16

LENGTHS = [0, 1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 63, 64, 65, 1001]


def reference_pack(v: torch.Tensor, bits: int) -> list[int]:
    """Byte-by-byte packing written from the documented layout with plain Python ints."""
    per = 8 // bits
    vals = [int(a) for a in v]
    out = []
    for j in range(math.ceil(len(vals) / per)):
        byte = 0
        for i in range(per):
            if j * per + i < len(vals):
                byte |= vals[j * per + i] << (i * bits)
        out.append(byte)
    return out


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", LENGTHS)
def test_pack_lanes_layout_and_round_trip(bits: int, n: int) -> None:
    g = torch.Generator().manual_seed(n * 10 + bits)
    v = torch.randint(0, 1 << bits, (n,), generator=g, dtype=torch.uint8)
    packed = comm.pack_lanes(v, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n * bits / 8)
    assert packed.tolist() == reference_pack(v, bits)
    assert torch.equal(comm.unpack_lanes(packed, bits, n), v)


@pytest.mark.parametrize("n", LENGTHS)
def test_pack_bits_layout_and_round_trip(n: int) -> None:
    b = torch.rand(n, generator=torch.Generator().manual_seed(n)) > 0.5
    packed = comm.pack_bits(b)
    assert packed.numel() == math.ceil(n / 8)
    assert packed.tolist() == reference_pack(b.to(torch.uint8), 1)
    assert torch.equal(comm.unpack_bits(packed, n), b)
    assert torch.equal(comm.unpack_signs(packed, n), b.to(torch.int8) * 2 - 1)


def test_pack_bits_known_bytes() -> None:
    # bit i of byte j = b[8j+i]: flags at 0, 3 -> 0b00001001; at 9, 15 -> byte 1 = 0b10000010
    b = torch.zeros(16, dtype=torch.bool)
    b[[0, 3, 9, 15]] = True
    assert comm.pack_bits(b).tolist() == [9, 130]


def test_pack_unaligned_views() -> None:
    # a slice with an odd storage offset must still pack correctly (word views need alignment)
    base = torch.rand(41) > 0.5
    for start in range(1, 9):
        b = base[start:start + 32]
        assert comm.pack_bits(b).tolist() == reference_pack(b.to(torch.uint8), 1)
    v = torch.randint(0, 4, (41,), dtype=torch.uint8)[3:35]
    assert comm.pack_lanes(v, 2).tolist() == reference_pack(v, 2)


def test_pack_lanes_rejects_out_of_range() -> None:
    with pytest.raises(ValueError, match="value 4 does not fit a 2-bit lane"):
        comm.pack_lanes(torch.tensor([1, 4], dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="bits must be one of"):
        comm.pack_lanes(torch.tensor([1], dtype=torch.uint8), 3)


def test_words16_round_trip_and_sum() -> None:
    v = torch.tensor([0, 65535, 1234, 40000, 7], dtype=torch.int32)
    w = pack_words16(v)
    assert w.numel() == 3 and torch.equal(unpack_words16(w, 5), v)
    # the SUM of words is exact while every lane sum < 2**16, even when the high lane sets the
    # int32 sign bit (the wire format of int_allreduce bits=16)
    a = torch.tensor([30000, 30000], dtype=torch.int32)
    b = torch.tensor([35535, 35535], dtype=torch.int32)
    assert unpack_words16(pack_words16(a) + pack_words16(b), 2).tolist() == [65535, 65535]


def test_single_rank_collectives_without_process_group() -> None:
    x = torch.tensor([0.5, -1.0, 0.0, 0.0, 3.0])
    assert comm.sign_vote_1bit(x, 1).tolist() == [1, -1, 1, 1, 1]
    assert comm.sign_vote_1bit(x, 2).tolist() == [1, -1, -1, -1, 1]
    assert comm.ps_vote(x, 2, "vote", "tree").tolist() == [1, -1, -1, -1, 1]
    assert comm.ps_vote(x, 1, "avg", "naive").tolist() == [1.0, -1.0, 1.0, 1.0, 1.0]
    assert comm.hierarchical_sign_vote(x, 2, node_size=1).tolist() == [1, -1, -1, -1, 1]
    q = torch.tensor([3, -3, 0, 1], dtype=torch.int8)
    assert comm.int_allreduce(q, 3, 4).tolist() == [3, -3, 0, 1]
    with pytest.raises(ValueError, match=r"1 \* 2 \* 8 = 16 exceeds the 4-bit lane maximum"):
        comm.int_allreduce(q, 8, 4)
    assert torch.equal(comm.allreduce_mean(x), x)


def test_commstats_bookkeeping() -> None:
    s = comm.CommStats()
    comm.sign_vote_1bit(torch.randn(100), 1, stats=s)
    comm.int_allreduce(torch.ones(10, dtype=torch.int8), 1, 2, stats=s)
    assert [c.name for c in s.calls] == ["sign_vote_1bit", "int_allreduce"]
    assert s.step_summary()["calls"] == 2 and s.totals()["bytes_sent"] == 0  # one rank: no wire
    assert s.step_summary()["pack_s"] > 0
    s.begin_step()
    assert s.step_summary()["calls"] == 0 and s.totals()["calls"] == 2
    s.reset()
    assert s.totals()["calls"] == 0 and s.calls == []


def test_cost_model_table1_values() -> None:
    P, N, a, b = 4, 1_000_000, 1e-5, 1e-9
    # hand-evaluated Table 1 rows at P=4 (log2 P = 2)
    assert cost_model.ps_naive(P, N, 32, a, b) == pytest.approx(6 * a + 8 * N * 32 * b)
    assert cost_model.ps_efficient(P, N, 32, a, b) == pytest.approx(4 * a + 2.25 * N * 32 * b)
    # one latency model per collective: the direct allreduce is an allreduce like the ring (2(P-1) alpha),
    # the 1-bit allreduce an all-to-all plus an all-gather ((P-1) alpha each); Table 1's bandwidth terms
    assert cost_model.direct_allreduce(P, N, None, a, b) == pytest.approx(6 * a + 1.5 * N * 3 * b)
    assert cost_model.direct_allreduce(P, N, 4, a, b) == pytest.approx(6 * a + 1.5 * N * 4 * b)
    assert cost_model.onebit_allreduce(P, N, 1, a, b) == pytest.approx(6 * a + 1.75 * N * b)
    assert cost_model.ring_allreduce(P, N, 32, a, b) == pytest.approx(6 * a + 1.5 * N * 32 * b)
    assert cost_model.allreduce_time(P, 8.0, a, b) == cost_model.ring_allreduce(P, 1, 8, a, b)
    assert (cost_model.all_to_all_time(P, 100, a, b) + cost_model.all_gather_time(P, 100, a, b)
            == pytest.approx(cost_model.allreduce_time(P, 100, a, b)))
    assert all(f(1, N, 32, a, b) == 0.0 for f in cost_model.TABLE1.values())
    # hierarchical = reduce-scatter + 1-bit across nodes + all-gather, the same primitives
    assert cost_model.hierarchical_onebit(P, N, 32, a, b, node_size=2) == pytest.approx(
        cost_model.reduce_scatter_time(2, N * 32, a, b) + cost_model.onebit_allreduce(2, N / 2, 1, a, b)
        + cost_model.all_gather_time(2, N, a, b))


def test_majority_threshold_equals_sign_of_2c_minus_p() -> None:
    from comm.vote import count_dtype, majority_flags
    for P in list(range(1, 20)) + [254, 255, 256, 257, 1000]:
        c = torch.arange(P + 1)
        for step in (1, 2):
            diff = 2 * c - P
            ref = (diff > 0) | ((diff == 0) & (step % 2 == 1))
            got = majority_flags(c.to(count_dtype(P)), P, step)
            assert torch.equal(got, ref), (P, step)


def test_blocked_paths_match_simple_reference() -> None:
    # lengths spanning several CPU cache blocks (2**18 elements) with ragged tails
    from comm.packing import pack_positive
    n = 3 * (1 << 18) + 13
    x = torch.randint(-1, 2, (n,), generator=torch.Generator().manual_seed(0)).float()
    for include_zero in (False, True):
        flags = x >= 0 if include_zero else x > 0
        ref = (torch.cat([flags, torch.zeros(-n % 8, dtype=torch.bool)]).view(-1, 8).to(torch.int64)
               << torch.arange(8)).sum(1).to(torch.uint8)
        packed = pack_positive(x, include_zero)
        assert torch.equal(packed, ref)
        padded = pack_positive(x, include_zero, length=n + (-n % 8) + 64)
        assert torch.equal(padded[:ref.numel()], ref) and int(padded[ref.numel():].sum()) == 0
        assert torch.equal(comm.unpack_bits(packed, n), flags)
        assert torch.equal(comm.unpack_signs(packed, n), flags.to(torch.int8) * 2 - 1)
    v = torch.randint(0, 4, (n,), dtype=torch.uint8)
    assert torch.equal(comm.unpack_lanes(comm.pack_lanes(v, 2), 2, n), v)


@pytest.mark.parametrize("block", ["small", "gpu_formula"])
def test_block_boundaries(monkeypatch, block: str) -> None:
    # block edges inside the data, inside the padding, and the one-block (GPU) layout
    import comm.packing as pk
    if block == "small":
        monkeypatch.setattr(pk, "CPU_BLOCK", 24)
    else:
        monkeypatch.setattr(pk, "_block", lambda t: -(-max(8, t.numel()) // 8) * 8)
    for n in (0, 1, 13, 24, 25, 100):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))
        x[::3] = 0.0
        for length in (-(-n // 8) * 8, -(-n // 8) * 8 + 40):
            got = pk.pack_positive(x, True, length)
            flags = torch.zeros(length, dtype=torch.bool)
            flags[:n] = x >= 0
            assert got.tolist() == reference_pack(flags.to(torch.uint8), 1), (n, length)
            assert torch.equal(pk.unpack_signs(got, n), (x >= 0).to(torch.int8) * 2 - 1)


def test_cost_model_ps_implementation_models() -> None:
    N, a, b = 1_000_000, 1e-5, 1e-9
    # naive at P=4: 3 one-bit payloads in, 3 back (vote) or 3 planes back (avg: ceil(log2 5) = 3)
    assert cost_model.ps_naive_packed(4, N, a, b) == pytest.approx(6 * a + 3 * N * 2 * b)
    assert cost_model.ps_naive_packed(4, N, a, b, up=1, back=3) == pytest.approx(6 * a + 3 * N * 4 * b)
    assert cost_model.ps_naive_packed(4, N, a, b, up=2, back=2) == pytest.approx(6 * a + 3 * N * 4 * b)  # eq. 5 exact
    # tree at P=4 (0 -> 1, 2; 1 -> 3): up = N (3 -> 1) + (2 + 1) N (1, 2 -> 0); down = 2N + N
    assert cost_model.ps_tree_packed(4, N, a, b) == pytest.approx(4 * a + 7 * N * b)
    assert cost_model.ps_tree_packed(2, N, a, b) == pytest.approx(2 * a + 2 * N * b)
    # ternary values (unit 2): 3 -> 1 sends ceil(log2 3) = 2 planes, 1 and 2 -> 0 send 3 and 2; down 2 planes
    assert cost_model.ps_tree_packed(4, N, a, b, unit=2, back=2) == pytest.approx(4 * a + (2 + 5 + 4 + 2) * N * b)
    # naive grows with P faster than the 1-bit allreduce (Lion Cub Fig. 2)
    ratios = [cost_model.ps_naive_packed(P, N, 0, b) / cost_model.onebit_allreduce(P, N, 1, 0, b)
              for P in (2, 4, 8)]
    assert ratios[0] < ratios[1] < ratios[2]
