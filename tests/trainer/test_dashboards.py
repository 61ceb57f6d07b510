"""trainer.dashboards: the wandb workspace and comparison report are built offline
(never saved) and every panel's key is one the trainer really logs to wandb: the keys of a real 2-rank
run's metrics.jsonl through trainer/logger.py's wandb_payload. Renaming a logged key fails here."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("wandb_workspaces")

from tests.dist import ROOT, torchrun  # noqa: E402
from trainer import dashboards  # noqa: E402
from trainer.logger import wandb_payload  # noqa: E402

TINY = ["model.preset=debug", "data.batch_size=4", "data.seq_len=64", "train.eval_steps=2", "log.wandb=disabled"]


@pytest.fixture(scope="module")
def logged_keys(tmp_path_factory) -> set[str]:
    """The wandb keys of a 2-rank Lion Cub 1-bit run with diagnostics on every step."""
    run = tmp_path_factory.mktemp("dash") / "run"
    torchrun(2, ROOT / "train.py", str(ROOT / "configs/default.yaml"), *TINY, "comm.mode=onebit", "diag.every=1",
             "train.max_steps=2", "train.log_every=1", f"train.out_dir={run}")
    keys: set[str] = set()
    for line in (run / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            keys |= set(wandb_payload(json.loads(line)))
    shutil.rmtree(run, ignore_errors=True)
    return keys


def _panels(panels) -> list[tuple[str, str, str]]:
    out = []
    for p in panels:
        out += [(p.title, "y", y) for y in (p.y or [])]
        if p.x != "Step":
            out.append((p.title, "x", p.x))
        if p.metric_regex:
            out.append((p.title, "regex", p.metric_regex))
    return out


def test_every_panel_key_is_logged_by_the_trainer(logged_keys):
    assert dashboards.missing_keys(logged_keys) == []
    # a renamed key is caught: what a panel would show empty
    assert dashboards.missing_keys(logged_keys - {"loss/train"}) == [
        "train loss vs steps: y loss/train", "train loss vs wall time (s in timed steps): y loss/train"]
    per_layer = {k for k in logged_keys if k.startswith("diag_momentum_spread/block.")}
    assert per_layer and dashboards.missing_keys(logged_keys - per_layer) == [
        r"momentum spread across ranks per layer: regex diag_momentum_spread/block\.\d+"]


def test_workspace_and_report_hold_exactly_those_panels():
    want = dashboards.panel_keys()
    ws = dashboards.build_workspace("me", "lioncub", group="cpu_30m")
    assert [s.name for s in ws.sections] == list(dashboards.PANELS)
    assert [k for s in ws.sections for k in _panels(s.panels)] == want
    assert [g.name for g in ws.runset_settings.groupby] == ["arm"]
    stacked = [p for s in ws.sections for p in s.panels if p.plot_type == "stacked-area"]
    assert [p.title for p in stacked] == ["step time split (ms, stacked)"]
    view = ws._to_model().model_dump_json(by_alias=True)  # the JSON save() would send, built offline
    assert '"plotType":"stacked-area"' in view and '"useMetricRegex":true' in view, view[:2000]
    # wandb addresses a config key as <key>.value; --group filters on the run's wandb group (log.group)
    assert '"grouping":[{"section":"config","name":"arm.value"}]' in view, view[:3000]
    assert '{"section":"run","name":"group"},"op":"=","value":"cpu_30m"' in view, view[:3000]

    report = dashboards.build_report("me", "lioncub", group="cpu_30m")
    grids = [b for b in report.blocks if type(b).__name__ == "PanelGrid"]
    assert [k for g in grids for k in _panels(g.panels)] == want
    assert all(g.runsets[0].groupby == ["config.arm"] and g.runsets[0].project == "lioncub" for g in grids)
    from wandb_workspaces import expr  # what save() turns them into (building its model needs a login)
    assert [expr.groupby_str_to_key(k) for k in grids[0].runsets[0].groupby] == [expr.Key(section="config",
                                                                                           name="arm.value")]
    leaf = expr.expr_to_filters(grids[0].runsets[0].filters)
    assert (leaf.key.section, leaf.key.name, leaf.value) == ("run", "group", "cpu_30m")


def test_the_arm_groups_seeds_and_separates_variants():
    """Seeds, run names and log settings share an arm; anything a run trains with (the variant file, the world
    size) separates it: the groups the dashboards draw."""
    from trainer.config import load_config
    from trainer.logger import arm_label

    def arm(*over, variant="lioncub_4bit", world=4):
        cfg = load_config(ROOT / "configs/variants" / f"{variant}.yaml", list(over)).to_dict()
        return arm_label(cfg, world)

    a = arm()
    assert a.startswith("lion pbit P4 ") and a == arm("train.seed=7", "train.out_dir=/x", "log.wandb=offline",
                                                       "diag.every=10", "train.eval_every=7")
    assert len({a, arm(variant="lioncub_8bit_l1"), arm(world=8), arm("optim.lr=1e-5"),
                arm(variant="lioncub_1bit")}) == 5
    assert arm(variant="diloco_h10") != arm(variant="diloco_h50")
    # how a run executes, not its numbers: seeds on two machines (another data cache, recomputed activations)
    assert a == arm("data.cache_dir=/elsewhere", "model.activation_checkpointing=true", "comm.timeout_s=60",
                    "train.compile=true")


def test_dry_run_builds_and_saves_nothing():
    p = subprocess.run([sys.executable, "-m", "trainer.dashboards", "--entity", "me", "--project", "lioncub",
                        "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "WANDB_MODE": "disabled", "PYTHONPATH": str(ROOT),
                            "HOME": str(ROOT / ".cache")})
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip().endswith("built for me/lioncub; nothing saved")
    assert "train loss vs wall time (s in timed steps): x throughput/train_time_s" in p.stdout
