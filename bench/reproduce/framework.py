"""The reproduction framework: a study is a list of training runs of the tool's own entry point,
each in its own run directory, summarized into a table, a plot and raw files.

A `Run` is one `train.py CONFIG key=value ...` invocation (variant preset + overrides + seed +
world size) under `python -m torch.distributed.run --standalone --nproc_per_node=P` (plain
`python train.py` for P = 1). Runs are restartable: a run whose metrics.jsonl holds the final
`params_identical` record and whose recorded spec matches is reused; an unfinished one with a
checkpoint is resumed (train.resume=auto), anything else restarted (train.resume=overwrite).
Results are read back only from RUN_DIR/metrics.jsonl and RUN_DIR/config.yaml, or from the run store.

The run store (<results>/store/<run name>.json.gz, committed with the results) keeps what a summary
needs of every finished run: its spec, config, metrics records, load and wall time, and the study's
`extras` (values read from files the store does not keep, e.g. Fig. 10's final weights from the
checkpoint). Run directories live under bench/out (ignored by git) and do not outlive the machine;
the store does, so seeds added in a later session are summarized with the earlier seeds' runs instead
of retraining them. A run is looked up in its run directory first, then in the store (same spec only).
The entry format, the settings and the scales' overrides are bench.runstore's, re-exported here: the
tools that read stored runs import it, not this package of studies.

Every study writes into its results directory (docs/results/reproduction/ for full runs):
  <study>.csv          the summary table (one row per arm; mean and spread over seeds)
  <study>.md           the same table in markdown, with the paper's numbers, the command and machine
  <study>.png          the plot (matplotlib, Agg)
  <study>_runs.jsonl   one record per run: spec, status, wall time, load before/after, curves
  <study>_meta.json    machine (platform, CPUs, torch), command line, scale, load range
  store/<run>.json.gz  the run store (above); shared by the studies that share runs
`Study` objects live in a registry (`register`, `STUDIES`) so new rows or studies (Dion's
error-feedback ablation, 1-bit Adam / BinSGDM / LoCo vs Lion Cub) plug in when their optimizers
land: a `Run` names the optim.name values it `requires`, and runs whose optimizer this build lacks
are reported as pending instead of failing.
"""
from __future__ import annotations

import csv
import fnmatch
import functools
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

# the settings, the scales' overrides and the run store's entries live in bench.runstore, which the tools that
# read runs (bench.time_to_loss) import without this package's studies; re-exported here under their old names
from ..runstore import (DEFAULT_SETTING, FULL_OVERRIDES, QUICK_OVERRIDES, SETTINGS, Setting, load_stored,  # noqa: F401
                        merge_overrides, store_file)
from ..runstore import write_gz_json as _write_gz_json

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_WORK = Path("bench/out/reproduce")
DEFAULT_RESULTS = Path("docs/results/reproduction")
QUICK_RESULTS = Path("bench/out/reproduce/quick/results")
SPEC_FILE = "reproduce_spec.json"  # written next to the trainer's files, after the run
PENDING_DIR = ".pending"           # under <work>/runs: the spec of a fresh launch until its run ends
LOAD_FILE = "reproduce_load.json"  # load average and wall time of the launch that produced the run
STORE_DIR = "store"                # under the results directory: <run name>.json.gz per finished run
IMPORTED = "imported"              # the source prefix of store entries rebuilt from an older raw record
NOT_RUN = "failed: not run"   # the status of a run --report-only found neither finished nor stored
# the status of a run train.on_nonfinite stopped: a result (stored, counted as diverged, never trained again), not a
# failure to run; "failed" so an lr sweep counts it as worse than any value that finished
DIVERGED = "failed: diverged"
TRAINER_FILES = ("config.yaml", "metrics.jsonl", "ckpt")


# ---------------------------------------------------------------------------------------------
# runs


@dataclass(frozen=True)
class Run:
    """One training run: `train.py config overrides...` on `nproc` ranks with `seed`."""
    name: str                                  # run directory name, unique inside a study
    config: str                                # YAML path relative to the repository root
    overrides: tuple[str, ...] = ()            # this run's own section.key=value overrides
    seed: int = 1337
    nproc: int = 4
    labels: tuple[tuple[str, Any], ...] = ()   # the factors a summary groups by, e.g. (("arm", "1bit"),)
    requires: tuple[str, ...] = ()             # optim.name values this run needs (pending without)

    def label(self, key: str, default: Any = None) -> Any:
        return dict(self.labels).get(key, default)


@dataclass(frozen=True)
class Scale:
    """Sizes shared by a study's runs: the quick (test) or full (benchmark) setting."""
    quick: bool
    steps: int
    overrides: tuple[str, ...]   # model / data / optim settings before each run's own overrides
    eval_every: int = 0          # 0 = only at the end
    eval_steps: int = 4
    log_every: int = 1
    diag_every: int = 0
    ckpt_every: int = 0          # > 0 lets an interrupted full run resume instead of restarting
    nproc: int = 4
    setting: str = "tiny-builtin"   # which model / corpus setting the overrides are (see SETTINGS)

    @property
    def legacy(self) -> bool:
        """The committed full-size setting (tiny preset, built-in corpus) whose runs predate the prose setting."""
        return self.setting == DEFAULT_SETTING and not self.quick


def quick_scale(steps: int = 6, **kw: Any) -> Scale:
    kw = {"eval_steps": 2, "log_every": 2, "nproc": 2, **kw}
    return Scale(quick=True, steps=steps, overrides=QUICK_OVERRIDES, **kw)


def full_scale(steps: int, **kw: Any) -> Scale:
    kw = {"eval_every": max(1, steps // 10), "eval_steps": 8, "log_every": 5, "nproc": 4,
          "ckpt_every": max(1, steps // 4), **kw}
    return Scale(quick=False, steps=steps, overrides=FULL_OVERRIDES, **kw)


def trainer_overrides(run: Run, scale: Scale) -> list[str]:
    """Every override of the run except train.out_dir / train.resume (those depend on the state)."""
    return [*scale.overrides, *run.overrides, f"train.max_steps={scale.steps}",
            f"train.eval_every={scale.eval_every}", f"train.eval_steps={scale.eval_steps}",
            f"train.log_every={scale.log_every}", f"diag.every={scale.diag_every}",
            f"train.ckpt_every={scale.ckpt_every}", f"train.seed={run.seed}", "log.wandb=disabled"]


def command(run: Run, scale: Scale, run_dir: Path, resume: str) -> list[str]:
    """The public entry point: torchrun --standalone (P > 1) or plain python (P = 1) on train.py."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={run.nproc}"]
                if run.nproc > 1 else [sys.executable])
    return [*launcher, "train.py", run.config, *trainer_overrides(run, scale),
            f"train.out_dir={run_dir}", f"train.resume={resume}"]


def run_spec(run: Run, scale: Scale) -> dict:
    """What identifies a run's result: a stored run is reused only when this matches exactly."""
    return {"config": run.config, "overrides": trainer_overrides(run, scale), "nproc": run.nproc}


def read_jsonl(path: str | Path) -> list[dict]:
    """All records of a JSONL file (blank and torn last lines skipped)."""
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a run killed mid-write leaves a partial last line
                continue
    return out


def is_finished(run_dir: Path) -> bool:
    """The trainer's last act is the params_identical record (then the final checkpoint)."""
    f = run_dir / "metrics.jsonl"
    return f.is_file() and any("params_identical" in r for r in read_jsonl(f))


def _records(run_dir: Path) -> list[dict]:
    f = run_dir / "metrics.jsonl"
    return read_jsonl(f) if f.is_file() else []


def diverged_at(records: Sequence[dict]) -> int | None:
    """The step at which train.on_nonfinite stopped the run (its last event is the trainer's DIVERGED_EVENT;
    a resume after it, as --restart's, clears it); None when it did not stop so."""
    from trainer.state import DIVERGED_EVENT

    last = next((r for r in reversed(records) if "event" in r), None)
    return int(last["step"]) if last is not None and last["event"] == DIVERGED_EVENT else None


def diverged_status(step: int) -> str:
    return f"{DIVERGED} at step {step} (train.on_nonfinite stopped it on a non-finite loss or gradient)"


def has_checkpoint(run_dir: Path) -> bool:
    ckpt = run_dir / "ckpt"
    return ckpt.is_dir() and any(ckpt.glob("step_*"))


def pending_spec_path(run_dir: Path) -> Path:
    """Where a fresh launch's spec waits, beside the run directory (the trainer refuses to start in
    a directory holding files it did not write, so the spec cannot go inside before the run)."""
    return run_dir.parent / PENDING_DIR / f"{run_dir.name}.json"


def stored_spec(run_dir: Path) -> dict | None:
    """The spec of the run in `run_dir`: the one written there after its launch, else, for a launch
    killed before it ended, its pending spec, when the trainer (re)made the directory after that
    spec was written (its marker is newer), so the checkpoints there are that launch's."""
    from trainer.rundir import MARKER

    f = run_dir / SPEC_FILE
    if f.is_file():
        return json.loads(f.read_text())
    pending, marker = pending_spec_path(run_dir), run_dir / MARKER
    if pending.is_file() and marker.is_file() and marker.stat().st_mtime_ns >= pending.stat().st_mtime_ns:
        return json.loads(pending.read_text())
    return None


def optimizer_available(name: str) -> bool:
    """Whether this build's config accepts optim.name=`name` (through the public load_config)."""
    from trainer.config import ConfigError, load_config

    try:
        load_config(None, [f"optim.name={name}"])
        return True
    except ConfigError as e:
        return "optim.name" not in str(e)


@functools.lru_cache(maxsize=1)
def machine() -> dict:
    """The machine the numbers come from (no host name)."""
    import torch

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    return {"platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
            "cpu_model": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_count": os.cpu_count(), "cpus_usable": usable, "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.cuda.is_available()}


def cpu_model() -> str:
    """The CPU's model name ("" where /proc/cpuinfo is absent). Recorded because torch's CPU kernels pick
    their vector width (AVX2, AVX-512) by the host: the same run on another host rounds differently and,
    over a few hundred steps, ends as far from the first as another seed does (docs/results/reproduction.md,
    "Same seed, another host")."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        return ""


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


@dataclass
class RunResult:
    run: Run
    status: str                      # ok, reused, pending: ..., failed ...
    run_dir: Path
    records: list[dict] = field(default_factory=list)
    config: dict | None = None
    wall_s: float | None = None
    load_before: list[float] | None = None
    load_after: list[float] | None = None
    how: str = ""                    # fresh, resumed, reused (run directory), stored (run store)
    extras: dict = field(default_factory=dict)   # a study's values kept in the store (see Study.extras)
    source: str = "trained"          # a store entry's origin: trained, or imported (losses only)
    machine: dict | None = None      # the host it trained on (stored runs: as the entry recorded it, if it did)
    tokens: dict | None = None       # {"read", "available"} training tokens (token_budget); None: not recorded
    same_as: str = ""                # read from the store entry of another name with the same spec (stored_specs)
    entry: Path | None = None        # the run-store entry holding it (a stored run, or one Study.execute stored)

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "reused")

    @property
    def diverged(self) -> bool:
        """train.on_nonfinite stopped it: a result with a curve up to the stop, no final value."""
        return self.status.startswith(DIVERGED)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of `key`, the last record winning for a repeated step."""
        pts = {r["step"]: r[key] for r in self.records if key in r and "step" in r}
        xs = sorted(pts)
        return xs, [pts[x] for x in xs]

    def final(self, key: str) -> float | None:
        _, ys = self.series(key)
        return ys[-1] if ys else None

    def window_mean(self, key: str, start_frac: float = 0.5) -> float | None:
        """Mean of `key` over records with step > start_frac * last step (e.g. late diagnostics)."""
        xs, ys = self.series(key)
        if not xs:
            return None
        cut = start_frac * xs[-1]
        vals = [y for x, y in zip(xs, ys) if x > cut] or ys[-1:]
        return sum(vals) / len(vals)


def _launch(run: Run, scale: Scale, run_dir: Path, resume: str, log: Path) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled",
           "TORCH_CPP_LOG_LEVEL": "ERROR"}
    env.pop("RANK", None)  # a launcher around us must not make train.py think it is a rank
    cmd = command(run, scale, run_dir, resume)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as f:
        f.write(f"== {shlex.join(cmd)}\n")
        f.flush()
        return subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT).returncode


# ---------------------------------------------------------------------------------------------
# the run store


def spec_key(spec: dict) -> tuple[str, int]:
    """(what a run trains, its diag.every): the run's config resolved by this build (load_config of its
    config file and overrides, so two override lists that say the same thing in other words match), without
    where it writes and how often it diagnoses, with its world size; and its diagnostics interval. Two runs
    with equal first parts train the same steps from the same seed: diagnostics read the state and change
    nothing (the compressors' Dion run, diagnosed every 10 steps, and dion_ef's rank-1/4 run, never, ended
    bit-identical at all three seeds). A spec this build cannot resolve is its own key."""
    from trainer.config import ConfigError, load_config

    try:
        cfg = asdict(load_config(ROOT / spec["config"], list(spec["overrides"])))
    except (ConfigError, OSError, KeyError, TypeError):
        return json.dumps(spec, sort_keys=True), -1
    every = int(cfg["diag"].pop("every"))
    for k in ("out_dir", "resume"):
        cfg["train"].pop(k, None)
    return json.dumps({"config": cfg, "nproc": spec.get("nproc")}, sort_keys=True, default=str), every


def covers(have_diag: int, want_diag: int) -> bool:
    """A run diagnosed every `have_diag` steps serves a study that wants `want_diag` (0: none)."""
    return want_diag == 0 or have_diag == want_diag


def stored_specs(store: Path | None) -> dict[str, list[tuple[str, int]]]:
    """spec_key's first part -> [(name, diag.every)] of the store entries that trained it (sorted by name), so
    that a run two studies list under different names trains once: the second is read from the first's
    entry (`ensure_run`'s by_spec) where its diagnostics cover the second's (`covers`). Reads every entry
    once (seconds for a hundred runs); a study builds it once per execution or plan."""
    out: dict[str, list[tuple[str, int]]] = {}
    if store is None or not store.is_dir():
        return out
    for f in sorted(store.glob("*.json.gz")):
        name = f.name[:-len(".json.gz")]
        entry = load_stored(store, name)
        if entry is not None and entry.get("spec") is not None:
            key, every = spec_key(entry["spec"])
            out.setdefault(key, []).append((name, every))
    return out


def same_run_stored(by_spec: dict[str, list[tuple[str, int]]], spec: dict, name: str) -> str | None:
    """The name of a stored run of another name that serves `spec` (same training, diagnostics covered)."""
    key, every = spec_key(spec)
    return next((n for n, have in by_spec.get(key, []) if n != name and covers(have, every)), None)


def save_stored(store: Path, res: RunResult, spec: dict, extras: dict | None = None) -> Path | None:
    """Keep a finished run in the store (spec, config, records, load, wall time, extras); returns the
    file when it was (re)written, None when the entry already held the same."""
    entry = {"name": res.run.name, "spec": spec, "source": res.source, "seed": res.run.seed,
             "wall_s": res.wall_s, "load_before": res.load_before, "load_after": res.load_after,
             "config": res.config, "extras": extras or {}, "records": res.records}
    if res.tokens is not None:  # entries from before the no-repeat check have none
        entry["tokens"] = res.tokens
    if res.diverged:  # a finished run's entry holds no status (older entries neither)
        entry["status"] = res.status
    old = load_stored(store, res.run.name)
    if old is not None and {k: v for k, v in old.items() if k not in ("saved", "machine")} == entry:
        return None
    entry["saved"] = time.strftime("%Y-%m-%d %H:%M:%S")
    entry["machine"] = machine()  # where it trained: a run directory does not outlive its machine
    path = store_file(store, res.run.name)
    _write_gz_json(path, entry)
    return path


def import_raw_records(runs_jsonl: Path, store: Path) -> list[str]:
    """Rebuild store entries from a <study>_runs.jsonl written before the store existed: only its loss
    curves and training time survive (no diagnostics, no extras), so the entry's source says so. Runs the
    store already holds are left alone; returns the names imported."""
    done = []
    for rec in read_jsonl(runs_jsonl):
        if rec.get("status") not in ("ok", "reused") or load_stored(store, rec["name"]) is not None:
            continue
        by_step: dict[int, dict] = {}
        for key in ("val_loss", "train_loss"):
            for step, value in rec.get(key) or []:
                by_step.setdefault(int(step), {"step": int(step)})[key] = value
        if not by_step:
            continue
        last = max(by_step)
        if rec.get("train_time_s") is not None:
            by_step[last]["train_time_s"] = rec["train_time_s"]
        run = Run(rec["name"], rec["config"], seed=rec["seed"], nproc=rec["nproc"])
        res = RunResult(run, "ok", Path(rec["run_dir"]), records=[by_step[s] for s in sorted(by_step)],
                        wall_s=rec.get("wall_s"), load_before=rec.get("load_before"),
                        load_after=rec.get("load_after"),
                        source=f"{IMPORTED} from {runs_jsonl.name} (loss curves and training time only)")
        save_stored(store, res, {"config": rec["config"], "overrides": rec["overrides"], "nproc": rec["nproc"]})
        done.append(rec["name"])
    return done


def ensure_run(run: Run, scale: Scale, work: Path, *, restart: bool = False, report_only: bool = False,
               available: Callable[[str], bool] = optimizer_available, echo: Callable[[str], None] = print,
               store: Path | None = None, by_spec: dict[str, list[tuple[str, int]]] | None = None) -> RunResult:
    """Reuse, resume or (re)start one run; return what its run directory (or the store) holds afterwards.
    Order: a finished run directory of the same spec (or one train.on_nonfinite stopped: DIVERGED); else the
    store's entry of the same name and spec;
    else, with `by_spec` (stored_specs), the store's entry of another name with the same spec (a run two
    studies share under different names); else launch (resume from the run directory's checkpoint when
    it has one). --restart skips the reuse."""
    run_dir = (work / "runs" / run.name).resolve()
    missing = [n for n in run.requires if not available(n)]
    if missing:
        return RunResult(run, f"pending: optim.name={','.join(missing)} not in this build", run_dir)
    if not (ROOT / run.config).is_file():
        return RunResult(run, f"pending: {run.config} does not exist", run_dir)
    spec = run_spec(run, scale)
    same = stored_spec(run_dir) == spec
    res = RunResult(run, "failed", run_dir)
    entry = None if restart else load_stored(store, run.name)
    if entry is not None and entry["spec"] != spec:
        entry = None  # another run of the same name
    same_as = ""
    if entry is None and by_spec and not restart and not (same and is_finished(run_dir)):
        other = same_run_stored(by_spec, spec, run.name)
        entry = load_stored(store, other) if other is not None else None
        same_as = other if entry is not None else ""
    if same and is_finished(run_dir) and not restart:
        res.status, res.how = "reused", "reused"
        # the tokens counted at its launch (a --report-only summary counts none) come from its store entry, so
        # re-saving the run (execute) never drops them
        res.tokens = entry.get("tokens") if entry is not None else None
    elif same and not restart and (stop := diverged_at(_records(run_dir))) is not None:
        res.status, res.how = diverged_status(stop), "reused"  # launched again, it would stop there again
        res.tokens = entry.get("tokens") if entry is not None else None
    elif entry is not None:
        return RunResult(run, entry.get("status", "reused"), run_dir, records=entry["records"], config=entry["config"],
                         wall_s=entry["wall_s"], load_before=entry["load_before"], load_after=entry["load_after"],
                         how="stored", extras=entry.get("extras") or {}, source=entry.get("source", "trained"),
                         machine=entry.get("machine"), tokens=entry.get("tokens"), same_as=same_as,
                         entry=store_file(store, same_as or run.name))
    elif report_only:
        res.status = f"{NOT_RUN} (--report-only)"
        return res
    else:
        pending = pending_spec_path(run_dir)

        def fresh() -> None:
            """Before a launch from scratch: our files leave the run directory (rewritten after the
            run; train.resume=overwrite replaces only what the trainer wrote), the spec waits beside it."""
            for n in (SPEC_FILE, LOAD_FILE):
                (run_dir / n).unlink(missing_ok=True)
            pending.parent.mkdir(parents=True, exist_ok=True)
            pending.write_text(json.dumps(spec, indent=1) + "\n")

        resume = "auto" if same and has_checkpoint(run_dir) and not restart else "overwrite"
        if resume == "overwrite":
            fresh()
            if not (run_dir.is_dir() and any(run_dir.iterdir())):
                resume = "never"  # nothing to replace
        log = work / "logs" / f"{run.name}.log"
        echo(f"[{run.name}] {'resuming' if resume == 'auto' else 'starting'} ({run.nproc} rank(s), log {log})")
        res.load_before = loadavg()
        t0 = time.perf_counter()
        rc = _launch(run, scale, run_dir, resume, log)
        if rc != 0 and resume == "auto":  # a checkpoint this build cannot load: start over once
            echo(f"[{run.name}] resume failed (rc={rc}); restarting from scratch")
            fresh()
            rc = _launch(run, scale, run_dir, "overwrite", log)
        res.wall_s = round(time.perf_counter() - t0, 2)
        res.load_after = loadavg()
        res.how = "resumed" if resume == "auto" else "fresh"
        res.status = "ok" if rc == 0 and is_finished(run_dir) else f"failed rc={rc} (see {log})"
        stop = diverged_at(_records(run_dir)) if rc != 0 else None
        if stop is not None:
            res.status = diverged_status(stop)
        if res.status != "ok":  # said now, not only in the study's summary: a suite runs for hours
            echo(f"[{run.name}] {res.status}")
        if (run_dir / "config.yaml").is_file():  # the trainer made it a run dir: record spec and load with it
            (run_dir / SPEC_FILE).write_text(json.dumps(spec, indent=1) + "\n")
            pending.unlink(missing_ok=True)
            (run_dir / LOAD_FILE).write_text(json.dumps(
                {"load_before": res.load_before, "load_after": res.load_after, "wall_s": res.wall_s}) + "\n")
    if (run_dir / "metrics.jsonl").is_file():
        res.records = read_jsonl(run_dir / "metrics.jsonl")
    if (run_dir / "config.yaml").is_file():
        import yaml

        res.config = yaml.safe_load((run_dir / "config.yaml").read_text())
    if res.how == "reused" and (run_dir / LOAD_FILE).is_file():
        stored = json.loads((run_dir / LOAD_FILE).read_text())
        res.load_before, res.load_after, res.wall_s = stored["load_before"], stored["load_after"], stored["wall_s"]
    return res


# ---------------------------------------------------------------------------------------------
# the setting's guards: training tokens read vs available, the lr of each arm, bytes on the wire


def run_config(run: Run, scale: Scale):
    """The trainer's resolved Config of `run` (through the public load_config; ConfigError on a bad override)."""
    from trainer.config import load_config

    return load_config(ROOT / run.config, trainer_overrides(run, scale))


def token_budget(run: Run, scale: Scale, allow_repeat: bool = False) -> dict:
    """{"read", "available"}: the training tokens `run` reads and its corpus holds (data.loader.check_no_repeat).
    Raises StudyUnavailable with the loader's one-line reason when the run would read a token twice, unless
    `allow_repeat` (then "repeats" records how many times over it reads the corpus)."""
    from data import DataError, resolve_dataset
    from data.loader import check_no_repeat, split_shards, open_shard, train_tokens_read

    from trainer.config import ConfigError

    try:
        cfg = run_config(run, scale)
    except ConfigError as e:
        raise StudyUnavailable(f"run {run.name}: {' '.join(str(e).split())}") from None
    d = cfg.data
    try:
        data_dir = resolve_dataset(d.dataset, d.cache_dir or None)
        available = sum(len(open_shard(p)) for p in split_shards(data_dir, "train"))
        read = train_tokens_read(d.batch_size, d.seq_len, run.nproc, cfg.train.max_steps, d.grad_accum)
        if not allow_repeat:
            check_no_repeat(data_dir, d.batch_size, d.seq_len, run.nproc, cfg.train.max_steps, d.grad_accum,
                            d.order)
    except DataError as e:
        raise StudyUnavailable(f"run {run.name}: {e}" + ("" if "twice" not in str(e) else
                               " (or pass --allow-repeat to train on repeated tokens, as the tiny-builtin "
                               "setting's committed runs did)")) from None
    out = {"read": read, "available": available}
    if read > available:
        out["repeats"] = round(read / max(available, 1), 2)
    return out


def tokens_read(r: RunResult) -> int | None:
    """Training tokens the run read: recorded at launch, else from its resolved config (stored runs)."""
    if r.tokens:
        return r.tokens["read"]
    c = r.config or {}
    try:
        d, t = c["data"], c["train"]
        return t["max_steps"] * d.get("grad_accum", 1) * r.run.nproc * d["batch_size"] * d["seq_len"] + 1
    except (KeyError, TypeError):
        return None


def tokens_line(results: Sequence[RunResult]) -> str:
    """'tokens seen / tokens available' over the finished runs (the largest reader), for a report."""
    done = [r for r in results if r.ok]
    have = [r for r in done if r.tokens]
    if have:
        top = max(have, key=lambda r: r.tokens["read"] / max(r.tokens["available"], 1))
        rd, av = top.tokens["read"], top.tokens["available"]
        line = (f"tokens seen / tokens available = {rd:,} / {av:,} ({100 * rd / max(av, 1):.1f} %, run "
                f"{top.run.name}, the largest share of {len(have)} run(s) counted at launch)")
        if rd > av:
            line += f": it reads the training split {rd / av:.2f} times over (--allow-repeat)"
    else:
        line = "tokens seen / tokens available not recorded (runs trained before the suite counted them)"
    rest = [tokens_read(r) for r in done if not r.tokens]
    rest = [x for x in rest if x is not None]
    if rest and have:
        line += f"; {len(rest)} run(s) not counted at launch read up to {max(rest):,} tokens each"
    elif rest:
        line += f"; from their configs, each run read up to {max(rest):,} tokens"
    return line


def lr_line(results: Sequence[RunResult], study: "Study") -> str:
    """Which lr each arm ran at: the setting's shared optim.lr, or the sweep's best per arm (--lr from-sweep)."""
    per = {}
    for r in results:
        if r.run.label("best_lr"):
            per[study.lr_alias.get(preset_of(r.run), preset_of(r.run))] = r.run.label("best_lr")
    if not per:
        return "the setting's optim.lr for every arm, unless a row says otherwise (--lr shared)"
    return "each arm at its best value from the lr_sweep study (--lr from-sweep): " + ", ".join(
        f"{a} {v}" for a, v in per.items())


FROM_SWEEP = "from-sweep"
BEST_LR_FILE = "lr_sweep_best.json"   # written by the lr_sweep study into the setting's results directory


def read_best_lr(opts: Options, scale: Scale) -> dict:
    """The lr sweep's best value per arm for this setting: {arm: {"key", "value", ...}}. Refuses a sweep run
    on another setting (other model / corpus / batch overrides) or a missing one."""
    st = SETTINGS.get(opts.setting)
    src = replace(opts, setting=st.lr_from) if st is not None and st.lr_from and opts.out is None else opts
    path = src.results_dir() / BEST_LR_FILE
    if not path.is_file():
        raise StudyUnavailable(f"--lr {FROM_SWEEP}: {path} does not exist; run `python -m bench.reproduce lr_sweep` "
                               "with the same --setting / --set / --out first")
    best = json.loads(path.read_text())
    if list(best["overrides"]) != list(scale.overrides):
        raise StudyUnavailable(f"--lr {FROM_SWEEP}: {path} was swept with overrides {' '.join(best['overrides'])}, "
                               f"this study runs {' '.join(scale.overrides)}; rerun lr_sweep on this setting")
    return best["best"]


def preset_of(run: Run) -> str:
    return Path(run.config).stem


def at_best_lr(runs: Sequence[Run], best: dict, study: "Study") -> list[Run]:
    """Each run at its arm's best lr from the sweep (the arm = its preset, or the study's lr_alias of it): the
    swept key appended to its overrides, and the value in its name (a store entry is per name, so a run at the
    shared lr and one at the sweep's lr never overwrite each other). Runs that set the swept key themselves (a
    fixed-lr control) are left out: the sweep replaces them."""
    out = []
    for run in runs:
        arm = study.lr_alias.get(preset_of(run), preset_of(run))
        if arm not in best:
            raise StudyUnavailable(f"--lr {FROM_SWEEP}: the lr sweep has no arm {arm!r} (run {run.name}); its arms: "
                                   f"{', '.join(best)}")
        key, value = best[arm]["key"], best[arm]["value"]
        if any(o.partition("=")[0] == key for o in run.overrides):
            continue
        out.append(replace(run, name=f"{run.name}_lr{value:g}", overrides=(*run.overrides, f"{key}={value:g}"),
                           labels=(*run.labels, ("best_lr", f"{key}={value:g}"))))
    return out


def run_wire_factor(r: RunResult, scale: Scale) -> tuple[float | None, str]:
    """wire_factor of a run: its recorded config, or (an entry imported without one) its config resolved now (as the
    YAML files and config.yaml spell it: a scheme's options flat in comm, not under comm.options)."""
    return wire_factor(r.config or run_config(r.run, scale).to_dict(), r.run.nproc)


def wire_factor(config: dict, nproc: int) -> tuple[float | None, str]:
    """(bytes the collective puts on the wire per rank) / (buffer bytes CommStats counts), and what the scheme
    sends, for the run's comm.mode at P = nproc: the sync scheme's own alpha-beta cost model (its `predict` at
    alpha = 0, beta = 1 byte, which counts a ring's forwarding: 2(P-1)/P for a ring allreduce, (P-1)/P for an
    all-to-all, (P-1) chunks for an all-gather, the server's fan-in and fan-out for a parameter server) over its
    exact buffer count (`bytes_per_call`), both for the run's parameter count."""
    import dataclasses

    import optim  # every optimizer registered
    from optim.sync import registry

    comm = dict(config.get("comm") or {})
    try:
        scheme = registry.get(comm.get("mode", "fp32"))
    except ValueError:
        return None, "unknown"
    # an optimizer that decides what crosses the network (Dion's factors) says so; the scheme carries it
    name = (config.get("optim") or {}).get("name")
    sends = optim.get_optimizer(name).sends if name in optim.optimizer_names() else None
    wire = f"{sends}, carried by comm.mode {scheme.name} (alone: {scheme.wire})" if sends else scheme.wire
    names = {f.name for f in dataclasses.fields(scheme.options)}
    opts = scheme.options(**{k: v for k, v in comm.items() if k in names})
    n = param_count(config)
    if not n or nproc < 2:
        return None, wire
    buf = scheme.bytes_per_call(opts, nproc, n)[0]
    return (scheme.predict(opts, nproc, n, 0.0, 1 / 8) / buf if buf else None), wire


def param_count(config: dict) -> int | None:
    """Parameters of the run's model preset (meta device) at the preset's vocabulary: the wire / buffer ratio
    depends on n only through a chunk's padding, and the preset's size keeps a summary independent of whether
    the run's dataset (whose tokenizer may resize the vocabulary) is on this machine."""
    m = (config or {}).get("model")
    if not m:
        return None
    return _param_count(tuple(sorted((k, v) for k, v in m.items() if k in ("preset", "tie_embeddings", "pos_emb",
                                                                            "block_size"))))


@functools.lru_cache(maxsize=None)
def _param_count(section: tuple) -> int:
    import torch

    from model import GPT, resolve_config

    with torch.device("meta"):
        return sum(p.numel() for p in GPT(resolve_config(dict(section))).parameters())


# ---------------------------------------------------------------------------------------------
# statistics and tables


def mean_std(xs: Iterable[float | None]) -> tuple[float | None, float | None, int]:
    """(mean, sample std (None for one value), n) over the finite values given."""
    v = [float(x) for x in xs if x is not None and math.isfinite(float(x))]
    if not v:
        return None, None, 0
    return statistics.fmean(v), (statistics.stdev(v) if len(v) > 1 else None), len(v)


def fmt(x: Any, spec: str = ".4f") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return format(x, spec)
    return str(x)


def fmt_ms(mean: float | None, std: float | None, spec: str = ".4f") -> str:
    """'m ± s' (or 'm' for one seed, '-' for none)."""
    if mean is None:
        return "-"
    return fmt(mean, spec) + (f" ± {fmt(std, spec)}" if std is not None else "")


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    spec: str = ".4f"          # format of numbers; ignored for strings
    align: str = "right"
    md: bool = True            # False: CSV only (raw numbers already shown formatted in another column)


def markdown_table(rows: Sequence[dict], columns: Sequence[Column]) -> str:
    columns = [c for c in columns if c.md]
    head = "| " + " | ".join(c.header for c in columns) + " |"
    rule = "|" + "|".join("---:" if c.align == "right" else "---" for c in columns) + "|"
    body = ["| " + " | ".join(fmt(r.get(c.key), c.spec) for c in columns) + " |" for r in rows]
    return "\n".join([head, rule, *body])


def group_runs(results: Sequence[RunResult], *keys: str) -> dict[tuple, list[RunResult]]:
    """Results grouped by the values of label `keys`, in first-seen order."""
    out: dict[tuple, list[RunResult]] = {}
    for r in results:
        out.setdefault(tuple(r.run.label(k) for k in keys), []).append(r)
    return out


def seed_stats(group: Sequence[RunResult], value: Callable[[RunResult], float | None], prefix: str) -> dict:
    """{prefix_mean, prefix_std, prefix_n} of value(run) over a group's finished runs (one per seed)."""
    m, s, n = mean_std(value(r) for r in group if r.ok)
    return {f"{prefix}_mean": m, f"{prefix}_std": s, f"{prefix}_n": n}


def paired_stats(group: Sequence[RunResult], ref: Sequence[RunResult], value: Callable[[RunResult], float | None],
                 prefix: str) -> dict:
    """{prefix_mean, prefix_std, prefix_n, prefix_t} of value(run) - value(reference run of the same seed), over
    the seeds finished in both groups. Arms trained from the same seed share the initialization and the data order,
    so the per-seed difference has a smaller spread than either arm's own and is the statistic to compare arms
    with; prefix_t is the paired t statistic mean / (std / sqrt(n)) on n - 1 degrees of freedom (None below two
    seeds or for a zero spread)."""
    refs = {r.run.seed: value(r) for r in ref if r.ok}
    diffs = []
    for r in group:
        v, b = (value(r), refs.get(r.run.seed)) if r.ok else (None, None)
        if v is not None and b is not None:
            diffs.append(v - b)
    m, s, n = mean_std(diffs)
    t = m / (s / math.sqrt(n)) if s else None
    return {f"{prefix}_mean": m, f"{prefix}_std": s, f"{prefix}_n": n, f"{prefix}_t": t}


def status_of(group: Sequence[RunResult]) -> str:
    """A table row's status: "ok", each distinct failure, and how many of its runs a --report-only summary
    found not trained yet (an interim row: pending, not failed)."""
    bad = [r.status for r in group if not r.ok]
    waiting = sum(s.startswith(NOT_RUN) for s in bad)
    parts = sorted({s for s in bad if not s.startswith(NOT_RUN)})
    if waiting:
        parts.append(f"interim: {waiting} of {len(group)} run(s) not trained yet")
    return "; ".join(parts) or "ok"


# ---------------------------------------------------------------------------------------------
# studies


@dataclass
class Options:
    """Command-line options shared by every study."""
    quick: bool = False
    seeds: list[int] | None = None
    out: Path | None = None          # results directory
    work: Path | None = None         # run directories and logs
    steps: int | None = None
    nproc: int | None = None
    restart: bool = False
    report_only: bool = False
    argv: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)   # study-specific (--alphas, --bits for the toy)
    failed: list[str] = field(default_factory=list)  # filled by Study.execute: runs that failed
    not_run: list[str] = field(default_factory=list)  # filled by Study.execute under report_only: runs not trained yet
    setting: str = DEFAULT_SETTING   # a SETTINGS name (--setting)
    sets: tuple[str, ...] = ()       # --set key=value ...: after the setting's overrides
    lr: str = "shared"               # "shared" (the scale's optim.lr for every arm) or FROM_SWEEP
    allow_repeat: bool = False       # --allow-repeat: launch runs that read a training token twice
    first: tuple[str, ...] = ()      # --first: glob patterns of run names trained before the others

    def setting_overrides(self) -> tuple[str, ...]:
        if self.setting not in SETTINGS:
            raise StudyUnavailable(f"unknown setting {self.setting!r}; known: {', '.join(SETTINGS)}")
        bad = [x for x in self.sets if "=" not in x or "." not in x.partition("=")[0]]
        if bad:
            raise StudyUnavailable(f"--set {' '.join(bad)}: expected section.key=value, e.g. --set optim.warmup_steps=40")
        st = SETTINGS[self.setting]
        return merge_overrides(st.quick if self.quick else st.full, self.sets)

    def setting_name(self) -> str:
        """The setting's name, plus a digest of the --set overrides when there are any: the directory name of
        its results and runs."""
        if not self.sets:
            return self.setting
        import hashlib

        return f"{self.setting}+{hashlib.sha256(chr(10).join(self.sets).encode()).hexdigest()[:8]}"

    def _under_setting(self, d: Path) -> Path:
        return d if self.setting_name() == DEFAULT_SETTING else d / self.setting_name()

    def results_dir(self) -> Path:
        d = self.out or self._under_setting(QUICK_RESULTS if self.quick else DEFAULT_RESULTS)
        return d if d.is_absolute() else ROOT / d

    def store_dir(self) -> Path:
        return self.results_dir() / STORE_DIR

    def work_dir(self, study: str) -> Path:
        d = self.work or self._under_setting(DEFAULT_WORK / ("quick" if self.quick else "")) / study
        return d if d.is_absolute() else ROOT / d


def first_ordered(runs: Sequence[Run], first: Sequence[str]) -> list[Run]:
    """`runs` with those whose name matches a pattern of `first` (fnmatch globs) moved ahead, each part in
    its own order: which runs train first, not which runs the study has."""
    return sorted(runs, key=lambda r: not any(fnmatch.fnmatchcase(r.name, p) for p in first))


@dataclass
class Summary:
    rows: list[dict]
    columns: list[Column]
    notes: list[str] = field(default_factory=list)   # markdown lines under the table
    extra_tables: list[tuple[str, str]] = field(default_factory=list)   # (title, markdown table)


class StudyUnavailable(RuntimeError):
    """The study cannot run in this build (its optimizer is missing); the message says what is needed."""


@dataclass
class Study:
    """A registered study. Training studies fill `build`, `summarize`, `plot`; others override `execute`."""
    name: str
    title: str
    paper: str                      # what the paper reports, quoted with table/figure (markdown)
    quick: Scale | None = None
    full: Scale | None = None
    seeds: list[int] = field(default_factory=lambda: [1337])
    quick_seeds: list[int] = field(default_factory=lambda: [1337])
    build: Callable[[Scale, list[int], Options], list[Run]] | None = None
    summarize: Callable[[list[RunResult], Scale], Summary] | None = None
    plot: Callable[[list[RunResult], Path], None] | None = None
    requires: tuple[str, ...] = ()  # optim.name values the whole study needs
    planned: str = ""               # for a study not written yet: what to add when it can run
    # values the summary reads from files the store does not keep (checkpoints), computed from a finished
    # run directory and stored with the run; the summary reads them from RunResult.extras when present
    extras: Callable[[RunResult], dict] | None = None
    # more files from the summary (the lr sweep's best lr per arm): (summary, results, scale, results dir) -> paths
    outputs: Callable[[Summary, list[RunResult], Scale, Path], list[Path]] | None = None
    # --lr from-sweep: a preset with no sweep arm of its own runs at another arm's best lr (preset -> arm)
    lr_alias: dict[str, str] = field(default_factory=dict)
    lr_from_sweep: bool = True      # False for the sweep itself: --lr from-sweep leaves its runs alone
    # more runs decided by the finished ones (the lr sweep's grid extended past a best at its edge):
    # (results so far, scale, seeds, options) -> runs; called until it adds no run it has not listed before
    extend: Callable[[list["RunResult"], Scale, list[int], Options], list[Run]] | None = None
    # --plan: stand-ins for the runs `extend` will add once the runs it waits on have finished (the outer-lr
    # sweep's best value names them): same arguments; counted and timed as runs to train, never launched
    awaiting: Callable[[list["RunResult"], Scale, list[int], Options], list[Run]] | None = None

    def scale(self, opts: Options) -> Scale:
        s = self.quick if opts.quick else self.full
        if s is None:
            raise StudyUnavailable(f"study {self.name} has no {'quick' if opts.quick else 'full'} setting")
        st = SETTINGS.get(opts.setting)
        steps = opts.steps or (st.steps if st is not None and not s.quick else 0)
        if steps:
            s = replace(s, steps=steps, eval_every=0 if s.quick else max(1, steps // 10),
                        ckpt_every=0 if s.quick else max(1, steps // 4))
        if opts.nproc:
            s = replace(s, nproc=opts.nproc)
        if st is not None and not s.quick:
            if st.evals:
                s = replace(s, eval_every=max(1, s.steps // st.evals))
            if st.eval_steps:
                s = replace(s, eval_steps=st.eval_steps)
        return replace(s, overrides=merge_overrides(s.overrides, opts.setting_overrides()), setting=opts.setting_name())

    def runs(self, scale: Scale, seeds: list[int], opts: Options) -> list[Run]:
        """The study's runs for these options: `build`, each arm at the sweep's lr under --lr from-sweep
        (StudyUnavailable while the sweep has not written it)."""
        return self.at_lr(self.build(scale, seeds, opts), scale, opts)

    def more_runs(self, results: list[RunResult], scale: Scale, seeds: list[int], opts: Options,
                  hook: Callable | None = None) -> list[Run]:
        """The runs `extend` (or `hook`, e.g. `awaiting`) adds after `results`, at the best lr as `runs` gives."""
        hook = hook or self.extend
        return self.at_lr(hook(results, scale, seeds, opts), scale, opts) if hook else []

    def at_lr(self, runs: list[Run], scale: Scale, opts: Options) -> list[Run]:
        if opts.lr == FROM_SWEEP and self.lr_from_sweep:
            runs = at_best_lr(runs, read_best_lr(opts, scale), self)
        return runs

    def check_available(self, available: Callable[[str], bool] = optimizer_available) -> None:
        missing = [n for n in self.requires if not available(n)]
        if missing:
            raise StudyUnavailable(f"study {self.name} needs optim.name={', '.join(missing)}, which this build does "
                                   f"not have. {self.planned}".strip())
        if self.planned:
            raise StudyUnavailable(f"study {self.name} is registered but not written yet: {self.planned}")

    def execute(self, opts: Options, echo: Callable[[str], None] = print) -> list[Path]:
        """Run (or reuse) every run, then write the table, plot and raw files; returns the paths."""
        self.check_available()
        assert self.build and self.summarize and self.plot, f"study {self.name} lacks build/summarize/plot"
        scale = self.scale(opts)
        seeds = opts.seeds or (self.quick_seeds if opts.quick else self.seeds)
        runs = first_ordered(self.runs(scale, seeds, opts), opts.first)
        names = [r.name for r in runs]
        if len(set(names)) != len(names):
            raise ValueError(f"study {self.name}: duplicate run names {sorted(n for n in names if names.count(n) > 1)}")
        work = opts.work_dir(self.name)
        started = time.strftime("%Y-%m-%d %H:%M:%S")
        store = opts.store_dir()
        # every run's training tokens against the corpus, before a round of runs launches (a summary of stored
        # runs needs no corpus): a run that would read a token twice refuses the whole study
        results: list[RunResult] = []
        by_spec = stored_specs(store)
        while runs:
            tokens = {} if opts.report_only else {run.name: token_budget(run, scale, opts.allow_repeat) for run in runs
                                                  if all(map(optimizer_available, run.requires))}  # else pending
            for run in runs:
                r = ensure_run(run, scale, work, restart=opts.restart, report_only=opts.report_only, echo=echo,
                               store=store, by_spec=by_spec)
                if r.same_as:
                    echo(f"[{run.name}] the same run as the stored {r.same_as} (same spec): not trained again")
                if r.how != "stored" and run.name in tokens:
                    r.tokens = tokens[run.name]
                # keep every finished run (trained now or earlier) beyond its run directory, as soon as it is
                # finished: a study interrupted later (a machine shut down) keeps the runs it had
                if (r.ok or r.diverged) and r.how != "stored":
                    r.extras = self.extras(r) if self.extras and r.ok else {}
                    save_stored(store, r, run_spec(r.run, scale), r.extras)
                    r.entry = store_file(store, r.run.name)
                    key, every = spec_key(run_spec(r.run, scale))
                    by_spec.setdefault(key, []).append((r.run.name, every))
                results.append(r)
            listed = {r.run.name for r in results}
            runs = first_ordered([r for r in self.more_runs(results, scale, seeds, opts) if r.name not in listed],
                                 opts.first)
            if len({r.name for r in runs}) != len(runs):
                raise ValueError(f"study {self.name}: its extend hook listed a run twice: {[r.name for r in runs]}")
            for r in runs:
                echo(f"[{r.name}] added by the finished runs ({self.name})")
        summary = self.summarize(results, scale)
        imported = [r.run.name for r in results if r.ok and r.source.startswith(IMPORTED)]
        if imported:
            summary.notes.append(
                f"{len(imported)} run(s) ({', '.join(imported)}) come from a raw record written before the run store "
                "kept diagnostics: their loss curves and training time are measured values, but their diagnostic "
                "and byte columns are empty, so those columns average the other seeds' runs only.")
        out = opts.results_dir()
        out.mkdir(parents=True, exist_ok=True)
        paths = write_results(self, summary, results, scale, out, opts, started)
        if self.outputs:
            paths += self.outputs(summary, results, scale, out)
        png = out / f"{self.name}.png"
        self.plot(results, png)
        paths.append(png)
        # a --report-only summary of a study still training is an interim report: its runs not trained yet are
        # pending, not failures (a run that failed after its launch still fails the summary)
        waiting = [r for r in results if opts.report_only and r.status.startswith(NOT_RUN)]
        failed = [r for r in results if r.status.startswith("failed") and r not in waiting and not r.diverged]
        stopped = [r for r in results if r.diverged]
        if stopped:  # a result the summary counts, not a failure of the study
            echo(f"{len(stopped)} run(s) diverged (stored with their curves): "
                 + "; ".join(f"{r.run.name}: {r.status}" for r in stopped))
        if failed:
            echo(f"{len(failed)} run(s) failed: " + "; ".join(f"{r.run.name}: {r.status}" for r in failed))
            opts.failed.extend(r.run.name for r in failed)
        opts.not_run.extend(r.run.name for r in waiting)
        return paths


@dataclass
class Planned:
    """One run of a study's plan (--plan): what the store and the run directories already hold for it."""
    study: str
    run: Run
    steps: int
    state: str                  # stored | finished | resumable | to train | pending: ...
    wall_s: float | None = None  # a finished run's wall time
    spec: tuple[str, int] = ("", 0)  # spec_key of the run: two studies' runs with one training are one run

    @property
    def left(self) -> bool:
        return self.state in ("resumable", "to train")


def plan_study(study: "Study", opts: Options, by_spec: dict[str, list[tuple[str, int]]] | None = None
               ) -> tuple[list[Planned], str]:
    """Every run `study` would run with `opts` and its state, launching nothing and writing nothing (the runs
    an extend hook adds are listed as the finished ones decide them now); plus a note ("" or why the list is
    provisional: --lr from-sweep before the sweep has finished names the runs by their lr only then)."""
    study.check_available()
    assert study.build, f"study {study.name} trains nothing of its own"
    scale = study.scale(opts)
    seeds = opts.seeds or (study.quick_seeds if opts.quick else study.seeds)
    note = ""
    try:
        runs, at_lr = study.runs(scale, seeds, opts), True
    except StudyUnavailable:
        runs, at_lr = study.build(scale, seeds, opts), False
        note = (f"each arm's lr comes from the sweep, whose {BEST_LR_FILE} has no value for every arm yet: "
                "the runs are named (and looked up) here without it")
    runs = first_ordered(runs, opts.first)
    work, store = opts.work_dir(study.name), opts.store_dir()
    out: list[Planned] = []
    results: list[RunResult] = []

    def more(hook: Callable | None) -> list[Run]:
        """The runs `hook` (extend, awaiting) adds after the results so far, at the lr `runs` gave."""
        new = hook(results, scale, seeds, opts) if hook else []
        return study.at_lr(new, scale, opts) if at_lr else new

    while runs:
        for run in runs:
            r = ensure_run(run, scale, work, report_only=True, echo=lambda s: None, store=store, by_spec=by_spec)
            if r.ok or (r.diverged and r.how == "stored"):
                state = ("stored" if r.how == "stored" else "finished") + (" (diverged)" if r.diverged else "")
            elif r.status.startswith("pending"):
                state = r.status
            else:
                run_dir = work / "runs" / run.name
                same = stored_spec(run_dir) == run_spec(run, scale)
                state = "resumable" if same and has_checkpoint(run_dir) else "to train"
            results.append(r)
            out.append(Planned(study.name, run, scale.steps, state, r.wall_s if r.ok else None,
                               spec_key(run_spec(run, scale))))
        listed = {r.run.name for r in results}
        runs = first_ordered([r for r in more(study.extend) if r.name not in listed], opts.first)
    later = more(study.awaiting)
    for run in later:
        out.append(Planned(study.name, run, scale.steps, "to train", None, spec_key(run_spec(run, scale))))
    if later:
        note = "; ".join(x for x in (note, f"{len(later)} of the runs to train are stand-ins for runs that wait on "
                                           "others (named here before those decide them)") if x)
    return out, note


def _recorded_available(opts: Options, dataset: str) -> int | None:
    """The training tokens of `dataset` as a stored run of this setting (or of the setting its lr comes from)
    counted them at launch; None when no stored run did."""
    st = SETTINGS.get(opts.setting)
    stores = [opts.store_dir()] + ([replace(opts, setting=st.lr_from).store_dir()] if st and st.lr_from else [])
    for store in stores:
        for f in sorted(store.glob("*.json.gz")) if store.is_dir() else []:
            entry = load_stored(store, f.name[:-len(".json.gz")]) or {}
            if entry.get("tokens") and ((entry.get("config") or {}).get("data") or {}).get("dataset") == dataset:
                return int(entry["tokens"]["available"])
    return None


def corpus_line(planned: Sequence[Planned], opts: Options) -> str:
    """The plan's largest reader of training tokens against the corpus (--plan): through token_budget where
    the corpus is prepared on this machine (its no-repeat check included), else against the corpus size a
    stored run recorded (the check itself runs again before every launch)."""
    p = max(planned, key=lambda q: q.steps * q.run.nproc)
    scale = STUDIES[p.study].scale(opts)
    what = f"the largest reader ({p.run.name}, {p.steps} steps at {p.run.nproc} ranks)"
    try:
        t, how = token_budget(p.run, scale), "the corpus on this machine; no token read twice"
    except StudyUnavailable as e:
        if "twice" in str(e):
            return f"corpus: {what} would repeat tokens: {e}"
        from data.loader import train_tokens_read

        cfg = run_config(p.run, scale)
        d = cfg.data
        avail = _recorded_available(opts, d.dataset)
        if avail is None:
            return f"corpus: not checked ({e})"
        t = {"read": train_tokens_read(d.batch_size, d.seq_len, p.run.nproc, cfg.train.max_steps, d.grad_accum),
             "available": avail}
        how = (f"{d.dataset} is not prepared here: its size as a stored run counted it; the no-repeat check runs "
               "before every launch")
    return (f"corpus: {what} reads {t['read']:,} of {t['available']:,} training tokens "
            f"({100 * t['read'] / max(t['available'], 1):.1f} %; {how})")


def _walls_by_geometry(planned: Sequence[Planned]) -> dict[tuple[int, int], list[float]]:
    """The finished runs' wall times by geometry (world size, steps)."""
    done: dict[tuple[int, int], list[float]] = {}
    for p in planned:
        if p.wall_s is not None:
            done.setdefault((p.run.nproc, p.steps), []).append(p.wall_s)
    return done


def hours_spent(planned: Sequence[Planned], left_minutes: float | None) -> tuple[int, float, float | None]:
    """The CPU cost of the plan on this machine (what the whole suite costs before anyone starts it): (finished runs, hours of
    wall time they recorded, hours of the whole plan: every finished run at the median wall time of its geometry
    plus `left_minutes`, minutes_left's estimate for the rest). A resumed run records only its last launch, so
    the recorded hours understate what the finished runs took; the median total is what the plan costs run
    once, uninterrupted (None before any run finished)."""
    done = _walls_by_geometry(planned)
    if not done:
        return 0, 0.0, None
    finished = [p for p in planned if p.wall_s is not None]
    at_median_s = sum(statistics.median(done[(p.run.nproc, p.steps)]) for p in finished)
    return len(finished), sum(p.wall_s for p in finished) / 3600, at_median_s / 3600 + (left_minutes or 0.0) / 60


def stored_walls(store: Path) -> dict[tuple[int, int], list[float]]:
    """The wall times of a store's trained runs by geometry (world size, steps)."""
    out: dict[tuple[int, int], list[float]] = {}
    for f in sorted(store.glob("*.json.gz")) if store.is_dir() else []:
        e = load_stored(store, f.name[:-len(".json.gz")]) or {}
        steps = ((e.get("config") or {}).get("train") or {}).get("max_steps")
        if e.get("wall_s") and steps and e.get("source", "trained") == "trained" and "status" not in e:
            out.setdefault((int(e["spec"]["nproc"]), int(steps)), []).append(float(e["wall_s"]))
    return out


def minutes_left(planned: Sequence[Planned], reference: dict[tuple[int, int], list[float]] | None = None,
                 reference_name: str = "") -> tuple[float | None, str]:
    """Minutes to train the runs left: each at the median wall time of the finished runs of its geometry (world
    size, steps) in the plan, else the median of any geometry scaled by steps x world size (a rough guess; said
    so). With no finished run in the plan, the same from `reference` (stored_walls of another setting's store,
    `reference_name`). A resumable run counts whole."""
    done, source = _walls_by_geometry(planned), "the finished runs"
    if not done and reference:
        done, source = reference, f"{reference_name}'s stored runs"
    if not done:
        return None, "no finished run to time"
    total, scaled = 0.0, 0
    for p in planned:
        if not p.left:
            continue
        geo = (p.run.nproc, p.steps)
        if geo in done:
            total += statistics.median(done[geo])
        else:
            (n, k), ws = max(done.items(), key=lambda kv: len(kv[1]))
            total += statistics.median(ws) * (p.run.nproc * p.steps) / (n * k)
            scaled += 1
    how = f"median wall time of {source} of the same world size and steps"
    if scaled:
        how += (f"; {scaled} run(s) of a geometry with none finished: {source}' most common geometry's median scaled "
                "by steps x world size (rough)")
    return total / 60, how


def run_record(r: RunResult, scale: Scale) -> dict:
    """One line of <study>_runs.jsonl: the spec, status, machine load and the curves."""
    return {"name": r.run.name, "labels": dict(r.run.labels), "config": r.run.config,
            "overrides": trainer_overrides(r.run, scale), "seed": r.run.seed, "nproc": r.run.nproc,
            "status": r.status, "how": r.how, "source": r.source, "wall_s": r.wall_s, "load_before": r.load_before,
            "load_after": r.load_after, "run_dir": os.path.relpath(r.run_dir, ROOT),
            "final_val_loss": r.final("val_loss"), "final_train_loss": r.final("train_loss"),
            "train_time_s": r.final("train_time_s"), "cpu": host_label(r),
            "train_tokens_read": tokens_read(r), "train_tokens_available": (r.tokens or {}).get("available"),
            "val_loss": [list(p) for p in zip(*r.series("val_loss"))],
            "train_loss": [list(p) for p in zip(*r.series("train_loss"))]}


def host_label(r: RunResult) -> str:
    """'CPU model (capability)' of the host a run trained on; runs from a run directory trained here."""
    m = r.machine if r.how == "stored" else machine()
    if not m or "cpu_capability" not in m:
        return "not recorded"
    return f"{m.get('cpu_model') or 'unknown CPU'} ({m['cpu_capability']})"


def hosts_line(results: Sequence[RunResult]) -> str:
    """Which hosts the finished runs trained on, with counts (float rounding differs by host)."""
    counts: dict[str, int] = {}
    for label in (host_label(r) for r in results if r.ok):
        counts[label] = counts.get(label, 0) + 1
    return "; ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "none finished"


def load_range(results: Sequence[RunResult]) -> tuple[float, float] | None:
    """(min, max) of the 1-minute load average seen before/after the runs launched now or stored."""
    xs = [x[0] for r in results for x in (r.load_before, r.load_after) if x]
    return (min(xs), max(xs)) if xs else None


def write_results(study: Study, summary: Summary, results: Sequence[RunResult], scale: Scale, out: Path,
                  opts: Options, started: str) -> list[Path]:
    """<study>.csv, .md, _runs.jsonl and _meta.json into `out`."""
    name = study.name
    csv_path, md_path = out / f"{name}.csv", out / f"{name}.md"
    runs_path, meta_path = out / f"{name}_runs.jsonl", out / f"{name}_meta.json"
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=[c.key for c in summary.columns], extrasaction="ignore")
        w.writeheader()
        w.writerows(summary.rows)
    with open(runs_path, "w") as f:
        for r in results:
            f.write(json.dumps(run_record(r, scale)) + "\n")
    mach, lr = machine(), load_range(results)
    # the command that produces these results: a --report-only summary shows the training command
    argv = [a for a in opts.argv if a != "--report-only"]
    meta = {"study": name, "title": study.title, "command": "python -m bench.reproduce " + shlex.join(argv),
            "report_only": opts.report_only, "started": started, "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": mach,
            "load_1min_range": lr, "scale": asdict(scale), "runs": len(results),
            "ok": sum(r.ok for r in results), "pending": sum(r.status.startswith("pending") for r in results)}
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    md = [f"# {study.title}", "", f"Paper: {study.paper}", "",
          f"Command: `{meta['command']}`" + (" (quick mode: debug model, a handful of steps; not a result)"
                                              if scale.quick else ""), "",
          markdown_table(summary.rows, summary.columns), ""]
    for title, table in summary.extra_tables:
        md += [title, "", table, ""]
    md += [*summary.notes, "" if summary.notes else "",
           f"Setting: {scale.steps} steps, {' '.join(scale.overrides)}; eval every {scale.eval_every or scale.steps} "
           f"steps on {scale.eval_steps} batches per rank; diagnostics every {scale.diag_every or '-'} steps.",
           f"Machine (this report): {mach['platform']}, {mach.get('cpu_model') or 'CPU model unknown'} "
           f"({mach.get('cpu_capability', '?')}), {mach['cpus_usable']} usable CPUs of {mach['cpu_count']}, "
           f"torch {mach['torch']}, python {mach['python']}; 1-minute load average "
           + (f"{lr[0]:.2f}-{lr[1]:.2f}" if lr else "not recorded") + " around the runs. Runs trained on (CPU, "
           f"run count): {hosts_line(results)}.",
           f"Setting name: **{scale.setting}**" + (" (quick: its corpus, the debug model)" if scale.quick else "")
           + f" (results of another setting are in another directory, never in this table). Learning rate: "
           f"{lr_line(results, study)}. Training tokens: {tokens_line(results)}.",
           f"Raw: {runs_path.name} (per run: overrides, status, wall time, load, curves), {csv_path.name}, "
           f"{meta_path.name}; run directories under {os.path.relpath(opts.work_dir(name), ROOT)}/runs; every finished "
           f"run's spec, config and metrics in {STORE_DIR}/<run>.json.gz (how = stored: summarized from there)."]
    md_path.write_text("\n".join(md) + "\n")
    return [csv_path, md_path, runs_path, meta_path]


# ---------------------------------------------------------------------------------------------
# plotting


def pyplot():
    from bench import require

    require("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def mean_curve(group: Sequence[RunResult], key: str) -> tuple[list[int], list[float]]:
    """Mean over seeds of `key` at the steps every finished run of the group logged."""
    series = [dict(zip(*r.series(key))) for r in group if r.ok]
    series = [s for s in series if s]
    if not series:
        return [], []
    steps = sorted(set.intersection(*(set(s) for s in series)))
    return steps, [statistics.fmean(s[x] for s in series) for x in steps]


STUDIES: dict[str, Study] = {}


def register(study: Study) -> Study:
    if study.name in STUDIES:
        raise ValueError(f"study {study.name!r} is already registered")
    STUDIES[study.name] = study
    return study
