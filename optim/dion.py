"""Dion (Ahn & Xu 2025) for data-parallel training on the communication-owning base: Dion Alg. 1
(one rank) and Alg. 2 (P ranks) over the flat layout, registered as optim.name=dion.

What crosses the network in one step (comm.mode fp32 or bf16 picks the wire dtype of all of it):
  grad_sync    ONE mean-allreduce of the gradients of the non-matrix parameters (embedding, head,
               1-D; trained by AdamW or Lion, optim.scalar_opt) and of the matrices that are not
               worth factorising (below), which `_grad_order` places first in the flat gradient
               buffer so they are one contiguous slice; plus, with optim.grad_clip > 0, one fp32
               scalar (the clipping norm, see `_clip_`);
  update_sync  TWO mean-allreduces through the same scheme: every low-rank matrix's P
               (max(m, n) x r) in one flat buffer, then every R (min(m, n) x r) in another (Dion
               Alg. 2; dion_math.dion_step_ calls reduce_mean exactly twice). With
               optim.transpose_wide=false P is m x r and R n x r for every shape.
The gradients of the low-rank matrices never cross the network: every rank keeps its own
momentum M_i (Dion Alg. 2's hatted, unsynchronised state), and P, R, Q and the parameters come out
bit-identical on every rank because each is computed from the same reduced bits.

Which matrices are factorised. A matrix (m, n) at rank r sends (m + n) r elements per step; where
(m + n) r >= m n (full rank, r >= m n / (m + n), or tiny matrices) that is no cheaper than its
gradient. There we do what the Dion paper and microsoft/dion do: its gradient joins the
grad_sync allreduce (m n elements) and Dion runs on the mean gradient with no factor exchange,
which by Dion Thm. 2.1 is the same algorithm (Alg. 1 on the mean gradient = Alg. 2); its momentum
is then identical on every rank. Both parts are in `wire_bytes_per_step`.

Orientation (dion_math's module docstring): by default a wide matrix (fan_out < fan_in) runs the
power iteration on its transpose, as microsoft/dion's dion_reference does, so P is on the longer
side and Q on the shorter; optim.transpose_wide=false keeps P = B Q on the fan_out side for every
shape (the convention of this project's runs before the switch; their checkpoints resume only
with it).

Hybrid sharding (parallel.shard_size = S > 1; dion_math.dion_mesh_step_). Dion Alg. 2 shards the
side of Q and R (the paper's n columns), so Dion declares where FSDP2 shards each matrix
(`Dion.shard_dim`, asked by the trainer through optim.shard_dims before sharding): dim 0 (fan_out)
of a matrix whose power iteration runs on the transpose (wide ones with optim.transpose_wide=true:
Q is on fan_out), dim 1 (fan_in) of the others (tall and square; every matrix with
transpose_wide=false) where S divides fan_in; FSDP2 splits a dimension other than 0 only evenly,
so where S does not divide fan_in the matrix stays on dim 0 and P's side is sharded instead (the
fallback below). The non-matrix parameters stay on dim 0. On Q's side, with the local block B_j:
P = Orthonormalize(mean over replicas of sum over shards of B_j Q_j) (whole, m x r with m P's side),
R_j = B_j^T P and Q_j on the local block, column norms summed over the shard axis. In the fallback
P = B Q lies on the sharded rows: its row blocks are all-gathered over the shard group before the
orthonormalization and R = sum over shards of B_j^T P_j is summed there. Bytes per step a rank
sends, fp32 words times 4, r each matrix's rank, m its P side, n its Q side, s_j the rank's share
of the sharded side, c = ceil(m / S):
  replicate axis  the grad_sync slice of its local shards (non-matrix and full-gradient matrices), and
                  per low-rank matrix P then R: m r + s_j r on Q's side (summed over the shard group
                  (S m + n) r: Dion Table 1's (m + n) r per shard rank of the unsharded side),
                  s_j r + n r in the fallback;
  shard axis      per matrix (m + 1) r on Q's side (the partial P and the column norms: Dion Table 1),
                  c r + n r in the fallback (the P gather and the R sum); 2 words for the clipping
                  norm with optim.grad_clip > 0 (`_shard_bytes`, booked in shard_stats and logged as
                  shard_bytes; FSDP's all-gather and reduce-scatter come on top).
                  Dion Table 1's (m + 1) r takes m <= n: P on the shorter side, Q sharded along the
                  longer. With the default orientation P is on the longer side of every non-square
                  matrix (the wide ones run transposed), so this is (max(m, n) + 1) r, ~3x Table 1's
                  row for GPT-2's matrices; with optim.transpose_wide=false the wide ones are on
                  Table 1's row and the tall ones are not (docs/modes.md has the numbers).
Q on Q's side is the rank's block of the whole seeded Q; the diagnostics sum each rank's share of
||B - P R^T||^2 and ||B||^2 over the shard group first (the whole matrices' values). Checkpoints
record how M and Q are split (`state_shard_dims`), so a resume on another mesh joins and re-cuts
them (trainer/sharded_checkpoint.py); its clipping norm (`_clip_`) includes the spread of the
replicas' matrix gradients, so with optim.grad_clip > 0 it depends on the replica count.

State per matrix: M (param dtype, per rank), Q (min(m, n) x r by default, n x r with
optim.transpose_wide=false; float32 - float64 for float64 params -, identical on all ranks, drawn
from a seed derived from the parameter's name by dion_math.init_dion_q, so no broadcast is
needed); the inner AdamW state or the Lion momenta of the other parameters; the step counter.
Learning rates as in Muon (optim/muon.py): optim.matrix_lr for the matrices, following the
schedule of optim.lr, which stays the AdamW/Lion rate.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import torch

import comm

from . import sync
from .diagnostics import _aggregate, _sum_fp64
from .dion_math import (DEFAULT_RANK_FRACTION, dion_factor_rows, dion_mesh_step_, dion_rank, dion_step_,
                        dion_transposed, init_dion_q)
from .orthogonal import dion_scale
from .muon import MatrixOptimizer, MatrixOptions, _matrix_state_words
from .registry import gradient_mean
from .options import choice
from .orthogonal import ORTHO_METHODS
from .registry import OptimizerSpec, register_optimizer


@dataclass
class DionOptions(MatrixOptions):
    """Dion's options (optim.name=dion)."""

    mu: float = 0.95
    """Momentum decay mu of the error feedback M <- B - (1 - mu) P R^T (Dion Alg. 1; the paper and microsoft/dion:
    0.95)."""
    rank_fraction: float = DEFAULT_RANK_FRACTION
    """Rank r of each matrix's factors as a fraction of min(fan_out, fan_in), rounded up: in (0, 1]; the paper's
    main results use 1/4 (also 1/8, 1/16). Ignored when optim.rank > 0."""
    rank: int = 0
    """Absolute rank r of every matrix's factors (must not exceed any matrix's min(fan_out, fan_in)); 0 = use
    optim.rank_fraction."""
    ortho: str = "qr"
    """Column orthonormalisation of P: qr (Householder, any P) or cholesky_qr (CholeskyQR2, cheaper on GPUs,
    falls back to qr when P is ill-conditioned)."""

    error_feedback: bool = True
    """Dion's error feedback M = B - (1 - mu) P R^T (Alg. 1 line 7); false: the ablation of Dion §4.1,
    M = mu M + G approximated directly (for the reproduction study, not for training)."""
    transpose_wide: bool = True
    """Run a wide matrix (fan_out < fan_in) on its transpose, as microsoft/dion's dion_reference does: P = B^T Q
    is fan_in x r, Q and R fan_out x r, so Q always lies on the shorter side. false: P = B Q on the fan_out side
    for every shape (this project's earlier convention: Q is fan_in x r; needed to resume its checkpoints). The
    two differ on wide matrices only; bytes per step are the same. With optim.ortho=qr the Householder QR of the
    longer P costs more on a GPU (docs/results/code_notes.md); cholesky_qr costs the same in both."""

    def problems(self, world_size: int | None = None) -> list[str]:
        p = super().problems(world_size)
        if not (isinstance(self.mu, (int, float)) and 0.0 <= self.mu < 1.0):
            p.append(f"{self.key('mu')}: {self.mu} must lie in [0, 1) (the Dion paper uses 0.95)")
        rf = self.rank_fraction
        if isinstance(rf, bool) or not isinstance(rf, (int, float)) or not 0.0 < rf <= 1.0:
            p.append(f"{self.key('rank_fraction')}: {rf!r} must lie in (0, 1] (the Dion paper uses 1/4, 1/8, 1/16; "
                     f"or set {self.key('rank')} to an absolute rank)")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            p.append(f"{self.key('rank')}: {self.rank!r} must be an int >= 1, or 0 to use {self.key('rank_fraction')}")
        choice(p, self.key("ortho"), self.ortho, ORTHO_METHODS)
        return p


def matrix_seed(name: str) -> int:
    """Seed of a matrix's initial Q: from its name only, so every rank (and every resume) draws the
    same Q without communicating."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") % (2 ** 63 - 1)


class Dion(MatrixOptimizer):
    """Dion Alg. 2 on the hidden matrices (see the module docstring), AdamW or Lion on the rest."""

    bucketed = False  # exchanges a leading slice and its own factors: no buckets
    optim_name = "dion"  # its own registry entry (MatrixOptimizer's is muon's)

    options_class = DionOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """The arguments of MatrixOptimizer (options: DionOptions or a dict of its fields)."""
        super().__init__(*args, **kwargs)
        self._order_grads(self._grad_order(self.grads.order))
        # the P and R exchanges: the same scheme, booked in update_sync; a random stream of their own per
        # rank (a stochastic wire format must not round alike on every rank, nor replay the base exchange's)
        self.factor_exchange = self.scheme.build(self.scheme_options, sync.ExchangeContext(
            world_size=self.world_size, rank=self.rank, group=self.group, stats=self.stats["update_sync"],
            device=self.layout.device, kernels=self.kernel_set, seed=(self.ctx.seed + 1) % (2 ** 63 - 1)))

    # ---- layout: which gradients cross the network ------------------------------------------------
    def _grad_order(self, order: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """Called by the constructor: decide each matrix's rank and whether it is factorised,
        then order the flat gradient as [non-matrix, full-gradient matrices | low-rank matrices]
        (model order within each), so the synced part of every dtype's buffer is one leading slice."""
        entries = self.layout.entries
        o = self.options
        self.ranks: dict[int, int] = {}
        too_big = []
        for k, e in enumerate(entries):
            if not e.matrix:
                continue
            m, n = self.matrix_shape(k)
            if o.rank > min(m, n):
                too_big.append(f"{e.name} {(m, n)}")
                continue
            self.ranks[k] = dion_rank(m, n, rank_fraction=o.rank_fraction, rank=o.rank or None)
        if too_big:
            smallest = min(min(self.matrix_shape(k)) for k, e in enumerate(entries) if e.matrix)
            which = ", ".join(too_big[:3]) + (f" and {len(too_big) - 3} more" if len(too_big) > 3 else "")
            raise ValueError(f"optim.rank={o.rank} exceeds min(fan_out, fan_in) of {which}; set optim.rank <= "
                             f"{smallest} (the smallest matrix side), or optim.rank=0 to use optim.rank_fraction "
                             "in (0, 1]")
        # factorise only where the factors are smaller than the gradient: (m + n) r < m n
        self.lowrank_idx = [k for k, r in self.ranks.items()
                            if sum(self.matrix_shape(k)) * r < math.prod(self.matrix_shape(k))]
        self.fullgrad_idx = [k for k in self.ranks if k not in set(self.lowrank_idx)]
        local = {id(entries[k].param) for k in self.lowrank_idx}
        synced = [p for p in order if id(p) not in local]
        self._synced_numel: dict[torch.dtype, int] = {}
        for p in synced:
            self._synced_numel[p.dtype] = self._synced_numel.get(p.dtype, 0) + p.numel()
        return synced + [p for p in order if id(p) in local]

    def _exchange_gradients(self, step: int) -> None:
        """Mean of the leading synced slice of every flat gradient buffer (one collective each)."""
        for dtype, buf in self.grad_buffers.items():
            n = self._synced_numel.get(dtype, 0)
            if n:
                self.exchange(buf[:n], step)  # a contiguous view: reduced in place

    def _clip_(self, norm: torch.Tensor | None = None) -> None:
        """Clipping with local matrix gradients (the base's global `norm` is not this one: unused). The base's rule (each rank's norm over all its flat
        buffers) would scale the synced gradients by a different factor on every rank and break the
        bit-identity of the AdamW/Lion parameters. Here the norm is
            sqrt(||mean synced gradient||^2 + mean_i ||G_i||^2)   (G_i: rank i's low-rank matrix grads)
        from one fp32 allreduce of a scalar (booked in grad_sync), identical on every rank, and every
        gradient is scaled by the same factor, so Alg. 2 still equals Alg. 1 on the clipped mean
        gradient. By Jensen, mean_i ||G_i||^2 >= ||mean_i G_i||^2: the norm is an upper bound of the
        norm of the mean gradient (it adds the spread of the matrix gradients across ranks), so this
        clips at least as often as clipping the mean gradient would.
        Under a local-update scheme (the strategy's `replicas_step_apart`: DiLoCo's inner steps) nothing
        is averaged and each worker clips by its own gradients' norm, with no reduction over the workers
        (only over the shard group, which holds the other pieces of the same worker's tensors)."""
        synced_sq = torch.zeros((), dtype=torch.float32, device=self.layout.device)
        local_sq = torch.zeros((), dtype=torch.float32, device=self.layout.device)
        for dtype, buf in self.grad_buffers.items():
            n = self._synced_numel.get(dtype, 0)
            synced_sq += torch.linalg.vector_norm(buf[:n], dtype=torch.float32).square()
            local_sq += torch.linalg.vector_norm(buf[n:], dtype=torch.float32).square()
        if self.shard_group is not None:  # hybrid sharding: the whole tensors' squares
            both = torch.stack([synced_sq, local_sq])
            torch.distributed.all_reduce(both, group=self.shard_group)
            self.shard_stats.add_bytes("clip_norm", both.numel() * both.element_size(),
                                       both.numel() * both.element_size())
            synced_sq, local_sq = both[0], both[1]
        if self.world_size > 1 and self.lowrank_idx and not self.strategy.replicas_step_apart:
            local_sq = comm.allreduce_mean(local_sq.reshape(1), wire_dtype=torch.float32, group=self.group,
                                           stats=self.stats["grad_sync"])[0]
        norm = (synced_sq + local_sq).sqrt()
        scale = torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0)
        for buf in self.grad_buffers.values():
            buf.mul_(scale.to(buf.dtype))

    # ---- the matrix update -------------------------------------------------------------------------
    def _reduce_mean(self, step: int):
        def reduce_mean(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
            flat = torch.cat([t.reshape(-1) for t in tensors])
            flat = self.factor_exchange(flat, step)
            return [piece.view(t.shape) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
        return reduce_mean

    def _state_of(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.layout.entries[k]
        state = self.state[e.param]
        if "momentum" not in state:
            state["momentum"] = torch.zeros_like(e.param, memory_format=torch.preserve_format)
            dtype = torch.float64 if e.param.dtype == torch.float64 else torch.float32
            m, n = self.matrix_shape(k)
            rows = dion_factor_rows(m, n, self.options.transpose_wide)[1]
            Q = init_dion_q(rows, self.ranks[k], seed=matrix_seed(e.name), dtype=dtype, device=e.param.device)
            if self.q_sharded(k):  # Q lies on the sharded side: this rank's block of it
                start = self.shard_start(k)
                Q = Q[start:start + e.param.shape[self.shard_dim_of(k)]].clone()
            state["Q"] = Q
        return state["momentum"], state["Q"]

    def _shard_sum(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Sum over the shard group of every tensor, in ONE all_reduce (booked in shard_stats)."""
        if not tensors:
            return []
        flat = torch.cat([t.reshape(-1) for t in tensors])
        torch.distributed.all_reduce(flat, group=self.shard_group)
        nbytes = flat.numel() * flat.element_size()
        self.shard_stats.add_bytes("shard_sum", nbytes, nbytes)
        return [piece.view(t.shape) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]

    def _shard_gather(self, idx: list[int]):
        """All-gather over the shard group of the P blocks (s_j, r) of the matrices `idx` (layout
        indices; P on the sharded side), each padded to ceil(s / S) rows, in ONE call; returns the
        whole (s, r) tensors (s: the size of the sharded dimension)."""
        sh = self.shards

        def gather(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
            if not tensors:
                return []
            pos = [self._shard_pos[k] for k in idx]
            pieces = []
            for i, t in zip(pos, tensors):
                pieces += [t.reshape(-1), t.new_zeros((sh.chunk[i] - t.shape[0]) * t.shape[1])]
            flat = torch.cat(pieces)
            out = [torch.empty_like(flat) for _ in range(sh.S)]
            torch.distributed.all_gather(out, flat, group=self.shard_group)
            nbytes = flat.numel() * flat.element_size()
            self.shard_stats.add_bytes("shard_gather", nbytes, nbytes * (sh.S - 1))
            full = torch.stack(out)
            res, off = [], 0
            for i, t in zip(pos, tensors):
                size = sh.chunk[i] * t.shape[1]
                res.append(full[:, off:off + size].reshape(sh.S * sh.chunk[i], t.shape[1])[:sh.size[i]])
                off += size
            return res
        return gather

    def _matrix_update(self, step: int) -> dict | None:
        """The full-gradient matrices first (their gradients are already the mean: no reduce), then the
        low-rank ones with their two batched exchanges; on the hybrid-sharding mesh each group runs Dion
        Alg. 2 on its shards (dion_math.dion_mesh_step_), else Alg. 1 (dion_step_)."""
        entries = self.layout.entries
        diag: dict | None = {"entries": [], "res_sq": [], "b_sq": []} if self._diagnose else None
        step_of = self._mesh_step if self.shards is not None else self._local_step
        for idx, reduce_mean in ((self.fullgrad_idx, None), (self.lowrank_idx, self._reduce_mean(step))):
            if not idx:
                continue
            params = [entries[k].param for k in idx]
            moms, qs = zip(*(self._state_of(k) for k in idx))
            groups = [self.param_groups[entries[k].group] for k in idx]
            step_of(idx, params, list(moms), list(qs), groups, reduce_mean, diag)
            if diag is not None:
                diag["entries"] += [entries[k] for k in idx]
        return diag

    def _local_step(self, idx, params, moms, qs, groups, reduce_mean, diag) -> None:
        o = self.options
        grads = [p.grad for p in params]
        if diag is not None:  # ||B_i||^2 with B_i = M_i + G_i rounded as dion_step_ forms it
            diag["b_sq"] += [torch.linalg.vector_norm(m + g, dtype=torch.float64).square() for m, g in zip(moms, grads)]
        factors = dion_step_(params, grads, moms, qs, lr=[self.matrix_lr(g) for g in groups], mu=o.mu,
                             weight_decay=[float(g["weight_decay"]) for g in groups], reduce_mean=reduce_mean,
                             ortho=o.ortho, diagnostics=diag is not None, error_feedback=o.error_feedback,
                             transpose_wide=o.transpose_wide)
        if diag is not None:
            diag["res_sq"] += [f.residual_norm.square() for f in factors]

    def _mesh_step(self, idx, params, moms, qs, groups, reduce_mean, diag) -> None:
        o = self.options
        shapes = [self.matrix_shape(k) for k in idx]
        flip = [dion_transposed(m, n, o.transpose_wide) for m, n in shapes]
        factors = dion_mesh_step_(
            params, [p.grad for p in params], moms, qs, flip=flip, shard_dim=[self.shard_dim_of(k) for k in idx],
            shard_start=[self.shard_start(k) for k in idx], lr=[self.matrix_lr(g) for g in groups],
            weight_decay=[float(g["weight_decay"]) for g in groups], scale=[dion_scale(m, n) for m, n in shapes],
            shard_sum=self._shard_sum, shard_gather=self._shard_gather([k for k in idx if not self.q_sharded(k)]),
            reduce_mean=reduce_mean, mu=o.mu, ortho=o.ortho, diagnostics=diag is not None,
            error_feedback=o.error_feedback)
        if diag is not None:
            diag["res_sq"] += [f.residual_norm for f in factors]
            diag["b_sq"] += [f.rel_error for f in factors]

    def q_sharded(self, k: int) -> bool:
        """Whether matrix entry k's shard dimension is the side of Q and R (Dion Alg. 2's layout; the
        fallback, P's side, where FSDP2 cannot split Q's side evenly): False when not sharded."""
        if self.shards is None:
            return False
        m, n = self.matrix_shape(k)
        return (self.shard_dim_of(k) == 1) != dion_transposed(m, n, self.options.transpose_wide)

    @classmethod
    def shard_dim(cls, options: DionOptions, matrix: bool, shape: tuple[int, ...], shard_size: int) -> int:
        """Dion Alg. 2 shards the side of Q (the paper's n columns): dim 0 (fan_out) of a matrix whose
        power iteration runs on the transpose (dion_transposed: wide ones by default), dim 1 (fan_in)
        of the others where shard_size divides it (FSDP2 splits dims > 0 only evenly), else dim 0 (Q's
        side stays whole and P's is sharded: more bytes, see the module docstring). Non-matrices: 0."""
        if not matrix:
            return 0
        m, n = shape
        if dion_transposed(m, n, options.transpose_wide) or n % shard_size:
            return 0
        return 1

    def _diagnostics(self, out: dict | None) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """Per matrix tensor, role, block and overall, averaged over ranks (one fp64 allreduce in the
        diag phase): diag/dion_rel_error = sqrt(mean_i ||B_i - P R^T||^2 / mean_i ||B_i||^2), the
        relative error of the rank-r approximation of B (for a role, its matrices' squares summed
        first), and diag/dion_residual = sqrt(mean_i ||B_i - P R^T||^2), the norm of the part of B
        that was not applied and stays in the momentum beyond the decayed mu P R^T (error feedback).
        Both come from dion_step_'s cheap ||B||^2 - 2 <B^T P, R> + ||R||^2, which cancels near full
        rank: its resolution is about sqrt(max(m, n) u) relative (~1e-3 in fp32), not 0."""
        if not out or not out["entries"]:
            return {}, {}
        buf = torch.stack([torch.stack(out["res_sq"]), torch.stack(out["b_sq"])], dim=1).to(torch.float64)
        if self.shard_group is not None:  # each rank's share of the whole matrices' squares
            torch.distributed.all_reduce(buf, group=self.shard_group)
            buf[:, 0].clamp_(min=0.0)  # the cancellation near full rank (dion_step_ clamps per matrix too)
        buf = _sum_fp64(buf.reshape(-1).contiguous(), self.world_size, self.group, self.stats["diag"])
        pairs = list(buf.div_(self.world_size).view(-1, 2).cpu())
        d: dict[str, float] = {}
        for suffix, (res, b) in _aggregate(pairs, out["entries"], lambda vs: sum(vs)):
            res, b = float(res), float(b)
            d["diag/dion_rel_error" + suffix] = math.sqrt(res / b) if b > 0 else 0.0
            d["diag/dion_residual" + suffix] = math.sqrt(res)
        return d, {}

    # ---- bytes per step -----------------------------------------------------------------------------
    def factor_shapes(self) -> list[tuple[int, int, int]]:
        """(m, n, r) of every low-rank matrix, in exchange order (dion_math.dion_wire_elements)."""
        return [(*self.matrix_shape(k), self.ranks[k]) for k in self.lowrank_idx]

    def _local_factor_rows(self, k: int) -> tuple[int, int]:
        """(rows of P, rows of R) this rank exchanges across replicas for matrix entry k: the
        factors' rows, where the sharded side holds only this rank's block."""
        m, n = self.matrix_shape(k)
        p_rows, q_rows = dion_factor_rows(m, n, self.options.transpose_wide)
        local = self.layout.entries[k].param.shape[self.shard_dim_of(k)]
        return (p_rows, local) if self.q_sharded(k) else (local, q_rows)

    def _shard_bytes(self) -> int:
        """Bytes this rank sends on the shard axis in one step (dion_mesh_step_'s collectives, in the
        compute dtype): per matrix sharded on Q's side (m + 1) r with m the side of P (its partial
        B Q and the column norms, Dion Table 1), per matrix sharded on P's side c r + n r (its padded
        P block to the all-gather, R's sum; c = ceil(m / S)); plus 2 words for the clipping norm
        when clipping."""
        if self.shards is None:
            return 0
        total = 0
        for k in self.fullgrad_idx + self.lowrank_idx:
            m, n = self.matrix_shape(k)
            p_rows, q_rows = dion_factor_rows(m, n, self.options.transpose_wide)
            r = self.ranks[k]
            item = 8 if self.layout.entries[k].param.dtype == torch.float64 else 4
            c = self.shards.chunk[self._shard_pos[k]]
            total += item * ((p_rows + 1) * r if self.q_sharded(k) else (c + q_rows) * r)
        return total + (8 if self.grad_clip > 0 else 0)

    def _exchanged(self) -> list[tuple[str, int, int]]:
        out = [("grad_sync", n, 1) for n in self._synced_numel.values() if n]
        if self.lowrank_idx and self.shards is not None:
            rows = [(*self._local_factor_rows(k), self.ranks[k]) for k in self.lowrank_idx]
            out += [("update_sync", sum(p * r for p, _, r in rows), 1),
                    ("update_sync", sum(q * r for _, q, r in rows), 1)]
        elif self.lowrank_idx:
            rows = [(*dion_factor_rows(m, n, self.options.transpose_wide), r) for m, n, r in self.factor_shapes()]
            out += [("update_sync", sum(p * r for p, _, r in rows), 1),   # every P, one call
                    ("update_sync", sum(q * r for _, q, r in rows), 1)]   # every R, one call
        return out

    def _extra_calls(self) -> list[tuple[str, int, int]]:
        return [("grad_sync", 1, 32)] if self.grad_clip > 0 and self.lowrank_idx else []

    # ---- state ---------------------------------------------------------------------------------------
    def _matrix_state_dims(self, k: int) -> dict[str, int | None]:
        """M like its parameter; Q's rows are the Q side's, split where that side is the sharded one
        (the same FSDP2 chunks as the parameter's), whole on every rank otherwise."""
        return {"momentum": self.shard_dim_of(k), "Q": 0 if self.q_sharded(k) else None}

    def _comm_state(self) -> dict:
        return {**super()._comm_state(), "factor_exchange": self.factor_exchange.state_dict()}

    def _load_comm_state(self, extra: dict | None) -> None:
        super()._load_comm_state(extra)
        self.factor_exchange.load_state_dict(extra.get("factor_exchange", {}))
        self._check_q_orientation()

    def _check_q_orientation(self) -> None:
        """A loaded Q must lie on the side optim.transpose_wide puts it; a checkpoint of the other
        convention differs on wide matrices only, and is refused with the setting that resumes it."""
        tw = self.options.transpose_wide
        for k, r in self.ranks.items():
            e = self.layout.entries[k]
            Q = self.state.get(e.param, {}).get("Q")
            if Q is None:
                continue
            m, n = self.matrix_shape(k)
            want = (e.param.shape[self.shard_dim_of(k)] if self.q_sharded(k) else dion_factor_rows(m, n, tw)[1], r)
            if tuple(Q.shape) != want:
                other = (dion_factor_rows(m, n, not tw)[1], r)
                fix = (f"it was saved with optim.transpose_wide={str(not tw).lower()}; resume with that setting"
                       if tuple(Q.shape) == other else
                       "resume with the optim.rank / optim.rank_fraction it was saved with")
                raise ValueError(f"Dion.load_state_dict: Q of {e.name} {(m, n)} has shape "
                                 f"{tuple(Q.shape)}, this run expects {want} (optim.transpose_wide="
                                 f"{str(tw).lower()}): {fix}")


def _build_dion(groups, *, plan, **runtime) -> Dion:
    return Dion(groups, betas=plan.betas, eps=plan.eps, options=plan.optim_options, shard_dims=dict(plan.shard_dims),
                plan=plan, **runtime)


register_optimizer(OptimizerSpec(
    name="dion", options=DionOptions, build=_build_dion,
    # P and R go through the scheme's exchange twice per step: it must be a stateless
    # mean-allreduce (fp32, bf16), not one that keeps error-feedback state sized for the gradient
    # (loco): the scheme's capabilities say which, not its name
    accepts=lambda s: gradient_mean(s) and not s.stateful,
    needs="a mean-allreduce scheme for its P and R factors and the non-matrix gradients (comm.mode picks their "
          "wire dtype)",
    state="matrices: momentum M (param dtype, per rank) + Q (min(m, n) x r fp32); others: AdamW m, v or Lion m",
    help="Dion (low-rank orthonormal updates, error feedback; Dion Alg. 2) on the hidden matrices, AdamW or Lion "
         "on the rest; only P, R and the non-matrix gradients cross the network",
    # Q (n x r) is r / m of a matrix's elements: not counted per element
    state_words=lambda o, s, matrix: _matrix_state_words(o, matrix, 1.0), shards=True, shard_dim=Dion.shard_dim,
    sends="every low-rank matrix's P and R factors (Dion Alg. 2) and the gradients of the other parameters"))


__all__ = ["Dion", "DionOptions", "matrix_seed"]
