"""launch/one_device.py: several ranks on one device. On CPU the launcher starts gloo ranks as torchrun would;
on a GPU every rank shares cuda:0 over gloo (the tests named *cuda* run where one is visible, and
`make gpu-check` runs the same worker at 2 and 4 ranks)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from launch import one_device

ROOT = Path(__file__).resolve().parents[2]
WORKER = "tests/workers/one_device_train.py"
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible (runs in make gpu-check)")


def _launch(tmp_path: Path, nproc: int, device: str, variants: str, *flags: str, timeout: float = 600):
    out = tmp_path / "out.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    p = subprocess.run([sys.executable, "-m", "launch.one_device", "--nproc", str(nproc), "--device", device, WORKER,
                        str(out), variants, *flags], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"rc={p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return json.loads(out.read_text()), p.stdout


def test_two_ranks_on_cpu_overlap_equals_no_overlap(tmp_path):
    res, log = _launch(tmp_path, 2, "cpu", "lion_fp32@comm.bucket_mb=0.01,lion_fp32@comm.bucket_mb=0.01@comm.overlap=true")
    v = res["variants"]
    assert res["world_size"] == 2 and all(r["device"] == "cpu" for r in v.values())
    assert v["lion_fp32@comm.bucket_mb=0.01"]["sha256"] == v["lion_fp32@comm.bucket_mb=0.01@comm.overlap=true"]["sha256"]
    assert log.count("ONE_DEVICE ") == 2  # one progress line per variant, from rank 0 only


def test_bad_arguments_exit_2_with_one_line(tmp_path):
    for args, needle in ((["--nproc", "0", WORKER], "--nproc 0"), (["no_such_script.py"], "no script")):
        p = subprocess.run([sys.executable, "-m", "launch.one_device", *args], cwd=ROOT, capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 2 and needle in p.stderr and "Traceback" not in p.stderr
        assert len(p.stderr.strip().splitlines()) == 1


class _Work:
    def __init__(self, fn=None):
        self.fn = fn

    def wait(self, timeout=None):
        if self.fn:
            self.fn()
        return True

    def is_completed(self):
        return True


def test_point_to_point_calls_on_cuda_tensors_go_through_host_copies(monkeypatch):
    """gloo's send / recv refuse device pointers; the staged calls hand gloo host tensors and land
    the bytes in the tensor asked for. A stand-in dist module records what gloo would see; a CPU
    tensor that claims to be on CUDA plays the device tensor."""
    seen = []

    def send(t, dst=None, group=None, tag=0):
        seen.append(("send", t.device.type, t.clone()))

    def recv(t, src=None, group=None, tag=0):
        t.copy_(torch.arange(t.numel(), dtype=t.dtype).view_as(t))
        seen.append(("recv", t.device.type))
        return src

    def isend(t, dst=None, group=None, tag=0):
        seen.append(("isend", t.device.type, t.clone()))
        return _Work()

    def irecv(t, src=None, group=None, tag=0):
        seen.append(("irecv", t.device.type))
        return _Work(lambda: t.fill_(7))

    fake = SimpleNamespace(send=send, recv=recv, isend=isend, irecv=irecv, get_backend=lambda group=None: "gloo")
    one_device._stage_p2p(fake)

    class Dev(torch.Tensor):  # a host tensor standing in for a CUDA one
        @property
        def is_cuda(self):
            return True

        def cpu(self):
            return torch.Tensor(self).clone()

        def new_empty(self, *a, **k):
            return torch.empty(*a, dtype=self.dtype, device="cpu")

    x = torch.tensor([1.0, 2.0, 3.0]).as_subclass(Dev)
    fake.send(x, dst=1)
    assert type(seen[-1][2]) is torch.Tensor and torch.equal(seen[-1][2], torch.tensor([1.0, 2.0, 3.0]))
    y = torch.zeros(4).as_subclass(Dev)
    assert fake.recv(y, src=0) == 0 and torch.equal(torch.Tensor(y), torch.arange(4.0))
    w = fake.irecv(y, src=0)
    assert torch.equal(torch.Tensor(y), torch.arange(4.0))  # nothing lands before wait()
    assert w.wait() and torch.equal(torch.Tensor(y), torch.full((4,), 7.0))
    assert fake.isend(x, dst=1).wait() and type(seen[-1][2]) is torch.Tensor
    # a host tensor passes straight through
    z = torch.zeros(2)
    fake.recv(z, src=0)
    assert seen[-1] == ("recv", "cpu") and torch.equal(z, torch.arange(2.0))


@cuda
def test_cuda_two_ranks_every_mode_kind_overlap_ps_and_sharded_dcp(tmp_path):
    res, _ = _launch(tmp_path, 2, "cuda", "lion_fp32,lion_fp32@comm.bucket_mb=0.01@comm.overlap=true,lioncub_1bit,"
                     "lioncub_8bit_l1,dlion_mavo,muon", "--shard")
    assert all(r["device"] == "cuda" for r in res["variants"].values())
    assert res["shard"]["resumed_equals_straight"]


@cuda
def test_cuda_four_ranks(tmp_path):
    res, _ = _launch(tmp_path, 4, "cuda", "lion_fp32,lioncub_1bit,lioncub_4bit,dlion_avg")
    assert res["world_size"] == 4 and all(r["device"] == "cuda" for r in res["variants"].values())


def test_the_run_names_the_backend_the_group_runs_on(monkeypatch):
    """trainer.dist asks for NCCL on CUDA; under the launcher its DistInfo names gloo, which the group runs on."""
    import trainer.dist as tdist

    asked = tdist.DistInfo(0, 2, 0, torch.device("cpu"), "nccl")
    monkeypatch.setattr(tdist, "init_distributed", lambda *a, **k: asked)
    one_device._label_backend(SimpleNamespace(is_initialized=lambda: True, get_backend=lambda group=None: "gloo"))
    info = tdist.init_distributed("cuda")
    assert info.backend == "gloo" and (info.rank, info.world_size) == (0, 2)


def test_functional_collectives_on_cuda_tensors_go_through_host_copies():
    """DTensor's full_tensor runs a functional all_gather, which crashed on gloo with CUDA tensors: the staged
    call hands the collective a host tensor and returns the result on the tensor's device; host tensors pass."""
    seen = []

    def all_gather_single(t, gather_dim, group=None):
        seen.append(type(t))
        return torch.cat([torch.Tensor(t), torch.Tensor(t)], gather_dim)

    fake = SimpleNamespace(all_gather_single=all_gather_single)
    one_device._stage_functional(fake)

    class Dev(torch.Tensor):
        @property
        def is_cuda(self):
            return True

        def cpu(self):
            return torch.Tensor(self).clone()

    x = torch.tensor([1.0, 2.0]).as_subclass(Dev)
    out = fake.all_gather_single(x, 0, group=None)
    assert seen == [torch.Tensor] and torch.equal(torch.Tensor(out), torch.tensor([1.0, 2.0, 1.0, 2.0]))
    fake.all_gather_single(torch.ones(1), 0)
    assert seen[-1] is torch.Tensor and len(seen) == 2
