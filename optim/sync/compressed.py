"""Error-feedback compressed schemes on comm.ef_compressed_allreduce (all-to-all of compressed
chunks, owner reduces with its server error and re-compresses, all-gather): `loco` and
`compressed`.

- `loco` (GRADIENT kind, MEAN result; LoCo §3): the flat gradient, mean-allreduced through the
  int4 compressor (a fp32 scale per block of `block` elements) with LoCo's moving-average error
  compensation e <- err_beta * e + (1 - err_beta) * (y - D(C(y))) on both the worker and the
  server side; both errors are zeroed every `reset_every` calls (DeepSpeed's ZeRO++ LoCo code:
  err_beta 0.8, reset every 1024). Any gradient optimizer runs on it (`optim.name=adamw` is
  LoCo-AdamW, `optim.name=lion` LoCo-Lion). Between calls the errors are kept in 8 bits, as LoCo
  stores them: int8 codes in [-127, 127] and one fp32 scale (max |e| / 127) per block of the same
  `block` elements as the gradient's scales (DeepSpeed quantizes its error buffers in the same
  groups as the gradient), dequantized before each call and requantized after (round half to
  even). So the persistent state is 1 + 4/block bytes per element for the worker error plus the
  same per chunk element for the server error; the fp32 errors exist only during the call.
- `compressed` (UPDATE kind, MEAN result): the vector an update-sync optimizer chooses (1-bit
  Adam's momentum, BinSGDM's m/b), mean-allreduced through `compressor` with plain error feedback
  (worker and server errors in fp32): scaled_sign (1-bit Adam), binary_stochastic (BinSGDM
  eq. 5, bound 1: 1 bit per element, no scale) or int4. `ef_node_size` > 1 selects BinSGDM §4's
  hierarchical form. Stochastic compressors draw from a generator seeded per rank from the run's
  seed, saved with the errors in the exchange state (per-rank checkpoint), so a resume is exact.

Both exchanges write the estimate of the mean into x in place and return x (as the gradient
schemes do). At P = 1 nothing is sent but compression with error feedback still applies (the
rank is its own worker and server, comm.ef_compressed_allreduce's contract), so a one-rank run
sees the same quantization as a many-rank one.

Shared options mean the same in both: `block` is the elements per fp32 scale. Its default, 2048,
is about one weight row of the GPT-2 sizes (768-1600 wide; rows of the 3-4x MLP matrices are
longer), the group LoCo and ZeRO++ quantize in; for 1-bit Adam it stands in for DeepSpeed's one
scale per parameter tensor, which our single flat vector per step does not have (a block mostly
lies inside one tensor, so a layer's scale is not set by another layer's magnitudes).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

import comm
from comm import COMPRESSORS, Compressor, cost_model

from ..options import choice
from .registry import GRADIENT, MEAN, UPDATE, Exchange, ExchangeContext, SchemeOptions, SyncScheme, register

SIGN_SCALES = ("mean_abs", "l2")
ERR_LEVELS = 127          # 8-bit error codes in [-127, 127]
_PIECE = 1 << 18          # elements per piece of the 8-bit error (de)quantization: bounded temporaries


def _block_problems(p: list[str], key: str, block: int, allow_zero: bool) -> None:
    if block < 0 or block % 8 or (block == 0 and not allow_zero):
        p.append(f"{key}: {block} must be a positive multiple of 8 (elements per fp32 scale; 8 is the "
                 f"1-bit packing unit)" + (", or 0 for one scale per chunk" if allow_zero else
                                           "; LoCo quantizes in groups about one row long, e.g. 2048"))


def _wire_chunk_bytes(n: int, P: int, comp: Compressor) -> tuple[int, int]:
    """(w, c): bytes of one packed chunk (codes + scales) and elements per chunk of the flat form,
    from comm's public formulas (sent = (P + 1) w; the server error holds one chunk)."""
    sent, _ = comm.compressed_bytes(n, P, comp)
    return sent // (P + 1), comm.ef_buffer_sizes(n, P, comp)[1]


def _predict(comp: Compressor, node_size: int, P: int, n: int, a: float, b: float) -> float:
    """Alpha-beta seconds of one call: all-to-all of P packed chunks + all-gather of P chunks;
    BinSGDM §4 adds the fp32 intra-node reduce-scatter and the all-gather of the packed shard,
    the flat exchange then runs over k = P/m ranks per local index."""
    if P <= 1 or n == 0:
        return 0.0
    w, c = _wire_chunk_bytes(n, P, comp)
    m = node_size or 1
    if m == 1:
        return cost_model.all_to_all_time(P, 8 * P * w, a, b) + cost_model.all_gather_time(P, 8 * P * w, a, b)
    k = P // m
    t = cost_model.reduce_scatter_time(m, 32 * P * c, a, b) + cost_model.all_gather_time(m, 8 * P * w, a, b)
    return t + cost_model.all_to_all_time(k, 8 * k * w, a, b) + cost_model.all_gather_time(k, 8 * k * w, a, b)


# ---- compressed: update sync ----------------------------------------------------------------
@dataclass
class CompressedOptions(SchemeOptions):
    compressor: str = "scaled_sign"
    """scaled_sign (1-bit Adam: sign times the block's scale, 1 bit per element), binary_stochastic
    (BinSGDM eq. 5: +-1 with P(+1) = (y + 1)/2, 1 bit, no scale) or int4 (levels -7..7 times a scale)."""
    scale: str = "mean_abs"
    """scaled_sign only: mean_abs (mean |y| of the block, the L2-optimal scale of a sign code) or l2
    (DeepSpeed's ||y||_2 / sqrt(count))."""
    block: int = 2048
    """Elements per fp32 scale (a positive multiple of 8; 0 = one scale per chunk of n/P elements).
    Default ~ one weight row (LoCo's and ZeRO++'s quantization groups)."""
    ef_node_size: int = 0
    """compressed: ranks per node for BinSGDM §4's hierarchical form (fp32 reduce-scatter inside a
    node, compressed exchange across nodes); 0 = flat."""

    def problems(self, world_size: int | None = None) -> list[str]:
        p: list[str] = []
        choice(p, self.key("compressor"), self.compressor, COMPRESSORS)
        choice(p, self.key("scale"), self.scale, SIGN_SCALES)
        _block_problems(p, self.key("block"), self.block, allow_zero=True)
        if self.ef_node_size < 0:
            p.append(f"{self.key('ef_node_size')}: {self.ef_node_size} must be >= 0 (0 = flat, m > 1 = m ranks "
                     f"per node, BinSGDM §4)")
        elif world_size is not None and self.ef_node_size > 1 and world_size % self.ef_node_size:
            p.append(f"{self.key('ef_node_size')}: {self.ef_node_size} does not divide the world size "
                     f"{world_size}; set the ranks per node, or 0 for the flat form")
        return p

    def comp(self) -> Compressor:
        """The comm.Compressor these options describe (binary_stochastic with BinSGDM's bound 1)."""
        return Compressor(self.compressor, scale=self.scale, bound=1.0, block=self.block or None)

    def node(self) -> int | None:
        return self.ef_node_size if self.ef_node_size > 1 else None


class _Buffers:
    """Worker and server error of one vector length (fp32, zero at start)."""

    def __init__(self, n: int, P: int, comp: Compressor, node: int | None, device: torch.device) -> None:
        wn, sn = comm.ef_buffer_sizes(n, P, comp, node_size=node)
        self.n = n
        self.werr = torch.zeros(wn, dtype=torch.float32, device=device)
        self.serr = torch.zeros(sn, dtype=torch.float32, device=device)


class CompressedExchange(Exchange):
    """Error-feedback compressed mean of an update-sync vector (module docstring). State: the
    worker and server errors (`werr`, `serr`, sized on the first call) and the generator."""

    def __init__(self, options: CompressedOptions, ctx: ExchangeContext) -> None:
        bad = options.problems(ctx.world_size)
        if bad:
            raise ValueError("; ".join(bad))
        self.o, self.ctx = options, ctx
        self.comp, self.node = options.comp(), options.node()
        self.gen: torch.Generator | None = None
        if self.comp.kind == "binary_stochastic":
            self.gen = torch.Generator(device=ctx.device)
            self.gen.manual_seed(ctx.seed)
        self.buffers: _Buffers | None = None

    @property
    def werr(self) -> torch.Tensor | None:
        return None if self.buffers is None else self.buffers.werr

    @property
    def serr(self) -> torch.Tensor | None:
        return None if self.buffers is None else self.buffers.serr

    def _buffers_for(self, x: torch.Tensor) -> _Buffers:
        if self.buffers is None:
            self.buffers = _Buffers(x.numel(), self.ctx.world_size, self.comp, self.node, x.device)
        elif self.buffers.n != x.numel():
            raise ValueError(f"comm.mode=compressed: this exchange holds errors for {self.buffers.n} elements "
                             f"but was called with {x.numel()}; build one exchange per vector")
        return self.buffers

    def __call__(self, x: torch.Tensor, step: int) -> torch.Tensor:
        buf = self._buffers_for(x)
        return comm.ef_compressed_allreduce(x, buf.werr, buf.serr, self.comp, step, group=self.ctx.group,
                                            stats=self.ctx.stats, generator=self.gen, node_size=self.node, out=x)

    def state_dict(self) -> dict:
        out: dict = {"n": None if self.buffers is None else self.buffers.n}
        if self.buffers is not None:
            out.update(worker_error=self.buffers.werr, server_error=self.buffers.serr)
        if self.gen is not None:
            out["rng_state"] = self.gen.get_state()
        return out

    def load_state_dict(self, state: dict) -> None:
        if state.get("n") is None:
            self.buffers = None
        else:
            buf = _Buffers(int(state["n"]), self.ctx.world_size, self.comp, self.node, self.ctx.device)
            for name, mine in (("worker_error", buf.werr), ("server_error", buf.serr)):
                saved = state[name]
                if saved.numel() != mine.numel():
                    raise ValueError(f"comm.mode=compressed: the checkpoint's {name} has {saved.numel()} "
                                     f"elements, this configuration needs {mine.numel()}; resume with the same "
                                     f"comm options and world size")
                mine.copy_(saved)
            self.buffers = buf
        if self.gen is not None:
            if "rng_state" not in state:
                raise ValueError("comm.mode=compressed: the checkpoint has no generator state for "
                                 "binary_stochastic; was it saved with another comm.compressor?")
            self.gen.set_state(state["rng_state"])


def _compressed_bytes(o: CompressedOptions, P: int, n: int, rank: int, rows: int) -> tuple[int, int]:
    return comm.compressed_bytes(n, P, o.comp(), node_size=o.node())


# ---- loco: gradient sync --------------------------------------------------------------------------
@dataclass
class LocoOptions(SchemeOptions):
    err_beta: float = 0.8
    """LoCo's error moving average: e <- err_beta * e + (1 - err_beta) * (new error); 0 = plain error
    feedback (DeepSpeed's LoCo: 0.8)."""
    reset_every: int = 1024
    """Zero both errors every this many calls (DeepSpeed's LoCo: 1024); 0 = never."""
    block: int = 2048
    """Elements per fp32 scale (a positive multiple of 8; 0 = one scale per chunk of n/P elements).
    Default ~ one weight row (LoCo's and ZeRO++'s quantization groups)."""

    def problems(self, world_size: int | None = None) -> list[str]:
        p: list[str] = []
        if not 0.0 <= self.err_beta < 1.0:
            p.append(f"{self.key('err_beta')}: {self.err_beta} must be in [0, 1) (0 = plain error feedback; "
                     f"LoCo uses 0.8)")
        if self.reset_every < 0:
            p.append(f"{self.key('reset_every')}: {self.reset_every} must be >= 0 (0 = never reset; LoCo: 1024)")
        _block_problems(p, self.key("block"), self.block, allow_zero=False)
        return p

    def comp(self) -> Compressor:
        return Compressor("int4", block=self.block)


def _block_runs(n: int, block: int):
    """(lo, hi, rows) runs covering [0, n): whole blocks of `block` elements in pieces of about _PIECE
    elements (a bounded temporary), and a short last block as a run of one row."""
    step = max(block, _PIECE // block * block)
    for a in range(0, n, step):
        b = min(n, a + step)
        rows, tail = divmod(b - a, block)
        if rows:
            yield a, a + rows * block, rows
        if tail:
            yield a + rows * block, b, 1


def quantize_error(e: torch.Tensor, block: int, q: torch.Tensor, scales: torch.Tensor) -> None:
    """q (int8, like e) and scales (float32[ceil(n / block)]) <- LoCo's 8-bit code of e per block of
    `block` elements: scale = max |e| / 127, q = round(e * 127 / max |e|) (half to even)."""
    for lo, hi, r in _block_runs(e.numel(), block):
        v = e[lo:hi].view(r, -1)
        amax = v.abs().amax(dim=1)
        s0 = lo // block
        scales[s0:s0 + r] = amax / ERR_LEVELS
        inv = torch.where(amax > 0, ERR_LEVELS / amax, 0.0).unsqueeze(1)
        q[lo:hi].view(r, -1).copy_((v * inv).round_().clamp_(-ERR_LEVELS, ERR_LEVELS))


def dequantize_error(q: torch.Tensor, scales: torch.Tensor, block: int, out: torch.Tensor) -> None:
    """out (float32, like q) <- q * its block's scale (quantize_error's inverse up to rounding)."""
    for lo, hi, r in _block_runs(q.numel(), block):
        s0 = lo // block
        torch.mul(q[lo:hi].view(r, -1), scales[s0:s0 + r].unsqueeze(1), out=out[lo:hi].view(r, -1))


class _LocoErrors:
    """One vector length's errors in 8 bits (int8 codes + a fp32 scale per block) and its call count."""

    def __init__(self, n: int, P: int, comp: Compressor, device: torch.device) -> None:
        self.n = n
        wn, sn = comm.ef_buffer_sizes(n, P, comp)
        self.block = comp.block
        self.wq = torch.zeros(wn, dtype=torch.int8, device=device)
        self.ws = torch.zeros(comm.ceil_div(wn, self.block), dtype=torch.float32, device=device)
        self.sq = torch.zeros(sn, dtype=torch.int8, device=device)
        self.ss = torch.zeros(comm.ceil_div(sn, self.block), dtype=torch.float32, device=device)
        self.calls = 0

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"worker_codes": self.wq, "worker_scales": self.ws, "server_codes": self.sq, "server_scales": self.ss}

    def zero_(self) -> None:
        for t in self.tensors().values():
            t.zero_()

    def load(self, fp32: tuple[torch.Tensor, torch.Tensor]) -> None:
        """fp32 (worker, server) <- the stored 8-bit errors."""
        dequantize_error(self.wq, self.ws, self.block, fp32[0])
        dequantize_error(self.sq, self.ss, self.block, fp32[1])

    def store(self, fp32: tuple[torch.Tensor, torch.Tensor]) -> None:
        quantize_error(fp32[0], self.block, self.wq, self.ws)
        quantize_error(fp32[1], self.block, self.sq, self.ss)


class LocoExchange(Exchange):
    """LoCo: in-place int4 error-feedback mean of a flat gradient buffer (module docstring). One
    set of 8-bit errors per (dtype, length) of the buffers it is called with (one per flat gradient
    buffer)."""

    def __init__(self, options: LocoOptions, ctx: ExchangeContext) -> None:
        bad = options.problems(ctx.world_size)
        if bad:
            raise ValueError("; ".join(bad))
        self.o, self.ctx, self.comp = options, ctx, options.comp()
        self.errors: dict[str, _LocoErrors] = {}

    @staticmethod
    def _key(x: torch.Tensor) -> str:
        return f"{str(x.dtype).removeprefix('torch.')}/{x.numel()}"

    def __call__(self, x: torch.Tensor, step: int) -> torch.Tensor:
        key = self._key(x)
        if key not in self.errors:
            self.errors[key] = _LocoErrors(x.numel(), self.ctx.world_size, self.comp, x.device)
        st = self.errors[key]
        dev = x.device if x.is_cuda else None
        with self.ctx.stats.timed_pack(device=dev):
            if self.o.reset_every and st.calls and st.calls % self.o.reset_every == 0:
                st.zero_()  # DeepSpeed's LoCo: fresh errors every reset_every calls
            fp32 = (torch.empty(st.wq.numel(), dtype=torch.float32, device=x.device),
                    torch.empty(st.sq.numel(), dtype=torch.float32, device=x.device))
            st.load(fp32)
        comm.ef_compressed_allreduce(x, fp32[0], fp32[1], self.comp, step, group=self.ctx.group,
                                     stats=self.ctx.stats, err_beta=self.o.err_beta, out=x)
        with self.ctx.stats.timed_pack(device=dev):
            st.store(fp32)
        st.calls += 1
        return x

    def state_dict(self) -> dict:
        return {key: {"calls": st.calls, **st.tensors()} for key, st in self.errors.items()}

    def load_state_dict(self, state: dict) -> None:
        self.errors = {}
        for key, saved in state.items():
            n = int(key.rsplit("/", 1)[1])
            st = _LocoErrors(n, self.ctx.world_size, self.comp, self.ctx.device)
            for name, mine in st.tensors().items():
                if saved[name].shape != mine.shape:
                    raise ValueError(f"comm.mode=loco: the checkpoint's {name} has {saved[name].numel()} "
                                     f"elements, this configuration needs {mine.numel()}; resume with the same "
                                     f"comm.block and world size")
                mine.copy_(saved[name])
            st.calls = int(saved["calls"])
            self.errors[key] = st


LOCO = register(SyncScheme(
    name="loco", kind=GRADIENT, result=MEAN, options=LocoOptions,
    build=lambda o, ctx: LocoExchange(o, ctx),
    wire_bytes=lambda o, P, n, rank, rows: comm.compressed_bytes(n, P, o.comp()),
    predict=lambda o, P, n, a, b, rows=1: _predict(o.comp(), 1, P, n, a, b),
    wire="the flat gradient in 4 bits with a scale per block and LoCo's moving-average error feedback "
         "(all-to-all, owner re-compresses, all-gather)",
    help="LoCo: 4-bit gradient mean with moving-average error compensation, errors kept in 8 bits (gradient sync)",
    state_bytes=lambda o, P, n: _loco_state_bytes(o.comp(), P, n)))


COMPRESSED = register(SyncScheme(
    name="compressed", kind=UPDATE, result=MEAN, options=CompressedOptions,
    build=lambda o, ctx: CompressedExchange(o, ctx), wire_bytes=_compressed_bytes,
    predict=lambda o, P, n, a, b, rows=1: _predict(o.comp(), o.ef_node_size, P, n, a, b),
    wire="an optimizer's vector (1-bit Adam's momentum, BinSGDM's m/b), compressed with worker and server "
         "error feedback: all-to-all, owner re-compresses, all-gather",
    help="error-feedback compressed mean of an update-sync vector (1-bit Adam, BinSGDM Alg. 1 / §4)",
    state_bytes=lambda o, P, n: 4 * sum(comm.ef_buffer_sizes(n, P, o.comp(), node_size=o.node()))))


def _loco_state_bytes(comp: Compressor, P: int, n: int) -> int:
    """LoCo's errors in 8 bits: int8 codes and a fp32 scale per block, worker and server (_LocoErrors)."""
    return sum(k + 4 * comm.ceil_div(k, comp.block) for k in comm.ef_buffer_sizes(n, P, comp))
