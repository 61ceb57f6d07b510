"""Per-rank checks of update-sync distributed Lion (launched by tests/optim/test_lioncub.py).

For the world size it runs at: every comm mode keeps parameters bit-identical on all ranks after
every step and makes the loss fall; at P = 1 the exact-sign modes equal plain Lion step for step;
never-seen embedding rows are only weight-decayed when masked; momentum sync equalises exactly the
selected layers on the scheduled steps; diagnostics on constructed gradients give the expected
rates; diagnostic bytes stay out of the default CommStats; per-rank state round-trips; the native
kernels (comm.native) step bit for bit as the eager ones.
Each is a named check (CHECKS; tests/workers/_checks.py records its outcome).
"""
from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

import optim

VOCAB, USED = 32, 24  # rows USED..VOCAB-1 of the embedding never appear in the data
CHECKS = ("bits_error", "diagnostics", "momentum_sync", "state_round_trip", "modes", "native_kernels")


class TinyNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1234)  # identical initial parameters on every rank
        self.emb = torch.nn.Embedding(VOCAB, 16)
        self.fc = torch.nn.Linear(16, 32)
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, idx):
        return self.head(torch.tanh(self.fc(self.emb(idx))))

    def groups(self, lr: float = 0.01) -> list[dict]:
        spec = [("embedding", [("emb.weight", self.emb.weight)], 0.5),
                ("mlp", [("fc.weight", self.fc.weight)], 0.1),
                ("head", [("head.weight", self.head.weight)], 0.1),
                ("norm", [("fc.bias", self.fc.bias), ("head.bias", self.head.bias)], 0.0)]
        return [{"params": [p for _, p in ps], "names": [n for n, _ in ps], "role": role, "lr": lr,
                 "weight_decay": wd, "lr_mult": 1.0} for role, ps, wd in spec]


def batch(rank: int, step: int, shared: bool = False):
    g = torch.Generator().manual_seed(10_000 * (0 if shared else rank + 1) + step)
    x = torch.randint(0, USED, (400,), generator=g)  # every seen token appears in every batch
    return x, (7 * x + 3) % USED


def flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def seen_params(model) -> torch.Tensor:
    return torch.cat([model.emb.weight[:USED].detach().reshape(-1)] +
                     [p.detach().reshape(-1) for p in model.parameters() if p is not model.emb.weight])


def gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def identical_across_ranks(t: torch.Tensor) -> bool:
    parts = gathered(t)
    return all(torch.equal(parts[0], x) for x in parts[1:])


def build(model, mode: str, opts: dict):
    return optim.build_optimizer("lion", model.groups(), betas=(0.9, 0.99), eps=1e-8, comm_mode=mode,
                                 comm_options=opts)


def train_step(model, opt, rank, step, shared=False, diagnose=False):
    """One step; returns (loss, the optimizer's StepReport)."""
    x, y = batch(rank, step, shared)
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return float(loss.detach()), opt.step(diagnose=diagnose)


def modes(P: int) -> list[tuple[str, dict, bool]]:
    """(comm_mode, options, exact_sign_at_P1)."""
    out = [("onebit", {"tie_break": "alternate", "mask_zero_updates": True}, True),
           ("onebit", {"tie_break": "plus"}, True),
           ("onebit", {"tie_break": "minus", "mask_zero_updates": True}, True),
           ("ps", {"ps_aggregate": "vote", "ps_topology": "naive"}, True),
           ("ps", {"ps_aggregate": "vote", "ps_topology": "tree"}, True),
           ("ps", {"ps_aggregate": "vote_tiebreak", "ps_topology": "naive", "mask_zero_updates": True}, True),
           ("ps", {"ps_aggregate": "vote_tiebreak", "ps_topology": "tree"}, True),
           ("ps", {"ps_aggregate": "avg", "ps_topology": "naive", "mask_zero_updates": True}, True),
           ("pbit", {"bits": 8, "quantizer": "sign"}, True),
           ("pbit", {"bits": 4, "quantizer": "l1", "mask_zero_updates": True}, False),
           ("pbit", {"bits": 8, "quantizer": "l1", "rounding": "stochastic"}, False),
           ("pbit", {"bits": 8, "quantizer": "linf", "clip": 1.0, "rounding": "stochastic"}, False),
           ("pbit", {"bits": 16, "quantizer": "l0"}, False),
           ("pbit", {"bits": 8, "quantizer": "lp", "p": 0.5, "levels": 2}, False),
           ("hierarchical", {"node_size": 2 if P % 2 == 0 else 1, "mask_zero_updates": True}, True)]
    if P <= 3:  # 2-bit lanes: L1 with L = 1 at P = 1; signs only (0/1 sum <= 3) at P = 2, 3
        out.append(("pbit", {"bits": 2, "quantizer": "l1" if P == 1 else "sign", "mask_zero_updates": True},
                    False))
    if P == 1:  # 1-bit lanes hold one rank's 0/1 sign
        out.append(("pbit", {"bits": 1, "quantizer": "sign", "mask_zero_updates": True}, True))
    return out


def check_modes(rank: int, P: int, steps: int = 16) -> None:
    lr, mult = 0.01, 0.5  # the trainer's schedule: group["lr"] changes between steps
    assert len(modes(P)) >= 15, f"only {len(modes(P))} comm modes to check"
    for mode, opts, exact in modes(P):
        model = TinyNet()
        opt = build(model, mode, opts)
        masked = opts.get("mask_zero_updates", False) or opt.exchange.exact_zeros
        ref = ref_opt = None
        if P == 1 and exact:
            ref = TinyNet()
            ref_opt = optim.build_optimizer("lion", ref.groups(), betas=(0.9, 0.99), eps=1e-8, comm_mode="fp32",
                                            comm_options={})
        unused0 = model.emb.weight[USED:].detach().clone()
        losses = []
        for step in range(steps):
            sched = lr * (1.0 if step < steps // 2 else mult)
            for g in opt.param_groups:
                g["lr"] = sched * g["lr_mult"]
            losses.append(train_step(model, opt, rank, step)[0])
            if masked:  # Lion Cub App. B.1: only weight decay touches never-seen rows
                unused0.mul_(1.0 - sched * 0.5)
            assert identical_across_ranks(flat_params(model)), f"{mode} {opts}: ranks differ after step {step}"
            if ref is not None:
                for g in ref_opt.param_groups:
                    g["lr"] = sched * g["lr_mult"]
                train_step(ref, ref_opt, rank, step)
                # unmasked 1-bit votes move the never-seen rows (tie break of c = 0); all else equals Lion
                same = torch.equal(flat_params(ref), flat_params(model)) if masked else \
                    torch.equal(seen_params(ref), seen_params(model))
                assert same, f"{mode} {opts}: != Lion at step {step}"
        mean_loss = torch.tensor([sum(losses[:3]) / 3, sum(losses[-3:]) / 3])
        dist.all_reduce(mean_loss)
        first, last = (mean_loss / P).tolist()
        assert last < 0.6 * first, f"{mode} {opts}: loss did not fall enough ({first:.3f} -> {last:.3f})"
        unused = model.emb.weight[USED:].detach()
        if masked:
            assert torch.equal(unused, unused0), f"{mode} {opts}: masked never-seen rows moved"
        elif mode in ("onebit", "ps", "hierarchical"):  # tie-broken votes (the exact ps vote is `masked`)
            assert not torch.equal(unused, unused0), f"{mode} {opts}: unmasked rows were expected to move (tie break)"
        if rank == 0:
            print(f"P={P} {mode:12s} {str(opts):80s} loss {first:.3f} -> {last:.3f}", flush=True)


class WideNet(TinyNet):
    """TinyNet with a 1024-wide hidden layer (~50K parameters): long enough that every wire kernel
    runs its fast path (the majority needs more than 255 bytes per rank's chunk)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4321)
        self.fc = torch.nn.Linear(16, 1024)
        self.head = torch.nn.Linear(1024, VOCAB)


def check_native_kernels(rank: int, P: int, steps: int = 5) -> None:
    """comm.kernels=native against eager, from the same start: bit-identical parameters after every
    step, on every rank (1-bit votes, L1 4-bit, stochastic L1 8-bit, L0 16-bit, the sign quantizer
    native has no loop for)."""
    from comm import native

    if native.unavailable("cpu") is not None:
        if rank == 0:
            print(f"native kernels unavailable: {native.unavailable('cpu')}", flush=True)
        return
    cases = [("onebit", {"tie_break": "alternate"}), ("pbit", {"bits": 4, "quantizer": "l1"}),
             ("pbit", {"bits": 8, "quantizer": "l1", "rounding": "stochastic"}), ("pbit", {"bits": 16, "quantizer": "l0"}),
             ("pbit", {"bits": 8, "quantizer": "sign"})]
    calls: list[str] = []
    for name in ("sign_bits", "majority", "quant_blocks", "unpack_sign"):
        real = getattr(native, name)
        setattr(native, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    expect = {"onebit": {"sign_bits", "majority"} if P > 1 else set(), "l1": {"quant_blocks", "unpack_sign"},
              "l0": {"quant_blocks", "unpack_sign"}, "sign": {"unpack_sign"}}
    for mode, opts in cases:
        calls.clear()
        nets, opts_ = [], []
        for impl in ("eager", "native"):
            net = WideNet()
            nets.append(net)
            o = optim.build_optimizer("lion", net.groups(), betas=(0.9, 0.99), eps=1e-8, comm_mode=mode,
                                      comm_options=dict(opts), kernels=impl)
            o.warmup()
            opts_.append(o)
        for step in range(steps):
            for net, o in zip(nets, opts_):
                train_step(net, o, rank, step)
            a, b = flat_params(nets[0]), flat_params(nets[1])
            assert torch.equal(a, b), f"{mode} {opts}: native != eager after step {step}"
            assert identical_across_ranks(b), f"{mode} {opts}: ranks differ after step {step}"
        want = expect[opts.get("quantizer", mode)]
        assert want <= set(calls), f"{mode} {opts}: native kernels called {sorted(set(calls))}, expected {sorted(want)}"


def check_bits_error(P: int) -> None:
    if P < 4:
        return
    model = TinyNet()
    try:
        build(model, "pbit", {"bits": 2})
    except ValueError as e:
        assert "comm.bits=4" in str(e) and str(P) in str(e), e
    else:
        raise AssertionError("2-bit lanes with 4 ranks must be rejected")


def check_momentum_sync(rank: int, P: int) -> None:
    if P < 2:
        return
    model = TinyNet()
    sync = {"every": 2, "layers": ["mlp", "norm"], "start": 3, "stop": 8}  # stop inclusive
    opt = optim.build_optimizer("lion", model.groups(), betas=(0.9, 0.99), comm_mode="onebit", momentum_sync=sync)
    selected = {"mlp", "norm"}
    n_selected = sum(p.numel() for g in opt.param_groups if g["role"] in selected for p in g["params"])
    sent = {}
    for step in range(1, 12):  # the optimizer's step counter starts at 1
        due = 3 <= step <= 8 and step % 2 == 0
        _, report = train_step(model, opt, rank, step, diagnose=step in (4, 5))
        sent[step] = report.bytes_sent
        assert report.phases["momentum_sync"]["bytes_sent"] == (4 * n_selected if due else 0)
        if step in (4, 5):  # spread is measured before the sync; after it only on sync steps
            d = report.diagnostics
            assert d["diag/momentum_spread/mlp"] > 0 and d["diag/momentum_spread/tensor/fc.weight"] > 0, d
            assert d["diag/momentum_spread/embedding"] > 0
            if due:
                assert d["diag/momentum_spread_after_sync/mlp"] == 0.0
                assert d["diag/momentum_spread_after_sync/norm"] == 0.0
                assert d["diag/momentum_spread_after_sync/embedding"] == d["diag/momentum_spread/embedding"]
            else:
                assert not any(k.startswith("diag/momentum_spread_after_sync") for k in d)
        for g in opt.param_groups:
            for p in g["params"]:
                same = identical_across_ranks(opt.state[p]["exp_avg"])
                if g["role"] in selected:
                    assert same == due, f"step {step} role {g['role']}: identical={same}, sync due={due}"
                else:
                    assert not same, f"step {step}: unsynced role {g['role']} has identical momenta"
    # a sync step sends exactly one extra fp32 buffer of the selected momenta
    assert sent[4] - sent[5] == 4 * n_selected, (sent, n_selected)
    assert sent[5] == sent[3] == sent[9] == sent[10], sent


def set_grads(model, grads):
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()


def check_diagnostics(rank: int, P: int) -> None:
    gen = torch.Generator().manual_seed(77)
    model = TinyNet()
    shapes = [p.shape for p in model.parameters()]
    base = [torch.randn(s, generator=gen) for s in shapes]  # dense: no exact zeros
    # (1) identical gradients on all ranks: exact agreement
    for mode, opts in [("onebit", {}), ("pbit", {"bits": 8, "quantizer": "sign"}), ("ps", {"ps_aggregate": "avg"}),
                       ("hierarchical", {})]:
        model = TinyNet()
        opt = build(model, mode, opts)
        for step in range(3):
            set_grads(model, base)
            report = opt.step(diagnose=step == 1)
            sent = report.bytes_sent
            if step == 0:
                plain_sent = sent
            elif step == 1:
                d = report.diagnostics
                assert sent == plain_sent, "diagnostic traffic leaked into the step's bytes"
                assert P == 1 or report.phases["diag"]["bytes_sent"] > 0
                assert report.diag_seconds > 0
                for role in ("", "/embedding", "/mlp", "/head", "/norm", "/tensor/fc.weight", "/tensor/head.bias"):
                    assert d["diag/sign_match" + role] == 1.0, (mode, role, d)
                    assert d["diag/sign_flip" + role] == 0.0, (mode, role, d)
                    assert d["diag/tie_rate" + role] == 0.0, (mode, role, d)
                    assert d["diag/momentum_spread" + role] == 0.0, (mode, role, d)
                table = {k: v for k, v in d.items() if k.startswith("diag/vote_table/exact_")}
                assert len(table) == 9 and abs(sum(table.values()) - 1.0) < 1e-12
                for role in ("embedding", "mlp", "head", "norm"):  # one table per role, each a distribution
                    cells = [v for k, v in d.items() if k.startswith(f"diag/vote_table/{role}/exact_")]
                    assert len(cells) == 9 and abs(sum(cells) - 1.0) < 1e-12, (role, cells)
                assert not any(k.startswith(("diag/vote_table/tensor", "diag/vote_table/block")) for k in d)
                assert table["diag/vote_table/exact_pos_vote_pos"] + table["diag/vote_table/exact_neg_vote_neg"] == 1.0
                assert set(report.histograms) == {f"c_local/{r}" for r in ("embedding", "mlp", "head", "norm")}
                assert report.histograms["c_local/embedding"].numel() == model.emb.weight.numel()
    # (2) opposite gradients on half the ranks, on a known subset of elements (even P only)
    if P % 2:
        return
    flip = [torch.rand(s, generator=gen) < 0.3 for s in shapes]
    names_by_index = ["emb.weight", "fc.weight", "fc.bias", "head.weight", "head.bias"]  # model.parameters() order
    n_flip = sum(int(f.sum()) for f in flip)
    total = sum(f.numel() for f in flip)
    sign = -1.0 if rank >= P // 2 else 1.0
    grads = [torch.where(f, sign * b, b) for f, b in zip(flip, base)]
    for mode, opts in [("onebit", {}), ("pbit", {"bits": 8, "quantizer": "sign"})]:
        model = TinyNet()
        opt = build(model, mode, opts)
        set_grads(model, grads)
        d = opt.step(diagnose=True).diagnostics
        frac = n_flip / total
        # flipped elements: sum of signs 0 (tie), exact Lion mean 0; the 1-bit vote breaks the tie
        # to +-1 (no match, no flip); the p-bit sum is exactly 0 (a match)
        assert abs(d["diag/tie_rate"] - frac) < 1e-12, (d["diag/tie_rate"], frac)
        assert abs(d["diag/vote_table/exact_zero_vote_zero"] - frac) < 1e-12
        expected_match = 1.0 if mode == "pbit" else 1.0 - frac
        assert abs(d["diag/sign_match"] - expected_match) < 1e-12, (mode, d["diag/sign_match"], expected_match)
        assert d["diag/sign_flip"] == 0.0
        for role, ps in (("embedding", [0]), ("mlp", [1]), ("head", [3]), ("norm", [2, 4])):
            k_flip = sum(int(flip[i].sum()) for i in ps)
            k_all = sum(flip[i].numel() for i in ps)
            assert abs(d[f"diag/tie_rate/{role}"] - k_flip / k_all) < 1e-12
            assert abs(d[f"diag/vote_table/{role}/exact_zero_vote_zero"] - k_flip / k_all) < 1e-12
            for i in ps:  # per tensor too
                assert abs(d[f"diag/tie_rate/tensor/{names_by_index[i]}"] - int(flip[i].sum()) / flip[i].numel()) < 1e-12
            # m_i = (1 - b2) g_i = +-a on the flipped elements: the std across ranks is |a|
            params = list(model.parameters())
            want = max(float(opt.state[params[i]]["exp_avg"][flip[i]].abs().max()) for i in ps if flip[i].any())
            assert math.isclose(d[f"diag/momentum_spread/{role}"], want, rel_tol=1e-12), (role, d, want)


def check_state_round_trip(rank: int, P: int) -> None:
    opts = {"bits": 8, "quantizer": "l1", "rounding": "stochastic"}
    model = TinyNet()
    opt = build(model, "pbit", opts)
    for step in range(3):
        train_step(model, opt, rank, step)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    assert P == 1 or not identical_across_ranks(opt.state[model.emb.weight]["exp_avg"])  # per-rank state
    assert P == 1 or not identical_across_ranks(opt.exchange.gen.get_state())  # stochastic rounding: a stream per rank
    for step in range(3, 7):
        train_step(model, opt, rank, step)
    twin = TinyNet()
    twin.load_state_dict(saved_model)
    twin_opt = build(twin, "pbit", opts)
    twin_opt.load_state_dict(saved_opt)
    for step in range(3, 7):
        train_step(twin, twin_opt, rank, step)
    assert torch.equal(flat_params(model), flat_params(twin)), "state_dict round trip diverged"


def main() -> None:
    dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    from _checks import Checks  # tests/workers/ is the script's directory
    checks = Checks(CHECKS)
    checks.run("bits_error", check_bits_error, P)
    checks.run("diagnostics", check_diagnostics, rank, P)
    checks.run("momentum_sync", check_momentum_sync, rank, P)
    checks.run("state_round_trip", check_state_round_trip, rank, P)
    checks.run("modes", check_modes, rank, P)
    checks.run("native_kernels", check_native_kernels, rank, P)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from _exit import exit_cleanly  # tests/workers/ is the script's directory
    main()
    exit_cleanly()
