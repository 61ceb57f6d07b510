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

On the hybrid-sharding mesh (parallel.shard_size = S > 1; MatrixShards) each rank holds dim-0 row
blocks of every matrix. The momentum and u are element-wise on the rows; then each matrix's u goes
to one owner rank of its shard group (matrices spread so every rank orthonormalizes about the same
number of elements), which runs Newton-Schulz and the scale on the whole matrix, and the update's
rows go back. Bytes one rank sends per step, with c_k = ceil(m_k / S) and w the parameter's size:
    replicate axis  the scheme's mean-allreduce of the local flat gradient (N / S elements)
    shard axis      sum over matrices it does not own of c_k n_k w (gather) + sum over those it
                    owns of (S - 1) c_k n_k w (scatter): 2 (S - 1) / S * sum_k m_k n_k w summed
                    over a shard group, one all_to_all each way (FSDP's own all-gather and
                    reduce-scatter come on top).

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
from typing import Callable, Iterable

import torch

from comm.stats import CommStats

from . import sync
from .base import CommOptimizer
from .diagnostics import _aggregate
from .layout import Entry
from .lion import apply_update_, lion_group_step_
from .options import choice
from .orthogonal import MUON_SCALES, NS_STEPS, muon_scale, muon_update, newton_schulz
from .registry import OptimizerSpec, OptimOptions, gradient_mean, register_optimizer

SCALAR_OPTS = ("adamw", "lion")


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


def fsdp_chunks(size: int, S: int) -> list[int]:
    """FSDP2's split of a dimension of `size` over S ranks (torch.chunk): c = ceil(size / S) each,
    the last ranks fewer or none."""
    c = -(-size // S)
    return [min(c, max(0, size - j * c)) for j in range(S)]


class MatrixShards:
    """The hidden matrices of a model sharded over a shard group (hybrid sharding): their whole
    shapes, the dimension FSDP2 shards each on, its chunks, and one owner rank each.

    FSDP2 splits the shard dimension d of a parameter (`dims`, one per matrix: what the model was
    sharded with) as torch.chunk does: rank j of the S shard ranks holds indices
    [j c, min((j + 1) c, size)) of it with c = ceil(size / S) (the last ranks may hold fewer or none;
    d > 0 only evenly). The constructor learns every matrix's whole shape from one all_gather of the
    local shapes and checks that layout; `rule(m, n)`, the optimizer's shard_dim, must give d for
    the whole shape (else the model was sharded for another optimizer: an error). Owners: the
    matrices in decreasing size, each to the rank with the fewest elements so far (ties: the lowest
    rank), so every rank orthonormalizes about the same number of elements (the same assignment on
    every rank and replica: it depends on the shapes only).

    `gather` and `scatter` (Muon; dim-0 shards) move every owned matrix in ONE all_to_all_single
    each over the shard group, every shard padded to c rows: a rank sends sum_k c_k n_k (S - 1) / S
    elements to the others in each direction (its shards of the matrices it does not own, then the
    owner's chunks of the matrices it owns), booked in `stats` (the shard axis; CommStats of the
    replicate axis stay the optimizer's phases)."""

    def __init__(self, params: list[torch.Tensor], group, stats: CommStats | None = None,
                 dims: list[int] | None = None, rule: Callable[[int, int], int] | None = None) -> None:
        import torch.distributed as dist

        self.group = group
        self.S = dist.get_world_size(group)
        self.me = dist.get_rank(group)
        self.stats = stats if stats is not None else CommStats(timing=False)
        device = params[0].device if params else torch.device("cpu")
        self.device = device
        dims = list(dims) if dims is not None else [0] * len(params)
        rule = rule or (lambda m, n: 0)
        local = torch.tensor([list(p.shape) for p in params], dtype=torch.int64, device=device).reshape(-1, 2)
        got = [torch.empty_like(local) for _ in range(self.S)]
        dist.all_gather(got, local, group=group)
        shapes = torch.stack(got).cpu()  # (S, K, 2)
        self.m, self.n, self.dim, self.size, self.sizes = [], [], [], [], []
        for k, d in enumerate(dims):
            along, other = shapes[:, k, d].tolist(), shapes[:, k, 1 - d].tolist()
            whole = [other[0], other[0]]
            whole[d] = sum(along)
            if len(set(other)) != 1 or along != fsdp_chunks(whole[d], self.S):
                raise RuntimeError(f"MatrixShards: matrix {k} has local shapes {shapes[:, k].tolist()} over the shard "
                                   f"group, not FSDP2's chunks of one matrix along dim {d}")
            if rule(*whole) != d:
                raise RuntimeError(f"MatrixShards: matrix {k} {tuple(whole)} is sharded on dim {d}, but this optimizer "
                                   f"shards it on dim {rule(*whole)}: shard the model with optim.shard_dims and pass "
                                   f"the placements to build_optimizer (shard_dims)")
            m, n = whole
            self.m.append(m)
            self.n.append(n)
            self.dim.append(d)
            self.size.append(whole[d])
            self.sizes.append(fsdp_chunks(whole[d], self.S))
        self.chunk = [-(-size // self.S) for size in self.size]
        load = [0] * self.S
        self.owner = [0] * len(params)
        for k in sorted(range(len(params)), key=lambda k: (-self.m[k] * self.n[k], k)):
            j = min(range(self.S), key=lambda j: (load[j], j))
            self.owner[k] = j
            load[j] += self.m[k] * self.n[k]
        self.owned = [k for k in range(len(params)) if self.owner[k] == self.me]
        self.by_owner = [[k for k in range(len(params)) if self.owner[k] == j] for j in range(self.S)]

    def start(self, k: int) -> int:
        """First index along matrix k's shard dimension that this rank holds (its size when empty)."""
        return self.me * self.chunk[k] if self.sizes[k][self.me] else self.size[k]

    def shape(self, k: int) -> tuple[int, int]:
        return self.m[k], self.n[k]

    def _padded(self, k: int) -> int:
        if self.dim[k]:
            raise RuntimeError(f"MatrixShards.gather/scatter move dim-0 row blocks; matrix {k} is sharded on dim "
                               f"{self.dim[k]}")
        return self.chunk[k] * self.n[k]

    def _exchange(self, send: torch.Tensor, in_splits: list[int], out_splits: list[int], name: str) -> torch.Tensor:
        import torch.distributed as dist

        recv = send.new_empty(sum(out_splits))
        dist.all_to_all_single(recv, send, out_splits, in_splits, group=self.group)
        item = send.element_size()
        self.stats.add_bytes(name, (sum(in_splits) - in_splits[self.me]) * item,
                             (sum(out_splits) - out_splits[self.me]) * item)
        return recv

    def gather(self, local: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """Every rank's shard of the matrices this rank owns -> {k: whole (m, n) matrix}; `local`
        holds this rank's (rows, n) shard of every matrix (one dtype)."""
        pieces = []
        for j in range(self.S):
            for k in self.by_owner[j]:
                x = local[k].reshape(-1)
                pieces += [x, x.new_zeros(self._padded(k) - x.numel())]
        dtype = local[0].dtype if local else torch.float32
        send = torch.cat(pieces) if pieces else torch.zeros(0, dtype=dtype, device=self.device)
        in_splits = [sum(self._padded(k) for k in self.by_owner[j]) for j in range(self.S)]
        mine = sum(self._padded(k) for k in self.owned)
        recv = self._exchange(send, in_splits, [mine] * self.S, "shard_gather").view(self.S, mine)
        out, off = {}, 0
        for k in self.owned:
            block = recv[:, off:off + self._padded(k)].reshape(self.S * self.chunk[k], self.n[k])
            out[k] = block[:self.m[k]]
            off += self._padded(k)
        return out

    def scatter(self, whole: dict[int, torch.Tensor], like: list[torch.Tensor]) -> list[torch.Tensor]:
        """The inverse of `gather`: {k: whole matrix} on its owner -> this rank's (rows, n) shard of
        every matrix (`like`: this rank's shards, for shapes and dtype)."""
        pieces = []
        for j in range(self.S):
            for k in self.owned:
                c, n = self.chunk[k], self.n[k]
                chunk = whole[k][j * c:(j + 1) * c].reshape(-1)
                pieces += [chunk, chunk.new_zeros(c * n - chunk.numel())]
        dtype = like[0].dtype if like else torch.float32
        send = torch.cat(pieces).to(dtype) if pieces else torch.zeros(0, dtype=dtype, device=self.device)
        mine = sum(self._padded(k) for k in self.owned)
        out_splits = [sum(self._padded(k) for k in self.by_owner[j]) for j in range(self.S)]
        recv = self._exchange(send, [mine] * self.S, out_splits, "shard_scatter")
        out: list[torch.Tensor | None] = [None] * len(like)
        off = 0
        for j in range(self.S):
            for k in self.by_owner[j]:
                rows = self.sizes[k][self.me]
                out[k] = recv[off:off + rows * self.n[k]].view(rows, self.n[k])
                off += self._padded(k)
        return out


class MatrixOptimizer(CommOptimizer):
    """Base of Muon and Dion: hidden matrices get the subclass's update (`_matrix_update`), the
    other parameters AdamW or Lion; lr and weight_decay are read from the param groups every step.

    Subclasses implement `_matrix_update(step)` and may override `_exchanged()` (what crosses the
    network in one step, for the byte formula)."""

    options_class: type[MatrixOptions] = MatrixOptions
    optim_name = "muon"  # a subclass with its own registry entry names it (Dion: "dion")

    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8, weight_decay: float = 0.0, *, options: MatrixOptions | dict | None = None,
                 scheme: str | sync.SyncScheme = "fp32", shard_dims: dict[int, int] | None = None,
                 **comm_kwargs) -> None:
        """`shard_dims`: id(local parameter) -> the dimension its model parameter is sharded on
        (hybrid sharding; absent: 0), what `shard_dim` asked for."""
        name = type(self).__name__
        self._placements = dict(shard_dims or {})
        options = _options(self.options_class, options)
        if "plan" not in comm_kwargs:  # built directly: the scheme is one of the plan's keywords
            comm_kwargs["scheme"] = scheme
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay), **comm_kwargs)
        self.options = options
        entries = self.layout.entries
        self.matrix_idx = [k for k, e in enumerate(entries) if e.matrix]
        self.scalar_idx = [k for k, e in enumerate(entries) if not e.matrix]
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
        # hybrid sharding: the matrices' whole shapes and owners over the shard group; the shard
        # axis's bytes (gathers, scatters, factor sums) are booked in shard_stats
        self._build_shards()

    def _build_shards(self) -> None:
        """self.shards (MatrixShards over the hidden matrices, None when not sharded) and
        self.shard_stats."""
        self.shard_stats = CommStats(timing=False)
        self.shards: MatrixShards | None = None
        idx = [k for k, e in enumerate(self.layout.entries) if e.matrix]
        self._shard_pos = {k: i for i, k in enumerate(idx)}
        if self.shard_group is not None:
            S = torch.distributed.get_world_size(self.shard_group)
            params = [self.layout.entries[k].param for k in idx]
            self.shards = MatrixShards(params, self.shard_group, self.shard_stats,
                                       [self._placements.get(id(p), 0) for p in params],
                                       lambda m, n: self.shard_dim(self.options, True, (m, n), S))

    @classmethod
    def shard_dim(cls, options: MatrixOptions, matrix: bool, shape: tuple[int, ...], shard_size: int) -> int:
        """The dimension FSDP2 shards a parameter on for this optimizer (OptimizerSpec.shard_dim):
        0 for every parameter (Muon gathers whole row blocks to an owner)."""
        return 0

    def matrix_shape(self, k: int) -> tuple[int, int]:
        """The whole (m, n) of matrix entry k (its local shard's shape when not sharded)."""
        if self.shards is None:
            return tuple(self.layout.entries[k].param.shape)
        return self.shards.shape(self._shard_pos[k])

    def shard_dim_of(self, k: int) -> int:
        """The dimension matrix entry k is sharded on (0 when not sharded)."""
        return 0 if self.shards is None else self.shards.dim[self._shard_pos[k]]

    def shard_start(self, k: int) -> int:
        """First index of this rank's block of matrix entry k along its shard dimension (0 unsharded)."""
        return 0 if self.shards is None else self.shards.start(self._shard_pos[k])

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
    def mesh_bytes_per_step(self) -> tuple[int, int]:
        """(bytes this rank sends on the shard axis, on the replicate axis) in one step, as the
        collectives book them (shard_stats; the grad_sync and update_sync phases)."""
        rep = sum(v[0] for ph, v in self.wire_bytes_per_step().items() if ph in ("grad_sync", "update_sync"))
        return self._shard_bytes(), rep

    def _shard_bytes(self) -> int:
        """Muon's shard axis: the gather sends this rank's padded shard (c_k n_k elements, c_k =
        ceil(m_k / S)) of every matrix it does not own, the scatter (S - 1) padded chunks of every
        matrix it owns, in the momentum's dtype (the parameter's)."""
        sh = self.shards
        if sh is None:
            return 0
        item = [self.layout.entries[k].param.element_size() for k in self.matrix_idx]
        return sum(sh.chunk[i] * sh.n[i] * item[i] * ((sh.S - 1) if sh.owner[i] == sh.me else 1)
                   for i in range(len(item)))

    # ---- state -----------------------------------------------------------------------------------
    def state_shard_dims(self) -> dict[int, dict[str, int | None]]:
        """How the matrices' state is split over the shard group, for a checkpoint that resumes on
        another mesh (trainer/sharded_checkpoint.py remesh_optimizer_state): per index of
        state_dict()["state"], per state key, the tensor dimension split like the parameter's shard
        dimension (FSDP2's chunks), or None where every rank of the shard group holds the whole
        tensor. Unlisted tensors (the AdamW / Lion state of the other parameters): dim 0. Empty when
        not sharded."""
        if self.shards is None:
            return {}
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        return {index[id(self.layout.entries[k].param)]: self._matrix_state_dims(k) for k in self.matrix_idx}

    def _matrix_state_dims(self, k: int) -> dict[str, int | None]:
        return {"momentum": self.shard_dim_of(k)}

    def state_dict(self) -> dict:
        sd = super().state_dict()  # matrix state and Lion momenta (self.state), groups, comm
        if self.inner is not None:
            sd["inner"] = self.inner.state_dict()
        if self.shards is not None:  # read back by remesh_optimizer_state to join the saved shards
            sd["shard_dims"] = self.state_shard_dims()
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        state_dict.pop("shard_dims", None)  # the saved layout: remesh_optimizer_state's, not this mesh's
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
    def _role_rms(entries: list[Entry], sq_sums: list[float], numels: list[int] | None = None) -> dict[str, float]:
        """sqrt(sum of squares / elements) per tensor, per role, per block and overall (`numels`:
        the whole tensors' element counts where the entries are shards)."""
        numels = numels if numels is not None else [e.numel for e in entries]
        pairs = [torch.tensor([s, float(n)], dtype=torch.float64) for n, s in zip(numels, sq_sums)]
        return {suffix: math.sqrt(v[0].item() / v[1].item()) if v[1] > 0 else 0.0
                for suffix, v in _aggregate(pairs, entries, lambda vs: sum(vs))}


class Muon(MatrixOptimizer):
    """Muon on the mean gradient (gradient sync through the scheme: fp32 or bf16 allreduce of the
    whole flat gradient); see the module docstring. State per matrix: the momentum (param dtype)."""

    options_class = MuonOptions

    def _matrix_update(self, step: int) -> dict | None:
        if self.shards is not None:
            return self._sharded_matrix_update()
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

    def _sharded_matrix_update(self) -> dict | None:
        """Muon on dim-0 shards (hybrid sharding): the momentum and the Nesterov direction u on the
        local rows (element-wise), then every u to its owner (MatrixShards.gather, one all_to_all),
        Newton-Schulz and muon_scale of the whole matrix there, the update's rows back to their ranks
        (MatrixShards.scatter, one all_to_all) and applied to the local shard. Every rank of a
        replicate group holds the same mean gradient rows, so replicas stay bit-identical."""
        o, entries, sh = self.options, self.layout.entries, self.shards
        us = []
        for k in self.matrix_idx:
            p = entries[k].param
            state = self.state[p]
            if "momentum" not in state:
                state["momentum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            m = state["momentum"]
            m.lerp_(p.grad.to(m.dtype), 1.0 - o.momentum)
            us.append(p.grad.to(m.dtype).lerp(m, o.momentum) if o.nesterov else m)
        whole = sh.gather(us)
        for i, u in whole.items():
            whole[i] = newton_schulz(u, steps=o.ns_steps).mul_(muon_scale(*sh.shape(i), o.scale))
        updates = sh.scatter(whole, us)
        pos = {k: i for i, k in enumerate(self.matrix_idx)}
        sq_sums: list[torch.Tensor] = []
        for gi, ks in self._matrix_groups().items():
            group = self.param_groups[gi]
            ups = [updates[pos[k]] for k in ks]
            apply_update_([entries[k].param for k in ks], ups, self.matrix_lr(group), float(group["weight_decay"]))
            if self._diagnose:
                sq_sums += [torch.linalg.vector_norm(u, dtype=torch.float64).square() for u in ups]
        if not self._diagnose:
            return None
        # the whole matrices' sums of squares: the shards' summed over the shard group
        sq = torch.stack(sq_sums) if sq_sums else torch.zeros(0, dtype=torch.float64, device=self.shards.device)
        torch.distributed.all_reduce(sq, group=self.shard_group)
        order = [k for ks in self._matrix_groups().values() for k in ks]
        return {"entries": [entries[k] for k in order], "sq_sums": sq.cpu().tolist(),
                "numels": [math.prod(self.matrix_shape(k)) for k in order]}

    def _diagnostics(self, out: dict | None) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        """diag/muon_update_rms[/<role>|/block/<i>|/tensor/<name>]: element RMS of the applied
        direction muon_scale * O, before the learning rate (an exact orthogonal O of an (m, n)
        matrix has RMS 1/sqrt(max(m, n)); Newton-Schulz lands within its [0.68, 1.2] band of that)."""
        if not out or not out["entries"]:
            return {}, {}
        rms = self._role_rms(out["entries"], out["sq_sums"], out.get("numels"))
        return {"diag/muon_update_rms" + k: v for k, v in rms.items()}, {}


def _matrix_state_words(o: MatrixOptions, matrix: bool, matrix_words: float) -> float:
    """fp32 words per element: `matrix_words` on the hidden matrices, the scalar optimizer's on the
    embedding, head and 1-D parameters (AdamW m, v; Lion m)."""
    if matrix:
        return matrix_words
    return 2.0 if o.scalar_opt == "adamw" else 1.0


def _build_muon(groups, *, plan, **runtime) -> Muon:
    return Muon(groups, betas=plan.betas, eps=plan.eps, options=plan.optim_options, shard_dims=dict(plan.shard_dims),
                plan=plan, **runtime)


register_optimizer(OptimizerSpec(
    name="muon", options=MuonOptions, build=_build_muon, accepts=gradient_mean,
    needs="a gradient-sync mean (its matrices are orthogonalised from the mean gradient)",
    state="matrices: momentum (param dtype); others: AdamW m, v or Lion m",
    help="Muon (Newton-Schulz orthogonalised momentum) on the hidden matrices, AdamW or Lion on the rest; "
         "fp32/bf16 gradient allreduce",
    state_words=lambda o, s, matrix: _matrix_state_words(o, matrix, 1.0), shards=True))


__all__ = ["MatrixOptimizer", "MatrixOptions", "MatrixShards", "Muon", "MuonOptions", "SCALAR_OPTS"]
