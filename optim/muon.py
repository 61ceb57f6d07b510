"""Muon (Jordan et al., as in modded-nanogpt) on the communication-owning base, and what the two
matrix optimizers (Muon, Dion: optim/dion.py) share.

Owns:
  MatrixOptimizer    the split of the trainable parameters into hidden matrices (2-D weights of
                     every role but embedding, head and norm: attn, mlp) and the rest (embedding,
                     head, 1-D), the optimizer of the rest (torch's AdamW kernel or the project's
                     Lion kernels, option `scalar_opt`), the matrix learning rate `matrix_lr`, the
                     per-step byte formula (`wire_bytes_per_step`) and its alpha-beta prediction
  Muon               Muon on the mean gradient, registered as optim.name=muon
  MatrixOptions      the options both share (optim.matrix_lr, optim.scalar_opt)

Muon, one step on every rank (gradient sync: the scheme's fp32/bf16 mean-allreduce of the whole
flat gradient first, so every rank holds the same state and takes the same step):
    m  <- beta m + (1 - beta) g                      momentum (EMA form, modded-nanogpt)
    u  =  (1 - beta) g + beta m  (nesterov)  or  m   the direction orthogonalised
    O  =  newton_schulz(u)                           ~ U V^T of u = U S V^T; bf16 on CUDA, fp32 on CPU
    X  <- (1 - lr wd) X - lr * muon_scale(m, n) * O  decoupled weight decay, shape-aware scale
Every rank orthogonalises every matrix: nothing but the gradient crosses the network
(modded-nanogpt spreads the Newton-Schulz work over the ranks and all-gathers the updates, which
costs a second collective of the same size; on a slow network we keep one).

Learning rates. The common optim.lr (times the embedding/head/scalar multipliers) is the rate of
the AdamW/Lion part, as in modded-nanogpt and microsoft/dion, where the embedding and head run
AdamW at their own rate. optim.matrix_lr is the peak rate of the matrices; the trainer's schedule
(warmup, cosine) scales it by the same factor as optim.lr: lr_matrix(t) = matrix_lr * lr(t) / lr
(the group's rate now over its rate when the optimizer was built). matrix_lr = 0 reuses optim.lr
for the matrices (Moonlight's convention, with scale="rms" so AdamW's lr and weight decay carry
over).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

from comm import cost_model

from . import sync
from .base import CommOptimizer, Entry
from .diagnostics import _aggregate
from .lion import apply_update_, lion_group_step_
from .options import choice
from .orthogonal import MUON_SCALES, NS_STEPS, muon_scale, muon_update
from .registry import OptimizerSpec, OptimOptions, register_optimizer

SCALAR_OPTS = ("adamw", "lion")
NON_MATRIX_ROLES = ("embedding", "head", "norm")


def is_matrix(entry: Entry) -> bool:
    """A hidden matrix: a 2-D weight outside the embedding, the head and the 1-D scalars (Muon and
    Dion are defined for matrices; the embedding and head are left to AdamW/Lion as in
    modded-nanogpt and the Dion paper §3). Parameters of a group without a role count by shape."""
    return entry.param.ndim == 2 and entry.role not in NON_MATRIX_ROLES


@dataclass
class MatrixOptions(OptimOptions):
    """Options shared by the matrix optimizers (muon, dion)."""

    matrix_lr: float = 0.02
    """Peak learning rate of the hidden matrices (attn, mlp); the lr schedule scales it like optim.lr, which
    stays the rate of the embedding, head and 1-D parameters. 0 = use optim.lr. Default 0.02: the middle of the
    Dion paper's Muon/Dion grid (0.01-0.05, §3) and microsoft/dion's GPT configs."""
    scalar_opt: str = "adamw"
    """Optimizer of the embedding, head and 1-D parameters: adamw (torch's kernel; optim.betas, optim.eps) or
    lion (the project's Lion; optim.betas)."""

    def problems(self, world_size: int | None = None) -> list[str]:
        p: list[str] = []
        if not (isinstance(self.matrix_lr, (int, float)) and math.isfinite(self.matrix_lr) and self.matrix_lr >= 0):
            p.append(f"{self.key('matrix_lr')}: {self.matrix_lr} must be a number >= 0 (0 = use optim.lr)")
        choice(p, self.key("scalar_opt"), self.scalar_opt, SCALAR_OPTS)
        return p


@dataclass
class MuonOptions(MatrixOptions):
    """Muon's options (optim.name=muon)."""

    momentum: float = 0.95
    """Muon momentum beta (modded-nanogpt and the Dion paper: 0.95)."""
    nesterov: bool = True
    """Orthogonalise (1 - beta) g + beta m instead of m (modded-nanogpt's Nesterov form)."""
    ns_steps: int = NS_STEPS
    """Newton-Schulz iterations (modded-nanogpt: 5)."""
    scale: str = "shape"
    """Update scale per (fan_out, fan_in) matrix: shape = max(1, fan_out/fan_in)^0.5 (modded-nanogpt), rms =
    0.2 sqrt(max(fan_out, fan_in)) (Moonlight: matches AdamW's update RMS; use with matrix_lr 0)."""

    def problems(self, world_size: int | None = None) -> list[str]:
        p = super().problems(world_size)
        if not (isinstance(self.momentum, (int, float)) and 0.0 <= self.momentum < 1.0):
            p.append(f"{self.key('momentum')}: {self.momentum} must lie in [0, 1) (Muon uses 0.95)")
        if isinstance(self.ns_steps, bool) or not isinstance(self.ns_steps, int) or self.ns_steps < 1:
            p.append(f"{self.key('ns_steps')}: {self.ns_steps!r} must be an int >= 1 (Muon uses {NS_STEPS})")
        choice(p, self.key("scale"), self.scale, MUON_SCALES)
        return p


def _options(cls: type[MatrixOptions], given: MatrixOptions | dict | None) -> MatrixOptions:
    opts = given if isinstance(given, cls) else cls(**(given or {}))
    problems = opts.problems(None)
    if problems:
        raise ValueError("; ".join(problems))
    return opts


class MatrixOptimizer(CommOptimizer):
    """Base of Muon and Dion: hidden matrices get the subclass's update (`_matrix_update`), the
    other parameters AdamW or Lion; lr and weight_decay are read from the param groups every step.

    Subclasses implement `_matrix_update(step)` and may override `_exchanged()` (what crosses the
    network in one step, for the byte formula)."""

    options_class: type[MatrixOptions] = MatrixOptions
    optim_name = "muon"  # a subclass with its own registry entry names it (Dion: "dion")

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, options: MatrixOptions | dict | None = None,
                 scheme: str | sync.SyncScheme = "fp32", **comm_kwargs) -> None:
        name = type(self).__name__
        s = sync.get(scheme) if isinstance(scheme, str) else scheme
        # set before the base runs: a subclass's _grad_order (Dion) reads the options
        self.options = _options(self.options_class, options)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay), scheme=s,
                         **comm_kwargs)
        entries = self.layout.entries
        self.matrix_idx = [k for k, e in enumerate(entries) if is_matrix(e)]
        self.scalar_idx = [k for k, e in enumerate(entries) if not is_matrix(e)]
        for g in self.param_groups:
            g.setdefault("initial_lr", g["lr"])  # the schedule factor of matrix_lr is lr / initial_lr
        if self.options.matrix_lr > 0:
            for k in self.matrix_idx:
                g = self.param_groups[entries[k].group]
                if not g["initial_lr"] > 0:
                    raise ValueError(f"{name}: param group {g.get('role', entries[k].group)!r} holds matrices but has "
                                     f"lr={g['initial_lr']} when built, so the schedule of optim.matrix_lr cannot be "
                                     "derived from it; build the optimizer with the peak lr")
        self.inner = None
        self._inner_index: list[int] = []
        if self.options.scalar_opt == "adamw" and self.scalar_idx:
            groups, scalars = [], set(self.scalar_idx)
            for gi in range(len(self.param_groups)):
                ks = [k for k in self.layout.per_group.get(gi, []) if k in scalars]
                if ks:
                    g = self.param_groups[gi]
                    groups.append({"params": self.layout.params(ks), "lr": g["lr"], "weight_decay": g["weight_decay"]})
                    self._inner_index.append(gi)
            on_cuda = self.layout.device.type == "cuda"
            self.inner = torch.optim.AdamW(groups, betas=tuple(betas), eps=eps,
                                           **({"fused": True} if on_cuda else {"foreach": True}))
        self._diagnose = False
        self._diag_out: dict | None = None

    # ---- learning rates -----------------------------------------------------------------------
    def matrix_lr(self, group: dict) -> float:
        """This step's learning rate of the matrices in `group` (see the module docstring)."""
        if self.options.matrix_lr == 0:
            return float(group["lr"])
        return self.options.matrix_lr * float(group["lr"]) / float(group["initial_lr"])

    def _matrix_groups(self) -> dict[int, list[int]]:
        """Param group -> its matrix entries (layout indices), in layout order."""
        out: dict[int, list[int]] = {}
        for k in self.matrix_idx:
            out.setdefault(self.layout.entries[k].group, []).append(k)
        return out

    # ---- the step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None, *, diagnose: bool = False, **kwargs):
        # the matrix update computes its diagnostics on the fly (Dion: from B before it is
        # overwritten), so it must know whether this step is diagnosed
        self._diagnose = diagnose
        try:
            return super().step(closure, diagnose=diagnose, **kwargs)
        finally:
            self._diagnose = False

    def _update(self, step: int) -> dict | None:
        self._scalar_step()
        return self._matrix_update(step)

    def _matrix_update(self, step: int) -> dict | None:  # pragma: no cover - interface
        raise NotImplementedError

    def _scalar_step(self) -> None:
        """AdamW (torch's kernel, on an inner torch.optim.AdamW) or Lion (optim.lion's kernels) on
        every parameter that is not a hidden matrix, at the group's lr and weight decay."""
        if not self.scalar_idx:
            return
        if self.inner is not None:
            for gi, ig in zip(self._inner_index, self.inner.param_groups):
                ig["lr"] = self.param_groups[gi]["lr"]
                ig["weight_decay"] = self.param_groups[gi]["weight_decay"]
            self.inner.step()
            return
        scalars = set(self.scalar_idx)
        for gi, ks in self.layout.per_group.items():
            ks = [k for k in ks if k in scalars]
            if not ks:
                continue
            lion_group_step_(self.state, self.param_groups[gi], self.layout.params(ks))

    def momentum_of(self, p: torch.nn.Parameter) -> torch.Tensor | None:
        if self.inner is not None and p in self.inner.state:
            return self.inner.state[p].get("exp_avg")
        st = self.state.get(p, {})
        return st.get("momentum", st.get("exp_avg"))

    # ---- bytes and time per step ------------------------------------------------------------------
    # ---- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        sd = super().state_dict()  # matrix state and Lion momenta (self.state), groups, comm
        if self.inner is not None:
            sd["inner"] = self.inner.state_dict()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        inner = state_dict.pop("inner", None)
        if (inner is None) != (self.inner is None):
            raise ValueError(f"{type(self).__name__}.load_state_dict: the checkpoint was saved with "
                             f"optim.scalar_opt={'adamw' if inner is not None else 'lion'}, this optimizer runs "
                             f"optim.scalar_opt={self.options.scalar_opt}; resume with the same optimizer")
        if inner is not None:
            self.inner.load_state_dict(inner)
        super().load_state_dict(state_dict)

    def describe(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options.as_dict().items())
        return f"{super().describe()} | {type(self).__name__}: {opts}"

    @staticmethod
    def _role_rms(entries: list[Entry], sq_sums: list[float]) -> dict[str, float]:
        """sqrt(sum of squares / elements) per tensor, per role, per block and overall."""
        pairs = [torch.tensor([s, float(e.numel)], dtype=torch.float64) for e, s in zip(entries, sq_sums)]
        return {suffix: math.sqrt(v[0].item() / v[1].item()) if v[1] > 0 else 0.0
                for suffix, v in _aggregate(pairs, entries, lambda vs: sum(vs))}


class Muon(MatrixOptimizer):
    """Muon on the mean gradient (gradient sync through the scheme: fp32 or bf16 allreduce of the
    whole flat gradient); see the module docstring. State per matrix: the momentum (param dtype)."""

    options_class = MuonOptions

    def _matrix_update(self, step: int) -> dict | None:
        o = self.options
        entries = self.layout.entries
        sq_sums: list[float] = []
        for gi, ks in self._matrix_groups().items():
            group = self.param_groups[gi]
            params, updates = [], []
            for k in ks:
                p = entries[k].param
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                u = muon_update(p.grad, state["momentum"], o.momentum, nesterov=o.nesterov, steps=o.ns_steps)
                u.mul_(muon_scale(p.shape[0], p.shape[1], o.scale))
                params.append(p)
                updates.append(u)
                if self._diagnose:
                    sq_sums.append(float(torch.linalg.vector_norm(u, dtype=torch.float32) ** 2))
            apply_update_(params, updates, self.matrix_lr(group), float(group["weight_decay"]))
        if not self._diagnose:
            return None
        order = [k for ks in self._matrix_groups().values() for k in ks]
        return {"entries": [entries[k] for k in order], "sq_sums": sq_sums}

    def _diagnostics(self, out: dict | None) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """diag/muon_update_rms[/<role>|/block/<i>|/tensor/<name>]: element RMS of the applied
        direction muon_scale * O, before the learning rate (an exact orthogonal O of an (m, n)
        matrix has RMS 1/sqrt(max(m, n)); Newton-Schulz lands within its [0.68, 1.2] band of that)."""
        if not out or not out["entries"]:
            return {}, {}
        rms = self._role_rms(out["entries"], out["sq_sums"])
        return {"diag/muon_update_rms" + k: v for k, v in rms.items()}, {}


def _matrix_state_words(o: MatrixOptions, role: str, matrix_words: float) -> float:
    """fp32 words per element: `matrix_words` on the hidden matrices, the scalar optimizer's on the
    embedding, head and 1-D parameters (AdamW m, v; Lion m)."""
    if role not in NON_MATRIX_ROLES:
        return matrix_words
    return 2.0 if o.scalar_opt == "adamw" else 1.0


def _gradient_mean(s: sync.SyncScheme) -> bool:
    return s.kind == sync.GRADIENT and s.result == sync.MEAN


def _build_muon(groups, *, betas, eps, options, **comm_kwargs) -> Muon:
    return Muon(groups, betas=betas, eps=eps, options=options, **comm_kwargs)


register_optimizer(OptimizerSpec(
    name="muon", options=MuonOptions, build=_build_muon, accepts=_gradient_mean,
    needs="a gradient-sync mean (its matrices are orthogonalised from the mean gradient)",
    state="matrices: momentum (param dtype); others: AdamW m, v or Lion m",
    help="Muon (Newton-Schulz orthogonalised momentum) on the hidden matrices, AdamW or Lion on the rest; "
         "fp32/bf16 gradient allreduce",
    state_words=lambda o, s, role: _matrix_state_words(o, role, 1.0)))


__all__ = ["MatrixOptimizer", "MatrixOptions", "Muon", "MuonOptions", "NON_MATRIX_ROLES", "SCALAR_OPTS",
           "is_matrix"]
