"""Several ranks on ONE device: P processes time-share one GPU (or the CPU), so the multi-rank paths
(every comm mode, overlap, the FSDP2 mesh, DCP checkpoints) run where only one GPU is lent.

    python -m launch.one_device --nproc 4 train.py configs/default.yaml train.max_steps=20
    python -m launch.one_device --nproc 2 --device cpu tests/workers/one_device_train.py OUT.json

Each rank is a torchrun process (`--standalone`) that runs the script in-process after `install()`:
- on CUDA every rank uses cuda:0 (LOCAL_RANK=0) and the process group is gloo instead of NCCL:
  NCCL refuses two ranks on one device ("invalid usage", NCCL 2.28 with torch 2.11 on an H100). gloo
  takes CUDA tensors in its collectives (all_reduce of every dtype the comm layer sends, all_gather /
  reduce_scatter into one tensor, all_to_all_single, broadcast; checked by launch/gpu_probe.py) by
  copying through host memory, so collective times here are gloo's host path, not NCCL's;
- gloo's point-to-point calls (send / recv / isend / irecv, used by the parameter-server mode) do not
  take CUDA tensors (writev on a device pointer: "Bad address"), so install() stages them through a
  host copy: the bytes sent are the same;
- torch's functional collectives (DTensor's full_tensor and redistribution) on CUDA tensors over gloo crashed
  a process (SIGSEGV), so install() stages them through host copies too;
- on CPU nothing changes: gloo is the backend anyway; the launcher only starts the ranks.
Results are the multi-rank code's results (replicas bit-identical, the same wire bytes); the
speed is not that of P GPUs.
"""
from __future__ import annotations

import argparse
import os
import runpy
import sys
from pathlib import Path

ENV_DEVICE = "LIONCUB_ONE_DEVICE"
"""Set in every rank to the device type all ranks share ("cuda" or "cpu")."""


class _StagedRecv:
    """An irecv into a host buffer whose wait() copies the bytes into the CUDA tensor asked for."""

    def __init__(self, work, buf, dst) -> None:
        self._work, self._buf, self._dst = work, buf, dst

    def wait(self, timeout=None) -> bool:
        ok = self._work.wait() if timeout is None else self._work.wait(timeout)
        self._dst.copy_(self._buf)
        return ok

    def is_completed(self) -> bool:
        return self._work.is_completed()


class _StagedSend:
    """An isend of a host copy; holds the copy until the send is done."""

    def __init__(self, work, buf) -> None:
        self._work, self._buf = work, buf

    def wait(self, timeout=None) -> bool:
        return self._work.wait() if timeout is None else self._work.wait(timeout)

    def is_completed(self) -> bool:
        return self._work.is_completed()


def _stage_p2p(dist) -> None:
    """Point-to-point calls on CUDA tensors over a gloo group go through a host copy."""
    send, recv, isend, irecv = dist.send, dist.recv, dist.isend, dist.irecv

    def staged(t, group) -> bool:
        return t.is_cuda and dist.get_backend(group) == "gloo"

    def send_(tensor, *args, group=None, **kw):
        return send(tensor.cpu() if staged(tensor, group) else tensor, *args, group=group, **kw)

    def recv_(tensor, *args, group=None, **kw):
        if not staged(tensor, group):
            return recv(tensor, *args, group=group, **kw)
        buf = tensor.new_empty(tensor.shape, device="cpu")
        src = recv(buf, *args, group=group, **kw)
        tensor.copy_(buf)
        return src

    def isend_(tensor, *args, group=None, **kw):
        if not staged(tensor, group):
            return isend(tensor, *args, group=group, **kw)
        buf = tensor.cpu()
        return _StagedSend(isend(buf, *args, group=group, **kw), buf)

    def irecv_(tensor, *args, group=None, **kw):
        if not staged(tensor, group):
            return irecv(tensor, *args, group=group, **kw)
        buf = tensor.new_empty(tensor.shape, device="cpu")
        return _StagedRecv(irecv(buf, *args, group=group, **kw), buf, tensor)

    dist.send, dist.recv, dist.isend, dist.irecv = send_, recv_, isend_, irecv_


def install(device: str) -> None:
    """Make this process a rank on the shared `device` ("cuda": cuda:0 over gloo; "cpu": unchanged)."""
    os.environ[ENV_DEVICE] = device
    if device != "cuda":
        return
    import torch.distributed as dist

    os.environ["LOCAL_RANK"] = "0"  # trainer.dist picks cuda:LOCAL_RANK
    init = dist.init_process_group

    def gloo_init(*args, **kwargs):
        if kwargs.get("backend") in ("nccl", "cuda:nccl"):
            kwargs["backend"] = "gloo"
            kwargs.pop("device_id", None)
        return init(*args, **kwargs)

    dist.init_process_group = gloo_init
    _stage_p2p(dist)
    import torch.distributed._functional_collectives as funcol

    _stage_functional(funcol)
    _label_backend(dist)


FUNCTIONAL = ("all_gather_tensor", "all_gather_single", "all_reduce", "reduce_scatter_tensor", "reduce_scatter_single",
              "all_to_all_single", "all_gather_tensor_autograd", "reduce_scatter_tensor_autograd",
              "all_to_all_single_autograd")
"""torch's functional collectives, which DTensor's redistribution (full_tensor, Shard -> Replicate) calls."""


def _stage_functional(funcol) -> None:
    """The functional collectives on CUDA tensors go through host copies: on gloo they crashed the process
    (SIGSEGV in an all_gather of DTensor.full_tensor after a sharded run had trained, torch 2.11 on an
    H100), where gloo's own collectives and FSDP2's did not. Every group here is gloo."""
    for name in FUNCTIONAL:
        real = getattr(funcol, name, None)
        if real is None:
            continue

        def staged(self, *args, _real=real, **kwargs):
            if not getattr(self, "is_cuda", False):
                return _real(self, *args, **kwargs)
            out = _real(self.cpu(), *args, **kwargs)
            if hasattr(funcol, "AsyncCollectiveTensor") and isinstance(out, funcol.AsyncCollectiveTensor):
                out = out.wait()
            return out.to(self.device)

        setattr(funcol, name, staged)


def _label_backend(dist) -> None:
    """trainer.dist names the backend it asked for (NCCL on CUDA); its DistInfo (and so the run's log
    header) names the one the group runs on."""
    try:
        import dataclasses

        import trainer.dist as tdist
    except ImportError:  # a script without the trainer
        return
    real = tdist.init_distributed

    def init_distributed(*args, **kwargs):
        info = real(*args, **kwargs)
        if dataclasses.is_dataclass(info) and dist.is_initialized():
            info = dataclasses.replace(info, backend=dist.get_backend())
        return info

    tdist.init_distributed = init_distributed


def _run_rank(device: str, script: str, args: list[str]) -> None:
    install(device)
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m launch.one_device", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks (processes) on the one device")
    ap.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                    help="the shared device (auto: cuda when one is visible)")
    ap.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # inside torchrun: be one rank
    ap.add_argument("script")
    ap.add_argument("args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    if a.rank:
        _run_rank(a.device, a.script, a.args)
        return 0
    if a.nproc < 1:
        print(f"launch.one_device: --nproc {a.nproc} must be >= 1", file=sys.stderr)
        return 2
    if not Path(a.script).is_file():
        print(f"launch.one_device: no script {a.script!r}; give the path of train.py or a worker script", file=sys.stderr)
        return 2
    import torch

    device = a.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        print("launch.one_device: --device cuda but torch sees no CUDA device; use --device cpu", file=sys.stderr)
        return 2
    import subprocess

    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={a.nproc}",
           "-m", "launch.one_device", "--rank", "--device", device, a.script, *a.args]
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
