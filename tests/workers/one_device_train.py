"""Train variants of configs/variants/ for a few steps of the debug model in ONE process group whose ranks
share one device (started by launch/one_device.py), and write what happened to the JSON path argv[1].

    python -m launch.one_device --nproc 2 tests/workers/one_device_train.py OUT.json lion_fp32,lioncub_1bit [--shard]

Per variant ("name" or "name@key=value@..."): the parameters' sha256 on every rank (the trainer raises when
replicas differ) and the device they lived on. `--shard`: parallel.shard_size=2 (FSDP2 mesh, DCP checkpoints):
a run stopped at step 2 and resumed from its DCP checkpoint ends bit-identical to a straight 4-step run.
Rank 0 prints one line per finished item ("ONE_DEVICE ...") as it goes and rewrites the JSON after each, so a
killed run shows how far it got; a run that raises (on every rank alike) is recorded and the next one runs; the
exit status is 1 when any failed.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from trainer import parallel  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.dist import init_distributed, shutdown  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402
from _trainer import fit  # noqa: E402  (tests/workers/ is the script's directory)

DEVICE = os.environ.get("LIONCUB_ONE_DEVICE", "cpu")
# untied embeddings so the head-sync presets are legal; clipping, decay and a warm-up within the run
OVERRIDES = ["model.preset=debug", "model.tie_embeddings=false", "data.batch_size=2", "data.seq_len=32",
             "train.max_steps=4", "train.eval_every=0", "train.eval_steps=1", "train.log_every=2",
             "optim.lr=1e-3", "optim.warmup_steps=1", "log.wandb=disabled", "comm.momentum_sync.every=0",
             f"train.device={DEVICE}", "train.ckpt_every=0"]
# per variant: momentum sync within the run; 1-bit Adam's compression starting within it
SYNC = {"lioncub_4bit_synchead": ["comm.momentum_sync.every=2"], "lioncub_syncall": ["comm.momentum_sync.every=2"],
        "onebit_adam": ["optim.freeze_step=2"]}


def say(info, msg: str) -> None:
    if info.is_main:
        print(f"ONE_DEVICE {msg}", flush=True)


def trainer(info, base: str, overrides: list[str]) -> Trainer:
    return Trainer(load_config(ROOT / "configs" / "variants" / f"{base}.yaml", OVERRIDES + SYNC.get(base, []) + overrides),
                   info)


def run_variant(info, spec: str, tmp: Path, extra: list[str]) -> dict:
    base, *more = spec.split("@")
    out = tmp / spec.replace("@", "_").replace("=", "-")
    t0 = time.perf_counter()
    tr = trainer(info, base, list(more) + extra + [f"train.out_dir={out}"])
    device = next(tr.model.parameters()).device.type
    fit(tr)
    torch.distributed.barrier()  # rank 0 writes metrics.jsonl: every rank reads it only once rank 0 has closed it
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    shas = [r for r in recs if "param_sha256" in r][-1]["param_sha256"]
    assert len(shas) == info.world_size and len(set(shas)) == 1, (spec, shas)
    assert device == DEVICE, f"{spec}: parameters on {device}, not {DEVICE}"
    rec = {"sha256": shas[0], "device": device, "seconds": round(time.perf_counter() - t0, 1)}
    say(info, f"{spec}: {info.world_size} replicas bit-identical on {device} ({shas[0][:12]}), {rec['seconds']} s")
    return rec


def full(tr: Trainer) -> list[torch.Tensor]:
    return [(p.full_tensor() if tr.parallel.sharded else p).detach().cpu().clone()
            for _, p in sorted(tr.model.named_parameters())]


def shard_check(info, tmp: Path) -> dict:
    """parallel.shard_size=2: a straight 4-step run, and a run stopped at step 2 then resumed from its DCP
    checkpoint, end bit-identical."""
    t0 = time.perf_counter()
    base = ["parallel.shard_size=2", "comm.kernels=eager", "train.ckpt_every=1", "train.keep_ckpts=5"]
    a = trainer(info, "lioncub_1bit", base + [f"train.out_dir={tmp}/straight", "train.resume=never"])
    assert a.parallel.sharded
    fit(a)
    straight = full(a)
    b = trainer(info, "lioncub_1bit", base + [f"train.out_dir={tmp}/stopped", "train.resume=never", "train.stop_after=2"])
    assert fit(b)["stopped"]
    say(info, f"shard_size=2: stopped at step 2, DCP checkpoint written ({time.perf_counter() - t0:.1f} s)")
    c = trainer(info, "lioncub_1bit", base + [f"train.out_dir={tmp}/stopped", "train.resume=auto"])
    fit(c)
    resumed = full(c)
    same = all(torch.equal(x, y) for x, y in zip(straight, resumed))
    assert same, "the resumed sharded run ended elsewhere than the straight one"
    digests = parallel.param_digests(c.model, c.parallel, info.world_size)
    rec = {"resumed_equals_straight": same, "device": next(c.model.parameters()).device.type,
           "sha256": digests[0], "seconds": round(time.perf_counter() - t0, 1)}
    say(info, f"shard_size=2: resumed from DCP == straight run, bit for bit ({rec['seconds']} s)")
    return rec


def main(out_path: str, variants: list[str], flags: list[str]) -> None:
    info = init_distributed(DEVICE)
    extra = [f for f in flags if "=" in f]
    tmp = Path(str(Path(out_path).with_suffix("")) + "_runs")
    result = {"world_size": info.world_size, "device": DEVICE, "variants": {}}
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:  # after every item: a run cut short still reports what finished
        if info.is_main:
            Path(out_path).write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")

    failed = []
    for spec in variants:
        try:
            result["variants"][spec] = run_variant(info, spec, tmp, extra)
        except Exception as e:  # noqa: BLE001  the same error on every rank (a config or code error): go on
            failed.append(spec)
            result["variants"][spec] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"}
            # every rank says its own failure: one rank's error (not the others') would otherwise go unseen
            print(f"ONE_DEVICE {spec}: FAILED on rank {info.rank}: {result['variants'][spec]['error']}", flush=True)
        write()
    if "--shard" in flags:
        result["shard"] = shard_check(info, tmp / "shard")
        write()
    torch.distributed.barrier()  # every rank has read its last metrics.jsonl before rank 0 removes the runs
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    shutdown()
    if failed:
        raise SystemExit(f"one_device_train: {len(failed)} of {len(variants)} runs failed: {', '.join(failed)}")


if __name__ == "__main__":
    from _exit import exit_cleanly  # tests/workers/ is the script's directory

    try:
        main(sys.argv[1], [v for v in sys.argv[2].split(",") if v], sys.argv[3:])
    except SystemExit as e:
        print(e, file=sys.stderr)
        exit_cleanly(1)
    exit_cleanly()
