"""The training studies of the reproduction suite (Lion Cub Table 2, Fig. 10, Table 3, Fig. 5,
Fig. 6 / 17) and the registered hooks for studies whose optimizers have not landed yet.

Each study lists its runs (variant preset under configs/variants/ + overrides + seed + world size),
summarizes them from metrics.jsonl into one table row per arm (mean ± sample std over seeds) and
draws one PNG. The paper's numbers quoted in `paper` strings are Lion Cub's (GPT 730M on
OpenWebText / FineWeb, thousands of steps); ours come from a tiny GPT-2++ on the built-in corpus,
so orderings and qualitative effects are comparable, absolute losses are not.
"""
from __future__ import annotations

import csv
import json
import os
import shlex
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import comm
from bench import time_to_loss
from model import IO_ROLES, MATRIX_ROLES, ROLES

from .framework import (BEST_LR_FILE, DEFAULT_SETTING, FROM_SWEEP, NOT_RUN, ROOT, SETTINGS, Column, Options, Run,
                        RunResult, Scale, Study, Summary, full_scale, group_runs, markdown_table, mean_curve, mean_std,
                        paired_stats, preset_of, pyplot, quick_scale, register, run_config, run_wire_factor, seed_stats,
                        status_of, tokens_read)

FULL_SEEDS = [1337, 1338, 1339]
QUICK_SEEDS = [1337]


def run_name(arm: str, nproc: int, seed: int, beta2: float | None = None) -> str:
    """Run directory names shared by studies: two studies run with the same --work reuse each other's
    identical runs (same name and spec), e.g. table3 at P = 4 reuses table2's 1-bit runs and fig6_17
    reuses fig5's no-sync runs."""
    return (f"b{beta2}_" if beta2 is not None else "") + f"{arm}_p{nproc}_s{seed}"


def variant(name: str) -> str:
    return f"configs/variants/{name}.yaml"


def betas(beta2: float) -> str:
    return f"optim.betas=[0.9,{beta2}]"


def _pct(x: float | None) -> float | None:
    return None if x is None else 100.0 * x


def _ranks(values: dict[str, float | None], lower_is_better: bool = True) -> dict[str, int | None]:
    """1-based rank of each finite value (ties share the better rank)."""
    have = sorted((v, k) for k, v in values.items() if v is not None)
    out: dict[str, int | None] = {k: None for k in values}
    for k in out:
        if values[k] is not None:
            out[k] = 1 + sum(1 for v, _ in have if (v < values[k] if lower_is_better else v > values[k]))
    return out


def _val(r: RunResult) -> float | None:
    return r.final("val_loss")


def _train_tail(r: RunResult) -> float | None:
    """Mean train loss over the last 10 % of logged steps (less noisy than one record)."""
    xs, ys = r.series("train_loss")
    if not ys:
        return None
    k = max(1, len(ys) // 10)
    return statistics.fmean(ys[-k:])


def _loss_panels(results: Sequence[RunResult], path: Path, panel_key: str | None, line_key: str,
                 title: str, keys: Sequence[str] = ("val_loss",)) -> None:
    """A column per value of `panel_key` (or one), a row per metric in `keys`, one line per `line_key`
    value (mean over seeds)."""
    plt = pyplot()
    panels = group_runs(results, panel_key) if panel_key else {(): list(results)}
    fig, axes = plt.subplots(len(keys), len(panels), figsize=(5.5 * len(panels), 3.8 * len(keys)), squeeze=False)
    for row, key in zip(axes, keys):
        for ax, (pk, group) in zip(row, panels.items()):
            for (lk,), runs in group_runs(group, line_key).items():
                xs, ys = mean_curve(runs, key)
                if xs:
                    ax.plot(xs, ys, marker="." if len(xs) < 30 else None, label=str(lk))
            ax.set_title(f"{title}" + (f" ({panel_key} = {pk[0]})" if panel_key else ""), fontsize=10)
            ax.set_xlabel("step")
            ax.set_ylabel(key.replace("_", " ") + " (mean over seeds)")
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
            else:  # nothing finished yet (an interim report): say so on the panel, not with a blank legend
                ax.text(0.5, 0.5, "no finished run yet", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# Table 2: which 8-bit quantizer

TABLE2_ARMS = [  # (arm, label, preset, overrides, paper val loss (Lion Cub Table 2, FineWeb))
    ("fp32", "32 bit (Lion)", "lion_fp32", (), 2.94),
    ("1bit", "1 bit", "lioncub_1bit", (), 3.22),
    ("8bit_l0", "8 bit (L0)", "lioncub_8bit_l1", ("comm.quantizer=l0",), 3.07),
    ("8bit_l1", "8 bit (L1)", "lioncub_8bit_l1", ("comm.quantizer=l1",), 2.97),
    ("8bit_l2", "8 bit (L2)", "lioncub_8bit_l1", ("comm.quantizer=l2",), None),
    ("8bit_linf", "8 bit (Linf)", "lioncub_8bit_l1", ("comm.quantizer=linf",), 4.64),
    # a control the paper does not have: does an arm beat 32-bit Lion only because it moves less (quantizers that
    # round small |c| to 0 shrink the mean step), i.e. would 32-bit Lion with a smaller step do as well?
    ("fp32_lr3e-4", "32 bit (Lion), lr 3e-4 (control)", "lion_fp32", ("optim.lr=3e-4",), None),
]
TABLE2_CONTROLS = ("fp32_lr3e-4",)  # not ranked against the paper's arms


# Table 2's "no worse than 32-bit Lion" rests on paired t 2.0-3.9 at three seeds: the arms it compares get two
# more seeds (L_inf, 0.58 above at t 79, does not need them); only at the study's own seeds (no --seeds) and
# outside the committed tiny-builtin setting
TABLE2_ADDED_SEEDS = (1340, 1341)
TABLE2_FIVE_SEEDS = ("fp32", "1bit", "8bit_l0", "8bit_l1", "8bit_l2")
TABLE2_ROLES = ("embedding", "attn", "mlp")
TABLE2_QUICK = ("fp32", "1bit", "8bit_l1")  # --quick: one arm per code path (L0 / L2 / Linf are L1's with another p)


def table2_run(arm: str, nproc: int, seed: int, labels: tuple) -> Run:
    """Table 2's run of `arm`; table3 and compressors build their Lion runs with it too, so that under a
    shared --work they are the same runs (same name and spec) and are trained once."""
    preset, ov = next((preset, ov) for a, _, preset, ov, _ in TABLE2_ARMS if a == arm)
    return Run(run_name(arm, nproc, seed), variant(preset), ov, seed, nproc, labels)


def table2_runs(scale: Scale, seeds: list[int], opts: Options) -> list[Run]:
    # --lr from-sweep: every arm at its own best lr, so the fixed-lr control has nothing left to control
    added = TABLE2_ADDED_SEEDS if opts.seeds is None and not scale.quick and not scale.legacy else ()
    return [table2_run(arm, scale.nproc, seed, (("arm", arm), ("label", label), ("paper", paper)))
            for arm, label, _, _, paper in TABLE2_ARMS if not scale.quick or arm in TABLE2_QUICK
            if not (opts.lr == FROM_SWEEP and arm in TABLE2_CONTROLS)
            for seed in [*seeds, *(added if arm in TABLE2_FIVE_SEEDS else ())]]


def table2_summary(results: list[RunResult], scale: Scale) -> Summary:
    rows = []
    groups = group_runs(results, "arm", "label", "paper")
    fp32_runs = next((g for (a, _, _), g in groups.items() if a == "fp32"), [])
    for (arm, label, paper), group in groups.items():
        row = {"arm": arm, "label": label, "paper_val_loss": paper, "status": status_of(group),
               **seed_stats(group, _val, "val_loss"), **seed_stats(group, _train_tail, "train_loss"),
               **paired_stats(group, fp32_runs, _val, "delta_vs_fp32"),
               "sign_match_pct": _pct(mean_std(r.window_mean("diag/sign_match") for r in group if r.ok)[0]),
               "sign_flip_pct": _pct(mean_std(r.window_mean("diag/sign_flip") for r in group if r.ok)[0])}
        for role in TABLE2_ROLES:  # per role: a whole-model rate is set by the largest role
            row[f"sign_match_{role}_pct"] = _pct(mean_std(r.window_mean(f"diag/sign_match/{role}")
                                                          for r in group if r.ok)[0])
        rows.append(row)
    paper_fp32 = next(p for a, _, _, _, p in TABLE2_ARMS if a == "fp32")
    ours = _ranks({r["arm"]: r["val_loss_mean"] for r in rows if r["arm"] not in TABLE2_CONTROLS})
    theirs = _ranks({r["arm"]: r["paper_val_loss"] for r in rows})
    for r in rows:
        r["val_loss"] = f"{r['val_loss_mean']:.4f}" + (f" ± {r['val_loss_std']:.4f}" if r["val_loss_std"] is not None
                                                       else "") if r["val_loss_mean"] is not None else "-"
        r["paper_delta"] = (r["paper_val_loss"] - paper_fp32) if r["paper_val_loss"] is not None else None
        r["rank"], r["paper_rank"] = ours.get(r["arm"]), theirs[r["arm"]]
    cols = [Column("label", "arm", align="left"), Column("paper_val_loss", "paper val loss", ".2f"),
            Column("paper_delta", "paper Δ vs 32 bit", "+.2f"), Column("paper_rank", "paper rank", "d"),
            Column("val_loss", "val loss (mean ± std)"), Column("val_loss_n", "seeds", "d"),
            Column("delta_vs_fp32_mean", "Δ vs 32 bit (paired)", "+.4f"), Column("delta_vs_fp32_std", "± std", ".4f"),
            Column("delta_vs_fp32_t", "paired t", ".1f"), Column("delta_vs_fp32_n", "pairs", "d"),
            Column("rank", "rank", "d"),
            Column("train_loss_mean", "train loss (last 10 %)", ".4f"),
            Column("sign_match_pct", "sign match %", ".1f"), Column("sign_flip_pct", "sign flip %", ".1f"),
            *[Column(f"sign_match_{role}_pct", f"sign match % ({role})", ".1f") for role in TABLE2_ROLES],
            Column("status", "status", align="left"), Column("arm", "arm id", align="left", md=False),
            Column("val_loss_mean", "val loss mean", md=False), Column("val_loss_std", "val loss std", md=False)]
    # the control's note only where the control ran (--lr from-sweep drops it: every arm is at its own best lr)
    control = any(r["arm"] in TABLE2_CONTROLS for r in rows)
    notes = ["Δ: final validation loss minus 32-bit Lion's of the same seed (same initialization and data order), "
             "mean ± sample std over the seeds both finished; rank: of the mean final validation loss, lower is "
             "better, over the paper's arms; the paper has no L2 column. "
             + ("The lr 3e-4 control (32-bit Lion at 0.3x the learning rate, not in the paper) tells whether an "
                "arm's gain over 32-bit Lion is only a smaller step. " if control else "")
             + "Sign match / flip (Lion Cub Fig. 4): applied update vs exact Lion sign(mean_i c_i), mean over "
             "diagnostic steps in the second half of training (update-sync arms only); a zero update where exact "
             "Lion moves counts as neither match nor flip. Per role: the same rate over the embedding (tied with the "
             "head in both presets) and over the attention / MLP matrices; the whole-model rate counts every "
             "element once, so the largest role sets it (tiny preset: the embedding, 89 % of the model; study "
             "preset: the matrices, 79 %).",
             f"8-bit lanes at P = {scale.nproc}: L = 255 // (2P) = {comm.max_levels(scale.nproc, 8)} levels "
             "(the paper's 8 workers: 15)."]
    return Summary(rows, cols, notes)


def table2_plot(results: list[RunResult], path: Path) -> None:
    _loss_panels(results, path, None, "label", "Lion Cub Table 2: final quantizer")


register(Study(
    "table2", "Lion Cub Table 2: validation loss by quantizer (32 bit, 1 bit, 8 bit L0 / L1 / L2 / Linf)",
    "Lion Cub Table 2 (GPT on FineWeb): validation loss 32 bit 2.94, 1 bit 3.22, 8 bit (L0) 3.07, "
    "8 bit (Linf) 4.64, 8 bit (L1) 2.97: L1 matches 32-bit Lion, Linf converges poorly (§4.2).",
    quick=quick_scale(6, diag_every=2), full=full_scale(300, diag_every=10), seeds=FULL_SEEDS, quick_seeds=QUICK_SEEDS,
    build=table2_runs, summarize=table2_summary, plot=table2_plot))


# ---------------------------------------------------------------------------------------------
# Fig. 10: 1-bit tie break


def exact_zero_bits(nproc: int) -> int:
    """Narrowest lane of the p-bit allreduce that sums P sign votes (P <= 2^bits - 1)."""
    return next(b for b in (2, 4, 8, 16) if comm.max_levels(nproc, b) >= 0)


def fig10_runs(scale: Scale, seeds: list[int], opts: Options) -> list[Run]:
    beta2s = [0.99] if scale.quick else [0.95, 0.99]
    bits = exact_zero_bits(scale.nproc)
    arms = [("plus", "lioncub_1bit", ("comm.tie_break=plus",)),
            ("minus", "lioncub_1bit", ("comm.tie_break=minus",)),
            ("alternate", "lioncub_1bit", ("comm.tie_break=alternate",)),
            # exact zeros on a tie (Lion Cub App. B.1 "2-bit allreduce"): sum of 0/1 sign votes, sign(2k - P)
            (f"exact_zero_{bits}bit", "lioncub_4bit", (f"comm.bits={bits}", "comm.quantizer=sign", "comm.levels=0"))]
    if scale.quick:  # one fixed-sign arm and the exact-zero one (alternate runs in table2's quick 1-bit arm)
        arms = [a for a in arms if a[0] in ("plus",) or a[0].startswith("exact_zero")]
    return [Run(run_name(arm, scale.nproc, seed, b2), variant(preset), (*ov, betas(b2)), seed, scale.nproc,
                (("beta2", b2), ("arm", arm)))
            for b2 in beta2s for arm, preset, ov in arms for seed in seeds]


def final_matrix_weights(r: RunResult, roles: dict[str, str]) -> tuple[float | None, float | None]:
    """(mean w, mean |w|) over the attention and MLP matrices (`roles`: model.param_roles of the run's
    model) in the checkpoint of the run's final step: a tie always sent as +1 (or -1) moves every tied
    element the same way, so the fixed-sign arms end with a mean weight far from 0 (App. B.1's error
    accumulation, measured on the weights themselves). None without a finished run and its final checkpoint."""
    from model.checkpoint_files import MODEL, load_verified
    from trainer.checkpoint import latest_checkpoint, read_meta
    import torch
    finished, _ = r.series("params_identical")  # the trainer's last record, written at the final step
    path = latest_checkpoint(r.run_dir / "ckpt") if r.ok and finished else None
    if path is None or read_meta(path)["step"] != finished[-1]:
        return None, None
    state = load_verified(path, [MODEL])[0][MODEL]  # checksums, weights_only: no code from a checkpoint
    ws = [v.float().flatten() for k, v in state.items() if roles.get(k) in MATRIX_ROLES]
    if not ws:
        return None, None
    w = torch.cat(ws)
    return w.mean().item(), w.abs().mean().item()


def run_matrix_weights(r: RunResult, roles: dict[str, str]) -> tuple[float | None, float | None]:
    """final_matrix_weights from the run's checkpoint, or from the store's extras when the run directory is gone."""
    if "w_mean" in r.extras:
        return r.extras["w_mean"], r.extras["w_abs"]
    return final_matrix_weights(r, roles)


def fig10_extras(r: RunResult) -> dict:
    """Kept in the run store: the checkpoint these weight columns come from is not."""
    w_mean, w_abs = final_matrix_weights(r, _param_roles([r]))
    return {"w_mean": w_mean, "w_abs": w_abs}


def fig10_summary(results: list[RunResult], scale: Scale) -> Summary:
    rows = []
    roles = _param_roles(results)
    groups = group_runs(results, "beta2", "arm")
    for (b2, arm), group in groups.items():
        exact = next((g for (b, a), g in groups.items() if b == b2 and a.startswith("exact_zero")), [])
        def best(r: RunResult) -> float | None:
            _, ys = r.series("val_loss")
            return min(ys) if ys else None

        def drift(r: RunResult) -> float | None:
            v, b = _val(r), best(r)
            return None if None in (v, b) else v - b

        row = {"beta2": b2, "arm": arm, "status": status_of(group), **seed_stats(group, _val, "val_loss"),
               **seed_stats(group, best, "best_val"), **seed_stats(group, drift, "drift"),
               **seed_stats(group, _train_tail, "train_loss"), **paired_stats(group, exact, _val, "delta_vs_exact")}
        for col, key in (("tie_rate_pct", "diag/tie_rate"), ("tie_attn_pct", "diag/tie_rate/attn"),
                         ("tie_mlp_pct", "diag/tie_rate/mlp")):
            row[col] = _pct(mean_std(r.window_mean(key) for r in group if r.ok)[0])
        weights = [run_matrix_weights(r, roles) for r in group]
        row["w_mean"] = mean_std(w for w, _ in weights)[0]
        row["w_abs"] = mean_std(a for _, a in weights)[0]
        rows.append(row)
    cols = [Column("beta2", "beta2", ".2f"), Column("arm", "tie handling", align="left"),
            Column("val_loss_mean", "final val loss"), Column("val_loss_std", "± std"),
            Column("val_loss_n", "seeds", "d"),
            Column("delta_vs_exact_mean", "Δ vs exact zero (paired)", "+.4f"),
            Column("best_val_mean", "best val loss"), Column("drift_mean", "final − best (drift)", "+.4f"),
            Column("train_loss_mean", "train loss (last 10 %)"), Column("tie_rate_pct", "tie rate %", ".1f"),
            Column("tie_attn_pct", "ties, attn %", ".1f"), Column("tie_mlp_pct", "ties, mlp %", ".1f"),
            Column("w_mean", "final mean w (attn+mlp)", "+.4f"), Column("w_abs", "final mean abs w", ".4f"),
            Column("status", "status", align="left")]
    notes = ["plus / minus: a tied vote always becomes +1 / -1 (the naive 1-bit allreduce); alternate: +1 on odd, "
             "-1 on even steps (Lion Cub App. B.1); exact_zero: the p-bit allreduce of 0/1 sign votes, whose sum "
             "gives an exact 0 update on a tie (the paper's 2-bit reference). drift = final − best validation loss: "
             "positive when the loss climbs back up late in training; best and drift are over the run's "
             f"evaluations, every {scale.eval_every or scale.steps} steps ({scale.eval_steps} batches each).",
             "Tie rates: the share of elements whose sign votes sum to 0, over the diagnostic steps of the second "
             "half (all elements; attention and MLP matrices). The preset's tied embedding/head gives every "
             "vocabulary row a softmax gradient, so exact zeros (c = 0 on every rank, App. B.1's first-stage case) "
             "do not occur here; the ties are the second stage's: an even number of workers splitting their votes.",
             "final mean w / mean |w|: over every element of the attention and MLP matrices in the run's last "
             "checkpoint (mean over seeds); a tie sent as +1 always steps its weight by -lr, so plus drives the "
             "mean negative and minus positive while alternate and exact zero keep it near 0."]
    return Summary(rows, cols, notes)


def fig10_plot(results: list[RunResult], path: Path) -> None:
    _loss_panels(results, path, "beta2", "arm", "Lion Cub Fig. 10: 1-bit tie break", keys=("train_loss", "val_loss"))


register(Study(
    "fig10", "Lion Cub Fig. 10: 1-bit allreduce tie handling (plus / minus / alternate / exact zero)",
    "Lion Cub Fig. 10 and App. B.1: the naive 1-bit allreduce (a tie always sent as one sign) accumulates error "
    "and the loss diverges; converting ties to +1 / -1 on alternating iterations keeps training stable "
    "\"regardless of the beta2 value\", with minimal difference to a 2-bit allreduce that transmits exact zeros.",
    # P = 2: the even worker count where ties are most frequent (Table 3: ties fall as P grows), the exact-zero
    # reference is then the paper's 2-bit allreduce itself, and a 1000-step run costs ~10 min here, not ~25 at
    # P = 4. One seed: the finding is a divergence, not a small difference (--seeds adds more).
    quick=quick_scale(6, diag_every=3), full=full_scale(1000, diag_every=50, nproc=2), seeds=[1337],
    quick_seeds=QUICK_SEEDS, build=fig10_runs, summarize=fig10_summary, plot=fig10_plot,
    extras=fig10_extras,
    # --lr from-sweep: the exact-zero reference is the same Lion update with another tie rule: the 1-bit arm's lr
    lr_alias={"lioncub_4bit": "lioncub_1bit"}))


# ---------------------------------------------------------------------------------------------
# Table 3: tie rate and vote table vs workers

SIGNS = [("pos", "+1"), ("neg", "-1"), ("zero", "0")]  # the paper's row / column order
TABLE3_PAPER = {  # Lion Cub Table 3 (GPT 730M, iteration 3000), percent, (4 workers, 8 workers)
    ("pos", "pos"): (29.15, 32.08), ("pos", "neg"): (2.26, 4.34), ("pos", "zero"): (18.59, 13.54),
    ("neg", "pos"): (2.26, 4.34), ("neg", "neg"): (29.14, 32.13), ("neg", "zero"): (18.59, 13.56),
    ("zero", "pos"): (0.0, 0.0), ("zero", "neg"): (0.0, 0.0), ("zero", "zero"): (0.0, 0.0),
}


TABLE3_ROLES = ("attn", "mlp")


def table3_runs(scale: Scale, seeds: list[int], opts: Options) -> list[Run]:
    worlds = [opts.nproc] if opts.nproc else ([2] if scale.quick else [2, 4, 8])
    return [table2_run("1bit", p, seed, (("ranks", p),)) for p in worlds for seed in seeds]


def table3_summary(results: list[RunResult], scale: Scale) -> Summary:
    rows = []
    for (p,), group in group_runs(results, "ranks").items():
        # scope "all" = every element; "attn" / "mlp" = that role's own table, from the runs that logged
        # per-role vote tables (the paper's model is mostly attn / mlp, ours mostly embedding)
        for scope in ("all", *TABLE3_ROLES):
            sfx = "" if scope == "all" else f"/{scope}"
            have = [r for r in group if r.ok and r.series(f"diag/vote_table{sfx}/exact_pos_vote_pos")[0]]
            if sfx and not have:
                continue
            row = {"ranks": p, "scope": scope, "status": status_of(group), "n": len(have)}
            keys = [("diag/tie_rate" + sfx, "tie")]
            if scope == "all":
                keys += [("diag/tie_rate/attn", "tie_attn"), ("diag/tie_rate/mlp", "tie_mlp"),
                         ("diag/tie_rate/embedding", "tie_emb")]
            for key, name in keys:
                m, s, _ = mean_std(r.window_mean(key) for r in have)
                row[f"{name}_pct"], row[f"{name}_std"] = _pct(m), _pct(s)
            for e, _ in SIGNS:
                for v, _ in SIGNS:
                    row[f"{e}_{v}"] = _pct(mean_std(r.window_mean(f"diag/vote_table{sfx}/exact_{e}_vote_{v}")
                                                    for r in have)[0])
            rows.append(row)
    cols = [Column("ranks", "ranks", "d"), Column("scope", "elements", align="left"),
            Column("tie_pct", "tie rate %", ".2f"), Column("tie_std", "± std", ".2f"),
            Column("tie_attn_pct", "tie attn %", ".2f"), Column("tie_mlp_pct", "tie mlp %", ".2f"),
            Column("tie_emb_pct", "tie embedding %", ".2f")]
    cols += [Column(f"{e}_{v}", f"exact {el} / vote {vl} %", ".2f") for e, el in SIGNS for v, vl in SIGNS]
    cols += [Column("n", "seeds", "d"), Column("status", "status", align="left")]
    paper = ["| sign(exact Lion) | vote +1 | vote -1 | vote 0 |", "|---|---:|---:|---:|"]
    for e, el in SIGNS:
        paper.append(f"| {el} | " + " | ".join(f"{TABLE3_PAPER[(e, v)][0]:.2f} / {TABLE3_PAPER[(e, v)][1]:.2f}"
                                               for v, _ in SIGNS) + " |")
    notes = ["Entries: percent of all parameters with exact-Lion sign e = sign(mean_i c_i) and plain majority vote "
             "v = sign(sum_i sign(c_i)) (the nine sum to 100), averaged over diagnostic steps in the second half of "
             "training; tie rate = vote 0. Exact-zero rows come from parameters with c = 0 on every rank (with an "
             "untied embedding, its unused vocabulary rows; a tied head's gradient reaches every row), which the "
             "paper's table does not have: compare the attn / mlp tie rates with the paper's ties (4 workers 37.2 %, 8 workers 27.1 %). Rows 'attn' / 'mlp': the same table "
             "over that role's elements only (runs that logged per-role vote tables; 'seeds' counts those), the "
             "closer comparison with the paper's model, whose parameters are mostly attention and MLP matrices."]
    return Summary(rows, cols, notes, extra_tables=[("Paper (Lion Cub Table 3, 4 / 8 workers, %):", "\n".join(paper))])


def table3_plot(results: list[RunResult], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for (p,), group in group_runs(results, "ranks").items():
        for ax, key in zip(axes, ("diag/tie_rate/attn", "diag/tie_rate/mlp")):
            xs, ys = mean_curve(group, key)
            if xs:
                ax.plot(xs, [100 * y for y in ys], marker=".", label=f"P = {p}")
    paper = {4: 37.18, 8: 27.10}
    for ax, key in zip(axes, ("attn", "mlp")):
        for p, v in paper.items():
            ax.axhline(v, ls=":", color="gray")
            ax.text(0.01, v, f"paper, {p} workers", fontsize=7, va="bottom", color="gray",
                    transform=ax.get_yaxis_transform())  # x in axes coordinates: inside the panel
        ax.set_title(f"Lion Cub Table 3: vote tie rate ({key})", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("% of elements, sum of votes = 0")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


register(Study(
    "table3", "Lion Cub Table 3: vote ties and the exact-vs-majority sign table at 2, 4 and 8 ranks",
    "Lion Cub Table 3 (GPT 730M, iteration 3000, 4 / 8 workers): ties (vote 0) 18.59 % + 18.59 % = 37.2 % of "
    "updates at 4 workers, 13.54 % + 13.56 % = 27.1 % at 8; opposite signs 2.26 % + 2.26 % (4) and 4.34 % + 4.34 % "
    "(8); exact Lion is never 0.",
    quick=quick_scale(6, diag_every=2), full=full_scale(300, diag_every=10), seeds=FULL_SEEDS,
    quick_seeds=QUICK_SEEDS, build=table3_runs, summarize=table3_summary, plot=table3_plot))


# ---------------------------------------------------------------------------------------------
# Fig. 5: beta2 x momentum sync


UNTIED = "model.tie_embeddings=false"  # the head has its own momentum to sync (and to measure)


def fig5_runs(scale: Scale, seeds: list[int], opts: Options) -> list[Run]:
    every = 2 if scale.quick else 10  # the quick run must contain a sync step
    arms = [("none", "lioncub_1bit", ()),
            (f"sync_head_every_{every}", "lioncub_1bit",
             (f"comm.momentum_sync.every={every}", "comm.momentum_sync.layers=[head]")),
            # the paper's arm (§5: the input and the final layers), beside head-only
            (f"sync_emb_head_every_{every}", "lioncub_1bit",
             (f"comm.momentum_sync.every={every}", "comm.momentum_sync.layers=[embedding,head]")),
            ("l1_8bit", "lioncub_8bit_l1", ())]
    # --quick: "none" at both beta2 (what fig6_17 reuses) and both syncs at 0.95; the 8-bit L1 path runs in
    # table2's quick mode. The committed tiny-builtin results predate the embedding + head arm: that setting's
    # full study keeps its three arms (its table rebuilds from the store), every other setting runs all four
    keep = (lambda b2, arm: arm == "none" or (b2 == 0.95 and arm.startswith("sync"))) if scale.quick else \
        (lambda b2, arm: not arm.startswith("sync_emb")) if scale.legacy else (lambda b2, arm: True)
    return [Run(run_name(arm, scale.nproc, seed, b2), variant(preset), (UNTIED, *ov, betas(b2)), seed, scale.nproc,
                (("beta2", b2), ("arm", arm)))
            for b2 in (0.95, 0.99) for arm, preset, ov in arms if keep(b2, arm) for seed in seeds]


def fig5_summary(results: list[RunResult], scale: Scale) -> Summary:
    rows = []
    groups = group_runs(results, "beta2", "arm")
    for (b2, arm), group in groups.items():
        sync = next((g for (b, a), g in groups.items() if b == b2 and a.startswith("sync_head")), [])
        both = next((g for (b, a), g in groups.items() if b == b2 and a.startswith("sync_emb_head")), [])
        rows.append({"beta2": b2, "arm": arm, "status": status_of(group), **seed_stats(group, _val, "val_loss"),
                     **paired_stats(group, sync, _val, "delta_vs_sync"), **seed_stats(group, _train_tail, "train_loss"),
                     **(paired_stats(group, both, _val, "delta_vs_emb_head") if both else {})})
    cols = [Column("beta2", "beta2", ".2f"), Column("arm", "arm", align="left"),
            Column("val_loss_mean", "final val loss"), Column("val_loss_std", "± std"),
            Column("val_loss_n", "seeds", "d"),
            Column("delta_vs_sync_mean", "Δ vs sync head (paired)", "+.4f"), Column("delta_vs_sync_std", "± std", ".4f"),
            *([Column("delta_vs_emb_head_mean", "Δ vs sync embedding + head (paired)", "+.4f"),
               Column("delta_vs_emb_head_std", "± std", ".4f")] if any("delta_vs_emb_head_mean" in r for r in rows)
              else []),
            Column("train_loss_mean", "train loss (last 10 %)"),
            Column("status", "status", align="left")]
    notes = ["none: 1-bit Lion Cub, per-rank momenta never synchronized; sync_head: the head's momentum "
             "mean-allreduced every k steps; sync_emb_head: the embedding's and the head's (the paper's choice, "
             "Lion Cub §5: the input and final layers; runs in every setting but the committed tiny-builtin one); "
             "l1_8bit: 8-bit L1 votes, no sync. Untied embedding and "
             "head in every arm. Δ: final val loss minus the head-sync arm's of the same seed and beta2, mean ± std over "
             "seeds. The paper expects at beta2 = 0.95: none worse than sync, l1_8bit close to sync; "
             "at 0.99: all close."]
    return Summary(rows, cols, notes)


def fig5_plot(results: list[RunResult], path: Path) -> None:
    _loss_panels(results, path, "beta2", "arm", "Lion Cub Fig. 5: momentum sync")


register(Study(
    "fig5", "Lion Cub Fig. 5: beta2 x (no momentum sync, head sync every k, 8-bit L1)",
    "Lion Cub Fig. 5 / §5 (8 workers): with beta2 = 0.99 all sync strategies converge alike (no sync needed); "
    "with beta2 = 0.95 convergence deteriorates without sync, syncing only the input and final layers is as good "
    "as syncing all, and L1 quantization without any sync is comparable to synchronized momentum (no numbers given).",
    # diagnostics on, as in fig6_17, so that fig6_17 can reuse the "none" runs (same spec)
    quick=quick_scale(6, diag_every=2), full=full_scale(300, diag_every=10), seeds=FULL_SEEDS, quick_seeds=QUICK_SEEDS,
    build=fig5_runs, summarize=fig5_summary, plot=fig5_plot))


# ---------------------------------------------------------------------------------------------
# Fig. 6 / 17: per-layer momentum spread across workers

TENSOR_PREFIX = "diag/momentum_spread/tensor/"
BLOCK_PREFIX = "diag/momentum_spread/block/"


def fig6_runs(scale: Scale, seeds: list[int], opts: Options) -> list[Run]:
    # fig5's "none" arm exactly (name and spec): a shared --work reuses those runs
    return [Run(run_name("none", scale.nproc, seed, b2), variant("lioncub_1bit"), (UNTIED, betas(b2)), seed,
                scale.nproc, (("beta2", b2),))
            for b2 in (0.95, 0.99) for seed in seeds]


def spread_layers(results: Sequence[RunResult]) -> tuple[str, list[str]]:
    """('tensor', per-tensor keys) when the trainer logs them, else ('role', per-role keys)."""
    keys: dict[str, None] = {}
    for r in results:
        for rec in r.records:
            for k in rec:
                if k.startswith(TENSOR_PREFIX):
                    keys.setdefault(k)
    if keys:
        return "tensor", list(keys)
    return "role", [f"diag/momentum_spread/{x}" for x in ROLES]


def _role_of(key: str, roles: dict[str, str]) -> str:
    if key.startswith(TENSOR_PREFIX):
        return roles.get(key[len(TENSOR_PREFIX):], "?")
    if key.startswith(BLOCK_PREFIX):
        return "block"
    return key.rsplit("/", 1)[-1]


def _param_roles(results: Sequence[RunResult]) -> dict[str, str]:
    """Parameter name -> role for the model of the first finished run (from its config.yaml)."""
    cfg = next((r.config for r in results if r.ok and r.config), None)
    if not cfg:
        return {}
    import torch

    from model import GPT, get_preset, param_roles

    m = cfg["model"]
    kw = {"pos_emb": m.get("pos_emb", "rope")}
    if m.get("tie_embeddings") is not None:
        kw["tie_embeddings"] = m["tie_embeddings"]
    if m.get("block_size"):
        kw["block_size"] = m["block_size"]
    with torch.device("meta"):
        return dict(param_roles(GPT(get_preset(m["preset"], **kw))))


def fig6_summary(results: list[RunResult], scale: Scale) -> Summary:
    gran, keys = spread_layers(results)
    blocks = sorted({k for r in results for rec in r.records for k in rec if k.startswith(BLOCK_PREFIX)},
                    key=lambda k: int(k.rsplit("/", 1)[-1]) if k.rsplit("/", 1)[-1].isdigit() else 0)
    roles = _param_roles(results) if gran == "tensor" else {}
    by_b2 = group_runs(results, "beta2")
    rows = []
    for key in [*keys, *blocks]:
        name = key[len(TENSOR_PREFIX):] if key.startswith(TENSOR_PREFIX) else key.rsplit("/", 1)[-1]
        row = {"layer": name, "granularity": "block" if key in blocks else gran, "role": _role_of(key, roles)}
        for (b2,), group in by_b2.items():
            m, s, n = mean_std(r.window_mean(key, 0.0) for r in group if r.ok)
            row[f"spread_{b2}"], row[f"spread_{b2}_std"], row[f"n_{b2}"] = m, s, n
        rows.append(row)
    # ratio to the median of the non-(embedding, head) layers of the same granularity, per beta2
    for (b2,), _ in by_b2.items():
        for g in {r["granularity"] for r in rows}:
            others = [r[f"spread_{b2}"] for r in rows if r["granularity"] == g and r["role"] not in IO_ROLES
                      and r[f"spread_{b2}"] is not None]
            med = statistics.median(others) if others else None
            for r in rows:
                if r["granularity"] == g:
                    r[f"ratio_{b2}"] = (r[f"spread_{b2}"] / med) if med and r[f"spread_{b2}"] is not None else None
    cols = [Column("layer", "layer", align="left"), Column("granularity", "granularity", align="left"),
            Column("role", "role", align="left")]
    for (b2,), _ in by_b2.items():
        cols += [Column(f"spread_{b2}", f"spread β2={b2}", ".3e"), Column(f"spread_{b2}_std", "± std", ".1e"),
                 Column(f"ratio_{b2}", f"÷ median other (β2={b2})", ".1f")]
    notes = [f"Spread = max over a layer's elements of the std across ranks of the momentum (Lion Cub Fig. 6), "
             f"mean over all diagnostic steps, then mean ± std over seeds. Granularity here: **{gran}**"
             + (" (per-role keys diag/momentum_spread/<role>: this trainer logs no per-tensor keys yet, so each role "
                "is the max over its tensors)" if gran == "role" else " (per-tensor keys, measured before any "
                                                                     "momentum sync of the step)") + ".",
             "÷ median other: the layer's spread over the median of the layers that are neither embedding nor head "
             "(the paper: embedding and output layer about 100x the others)."]
    return Summary(rows, cols, notes)


def fig6_plot(results: list[RunResult], path: Path) -> None:
    plt = pyplot()
    gran, keys = spread_layers(results)
    fig, (a6, a17) = plt.subplots(1, 2, figsize=(12, 4.2))
    by_b2 = group_runs(results, "beta2")
    for (b2,), group in by_b2.items():  # Fig. 6: one value per layer
        ys = [mean_std(r.window_mean(k, 0.0) for r in group if r.ok)[0] for k in keys]
        a6.plot(range(len(keys)), [y if y is not None else float("nan") for y in ys], marker="o", label=f"β2 = {b2}")
    a6.set_xticks(range(len(keys)))
    a6.set_xticklabels([k.rsplit("/", 1)[-1] if gran == "role" else k[len(TENSOR_PREFIX):] for k in keys],
                       rotation=60, ha="right", fontsize=6 if gran == "tensor" else 8)
    a6.set_yscale("log")
    a6.set_title(f"Fig. 6: momentum spread across workers per {gran}", fontsize=10)
    styles = {0: "-", 1: "--", 2: ":"}
    for i, ((b2,), group) in enumerate(by_b2.items()):  # Fig. 17: spread over training, per role
        for j, role in enumerate(ROLES):
            xs, ys = mean_curve(group, f"diag/momentum_spread/{role}")
            if xs:
                a17.plot(xs, ys, ls=styles.get(i, "-"), color=f"C{j}", label=f"{role}, β2 = {b2}")
    a17.set_yscale("log")
    a17.set_xlabel("step")
    a17.set_title("Fig. 17: spread over training per role (line style = β2)", fontsize=10)
    for ax in (a6, a17):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


register(Study(
    "fig6_17", "Lion Cub Fig. 6 / 17: per-layer momentum spread across workers at two beta2 values",
    "Lion Cub Fig. 6 (GPT 730M, OpenWebText): the max std across workers of the momentum is nearly 100x larger for "
    "the input embedding and the output layer than for the other layers. Fig. 17: the spread is smaller for larger "
    "beta2 and stays about constant through training.",
    quick=quick_scale(6, diag_every=2), full=full_scale(300, diag_every=10), seeds=FULL_SEEDS,
    quick_seeds=QUICK_SEEDS, build=fig6_runs, summarize=fig6_summary, plot=fig6_plot))


# ---------------------------------------------------------------------------------------------
# Lion Cub Fig. 20: Lion Cub against AdamW and the compressed Adam-family optimizers

COMPRESSED = ("onebit_adam", "binsgdm", "loco_adamw")


# the Lion rows are table2's runs (its diagnostics every 10 steps included in this study's scale)
# (and table2's lr 3e-4 control: Chen et al. recommend Lion a learning rate 3-10x smaller than AdamW's)
COMPRESSORS_FROM_TABLE2 = {"lion_fp32": "fp32", "lioncub_1bit": "1bit", "lioncub_8bit_l1": "8bit_l1",
                           "lion_fp32_lr3e-4": "fp32_lr3e-4"}


# --quick trains one compressed optimizer, 1-bit Adam (the one with a per-run override, its freeze step):
# BinSGDM and LoCo train end to end in tests/optim/test_ef_optim.py, and the study's summary is the same for all
COMPRESSED_QUICK = ("onebit_adam",)


# the matrix optimizers beside them (not in Lion Cub's Fig. 20): they need a model whose matrices dominate, so
# they run in every setting but the committed tiny-builtin one (94 % embedding and head)
MATRIX_OPTIMIZERS = ("muon", "dion")


def compressor_run(v: str, scale: Scale, seed: int) -> Run:
    """The compressors study's run of optimizer preset `v` (not a table2 arm); horizon builds its AdamW and
    1-bit Adam runs with it, so under one setting they are the same runs (name and spec)."""
    # 1-bit Adam freezes its variance after 15 % of the run (its preset's ratio), here of this run
    freeze = (f"optim.freeze_step={max(1, int(0.15 * scale.steps))}",)
    return Run(run_name(v, scale.nproc, seed), variant(v),
               freeze if v == "onebit_adam" else DION_CONVENTION if v == "dion" and scale.setting == DEFAULT_SETTING
               else (), seed, scale.nproc, (("optimizer", v),))


def compressors_runs(scale: Scale, seeds: list[int], opts: Options) -> list[Run]:
    now = ["adamw_fp32"] if scale.quick else ["adamw_fp32", *COMPRESSORS_FROM_TABLE2]
    if opts.lr == FROM_SWEEP:  # every arm at its own best lr: no fixed-lr control
        now = [v for v in now if COMPRESSORS_FROM_TABLE2.get(v) not in TABLE2_CONTROLS]
    compressed = COMPRESSED_QUICK if scale.quick else COMPRESSED
    if not scale.quick and not scale.legacy:
        compressed = (*compressed, *MATRIX_OPTIMIZERS)
    return [table2_run(COMPRESSORS_FROM_TABLE2[v], scale.nproc, seed, (("optimizer", v),))
            if v in COMPRESSORS_FROM_TABLE2 else compressor_run(v, scale, seed)
            for v in [*now, *compressed] for seed in seeds]


def _bytes_per_step(r: RunResult) -> float | None:
    _, ys = r.series("comm_bytes")
    return statistics.median(ys) if ys else None


# the compressors table's reference: every other row's Δ is paired with its seed's AdamW run
COMPRESSORS_REFERENCE = "adamw_fp32"


def compressors_summary(results: list[RunResult], scale: Scale) -> Summary:
    rows, wires = [], {}
    groups = group_runs(results, "optimizer")
    ref = groups.get((COMPRESSORS_REFERENCE,), [])
    for (opt,), group in groups.items():
        m, _, _ = mean_std(_bytes_per_step(r) for r in group if r.ok)
        factor, wire = next((run_wire_factor(r, scale) for r in group if r.ok), (None, ""))
        wires[opt] = wire
        rows.append({"optimizer": opt, "status": status_of(group), **seed_stats(group, _val, "val_loss"),
                     **(paired_stats(group, ref, _val, "delta_vs_adamw") if opt != COMPRESSORS_REFERENCE else {}),
                     "bytes_per_step": m, "wire_factor": factor,
                     "wire_bytes_per_step": m * factor if None not in (m, factor) else None,
                     "train_time_s": mean_std(r.final("train_time_s") for r in group if r.ok)[0]})
    cols = [Column("optimizer", "optimizer", align="left"), Column("val_loss_mean", "final val loss"),
            Column("val_loss_std", "± std"), Column("val_loss_n", "seeds", "d"),
            Column("delta_vs_adamw_mean", "Δ vs AdamW (paired)", "+.4f"), Column("delta_vs_adamw_std", "± std", ".4f"),
            Column("bytes_per_step", "buffer bytes / rank / step (handed to collectives)", ",.0f"),
            Column("wire_bytes_per_step", f"wire bytes / rank / step (P = {scale.nproc}, the scheme's algorithm)",
                   ",.0f"),
            Column("wire_factor", "wire ÷ buffer", ".3f"),
            Column("train_time_s", "train time (s)", ".0f"),
            Column("status", "status", align="left")]
    notes = ["1-bit Adam runs exact AdamW for the first 15 % of the steps (optim.freeze_step), then exchanges "
             "1-bit momenta; bytes per step are the median over the run (past the warm-up's fp32 steps, whose "
             "ring allreduce the wire factor of the compressed exchange does not describe).",
             "Buffer bytes: the tensors each rank hands to its collectives per step (CommStats' count, "
             "`comm_bytes`). Wire bytes: what the collective puts on the network per rank for the algorithm the "
             "run's comm.mode uses, from that sync scheme's own cost model (optim.sync registry: `predict` at "
             "alpha = 0 over `bytes_per_call`, both at P ranks): ring allreduce 2(P-1)/P x the buffer (fp32 at "
             "P = 4: 1.5x), all-to-all (P-1)/P (a rank's own chunk stays), ring all-gather (P-1) chunks, a "
             "parameter server its fan-in and fan-out. What each row's scheme sends: "
             + "; ".join(f"{opt}: {w}" for opt, w in wires.items() if w) + "."]
    sign_scale = onebit_adam_scale(results)
    if sign_scale:
        notes.append(sign_scale)
    return Summary(rows, cols, notes)


def onebit_adam_scale(results: Sequence[RunResult]) -> str:
    """The note beside the 1-bit Adam row: which scale its sign code used (from the run's own config), and how it
    differs from the reference implementation's one per-tensor L2 scale; "" without a finished 1-bit Adam run."""
    # a config written before comm.scale / comm.block existed does not say: the first run whose config does
    comm_cfg = next((c for r in results if r.ok and r.run.label("optimizer") == "onebit_adam"
                     for c in [(r.config or {}).get("comm") or {}] if {"compressor", "scale", "block"} <= c.keys()),
                    None)
    if comm_cfg is None or comm_cfg["compressor"] != "scaled_sign":
        return ""
    how, block = comm_cfg["scale"], int(comm_cfg["block"])
    scale = "the mean |y|" if how == "mean_abs" else "||y||_2 / sqrt(n)"
    where = f"each block of {block} elements" if block else "each rank's chunk (n / P elements)"
    return (f"The 1-bit Adam row's sign code is scaled by {scale} of {where} of the flat momentum "
            f"(comm.scale={how} comm.block={block}), not by the one per-tensor L2 scale ||y||_2 / sqrt(n) of "
            "DeepSpeed's OnebitAdam (1-bit Adam's reference implementation); comm.scale=l2 comm.block=0 comes "
            "closest to it.")


def compressors_plot(results: list[RunResult], path: Path) -> None:
    _loss_panels(results, path, None, "optimizer", "Lion Cub Fig. 20: Lion Cub vs compressed Adam variants")


register(Study(
    "compressors", "Lion Cub Fig. 20: Lion Cub vs AdamW and compressed optimizers (1-bit Adam, BinSGDM, LoCo)",
    "Lion Cub Fig. 20 (GPT 735M, 8 GPUs): under restricted bandwidth 1-bit Adam beats Adam in total time but Lion Cub "
    "is fastest; on FineWeb, with the hyperparameters that make Adam converge, 1-bit Adam and 0/1 Adam diverge.",
    quick=quick_scale(6, diag_every=2), full=full_scale(300, diag_every=10), seeds=FULL_SEEDS,
    quick_seeds=QUICK_SEEDS, build=compressors_runs, summarize=compressors_summary, plot=compressors_plot))

# ---------------------------------------------------------------------------------------------
# Dion §4.1: error feedback on / off across ranks

DION_RANKS = (0.5, 0.25, 0.0625)
# The tiny-builtin setting's Dion runs trained before optim.transpose_wide existed, under the convention it now
# names false (P = B Q on the fan_out side for every shape); its default became true (Q on the shorter side). The
# run store identifies a run by its config and overrides, so the setting's Dion runs pin the old convention: their
# committed entries (whose specs say so) stay valid, and a run under the new default is a different run. Every
# other setting trains under the default.
DION_CONVENTION = ("optim.transpose_wide=false",)


def dion_ef_run(r: float, ef: bool, scale: Scale, seed: int) -> Run:
    """dion_ef's run at rank fraction r with error feedback on or off (horizon builds its Dion runs with it).
    Its rank-1/4 run with error feedback has the spec of the compressors' Dion run under another name: the
    store's spec index (framework.stored_specs) trains that spec once."""
    pin = DION_CONVENTION if scale.setting == DEFAULT_SETTING else ()
    return Run(run_name(f"dion_r{r:g}_ef{int(ef)}", scale.nproc, seed), variant("dion"),
               (f"optim.rank_fraction={r}", f"optim.error_feedback={'true' if ef else 'false'}", *pin), seed,
               scale.nproc, (("rank_fraction", r), ("error_feedback", ef)))


def dion_runs(scale: Scale, seeds: list[int], opts: Options) -> list[Run]:
    # quick: the lowest rank only (the on / off pair; the gap-vs-rank summary has its own unit test)
    ranks = (0.0625,) if scale.quick else DION_RANKS
    return [dion_ef_run(r, ef, scale, seed) for r in ranks for ef in (True, False) for seed in seeds]


def dion_summary(results: list[RunResult], scale: Scale) -> Summary:
    rows = []
    groups = group_runs(results, "rank_fraction", "error_feedback")
    for (r, ef), group in groups.items():
        # the gap, per seed, on the "off" row: val loss without error feedback minus with it
        gap = paired_stats(group, groups.get((r, True), []), _val, "gap_off_minus_on") if not ef else {}
        rows.append({"rank_fraction": r, "error_feedback": "on" if ef else "off", "status": status_of(group),
                     **seed_stats(group, _val, "val_loss"), **seed_stats(group, _train_tail, "train_loss"), **gap})
    rows.sort(key=lambda x: (-x["rank_fraction"], x["error_feedback"] == "off"))
    cols = [Column("rank_fraction", "rank / min(m, n)", ".4g"), Column("error_feedback", "error feedback", align="left"),
            Column("val_loss_mean", "final val loss"), Column("val_loss_std", "± std"), Column("val_loss_n", "seeds", "d"),
            Column("train_loss_mean", "train loss (last 10 %)"),
            Column("gap_off_minus_on_mean", "off - on (val, paired)", "+.4f"),
            Column("gap_off_minus_on_std", "± std", ".4f"), Column("status", "status", align="left")]
    notes = ["Dion §4.1: without error feedback the rank-r approximation is applied to M = mu M + G directly; the "
             "paper (Fig. 3a) finds that version degrades steeply as the rank falls while Dion does not. The finding "
             "reproduces when the off - on gap grows as the rank fraction shrinks. The gap is taken per seed (both arms "
             "of a seed share the initialization and the data order), mean ± std over seeds."]
    return Summary(rows, cols, notes)


def dion_plot(results: list[RunResult], path: Path) -> None:
    _loss_panels(results, path, "rank_fraction", "error_feedback", "Dion §4.1: error feedback on (True) / off")


register(Study(
    "dion_ef", "Dion error-feedback ablation (Dion §4.1, Fig. 3a: error feedback on / off at decreasing rank)",
    "Dion (Ahn & Xu) §4.1, Fig. 3a: without error feedback, quality degrades steeply as the rank drops from d/2 to "
    "d/4, while Dion with error feedback stays stable.",
    quick=quick_scale(6), full=full_scale(300), seeds=FULL_SEEDS, quick_seeds=QUICK_SEEDS,
    build=dion_runs, summarize=dion_summary, plot=dion_plot))


# ---------------------------------------------------------------------------------------------
# the longer horizon: the verdicts that are claims about longer training, at the study-prose-1200 setting

# (arm, its reference arm for the paired Δ or None): 1-bit Adam's divergence against AdamW (Lion Cub Fig. 20);
# Dion without error feedback against with, at rank 1/4 and 1/16 (Dion §4.1); 1-bit and 8-bit L1 Lion Cub against
# 32-bit Lion (Lion Cub Table 2)
HORIZON_ARMS = (("adamw_fp32", None), ("onebit_adam", "adamw_fp32"),
                ("dion_r0.25_ef1", None), ("dion_r0.25_ef0", "dion_r0.25_ef1"),
                ("dion_r0.0625_ef1", None), ("dion_r0.0625_ef0", "dion_r0.0625_ef1"),
                ("fp32", None), ("1bit", "fp32"), ("8bit_l1", "fp32"))


def horizon_run(arm: str, scale: Scale, seed: int) -> Run:
    """The arm's run as the study that owns it builds it (compressors, dion_ef, table2), under a name of its own
    ("horizon_" + theirs: without diagnostics, its spec differs from table2's and compressors' runs, which
    diagnose every 10 steps) and labelled for this study's table. Where one of theirs is stored, the store's
    spec index serves it (its diagnostics cover none), so no training run is repeated."""
    if arm.startswith("dion_r"):
        r, ef = arm[len("dion_r"):].split("_ef")
        run = dion_ef_run(float(r), ef == "1", scale, seed)
    elif arm in COMPRESSED or arm == COMPRESSORS_REFERENCE:
        run = compressor_run(arm, scale, seed)
    else:
        run = table2_run(arm, scale.nproc, seed, ())
    ref = dict(HORIZON_ARMS)[arm]
    return Run(f"horizon_{run.name}", run.config, run.overrides, run.seed, run.nproc,
               (("arm", arm), ("reference", ref)), run.requires)


def horizon_runs(scale: Scale, seeds: list[int], opts: Options) -> list[Run]:
    return [horizon_run(arm, scale, seed) for arm, _ in HORIZON_ARMS for seed in seeds]


# the 5 % two-sided critical value of Student's t by degrees of freedom (pairs - 1), to three decimals (rounded
# down to two, 4.30 at 2 dof would pass a t of 4.301 that 4.303 does not)
T_CRIT_5 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
# the 5 % one-sided critical value (a claim with a direction: Dion §4.1's gain grows as the rank falls)
T_CRIT_5_ONE_SIDED = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833}
# a run diverged: its val loss rose this much above its own lowest value after the first 15 % of the run,
# or train.on_nonfinite stopped it (framework.DIVERGED)
DIVERGED_RISE = 0.05


def paired_verdict(n: int, t: float | None, status: str = "ok") -> str:
    """The verdict of a paired Δ (positive: worse) over n pairs at the 5 % level ("-" below two pairs): a t
    under the critical value is "not significant" (the test found no difference; it does not show the arms
    equal). While the arm's status is interim (runs still to train) the verdict says so."""
    if n < 2:
        return "-"
    word = "not significant at 5 %" if t is None or abs(t) < T_CRIT_5[min(n - 1, 9)] else \
        "worse" if t > 0 else "better"
    return word + (f" (interim, {n - 1} dof)" if "interim" in status else "")


def _val_rise(r: RunResult) -> float | None:
    """The largest rise of the val loss above its lowest value so far, after the first 15 % of the run (past
    warm-up and 1-bit Adam's exact phase): 0 for a curve that only falls."""
    xs, ys = r.series("val_loss")
    late = [y for x, y in zip(xs, ys) if y is not None and x > 0.15 * xs[-1]] if xs else []
    return max((y - min(late[:i + 1]) for i, y in enumerate(late)), default=None)


def diverged(r: RunResult) -> bool | None:
    """Whether the run diverged (DIVERGED_RISE, or stopped on a non-finite loss); None when it did not run to a
    verdict."""
    if r.diverged:
        return True
    rise = _val_rise(r) if r.ok else None
    return None if rise is None else rise > DIVERGED_RISE


def _per_seed(group: Sequence[RunResult], ref: Sequence[RunResult]) -> dict[int, float]:
    """seed -> final val loss of the run minus its reference's at that seed (both finished)."""
    refs = {r.run.seed: _val(r) for r in ref if r.ok}
    return {r.run.seed: _val(r) - refs[r.run.seed] for r in group
            if r.ok and _val(r) is not None and refs.get(r.run.seed) is not None}


def horizon_summary(results: list[RunResult], scale: Scale) -> Summary:
    groups = group_runs(results, "arm")
    rows = []
    for arm, ref in HORIZON_ARMS:
        group = groups.get((arm,), [])
        verdicts = [v for v in map(diverged, group) if v is not None]
        row = {"arm": arm, "reference": ref or "-", "status": status_of(group), **seed_stats(group, _val, "val_loss"),
               "val_rise": max((x for x in map(_val_rise, group) if x is not None), default=None),
               "diverged": f"{sum(verdicts)} of {len(verdicts)}" if verdicts else "-"}
        if ref is not None:
            row.update(paired_stats(group, groups.get((ref,), []), _val, "delta"))
            row["verdict"] = paired_verdict(row["delta_n"], row["delta_t"], row["status"])
        rows.append(row)
    cols = [Column("arm", "arm", align="left"), Column("val_loss_mean", "final val loss"),
            Column("val_loss_std", "± std"), Column("val_loss_n", "seeds", "d"),
            Column("reference", "paired against", align="left"), Column("delta_mean", "Δ (paired)", "+.4f"),
            Column("delta_std", "± std", ".4f"), Column("delta_n", "pairs", "d"),
            Column("delta_t", "paired t (pairs - 1 dof)", ".1f"), Column("verdict", "verdict (5 %)", align="left"),
            Column("val_rise", "largest val-loss rise after 15 %", ".3f"),
            Column("diverged", "seeds diverged", align="left"), Column("status", "status", align="left")]
    notes = [f"{scale.steps} steps. Δ: this arm's final val loss minus its reference's at the same seed (same "
             "initialization and data order); the seeds are the independent units: the paired t has pairs - 1 "
             "degrees of freedom (4.30 at the 5 % level for 3 pairs, 12.71 for 2), and the verdict says whether it "
             "passes. A run diverged when its val loss rose more than "
             f"{DIVERGED_RISE} above its own lowest value after the first 15 % of the run, or it stopped on a "
             "non-finite loss (train.on_nonfinite=stop; such a run is stored with its curve up to the stop and never trained "
             "again): Lion Cub "
             "Fig. 20's claim, 1-bit Adam diverging where AdamW converges, reproduces only on diverged seeds.",
             ef_growth_note(groups)]
    return Summary(rows, cols, notes)


def ef_growth_note(groups: dict) -> str:
    """Dion §4.1 (error feedback matters more as the rank falls) as its own paired statistic: per seed, the gain
    of error feedback at rank 1/16 minus its gain at rank 1/4 (each gain: final val loss without it minus with
    it), its mean, spread and t over the seeds that ran all four arms."""
    at = {r: _per_seed(groups.get((f"dion_r{r}_ef0",), []), groups.get((f"dion_r{r}_ef1",), []))
          for r in ("0.25", "0.0625")}
    seeds = sorted(at["0.25"].keys() & at["0.0625"].keys())
    m, sd, n = mean_std(at["0.0625"][k] - at["0.25"][k] for k in seeds)
    t = m / (sd / n ** 0.5) if m is not None and sd and n > 1 else None
    head = ("Dion §4.1 (error feedback helps more at lower rank), per seed: the gain of error feedback at rank 1/16 "
            "minus its gain at rank 1/4 (gain = val loss without it minus with it; positive = it helps more at "
            "1/16): ")
    if not n:
        return head + "no seed has all four Dion runs yet."
    said = f"{m:+.4f}" + (f" ± {sd:.4f}, t {t:.1f} at {n - 1} dof" if t is not None else "") + f" over {n} seed(s)"
    if n < 2:
        return head + said + ": one unit, no verdict."
    grows = t is not None and t >= T_CRIT_5_ONE_SIDED[min(n - 1, 9)]  # a directional claim: one-sided
    arms = [f"dion_r{rank}_ef{ef}" for rank in ("0.25", "0.0625") for ef in (0, 1)]
    pending = sum(res.status.startswith(NOT_RUN) for arm in arms for res in groups.get((arm,), []))
    return head + said + (": reproduces (the gain grows, significant at 5 %, one-sided)." if grows else
                          f": not established (no significant growth at 5 %, one-sided; interim, {pending} of its "
                          f"runs not trained yet)." if pending else
                          ": not reproduced here (no significant growth at 5 %, one-sided; a growth is not "
                          "excluded).")


def horizon_plot(results: list[RunResult], path: Path) -> None:
    _loss_panels(results, path, None, "arm", "Longer horizon: AdamW / 1-bit Adam, Dion ± error feedback, Lion Cub")


register(Study(
    "horizon", "The longer horizon: 1-bit Adam vs AdamW, Dion's error feedback at rank 1/4 and 1/16, Lion Cub 1-bit "
               "and 8-bit L1 vs 32-bit Lion (run it with --setting study-prose-1200)",
    "Lion Cub Fig. 20: 1-bit Adam diverges where Adam converges (FineWeb). Dion §4.1, Fig. 3a: without error "
    "feedback quality degrades steeply as the rank falls. Lion Cub Table 2: 8-bit L1 matches 32-bit Lion, 1 bit "
    "converges worse. All three from runs far longer than the study setting's 300 steps.",
    # no diagnostics: its summary reads losses only, so the other studies' runs (diagnosed or not) serve it
    quick=quick_scale(6), full=full_scale(300), seeds=FULL_SEEDS, quick_seeds=QUICK_SEEDS,
    build=horizon_runs, summarize=horizon_summary, plot=horizon_plot))


# ---------------------------------------------------------------------------------------------
# learning-rate sweep: every arm at its own best lr

LION_LRS = (1e-4, 3e-4, 1e-3)     # Lion's best lr is typically 3-10x below AdamW's (Chen et al., Lion §5)
ADAM_LRS = (3e-4, 1e-3, 3e-3)
MATRIX_LRS = (0.006, 0.02, 0.06)  # Muon / Dion: the matrices' lr (the Dion paper tunes it over 0.01-0.05)
SWEEP_ARMS = {  # preset (configs/variants) -> (the swept key, its values, about 3x apart)
    "lion_fp32": ("optim.lr", LION_LRS), "lioncub_1bit": ("optim.lr", LION_LRS),
    "lioncub_8bit_l1": ("optim.lr", LION_LRS), "adamw_fp32": ("optim.lr", ADAM_LRS),
    "onebit_adam": ("optim.lr", ADAM_LRS), "binsgdm": ("optim.lr", ADAM_LRS), "loco_adamw": ("optim.lr", ADAM_LRS),
    "dion": ("optim.matrix_lr", MATRIX_LRS), "muon": ("optim.matrix_lr", MATRIX_LRS),
}
SWEEP_SEED = 7            # not one of the comparison seeds: the lr is not chosen on the runs it is then judged by
SWEEP_QUICK = ("lion_fp32",)  # --quick: one arm's three values (the summary is the same for all)


SWEEP_EXTEND = 2          # full scale: grid values added past each edge at most (quick: none)


def _sweep_runs(preset: str, values: Sequence[float], scale: Scale, seeds: list[int]) -> list[Run]:
    key = SWEEP_ARMS[preset][0]
    extra = (f"optim.freeze_step={max(1, int(0.15 * scale.steps))}",) if preset == "onebit_adam" else \
        DION_CONVENTION if preset == "dion" and scale.setting == DEFAULT_SETTING else ()
    return [Run(run_name(f"sweep_{preset}_lr{v:g}", scale.nproc, seed), variant(preset), (*extra, f"{key}={v:g}"),
                seed, scale.nproc, (("arm", preset), ("key", key), ("lr", v)))
            for v in values for seed in seeds]


def lr_sweep_runs(scale: Scale, seeds: list[int], opts: Options) -> list[Run]:
    arms = SWEEP_QUICK if scale.quick else tuple(SWEEP_ARMS)
    return [run for preset in arms for run in _sweep_runs(preset, SWEEP_ARMS[preset][1], scale, seeds)]


def next_grid_value(grid: Sequence[float], below: bool) -> float:
    """The value one step past the grid's lower (or upper) edge, keeping its alternation of steps (1e-4, 3e-4,
    1e-3 -> 3e-5 below, 3e-3 above; 0.006, 0.02, 0.06 -> 0.002, 0.2): the step two places in from that edge."""
    g = sorted(grid)
    v = g[0] * g[1] / g[2] if below else g[-1] * g[-2] / g[-3]
    return float(f"{v:.3g}")


def lr_sweep_extend(results: list[RunResult], scale: Scale, seeds: list[int], opts: Options) -> list[Run]:
    """An arm whose every value finished and whose best is at the grid's edge gets the next value past that edge
    (up to SWEEP_EXTEND per side): a best at the edge says only that the best lies there or beyond."""
    if scale.quick:
        return []
    out = []
    for (arm,), group in group_runs(results, "arm").items():
        if not all(r.ok for r in group):
            continue
        vals = {lr: seed_stats(g, _val, "val_loss")["val_loss_mean"] for (lr,), g in group_runs(group, "lr").items()}
        if None in vals.values() or len(vals) < 3:
            continue
        grid, base = sorted(vals), SWEEP_ARMS[arm][1]
        best = min(vals, key=vals.get)
        if best == grid[0] and sum(v < min(base) for v in grid) < SWEEP_EXTEND:
            out += _sweep_runs(arm, [next_grid_value(grid, below=True)], scale, seeds)
        elif best == grid[-1] and sum(v > max(base) for v in grid) < SWEEP_EXTEND:
            out += _sweep_runs(arm, [next_grid_value(grid, below=False)], scale, seeds)
    return out


def lr_sweep_summary(results: list[RunResult], scale: Scale) -> Summary:
    rows = []
    for (arm, key), group in group_runs(results, "arm", "key").items():
        by_lr = group_runs(group, "lr")
        vals = {lr: seed_stats(g, _val, "val_loss")["val_loss_mean"] for (lr,), g in by_lr.items()}
        have = {lr: v for lr, v in vals.items() if v is not None}
        best = min(have, key=have.get) if have else None
        for (lr,), g in by_lr.items():
            # the minimum at the edge of the values that finished: the true best may lie beyond it (the sweep adds
            # the next value past an edge; a value there that did not finish is named)
            edge = ""
            if lr == best and lr in (min(have), max(have)):
                past = [v for v in vals if (v < lr if lr == min(have) else v > lr)]
                edge = "edge" + (f"; {', '.join(f'{v:g}' for v in sorted(past))} did not finish" if past else "")
            rows.append({"arm": arm, "key": key, "lr": lr, "status": status_of(g), **seed_stats(g, _val, "val_loss"),
                         **seed_stats(g, _train_tail, "train_loss"), "best": "best" if lr == best else "",
                         "edge": edge})
    cols = [Column("arm", "arm (preset)", align="left"), Column("key", "swept", align="left"),
            Column("lr", "value", ".0e"), Column("val_loss_mean", "final val loss"), Column("val_loss_n", "seeds", "d"),
            Column("train_loss_mean", "train loss (last 10 %)"), Column("best", "best", align="left"),
            Column("edge", "at grid edge", align="left"), Column("status", "status", align="left")]
    notes = [f"One seed ({SWEEP_SEED}, not a comparison seed), {scale.steps} steps per run; best = lowest final "
             "validation loss of the arm. `--lr from-sweep` runs the other studies (Table 2, Fig. 20 compressors, "
             f"Dion's ablation, ...) with each arm at its best value, read from {BEST_LR_FILE} in this results "
             "directory (written only when every value of the arm finished). A best at the grid's edge adds the next "
             f"value past that edge (the grid's step, up to {SWEEP_EXTEND} values per side), so a best still marked "
             "at the edge lies at or beyond the extended grid. The Lion family sweeps 1e-4-1e-3, the "
             "AdamW family 3e-4-3e-3 (Lion's best lr is typically 3-10x below AdamW's); Muon and Dion sweep the "
             "matrices' lr (their AdamW part on embedding, head and 1-D parameters keeps the setting's optim.lr)."]
    return Summary(rows, cols, notes)


def lr_sweep_best(summary: Summary, results: list[RunResult], scale: Scale, out: Path) -> list[Path]:
    """BEST_LR_FILE: the best value per arm whose every value of the base grid finished and whose values added
    past an edge were tried (one that failed, e.g. diverged, counts as worse; one not run yet, as under
    --report-only, leaves the arm out until it is), with the setting it holds for."""
    done = {a for (a,), g in group_runs(results, "arm").items()
            if all(r.ok for r in g if r.run.label("lr") in SWEEP_ARMS[a][1])
            and not any(r.status.startswith(NOT_RUN) for r in g)}
    best = {r["arm"]: {"key": r["key"], "value": r["lr"], "val_loss": r["val_loss_mean"], "edge": bool(r["edge"])}
            for r in summary.rows if r["best"] and r["arm"] in done}
    path = out / BEST_LR_FILE
    path.write_text(json.dumps({"setting": scale.setting, "overrides": list(scale.overrides), "steps": scale.steps,
                                "nproc": scale.nproc, "best": best}, indent=1) + "\n")
    return [path]


SWEEP_SMOOTH = 5  # train-loss panels: mean over this many logged points (a 300-step run logs every 5th step)


def lr_sweep_plot(results: list[RunResult], path: Path) -> None:
    """Top row: final val loss against the swept value, one line per arm (optim.lr arms, then the matrix-lr
    arms, whose values are on another scale), and the val curves of each arm at its best value. Below: one
    panel per arm, train loss (a running mean over SWEEP_SMOOTH logged points) per value, val loss as markers."""
    plt = pyplot()
    arms = group_runs(results, "arm", "key")
    cols = 3
    rows = 1 + -(-len(arms) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.8 * rows), squeeze=False)
    finals = {}
    for (arm, key), group in arms.items():
        pts = sorted((lr, m) for (lr,), g in group_runs(group, "lr").items()
                     if (m := seed_stats(g, _val, "val_loss")["val_loss_mean"]) is not None)
        finals[(arm, key)] = pts
    keys = sorted({k for _, k in arms}, key=lambda k: k != "optim.lr")
    for ax, key in zip(axes[0][:2], keys):
        for (arm, k), pts in finals.items():
            if k == key and pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=arm)
        ax.set_xscale("log")
        ax.set_title(f"final val loss against {key}", fontsize=10)
        ax.set_xlabel(key)
        ax.set_ylabel("final val loss")
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    ax = axes[0][2]
    for (arm, key), pts in finals.items():
        if pts:
            best = min(pts, key=lambda p: p[1])[0]
            xs, ys = mean_curve([r for r in arms[(arm, key)] if r.run.label("lr") == best], "val_loss")
            if xs:
                ax.plot(xs, ys, marker=".", label=f"{arm} ({best:g})")
    ax.set_title("val loss at each arm's best value", fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel("val loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    for ax in list(axes[0][len(keys):2]) + list(axes.flat[cols + len(arms):]):
        ax.axis("off")
    for ax, ((arm, key), group) in zip(axes.flat[cols:], arms.items()):
        for (lr,), g in sorted(group_runs(group, "lr").items()):
            xs, ys = mean_curve(g, "train_loss")
            if xs:
                k = min(SWEEP_SMOOTH, len(ys))
                sm = [statistics.fmean(ys[max(0, i - k + 1):i + 1]) for i in range(len(ys))]
                line, = ax.plot(xs, sm, label=f"{lr:g}")
                vx, vy = mean_curve(g, "val_loss")
                ax.plot(vx, vy, marker="o", linestyle="none", color=line.get_color())
        ax.set_title(f"{arm}: train loss (mean of {SWEEP_SMOOTH} logged), val (dots)", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, title=key, title_fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


register(Study(
    "lr_sweep", "Learning-rate sweep: each optimizer arm at three values about 3x apart (one seed)",
    "Lion (Chen et al.) §5 and Lion Cub §4 tune the learning rate per optimizer (Lion's 3-10x below AdamW's); "
    "Dion §3 tunes Dion's and Muon's over 0.01-0.05. Not a paper figure: the lr each comparison's arm runs at.",
    quick=quick_scale(4), full=full_scale(300), seeds=[SWEEP_SEED], quick_seeds=[SWEEP_SEED],
    build=lr_sweep_runs, summarize=lr_sweep_summary, plot=lr_sweep_plot, outputs=lr_sweep_best,
    extend=lr_sweep_extend, lr_from_sweep=False))


# ---------------------------------------------------------------------------------------------
# DiLoCo and Streaming DiLoCo against the synchronous baselines, at the longer horizon

# (arm, preset, parallel.shard_size): at P = 4, S = 1 makes four workers of one rank, S = 2 two workers of two
# (an FSDP group each; the pseudo-gradient averages cross the replicate axis, FSDP's traffic stays in the group)
DILOCO_ARMS = (("diloco_h10_s1", "diloco_h10", 1), ("diloco_h10_s2", "diloco_h10", 2),
               ("diloco_h50_s1", "diloco_h50", 1), ("diloco_h50_s2", "diloco_h50", 2),
               ("streaming_s1", "streaming_diloco", 1), ("streaming_s2", "streaming_diloco", 2))
# the synchronous baselines at S = 1: horizon's runs (horizon_run), so the two studies train them once
DILOCO_BASELINES = ("adamw_fp32", "fp32", "1bit", "8bit_l1", "dion_r0.0625_ef1")
DILOCO_REFERENCE = "adamw_fp32"    # the synchronous run DiLoCo's inner optimizer is: every Δ is paired with it
OUTER_LR_KEY = "comm.diloco.outer_lr"
OUTER_LRS = (0.3, 0.7, 1.0)        # swept per DiLoCo arm on SWEEP_SEED; the three seeds run at the best
# run too (full scale) when the best of OUTER_LRS is its lowest: a best at the grid's edge says only that the best
# lies there or below (at H = 10, outer Nesterov momentum 0.9 multiplies each averaged step about tenfold). Not
# past the upper edge: DiLoCo's outer lr stays <= 1 (plain averaging at momentum 0); a best at 1.0 is flagged.
OUTER_LR_BELOW = 0.1
DILOCO_QUICK = ("diloco_h10_s1",)  # --quick (2 ranks): one arm at S = 1, its sweep, AdamW beside it ...
QUICK_INNER = ("comm.diloco.inner_steps=3",)  # ... with outer steps inside its 6 steps
DILOCO_LINKS = ("100mbit", "1gbit")  # time to loss measured under bench.netsim (two simulated nodes)
# time to loss predicted for two real cluster shapes (bench.time_to_loss --cluster; the shapes of its committed
# study-prose table, docs/results/time_to_loss/study_prose_predicted)
DILOCO_CLUSTERS = ("nodes=2 gpus_per_node=8 gpu=h100 inter=10gbit intra=nvlink",
                   "nodes=4 gpus_per_node=8 gpu=h100 inter=100gbit intra=nvlink")
DILOCO_TTL_DIR = "diloco_time_to_loss"   # under the results directory: target_<t>/ per target (bench.time_to_loss's
# --out) and breakdown/ (the step times both commands measure and read)


def _diloco_arm(arm: str) -> tuple[str, int]:
    return next((preset, s) for a, preset, s in DILOCO_ARMS if a == arm)


def diloco_run(arm: str, outer_lr: float, scale: Scale, seed: int, role: str) -> Run:
    """A DiLoCo arm's run at one outer lr; role "sweep" (the outer-lr sweep's seed) or "compare" (a comparison
    seed, at the sweep's best outer lr)."""
    preset, shard = _diloco_arm(arm)
    ov = (f"{OUTER_LR_KEY}={outer_lr:g}", *((f"parallel.shard_size={shard}",) if shard > 1 else ()),
          *(QUICK_INNER if scale.quick else ()))
    return Run(run_name(f"{arm}_outer{outer_lr:g}", scale.nproc, seed), variant(preset), ov, seed, scale.nproc,
               (("arm", arm), ("outer_lr", outer_lr), ("role", role), ("shard", shard)))


def diloco_arms(scale: Scale) -> list[str]:
    return [a for a, _, _ in DILOCO_ARMS if not scale.quick or a in DILOCO_QUICK]


def diloco_runs(scale: Scale, seeds: list[int], opts: Options) -> list[Run]:
    """The baselines (horizon's runs, relabelled: labels are not part of a run's spec) at every seed, and each
    DiLoCo arm's outer-lr sweep at SWEEP_SEED; the comparison seeds' DiLoCo runs follow the sweep (diloco_extend)."""
    baselines = (DILOCO_REFERENCE,) if scale.quick else DILOCO_BASELINES
    base = [replace(r, labels=(("arm", arm), ("role", "compare"), ("shard", 1)))
            for arm in baselines for seed in seeds for r in [horizon_run(arm, scale, seed)]]
    return base + [diloco_run(arm, lr, scale, SWEEP_SEED, "sweep") for arm in diloco_arms(scale) for lr in OUTER_LRS]


def _outer_sweep(results: Sequence[RunResult]) -> dict[str, dict[float, RunResult]]:
    """arm -> {outer lr: its sweep run's result}."""
    return {arm: {r.run.label("outer_lr"): r for r in group}
            for (arm,), group in group_runs([r for r in results if r.run.label("role") == "sweep"], "arm").items()}


def _outer_ran(r: RunResult | None) -> bool:
    """Finished, or diverged (train.on_nonfinite stopped it: a result, worse than any finished value). Not
    absent, pending, NOT_RUN, stopped by a signal or crashed: those leave the arm undecided (a stopped or
    crashed run says nothing of its outer lr, and taking it as worse would run the comparison seeds at the
    runner-up)."""
    return r is not None and (r.ok or r.diverged)


def _outer_best(by: dict[float, RunResult], values: Sequence[float]) -> float | None:
    vals = {lr: _val(by[lr]) for lr in values if by[lr].ok and _val(by[lr]) is not None}
    return min(vals, key=vals.get) if vals else None


def _needs_below(by: dict[float, RunResult]) -> bool:
    """The grid ran and its best is its lowest value: OUTER_LR_BELOW decides (full scale)."""
    return all(_outer_ran(by.get(lr)) for lr in OUTER_LRS) and _outer_best(by, OUTER_LRS) == min(OUTER_LRS)


def outer_lr_choice(results: Sequence[RunResult], extend: bool = True) -> dict[str, float | None]:
    """Each DiLoCo arm's best outer lr (lowest final val loss at the sweep seed), or None while undecided: a value
    of the grid not run yet (absent, pending, NOT_RUN under --report-only, stopped or crashed), or, with `extend`
    (full scale), a best at the grid's lower edge whose OUTER_LR_BELOW run has not run. A diverged run counts as
    worse."""
    out: dict[str, float | None] = {}
    for arm, by in _outer_sweep(results).items():
        if not all(_outer_ran(by.get(lr)) for lr in OUTER_LRS):
            out[arm] = None
            continue
        out[arm] = _outer_best(by, OUTER_LRS)
        if extend and _needs_below(by):
            out[arm] = _outer_best(by, (*OUTER_LRS, OUTER_LR_BELOW)) if _outer_ran(by.get(OUTER_LR_BELOW)) else None
    return out


def diloco_extend(results: list[RunResult], scale: Scale, seeds: list[int], opts: Options) -> list[Run]:
    """The OUTER_LR_BELOW sweep run of every arm whose grid finished with its best at the lowest value (full
    scale), and the comparison seeds of every arm whose sweep has decided, at its best outer lr."""
    extend = not scale.quick
    more = [diloco_run(arm, OUTER_LR_BELOW, scale, SWEEP_SEED, "sweep") for arm, by in _outer_sweep(results).items()
            if extend and OUTER_LR_BELOW not in by and _needs_below(by)]
    return more + [diloco_run(arm, lr, scale, seed, "compare")
                   for arm, lr in outer_lr_choice(results, extend).items() if lr is not None for seed in seeds]


def diloco_awaiting(results: list[RunResult], scale: Scale, seeds: list[int], opts: Options) -> list[Run]:
    """--plan: stand-ins for the comparison runs of the arms whose sweep has not decided (named 'outerbest')."""
    chosen = outer_lr_choice(results, not scale.quick)
    return [replace(r, name=r.name.replace(f"_outer{OUTER_LRS[0]:g}_", "_outerbest_"))
            for arm in diloco_arms(scale) if chosen.get(arm) is None
            for seed in seeds for r in [diloco_run(arm, OUTER_LRS[0], scale, seed, "compare")]]


def slow_axis_bytes(r: RunResult) -> float | None:
    """Bytes a rank handed to the collectives of the replicate axis (the slow one: between workers) over the run,
    from the train records' comm_bytes (a record's value is the mean per step of its window): sum of value x
    window length, plus what the end of training sent (the finish record's finish_comm_bytes: a local-update
    scheme's averages still in flight). FSDP's traffic inside a shard group is not in comm_bytes."""
    pts: list[tuple[int, float]] = []
    for x in r.records:
        if x.get("event") == "resume" and "step" in x:   # a stop's records past its checkpoint were trained again
            pts = [p for p in pts if p[0] <= x["step"]]
        elif "comm_bytes" in x and "step" in x:
            pts.append((x["step"], x["comm_bytes"]))
    if not pts:
        return None
    total, prev = float(sum(x.get("finish_comm_bytes", 0) for x in r.records)), 0
    for step, b in sorted(pts):
        total += b * (step - prev)
        prev = step
    return total


def slow_axis_bytes_per_step(r: RunResult) -> float | None:
    """slow_axis_bytes over the steps the train records cover."""
    total, steps = slow_axis_bytes(r), max((x["step"] for x in r.records if "comm_bytes" in x), default=0)
    return total / steps if total is not None and steps else None


def _workers(r: RunResult) -> str:
    s = r.run.label("shard", 1)
    return f"{r.run.nproc // s} x {s}"


def ttl_name(run: Run) -> str:
    """The arm's variant in the time-to-loss table: its preset, with its shard size as the variant's own override
    where it is sharded (bench.time_to_loss's name@key=value), so both shard sizes share one table and one time
    axis."""
    s = run.label("shard", 1)
    return preset_of(run) + (f"@parallel.shard_size={s}" if s > 1 else "")


def ttl_command(curves: dict[str, list[Path]], target: float, setting: str, out: Path, breakdown: Path) -> list[str]:
    """The bench.time_to_loss command that times `curves` (variant name, ttl_name -> its seeds' run-store entries)
    to `target`: measured at DILOCO_LINKS on two simulated nodes from bench.step_breakdown runs in `breakdown`
    (--measure runs the missing ones: root needed; the commands of both targets share it), predicted for
    DILOCO_CLUSTERS; written into `out`."""
    rel = lambda p: os.path.relpath(p, ROOT)  # noqa: E731
    st = SETTINGS.get(setting.split("+")[0])
    return ["python", "-m", "bench.time_to_loss", "--setting", setting.split("+")[0], "--variants", *curves,
            *(x for v, ps in curves.items() for x in ("--run", f"{v}={','.join(rel(p) for p in ps)}")),
            "--target", repr(float(target)), "--link", ",".join(DILOCO_LINKS), "--nodes", "2", "--nproc", "4",
            "--breakdown", rel(breakdown), "--measure", *(x for c in DILOCO_CLUSTERS for x in ("--cluster", c)),
            *(("--vocab-size", str(st.vocab)) if st and st.vocab else ()), "--out", rel(out)]


def ttl_cells(out: Path, argv: list[str], equal_time: bool = True) -> tuple[dict[tuple[str, str], str], str]:
    """{(variant, setting): cell} from bench.time_to_loss's results.csv in `out`, when its meta.json records the
    command `argv` (else the results are of other runs or another target: none, and why). With `equal_time`,
    a cell carries the curve's loss at equal time after a '·'."""
    meta, res = out / "meta.json", out / "results.csv"
    if not (meta.is_file() and res.is_file()):
        return {}, "not computed"
    if json.loads(meta.read_text()).get("argv") != argv[3:]:
        return {}, "stale (computed from other runs)"
    cells = {}
    for row in csv.DictReader(open(res)):
        if row.get("missing"):
            what = "not measured" if row["setting"].startswith("(a)") else "not predicted"
            cells[(row["variant"], row["setting"])] = f"{what}: {row['missing']}"
        else:
            cell = _fmt_seconds(float(row["target_s"])) if row.get("target_s") else "not reached"
            if equal_time and row.get("budget_loss") and row.get("budget_s"):   # the same curve at equal time
                cell += f" · {float(row['budget_loss']):.3f} at {_fmt_seconds(float(row['budget_s']))}"
            cells[(row["variant"], row["setting"])] = cell
    return cells, ""


def _fmt_seconds(x: float) -> str:
    return f"{x / 3600:.2f} h" if x >= 7200 else f"{x / 60:.1f} min" if x >= 120 else f"{x:.2f} s"


# the two targets of the time-to-loss table: AdamW's final val loss (the issue's default: few arms reach it), and
# the loosest final of the arms in the table (every arm reaches it: a ranking of all of them)
TTL_TARGETS = ("adamw", "all")
TTL_TABLE = ("Time to loss (bench.time_to_loss; measured = step time under the simulator x the unsimulated curve's "
             "crossing step; predicted = the cluster's modelled step time):")
SWEEP_TABLE = ("Outer-lr sweep (one seed; a gap below AdamW's spread over seeds says the sweep did not separate "
               "those values):")


def ttl_settings(target: str = TTL_TARGETS[0]) -> list[tuple[str, str]]:
    """(key, the row's `setting` in bench.time_to_loss's results.csv) of each time-to-loss column of a target."""
    return ([(f"ttl_{target}_{link}", f"(a) this machine, simulated link {link}") for link in DILOCO_LINKS]
            + [(f"ttl_{target}_cluster{i}", f"(b) cluster {c}") for i, c in enumerate(DILOCO_CLUSTERS, 1)])


def _config(r: RunResult, scale: Scale) -> dict:
    """The run's resolved config as config.yaml spells it: its recorded one, or resolved now."""
    return r.config or run_config(r.run, scale).to_dict()


def node_port_bytes(r: RunResult, scale: Scale) -> float | None:
    """Bytes through each node's port per step on the two simulated nodes the study's time to loss measures
    (bench.time_to_loss.node_port_bytes: the registry's cost model), for the run's config; None where the
    model cannot say (its mode unknown here)."""
    st = SETTINGS.get(scale.setting.split("+")[0])
    try:
        return time_to_loss.node_port_bytes(_config(r, scale), 2, max(1, r.run.nproc // 2), st.vocab if st else None)
    except (ValueError, KeyError) as e:
        print(f"note: {r.run.name}: bytes between nodes not modelled ({str(e).splitlines()[0]})", file=sys.stderr)
        return None


def diloco_summary(results: list[RunResult], scale: Scale) -> Summary:
    chosen = outer_lr_choice(results, not scale.quick)
    compare = [r for r in results if r.run.label("role") == "compare"
               and (r.run.label("outer_lr") is None or r.run.label("outer_lr") == chosen.get(r.run.label("arm")))]
    groups = group_runs(compare, "arm")
    ref = groups.get((DILOCO_REFERENCE,), [])
    ref_stats = seed_stats(ref, _val, "v")
    target = ref_stats["v_mean"]
    rows = []
    present = {r.run.label("arm") for r in results}
    for arm in [a for a in (*DILOCO_BASELINES, *(a for a, _, _ in DILOCO_ARMS)) if a in present]:
        group = groups.get((arm,), [])
        sweep = [r for r in results if r.run.label("role") == "sweep" and r.run.label("arm") == arm]
        # the row is its comparison runs; the sweep's own failures are in the sweep's table
        status = (status_of(group) if group else f"interim: outer lr not chosen yet (sweep: {status_of(sweep)})"
                  if sweep else "not run")
        first = (group or sweep)[0] if group or sweep else None
        row = {"arm": arm, "kind": "baseline" if arm in DILOCO_BASELINES else "DiLoCo",
               "workers": _workers(first) if first else "-", "outer_lr": chosen.get(arm), "status": status,
               **seed_stats(group, _val, "val_loss"), "tokens": max((tokens_read(r) or 0 for r in group if r.ok),
                                                                   default=None) or None,
               **seed_stats(group, slow_axis_bytes, "bytes"), "bytes_per_step":
               seed_stats(group, slow_axis_bytes_per_step, "b")["b_mean"],
               # seeds that ran and are left out of the means: named in the finding
               "dropped": [f"s{r.run.seed}: {r.status}" for r in group
                           if not r.ok and not r.status.startswith(NOT_RUN)]}
        if first is not None and not scale.quick:
            row["port_bytes"] = node_port_bytes(first, scale)
            h = ((_config(first, scale).get("comm") or {}).get("diloco") or {}).get("inner_steps")
            if row["kind"] == "DiLoCo" and row["port_bytes"] is not None and h:
                row["port_bytes_cycle"] = row["port_bytes"] * h
        if arm != DILOCO_REFERENCE:
            row.update(paired_stats(group, ref, _val, "delta"))
            n, sd = row["delta_n"], row["delta_std"]
            row["delta_ci"] = T_CRIT_5[min(n - 1, 9)] * sd / n ** 0.5 if n >= 2 and sd is not None else None
            row["verdict"] = paired_verdict(row["delta_n"], row["delta_t"], row["status"])
        rows.append(row)
    ref_row = next((r for r in rows if r["arm"] == DILOCO_REFERENCE), {})
    for r in rows:
        r["bytes_vs_ref"] = (ref_row["bytes_per_step"] / r["bytes_per_step"]
                             if ref_row.get("bytes_per_step") and r["bytes_per_step"] else None)
        r["port_vs_ref"] = (ref_row["port_bytes"] / r["port_bytes"]
                            if ref_row.get("port_bytes") and r.get("port_bytes") else None)

    # time to loss: bench.time_to_loss over the stored runs of every arm whose seeds are all stored, in one table
    # (both shard sizes: one time axis, one equal time), at two targets (TTL_TARGETS)
    notes, commands, ttl_rows = [], [], []
    stored = {arm: [r.entry for r in g if r.ok and r.entry is not None] for (arm,), g in groups.items()}
    where = next((r.entry.parent.parent for r in compare if r.entry is not None), None)
    curves, name_of = {}, {}
    for (arm,), g in groups.items():
        name_of[arm] = ttl_name(g[0].run)
        if stored.get(arm) and len(stored[arm]) == len(g):
            curves[name_of[arm]] = stored[arm]
    in_table = [r for r in rows if name_of.get(r["arm"]) in curves and r["val_loss_mean"] is not None]
    loosest = max((r["val_loss_mean"] for r in in_table), default=None)
    # the loosest final needs no AdamW run; where AdamW's own is the loosest, the second target is the first
    targets = {"adamw": target, "all": loosest if loosest is not None and (target is None or loosest > target)
               else None}
    why: dict[str, str] = {}
    if where is not None and curves and not scale.quick:
        base = where / DILOCO_TTL_DIR
        for tkey, value in targets.items():
            if value is None:
                continue
            cmd = ttl_command(curves, value, scale.setting, base / f"target_{tkey}", base / "breakdown")
            commands.append(shlex.join(cmd))
            cells, why[tkey] = ttl_cells(base / f"target_{tkey}", cmd, equal_time=tkey == TTL_TARGETS[0])
            for r in rows:
                for key, setting in ttl_settings(tkey):
                    g = groups.get((r["arm"],), [])
                    if name_of.get(r["arm"]) in curves:
                        r[key] = cells.get((name_of[r["arm"]], setting), why[tkey] or "not in its results")
                    elif g and not any(x.status.startswith(NOT_RUN) for x in g):  # ran, but not every seed stored
                        r[key] = f"not timed: {len(stored.get(r['arm'], []))} of {len(g)} seeds stored"
    for r in rows:
        for tkey in TTL_TARGETS:
            for key, _ in ttl_settings(tkey):
                r.setdefault(key, "not computed" if targets[tkey] is not None and r["val_loss_n"] else "-")
    # long reasons go below the table, the cell says what kind
    reasons: dict[str, list[str]] = {}
    for r in rows:
        for tkey in TTL_TARGETS:
            for key, _ in ttl_settings(tkey):
                head, sep, tail = str(r[key]).partition(": ")
                if sep and head in ("not measured", "not predicted"):
                    reasons.setdefault(tail, []).append(f"{r['arm']} ({key.removeprefix('ttl_')})")
                    r[key] = head

    sweep_rows = []
    noise = ref_stats["v_std"]
    for (arm,), g in group_runs([r for r in results if r.run.label("role") == "sweep"], "arm").items():
        best = min((_val(r) for r in g if r.ok and _val(r) is not None), default=None)
        for r in sorted(g, key=lambda x: x.run.label("outer_lr")):
            gap = _val(r) - best if r.ok and best is not None and _val(r) is not None else None
            sweep_rows.append({"arm": arm, "outer_lr": r.run.label("outer_lr"), "val": _val(r) if r.ok else None,
                               "gap": gap, "best": "best" if chosen.get(arm) == r.run.label("outer_lr") else "",
                               "edge": "edge" if chosen.get(arm) == r.run.label("outer_lr")
                               and chosen.get(arm) in (min(x.run.label("outer_lr") for x in g), max(OUTER_LRS))
                               else "",
                               "noise": "within seed noise" if gap and noise is not None and gap < noise else "",
                               "status": "not trained yet" if r.status.startswith(NOT_RUN) else r.status})

    def ttl_header(tkey: str, setting: str) -> str:
        where_ = (f"{setting.rsplit(' ', 1)[1]} simulated (measured step time)" if setting.startswith("(a)") else
                  f"{setting.removeprefix('(b) cluster ')} (predicted)")
        value = targets[tkey]
        return (f"to {value:.4f} ({'AdamW' if tkey == 'adamw' else 'every arm'}), {where_}" if value is not None
                else f"to {'AdamW' if tkey == 'adamw' else 'every arm'}'s target, {where_}")

    ttl_cols = [Column("arm", "arm", align="left"), Column("workers", "workers x ranks", align="left"),
                *(Column(key, ttl_header(tkey, setting), align="left")
                  for tkey in TTL_TARGETS for key, setting in ttl_settings(tkey))]
    cols = [Column("arm", "arm", align="left"), Column("kind", "kind", align="left"),
            Column("workers", "workers x ranks", align="left"), Column("outer_lr", "outer lr (swept)", ".1f"),
            Column("val_loss_mean", "final val loss"), Column("val_loss_std", "± std"),
            Column("val_loss_n", "seeds", "d"), Column("tokens", "train tokens per run", ",d"),
            Column("delta_mean", f"Δ vs {DILOCO_REFERENCE} (paired)", "+.4f"), Column("delta_std", "± std", ".4f"),
            Column("delta_ci", "95 % CI ±", ".4f"), Column("delta_t", "paired t", ".1f"),
            Column("verdict", "verdict (5 %)", align="left"),
            Column("port_bytes", "between nodes: bytes / node / step (cost model)", ",.0f"),
            Column("port_vs_ref", f"÷ {DILOCO_REFERENCE}'s", ".1f"),
            Column("port_bytes_cycle", "… / cycle of H inner steps", ",.0f"),
            Column("bytes_per_step", "handed to slow-axis collectives / rank / step (counted)", ",.0f"),
            Column("status", "status", align="left"),
            Column("bytes_vs_ref", f"counted ÷ {DILOCO_REFERENCE}'s", md=False),
            Column("bytes_mean", "slow-axis bytes / rank / run", md=False),
            *(Column(key, ttl_header(tkey, setting), md=False)
              for tkey in TTL_TARGETS for key, setting in ttl_settings(tkey))]
    notes.append(
        f"{scale.steps} steps at P = {scale.nproc}, every arm reading the same training tokens (equal tokens: the "
        f"same global batch and steps), up to {max((r['val_loss_n'] for r in rows), default=0)} seeds each. DiLoCo arms: the inner AdamW at AdamW's lr (its best from "
        f"the lr sweep under --lr from-sweep), the outer lr swept over {', '.join(map(str, OUTER_LRS))} on one seed "
        f"({SWEEP_SEED}, not a comparison seed, as the lr sweep does) and the comparison seeds run at the best "
        f"(table below); a best at the grid's lowest value adds a run at {OUTER_LR_BELOW:g} (full scale), and a best at the edge of what ran is flagged there. workers x ranks: 4 x 1 is four DiLoCo workers, "
        "2 x 2 two workers of two ranks (parallel.shard_size=2). Δ: final val loss minus AdamW's at the same seed; "
        "95 % CI: the half width of Δ's t interval (pairs - 1 degrees of freedom); verdict: the paired t against "
        "the 5 % two-sided critical value. 'not significant' says the test found no difference, not that the arms "
        "are equal: with three pairs only a difference well outside the interval would show.")
    notes.append(
        "Bytes between nodes: what crosses the slow links, the study's two nodes of two ranks each (the simulator's "
        "layout), per node's port and step, from the registry's cost model for each arm's config "
        "(bench.time_to_loss.node_port_bytes): a ring allreduce of B bytes per rank over 4 ranks on 2 nodes moves "
        "1.5 B through each port; 2 workers of 2 ranks (S = 2) run two rings of 2 (one per shard) whose B / 2 each "
        "share the port, B in all; a DiLoCo cycle's exchange is spread over its H inner steps (… / cycle: the "
        "whole exchange). So against AdamW a 2 x 2 fp32 arm saves 1.5 H, a 4 x 1 arm H. Handed to the slow-axis "
        "collectives: what a rank gave the collectives across workers (the replicate axis) over the run, counted "
        "(the train records' comm_bytes and the finish record's, the averages still in flight at the end), divided "
        "by the steps; FSDP's traffic inside a worker (S = 2) is on the fast axis and in neither column. The "
        "counted column is not the traffic between nodes (a rank of a 2 x 2 arm hands over half the model).")
    loosest_text = (f"the loosest final of the arms in the table ({targets['all']:.4f}: every arm reaches it). "
                    if targets["all"] is not None else
                    "the loosest final of the arms in the table (AdamW's own: every other arm ends below it; no "
                    "second table). " if loosest is not None else "the loosest final of the arms in the table. ")
    target_line = (f"Time to loss (table below): the time each arm's mean val-loss curve needs to reach a target, "
                   f"by bench.time_to_loss over the stored runs (its arithmetic: crossing step x step time), at two "
                   + (f"targets: AdamW's final val loss ({target:.4f}; few arms reach it) and " if target is not None
                      else "targets: AdamW's final val loss (no finished AdamW run yet: not computed) and ")
                   + loosest_text
                   + "Both shard sizes are one table: S = 2 arms are their variant @parallel.shard_size=2. "
                   "Measured: step times from bench.step_breakdown runs under bench.netsim on two simulated "
                   "nodes at each link, of the step each arm trained (time_to_loss's --measure times an arm whose "
                   "step-shaping settings differ from its variant file, Dion at rank 1/16, as variant@key=value; "
                   "lrs and the outer lr do not shape a step and are not compared; a run of another step is "
                   "'not measured'; measuring needs root); the curve is the unsimulated run's. A target reached at "
                   "the first evaluation (step 200) is reported there: an upper bound. After '·' (AdamW's target's "
                   "columns): the arm's val loss at equal time, when the quickest whole run of the table ends, read "
                   "from its curve between evaluations (bench.time_to_loss's last column; a DiLoCo curve at its "
                   "outer steps). Predicted: compute from FLOPs and the GPU check's MFU, communication from "
                   "the registry's cost model, on the cluster's GPUs (the curves are the 4-worker runs'; DiLoCo's "
                   "numerics at the cluster's worker count may differ; a sharded arm's workers are the cluster's "
                   "ranks / 2, with FSDP's traffic inside each node's shard groups booked exposed). ")
    notes.append(
        "Evaluations read each arm's global model. DiLoCo's (H = 10, 50) fall on its outer steps; Streaming "
        "DiLoCo's (H = 50, F = 2, tau = 1: fragment 0 sent after steps 25, 75, ..., fragment 1 after 50, 100, ..., "
        "each applied one step later) see fragment 0 as of 25 steps before and fragment 1 as of 50 before at "
        "steps 200-1,000, so its curve there lags by that much. Its final model holds every step: the end of "
        "training averages in each fragment's steps since its last send (comm.diloco.final_average; fragment 0's "
        "last 25), one fragment's bytes more, counted in its finish record.")
    notes.append(target_line + ("Commands (rerun the study with --report-only afterwards to fill the columns): "
                                + " ; ".join(f"`{c}`" for c in commands) if commands else
                                "Not computed in quick mode." if scale.quick else
                                "No command yet: no arm has all its runs stored." if not curves else
                                "No command yet: no target (no finished AdamW run, and no other arm's final)."))
    if reasons:
        notes.append("Why a time-to-loss cell is empty: " + "; ".join(f"{', '.join(w)}: {t}"
                                                                      for t, w in reasons.items()) + ".")
    notes.append(diloco_finding(rows))
    sweep_table = markdown_table(sweep_rows, [Column("arm", "arm", align="left"), Column("outer_lr", "outer lr", ".1f"),
                                              Column("val", f"final val loss (seed {SWEEP_SEED})"),
                                              Column("gap", "above the arm's best", "+.4f"),
                                              Column("best", "best", align="left"),
                                              Column("edge", "at grid edge", align="left"),
                                              Column("noise", (f"gap < AdamW's seed std ({noise:.4f})" if noise
                                                               else "gap < AdamW's seed std"), align="left"),
                                              Column("status", "status", align="left")])
    extra = [(SWEEP_TABLE, sweep_table)]
    if not scale.quick:
        extra.insert(0, (TTL_TABLE, markdown_table(rows, ttl_cols)))
    return Summary(rows, cols, notes, extra_tables=extra)


def diloco_finding(rows: Sequence[dict]) -> str:
    """DiLoCo's own finding against ours, arm by arm, from the rows (nothing said of an arm without pairs): each
    arm's Δ with its interval and pairs, the seeds left out, and its bytes between nodes against AdamW's."""
    said = []
    for r in rows:
        if r["kind"] == "DiLoCo" and r.get("delta_n", 0) >= 2:
            ci = f" ± {r['delta_ci']:.4f}" if r.get("delta_ci") is not None else ""
            left = f"; left out: {', '.join(r['dropped'])}" if r.get("dropped") else ""
            said.append(f"{r['arm']} ({r['workers']}): Δ {r['delta_mean']:+.4f}{ci} over {r['delta_n']} pairs "
                        f"({r['verdict']}{left}), "
                        + (f"{r['port_vs_ref']:.0f}x fewer bytes between nodes" if r.get("port_vs_ref")
                           else "bytes between nodes -"))
    return ("DiLoCo's finding (Douillard et al. 2023, abstract and §3): with 8 workers and H = 500 inner steps it "
            "matches fully synchronous training while communicating 500x less. Ours differ in the worker count "
            "(4, or 2 workers of 2 ranks), in H (10 and 50: a 1,200-step run has 120 or 24 outer steps), in the length of training and the model size. "
            + ("Here: " + "; ".join(said) + "." if said else "No DiLoCo arm has two paired seeds yet."))


def diloco_plot(results: list[RunResult], path: Path) -> None:
    quick = any(set(QUICK_INNER) <= set(r.run.overrides) for r in results)  # --quick's runs: no sweep extension
    chosen = outer_lr_choice(results, not quick)
    compare = [r for r in results if r.run.label("role") == "compare"
               and (r.run.label("outer_lr") is None or r.run.label("outer_lr") == chosen.get(r.run.label("arm")))]
    _loss_panels(compare, path, None, "arm", "DiLoCo / Streaming DiLoCo vs synchronous baselines (mean over seeds)")


register(Study(
    "diloco", "DiLoCo (H = 10, 50) and Streaming DiLoCo against AdamW, Lion, Lion Cub 1-bit / 8-bit L1 and Dion "
              "1/16 at the longer horizon, 4 ranks as 4 workers or 2 workers of 2 (run it with --setting "
              "study-prose-1200)",
    "DiLoCo (Douillard et al. 2023), abstract and §3: 8 workers with H = 500 inner steps match fully synchronous "
    "training while communicating 500x less. Streaming DiLoCo (Douillard et al. 2025): fragments synchronised on "
    "staggered schedules, overlapped with computation, with 4-bit pseudo-gradients, keep that quality at a lower "
    "peak bandwidth.",
    # horizon's scale (no diagnostics): its baseline runs are these runs (same name and spec), trained once
    quick=quick_scale(6), full=full_scale(300), seeds=FULL_SEEDS, quick_seeds=QUICK_SEEDS,
    build=diloco_runs, summarize=diloco_summary, plot=diloco_plot, extend=diloco_extend, awaiting=diloco_awaiting,
    # --lr from-sweep: the inner optimizer is the adamw_fp32 recipe, so it runs at AdamW's best lr
    lr_alias={preset: DILOCO_REFERENCE for _, preset, _ in DILOCO_ARMS}))
