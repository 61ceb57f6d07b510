"""Launch helpers: the torchrun wrapper and cluster scripts (launch/slurm); the bandwidth simulator is the lab's (bench.netsim)."""
