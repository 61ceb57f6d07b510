"""Report how this rank was started (tests/harness/test_dist_launcher.py): argv, module name, sys.path[0], working
directory, an environment variable, whether torch was already imported, str hash order and random
seeds; then exit with the code argv[1] asks for ('raise' raises; 'sleep' writes its pid to argv[2] and
waits to be signalled)."""
import json
import os
import random
import sys
import time

PRELOADED = "torch" in sys.modules

import torch  # noqa: E402  (after PRELOADED, which records whether the zygote had imported it)

print(json.dumps({"cpu_capability": torch.backends.cpu.get_cpu_capability(), "rank": int(os.environ["RANK"]),
                  "name": __name__, "argv": sys.argv[1:], "path0": sys.path[0],
                  "cwd": os.getcwd(), "probe": os.environ.get("LAUNCH_PROBE"), "torch_preloaded": PRELOADED,
                  "hash": hash("lioncub"), "random": random.random()}), flush=True)
what = sys.argv[1]
if what == "raise":
    raise RuntimeError("probe asked to fail")
if what == "sleep":
    with open(sys.argv[2] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
    time.sleep(120)
sys.exit(int(what))
