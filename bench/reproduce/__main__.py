"""Command line of the reproduction suite: `python -m bench.reproduce <study> [CONFIG.yaml ...]
[section.key=value ...] [options]`, in any order (util/cli.py's convention). Config files and
key=value words change every run of the study after the setting's own overrides, as --set does: a
file counts as its section.key=value lines (the files composed as train.py composes them), then
the key=value words, then --set."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import yaml

from trainer.config import ConfigError
from trainer.config_load import compose_yaml
from util.cli import Parser, path_arg

from . import STUDIES, Options, StudyUnavailable, framework


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected comma-separated integers, e.g. 1337,1338,1339")


def _floats(s: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected comma-separated numbers, e.g. 2,1.5,1,0.5")


def _globs(s: str) -> tuple[str, ...]:
    globs = tuple(x for x in s.split(",") if x)
    if not globs:
        raise argparse.ArgumentTypeError(f"{s!r}: expected comma-separated run-name patterns, e.g. '*_s7_*'")
    return globs


def _path(value: str) -> Path:
    return Path(path_arg(value))


def parser() -> Parser:
    ap = Parser(prog="python -m bench.reproduce", description="Reproduce Lion Cub's findings with this tool's own "
                "training.", epilog=__doc__, configs=True, positionals=("study",), override_lists=("sets",),
                config_help="the study name (see --list), or 'all': every study in turn; config files and "
                            "section.key=value overrides for every run, after the setting's (as --set)")
    ap.add_argument("--list", action="store_true", help="list the registered studies and exit")
    ap.add_argument("--quick", action="store_true",
                    help="minutes: debug model, a handful of steps, 2 ranks (what the tests run); results go to "
                         "bench/out/reproduce/quick/results unless --out is given")
    ap.add_argument("--seeds", type=_ints, default=None, help="comma-separated seeds (default: the study's)")
    ap.add_argument("--out", type=_path, default=None, help="results directory (default docs/results/reproduction)")
    ap.add_argument("--work", type=_path, default=None,
                    help="run directories and logs (default bench/out/reproduce/<study>)")
    ap.add_argument("--steps", type=int, default=None, help="override the study's number of steps")
    ap.add_argument("--nproc", type=int, default=None, help="override the world size (table3: run only this one)")
    ap.add_argument("--restart", action="store_true", help="rerun every run from scratch (no reuse, no resume)")
    ap.add_argument("--report-only", action="store_true",
                    help="launch nothing; summarize the finished runs (an interim report: the runs not trained yet "
                         "are listed and left out, exit 0 unless a run failed)")
    ap.add_argument("--import-raw", type=Path, nargs="+", default=None, metavar="RUNS_JSONL",
                    help="rebuild run-store entries (loss curves only) from <study>_runs.jsonl files written before "
                         "the store existed, into the --out (or default) results directory's store/, and exit")
    ap.add_argument("--setting", default=framework.DEFAULT_SETTING, choices=list(framework.SETTINGS),
                    help="the model / corpus every run uses: " + "; ".join(  # argparse %-formats help: escape '%'
                        f"{n}: {st.description}".replace("%", "%%") for n, st in framework.SETTINGS.items())
                    + f". Results and runs of a setting other than {framework.DEFAULT_SETTING} go to a directory of "
                      "its own (docs/results/reproduction/<setting>/, bench/out/reproduce/<setting>/)")
    ap.add_argument("--set", dest="sets", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                    help="section.key=value overrides after the setting's, for every run of the study (in the run "
                         "store's key and the report; their digest names the results directory)")
    ap.add_argument("--lr", default="shared", choices=["shared", framework.FROM_SWEEP],
                    help=f"shared: every arm at the setting's optim.lr; {framework.FROM_SWEEP}: each arm at its best "
                         f"value from the lr_sweep study of the same setting ({framework.BEST_LR_FILE})")
    ap.add_argument("--allow-repeat", action="store_true",
                    help="launch runs that read a training token twice (refused otherwise: data.loader."
                         "check_no_repeat); the tiny-builtin setting's committed runs did")
    ap.add_argument("--seed-major", action="store_true",
                    help="all only: train every study at its first seed, then every study at its second, and so on "
                         "(each report, rewritten after every pass, covers the seeds done so far): an interrupted "
                         "suite has one seed of every comparison before it has three of any")
    ap.add_argument("--first", type=_globs, default=(), metavar="GLOB[,GLOB...]",
                    help="train the runs whose names match one of these patterns before the others (e.g. "
                         "'*_s7_*': a sweep's seed first); the study, its runs and its report are the same")
    ap.add_argument("--plan", action="store_true",
                    help="launch and write nothing: list every run the command would run (with 'all': every "
                         "study's, a run shared by two studies counted once) and what the run store and the run "
                         "directories already hold, with an estimate of the time left")
    ap.add_argument("--alphas", type=_floats, default=None, help="toy only: noise tail indices (default 2,1.5,1,0.5)")
    ap.add_argument("--bits", type=_ints, default=None, help="toy only: bit widths (default 2,4,8)")
    return ap


def config_sets(files: Sequence[str]) -> list[str]:
    """The section.key=value lines of config files composed as train.py composes them (a key's nested
    mapping, such as data.mix or comm.momentum_sync, stays one value)."""
    out = []
    for section, keys in compose_yaml(files).items():
        if not isinstance(keys, dict):
            raise ConfigError(f"{' '.join(files)}: {section}: expected a mapping of keys, got {keys!r}")
        for key, v in keys.items():
            text = v if isinstance(v, str) and yaml.safe_load(v) == v else json.dumps(v)
            out.append(f"{section}.{key}={text}")
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    try:
        args.sets = config_sets(args.configs) + args.overrides + args.sets
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.import_raw:
        store = Options(quick=args.quick, out=args.out).store_dir()
        for f in args.import_raw:
            if not f.is_file():
                print(f"error: {f} does not exist; pass <study>_runs.jsonl files of a results directory",
                      file=sys.stderr)
                return 2
            names = framework.import_raw_records(f, store)
            print(f"{f}: imported {len(names)} run(s) into {store}" + (f": {', '.join(names)}" if names else ""))
        return 0
    if args.list or not args.study:
        for name, s in STUDIES.items():
            extra = f"  [needs optim.name={','.join(s.requires)}]" if s.requires else ""
            print(f"{name:12s} {s.title}{extra}")
        if args.list:
            return 0
        what = "to plan" if args.plan else ("to summarize" if args.report_only else "to run")
        print(f"error: name a study {what} (one of the above, or all), e.g. python -m bench.reproduce "
              f"{'all --plan' if args.plan else 'table2 --quick'}", file=sys.stderr)
        return 2
    if args.study != "all" and args.study not in STUDIES:
        print(f"error: unknown study {args.study!r}; known: {', '.join(STUDIES)}, or all", file=sys.stderr)
        return 2
    if args.seed_major and args.study != "all":
        print("error: --seed-major orders the studies of 'all'; one study already trains its seeds in turn",
              file=sys.stderr)
        return 2
    if args.seed_major and args.restart:
        print("error: --seed-major reruns each study with the seeds of the passes before it (taken from the store), "
              "which --restart would retrain every pass; give --restart without --seed-major", file=sys.stderr)
        return 2
    if args.plan:
        return show_plan(list(STUDIES) if args.study == "all" else [args.study], args)
    if args.report_only and args.out is not None:
        here = Options(quick=args.quick, out=args.out, setting=args.setting, sets=tuple(args.sets)).store_dir()
        if not here.is_dir():  # everything would read "not trained yet": say why before the table does
            home = Options(quick=args.quick, setting=args.setting, sets=tuple(args.sets)).store_dir()
            print(f"note: {here} does not exist: --report-only reads the run store under --out, so no stored run "
                  f"is summarized (this setting's store is {home}; copy or link it there, or drop --out)",
                  file=sys.stderr)
    if args.study == "all":
        if args.nproc or args.steps:
            print("error: --nproc / --steps change one study's runs; give them with a study name, not 'all'",
                  file=sys.stderr)
            return 2
        # every study in turn; runs shared between studies (table3's P = 4 = table2's 1-bit run, fig6_17 = fig5's
        # no-sync runs, the compressors' Lion rows = table2's) are trained once: later studies find them in the
        # run store. A study that fails does not stop the others; the exit status says so.
        # the lr sweep first: --lr from-sweep studies read its best lr per arm
        order = sorted(STUDIES, key=lambda n: STUDIES[n].lr_from_sweep if args.lr == framework.FROM_SWEEP else 0)
        if args.seed_major:
            failed = _seed_major(order, args, argv)
        else:
            failed = []
            for name in order:
                print(f"== {name}", flush=True)
                if run_study(name, args, _study_argv(name, argv)) != 0:
                    failed.append(name)
        if failed:
            print(f"error: {len(failed)} study(ies) failed or could not run: {', '.join(failed)}", file=sys.stderr)
        return 1 if failed else 0
    return run_study(args.study, args, argv)


def _study_argv(name: str, argv: list[str], seeds: Sequence[int] | None = None) -> list[str]:
    """The command line one study of `all` records in its report: a command that reruns that study alone
    ('all' and --seed-major dropped; in a seed pass, the seeds it covers)."""
    out, rest, dropped = [name], iter(argv), False
    for a in rest:
        if a == "all" and not dropped:
            dropped = True
            continue
        if a.startswith("--seed-") and "--seed-major".startswith(a):
            continue
        if seeds is not None and a.startswith("--seeds"):
            if a == "--seeds":
                next(rest, None)
            continue
        out.append(a)
    return out + (["--seeds", ",".join(map(str, seeds))] if seeds is not None else [])


def _seed_major(order: Sequence[str], args: argparse.Namespace, argv: list[str]) -> list[str]:
    """--seed-major: pass k runs every training study (one that lists runs per seed) with the first k of its
    seeds (--seeds, or the study's own), in `order`: the seeds of earlier passes come from the store, so pass k
    trains the k-th seed only and the report written after it covers every seed done so far. Studies with their
    own loop (the toy) run once, after the passes. Returns the studies whose last pass failed."""
    lists = {n: args.seeds or (STUDIES[n].quick_seeds if args.quick else STUDIES[n].seeds)
             for n in order if STUDIES[n].build is not None}
    rc: dict[str, int] = {}
    for k in range(max(map(len, lists.values()), default=0)):
        for name in order:
            if name not in lists or k >= len(lists[name]):
                continue
            seeds = lists[name][:k + 1]
            print(f"== {name} (seed pass {k + 1}: seeds {','.join(map(str, seeds))})", flush=True)
            rc[name] = run_study(name, argparse.Namespace(**{**vars(args), "seeds": seeds}),
                                 _study_argv(name, argv, seeds))
    for name in order:
        if name not in lists:
            print(f"== {name}", flush=True)
            rc[name] = run_study(name, args, _study_argv(name, argv))
    return [n for n in order if rc.get(n)]


STATES = ("stored", "finished", "resumable", "to train")


def show_plan(names: Sequence[str], args: argparse.Namespace) -> int:
    """--plan: per study, its runs by state; a run listed by an earlier study (shared: the same name, or the same
    spec under another name) counted there only."""
    if args.lr == framework.FROM_SWEEP:
        names = sorted(names, key=lambda n: STUDIES[n].lr_from_sweep)  # as `all` runs them: the sweep first
    opts = Options(quick=args.quick, seeds=args.seeds, out=args.out, work=args.work, steps=args.steps,
                   nproc=args.nproc, setting=args.setting, sets=tuple(args.sets), lr=args.lr, first=args.first)
    seen: set[str] = set()
    seen_specs: dict[str, list[int]] = {}  # spec_key's training part -> the diag.every of the runs listed
    every: list[framework.Planned] = []
    by_spec = framework.stored_specs(opts.store_dir())
    print(f"plan: setting {opts.setting_name()}, lr {args.lr}; store {opts.store_dir()}")
    print(f"{'study':12s} {'runs':>5s} " + " ".join(f"{s:>9s}" for s in STATES) + f" {'pending':>8s}")
    rc = 0
    for name in names:
        study = STUDIES[name]
        if study.build is None:
            print(f"{name:12s} runs its own loop, not planned (minutes: see its section)")
            continue
        try:
            planned, note = framework.plan_study(study, opts, by_spec)
        except StudyUnavailable as e:
            print(f"{name:12s} cannot run: {e}")
            rc = 2
            continue
        mine = [p for p in planned if p.run.name not in seen
                and not any(framework.covers(have, p.spec[1]) for have in seen_specs.get(p.spec[0], []))]
        seen.update(p.run.name for p in planned)
        for p in planned:
            seen_specs.setdefault(p.spec[0], []).append(p.spec[1])
        every += mine
        counts = [sum(p.state == s for p in mine) for s in STATES]
        pending = sum(p.state.startswith("pending") for p in mine)
        shared = len(planned) - len(mine)
        print(f"{name:12s} {len(mine):5d} " + " ".join(f"{c:9d}" for c in counts) + f" {pending:8d}"
              + (f"  (+{shared} shared with an earlier study)" if shared else ""))
        left = [p.run.name for p in mine if p.left]
        if left:
            print(f"{'':12s} left: {', '.join(left)}")
        if note:
            print(f"{'':12s} note: {note}")
    left = [p for p in every if p.left]
    st = framework.SETTINGS.get(opts.setting)
    ref = framework.stored_walls(replace(opts, setting=st.lr_from).store_dir()) if st and st.lr_from else None
    minutes, how = framework.minutes_left(every, ref, st.lr_from if st else "")
    print(f"left: {len(left)} of {len(every)} run(s)"
          + (f", about {minutes / 60:.1f} h on this machine ({how})" if minutes is not None and left else
             f" ({how})" if left else ""))
    done, recorded, whole = framework.hours_spent(every, minutes)
    if whole is not None:
        print(f"cost: {done} finished run(s) recorded {recorded:.1f} h of wall time (a resumed run records only its "
              f"last launch); the whole plan, every run once at its geometry's median, about {whole:.1f} h")
    if every and not opts.quick:
        print(framework.corpus_line(every, opts))
    return rc


def run_study(name: str, args: argparse.Namespace, argv: list[str]) -> int:
    """Execute one study; 0 when it wrote its results and none of its runs failed."""
    opts = Options(quick=args.quick, seeds=args.seeds, out=args.out, work=args.work, steps=args.steps,
                   nproc=args.nproc, restart=args.restart, report_only=args.report_only, argv=argv,
                   extra={"alphas": args.alphas, "bits": args.bits}, setting=args.setting, sets=tuple(args.sets),
                   lr=args.lr, allow_repeat=args.allow_repeat, first=args.first)
    try:
        paths = STUDIES[name].execute(opts)
    except StudyUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in paths:
        print(f"wrote {p}")
    md = next((p for p in paths if p.suffix == ".md"), None)
    if md:
        print(md.read_text())
    if opts.not_run:
        print(f"note: study {name}: {len(opts.not_run)} run(s) not trained yet ({', '.join(opts.not_run)}); the table "
              f"above is interim and leaves them out. Train them with the same command without --report-only "
              f"(finished runs are reused)", file=sys.stderr)
    if opts.failed:
        print(f"error: study {name}: {len(opts.failed)} run(s) failed or were not run ({', '.join(opts.failed)}); "
              "the table above leaves them out. Their logs are under the --work directory's logs/; rerun the same "
              "command to retry them (finished runs are reused)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
