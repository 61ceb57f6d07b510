"""comm.mode=auto: pick the communication mode from measurements at start, keep the decision.

At start (every rank, before the model is built) trainer.advise measures this run's links, its
model's forward + backward and each candidate's local optimizer work, predicts every candidate's
step time and picks the fastest allowed one, leaving fp32 only when it is predicted more than
comm.auto_min_gain faster (trainer.advise.pick; the decision line says when it stays). Candidates:
the named variants (configs/variants) of the configured optimizer whose mode (or name) is in
comm.auto_allow and that add no momentum synchronisation of their own (that is a quality choice, not
a speed one; the user's comm.momentum_sync is kept); of those, the quality evidence
(trainer/auto_quality.yaml over the study-prose tables) keeps out ablations, variants without
evidence and those measured worse than fp32 beyond noise, unless comm.auto_allow names them; the
table says why each is out.
The decision, with the whole table, is written to <out_dir>/auto_mode.json and logged (console,
metrics.jsonl, wandb). A resumed run (train.resume=auto with a checkpoint) reads it back instead of
measuring, unless comm.auto_remeasure is set; there is no switching mid-run. A stored decision that is
not valid JSON is measured again and rewritten; one that is JSON of another shape (edited by hand, or
another program's file) is a ConfigError naming the file, on every rank.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from util import atomic_write
from util.files import FileShapeError, read_json_object

from . import advise
from .config import AUTO_MODE, Config, ConfigError
from .config_validate import allowed_variants
from .dist import DistInfo

DECISION = "auto_mode.json"


def candidates(cfg: Config) -> list:
    """The variants comm.mode=auto chooses among for cfg (trainer.advise.Candidate)."""
    return [advise.load_variant(name) for name in allowed_variants(cfg)]


# what resolve() and the trainer's log read from a stored decision, with the types they need
FIELDS = {"variant": str, "mode": str, "sections": dict, "predicted_step_s": float}


def stored_decision(out_dir: Path) -> dict | None:
    """The decision kept in <out_dir>/auto_mode.json; None when there is none or it is not JSON
    (measured again, and rewritten). JSON of another shape raises ConfigError naming the file."""
    path = Path(out_dir) / DECISION
    if not path.is_file():
        return None
    try:
        json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # unreadable: measured again, and rewritten
    fix = "delete it to measure again, or set comm.auto_remeasure=true"
    try:
        decision = read_json_object(path, FIELDS, fix=fix)
        if not all(isinstance(decision["sections"].get(k, {}), dict) for k in ("optim", "comm")):
            raise FileShapeError(f"{path}: 'sections' has an optim or comm entry that is not an object; {fix}")
    except FileShapeError as e:
        raise ConfigError(str(e)) from None
    return decision


def _has_checkpoint(out_dir: Path) -> bool:
    return any((Path(out_dir) / "ckpt").glob("step_*/meta.json"))


def resolve(cfg: Config, info: DistInfo, data_dir: Path, say: Callable[[str], None]) -> tuple[Config, dict]:
    """(cfg with comm.mode and its options replaced by the chosen variant's, the decision).
    Collective: every rank calls it; every rank returns the same choice (rank 0's), or raises the
    same ConfigError."""
    assert cfg.comm.mode == AUTO_MODE
    decision, error, previous = None, None, None
    if info.is_main and cfg.train.resume == "auto" and _has_checkpoint(Path(cfg.train.out_dir)):
        try:
            previous = stored_decision(Path(cfg.train.out_dir))
        except ConfigError as e:  # told to every rank below, so none waits for the others
            if not cfg.comm.auto_remeasure:  # remeasure is the way past a damaged decision file: rewritten
                error = str(e)
        if previous is not None and not cfg.comm.auto_remeasure:
            decision = {**previous, "source": "stored"}
    box = [(decision, error, previous)]
    if info.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    decision, error, previous = box[0]
    if error:
        raise ConfigError(error)
    if decision is None:
        cands = candidates(cfg)
        if not cands:
            raise ConfigError(f"comm.mode=auto: no variant of optim.name={cfg.optim.name} in configs/variants "
                              f"runs on comm.auto_allow={cfg.comm.auto_allow}; widen comm.auto_allow")
        verdicts = advise.quality_verdicts([c.name for c in cands], cfg.comm.auto_allow)
        allowed = [c.name for c in cands if verdicts[c.name].allowed]
        if not allowed:  # known before measuring anything: no minutes of links and compute for no choice
            raise ConfigError("comm.mode=auto: the quality evidence allows none of its candidates ("
                              + "; ".join(f"{c.name}: {verdicts[c.name].evidence}" for c in cands)
                              + "); name a variant in comm.auto_allow to allow it anyway, or pick comm.mode yourself")
        say(f"comm.mode=auto: measuring links, model and the {len(allowed)} of {len(cands)} candidate(s) the "
            f"quality evidence allows ({', '.join(allowed) or 'none'}"
            f"{'; the table says why the others are out' if len(allowed) < len(cands) else ''})")
        result = advise.advise(cfg, cands, info.device, data_dir, log=say, exclude=True,
                               named=cfg.comm.auto_allow)
        ok = [r for r in result["rows"] if r["status"] == "ok"]
        if not ok:
            reasons = "; ".join(f"{r['variant']}: {r.get('reason')}" for r in result["rows"])
            raise ConfigError(f"comm.mode=auto: no allowed variant can run this config ({reasons}); name a "
                              f"variant in comm.auto_allow to allow it anyway, or pick comm.mode yourself")
        best, why = advise.pick(result, cfg.comm.auto_min_gain)
        decision = {"variant": best["variant"], "mode": best["mode"], "why": why,
                    "sections": next(c.sections for c in cands if c.name == best["variant"]),
                    "predicted_step_s": best["step_s"], "world_size": info.world_size, "source": "measured",
                    "table": result["rows"], "links": result["links"], "compute": result["compute"]}
        box = [decision]
        if info.world_size > 1:
            dist.broadcast_object_list(box, src=0)  # every rank runs rank 0's pick
        decision = box[0]
        say(advise.table_markdown(result))
        if previous is not None and previous["sections"] != decision["sections"]:  # a run keeps its mode
            raise ConfigError(f"comm.auto_remeasure=true picked {decision['variant']} now, but the checkpoint in "
                              f"{cfg.train.out_dir} was trained with {previous['variant']} ({DECISION}); a run "
                              f"cannot change its comm.mode mid-way: resume without comm.auto_remeasure to keep "
                              f"{previous['variant']}, or start a new run (another train.out_dir) to train with "
                              f"{decision['variant']}")
    cand = advise.Candidate(decision["variant"], decision["sections"])
    chosen = advise.config_from_dict(advise.candidate_config(cfg.to_dict(), cand))
    changed = advise.replaced_keys(cfg.to_dict(), chosen.to_dict())
    if changed:  # the variant's own options of the user's optimizer (its recipe never replaces the user's)
        say(f"comm.mode=auto: {decision['variant']} sets " + "; ".join(changed))
    say(f"comm.mode=auto -> {decision['variant']} (comm.mode={chosen.comm.mode}; "
        f"{'kept from ' + DECISION if decision['source'] == 'stored' else 'measured now'}; "
        f"predicted {1e3 * decision['predicted_step_s']:.0f} ms/step"
        f"{'; ' + decision['why'] if decision.get('why') else ''})")
    return chosen, decision


def write_decision(out_dir: Path, decision: dict) -> None:
    atomic_write(Path(out_dir) / DECISION, json.dumps({**decision, "source": "measured"}, indent=1, default=str))


def log_decision(logger, step: int, decision: dict) -> None:
    """The decision as one metrics.jsonl / wandb event (the console has had its lines from resolve)."""
    logger.log({"step": step, "event": "auto_mode", "variant": decision["variant"], "mode": decision["mode"],
                "source": decision["source"], "predicted_step_ms": 1e3 * decision["predicted_step_s"],
                "table": decision.get("table")})


__all__ = ["DECISION", "candidates", "log_decision", "resolve", "stored_decision",
           "write_decision"]
