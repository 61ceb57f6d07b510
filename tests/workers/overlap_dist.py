"""Buckets and overlap (optim/overlap.py): for every registered sync scheme, training the debug
GPT for a few steps with comm.overlap on and off (same buckets) ends with bit-identical
parameters on every rank; schemes that cannot be split into buckets refuse with a clear error.
Launched by tests/optim/test_overlap.py; each scheme is a named check (CHECKS, which must name every
registered scheme; tests/workers/_checks.py records its outcome)."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import optim  # noqa: E402
from model import GPT, get_preset  # noqa: E402
from optim import sync  # noqa: E402
from optim.base import digest  # noqa: E402
from optim.registry import accepts  # noqa: E402
from trainer.param_groups import param_groups  # noqa: E402
from trainer.config import load_config  # noqa: E402

STEPS, ACCUM = 4, 2
CHECKS = ("fp32", "bf16", "onebit", "ps", "hierarchical", "pbit", "loco", "compressed", "diloco")
# the gradient means and Lion Cub's votes are split; the error-feedback schemes keep state that spans the vector
SPLIT = ("fp32", "bf16", "onebit", "ps", "hierarchical", "pbit")


def run(mode: str, name: str, overlap: bool, bucket_mb: float, rank: int) -> tuple[str, int, int]:
    torch.manual_seed(0)
    model = GPT(get_preset("debug", tie_embeddings=False))
    # a DiLoCo run must reach its first outer step within train.max_steps (the defaults' H = 500 does not)
    cfg = load_config(None, [f"optim.name={name}", f"comm.mode={mode}", "optim.lr=1e-3", "optim.grad_clip=0",
                             *(["comm.diloco.inner_steps=10"] if mode == "diloco" else [])])
    opt = optim.build_optimizer(name, param_groups(model, cfg.optim), comm_mode=mode,
                                comm_options=cfg.comm.options, optim_options=cfg.optim.options,
                                param_order=list(model.parameters()), bucket_mb=bucket_mb, overlap=overlap)
    g = torch.Generator().manual_seed(100 + rank)
    sent = buckets = 0
    for step in range(STEPS):
        opt.zero_grad()
        for i in range(ACCUM):
            opt.expect_backward(final=i == ACCUM - 1)
            x = torch.randint(0, 50257, (2, 32), generator=g)
            _, loss = model(x, torch.roll(x, -1, 1))
            (loss / ACCUM).backward()
        report = opt.step()
        sent += report.bytes_sent
    buckets = len(opt._buckets.buckets) if opt._buckets is not None else 1
    return digest(p for _, p in sorted(model.named_parameters())), sent, buckets


def check_scheme(scheme, bucket_mb: float, rank: int, P: int) -> None:
    users = [o.name for o in optim.optimizers() if accepts(o, scheme)]
    name = "lion" if "lion" in users else users[0]
    if scheme.name == "compressed":
        name = "onebit_adam"
    try:
        plain = run(scheme.name, name, False, bucket_mb, rank)
    except ValueError as e:
        assert "cannot exchange its vector in buckets" in str(e) or "as a whole" in str(e), e
        assert scheme.name not in SPLIT, f"{scheme.name} refuses buckets: {e}"
        if rank == 0:
            print(f"P={P} {scheme.name:13s} {name:12s} refuses buckets: {str(e)[:80]}", flush=True)
        return
    over = run(scheme.name, name, True, bucket_mb, rank)
    assert plain[2] > 2, (scheme.name, plain[2])
    assert plain[0] == over[0], f"{scheme.name}/{name}: overlap changed the parameters"
    assert plain[1] == over[1], f"{scheme.name}/{name}: overlap changed the bytes {plain[1]} vs {over[1]}"
    digests = [None] * P
    dist.all_gather_object(digests, over[0])
    assert len(set(digests)) == 1, f"{scheme.name}: ranks differ"
    if rank == 0:
        print(f"P={P} {scheme.name:13s} {name:12s} {plain[2]} buckets: overlap == no overlap, "
              f"{plain[1]} bytes", flush=True)


def main() -> None:
    dist.init_process_group("gloo")
    rank, P = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    bucket_mb = 0.25  # the debug model's 3.3M-parameter embedding is one bucket, the rest several
    from _checks import Checks  # tests/workers/ is the script's directory
    checks = Checks(CHECKS)
    for scheme in sync.schemes():
        checks.run(scheme.name, check_scheme, scheme, bucket_mb, rank, P)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from _exit import exit_cleanly  # tests/workers/ is the script's directory
    main()
    exit_cleanly()
