"""launch/gpu_check.sh's plumbing, dry-run on CPU (GPU_CHECK_DEVICE=cpu): where the report goes, the summary's
PASS / FAIL lines, the exit status, the budget; and the summary of a report folder (launch/gpu_check_summary.py)."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _check(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("GPU_CHECK_OUT", "OUT", "STAGES", "GPU_CHECK_BUDGET")}
    full.update(GPU_CHECK_DEVICE="cpu", OMP_NUM_THREADS="1", **env)
    return subprocess.run(["bash", "launch/gpu_check.sh"], cwd=ROOT, env=full, capture_output=True, text=True, timeout=300)


def test_report_lands_in_out_and_names_every_stage(tmp_path):
    p = _check(tmp_path, OUT=str(tmp_path), STAGES="env")
    assert p.returncode == 0, p.stdout + p.stderr
    summary = (tmp_path / "gc" / "summary.txt").read_text()
    assert "PASS  env" in summary and "of a 440 s budget" in summary
    assert sorted(f.name for f in (tmp_path / "gc").iterdir()) == ["env.log", "summary.txt"]


def test_mfu_variants_compile_together_and_time_one_after_another(tmp_path):
    """The mfu stage starts every variant beside the tests stage; each times only once the one before it is done
    (the first once the GPU is quiet), so their result lines come in MFU_VARIANTS' order."""
    p = _check(tmp_path, GPU_CHECK_OUT=str(tmp_path / "r"), STAGES="env mfu", MFU_STEPS="1", MFU_MB="1",
               MFU_VARIANTS="before:eager model:eager")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "PASS  mfu" in (tmp_path / "r" / "summary.txt").read_text()
    lines = [ln for ln in (tmp_path / "r" / "probe.log").read_text().splitlines() if "fwd+bwd" in ln]
    assert [ln.split("rope=")[1].split(":")[0] for ln in lines] == ["before", "model"], lines


def test_a_stage_past_the_budget_is_skipped_and_counted(tmp_path):
    p = _check(tmp_path, GPU_CHECK_OUT=str(tmp_path / "r"), STAGES="env shard", GPU_CHECK_BUDGET="5")
    assert p.returncode == 2, p.stdout + p.stderr  # both stages skipped: two failures
    summary = (tmp_path / "r" / "summary.txt").read_text()
    assert "SKIP  env: the budget of 5 s is spent" in summary and "SKIP  shard" in summary


def test_summary_of_a_report_folder(tmp_path):
    (tmp_path / "ranks.json").write_text(json.dumps({"ranks2": {"world_size": 2, "variants": {
        "lion_fp32@comm.bucket_mb=0.01": {"sha256": "ab", "device": "cuda", "seconds": 1},
        "lion_fp32@comm.bucket_mb=0.01@comm.overlap=true": {"sha256": "ab", "device": "cuda", "seconds": 1},
        "dion": {"error": "RuntimeError: x"}}}, "shard": {"world_size": 2, "variants": {}, "shard": {
            "device": "cuda", "resumed_equals_straight": True, "seconds": 9}}}))
    cols = ["variant", "status", "step_ms", "compute_ms", "comm_ms", "other_ms", "tokens_per_s", "mfu", "peak_mem_gib"]
    with open(tmp_path / "train_results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, cols)
        w.writeheader()
        w.writerow(dict(variant="lion_fp32", status="ok", step_ms=30, compute_ms=28, comm_ms=0, other_ms=1.5,
                        tokens_per_s=409600, mfu=0.36, peak_mem_gib=9.5))
        w.writerow(dict(variant="adamw_fp32", status="ok", step_ms=31, compute_ms=28, comm_ms=0, other_ms=2.5,
                        tokens_per_s=396000, mfu=0.35, peak_mem_gib=9.9))
    out = subprocess.run([sys.executable, "-m", "launch.gpu_check_summary", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60).stdout
    assert "ranks2: 2 runs at 2 ranks on cuda" in out and "ranks2: dion FAILED: RuntimeError: x" in out
    assert out.count("overlap on == off bit for bit: True") == 1 and "resumed from DCP == straight run: True" in out
    assert "MFU 36.0 % (forward+backward alone 38.6 %)" in out
    assert "target lion_fp32 MFU >= 40 %: NOT met (36.0 %)" in out
    assert "<= AdamW's: met (1.50 vs 2.50 ms)" in out
