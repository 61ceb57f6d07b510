"""A wandb workspace and a comparison report for a project's runs, from the keys the trainer logs.

    python -m trainer.dashboards --entity ME --project lioncub                  # creates both, prints URLs
    python -m trainer.dashboards --entity ME --project lioncub --group cpu_30m  # only runs of one log.group
    python -m trainer.dashboards --entity ME --project lioncub --dry-run        # lists the panels, saves nothing

Needs the `dashboards` extra (wandb-workspaces; pip install -e '.[dashboards]') and, to save, a wandb
login. Runs are grouped by their arm (the run config's `arm`, trainer.logger.arm_label: optimizer, mode,
world size and a digest of every setting a run trains with, so a group is the seeds of one method and
4- vs 8-bit Lion Cub or DiLoCo H = 10 vs 50 are groups of their own; mean line with a min/max band). Panels (PANELS below; every key is one trainer/logger.py logs to wandb, and
tests/trainer/test_dashboards.py checks them against a real run's keys):
- loss: train and val loss against steps and against training wall time (throughput/train_time_s,
  seconds in timed steps), learning rate;
- step time: the step split into data, forward+backward, collectives, pack, optimizer as a stacked
  chart, and the total;
- communication: bytes sent per step per rank, communication ms, tokens/s;
- Lion Cub diagnostics (diag.every > 0, update-sync modes): sign match, flip and tie rates, the
  momentum spread across ranks overall and per transformer block (Lion Cub Fig. 6);
- gradient norm: global and per role (gradient-sync modes: of the averaged gradient; update-sync modes:
  the rank mean of local norms, larger: the panel's title says so).
"""
from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass

GROUP_KEYS = ("arm",)  # run-config keys the runs are grouped by (trainer.logger.arm_label)
WALL_X = "throughput/train_time_s"


@dataclass(frozen=True)
class Panel:
    title: str
    y: tuple[str, ...] = ()  # wandb keys (trainer/logger.py wandb_payload)
    x: str = "Step"  # "Step" (wandb's step = the trainer's step) or a logged key
    regex: str = ""  # instead of y: every logged key matching it (per-layer charts)
    stacked: bool = False


PANELS: dict[str, tuple[Panel, ...]] = {
    "Loss": (
        Panel("train loss vs steps", ("loss/train",)),
        Panel("val loss vs steps", ("loss/val",)),
        Panel("train loss vs wall time (s in timed steps)", ("loss/train",), x=WALL_X),
        Panel("val loss vs wall time (s in timed steps)", ("loss/val",), x=WALL_X),
        Panel("learning rate", ("loss/lr",)),
    ),
    "Step time": (
        Panel("step time split (ms, stacked)", ("step_time_ms/data", "step_time_ms/fwd_bwd", "step_time_ms/collectives",
                                               "step_time_ms/pack", "step_time_ms/optimizer"), stacked=True),
        Panel("step time total (ms)", ("step_time_ms/total",)),
    ),
    "Communication": (
        Panel("bytes sent per step per rank", ("comm/bytes_sent",)),
        Panel("communication ms per step", ("comm/ms",)),
        Panel("tokens/s", ("throughput/tokens_per_s",)),
    ),
    "Lion Cub diagnostics": (
        Panel("sign match rate (applied vs exact Lion)", ("diag/sign_match",)),
        Panel("sign flip rate", ("diag/sign_flip",)),
        Panel("tie rate", ("diag/tie_rate",)),
        Panel("momentum spread across ranks (max std)", ("diag/momentum_spread",)),
        Panel("momentum spread across ranks per layer", regex=r"diag_momentum_spread/block\.\d+"),
    ),
    "Gradient norm": (
        # two quantities under one key: gradient-sync modes the averaged gradient's norm, update-sync modes (Lion
        # Cub, DiLoCo: no gradient crosses) the rank mean of each rank's own norm, which runs larger
        Panel("grad norm before clipping (grad sync: of the mean gradient; update sync: rank mean of local norms)",
              ("grad_norm/global",)),
        Panel("grad norm per role", regex=r"grad_norm/(embedding|head|attn|mlp|norm)"),
    ),
}


def panel_keys() -> list[tuple[str, str, str]]:
    """(panel title, what, key or regex) for every key a panel reads: what is 'y', 'x' or 'regex'."""
    out = []
    for panels in PANELS.values():
        for p in panels:
            out += [(p.title, "y", k) for k in p.y]
            if p.x != "Step":
                out.append((p.title, "x", p.x))
            if p.regex:
                out.append((p.title, "regex", p.regex))
    return out


def missing_keys(logged: set[str]) -> list[str]:
    """The panel keys (and regexes) that none of the `logged` wandb keys matches."""
    bad = []
    for title, what, key in panel_keys():
        ok = any(re.fullmatch(key, k) for k in logged) if what == "regex" else key in logged
        if not ok:
            bad.append(f"{title}: {what} {key}")
    return bad


def _require():
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError:
        raise ImportError("trainer.dashboards needs wandb-workspaces: pip install -e '.[dashboards]'") from None
    return wr, ws


def _line(wr, p: Panel, group: bool):
    kw = dict(title=p.title, x=p.x)
    if p.regex:
        kw["metric_regex"] = p.regex
    else:
        kw["y"] = list(p.y)
    if p.stacked:
        kw["plot_type"] = "stacked-area"
    if group:  # mean over a group's runs with a min-max band
        kw.update(groupby_aggfunc="mean", groupby_rangefunc="minmax")
    return wr.LinePlot(**kw)


def _filters(ws_or_wr, group: str):
    # the run's wandb group, which the trainer sets to log.group (a config key would be addressed
    # log.value.group: wandb nests a section's keys under .value)
    return f"Metric('group') = '{group}'" if group else ""


def build_workspace(entity: str, project: str, name: str = "lioncub comparison", group: str = ""):
    """The workspace (not saved): one section per PANELS entry, runs grouped by GROUP_KEYS."""
    wr, ws = _require()
    from wandb_workspaces import expr

    sections = [ws.Section(name=title, panels=[_line(wr, p, True) for p in panels], is_open=True)
                for title, panels in PANELS.items()]
    runset = ws.RunsetSettings(groupby=[expr.Config(k) for k in GROUP_KEYS], filters=_filters(ws, group))
    return ws.Workspace(entity=entity, project=project, name=name, sections=sections, runset_settings=runset,
                        settings=ws.WorkspaceSettings(x_axis="Step", max_runs=100))


def build_report(entity: str, project: str, title: str = "Lion Cub: optimizers and comm modes compared",
                 group: str = ""):
    """The comparison report (not saved): one panel grid per PANELS entry over the project's runs,
    grouped by GROUP_KEYS."""
    wr, _ = _require()
    # a report's groupby names a config key as config.<key> (wandb_workspaces adds its .value)
    runset = wr.Runset(entity=entity, project=project, name=f"runs by {', '.join(GROUP_KEYS)}",
                       groupby=[f"config.{k}" for k in GROUP_KEYS], filters=_filters(wr, group))
    blocks = [wr.P(f"Runs of {entity}/{project}" + (f", log.group={group}" if group else "")
                   + f", grouped by {' and '.join(GROUP_KEYS)} (the seeds of one method: mean, min-max band). "
                   "Keys: trainer/logger.py.")]
    for heading, panels in PANELS.items():
        blocks += [wr.H2(heading), wr.PanelGrid(runsets=[runset], panels=[_line(wr, p, True) for p in panels])]
    return wr.Report(entity=entity, project=project, title=title, description="built by python -m trainer.dashboards",
                     blocks=blocks, width="fluid")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.dashboards", description=__doc__.split("\n\n")[0])
    ap.add_argument("--entity", required=True, help="wandb entity (user or team) that owns the project")
    ap.add_argument("--project", required=True, help="wandb project (log.project)")
    ap.add_argument("--group", default="", help="only the runs of this log.group")
    ap.add_argument("--name", default="lioncub comparison", help="workspace name")
    ap.add_argument("--dry-run", action="store_true", help="build both and list the panels; save nothing")
    a = ap.parse_args(argv)
    try:
        workspace = build_workspace(a.entity, a.project, a.name, a.group)
        report = build_report(a.entity, a.project, group=a.group)
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.dry_run:
        for title, what, key in panel_keys():
            print(f"{title}: {what} {key}")
        print(f"dry run: workspace '{a.name}' ({len(workspace.sections)} sections) and report '{report.title}' "
              f"built for {a.entity}/{a.project}; nothing saved")
        return 0
    try:
        workspace.save()
        report.save()
    except Exception as e:  # noqa: BLE001 - wandb's API errors (no login, no such project, network)
        print(f"error: saving to wandb {a.entity}/{a.project} failed ({type(e).__name__}: {str(e)[:300]}); log in "
              f"with `wandb login` and check the entity and project names", file=sys.stderr)
        return 2
    print(f"workspace: {workspace.url}\nreport: {report.url}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
