"""Buckets and communication overlapped with backward: bit-identical results with and without
overlap for every registered scheme that can be split (tests/workers/overlap_dist.py), clear errors
for the rest, and the config's checks."""
from __future__ import annotations

import pytest

from optim import sync
from tests.checks import Worker, declared_checks
from trainer.config import ConfigError, load_config
from trainer.trainer import Trainer  # noqa: F401  (the trainer wires expect_backward)

OVERLAP_DIST = Worker("overlap_dist.py", timeout=600)


def test_overlap_worker_checks_every_registered_scheme():
    assert sorted(declared_checks("overlap_dist.py")) == sorted(sync.names())


@pytest.mark.parametrize("nproc,check", OVERLAP_DIST.cases([2, 4]))
def test_overlap_is_bit_identical_for_every_scheme(nproc, check):
    OVERLAP_DIST.check(nproc, check)


def test_overlap_config_errors():
    with pytest.raises(ConfigError, match="comm.overlap: true needs buckets; set comm.bucket_mb > 0"):
        _build(["comm.overlap=true"])
    with pytest.raises(ConfigError, match="needs optim.grad_clip=0"):
        _build(["comm.mode=onebit", "comm.bucket_mb=1", "comm.overlap=true", "optim.grad_clip=1.0"])
    with pytest.raises(ConfigError, match="Dion on comm.mode=fp32 cannot exchange its vector in buckets"):
        _build(["optim.name=dion", "comm.bucket_mb=1"])


def _build(overrides):
    import optim
    from model import GPT, get_preset
    from trainer.param_groups import param_groups

    cfg = load_config(None, ["model.preset=debug", *overrides])
    model = GPT(get_preset("debug"))
    c = cfg.comm
    try:
        optim.build_optimizer(cfg.optim.name, param_groups(model, cfg.optim), comm_mode=c.mode, comm_options=c.options,
                              optim_options=cfg.optim.options, grad_clip=cfg.optim.grad_clip,
                              param_order=list(model.parameters()), bucket_mb=c.bucket_mb, overlap=c.overlap)
    except ValueError as e:
        raise ConfigError(str(e)) from None
