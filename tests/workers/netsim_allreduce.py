"""Per-rank worker for tests/launch/test_netsim.py: time a gloo allreduce of a known size over netsim links.

Usage (under bench.netsim, which sets RANK/WORLD_SIZE/MASTER_ADDR/GLOO_SOCKET_IFNAME):
    netsim_allreduce.py OUT_DIR N_ELEMENTS
Rank r writes OUT_DIR/rank{r}.json with the median seconds of 3 timed fp32 SUM allreduces, and asserts
the result is exact (sum of per-rank constants), so a run that "finishes" without moving data fails.
"""
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    out_dir, n = sys.argv[1], int(sys.argv[2])
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.full((n,), float(rank + 1))
    dist.all_reduce(x.clone())                       # warm-up: connections, allocations
    times = []
    for _ in range(3):
        y = x.clone()
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(y)
        times.append(time.perf_counter() - t0)
        assert torch.all(y == world * (world + 1) / 2), f"rank {rank}: wrong allreduce result {y[:4]}"
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "seconds": statistics.median(times),
                   "ifname": os.environ.get("GLOO_SOCKET_IFNAME"), "master": os.environ.get("MASTER_ADDR"),
                   "local_rank": os.environ.get("LOCAL_RANK"), "local_world": os.environ.get("LOCAL_WORLD_SIZE")}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    from _exit import exit_cleanly  # tests/workers/ is the script's directory
    main()
    exit_cleanly()
