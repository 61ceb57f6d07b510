"""Launch helpers: the one-machine bandwidth simulator (launch.netsim) and cluster scripts (launch/slurm)."""
