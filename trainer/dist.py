"""Process-group setup: gloo on CPU, NCCL on CUDA; a one-rank group when run without torchrun,
so every code path (including update-sync optimizers) runs the same way at P = 1."""
from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

import comm


@dataclass
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _round_store(world: int, timeout_s: float) -> dist.Store | None:
    """Under torchrun's elastic agent, a store private to this restart round (None otherwise).

    The agent's TCPStore outlives a round (with --rdzv_backend=c10d its port stays the same), and
    torch's env:// init reuses it without a per-round prefix, so a restarted round can read the
    previous round's gloo listening addresses and fail with "connectFullMesh ... Connection
    refused" (as a round restarted after a SIGKILL usually does, costing one --max-restarts). A
    prefix by restart count and world size keeps rounds apart; every rank of a round sees the same
    TORCHELASTIC_RESTART_COUNT."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return dist.PrefixStore(f"lioncub/restart_{os.environ['TORCHELASTIC_RESTART_COUNT']}/world_{world}", agent)


def init_distributed(device: str = "auto", timeout_s: float = 600.0, init_timeout_s: float | None = None) -> DistInfo:
    """Join the process group. `init_timeout_s` bounds forming the group (a restarted round whose
    peers never show up fails fast and the launcher can restart it again); collectives then use
    `timeout_s`."""
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is visible; use train.device=cpu or auto")
    if "RANK" not in os.environ:  # plain `python train.py`: a one-rank group on loopback
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev, backend = torch.device("cuda", local_rank), "nccl"
    else:
        dev, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        setter = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        first = min(timeout_s, init_timeout_s) if init_timeout_s and setter else timeout_s
        kwargs = dict(backend=backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=first))
        store = _round_store(world, first)
        if store is not None:
            kwargs["store"] = store
        if backend == "nccl":
            kwargs["device_id"] = dev
        dist.init_process_group(**kwargs)
        if first != timeout_s:
            setter(datetime.timedelta(seconds=timeout_s))
    return DistInfo(rank, world, local_rank, dev, backend)


_before_shutdown: list = []  # callables run by `shutdown` first (trainer/checkpoint.py: a background save's wait)


def before_shutdown(fn) -> None:
    """Have `shutdown` call fn() (no arguments, no collectives) before it tears the process group down:
    the process leaves with os._exit right after (train.py), which would cut a background thread short."""
    if fn not in _before_shutdown:
        _before_shutdown.append(fn)


def shutdown() -> None:
    while _before_shutdown:
        _before_shutdown.pop()()
    if dist.is_initialized():
        dist.destroy_process_group()


def all_agree(flag: bool, device: torch.device) -> bool:
    """True on every rank if `flag` is True on any rank (a tiny control allreduce)."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def mean_over_ranks(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)  # exact byte counts (NCCL has fp64)
    dist.all_reduce(t)
    return (t / comm.world(None)[0]).tolist()
