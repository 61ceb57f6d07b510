"""optim.diloco's outer loop on real collectives (gloo), run by tests/optim/test_diloco.py at P = 2, 3.

Every rank runs Streaming DiLoCo (H = 3, F = 2, tau = 1, alpha = 0.5; 4 blocks and one tensor
outside them) with an inner SGD on rank-dependent gradients, once per wire of optim.diloco.WIRES,
and checks at every average and every outer step:

- the average equals the mean of every rank's pseudo-gradient gathered here: fp32 bit for bit at
  two ranks (a + b is exact in any order, then / 2), within fp32 rounding at more; e3m0 bit for bit against comm.e3m0's encoder
  and decoder applied as its docstring says (encode the chunks, sum the decoded copies in rank
  order, / P, encode, decode); pbit_mean bit for bit against eq. 1 with the ranks' largest block
  scale, the lanes summed as integers; bf16 within bf16 rounding; loco and sign close in direction (they are
  lossy, with error feedback);
- the global parameters are bit-identical on every rank after every outer step;
- the bytes CommStats counted at the collectives equal optim.diloco.wire_bytes summed over the
  averages that ran;
- fp32, loco and e3m0 run on a background thread (optim.diloco.background_averages, with a group of
  their own while the main thread gathers on the world group) end with the same bits as blocking.
Rank 0 prints "diloco_dist: ok" at the end; any failed check raises (non-zero exit).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from comm import CommStats  # noqa: E402
from comm.e3m0 import e3m0_decode, e3m0_encode, e3m0_layout  # noqa: E402
from optim import sync  # noqa: E402
from optim.diloco import (WIRES, DiLoCo, DiLoCoOptions, background_averages, build_averages,  # noqa: E402
                          strided_fragments, wire_bytes)

dist.init_process_group("gloo")
P, RANK = dist.get_world_size(), dist.get_rank()
AVG_GROUP = dist.new_group(list(range(P)))      # the averages' own group: a background thread may use it
SHAPES = [(16, 8), (8,), (12, 8), (8,), (40,)]   # four blocks, then one tensor outside them
STEPS = 10


def gather(x: torch.Tensor, group=None) -> list[torch.Tensor]:
    out = [torch.empty_like(x) for _ in range(P)]
    dist.all_gather(out, x.contiguous(), group=group)   # plain torch.distributed: not booked in CommStats
    return out


def e3m0_reference(xs: list[torch.Tensor], block: int) -> torch.Tensor:
    n = xs[0].numel()
    c = e3m0_layout(n, P, block)
    padded = [torch.cat([x, x.new_zeros(P * c - n)]) for x in xs]
    out = []
    for r in range(P):
        z = e3m0_decode(*e3m0_encode(padded[0][r * c:(r + 1) * c], block), block)
        for i in range(1, P):
            z = z + e3m0_decode(*e3m0_encode(padded[i][r * c:(r + 1) * c], block), block)
        out.append(e3m0_decode(*e3m0_encode(z / P, block), block))
    return torch.cat(out)[:n]


def pbit_mean_reference(xs: list[torch.Tensor], block: int) -> torch.Tensor:
    """linf, clip 1, 8 bits: M = the largest |x| of the block over the ranks, L = 255 // (2P),
    q_i = round(x_i L / M), mean = (sum_i q_i) (M / L) / P."""
    L = 255 // (2 * P)
    out = []
    for a in range(0, xs[0].numel(), block):
        M = torch.stack([x[a:a + block].abs().max() for x in xs]).max()
        if M == 0:
            out.append(torch.zeros_like(xs[0][a:a + block]))
            continue
        total = sum((x[a:a + block] * (L / M)).round().clamp(-L, L).to(torch.int32) for x in xs)
        out.append(total.to(torch.float32) * (M / L) / P)
    return torch.cat(out)


class Checked:
    """The wire's average, checked against the gathered pseudo-gradients."""

    def __init__(self, inner: sync.Exchange, wire: str, block: int) -> None:
        self.inner, self.wire, self.block, self.calls = inner, wire, block, []

    def __call__(self, x: torch.Tensor, step: int) -> torch.Tensor:
        xs = gather(x, AVG_GROUP)        # on the thread the average runs on, with its group
        ref = xs[0].clone()
        for y in xs[1:]:
            ref += y
        ref /= P
        avg = self.inner(x, step)
        self.calls.append(x.numel())
        agree = gather(avg, AVG_GROUP)
        assert all(torch.equal(agree[0], a) for a in agree), f"{self.wire}: ranks got different averages"
        if self.wire == "fp32" and P == 2:
            assert torch.equal(avg, ref), f"fp32: max |diff| {(avg - ref).abs().max()}"
        elif self.wire == "fp32":             # gloo's ring sums in its own order
            torch.testing.assert_close(avg, ref, rtol=1e-6, atol=1e-6)
        elif self.wire == "e3m0":
            assert torch.equal(avg, e3m0_reference(xs, self.block)), "e3m0: not the documented codec's mean"
        elif self.wire == "pbit_mean":
            assert torch.equal(avg, pbit_mean_reference(xs, self.block)), "pbit_mean: not eq. 1's lanes summed"
        elif self.wire == "bf16":
            # each input rounds to bf16 (8 bits of mantissa), then the sum: a mean near zero can lose
            # all its relative precision, so the bound is on the inputs' magnitude
            bound = 2 ** -7 * max(y.abs().max().item() for y in xs)
            assert (avg - ref).abs().max() <= bound, f"bf16: max |diff| {(avg - ref).abs().max()} > {bound}"
            assert (avg - ref).abs().max() > 0, "bf16: bit-identical to fp32: the wire did not round"
        else:
            cos = torch.dot(avg, ref) / (avg.norm() * ref.norm())
            assert cos > 0.5, f"{self.wire}: cosine to the mean {cos:.3f}"
        return avg

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, s: dict) -> None:
        self.inner.load_state_dict(s)


def run(wire: str, background: bool = False) -> list[torch.Tensor]:
    o = DiLoCoOptions(inner_steps=3, outer_lr=0.7, outer_momentum=0.9, fragments=2, overlap_steps=1, alpha=0.5,
                      wire=wire, block=16)
    g = torch.Generator().manual_seed(0)           # the same start on every rank
    params = [torch.randn(s, generator=g) for s in SHAPES]
    frags = strided_fragments([[p] for p in params[:4]], params[4:], 2)
    stats = CommStats(timing=False)
    ctx = sync.ExchangeContext(world_size=P, rank=RANK, group=AVG_GROUP, stats=stats)
    numels = [sum(p.numel() for p in f) for f in frags]
    avgs = [Checked(a, wire, o.block) for a in build_averages(o, numels, ctx)]
    d = DiLoCo(frags, o, background_averages(avgs) if background else avgs)
    data = torch.Generator().manual_seed(100 + RANK)
    for _ in range(STEPS):
        for p in params:                              # an inner SGD step on this rank's gradient
            p.sub_(0.05 * (p - torch.randn(p.shape, generator=data) - RANK))
        for k in d.after_inner_step():
            glob = gather(d.glob[k])
            assert all(torch.equal(glob[0], x) for x in glob), f"{wire}: fragment {k}'s global parameters differ"
    assert sum(d.syncs) >= 5, d.syncs
    want = sum(wire_bytes(o, P, n)[0] for a in avgs for n in a.calls)
    got = stats.totals()["bytes_sent"]
    assert got == want, f"{wire}: {got} bytes sent counted at the collectives, formula {want}"
    want_r = sum(wire_bytes(o, P, n)[1] for a in avgs for n in a.calls)
    assert stats.totals()["bytes_recv"] == want_r, f"{wire}: received {stats.totals()['bytes_recv']} != {want_r}"
    d.finish()
    return [p.clone() for p in params] + [g.clone() for g in d.glob]


for w in WIRES:
    blocking = run(w)
    if w in ("fp32", "loco", "e3m0"):   # on the background thread: the same bits (loco: with its errors)
        assert all(torch.equal(a, b) for a, b in zip(blocking, run(w, background=True))), f"{w}: background differs"
if RANK == 0:
    print("diloco_dist: ok", flush=True)
dist.destroy_process_group()
