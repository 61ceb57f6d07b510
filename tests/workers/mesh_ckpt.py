"""Checkpoints of Muon and Dion on the hybrid-sharding mesh (launched by tests/optim/test_mesh_optim.py):
4 ranks, parallel.shard_size=2, debug model. For each: a run stopped at step 2 (train.stop_after)
and resumed from its sharded checkpoint ends bit-identical to an uninterrupted 4-step run, and every
rank's matrix state (Muon's momentum rows; Dion's M and Q shards) equals what it saved. On another mesh
(2 x 2 -> 1 x 4) Muon resumes with every rank's momentum its chunk of the whole momentum (identical on
the replicas: it follows the mean gradient) and trains on. Dion's step-2 checkpoint resumes at
S = 4 (1 x 4: the replicas' momenta averaged once, M and Q re-cut) and at S = 1 (4 x 1: whole M and
Q on every rank) and ends within TOL of the uninterrupted S = 2 run (Dion Thm. 2.1: the step depends
on the replicas' mean momentum only; the meshes differ in fp32 reduction order). Each is a named
check (CHECKS; tests/workers/_checks.py records its outcome)."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from trainer.config import load_config  # noqa: E402
from trainer.dist import init_distributed, shutdown  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402
from _trainer import fit  # noqa: E402  (tests/workers/ is the script's directory)

CHECKS = ("muon_resume_exact", "muon_another_mesh", "dion_resume_exact", "dion_another_mesh")
TOL = 2e-5
"""Max |difference| of any parameter between the remeshed Dion resumes and the uninterrupted run
(fp32 reduction orders, as tests/workers/mesh_optim.py's TOL; a wrong cut of M or Q moves a weight by
about lr * scale = 2e-2)."""
BASE = ["model.preset=debug", "data.batch_size=2", "data.seq_len=32", "train.max_steps=4", "train.eval_every=0",
        "train.eval_steps=1", "log.wandb=disabled", "optim.lr=1e-3", "comm.kernels=eager", "train.ckpt_every=1",
        "train.keep_ckpts=5", "parallel.shard_size=2", "train.log_every=1"]


def trainer(out: Path, extra: list[str], variant: str) -> Trainer:
    # Dion's clipping norm adds the spread of the replicas' matrix gradients (optim/dion.py _clip_), so
    # it depends on the replica count: its runs clip nothing, to compare across meshes
    own = ["optim.grad_clip=0"] if variant == "dion" else []
    return Trainer(load_config(ROOT / f"configs/variants/{variant}.yaml",
                               BASE + [f"train.out_dir={out}"] + own + extra), INFO)


def full(tr: Trainer) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for _, p in sorted(tr.model.named_parameters())]


def matrix_state(tr: Trainer) -> list[torch.Tensor]:
    opt = tr.optimizer
    return [v.detach().clone() for k in opt.matrix_idx for _, v in sorted(opt.state[opt.layout.entries[k].param].items())
            if torch.is_tensor(v)]


def gather_matrix_momenta(tr: Trainer) -> list[list[torch.Tensor]]:
    """Per matrix, the momentum row blocks of the shard group of rank 0 (replica 0), in order."""
    opt = tr.optimizer
    mine = [opt.momentum_of(opt.layout.entries[k].param).detach().clone() for k in opt.matrix_idx]
    out = [None] * INFO.world_size
    dist.all_gather_object(out, mine)
    S = tr.parallel.shard_size
    return [[out[s][i] for s in range(S)] for i in range(len(mine))]


def main(tmp: str) -> None:
    global INFO
    INFO = init_distributed("cpu")
    tmp_dir = Path(tmp)
    for variant in ("muon", "dion"):
        checks.begin(f"{variant}_resume_exact")
        a = trainer(tmp_dir / f"{variant}_straight", ["train.resume=never"], variant)
        fit(a)
        b = trainer(tmp_dir / f"{variant}_stopped", ["train.resume=never", "train.stop_after=2"], variant)
        assert fit(b)["stopped"]
        if variant == "dion" and INFO.is_main:  # the step-2 checkpoint, for the resumes on other meshes
            for S in (4, 1):
                shutil.copytree(tmp_dir / "dion_stopped", tmp_dir / f"dion_at_{S}")
        dist.barrier()
        saved = matrix_state(b)
        assert saved, f"{variant}: no matrix state"
        c = trainer(tmp_dir / f"{variant}_stopped", ["train.resume=auto"], variant)
        assert c.step == 2
        assert all(torch.equal(x, y) for x, y in zip(matrix_state(c), saved)), f"{variant}: state changed on load"
        fit(c)
        assert all(torch.equal(x, y) for x, y in zip(full(a), full(c))), f"{variant}: resumed run differs"
        if variant == "muon":  # another mesh, 2 x 2 -> 1 x 4: the momentum rows move like Lion's
            checks.begin("muon_another_mesh")
            whole = [torch.cat(rows) for rows in gather_matrix_momenta(c)]
            e = trainer(tmp_dir / "muon_stopped", ["train.resume=auto", "parallel.shard_size=4", "train.max_steps=5"],
                        variant)
            assert e.step == 4 and all(torch.equal(x, y) for x, y in zip(full(a), full(e)))
            for k, w in zip(e.optimizer.matrix_idx, whole):
                chunk = -(-w.shape[0] // 4)
                got = e.optimizer.momentum_of(e.optimizer.layout.entries[k].param)
                assert torch.equal(got, w[INFO.rank * chunk:(INFO.rank + 1) * chunk]), k
            fit(e)
        if variant == "dion":  # another mesh: S = 4 (dims kept, one replica) and S = 1 (replicated)
            checks.begin("dion_another_mesh")
            for S in (4, 1):
                e = trainer(tmp_dir / f"dion_at_{S}", ["train.resume=auto", f"parallel.shard_size={S}"], variant)
                assert e.step == 2, e.step
                fit(e)
                got = full(e) if S > 1 else [p.detach().clone() for _, p in sorted(e.model.named_parameters())]
                err = max(float((x - y).abs().max()) for x, y in zip(full(a), got))
                assert err < TOL, f"dion resumed at S={S}: max |diff| {err:.3g} to the uninterrupted S=2 run"
                if INFO.is_main:
                    print(f"dion S=2 -> S={S}: max |diff| {err:.3g} after 2 steps", flush=True)
    checks.end()
    dist.barrier()
    shutdown()


if __name__ == "__main__":
    from _checks import Checks  # tests/workers/ is the script's directory
    from _exit import exit_cleanly
    checks = Checks(CHECKS)
    checks.guard(main, sys.argv[1])
    exit_cleanly()
