"""DiLoCo and Streaming DiLoCo's outer loop (optim/diloco.py) and the E3M0 codec (comm/e3m0.py).

In one process, W workers are W sets of plain tensors with their own inner optimizers, driven in
lockstep; their pseudo-gradients meet in `SimMean` (the fp32 mean, summed in worker order), which
stands in for the allreduce. tests/workers/diloco_dist.py checks the real wires under gloo.

- H = 1, outer lr 1, no outer momentum, fp32: inner SGD (with heavy-ball momentum) is synchronous
  SGD on the averaged gradient. Why: every worker starts the step at the same theta, so
  Delta_i = lr * d_i with d_i the worker's SGD direction, which is linear in its gradient history
  (d_i = beta d_i' + g_i); the mean of the d_i is then the direction synchronous SGD computes from
  the mean gradients, and theta - 1 * lr * mean d_i is its step. AdamW's direction m_i / (sqrt(v_i)
  + eps) is not linear in the gradients (v_i squares them, per worker), so the mean of the workers'
  Adam steps is not Adam's step on the mean gradient: the test shows they differ.
- a hand-written reference of the algorithm (2 workers, 3 outer steps, inner AdamW, outer Nesterov
  momentum 0.9, outer lr 0.7) equals the object within fp32 tolerance; heavy ball too; its outer
  step is torch.optim.SGD's on the averaged pseudo-gradient bit for bit (the peers' construction);
- Streaming with F = 1 and no overlap equals that reference; a hand-written streaming reference
  (F = 2 on literal offsets, tau = 1, alpha = 0.25) equals the object;
- a state_dict round trip (through torch.save) mid-inner-phase, mid-overlap and at an outer step
  continues bit for bit, also with LoCo's error feedback as the wire;
- the E3M0 codec: exact on its representable values, nearest rounding, bytes = formula; the
  pbit_mean wire at one rank is eq. 1's quantization per block, dequantized; its bytes;
- finish() applies the averages still in flight as the reference does, then averages in the steps each
  fragment trained since its last send (comm.diloco.final_average; without it they are dropped);
- bad options: one line each, naming the comm.diloco key.
"""
from __future__ import annotations

import copy
import dataclasses
import io

import pytest
import torch

from comm.e3m0 import e3m0_allreduce_mean, e3m0_bytes, e3m0_chunk_bytes, e3m0_decode, e3m0_encode, e3m0_layout
from optim import sync
from optim.diloco import (WIRES, DiLoCo, DiLoCoOptions, build_averages, cycle_bytes, strided_fragments,
                          drift_from_scalars, drift_scalars, wire_bytes, worker_drift)
from tests.dist import torchrun

SHAPES = [(3, 4), (4,), (2, 3), (3,)]   # four "blocks", one tensor each
REST = [(5,)]                           # a tensor outside the blocks (an embedding, a head)


# ---- the simulated workers ----------------------------------------------------------------------
class SimMean:
    """The fp32 mean of W workers' tensors: worker i's `start` drops its tensor for one round (the
    fragment's sync count); `wait` sums them in worker order and divides by W."""

    def __init__(self, W: int) -> None:
        self.W, self.rounds = W, {}

    def member(self, i: int) -> "_Member":
        return _Member(self, i)


class _Member:
    def __init__(self, g: SimMean, i: int) -> None:
        self.g, self.i = g, i

    def start(self, x: torch.Tensor, step: int) -> "_Handle":
        box = self.g.rounds.setdefault(step, {})
        assert self.i not in box, f"worker {self.i} started round {step} twice"
        box[self.i] = x.clone()
        return _Handle(self.g, step)


class _Handle:
    def __init__(self, g: SimMean, step: int) -> None:
        self.g, self.step = g, step

    def wait(self) -> torch.Tensor:
        box = self.g.rounds[self.step]
        assert sorted(box) == list(range(self.g.W)), f"round {self.step}: only workers {sorted(box)} started"
        total = box[0].clone()
        for i in range(1, self.g.W):
            total += box[i]
        return total / self.g.W


def _init_params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in SHAPES + REST]


def _loss(params: list[torch.Tensor], worker: int, step: int) -> torch.Tensor:
    """A worker's loss at its inner step: a least-squares fit per tensor to data drawn from
    (worker, step), plus a tanh coupling so the gradient is not linear in the parameters."""
    g = torch.Generator().manual_seed(1000 * worker + step)
    total = torch.zeros(())
    for p in params:
        x = p.reshape(-1)
        A = torch.randn(x.numel(), x.numel(), generator=g) / x.numel() ** 0.5
        y = torch.randn(x.numel(), generator=g) + worker
        total = total + (A @ x - y).pow(2).mean() + 0.1 * torch.tanh(x).sum()
    return total


def _grads(params: list[torch.Tensor], worker: int, step: int) -> list[torch.Tensor]:
    ps = [p.detach().clone().requires_grad_(True) for p in params]
    return list(torch.autograd.grad(_loss(ps, worker, step), ps))


class Worker:
    """One worker: its parameters and inner optimizer (torch's: the inner step is not under test)."""

    def __init__(self, i: int, inner: str) -> None:
        self.i = i
        self.params = [torch.nn.Parameter(t.clone()) for t in _init_params()]
        if inner == "sgd":
            self.opt = torch.optim.SGD(self.params, lr=0.05, momentum=0.9)
        else:
            self.opt = torch.optim.AdamW(self.params, lr=0.02, betas=(0.9, 0.95), weight_decay=0.1)
        self.t = 0

    def inner_step(self) -> None:
        for p, g in zip(self.params, _grads(self.params, self.i, self.t)):
            p.grad = g
        self.opt.step()
        self.t += 1


def _fragments(w: Worker, F: int) -> list[list[torch.Tensor]]:
    blocks = [[p] for p in w.params[:len(SHAPES)]]
    return strided_fragments(blocks, w.params[len(SHAPES):], F)


def _run_diloco(W: int, o: DiLoCoOptions, steps: int, inner: str) -> tuple[list[Worker], list[DiLoCo]]:
    workers = [Worker(i, inner) for i in range(W)]
    frags = [_fragments(w, o.fragments) for w in workers]
    groups = [SimMean(W) for _ in range(o.fragments)]
    dl = [DiLoCo(frags[i], o, [groups[k].member(i) for k in range(o.fragments)]) for i in range(W)]
    _advance(workers, dl, steps)
    return workers, dl


def _advance(workers: list[Worker], dl: list[DiLoCo], steps: int) -> None:
    for _ in range(steps):
        for w in workers:
            w.inner_step()
        for d in dl:
            d.send()
        for d in dl:
            d.receive()


# ---- (a) H = 1 is synchronous SGD ---------------------------------------------------------------
def _sync_run(W: int, steps: int, inner: str) -> list[torch.Tensor]:
    """Synchronous training: one parameter set, stepped by the inner optimizer on the workers' mean gradient."""
    w = Worker(0, inner)
    for t in range(steps):
        per = [_grads(w.params, i, t) for i in range(W)]
        for j, p in enumerate(w.params):
            total = per[0][j].clone()
            for i in range(1, W):
                total += per[i][j]
            p.grad = total / W
        w.opt.step()
    return [p.detach() for p in w.params]


H1 = DiLoCoOptions(inner_steps=1, outer_lr=1.0, outer_momentum=0.0, nesterov=False, wire="fp32")


def test_h1_outer_lr_1_no_momentum_is_synchronous_sgd() -> None:
    workers, dl = _run_diloco(3, H1, 6, "sgd")
    ref = _sync_run(3, 6, "sgd")
    moved = max((a - b).abs().max().item() for a, b in zip(ref, _init_params()))
    assert moved > 0.05, moved                       # the runs went somewhere
    for w in workers:
        for p, r in zip(w.params, ref):
            torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)
    for d in dl:
        assert d.syncs == [6]


def test_h1_is_not_synchronous_adamw() -> None:
    """The same construction with AdamW inside: the mean of the workers' Adam steps is not Adam's
    step on the mean gradient (module docstring)."""
    workers, _ = _run_diloco(3, H1, 6, "adamw")
    ref = _sync_run(3, 6, "adamw")
    gap = max((p.detach() - r).abs().max().item() for p, r in zip(workers[0].params, ref))
    assert gap > 1e-3, gap


# ---- (b) against a hand-written reference ---------------------------------------------------------
def _reference(W: int, H: int, outer_steps: int, lr: float, mu: float, nesterov: bool) -> list[torch.Tensor]:
    """DiLoCo written out plainly: every worker runs H inner AdamW steps from theta, Delta is the
    mean of theta - theta_i, the outer SGD with (Nesterov) momentum moves theta, workers restart
    from theta (their AdamW states carry on)."""
    workers = [Worker(i, "adamw") for i in range(W)]
    theta = [t.clone() for t in _init_params()]
    mom = [torch.zeros_like(t) for t in theta]
    for _ in range(outer_steps):
        for w in workers:
            for _ in range(H):
                w.inner_step()
        for j in range(len(theta)):
            delta = (theta[j] - workers[0].params[j].detach())
            for w in workers[1:]:
                delta = delta + (theta[j] - w.params[j].detach())
            delta = delta / W
            mom[j] = mu * mom[j] + delta
            step = delta + mu * mom[j] if nesterov else mom[j]
            theta[j] = theta[j] - lr * step
        with torch.no_grad():
            for w in workers:
                for p, t in zip(w.params, theta):
                    p.copy_(t)
    return theta


@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_hand_written_reference(nesterov: bool) -> None:
    o = DiLoCoOptions(inner_steps=3, outer_lr=0.7, outer_momentum=0.9, nesterov=nesterov)
    workers, dl = _run_diloco(2, o, 9, "adamw")
    ref = _reference(2, 3, 3, 0.7, 0.9, nesterov)
    for w in workers:
        for p, r in zip(w.params, ref):
            torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)
    # the two workers hold bit-identical parameters after an outer step, as the global copy
    for a, b in zip(workers[0].params, workers[1].params):
        assert torch.equal(a, b)
    assert torch.equal(dl[0].glob[0], dl[1].glob[0])
    assert dl[0].syncs == [3]


def _torch_sgd_reference(W: int, H: int, outer_steps: int, nesterov: bool) -> list[torch.Tensor]:
    """DiLoCo as its peers build it (the DiLoCo paper, torchft): the global copy is a set of
    parameters stepped by torch.optim.SGD whose gradient is the averaged pseudo-gradient (summed in
    worker order, divided by W, as SimMean)."""
    workers = [Worker(i, "adamw") for i in range(W)]
    theta = [torch.nn.Parameter(t.clone()) for t in _init_params()]
    outer = torch.optim.SGD(theta, lr=0.7, momentum=0.9, nesterov=nesterov)
    for _ in range(outer_steps):
        for w in workers:
            for _ in range(H):
                w.inner_step()
        for j, t in enumerate(theta):
            total = t.detach() - workers[0].params[j].detach()
            for w in workers[1:]:
                total += t.detach() - w.params[j].detach()
            t.grad = total / W
        outer.step()
        with torch.no_grad():
            for w in workers:
                for p, t in zip(w.params, theta):
                    p.copy_(t)
    return [t.detach() for t in theta]


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_is_torch_sgd_bit_for_bit(nesterov: bool) -> None:
    """The outer optimizer is torch's SGD (momentum 0.9, dampening 0) on the averaged pseudo-gradient,
    to the bit, over 4 outer steps (momentum buffers past their first step included)."""
    o = DiLoCoOptions(inner_steps=3, outer_lr=0.7, outer_momentum=0.9, nesterov=nesterov)
    workers, _ = _run_diloco(2, o, 12, "adamw")
    ref = _torch_sgd_reference(2, 3, 4, nesterov)
    moved = max((a - b).abs().max().item() for a, b in zip(ref, _init_params()))
    assert moved > 0.05, moved
    for w in workers:
        for p, r in zip(w.params, ref):
            assert torch.equal(p.detach(), r), (p.detach() - r).abs().max().item()


# ---- (c) streaming ----------------------------------------------------------------------------------
def test_streaming_one_fragment_no_overlap_is_diloco() -> None:
    o = DiLoCoOptions(inner_steps=3, outer_lr=0.7, outer_momentum=0.9, fragments=1, overlap_steps=0, alpha=0.0)
    workers, _ = _run_diloco(2, o, 9, "adamw")
    ref = _reference(2, 3, 3, 0.7, 0.9, True)
    for p, r in zip(workers[0].params, ref):
        torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)


def test_strided_fragments() -> None:
    blocks = [[torch.zeros(4)], [torch.zeros(4)], [torch.zeros(4)], [torch.zeros(4), torch.zeros(2)], [torch.zeros(4)]]
    rest = [torch.zeros(7), torch.zeros(3)]
    f = strided_fragments(blocks, rest, 2)
    # blocks 0, 2, 4 -> fragment 0 (12 elements), blocks 1, 3 -> fragment 1 (10), then the 7 joins
    # fragment 1 (the smaller: 17) and the 3 fragment 0 (15)
    same = lambda a, b: len(a) == len(b) and all(t is u for t, u in zip(a, b))   # noqa: E731
    assert same(f[0], blocks[0] + blocks[2] + blocks[4] + [rest[1]])
    assert same(f[1], blocks[1] + blocks[3] + [rest[0]])
    with pytest.raises(ValueError, match="comm.diloco.fragments: 6 fragments but the model has 5 blocks"):
        strided_fragments(blocks, rest, 6)


def test_fragment_numels_are_the_sizes_of_strided_fragments() -> None:
    """The registry's prediction fragments (parameter, size) pairs by strided_fragments' rule: the same
    sizes as the tensors' fragments, on the example above and on a GPT's blocks, embeddings and head."""
    from model import GPT, get_preset, param_layers
    from optim.sync.diloco import fragment_numels

    sizes = [[4], [4], [4], [4, 2], [4]]
    params = [(f"block.{i}", n) for i, b in enumerate(sizes) for n in b] + [("", 7), ("", 3)]
    assert fragment_numels(DiLoCoOptions(fragments=2), params) == [15, 17]
    assert fragment_numels(DiLoCoOptions(fragments=1), [("", 5), ("", 6)]) == [11]   # no blocks: one block
    with pytest.raises(ValueError, match="comm.diloco.fragments"):
        fragment_numels(DiLoCoOptions(fragments=6), params)
    with torch.device("meta"):
        model = GPT(get_preset("debug"))
    where, named = param_layers(model), list(model.named_parameters())
    blocks: dict[str, list] = {}
    for name, p in named:
        if where[name]:
            blocks.setdefault(where[name], []).append(p)
    order = sorted(blocks, key=lambda b: int(b.split(".")[1]))
    rest = [p for name, p in named if not where[name]]
    layout = [(where[name], p.numel()) for name, p in named]
    for F in range(1, len(order) + 1):
        want = [sum(t.numel() for t in f) for f in strided_fragments([blocks[b] for b in order], rest, F)]
        assert fragment_numels(DiLoCoOptions(inner_steps=8, fragments=F), layout) == want, F


def _streaming_reference(W: int, steps: int, finish: bool = False, final_average: bool = True) -> list[torch.Tensor]:
    """Streaming DiLoCo written out for H = 4, F = 2, tau = 1, alpha = 0.25 on SHAPES + REST:
    fragment 0 = blocks 0, 2 (18 elements), fragment 1 = blocks 1, 3 (7) and REST's tensor (it joins
    the smaller fragment); fragment 0 sends after steps 2, 6, 10, ..., fragment 1 after 4, 8, ...; each applies its
    outer step (Nesterov, lr 0.7, mu 0.9) one step later and mixes local = 0.25 local + 0.75 global."""
    frag = {0: [0, 2], 1: [1, 3, 4]}
    sends = {0: {2, 6, 10, 14}, 1: {4, 8, 12, 16}}
    workers = [Worker(i, "adamw") for i in range(W)]
    theta = [t.clone() for t in _init_params()]
    mom = [torch.zeros_like(t) for t in theta]
    sent: dict[int, list[torch.Tensor]] = {}
    for t in range(1, steps + 1):
        for w in workers:
            w.inner_step()
        for k in (0, 1):
            if t in sends[k]:
                sent[k] = []
                for j in frag[k]:
                    d = theta[j] - workers[0].params[j].detach()
                    for w in workers[1:]:
                        d = d + (theta[j] - w.params[j].detach())
                    sent[k].append(d / W)
            if t - 1 in sends[k]:
                for j, d in zip(frag[k], sent.pop(k)):
                    mom[j] = 0.9 * mom[j] + d
                    theta[j] = theta[j] - 0.7 * (d + 0.9 * mom[j])
                    with torch.no_grad():
                        for w in workers:
                            w.params[j].copy_(0.25 * w.params[j] + 0.75 * theta[j])
    for k in sorted(sent) if finish else ():        # the end of training: apply what is in flight
        for j, d in zip(frag[k], sent[k]):
            mom[j] = 0.9 * mom[j] + d
            theta[j] = theta[j] - 0.7 * (d + 0.9 * mom[j])
            with torch.no_grad():
                for w in workers:
                    w.params[j].copy_(0.25 * w.params[j] + 0.75 * theta[j])
    for k in (0, 1) if finish and final_average else ():   # then the steps since a fragment's last send
        if max(x for x in sends[k] if x <= steps) < steps:
            for j in frag[k]:
                d = sum((theta[j] - w.params[j].detach() for w in workers[1:]), theta[j] - workers[0].params[j].detach())
                theta[j] = theta[j] - d / W                   # the workers' mean: no outer lr, no momentum
                with torch.no_grad():
                    for w in workers:
                        w.params[j].copy_(theta[j])
    return [p.detach().clone() for p in workers[1].params]


def test_streaming_matches_hand_written_reference() -> None:
    o = DiLoCoOptions(inner_steps=4, outer_lr=0.7, outer_momentum=0.9, fragments=2, overlap_steps=1, alpha=0.25)
    assert o.offsets() == [2, 4]
    workers, dl = _run_diloco(2, o, 10, "adamw")   # ends with fragment 0's average of step 10 in flight
    assert set(dl[0].pending) == {0}
    ref = _streaming_reference(2, 10)
    for p, r in zip(workers[1].params, ref):
        torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)
    assert dl[0].syncs == [2, 2]   # fragment 0 applied at 3 and 7, fragment 1 at 5 and 9
    for d in dl:
        # fragment 0's average in flight is applied; fragment 1 (last sent after step 8) sends the
        # pseudo-gradient of steps 9-10 and becomes the workers' mean
        assert d.last_send(0) == 10 and d.last_send(1) == 8
        assert d.finish_send() == [0, 1]
    for d in dl:                                   # (lockstep: every worker starts before any waits)
        d.finish_receive()
        assert not d.pending and d.syncs == [3, 3]
    for p, r, q in zip(workers[1].params, _streaming_reference(2, 10, finish=True), ref):
        torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)
    assert any(not torch.allclose(p.detach(), q) for p, q in zip(workers[1].params, ref))
    for j in (1, 3, 4):                            # fragment 1: one model on every worker (fragment 0's
        assert torch.equal(workers[0].params[j], workers[1].params[j])   # alpha merge is OuterLoop's to end)


def test_without_final_average_the_last_steps_of_a_fragment_are_dropped() -> None:
    o = DiLoCoOptions(inner_steps=4, outer_lr=0.7, outer_momentum=0.9, fragments=2, overlap_steps=1, alpha=0.25,
                      final_average=False)
    workers, dl = _run_diloco(2, o, 10, "adamw")
    for d in dl:
        assert d.finish() == [0] and d.syncs == [3, 2]
    for p, r in zip(workers[1].params, _streaming_reference(2, 10, finish=True, final_average=False)):
        torch.testing.assert_close(p.detach(), r, rtol=1e-5, atol=1e-6)
    with_avg = _streaming_reference(2, 10, finish=True)
    assert any(not torch.allclose(p.detach(), q) for p, q in zip(workers[1].params, with_avg))


@pytest.mark.parametrize("final_average", [True, False])
def test_diloco_ending_inside_an_inner_phase(final_average: bool) -> None:
    """H = 3, 11 steps: the outer steps after 3, 6, 9, then steps 10-11. With final_average the model is
    the workers' mean after step 11 (global minus the averaged pseudo-gradient); without it, the global
    parameters of step 9's outer step."""
    o = DiLoCoOptions(inner_steps=3, outer_lr=0.7, outer_momentum=0.9, final_average=final_average)
    workers, dl = _run_diloco(2, o, 11, "adamw")
    glob9 = [g.clone() for g in dl[0].glob]
    mean = [(a.detach() + b.detach()) / 2 for a, b in zip(workers[0].params, workers[1].params)]
    mom = [m.clone() for m in dl[0].momentum]
    for d in dl:
        assert d.finish_send() == ([0] if final_average else [])
    for d in dl:
        d.finish_receive()
        assert d.syncs == [4 if final_average else 3]
    assert torch.equal(dl[0].glob[0], dl[1].glob[0])
    assert all(torch.equal(m, n) for m, n in zip(dl[0].momentum, mom))   # the momentum is not touched
    if final_average:
        want = torch.cat([m.reshape(-1) for m in mean])
        torch.testing.assert_close(dl[0].glob[0], want, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(dl[0].glob[0], glob9[0])
        for a, b in zip(workers[0].params, workers[1].params):
            assert torch.equal(a, b)
    else:
        assert torch.equal(dl[0].glob[0], glob9[0])


# ---- (d) exact resume -----------------------------------------------------------------------------
def _snapshot(workers: list[Worker], dl: list[DiLoCo]) -> bytes:
    buf = io.BytesIO()
    torch.save({"params": [[p.detach().clone() for p in w.params] for w in workers],
                "opt": [w.opt.state_dict() for w in workers], "t": [w.t for w in workers],
                "outer": [d.state_dict() for d in dl]}, buf)
    return buf.getvalue()


def _restore(blob: bytes, W: int, o: DiLoCoOptions, inner: str, averages=None) -> tuple[list[Worker], list[DiLoCo]]:
    state = torch.load(io.BytesIO(blob), weights_only=True)
    workers = [Worker(i, inner) for i in range(W)]
    groups = [SimMean(W) for _ in range(o.fragments)]
    dl = []
    for i, w in enumerate(workers):
        with torch.no_grad():
            for p, s in zip(w.params, state["params"][i]):
                p.copy_(s)
        w.opt.load_state_dict(state["opt"][i])
        w.t = state["t"][i]
        avgs = averages(i) if averages else [groups[k].member(i) for k in range(o.fragments)]
        d = DiLoCo(_fragments(w, o.fragments), o, avgs)
        d.load_state_dict(state["outer"][i])
        dl.append(d)
    return workers, dl


STREAM = DiLoCoOptions(inner_steps=4, outer_lr=0.7, outer_momentum=0.9, fragments=2, overlap_steps=1, alpha=0.5)


@pytest.mark.parametrize("at", [1, 2, 4, 5], ids=["mid-inner", "mid-overlap", "outer-step", "after-overlap"])
def test_resume_is_bit_exact(at: int) -> None:
    workers, dl = _run_diloco(2, STREAM, at, "adamw")
    if at == 2:
        assert dl[0].pending, "fragment 0's average must be in flight at step 2"
    blob = _snapshot(workers, dl)
    _advance(workers, dl, 9)
    w2, d2 = _restore(blob, 2, STREAM, "adamw")
    _advance(w2, d2, 9)
    for a, b in zip(workers, w2):
        for p, q in zip(a.params, b.params):
            assert torch.equal(p, q)
    for a, b in zip(dl, d2):
        assert all(torch.equal(x, y) for x, y in zip(a.glob + a.momentum, b.glob + b.momentum))
        assert a.syncs == b.syncs and a.step == b.step


def test_a_finished_run_extended_past_its_end_skips_the_outer_step_its_end_applied() -> None:
    """Streaming DiLoCo ending right after a send (step 6: fragment 0's average in flight, its outer step
    due at 7): the end applies it early. A run extended from there (train.max_steps raised, resume=auto)
    skips that outer step instead of waiting for an average nobody sends (it raised KeyError), then
    follows the schedule; in memory and from the end's checkpoint alike, the workers agreeing."""
    workers, dl = _run_diloco(2, STREAM, 6, "adamw")
    assert sorted(dl[0].pending) == [0] and dl[0].receives_at(7) == [0]
    for d in dl:
        d.finish_send()
    for d in dl:
        d.finish_receive()
    syncs = list(dl[0].syncs)
    blob = _snapshot(workers, dl)
    _advance(workers, dl, 6)          # steps 7-12: fragment 0's outer step at 7 skipped, then 11; fragment 1's at 9
    w2, d2 = _restore(blob, 2, STREAM, "adamw")
    _advance(w2, d2, 6)
    assert dl[0].syncs == [syncs[0] + 1, syncs[1] + 1] and not dl[0].drained
    for a, b in zip(dl, d2):
        assert all(torch.equal(x, y) for x, y in zip(a.glob + a.momentum, b.glob + b.momentum))
    assert all(torch.equal(x, y) for x, y in zip(dl[0].glob, dl[1].glob))
    for a, b in zip(workers, w2):
        assert all(torch.equal(p, q) for p, q in zip(a.params, b.params))


def test_resume_with_error_feedback_wire_is_bit_exact() -> None:
    """One worker on the loco wire (at P = 1 the compression and its 8-bit errors still apply)."""
    o = DiLoCoOptions(inner_steps=2, outer_lr=0.7, outer_momentum=0.9, wire="loco", block=8)
    ctx = lambda: sync.ExchangeContext(world_size=1, rank=0)   # noqa: E731
    w = Worker(0, "adamw")
    d = DiLoCo(_fragments(w, 1), o, build_averages(o, [sum(p.numel() for p in w.params)], ctx()))
    _advance([w], [d], 3)
    state = d.state_dict()
    assert any(t.abs().sum() > 0 for t in state["averages"][0]["float32/" + str(d.numels[0])].values()
               if isinstance(t, torch.Tensor)), "the loco wire kept no error: the test would not cover it"
    blob = _snapshot([w], [d])
    _advance([w], [d], 5)
    w2, d2 = _restore(blob, 1, o, "adamw", averages=lambda i: build_averages(o, d.numels, ctx()))
    _advance(w2, d2, 5)
    for p, q in zip(w.params, w2[0].params):
        assert torch.equal(p, q)
    # the same run with the wire's error reset at the resume differs: the state matters
    w3, d3 = _restore(blob, 1, o, "adamw", averages=lambda i: build_averages(o, d.numels, ctx()))
    d3[0].averages[0].load_state_dict({})
    _advance(w3, d3, 5)
    assert any(not torch.equal(p, q) for p, q in zip(w.params, w3[0].params))


def test_resume_refuses_other_options() -> None:
    _, dl = _run_diloco(2, STREAM, 3, "adamw")
    state = dl[0].state_dict()
    other = DiLoCoOptions(inner_steps=5, outer_lr=0.7, fragments=2, overlap_steps=1)
    w = Worker(0, "adamw")
    d = DiLoCo(_fragments(w, 2), other, [SimMean(1).member(0), SimMean(1).member(0)])
    with pytest.raises(ValueError, match=r"comm.diloco.inner_steps: the checkpoint was saved with 4, this run has 5"):
        d.load_state_dict(state)


def test_state_dict_between_send_and_receive_is_refused() -> None:
    workers, dl = _run_diloco(1, DiLoCoOptions(inner_steps=2), 1, "sgd")
    workers[0].inner_step()
    dl[0].send()
    with pytest.raises(RuntimeError, match="between send"):
        dl[0].state_dict()


# ---- (e) bytes ------------------------------------------------------------------------------------
def test_e3m0_codes_and_rounding() -> None:
    s = 3.0
    exact = torch.tensor([s, -s / 2, s / 4, -s / 8, s / 16, s / 32, -s / 64, 0.0])
    codes, scales = e3m0_encode(exact, 8)
    assert torch.equal(e3m0_decode(codes, scales, 8), exact)
    assert scales.tolist() == [s]
    # nearest in value, ties away from zero; below s/128 -> 0, [s/128, s/64) -> s/64
    x = torch.tensor([1.0, 0.74, 0.75, 0.376, 0.374, 1 / 128, 0.99 / 128, -0.3])
    got = e3m0_decode(*e3m0_encode(x, 8), 8)
    assert got.tolist() == [1.0, 0.5, 1.0, 0.5, 0.25, 1 / 64, 0.0, -0.25]
    g = torch.Generator().manual_seed(3)
    y = torch.randn(4096, generator=g)
    dec = e3m0_decode(*e3m0_encode(y, 256), 256)
    s = y.view(-1, 256).abs().amax(1, keepdim=True)
    big = y.view(-1, 256).abs() >= s / 64
    rel = ((dec.view(-1, 256) - y.view(-1, 256)).abs() / y.view(-1, 256).abs())[big]
    assert rel.max() <= 1 / 3 + 1e-6 and rel.max() > 0.3
    assert torch.equal(torch.sign(dec.view(-1, 256)[big]), torch.sign(y.view(-1, 256)[big]))


def test_e3m0_mean_at_one_rank_is_one_quantization() -> None:
    """At P = 1 the mean encodes, decodes, encodes again: the same as encoding once (a decoded
    block's scale is its own max and every value is representable)."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    once = e3m0_decode(*e3m0_encode(torch.cat([x, x.new_zeros(24)]), 64), 64, 1000)
    assert torch.equal(e3m0_allreduce_mean(x, 64), once)
    assert not torch.equal(once, x)


@pytest.mark.parametrize("n,block", [(1, 8), (1000, 64), (4096, 256), (12345, 2048)])
def test_e3m0_bytes_equal_the_encoded_bytes(n: int, block: int) -> None:
    for P in (2, 3, 8):
        c = e3m0_layout(n, P, block)
        y = torch.randn(P * c)
        codes, scales = e3m0_encode(y, block)
        # the wire holds P chunks, each codes then scales: the encoder's bytes are P chunks of w
        assert codes.numel() + 4 * scales.numel() == P * e3m0_chunk_bytes(c, block)
        w = e3m0_chunk_bytes(c, block)
        assert e3m0_bytes(n, P, block) == ((P + 1) * w, 2 * P * w)
        assert c % block == 0 and c * P >= n and (c - block) * P < n
    assert e3m0_bytes(n, 1, block) == (0, 0)


@pytest.mark.parametrize("quantizer,clip", [("linf", 1.0), ("l1", 2.0)])
def test_pbit_mean_one_rank_is_the_dequantized_vector(quantizer: str, clip: float) -> None:
    """At P = 1 the mean is x quantized by eq. 1 per block (127 levels at 8 bits) and dequantized."""
    o = DiLoCoOptions(wire="pbit_mean", bits=8, quantizer=quantizer, clip=clip, block=64)
    (ex,) = build_averages(o, [1000], sync.ExchangeContext(world_size=1, rank=0))
    x = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    got = ex(x.clone(), 0)
    for a in range(0, 1000, 64):
        b = x[a:a + 64]
        M = b.abs().max() if quantizer == "linf" else b.abs().mean()
        unit = clip * M / 127
        want = (b * (127 / (clip * M))).round().clamp(-127, 127) * unit
        torch.testing.assert_close(got[a:a + 64], want, rtol=1e-6, atol=1e-7)
        inside = b.abs() <= clip * M
        assert (got[a:a + 64] - b)[inside].abs().max() <= unit / 2 * (1 + 1e-5)
    assert not torch.equal(got, x)
    assert wire_bytes(o, 4, 1000) == (4 * 16 + 1000, 4 * 16 + 1000)
    assert wire_bytes(dataclasses.replace(o, bits=16), 4, 1001) == (4 * 16 + 4 * 501,) * 2


def test_cycle_bytes_sum_and_peak() -> None:
    o = DiLoCoOptions(inner_steps=10, fragments=3, wire="bf16")
    c = cycle_bytes(o, 4, [100, 300, 200])
    assert (c.sent, c.recv, c.peak_step, c.per_inner_step) == (1200, 1200, 600, 120.0)
    for wire in WIRES:
        o = DiLoCoOptions(inner_steps=5, fragments=2, wire=wire, block=64)
        c = cycle_bytes(o, 4, [1000, 3000])
        assert c.sent == wire_bytes(o, 4, 1000)[0] + wire_bytes(o, 4, 3000)[0]
        assert c.peak_step == wire_bytes(o, 4, 3000)[0] and c.per_inner_step == c.sent / 5
    # fp32 sends 4 bytes per element, e3m0 about half a byte (plus a scale per block and padding)
    assert wire_bytes(DiLoCoOptions(wire="fp32"), 4, 4096)[0] == 4 * 4096
    assert wire_bytes(DiLoCoOptions(wire="e3m0", block=256), 4, 4096)[0] == 5 * (512 + 4 * 4)


def test_worker_drift() -> None:
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    d = worker_drift([a, b])
    assert abs(d["spread"] - 1.0) < 1e-9 and all(abs(c - 2 ** -0.5) < 1e-9 for c in d["cosine"])
    assert worker_drift([a, a])["spread"] == 0.0


@pytest.mark.parametrize("P,noise", [(2, 1.0), (3, 0.3), (4, 1e-4)])
def test_drift_from_per_worker_scalars_equals_worker_drift(P: int, noise: float) -> None:
    """The drift a run logs (four scalars per worker and the exact mean, optim/diloco.py
    OuterLoop.drift) is worker_drift on the gathered pseudo-gradients, also when each worker's
    fragment is in shards whose scalars add up, and when the workers nearly agree (noise 1e-4:
    ||Delta_i||^2 - ||mean||^2 in fp32 would lose the spread there)."""
    g = torch.Generator().manual_seed(P)
    base = torch.randn(5000, generator=g)
    deltas = [base + noise * torch.randn(5000, generator=g) for _ in range(P)]
    mean = torch.stack(deltas).mean(0)   # fp32, as the allreduce computes it
    want = worker_drift(deltas)
    whole = torch.stack([drift_scalars(d, mean) for d in deltas])
    sharded = torch.stack([drift_scalars(d[:1234], mean[:1234]) + drift_scalars(d[1234:], mean[1234:])
                           for d in deltas])
    for scalars in (whole, sharded):
        got = drift_from_scalars(scalars)
        assert got["spread"] == pytest.approx(want["spread"], rel=1e-4)
        assert got["cosine"] == pytest.approx(want["cosine"], rel=1e-6, abs=1e-7)
    assert 0.5 * noise < want["spread"] < 2 * noise
    # the scalars need the exact mean: a compressed wire's decoded average (here 1 bit with a mean |x|
    # scale, the sign wire without its error feedback) gives other numbers
    rough = drift_from_scalars(torch.stack([drift_scalars(d, mean.sign() * mean.abs().mean()) for d in deltas]))
    assert rough["spread"] != pytest.approx(want["spread"], rel=1e-2)
    assert rough["cosine"] != pytest.approx(want["cosine"], rel=1e-2)
    assert drift_from_scalars(torch.stack([drift_scalars(torch.zeros(3), torch.zeros(3))] * 2)) == \
        {"spread": float("inf"), "cosine": [0.0, 0.0]}


@pytest.mark.parametrize("nproc", [2, 3])
def test_collectives_under_gloo(nproc: int) -> None:
    """tests/workers/diloco_dist.py at P = 2 and 3 (chunks with padding): every wire's average equals
    the gathered reference (fp32, e3m0 and pbit_mean bit for bit, the others within their
    quantization), replicas bit-identical after every outer step, bytes counted at the collectives
    equal the formula, the background thread gives the same bits."""
    out = torchrun(nproc, "diloco_dist.py", timeout=240)
    assert "diloco_dist: ok" in out.stdout, out.stdout + out.stderr


# ---- (f) bad options ------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,blocks,msg", [
    (dict(inner_steps=0), None, "comm.diloco.inner_steps: 0 must be an integer >= 1"),
    (dict(inner_steps=2.5), None, "comm.diloco.inner_steps: 2.5 must be an integer >= 1"),
    (dict(fragments=5), 4, "comm.diloco.fragments: 5 fragments but the model has 4 blocks"),
    (dict(fragments=4, inner_steps=3), None, "comm.diloco.fragments: 4 fragments need distinct offsets"),
    (dict(overlap_steps=10, inner_steps=10), None,
     "comm.diloco.overlap_steps: 10 must be < comm.diloco.inner_steps=10"),
    (dict(overlap_steps=-1), None, "comm.diloco.overlap_steps: -1 must be an integer >= 0"),
    (dict(wire="onebit"), None, "comm.diloco.wire: 'onebit' returns a sign vote, not a mean"),
    (dict(wire="pbit"), None, "comm.diloco.wire: 'pbit' returns a sign vote, not a mean"),
    (dict(wire="fp8"), None, "comm.diloco.wire: 'fp8' is not one of fp32, bf16, loco, sign, e3m0, pbit_mean"),
    (dict(outer_lr=0.0), None, "comm.diloco.outer_lr: 0.0 must be a positive number"),
    (dict(outer_momentum=1.0), None, "comm.diloco.outer_momentum: 1.0 must be in [0, 1)"),
    (dict(alpha=1.5), None, "comm.diloco.alpha: 1.5 must be in [0, 1]"),
    (dict(block=12), None, "comm.diloco.block: 12 must be a positive multiple of 8"),
    (dict(nesterov="yes"), None, "comm.diloco.nesterov: 'yes' must be true or false"),
    (dict(wire="pbit_mean", bits=2), None, "comm.diloco.bits: 2 is not one of 4, 8, 16"),
    (dict(wire="pbit_mean", quantizer="l2"), None, "comm.diloco.quantizer: 'l2' is not one of linf, l1"),
    (dict(wire="pbit_mean", clip=0.0), None, "comm.diloco.clip: 0.0 must be a positive number"),
])
def test_bad_options_name_the_key(kw: dict, blocks, msg: str) -> None:
    problems = DiLoCoOptions(**kw).problems(blocks=blocks)
    assert len(problems) == 1 and problems[0].startswith(msg), problems
    assert "\n" not in problems[0]
    with pytest.raises(ValueError, match=msg.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        DiLoCoOptions(**kw).check(blocks=blocks)


def test_pbit_mean_lanes_must_hold_a_level_at_the_world_size() -> None:
    o = DiLoCoOptions(wire="pbit_mean", bits=4)
    assert o.problems(world_size=7) == []                      # 7 * 2 * 1 <= 15
    assert o.problems(world_size=8) == ["comm.diloco.bits: 4-bit lanes leave no quantization level at 8 workers "
                                        "(need P * 2L <= 15); use comm.diloco.bits=8"]
    with pytest.raises(ValueError, match="comm.diloco.bits: 4-bit lanes leave no quantization level at 8"):
        build_averages(o, [10], sync.ExchangeContext(world_size=8, rank=0))


def test_every_sign_scheme_is_refused_and_defaults_are_valid() -> None:
    assert DiLoCoOptions().problems(blocks=12) == []
    for s in sync.schemes():
        p = DiLoCoOptions(wire=s.name).problems()
        if s.result == sync.SIGN:
            assert p and "returns a sign vote" in p[0]


def test_constructor_checks_fragments_and_averages() -> None:
    w = Worker(0, "sgd")
    with pytest.raises(ValueError, match="comm.diloco.fragments: 2 but 1 parameter fragments were given"):
        DiLoCo([w.params], DiLoCoOptions(inner_steps=4, fragments=2), [SimMean(1).member(0)])
    with pytest.raises(ValueError, match="comm.diloco.inner_steps: 0"):
        DiLoCo([w.params], DiLoCoOptions(inner_steps=0), [SimMean(1).member(0)])
    with pytest.raises(RuntimeError, match="call send"):
        DiLoCo([w.params], DiLoCoOptions(inner_steps=4), [SimMean(1).member(0)]).receive()
    assert copy.deepcopy(DiLoCoOptions()).offsets() == [500]


# ---- (g) the background averages' stream (CUDA) ------------------------------------------------------
def test_background_average_hands_off_runs_and_joins_through_its_side_stream() -> None:
    """The plumbing of a background average with a side stream (CudaSideStream's three calls, logged by a
    stand-in): handoff in the caller's thread at start, run (the average inside it) in the background
    thread, join in the caller's thread at wait, with run's result; without a side stream none of them."""
    import threading

    from optim.diloco import background_averages

    log = []

    class Side:
        def handoff(self, x):
            log.append(("handoff", threading.current_thread().name))
            return "ready"

        def run(self, ready, fn):
            log.append(("run", threading.current_thread().name, ready))
            return fn(), "done"

        def join(self, y, done):
            log.append(("join", threading.current_thread().name, done))
            return y

    def average(x, step):
        log.append(("average", threading.current_thread().name, step))
        return x * 2

    [bg] = background_averages([average])
    assert bg.side is None                                   # CPU: no stream
    bg.side = Side()
    fut = bg.start(torch.ones(3), 5)
    assert torch.equal(fut.wait(), torch.full((3,), 2.0))
    me = threading.current_thread().name
    assert [e[0] for e in log] == ["handoff", "run", "average", "join"]
    assert log[0][1] == me and log[3][1] == me and log[3][2] == "done"
    assert log[1][1] == log[2][1] != me and log[1][2] == "ready" and log[2][2] == 5
    log.clear()
    [plain] = background_averages([average], torch.device("cpu"))
    assert plain.side is None and torch.equal(plain.start(torch.ones(2), 1).wait(), torch.full((2,), 2.0))
    assert [e[0] for e in log] == ["average"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (runs in make gpu-check)")
def test_cuda_background_average_does_not_hold_up_the_main_stream() -> None:
    """On CUDA a background average runs on its side stream: a kernel the main thread enqueues after
    starting a long average finishes before the average does (on the device's default stream, which a
    new thread uses, it would queue behind it), and wait() returns the average's result, usable on
    the main stream."""
    from optim.diloco import background_averages

    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev)

    def long_average(x, step):
        y = a
        for _ in range(40):                  # ~tens of ms of matmuls on the side stream
            y = (y @ a).tanh()
        return x + 0 * y.sum()

    [bg] = background_averages([long_average], dev)
    assert bg.side is not None
    x = torch.arange(8.0, device=dev)
    torch.cuda.synchronize()
    fut = bg.start(x, 1)
    while fut.fut.running() is False and not fut.fut.done():  # the thread has picked it up
        pass
    small = torch.ones(4, device=dev) * 3
    main_done = torch.cuda.current_stream().record_event()
    main_done.synchronize()
    y, side_done = fut.fut.result()          # the thread has enqueued everything; the device may still run it
    assert not side_done.query(), "the main stream's kernel waited for the side stream's average"
    assert torch.equal(fut.side.join(y, side_done), x) and torch.equal(small, torch.full((4,), 3.0, device=dev))


def test_memory_counts_every_average_in_flight() -> None:
    """The registry's state bytes count each fragment average that can be in flight at once (tau > H / F
    overlaps two), at fp32 pseudo-gradient plus result, besides the global parameters and momentum."""
    from optim.sync.diloco import DiLoCoSchemeOptions, in_flight

    def of(**kw):
        return DiLoCoOptions(**{"wire": "fp32", **kw})
    assert [in_flight(of(inner_steps=50, fragments=2, overlap_steps=t)) for t in (0, 1, 25, 26, 49)] == [0, 1, 1, 2, 2]
    assert in_flight(of(inner_steps=50, fragments=4, overlap_steps=20)) == 2
    n, scheme = 1000, sync.get("diloco")
    for kw, flying in ((dict(inner_steps=50), 0), (dict(inner_steps=50, fragments=2, overlap_steps=1), 1),
                       (dict(inner_steps=50, fragments=2, overlap_steps=30), 2)):
        o = DiLoCoSchemeOptions(diloco=of(**kw))
        assert scheme.state_bytes(o, 4, n) == 8 * n + 8 * (n // o.diloco.fragments) * flying, kw
