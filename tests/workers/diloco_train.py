"""comm.mode=diloco in the trainer on 2 gloo ranks (launched by tests/trainer/test_diloco_train.py).

Streaming DiLoCo (H = 3, F = 2 fragments = the debug model's 2 blocks, tau = 1, alpha = 0.5, the
e3m0 wire) trains 7 steps uninterrupted; after every outer step the ranks all-gather digests of
their global parameters (they must be bit-identical) and of their local ones (different between
the workers before a sync: they do train apart). DiLoCo (H = 3, F = 1, fp32) trains 7 steps
uninterrupted, and again in three pieces: stopped at step 3 (right after its outer step), resumed and
stopped at step 4 (in the inner phase), resumed to the end; then rank 1's file of the last
checkpoint is damaged and a resume must fall back to the one of step 4. The streaming run trains
again in two pieces, stopped at step 3 with an average in flight, and once rolled back from a
NaN at step 5 (an average in flight) to its checkpoint of step 3; the uninterrupted streaming run is
extended from its end (step 7, right after a send) to step 10. Each rank writes what the test compares
(`result_<rank>.json`): the per-step bytes each run booked (metrics.jsonl) with the formula's
(optim.diloco.wire_bytes of each fragment whose outer step that step applied: with tau > 0 the
averages run on a background thread and their bytes join the step that waits for them; the one
still in flight at the end, and the final average of each fragment that trained since its last send
(comm.diloco.final_average), in the {"event": "finish"} record), the digest checks, and every run's
final parameter digests, val loss and train losses."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from optim.base import digest  # noqa: E402
from optim.diloco import wire_bytes, worker_drift  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.dist import init_distributed, shutdown  # noqa: E402
from trainer.trainer import Trainer  # noqa: E402

BASE = ["model.preset=debug", "data.batch_size=2", "data.seq_len=32", "train.eval_every=0", "train.eval_steps=1",
        "log.wandb=disabled", "optim.warmup_steps=0", "train.log_every=1", "optim.name=adamw", "optim.lr=3e-3",
        "comm.mode=diloco", "comm.diloco.inner_steps=3", "train.max_steps=7"]
STREAMING = ["comm.diloco.fragments=2", "comm.diloco.overlap_steps=1", "comm.diloco.alpha=0.5",
             "comm.diloco.wire=e3m0", "comm.diloco.block=64"]
DILOCO = ["comm.diloco.fragments=1", "comm.diloco.wire=fp32"]


def gathered(x) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, x)
    return out


def records(run: Path, key: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if key in r]


def train(run: Path, extra: list[str], watch: list | None = None, drift: list | None = None,
          poison: tuple[int, int] | None = None) -> Trainer:
    """Fit one run; with `watch`, every applied outer step appends (step, fragments, global digests of
    every rank, local digests of every rank before the step); with `drift`, every send appends the
    step, the fragment and worker_drift of every rank's pseudo-gradient (gathered whole here); with
    `poison` = (rank, n), that rank's n-th forward returns a NaN loss."""
    tr = Trainer(load_config(ROOT / "configs/default.yaml", BASE + [f"train.out_dir={run}", *extra]), INFO)
    loop = tr.optimizer.strategy.loop
    if poison is not None:
        forward, calls = tr.forward, {"n": 0}

        def poisoned(x, y):
            logits, loss = forward(x, y)
            calls["n"] += 1
            if INFO.rank == poison[0] and calls["n"] == poison[1]:
                loss = loss * float("nan")
            return logits, loss

        tr.forward = poisoned
    if drift is not None:
        d, send = loop.outer, loop.outer.send

        def recorded_send(observe=None) -> list[int]:
            due = d.sends_at(d.step + 1)
            deltas = {k: d.glob[k] - d._flat(k) for k in due}
            done = send(observe)
            for k in due:
                w = worker_drift(gathered(deltas[k]))
                drift.append({"step": d.step, "fragment": k, "spread": w["spread"], "cos_min": min(w["cosine"]),
                              "cos_mean": sum(w["cosine"]) / len(w["cosine"])})
            return done

        d.send = recorded_send
    if watch is not None:
        d, receive = loop.outer, loop.outer.receive

        def checked_receive() -> list[int]:
            due = d.receives_at(d.step)
            before = gathered(digest(p for f in d.local for p in f)) if due else None
            done = receive()
            if done:
                watch.append({"step": d.step, "fragments": done, "global": gathered(digest(d.glob)),
                              "local_before": before})
            return done

        d.receive = checked_receive
    try:
        tr.fit()
    finally:
        tr.logger.close()
        tr.release()
    return tr


def _find(tree, key: str):
    """The first value under `key` in nested dicts / lists (the outer state in a rank file)."""
    if isinstance(tree, dict):
        if key in tree:
            return tree[key]
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        for v in tree:
            found = _find(v, key)
            if found is not None:
                return found
    return None


def main(tmp: str) -> None:
    global INFO
    INFO = init_distributed("cpu")
    tmp_dir = Path(tmp)
    out: dict = {}

    # Streaming DiLoCo: identical global parameters after every outer step; bytes at the collectives
    # with diag.every = 2: the drift of the fragments sent after steps 4 and 6 (not 1, 3, 7), none at 2
    watch: list = []
    drift: list = []
    run = tmp_dir / "streaming"
    tr = train(run, STREAMING + ["diag.every=2"], watch, drift)
    d = tr.optimizer.strategy.loop.outer
    P = tr.optimizer.world_size
    # tau = 1 at 2 ranks: the averages run on the background thread; the bytes they booked at their
    # collectives join the step of their outer step (the send after step 7 is applied by the end)
    formula = {t: sum(wire_bytes(d.o, P, d.numels[k])[0] for k in d.receives_at(t)) for t in range(1, 8)}
    out["streaming"] = {"watch": watch, "formula": formula, "numels": d.numels,
                        "background": [type(a).__name__ for a in d.averages],
                        "booked": {r["step"]: r["comm_bytes"] for r in records(run, "train_loss")},
                        "comm_ms": {r["step"]: r["comm_ms"] for r in records(run, "train_loss")},
                        "sent": {t: sum(wire_bytes(d.o, P, d.numels[k])[0] for k in d.sends_at(t))
                                 for t in range(1, 8)},
                        "finish": records(run, "finish_comm_bytes"),
                        "final_sent": sum(wire_bytes(d.o, P, d.numels[k])[0] for k in range(d.o.fragments)
                                          if d.last_send(k) < d.step),
                        "final": records(run, "param_sha256")[-1]["param_sha256"],
                        "drift": drift, "drift_logged": records(run, "diag/diloco_drift_spread"),
                        "diag_steps": [r["step"] for r in records(run, "diag/seconds")]}

    # the streaming run extended past its end (train.max_steps 7 -> 10, resume=auto): its end applied the
    # average sent after step 7 ahead of its outer step (8), which the extension skips (it raised KeyError)
    train(run, STREAMING + ["train.max_steps=10", "train.resume=auto"])
    out["streaming_extended"] = {"steps": [r["step"] for r in records(run, "train_loss")],
                                 "final": records(run, "param_sha256")[-1]["param_sha256"],
                                 "resumed_at": [x["step"] for x in records(run, "event") if x["event"] == "resume"]}

    # Streaming DiLoCo stopped at step 3 while fragment 1's average (sent after step 3) is in flight,
    # then resumed to the end: the same parameters, and the same bytes per step as the run above (the
    # average in flight at the stop is booked at its outer step, step 4, by the resumed run)
    spieces = tmp_dir / "streaming_pieces"
    train(spieces, STREAMING + ["train.stop_after=3"])
    train(spieces, STREAMING + ["train.resume=auto"])
    out["streaming_pieces"] = {"booked": {r["step"]: r["comm_bytes"] for r in records(spieces, "train_loss")},
                               "comm_ms": {r["step"]: r["comm_ms"] for r in records(spieces, "train_loss")},
                               "finish": records(spieces, "finish_comm_bytes"),
                               "final": records(spieces, "param_sha256")[-1]["param_sha256"],
                               "resumed_at": [x["step"] for x in records(spieces, "event") if x["event"] == "resume"]}

    # Streaming DiLoCo rolled back (train.on_nonfinite=rollback) at step 5, while fragment 0's average
    # sent after step 4 is in flight, to the checkpoint of step 3: that average is dropped and its bytes
    # not booked again when step 4 is replayed, so each step's last record books the formula's bytes
    rolled = tmp_dir / "streaming_rollback"
    train(rolled, STREAMING + ["train.ckpt_every=3", "train.keep_ckpts=5", "train.on_nonfinite=rollback"],
          poison=(1, 5))
    out["streaming_rollback"] = {"booked": {r["step"]: r["comm_bytes"] for r in records(rolled, "train_loss")
                                            if "event" not in r},
                                 "nonfinite": [r["step"] for r in records(rolled, "event")
                                               if r["event"] == "nonfinite"],
                                 "final": records(rolled, "param_sha256")[-1]["param_sha256"]}

    # DiLoCo: uninterrupted, then in three pieces (stop at 3 = an outer step, at 4 = inner phase)
    # the uninterrupted run takes diagnostics (drift at step 6), the pieces none: same parameters
    whole = tmp_dir / "whole"
    d = train(whole, DILOCO + ["diag.every=2"]).optimizer.strategy.loop.outer
    out["blocking_bytes"] = {  # tau = 0: each average runs when sent and books in that step
        "booked": {r["step"]: r["comm_bytes"] for r in records(whole, "train_loss")},
        "formula": {t: sum(wire_bytes(d.o, P, d.numels[k])[0] for k in d.sends_at(t)) for t in range(1, 8)},
        "finish": records(whole, "finish_comm_bytes"),
        "final_sent": sum(wire_bytes(d.o, P, d.numels[k])[0] for k in range(d.o.fragments) if d.last_send(k) < d.step)}
    pieces = tmp_dir / "pieces"
    train(pieces, DILOCO + ["train.stop_after=3"])
    tr = train(pieces, DILOCO + ["train.stop_after=1", "train.resume=auto"])
    # the checkpoint of step 4 (inside a cycle): model.pt holds the global parameters, which
    # differ from this rank's local ones, and the rank file the local ones
    d, ckpt = tr.optimizer.strategy.loop.outer, pieces / "ckpt" / "step_000004"
    names = {id(p): n for n, p in tr.model.named_parameters()}
    saved = torch.load(ckpt / "model.pt", map_location="cpu", weights_only=False)
    saved = saved.get("model", saved)
    chunks = d.glob[0].split([p.numel() for p in d.local[0]])
    rank_file = torch.load(ckpt / f"rank_{INFO.rank:05d}.pt", map_location="cpu", weights_only=False)
    out["checkpoint_mid_cycle"] = {
        "model_is_global": all(torch.equal(saved[names[id(p)]].float().reshape(-1), c)
                               for p, c in zip(d.local[0], chunks)),
        "model_is_local": all(torch.equal(saved[names[id(p)]], p) for p in d.local[0]),
        "rank_file_local": torch.equal(_find(rank_file, "local")[0], d._flat(0)),
        "model_keys": sorted(saved)[:3]}
    train(pieces, DILOCO + ["train.resume=auto"])
    for name, r in (("whole", whole), ("pieces", pieces)):
        out[name] = {"final": records(r, "param_sha256")[-1]["param_sha256"],
                     "val_loss": records(r, "val_loss")[-1]["val_loss"],
                     "losses": {x["step"]: x["train_loss"] for x in records(r, "train_loss")},
                     "resumed_at": [x["step"] for x in records(r, "event") if x["event"] == "resume"]}
    # Dion as the inner optimizer with clipping: the workers clip by their own gradients' norm, so nothing
    # crosses the replicate axis between outer steps (its clipping norm was once averaged over the workers)
    dion = tmp_dir / "dion_clip"
    d = train(dion, DILOCO + ["optim.name=dion", "optim.grad_clip=0.5"]).optimizer.strategy.loop.outer
    out["dion_clip"] = {"booked": {r["step"]: r["comm_bytes"] for r in records(dion, "train_loss")},
                        "formula": {t: sum(wire_bytes(d.o, P, d.numels[k])[0] for k in d.sends_at(t))
                                    for t in range(1, 8)},
                        "clipped": [r.get("grad_norm") for r in records(dion, "train_loss")]}
    # a damaged outer state (rank 1's file of the last checkpoint: its outer state and local
    # parameters) falls back to the previous checkpoint like any damaged file
    last = pieces / "ckpt" / "step_000007" / "rank_00001.pt"
    if INFO.is_main:
        blob = bytearray(last.read_bytes())
        blob[len(blob) // 2] ^= 0xFF
        last.write_bytes(bytes(blob))
    dist.barrier()
    tr = Trainer(load_config(ROOT / "configs/default.yaml", BASE + [f"train.out_dir={pieces}", *DILOCO,
                                                                    "train.resume=auto"]), INFO)
    out["damaged"] = {"step": tr.step, "outer_step": tr.optimizer.strategy.loop.outer.step}
    tr.logger.close()
    tr.release()
    (tmp_dir / f"result_{INFO.rank}.json").write_text(json.dumps(out, indent=1))
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
