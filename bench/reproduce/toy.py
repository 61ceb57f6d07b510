"""Lion Cub App. C.1 / Fig. 11 toy: Lp quantizers under Gaussian vs heavy-tailed per-client noise.

A teacher-student MLP on synthetic data (App. C.1), C = 8 clients. Every step each client sees the
exact full-batch gradient g plus its own noise sample, noise = s * rms(g_0) * X with X symmetric
alpha-stable (alpha = 2 is Gaussian, smaller alpha heavier tails; App. C.1 uses alpha = 0.5 for
symmetric Levy noise) and rms(g_0) the root mean square of the initial clean gradient, so that s is
scale-free. Each client's vector is quantized per parameter tensor by the project's own quantizer,
optim.quantize.lp_quantize (Lion Cub §4.2 eq. 1, L = 2^(bits-1) - 1 levels, clip 2, nearest
rounding), and the C messages are aggregated in one of two ways:

  mean  what App. C.1 describes: the clients' *gradients* are quantized, the server averages the
        dequantized values q * clip * M_p / L, and the model takes a plain gradient step.
  vote  what Lion Cub trains with (§3, §4.2, App. F.1): each client keeps its own Lion momentum
        m_i, quantizes its update c_i = b1 m_i + (1 - b1) g_i, and the model moves by
        -lr * sign(sum_i q_i) (an exact tie moves nothing).

References in every grid: fp32 (no quantization: the mean of the noisy gradients, or sign(sum c_i)
= exact Lion with per-client momenta) and, for vote, 1-bit majority vote sign(sum_i sign(c_i))
(Distributed Lion). Loss = full-data MSE / mean(y^2) (1 = predicting 0).

Noise sampler: scipy.stats.levy_stable (beta = 0, scale 1) when scipy is importable; otherwise a
Student-t with alpha degrees of freedom (the same tail index for alpha < 2; Gaussian at alpha = 2).
Outputs name the sampler used.

Known answer (tests): with s = 0 all clients send the same message, every quantizer with L >= 2
sends a nonzero descent direction, and after 400 steps the loss is below 10 % of its start (measured:
at most 7 % for the mean aggregation, 2 % for vote); with L = 1 (2 bits) the L_inf quantizer sends
y = x / (2 max|x|) in [-1/2, 1/2], which rounds (half to even) to 0 for every element, so the model
never moves.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from optim.quantize import levels_for_bits, lp_mean, lp_quantize

from .framework import Column, Options, Study, fmt_ms, loadavg, machine, markdown_table, mean_std, pyplot, register

QUANTIZER_P = {"l0": 0.0, "l1": 1.0, "l2": 2.0, "linf": math.inf}
REFERENCES = ("fp32", "sign")  # fp32: no quantization; sign: 1-bit majority vote (vote only)
AGGREGATORS = ("mean", "vote")


@dataclass
class ToySetup:
    """One toy problem and its optimizer settings (defaults: the full study)."""
    clients: int = 8            # App. C.1: C = 8
    d_in: int = 16
    hidden: int = 32
    samples: int = 512
    steps: int = 400
    noise: float = 0.25         # s: noise scale relative to rms(g_0)
    lr_mean: float = 0.5        # plain gradient step on the averaged dequantized gradients
    lr_vote: float = 0.01       # sign step (Lion's lr scale for an O(1) tanh MLP)
    betas: tuple[float, float] = (0.9, 0.99)
    clip: float = 2.0           # eq. (1)
    rounding: str = "nearest"   # eq. (1)
    min_lr_ratio: float = 0.1   # cosine schedule to this fraction of lr, as the trainer's default
    log_every: int = 5


@dataclass
class ToyResult:
    aggregator: str
    alpha: float
    quantizer: str
    bits: int | None
    seed: int
    steps: list[int] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    diverged: bool = False

    @property
    def final(self) -> float:
        """Mean of the last 10 % of the logged losses (inf if the run diverged)."""
        if self.diverged or not self.loss:
            return math.inf
        k = max(1, len(self.loss) // 10)
        return float(np.mean(self.loss[-k:]))


# ---------------------------------------------------------------------------------------------
# the problem


class Problem:
    """Teacher-student tanh MLP without biases (d_in -> hidden -> 1), flat student parameters,
    full-batch MSE. No biases: a one-element tensor has M_p(x) = |x| for every p, so per-tensor
    quantization would pass its noise through unclipped and hide the quantizers' differences."""

    def __init__(self, setup: ToySetup, seed: int):
        g = torch.Generator().manual_seed(10_000 + seed)
        d, h = setup.d_in, setup.hidden
        self.shapes = [(h, d), (1, h)]
        self.sizes = [math.prod(s) for s in self.shapes]
        self.n = sum(self.sizes)
        self.offsets = np.cumsum([0] + self.sizes).tolist()
        self.x = torch.randn(setup.samples, d, generator=g)
        teacher = self._init(g, gain=2.0)  # gain 2: tanh well into its nonlinear range
        with torch.no_grad():
            self.y = self.forward(teacher, self.x)
        self.y_scale = float(self.y.pow(2).mean())
        self.theta0 = self._init(g, gain=1.0)

    def _init(self, g: torch.Generator, gain: float) -> torch.Tensor:
        return torch.cat([torch.randn(math.prod(s), generator=g) * gain / math.sqrt(s[1]) for s in self.shapes])

    def views(self, theta: torch.Tensor) -> list[torch.Tensor]:
        return [theta[a:b].view(s) for a, b, s in zip(self.offsets, self.offsets[1:], self.shapes)]

    def forward(self, theta: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        w1, w2 = self.views(theta)
        return torch.tanh(x @ w1.T) @ w2.T

    def loss_grad(self, theta: torch.Tensor) -> tuple[float, torch.Tensor]:
        """(relative loss MSE / mean(y^2), gradient of the relative loss)."""
        t = theta.detach().requires_grad_(True)
        loss = (self.forward(t, self.x) - self.y).pow(2).mean() / self.y_scale
        (grad,) = torch.autograd.grad(loss, t)
        return float(loss.detach()), grad

    def segments(self) -> list[tuple[int, int]]:
        return list(zip(self.offsets, self.offsets[1:]))


def noise_sampler() -> str:
    """Which heavy-tailed sampler this environment uses (written into the outputs)."""
    try:
        import scipy.stats  # noqa: F401
        return "scipy.stats.levy_stable"
    except ImportError:
        return "student_t(df=alpha)"


def sample_noise(alpha: float, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Symmetric alpha-stable samples (scale 1) of `shape`, float32; see the module docstring."""
    if not 0 < alpha <= 2:
        raise ValueError(f"alpha={alpha}: a stable law needs 0 < alpha <= 2 (2 = Gaussian)")
    rng = np.random.default_rng(seed)
    if noise_sampler() == "scipy.stats.levy_stable":
        from scipy.stats import levy_stable

        x = levy_stable.rvs(alpha, 0.0, size=shape, random_state=rng)
    elif alpha == 2:
        x = rng.standard_normal(shape) * math.sqrt(2)  # stable(2) with scale 1 has variance 2
    else:
        x = rng.standard_t(alpha, size=shape)
    return torch.from_numpy(np.asarray(x, dtype=np.float32))


# ---------------------------------------------------------------------------------------------
# one run


def _quantize(v: torch.Tensor, segments: list[tuple[int, int]], levels: int, p: float, setup: ToySetup
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor lp_quantize of `v`: (int32 votes, dequantized float values q * clip * M_p / L)."""
    q = torch.empty(v.numel(), dtype=torch.int32)
    deq = torch.empty_like(v)
    for a, b in segments:
        qs = lp_quantize(v[a:b], levels, p, setup.clip, setup.rounding)
        q[a:b] = qs
        deq[a:b] = qs.to(v.dtype) * (setup.clip * lp_mean(v[a:b], p) / levels).to(v.dtype)
    return q, deq


def run_one(problem: Problem, noise: torch.Tensor | None, aggregator: str, quantizer: str, bits: int | None,
            setup: ToySetup, *, alpha: float = 2.0, seed: int = 0) -> ToyResult:
    """Train the student once; `noise` is (steps, clients, n) unit-scale samples or None (s = 0)."""
    if aggregator not in AGGREGATORS:
        raise ValueError(f"aggregator={aggregator!r}; choose one of {AGGREGATORS}")
    if quantizer not in QUANTIZER_P and quantizer not in REFERENCES:
        raise ValueError(f"quantizer={quantizer!r}; choose one of {list(QUANTIZER_P) + list(REFERENCES)}")
    if quantizer == "sign" and aggregator != "vote":
        raise ValueError("quantizer=sign (1-bit majority vote) only exists with aggregator=vote")
    res = ToyResult(aggregator, alpha, quantizer, bits, seed)
    levels = levels_for_bits(bits) if quantizer in QUANTIZER_P else 0
    p = QUANTIZER_P.get(quantizer, 0.0)
    segs = problem.segments()
    theta = problem.theta0.clone()
    b1, b2 = setup.betas
    loss0, g0 = problem.loss_grad(theta)
    scale = setup.noise * float(g0.pow(2).mean().sqrt())
    # without noise every client sends the same message: simulate one (sum = C x one vote, same sign;
    # mean of identical dequantized vectors = that vector)
    C = 1 if noise is None or scale == 0 else setup.clients
    mom = torch.zeros(C, problem.n)
    lr0 = setup.lr_mean if aggregator == "mean" else setup.lr_vote
    for t in range(setup.steps):
        loss, g = problem.loss_grad(theta)
        if t % setup.log_every == 0:
            res.steps.append(t)
            res.loss.append(loss)
        if not math.isfinite(loss) or loss > 1e3 * max(loss0, 1e-12):
            res.diverged = True
            break
        cos = 0.5 * (1 + math.cos(math.pi * t / setup.steps))
        lr = lr0 * (setup.min_lr_ratio + (1 - setup.min_lr_ratio) * cos)
        gi = g.unsqueeze(0) if C == 1 else g + scale * noise[t]
        if aggregator == "mean":
            if quantizer == "fp32":
                step = gi.mean(0)
            else:
                step = torch.stack([_quantize(gi[i], segs, levels, p, setup)[1] for i in range(C)]).mean(0)
        else:
            c = b1 * mom + (1 - b1) * gi
            if quantizer == "fp32":
                total = c.sum(0)
            elif quantizer == "sign":
                total = torch.sign(c).sum(0)
            else:
                total = torch.stack([_quantize(c[i], segs, levels, p, setup)[0] for i in range(C)]).sum(0)
            step = torch.sign(total).to(theta.dtype)
            mom = b2 * mom + (1 - b2) * gi
        theta = theta - lr * step
    else:
        loss, _ = problem.loss_grad(theta)
        res.steps.append(setup.steps)
        res.loss.append(loss)
        res.diverged = not math.isfinite(loss) or loss > 1e3 * max(loss0, 1e-12)
    return res


# ---------------------------------------------------------------------------------------------
# the grid


@dataclass
class ToyGrid:
    alphas: list[float] = field(default_factory=lambda: [2.0, 1.5, 1.0, 0.5])
    quantizers: list[str] = field(default_factory=lambda: ["l0", "l1", "l2", "linf"])
    bits: list[int] = field(default_factory=lambda: [2, 4, 8])
    aggregators: list[str] = field(default_factory=lambda: list(AGGREGATORS))
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])


QUICK_SETUP = ToySetup(steps=60, log_every=5)
QUICK_GRID = ToyGrid(alphas=[2.0, 0.5], quantizers=["l0", "l1", "linf"], bits=[4], seeds=[0])


def grid_cases(grid: ToyGrid) -> Iterable[tuple[str, str, int | None]]:
    """(aggregator, quantizer, bits) of one grid, references first."""
    for agg in grid.aggregators:
        yield agg, "fp32", None
        if agg == "vote":
            yield agg, "sign", 1
        for b in grid.bits:
            for q in grid.quantizers:
                yield agg, q, b


def run_grid(setup: ToySetup, grid: ToyGrid, log=print) -> list[ToyResult]:
    """Every (alpha, seed) noise stream shared by all quantizers (common random numbers)."""
    out: list[ToyResult] = []
    cases = list(grid_cases(grid))
    for seed in grid.seeds:
        problem = Problem(setup, seed)
        for alpha in grid.alphas:
            noise = sample_noise(alpha, (setup.steps, setup.clients, problem.n), seed=1000 * seed + int(100 * alpha))
            for agg, q, b in cases:
                out.append(run_one(problem, noise, agg, q, b, setup, alpha=alpha, seed=seed))
            log(f"toy: seed {seed} alpha {alpha}: {len(cases)} runs done")
    return out


def setup_dict(setup: ToySetup, grid: ToyGrid) -> dict:
    return {"setup": asdict(setup), "grid": asdict(grid), "noise_sampler": noise_sampler()}




# ---------------------------------------------------------------------------------------------
# the study: tables, plot, raw files

ZERO_NOISE_BOUND = 0.1    # known answer: final loss below 10 % of the initial loss with s = 0 and L >= 2 ...
ZERO_NOISE_STEPS = 400    # ... after this many steps (the full study's length, also in quick mode)


def zero_noise_check(setup: ToySetup, grid: ToyGrid, seed: int = 0) -> list[dict]:
    """Every case of the grid with s = 0 and ZERO_NOISE_STEPS steps: final / initial loss, and whether
    it meets the known answer (module docstring)."""
    setup = replace(setup, steps=ZERO_NOISE_STEPS, noise=0.0)
    problem = Problem(setup, seed)
    rows = []
    for agg, q, b in grid_cases(grid):
        r = run_one(problem, None, agg, q, b, setup, seed=seed)
        ratio = r.final / r.loss[0]
        degenerate = q == "linf" and b is not None and levels_for_bits(b) == 1
        rows.append({"aggregator": agg, "quantizer": q, "bits": b, "initial": r.loss[0], "final": r.final,
                     "ratio": ratio, "expected": "no move (all rounded to 0)" if degenerate
                     else f"< {ZERO_NOISE_BOUND:g} x initial",
                     "meets": (ratio == 1.0) if degenerate else ratio < ZERO_NOISE_BOUND})
    return rows


def summarize(results: list[ToyResult], grid: ToyGrid) -> list[dict]:
    """One row per (aggregator, alpha, bits); a column per quantizer: 'mean ± std' or 'div k/n'."""
    cell: dict[tuple, list[ToyResult]] = {}
    for r in results:
        cell.setdefault((r.aggregator, r.alpha, r.quantizer, r.bits), []).append(r)

    def text(rs: list[ToyResult]) -> str:
        div = sum(r.diverged for r in rs)
        m, s, _ = mean_std(r.final for r in rs if not r.diverged)
        return (fmt_ms(m, s, ".4f") if not div else (f"div {div}/{len(rs)}" + (f" (rest {m:.4f})" if m else "")))

    rows = []
    for agg in grid.aggregators:
        for alpha in grid.alphas:
            for b in grid.bits:
                row = {"aggregator": agg, "alpha": alpha, "bits": b, "levels": levels_for_bits(b)}
                for q in ["fp32", "sign", *grid.quantizers]:
                    rs = cell.get((agg, alpha, q, None if q == "fp32" else 1 if q == "sign" else b), [])
                    if rs:
                        m, s, n = mean_std(r.final for r in rs if not r.diverged)
                        row[q] = text(rs)
                        row[f"{q}_mean"], row[f"{q}_std"], row[f"{q}_n"] = m, s, n
                        row[f"{q}_diverged"] = sum(r.diverged for r in rs)
                rows.append(row)
    return rows


def plot(results: list[ToyResult], grid: ToyGrid, path: Path, bits: int) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(len(grid.aggregators), len(grid.alphas),
                             figsize=(4.2 * len(grid.alphas), 3.4 * len(grid.aggregators)), squeeze=False)
    for i, agg in enumerate(grid.aggregators):
        for j, alpha in enumerate(grid.alphas):
            ax = axes[i][j]
            for k, q in enumerate(["fp32", "sign", *grid.quantizers]):
                rs = [r for r in results if r.aggregator == agg and r.alpha == alpha and r.quantizer == q
                      and (q in REFERENCES or r.bits == bits)]
                if not rs:
                    continue
                n = min(len(r.loss) for r in rs)  # a diverged seed ends early: the mean stops there
                ys = np.mean([r.loss[:n] for r in rs], axis=0)
                label = q if q in REFERENCES else f"{q} ({bits} bit)"
                ax.plot(rs[0].steps[:n], ys, color=f"C{k}", ls="--" if q in REFERENCES else "-", label=label)
                if any(r.diverged for r in rs):
                    ax.plot(rs[0].steps[n - 1], ys[-1], "x", color=f"C{k}", ms=8)
            ax.set_yscale("log")
            ax.set_ylim(top=10)
            ax.set_title(f"{agg}, alpha = {alpha}" + (" (Gaussian)" if alpha == 2 else ""), fontsize=10)
            ax.set_xlabel("step")
            ax.set_ylabel("loss (MSE / mean y^2)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("Lion Cub App. C.1 / Fig. 11 toy: Lp quantizers under heavy-tailed noise (x = diverged)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


PAPER = ("Lion Cub App. C.1 / Fig. 11 (teacher-student MLP, C = 8 clients, alpha-stable gradient noise, Lp "
         "quantizers for p in {0.01, 0.1, 1, 10, inf}): the heavier the noise (smaller alpha), the more the standard "
         "L_inf quantizer degrades and the wider its gap to L_0; under Gaussian noise the quantizers are alike. "
         "No numbers are given.")


class ToyStudy(Study):
    """App. C.1 toy: no training through train.py; its own grid (see the module docstring)."""

    def execute(self, opts: Options, echo=print) -> list[Path]:
        import csv
        import json
        import shlex
        import time

        setup = QUICK_SETUP if opts.quick else ToySetup()
        if opts.steps:
            setup = replace(setup, steps=opts.steps)
        grid = replace(QUICK_GRID if opts.quick else ToyGrid())
        if opts.seeds:
            grid.seeds = list(opts.seeds)
        if opts.extra.get("alphas"):
            grid.alphas = list(opts.extra["alphas"])
        if opts.extra.get("bits"):
            grid.bits = list(opts.extra["bits"])
        out = opts.results_dir()
        out.mkdir(parents=True, exist_ok=True)
        load_before, t0, started = loadavg(), time.perf_counter(), time.strftime("%Y-%m-%d %H:%M:%S")
        results = run_grid(setup, grid, log=echo)
        zero = zero_noise_check(setup, grid)
        wall, load_after = time.perf_counter() - t0, loadavg()
        rows = summarize(results, grid)
        qcols = [q for q in ["fp32", "sign", *grid.quantizers] if any(q in r for r in rows)]
        columns = ["aggregator", "alpha", "bits", "levels"]
        columns += [f"{q}_{k}" for q in qcols for k in ("mean", "std", "n", "diverged")]
        paths = [out / "toy.csv", out / "toy.md", out / "toy_runs.jsonl", out / "toy_meta.json", out / "toy.png"]
        with open(paths[0], "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
        with open(paths[2], "w") as f:
            for r in results:
                f.write(json.dumps({"aggregator": r.aggregator, "alpha": r.alpha, "quantizer": r.quantizer,
                                    "bits": r.bits, "seed": r.seed, "diverged": r.diverged,
                                    "final": None if r.diverged else r.final, "steps": r.steps, "loss": r.loss}) + "\n")
            for z in zero:
                f.write(json.dumps({"zero_noise": True, **z}) + "\n")
        meta = {"study": "toy", "command": "python -m bench.reproduce " + shlex.join(opts.argv), "started": started,
                "wall_s": round(wall, 1), "machine": machine(), "load_before": load_before, "load_after": load_after,
                **setup_dict(setup, grid)}
        paths[3].write_text(json.dumps(meta, indent=1) + "\n")
        plot_bits = 4 if 4 in grid.bits else grid.bits[0]
        plot(results, grid, paths[4], plot_bits)
        table_cols = [Column("aggregator", "aggregation", align="left"), Column("alpha", "alpha", ".1f"),
                      Column("bits", "bits", "d"), Column("levels", "L", "d")]
        names = {"fp32": "fp32 (no quant.)", "sign": "1-bit vote"}
        table_cols += [Column(q, names.get(q, q.upper().replace("INF", "inf"))) for q in qcols]
        zero_cols = [Column("aggregator", "aggregation", align="left"), Column("quantizer", "quantizer", align="left"),
                     Column("bits", "bits", "d"), Column("ratio", "final / initial loss", ".4f"),
                     Column("expected", "known answer", align="left"), Column("meets", "meets", align="left")]
        s = setup
        md = [f"# {self.title}", "", f"Paper: {self.paper}", "",
              f"Command: `{meta['command']}`" + (" (quick mode: not a result)" if opts.quick else ""), "",
              f"Final loss (MSE / mean(y^2), mean of the last 10 % of logged steps), mean ± std over seeds "
              f"{grid.seeds}; 'div k/n': k of n seeds diverged (loss > 1000 x initial or non-finite).", "",
              markdown_table(rows, table_cols), "",
              f"Zero noise (known answer, seed 0, {ZERO_NOISE_STEPS} steps): every client sends the same message; "
              "with L >= 2 the largest element always survives rounding, so each step is a descent direction.", "",
              markdown_table(zero, zero_cols), "",
              f"Setting: teacher-student tanh MLP {s.d_in} -> {s.hidden} -> 1 without biases, {s.samples} samples, "
              f"C = {s.clients} clients, {s.steps} steps, noise s = {s.noise} x rms(initial gradient) x "
              f"{noise_sampler()}(alpha, beta = 0); quantization per tensor with optim.quantize.lp_quantize "
              f"(clip {s.clip}, {s.rounding} rounding, L = 2^(bits-1) - 1); mean: gradient step lr {s.lr_mean}, vote: "
              f"Lion (betas {list(s.betas)}) sign step lr {s.lr_vote}; cosine schedule to {s.min_lr_ratio} x lr. "
              f"Every quantizer of one (seed, alpha) sees the same noise samples.",
              f"Machine: {meta['machine']['platform']}, {meta['machine']['cpus_usable']} usable CPUs, torch "
              f"{meta['machine']['torch']}; 1-minute load {load_before and load_before[0]} before, "
              f"{load_after and load_after[0]} after; {wall:.0f} s.",
              "Raw: toy.csv, toy_runs.jsonl (every run's loss curve and the zero-noise checks), toy_meta.json."]
        paths[1].write_text("\n".join(md) + "\n")
        bad = [z for z in zero if not z["meets"]]
        if bad:
            echo(f"toy: {len(bad)} zero-noise case(s) miss the known answer: {bad}")
        return paths


register(ToyStudy("toy", "Lion Cub App. C.1 / Fig. 11 toy: Lp quantizers under Gaussian vs heavy-tailed noise", PAPER))
