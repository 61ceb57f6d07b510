"""Clean errors wherever a user can reach them: a state this run's optimizer cannot take, a rank
that fails while its peers wait in a collective, a torn metrics.jsonl, a data error mid-run."""
from __future__ import annotations

import json

import pytest

from bench.plot import load_runs
from tests.dist import ROOT, torchrun
from tests.faults.common import TINY, records, run1


@pytest.mark.slow
def test_binsgdm_on_another_world_size_is_a_checkpoint_error(tmp_path):
    cfg = tmp_path / "binsgdm.yaml"
    cfg.write_text(f"extends: [{ROOT / 'configs/default.yaml'}, {ROOT / 'configs/variants/binsgdm.yaml'}]\n")
    run = tmp_path / "run"
    common = [*TINY, f"train.out_dir={run}", "train.max_steps=4", "train.ckpt_every=2", "train.eval_every=0"]
    torchrun(2, ROOT / "train.py", str(cfg), *common, "train.stop_after=2")
    proc = torchrun(1, ROOT / "train.py", str(cfg), *common, "train.resume=auto", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error")]
    assert len(lines) == 1 and "cannot be restored by this run" in lines[0]
    # refused at the first old rank whose exchange holds state (none read after it), the way to resume said once
    assert "saved rank 0's" in lines[0] and "resume with" not in lines[0], lines[0]
    assert "resume on the 2 rank(s) it was written with" in lines[0]


@pytest.mark.slow
def test_peers_of_a_failing_rank_point_to_its_message_and_the_run_stays_resumable(tmp_path):
    run = tmp_path / "run"
    proc = torchrun(2, "rank_fails.py", "1", "4", "configs/default.yaml", *TINY, f"train.out_dir={run}",
                    "train.max_steps=8", "train.ckpt_every=2", "train.eval_every=0", check=False)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "Connection closed by peer" not in proc.stderr, proc.stderr[-3000:]
    assert "error (rank 1): shard train_000000.bin: token id 99999" in proc.stderr
    assert "rerun with train.resume=auto" in proc.stderr
    assert "error (rank 0): stopped because another rank left a collective" in proc.stderr
    # the same command with train.resume=auto continues from the checkpoint before the failure
    proc = torchrun(2, ROOT / "train.py", "configs/default.yaml", *TINY, f"train.out_dir={run}",
                    "train.max_steps=4", "train.eval_every=0", "train.resume=auto")
    assert "resumed from" in proc.stdout and "step_000002 at step 2" in proc.stdout


def test_a_torn_metrics_line_is_repaired_and_readers_skip_it(run_copy, capsys):
    with open(run_copy / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "train_lo')  # a writer killed mid-record
    proc = run1(run_copy, "train.max_steps=5", "train.eval_every=0", "train.resume=auto")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = (run_copy / "metrics.jsonl").read_text().splitlines()
    assert '{"step": 4, "train_lo' in lines  # the torn line stands alone; the next record is intact
    runs = load_runs([run_copy])
    recs = next(iter(runs.values()))
    assert any(r.get("event") == "resume" for r in recs) and any(r.get("step") == 5 and "train_loss" in r
                                                                  for r in recs)
    assert "skipped a torn record" in capsys.readouterr().err
    assert len(recs) == len(lines) - 1 == len([ln for ln in lines if ln.strip()]) - 1
    with pytest.raises(json.JSONDecodeError):
        records(run_copy)  # a reader that does not skip it would fail: the torn line is really there
