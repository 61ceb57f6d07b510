"""Hybrid sharding on 4 ranks (launched by tests/trainer/test_parallel.py), debug model, a few steps, in one
process group; every run is a real Trainer whose steps are driven here:

- fp32 gradient sync (adamw, and global lion) at parallel.shard_size 2 and 4 equals the replicated
  run on the same data: losses, clipped gradient norms (adamw clips every step: the norm over
  shards is global) and parameters within TOL (fp32 reduction order: FSDP's
  reduce-scatter inside the shard group then the mean across replicas, instead of one allreduce);
- Lion Cub onebit at S = 2 equals the replicated hierarchical run with 2 ranks per node (fp32 mean
  inside the group, 1-bit vote across groups: the same mathematics) within TOL;
- after every step every replica holds bit-identical parameters (the digest of the whole tensors,
  gathered in the shard group, is the same on all 4 ranks), and FSDP still writes its gradient
  into the optimizer's flat buffer;
- bytes per step across the replicate axis equal the scheme's formula on N / S elements;
- momentum sync (Lion Cub §5) runs across replicas on the shards: afterwards they hold equal momenta;
- the divergence guard: a NaN in one rank's gradient shard stops the step on every rank;
- the Lion Cub diagnostics at S = 2 are reduced over the shard group (the same on every rank);
- pbit, bf16, the parameter server, LoCo, BinSGDM and 1-bit Adam run at S = 2 with identical
  replicas, the formula's bytes and a finite loss (3 steps say nothing of quality);
- the memory model's parameter + gradient + optimizer-state bytes are within 15 % of the tensors;
- FSDP's own traffic in one step with two micro-steps at S = 4 on a width FSDP2 pads (the bytes each rank
  hands to its all-gathers and reduce-scatters) equals trainer.comm_prediction.fsdp_comm, what
  bench.time_to_loss --cluster books.
Each is a named check (CHECKS; tests/workers/_checks.py records its outcome).
"""
from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from model.memory import estimate, measure  # noqa: E402
from optim.base import digest  # noqa: E402
from trainer import parallel  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.dist import init_distributed, shutdown  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402

STEPS = 3
TOL = 1e-5
"""Max |difference| of any parameter after STEPS steps between runs that differ only in the fp32
reduction order (lr 1e-3: a flipped sign of a near-zero update would be 2e-3, 200x this)."""
LR = 1e-3
FLIPS = 1e-5
"""Sign updates (Lion): at most this fraction of the elements may take the other sign of a near-zero
aggregate (a difference of up to 2 lr per step)."""
MODES = [("lioncub_4bit", [], "update_sync"), ("lion_bf16", [], "grad_sync"), ("dlion_avg", [], "update_sync"),
         ("loco_adamw", [], "grad_sync"), ("binsgdm", [], "update_sync"),
         ("onebit_adam", ["optim.freeze_step=1"], "update_sync")]
BASE = ["model.preset=debug", "data.batch_size=2", "data.seq_len=32", "train.max_steps=10", "train.eval_every=0",
        "train.eval_steps=1", "log.wandb=disabled", f"optim.lr={LR}", "optim.warmup_steps=0", "comm.kernels=eager",
        "train.resume=overwrite"]
CHECKS = ("adamw_clips_by_the_global_norm", "adamw_S2_equals_replicated", "adamw_S4_equals_replicated",
          "lion_S2_equals_replicated", "onebit_S2_equals_hierarchical", "guard", "momentum_sync_across_replicas",
          "lioncub_4bit_S2", "lion_bf16_S2", "dlion_avg_S2", "loco_adamw_S2", "binsgdm_S2", "onebit_adam_S2",
          "fsdp_bytes_match_the_model")


def full_params(tr: Trainer) -> list[torch.Tensor]:
    ps = [p for _, p in sorted(tr.model.named_parameters())]
    return [(p.full_tensor() if tr.parallel.sharded else p).detach().clone() for p in ps]


def run(variant: str, extra: list[str], tmp: Path, diagnose: bool = False) -> dict:
    info = INFO
    out = tmp / f"{variant}_{'_'.join(x.replace('=', '-') for x in extra)}"
    cfg = load_config(ROOT / "configs" / "variants" / f"{variant}.yaml", BASE + extra + [f"train.out_dir={out}"])
    tr = Trainer(cfg, info)
    losses, reports, gnorms = [], [], []  # gnorms: of the whole gradient of each step (before clipping)
    after = []  # this rank's gradient buffers' norm after each step (clipped; a gradient-sync run's gradient)
    init = full_params(tr)
    try:
        for k in range(STEPS):
            r = tr.train_step(diagnose=diagnose and k == STEPS - 1)
            losses.append(r["loss"])
            gnorms.append(float(r["grad_norms"][-1]))
            after.append(float(torch.linalg.vector_norm(torch.cat([b.reshape(-1) for b in tr.optimizer.grad_buffers.values()]))))
            reports.append(r["report"])
            if tr.parallel.sharded:
                assert parallel.grads_routed(tr.model, tr.aliases), "FSDP replaced a gradient: not in the flat buffer"
            shas = [None] * info.world_size
            dist.all_gather_object(shas, digest(full_params(tr)))
            assert len(set(shas)) == 1, f"{variant} {extra}: replicas differ after step {tr.step}: {shas}"
        params = full_params(tr)
        mem = measure(tr.model, tr.optimizer)
        est = estimate(cfg, info.world_size, cfg.parallel.shard_size, model_config=tr.model_config)
    finally:
        tr.logger.close()
        tr.release()
    return {"losses": losses, "gnorms": gnorms, "after": after, "params": params, "init": init, "reports": reports, "opt": tr.optimizer, "mem": mem, "est": est,
            "S": cfg.parallel.shard_size}


def same(a: dict, b: dict, what: str, signs: bool = False, norms: bool = True) -> None:
    """a and b within TOL; `signs` (an update that is a sign: Lion): an element whose aggregate is
    within rounding of 0 may take the other sign, so up to FLIPS of the elements may differ, each
    by at most 2 lr per step."""
    dl = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
    diff = torch.cat([(x - y).abs().reshape(-1) for x, y in zip(a["params"], b["params"])])
    moved = max((x - y).abs().max().item() for x, y in zip(a["params"], a["init"]))
    off = int((diff > TOL).sum())
    print(f"rank {dist.get_rank()} {what}: max |loss diff| {dl:.2e}, max |param diff| {diff.max():.2e}, "
          f"{off} of {diff.numel()} elements beyond {TOL} (params moved up to {moved:.2e})", flush=True)
    assert moved > 100 * TOL, f"{what}: the parameters did not move ({moved})"
    assert dl <= TOL, f"{what}: loss diff {dl} > {TOL}"
    for x, y in zip(a["gnorms"], b["gnorms"]) if norms else ():  # clipping saw the global norm (sharded: summed over the shard group)
        assert abs(x - y) <= 1e-4 * x, (what, a["gnorms"], b["gnorms"])
    if signs:
        assert off <= FLIPS * diff.numel() and diff.max() <= 2 * LR * STEPS * 1.001, (what, off, diff.max())
    else:
        assert off == 0, f"{what}: param diff {diff.max()} > {TOL}"


def check_bytes(res: dict, phase: str) -> None:
    opt = res["opt"]
    R, S = dist.get_world_size() // res["S"], res["S"]
    n = sum(e.numel for e in opt.layout.entries)
    total = sum(p.numel() for p in res["init"])
    assert n == total // S, (n, total, S)  # the debug model's dims divide by S: N / S local elements
    sent, recv = opt.scheme.bytes_per_call(opt.scheme_options, R, n, rank=opt.rank)
    for rep in res["reports"][-1:] if phase == "update_sync" else res["reports"]:  # 1-bit Adam: after freeze_step
        got = rep.phases[phase]
        assert (got["bytes_sent"], got["bytes_recv"]) == (sent, recv), (phase, got, sent, recv)
    assert (sent > 0) == (R > 1)  # one replica: nothing crosses the replicate axis


def check_memory(res: dict) -> None:
    got, est = res["mem"], res["est"]
    assert est.params == got["params"] and est.grads == got["grads"], (est, got)
    assert abs(est.model_state - got["model_state"]) <= 0.15 * got["model_state"], (est, got)


def check_guard(tmp: Path) -> None:
    """A NaN in one rank's gradient shard (rank 1 only): every rank of every replica skips the step."""
    cfg = load_config(ROOT / "configs/variants/lioncub_1bit.yaml",
                      BASE + ["parallel.shard_size=2", f"train.out_dir={tmp / 'guard'}"])
    tr = Trainer(cfg, INFO)
    try:
        before = full_params(tr)
        opt = tr.optimizer
        opt.zero_grad()
        x = torch.randint(0, 1000, (2, 32))
        tr.model(x, x)[1].backward()
        if dist.get_rank() == 1:
            next(iter(opt.grad_buffers.values()))[-1] = float("nan")
        rep = opt.step(loss_finite=True)
        assert rep.nonfinite and opt.steps_done == 0, "a NaN in one shard did not stop every rank"
        assert all(torch.equal(a, b) for a, b in zip(before, full_params(tr)))
    finally:
        tr.logger.close()
        tr.release()


def check_fsdp_bytes(tmp: Path) -> None:
    """One training step at S = 4 with data.grad_accum=2: the bytes this rank sends in FSDP2's collectives
    (a ring all-gather sends S - 1 of its S input shards; a ring reduce-scatter (S - 1) / S of its input),
    counted where FSDP2 calls them, equal fsdp_comm's on the model's meta copy, padding included."""
    from model import GPT
    from trainer.comm_prediction import fsdp_comm

    S = 4  # a width of 66 over 4 ranks: FSDP2 pads every parameter whose first dimension is 66 to 68
    cfg = load_config(ROOT / "configs/variants/adamw_fp32.yaml",
                      BASE + [f"parallel.shard_size={S}", "data.grad_accum=2", "model.n_embd=66", "model.n_head=3",
                              "model.n_kv_head=3", "model.mlp_hidden=170", f"train.out_dir={tmp / 'fsdp'}"])
    tr = Trainer(cfg, INFO)
    sent, calls = [0.0], {"all_gather": 0, "reduce_scatter": 0}
    real = {"all_gather_single": dist.all_gather_single, "reduce_scatter_single": dist.reduce_scatter_single}

    def counted(name: str, arg: str):
        def call(*a, **k):
            x = k[arg] if arg in k else a[1]
            nbytes = x.numel() * x.element_size()
            sent[0] += (S - 1) * nbytes if name == "all_gather_single" else (S - 1) / S * nbytes
            calls[name.split("_single")[0]] += 1
            return real[name](*a, **k)
        return call
    try:
        dist.all_gather_single = counted("all_gather_single", "input_tensor")
        dist.reduce_scatter_single = counted("reduce_scatter_single", "input")
        tr.train_step()
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = real["all_gather_single"], real["reduce_scatter_single"]
        tr.logger.close()
        tr.release()
    with torch.device("meta"):
        meta = GPT(tr.model_config)
    _, want = fsdp_comm(meta, S, 0.0, 1.0, micro_steps=2)
    assert any(p.shape[0] % S for p in meta.parameters()), "no parameter FSDP2 must pad"
    blocks = len(meta.transformer.h)
    assert calls == {"all_gather": 2 * (2 * blocks + 1), "reduce_scatter": 2 * (blocks + 1)}, calls
    assert int(sent[0]) == want, (sent[0], want)


def main(tmp: str) -> None:
    from _checks import Checks  # tests/workers/ is the script's directory
    global INFO
    INFO = init_distributed("cpu")
    checks, tmp_dir = Checks(CHECKS), Path(tmp)
    clip = ["optim.grad_clip=0.05"]  # below the gradient norm: every step clips (by the global norm)
    refs = {}

    def adamw_replicated() -> None:
        ref = refs["adamw"] = run("adamw_fp32", clip, tmp_dir)
        assert all(g > 0.05 for g in ref["gnorms"]), ref["gnorms"]  # every step clips ...
        assert all(abs(g - 0.05) < 1e-4 for g in ref["after"]), ref["after"]  # ... to the global norm 0.05
        check_memory(ref)

    def adamw_sharded(S: int) -> None:
        res = run("adamw_fp32", [f"parallel.shard_size={S}"] + clip, tmp_dir)
        check_bytes(res, "grad_sync")
        check_memory(res)
        same(refs["adamw"], res, f"adamw fp32 S={S} vs replicated")

    def lion_sharded() -> None:
        ref = run("lion_fp32", [], tmp_dir)
        same(ref, run("lion_fp32", ["parallel.shard_size=2"], tmp_dir), "lion fp32 S=2 vs replicated", signs=True)

    def onebit_sharded() -> None:
        # no clipping: the hierarchical run clips every rank's own gradient, the sharded one the group's mean
        hier = run("lioncub_hier", ["comm.node_size=2", "optim.grad_clip=0"], tmp_dir)
        res = run("lioncub_1bit", ["parallel.shard_size=2", "optim.grad_clip=0"], tmp_dir, diagnose=True)
        check_bytes(res, "update_sync")
        # diagnostics on shards: reduced over the shard group, the same numbers on every rank
        diag = res["reports"][-1].diagnostics
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, diag)
        assert all(d == everyone[0] for d in everyone), "diagnostics differ across the ranks of a shard group"
        assert 0 < diag["diag/sign_match"] < 1 and 0 < diag["diag/tie_rate"] < 1 and \
            diag["diag/momentum_spread"] > 0, diag
        check_memory(res)
        same(hier, res, "onebit S=2 vs hierarchical node_size=2", signs=True, norms=False)  # update sync: local norms

    def momentum_sync() -> None:
        # momentum sync of every layer every step: the replicas' momentum shards become equal (mean over replicas)
        res = run("lioncub_syncall", ["parallel.shard_size=2", "comm.momentum_sync.every=1"], tmp_dir)
        moms = torch.cat([res["opt"].momentum_of(e.param).reshape(-1) for e in res["opt"].layout.entries])
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, moms)
        assert torch.equal(everyone[0], everyone[2]) and torch.equal(everyone[1], everyone[3])
        assert not torch.equal(everyone[0][:everyone[1].numel()], everyone[1])  # different shards
        assert res["reports"][-1].phases["momentum_sync"]["bytes_sent"] == 4 * moms.numel()  # fp32, N / S elements

    def other_mode(variant: str, extra: list[str], phase: str) -> None:
        # the other modes across replicas on shards: replicas identical every step (in run), bytes = formula
        res = run(variant, ["parallel.shard_size=2"] + extra, tmp_dir)
        check_bytes(res, phase)
        assert all(map(math.isfinite, res["losses"])), res["losses"]
        print(f"rank {dist.get_rank()} {variant} {extra} S=2: losses {res['losses']}", flush=True)

    checks.run("adamw_clips_by_the_global_norm", adamw_replicated)
    checks.run("adamw_S2_equals_replicated", adamw_sharded, 2)
    checks.run("adamw_S4_equals_replicated", adamw_sharded, 4)
    checks.run("lion_S2_equals_replicated", lion_sharded)
    checks.run("onebit_S2_equals_hierarchical", onebit_sharded)
    checks.run("guard", check_guard, tmp_dir)
    checks.run("momentum_sync_across_replicas", momentum_sync)
    for variant, extra, phase in MODES:
        checks.run(f"{variant}_S2", other_mode, variant, extra, phase)
    checks.run("fsdp_bytes_match_the_model", check_fsdp_bytes, tmp_dir)
    dist.barrier()
    if INFO.is_main:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    shutdown()


if __name__ == "__main__":
    from _exit import exit_cleanly  # tests/workers/ is the script's directory
    main(sys.argv[1])
    exit_cleanly()
