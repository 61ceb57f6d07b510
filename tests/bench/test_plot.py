"""bench.plot on synthetic metrics.jsonl files: the PNGs appear and hold the right series."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import plot

PNG = b"\x89PNG\r\n\x1a\n"


def _write_run(d: Path, slope: float, diag: bool) -> Path:
    d.mkdir(parents=True)
    lines = []
    t = 0.0
    for step in range(1, 31):
        t += 0.5 * slope
        lines.append({"step": step, "train_loss": 10 - slope * step / 10, "step_ms": 500 * slope, "comm_ms": 1.0,
                      "comm_bytes": 1, "train_time_s": t, **({"tokens": 128 * slope * step} if diag else {})})
        if step % 10 == 0:
            lines.append({"step": step, "val_loss": 10 - slope * step / 10, "train_time_s": t})
        if diag and step % 5 == 0:
            rec = {"step": step, "diag/sign_match": 0.5 + step / 100, "diag/sign_flip": 0.1 - step / 1000,
                   "diag/tie_rate": 0.2, "diag/seconds": 0.1}
            for i, role in enumerate(plot.ROLES):
                rec[f"diag/momentum_spread/{role}"] = 10.0 ** -(i + 1) * step
            lines.append(rec)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return d


def test_plots_hold_the_right_series(tmp_path: Path):
    a = _write_run(tmp_path / "lion_fp32", slope=1.0, diag=False)
    b = _write_run(tmp_path / "lioncub_4bit", slope=2.0, diag=True)
    runs = plot.load_runs([a, b / "metrics.jsonl"])
    assert list(runs) == ["lion_fp32", "lioncub_4bit"]

    s = plot.plot_loss(runs, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes()[:8] == PNG
    xs, ys = s["val_vs_step"]["lioncub_4bit"]
    assert xs == [10, 20, 30] and ys == pytest.approx([8.0, 6.0, 4.0])
    xs, ys = s["val_vs_time"]["lion_fp32"]
    assert xs == pytest.approx([5.0, 10.0, 15.0]) and ys == pytest.approx([9.0, 8.0, 7.0])
    # against training tokens: the run that logs them (slope 2: 256 tokens a step), not the one without
    assert list(s["val_vs_tokens"]) == ["lioncub_4bit"]
    xs, ys = s["val_vs_tokens"]["lioncub_4bit"]
    assert xs == pytest.approx([2560, 5120, 7680]) and ys == pytest.approx([8.0, 6.0, 4.0])
    assert "val_vs_tokens" not in plot.plot_loss({"lion_fp32": runs["lion_fp32"]}, tmp_path / "l2.png")

    d = plot.plot_diagnostics(runs, tmp_path / "diag.png")
    assert (tmp_path / "diag.png").read_bytes()[:8] == PNG
    assert list(d["sign_match"]) == ["lioncub_4bit"]          # the gradient-sync run has no diagnostics
    xs, ys = d["sign_match"]["lioncub_4bit"]
    assert xs == [5, 10, 15, 20, 25, 30] and ys == pytest.approx([0.55, 0.6, 0.65, 0.7, 0.75, 0.8])

    m = plot.plot_momentum_spread(runs, tmp_path / "spread.png")
    assert list(m) == ["lioncub_4bit"] and list(m["lioncub_4bit"]) == list(plot.ROLES)
    assert m["lioncub_4bit"]["head"][1][0] == pytest.approx(1e-2 * 5)

    rc = plot.main([str(a), str(b), "--labels", "Lion,Lion Cub", "--out", str(tmp_path / "cli")])
    assert rc == 0
    assert sorted(p.name for p in (tmp_path / "cli").iterdir()) == ["diagnostics.png", "momentum_spread.png",
                                                                    "val_loss.png"]


def test_load_runs_errors(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        plot.load_runs([tmp_path / "missing"])
    a = _write_run(tmp_path / "a", 1.0, False)
    with pytest.raises(ValueError, match="1 labels for 2 runs"):
        plot.load_runs([a, a], ["only-one"])
    # two runs of one directory name: each keeps its curve, told apart by its parent's name
    s1, s2 = _write_run(tmp_path / "seedA" / "run", 1.0, False), _write_run(tmp_path / "seedB" / "run", 2.0, False)
    assert list(plot.load_runs([s1, s2, a])) == ["seedA/run", "seedB/run", "a"]
    with pytest.raises(ValueError, match="given twice"):
        plot.load_runs([s1, s1 / "metrics.jsonl"])
    with pytest.raises(ValueError, match="'x' given to two runs"):
        plot.load_runs([s1, s2], ["x", "x"])


def test_plot_command_errors_are_one_line(tmp_path: Path, capsys):
    a = _write_run(tmp_path / "a", 1.0, False)
    for argv in ([str(tmp_path / "missing")], [str(a), str(a), "--labels", "one"]):
        assert plot.main([*argv, "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and "Traceback" not in err
