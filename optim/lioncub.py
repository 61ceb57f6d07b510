"""Update-sync distributed Lion: Distributed Lion (Liu et al.) and Lion Cub (Ishikawa et al.).

Every rank keeps its own momentum m_i and never sends gradients (Distributed Lion §2.2, Alg. 1;
Lion Cub App. F.1, Alg. 1). One step, on every rank i:
    c_i   = b1 * m_i + (1 - b1) * g_i             local update direction ("c_local")
    agg   = aggregate_i(c_i) through comm/         one collective on ONE flat buffer (Lion Cub App. D.2)
    theta = theta * (1 - lr*wd) - lr * agg         agg = sign(...) in {-1, 0, +1}, or mean of votes (Avg)
    m_i   = b2 * m_i + (1 - b2) * g_i              local gradient
    optional: m_i <- mean_j m_j for selected layers on a schedule (Lion Cub §5)
`agg` is identical on every rank, so parameters stay bit-identical across ranks.

Aggregation by comm_mode (tb(x, step) is DESIGN.md's tie-broken sign: odd step -> +1 for 0):
  "ps"           comm.ps_vote: Distributed Lion's parameter server; "vote" applies the majority
                 sign, "avg" applies the mean of the P votes (eq. 5).
  "onebit"       comm.sign_vote_1bit: Lion Cub's 1-bit compressed allreduce (§3, App. B.1).
  "pbit"         comm.int_allreduce of quantized votes (Lion Cub §4.2 eq. 1, App. F.1); applied update
                 sign(sum_i q_i), an exact tie giving 0. With L == 0 levels only tb-signs are sent.
  "hierarchical" comm.hierarchical_sign_vote (BinSGDM §4).
tie_break "alternate" passes the step number (Lion Cub App. B.1); "plus" / "minus" pass a fixed odd
/ even step, the naive variants of Lion Cub Fig. 10.

Quantization (pbit) is per parameter tensor: each tensor gets its own M_p, because update
magnitudes differ by orders of magnitude between layers (Lion Cub Fig. 3; a model-wide M_p would
round the lm_head's updates to 0).

mask_zero_updates (Lion Cub App. B.1): a parameter ROW (index along dim 0 of a >= 2-D tensor; a
0-/1-D tensor is one row) whose c_local is exactly zero on every rank gets update exactly 0, as
exact Lion's sign(mean_i c_i) = 0 would give; weight decay still applies, as in Lion. This is the
padded-vocabulary / never-seen-token case: such embedding rows have zero gradient and zero
momentum on all ranks. The agreement costs one fp32 allreduce of one flag per row (tiny next
to the vote). In "pbit" mode with L >= 1 the exact sum already gives 0 there, so no collective
is spent.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Iterable

import torch
import torch.distributed as dist

import comm
from .diagnostics import update_sync_diagnostics
from .lion import apply_update_, lion_direction, momentum_update_
from .quantize import MAX_LEVELS, ROUNDINGS, levels_for, lp_quantize

UPDATE_SYNC_MODES = ("ps", "onebit", "pbit", "hierarchical")
QUANTIZER_P = {"sign": None, "l0": 0.0, "l1": 1.0, "l2": 2.0, "linf": math.inf, "lp": None}
TIE_BREAKS = ("alternate", "plus", "minus")
PS_AGGREGATES = ("vote", "avg")
PS_TOPOLOGIES = ("naive", "tree")
LAYER_SELECTORS = ("embedding", "head", "attn", "mlp", "norm", "all")
_ROLE_ORDER = ("embedding", "head", "attn", "mlp", "norm")


def _world(group) -> tuple[int, int]:
    """(rank, world size); one process without torch.distributed is rank 0 of 1, as in comm/."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("a process group was passed but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _check_momentum_sync(ms: dict | None) -> dict | None:
    if ms is None:
        return None
    if not isinstance(ms, dict):
        raise ValueError(f"comm.momentum_sync={ms!r}; expected a dict with keys every, layers, start, stop, or null")
    unknown = set(ms) - {"every", "layers", "start", "stop"}
    if unknown:
        raise ValueError(f"comm.momentum_sync has unknown keys {sorted(unknown)}; valid: every, layers, start, stop")
    every = ms.get("every", 1)
    if not isinstance(every, int) or every < 1:
        raise ValueError(f"comm.momentum_sync.every={every!r}; need an int >= 1 (sync every k steps)")
    layers = ms.get("layers", ["all"])
    if isinstance(layers, str):
        layers = [layers]
    bad = [x for x in layers if x not in LAYER_SELECTORS]
    if bad or not layers:
        raise ValueError(f"comm.momentum_sync.layers={layers!r}; choose from {list(LAYER_SELECTORS)}")
    start, stop = ms.get("start", 0) or 0, ms.get("stop") or None  # stop 0 / null: never stops
    if not isinstance(start, int) or start < 0 or (stop is not None and (not isinstance(stop, int) or stop < start)):
        raise ValueError(f"comm.momentum_sync start={start!r} stop={stop!r}; need ints with 0 <= start <= stop "
                         "(stop 0 or null = never stop)")
    return {"every": every, "layers": list(layers), "start": start, "stop": stop}


class DistributedLion(torch.optim.Optimizer):
    """Distributed Lion / Lion Cub with per-rank momentum; `sync_kind = "update"`.

    Param groups may carry "role" (embedding/head/attn/mlp/norm; used by momentum_sync and the
    per-layer diagnostics) and "names"; lr and weight_decay are read from the group every step.
    Steps are counted from 1 (the t of the tie break). momentum_sync {every, layers, start, stop}
    mean-allreduces (fp32, one flat buffer, default CommStats) the momenta of the selected roles
    after the momentum update of every step t with t % every == 0 and start <= t <= stop (stop
    0 or null: no end). Stochastic rounding draws from a per-rank generator seeded from
    torch.initial_seed() and the rank; it is saved in state_dict() with the step counter.
    """

    sync_kind = "update"

    def __init__(self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, comm_mode: str, bits: int = 8, quantizer: str = "l1",
                 p: float | None = None, levels: int | str | None = None, clip: float = 2.0,
                 rounding: str = "nearest", tie_break: str = "alternate", ps_aggregate: str = "vote",
                 ps_topology: str = "naive", node_size: int | None = None, mask_zero_updates: bool = False,
                 momentum_sync: dict | None = None, group=None) -> None:
        if comm_mode not in UPDATE_SYNC_MODES:
            raise ValueError(f"comm.mode={comm_mode!r} is not an update-sync mode; choose one of {UPDATE_SYNC_MODES}")
        if not (0.0 <= betas[0] <= 1.0 and 0.0 <= betas[1] <= 1.0):
            raise ValueError(f"Lion: betas={betas}; both must lie in [0, 1]")
        if tie_break not in TIE_BREAKS:
            raise ValueError(f"comm.tie_break={tie_break!r}; choose one of {TIE_BREAKS}")
        if ps_aggregate not in PS_AGGREGATES:
            raise ValueError(f"comm.ps_aggregate={ps_aggregate!r}; choose one of {PS_AGGREGATES}")
        if ps_topology not in PS_TOPOLOGIES:
            raise ValueError(f"comm.ps_topology={ps_topology!r}; choose one of {PS_TOPOLOGIES}")
        if quantizer not in QUANTIZER_P:
            raise ValueError(f"comm.quantizer={quantizer!r}; choose one of {list(QUANTIZER_P)}")
        if rounding not in ROUNDINGS:
            raise ValueError(f"comm.rounding={rounding!r}; choose one of {ROUNDINGS}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))
        self.group = group
        self.rank, self.world_size = _world(group)
        self.comm_mode = comm_mode
        self.tie_break = tie_break
        self.ps_aggregate, self.ps_topology, self.node_size = ps_aggregate, ps_topology, node_size or None
        self.mask_zero_updates = bool(mask_zero_updates)
        self.momentum_sync = _check_momentum_sync(momentum_sync)
        self.bits, self.quantizer, self.clip, self.rounding = bits, quantizer, float(clip), rounding
        self.p = QUANTIZER_P[quantizer] if quantizer != "lp" else p
        self.levels = 0
        if comm_mode == "pbit":
            if quantizer == "lp" and (p is None or not float(p) >= 0):
                raise ValueError(f"comm.quantizer=lp needs comm.p >= 0 (got p={p!r})")
            auto = levels_for(bits, self.world_size)  # also validates bits against the world size
            if levels is None or levels == "auto" or levels == -1:  # -1: the trainer's "auto"
                # DESIGN.md: the largest L with P * 2L <= 2**bits - 1; L == 0 means signs only in 0/1
                # lanes (Lion Cub 4-bit at 8 workers: "workers only send 1/-1 values")
                self.levels = auto
            else:
                if not isinstance(levels, int) or levels < 0 or levels > MAX_LEVELS \
                        or self.world_size * 2 * levels > 2 ** bits - 1:
                    raise ValueError(f"comm.levels={levels!r} with comm.bits={bits} and {self.world_size} ranks: "
                                     f"need 0 <= levels <= {auto} (P * 2L <= 2**bits - 1); use levels=auto")
                self.levels = levels
            if not self.clip > 0:
                raise ValueError(f"comm.clip={clip}; need > 0 (Lion Cub uses 2)")
        elif comm_mode == "hierarchical" and node_size:  # 0 / None: LOCAL_WORLD_SIZE, resolved by comm/
            if not isinstance(node_size, int) or node_size < 1 or self.world_size % node_size:
                raise ValueError(f"comm.node_size={node_size!r} must divide the world size {self.world_size}")

        # flat layout: parameters ordered by role so every role is one contiguous slice
        entries = []
        for gi, g in enumerate(self.param_groups):
            role = g.get("role", "all")
            for p_ in g["params"]:
                entries.append((gi, role, p_))
        order = {r: i for i, r in enumerate(_ROLE_ORDER)}
        entries.sort(key=lambda e: (order.get(e[1], len(order)), e[1]))  # stable: group order within a role
        self._entries = entries
        self.roles_present = sorted({e[1] for e in entries}, key=lambda r: (order.get(r, len(order)), r))
        if self.momentum_sync is not None:
            wanted = self.momentum_sync["layers"]
            if "all" not in wanted and not any(e[1] in wanted for e in entries):
                raise ValueError(f"comm.momentum_sync.layers={wanted} selects no parameter; roles present: "
                                 f"{self.roles_present} (a head tied to the embedding has role 'embedding')")
        self._layout = None
        # stochastic rounding: independent stream per rank, reproducible from the global seed
        device = entries[0][2].device if entries else torch.device("cpu")
        self._gen = torch.Generator(device=device)
        self._gen.manual_seed((torch.initial_seed() * 1_000_003 + 7919 * (self.rank + 1)) % (2 ** 63 - 1))
        self._step = 0
        self.diagnose_next_step = False
        self.diag_stats = comm.CommStats()
        self.last_diagnostics: dict[str, float] = {}
        self.last_histograms: dict[str, torch.Tensor] = {}

    # ---- layout ---------------------------------------------------------------------------
    def _build_layout(self) -> dict:
        params = [e[2] for e in self._entries]
        dtypes = {p.dtype for p in params}
        dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        total = sum(p.numel() for p in params)
        device = params[0].device
        c_flat = torch.empty(total, dtype=dtype, device=device)
        off, segments, role_ranges = 0, [], {}
        for gi, role, p in self._entries:
            n = p.numel()
            segments.append((off, n))
            start, _ = role_ranges.get(role, (off, off))
            role_ranges[role] = (start, off + n)
            off += n
        per_group: dict[int, list[int]] = {}
        for k, (gi, _, _) in enumerate(self._entries):
            per_group.setdefault(gi, []).append(k)
        return {"dtype": dtype, "total": total, "c_flat": c_flat, "segments": segments,
                "role_ranges": role_ranges, "per_group": per_group}

    def _views(self, flat: torch.Tensor, ks: list[int]) -> list[torch.Tensor]:
        segs = self._layout["segments"]
        return [flat[segs[k][0]:segs[k][0] + segs[k][1]].view_as(self._entries[k][2]) for k in ks]

    def _tb_step(self, step: int) -> int:
        return {"alternate": step, "plus": 1, "minus": 2}[self.tie_break]

    # ---- the step -------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._entries:
            return loss
        if self._layout is None:
            self._layout = self._build_layout()
        lay = self._layout
        self._step += 1
        t = self._step
        c_flat = lay["c_flat"]

        grads_by_group, moms_by_group = {}, {}
        for gi, ks in lay["per_group"].items():
            params = [self._entries[k][2] for k in ks]
            # a parameter without a gradient this step counts as g = 0 so the flat layout (and the
            # collective) is the same on every rank
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            moms = []
            for p in params:
                state = self.state[p]
                if "exp_avg" not in state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                moms.append(state["exp_avg"])
            beta1 = self.param_groups[gi]["betas"][0]
            lion_direction(moms, grads, beta1, out=self._views(c_flat, ks))
            grads_by_group[gi], moms_by_group[gi] = grads, moms

        update = self._aggregate(c_flat, t)
        if self.mask_zero_updates and not (self.comm_mode == "pbit" and self.levels >= 1):
            self._mask_rows_zero_everywhere(c_flat, update)

        for gi, ks in lay["per_group"].items():
            g = self.param_groups[gi]
            params = [self._entries[k][2] for k in ks]
            apply_update_(params, self._views(update, ks), float(g["lr"]), float(g["weight_decay"]))
            momentum_update_(moms_by_group[gi], grads_by_group[gi], g["betas"][1])

        if self._momentum_sync_due(t):
            self._sync_momenta()

        if self.diagnose_next_step:
            if c_flat.is_cuda:
                torch.cuda.synchronize(c_flat.device)
            t0 = time.perf_counter()
            moms = [self.state[e[2]]["exp_avg"] for e in self._entries]
            self.last_diagnostics, self.last_histograms = update_sync_diagnostics(
                c_flat, update, moms, lay["role_ranges"], world_size=self.world_size, group=self.group,
                stats=self.diag_stats)
            if c_flat.is_cuda:
                torch.cuda.synchronize(c_flat.device)
            self.last_diagnostics["diag/seconds"] = time.perf_counter() - t0
            self.diagnose_next_step = False
        return loss

    def _aggregate(self, c: torch.Tensor, t: int) -> torch.Tensor:
        """The identical-on-every-rank update (sign in {-1, 0, 1}, or mean of votes for ps/avg)."""
        tb = self._tb_step(t)
        mode = self.comm_mode
        if mode == "onebit":
            return comm.sign_vote_1bit(c, tb, group=self.group).to(c.dtype)
        if mode == "hierarchical":
            # raw c: BinSGDM §4 sums in full precision inside a node, then votes 1 bit across nodes
            return comm.hierarchical_sign_vote(c, tb, node_size=self.node_size, group=self.group).to(c.dtype)
        if mode == "ps":
            out = comm.ps_vote(c, tb, aggregate=self.ps_aggregate, topology=self.ps_topology, group=self.group)
            return out.to(c.dtype)
        # pbit (Lion Cub App. F.1): quantize per tensor, one integer SUM allreduce, sign of the sum
        with comm.default_stats().timed_pack(device=c.device if c.is_cuda else None):
            q = self._quantize(c, tb)
        total = comm.int_allreduce(q, self.levels, self.bits, group=self.group)
        return torch.sign(total).to(c.dtype)

    def _quantize(self, c: torch.Tensor, tb: int) -> torch.Tensor:
        if self.levels == 0:  # signs only, 0 forced by the tie break (Lion Cub App. F.1, "1/-1 values")
            fill = torch.tensor(1 if tb % 2 == 1 else -1, dtype=torch.int8, device=c.device)
            return torch.where(c > 0, 1, torch.where(c < 0, -1, fill)).to(torch.int8)
        if self.quantizer == "sign":
            return torch.sign(c).to(torch.int8)
        q = torch.empty(c.numel(), dtype=torch.int8, device=c.device)
        for off, n in self._layout["segments"]:
            q[off:off + n] = lp_quantize(c[off:off + n], self.levels, self.p, self.clip, self.rounding, self._gen)
        return q

    def _row_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        out = []
        for (off, n), (_, _, p) in zip(self._layout["segments"], self._entries):
            rows = p.shape[0] if p.ndim >= 2 else 1
            out.append(flat[off:off + n].view(rows, n // rows if rows else 0))
        return out

    def _mask_rows_zero_everywhere(self, c: torch.Tensor, update: torch.Tensor) -> None:
        """Lion Cub App. B.1: rows whose c_local is exactly 0 on every rank get update 0."""
        local = torch.cat([(v == 0).all(dim=1) for v in self._row_views(c)]).to(torch.float32)
        # mean of 0/1 flags is exactly 1.0 only when every rank sent 1
        everywhere = comm.allreduce_mean(local, wire_dtype=torch.float32, group=self.group) == 1.0
        start = 0
        for v in self._row_views(update):
            r = v.shape[0]
            v.masked_fill_(everywhere[start:start + r].unsqueeze(1), 0)
            start += r

    # ---- momentum sync (Lion Cub §5) ------------------------------------------------------
    def _momentum_sync_due(self, t: int) -> bool:
        ms = self.momentum_sync
        if ms is None or t < ms["start"] or (ms["stop"] is not None and t > ms["stop"]):
            return False
        return t % ms["every"] == 0

    def _sync_momenta(self) -> None:
        layers = self.momentum_sync["layers"]
        moms = [self.state[p]["exp_avg"] for _, role, p in self._entries if "all" in layers or role in layers]
        flat = torch.cat([m.reshape(-1).to(torch.float32) for m in moms])
        flat = comm.allreduce_mean(flat, wire_dtype=torch.float32, group=self.group)
        torch._foreach_copy_(moms, [v.view_as(m) for v, m in zip(flat.split([m.numel() for m in moms]), moms)])

    # ---- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["distributed_lion"] = {"step": self._step, "rng_state": self._gen.get_state(),
                                  "rank": self.rank, "world_size": self.world_size}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        extra = state_dict.pop("distributed_lion", None)
        if extra is None:
            raise ValueError("DistributedLion.load_state_dict: missing 'distributed_lion' entry (step counter, "
                             "RNG); was this saved by a different optimizer?")
        if extra["world_size"] != self.world_size:
            raise ValueError(f"optimizer state was saved with {extra['world_size']} ranks, now {self.world_size}; "
                             "per-rank momenta cannot be remapped — resume with the same world size")
        super().load_state_dict(state_dict)
        self._step = int(extra["step"])
        self._gen.set_state(extra["rng_state"])
