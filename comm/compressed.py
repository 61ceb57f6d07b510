"""Error-feedback compressed allreduce (1-bit Adam, BinSGDM Alg. 1, LoCo): the collective and its
three compressors, its buffer sizes and its exact per-rank byte count.

One call, for P ranks in `group` (BinSGDM Alg. 1 lines 8-12 in the all-to-all form of its App. A
"non-parameter-server model"; DeepSpeed's compressed allreduce for 1-bit Adam has the same shape):

  1. worker: y = x + e (e = this rank's worker error); y, zero-padded, splits into P chunks of
     c elements, chunk r going to rank r; each chunk is compressed C(.) and e <- y - D(C(y)) on
     the n real elements (D decompresses);
  2. one all-to-all of the packed chunks, each followed by its fp32 scales, as one uint8 buffer;
  3. owner r of chunk r: z = (sum over ranks i, in rank order, of D(chunk from i)) / P + e_s
     (e_s = the server error of chunk r); z is compressed and e_s <- z - D(C(z));
  4. one all-gather of the packed server chunks; every rank decompresses the same bytes, so the
     result (an estimate of the mean of x over ranks) is bitwise identical everywhere.

With err_beta = b > 0 both errors follow LoCo's moving average instead (DeepSpeed's ZeRO++ LoCo
kernels): e <- b * e + (1 - b) * (y - D(C(y))); b = 0 is plain error feedback.
At P = 1 nothing is sent but compression still applies, both errors included: the rank is its
own worker and server (the formula above at P = 1), so a one-rank run sees the same quantization
as a many-rank one.

Compressors (per block of B elements, B = the whole chunk unless `block` is set):
- scaled_sign (1-bit Adam): D(C(y)) = s * sign(y), sign(0) = +1 as in DeepSpeed; s = mean |y|
  over the block's real elements (the L2-optimal scale for a sign code; scale="mean_abs") or
  DeepSpeed's ||y||_2 / sqrt(count) (scale="l2"). Wire: 1 bit per element + one fp32 per block.
- binary_stochastic (BinSGDM eq. 5): for |y| <= bound B, +B with probability (y/B + 1)/2, else
  -B, so E[Q(y)] = y. BinSGDM quantizes m/b with B = 1 (|m/b| <= 1, its Alg. 1) and sends no
  scale: 1 bit per element. Values beyond [-B, B] (y = m/b + e can leave it) saturate to sign(y)
  and the excess goes to the error. bound=None takes B = max |y| per block instead (always
  unbiased) and sends it as one fp32 per block. Exactly: t = clamp(y * (1/B), -1, 1) (1/B := 0
  when B = 0), p = (t + 1) * 0.5, code +1 iff u < p, u ~ U[0, 1) from `generator` (or torch's
  default one): torch.rand(n) for the worker side, then torch.rand(count of real elements in my
  chunk) for the server side, on every call (on CPU drawn piece by piece: the same stream).
  Seed a generator per rank and keep its state in the checkpoint for an exact resume.
- int4 (LoCo): symmetric levels q in [-7, 7], scale s = max |y| / 7 per block, q = round(y * (7 /
  max|y|)) with round half to even, D = q * s. LoCo's public kernels (DeepSpeed ZeRO++) round to
  nearest-even too (deterministic, no stochastic rounding), but use 16 levels [-8, 7] with step
  max/8 and clip +max to 7/8 of it; we keep the levels symmetric so no value is clipped. Wire:
  q + 7 in 4-bit lanes (comm.packing.pack_lanes, two per byte) + one fp32 per block. LoCo and
  ZeRO++ quantize in groups about one weight row long; pass `block` for that.

Layout: c = ceil(n / P) rounded up to the packing unit (8 elements for 1 bit, 2 for 4 bits) or
to a multiple of `block`. Padding elements are zero on the worker side, masked to zero before the
server scale, never enter the errors and never reach the result (any n >= 0).

Hierarchical form (BinSGDM §4, node_size = m > 1 ranks per contiguous node, k = P/m nodes):
(i) intra-node reduce-scatter of x in fp32, divided by m: local rank l holds shard l (k chunks)
of its node's mean; (ii)-(iii) the call above over the k ranks with local index l (one per
node), with its worker and server errors, on that shard; (iv) intra-node all-gather of the
packed result bytes, decompressed on every rank. The worker error then covers one shard.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist

from ._groups import device_of, node_groups, world
from .packing import CPU_BLOCK, _lookup, _lut, _pack_flags, pack_lanes
from .stats import CallTimer, CommStats, default_stats
from ._groups import all_gather_single, reduce_scatter_single

COMPRESSORS = ("scaled_sign", "binary_stochastic", "int4")
SIGN_SCALES = ("mean_abs", "l2")
INT4_LEVELS = 7          # q in [-7, 7]; q + 7 fits a 4-bit lane
_SCALE_BYTES = 4         # one float32 per block


@dataclass(frozen=True)
class Compressor:
    """What ef_compressed_allreduce sends per chunk (see the module docstring for the math).

    kind: scaled_sign | binary_stochastic | int4. scale (scaled_sign only): mean_abs | l2.
    bound (binary_stochastic only): fixed bound B > 0 (no scale on the wire; BinSGDM: 1.0) or
    None (B = max |y| per block, sent as fp32). block: elements per scale, a positive multiple of
    the packing unit (8 for 1-bit kinds, 2 for int4); None = one scale per chunk."""
    kind: str
    scale: str = "mean_abs"
    bound: float | None = 1.0
    block: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in COMPRESSORS:
            raise ValueError(f"compressor kind {self.kind!r} is unknown; use one of {COMPRESSORS}")
        if self.scale not in SIGN_SCALES:
            raise ValueError(f"compressor scale {self.scale!r} is unknown; use one of {SIGN_SCALES} "
                             f"(it only matters for scaled_sign)")
        if self.bound is not None and not (isinstance(self.bound, (int, float))
                                           and math.isfinite(self.bound) and self.bound > 0):
            raise ValueError(f"compressor bound={self.bound!r} must be a finite number > 0, or None "
                             f"for a per-block max |y| bound (BinSGDM uses 1.0)")
        if self.block is not None and (not isinstance(self.block, int) or self.block <= 0
                                       or self.block % self.unit):
            raise ValueError(f"compressor block={self.block!r} must be a positive multiple of "
                             f"{self.unit} for {self.kind} (or None for one scale per chunk)")

    @property
    def bits(self) -> int:
        """Wire bits per element."""
        return 4 if self.kind == "int4" else 1

    @property
    def unit(self) -> int:
        """Elements per wire byte: chunks are padded to a multiple of it."""
        return 8 // self.bits

    @property
    def has_scale(self) -> bool:
        """Whether each block carries an fp32 scale on the wire."""
        return self.kind != "binary_stochastic" or self.bound is None


def as_compressor(spec: str | Compressor) -> Compressor:
    """A Compressor from its kind name (defaults for the options) or a Compressor itself."""
    if isinstance(spec, Compressor):
        return spec
    if isinstance(spec, str):
        return Compressor(spec)
    raise ValueError(f"compressor must be one of {COMPRESSORS} or a comm.Compressor, got {spec!r}")


def _ceil_to(a: int, m: int) -> int:
    return -(-a // m) * m


def _layout(n: int, P: int, comp: Compressor) -> tuple[int, int, int]:
    """(c, B, nb): elements per chunk, per scale block, blocks per chunk."""
    per = -(-n // P)
    if comp.block is None:
        c = _ceil_to(per, comp.unit)
        return c, c, 1 if c else 0
    c = _ceil_to(per, comp.block)
    return c, comp.block, c // comp.block


def _wire_bytes(c: int, nb: int, comp: Compressor) -> int:
    """Bytes of one packed chunk: its codes, then its scales."""
    return c * comp.bits // 8 + (_SCALE_BYTES * nb if comp.has_scale else 0)


def _node_size(node_size: int | None, P: int) -> int:
    if node_size is None:
        return 1
    if not isinstance(node_size, int) or node_size < 1 or P % node_size:
        raise ValueError(f"ef_compressed_allreduce: node_size={node_size!r} must be a positive "
                         f"divisor of the world size {P} (the ranks per node), or None for the "
                         f"flat form")
    return node_size


def ef_buffer_sizes(n: int, P: int, compressor: str | Compressor,
                    node_size: int | None = None) -> tuple[int, int]:
    """(worker_error numel, server_error numel) for x of n elements over P ranks.

    Flat form: (n, c) with c the chunk length. Hierarchical (node_size = m > 1): (P/m * c, c),
    the shard a rank compresses; entries past the real elements are never read or written."""
    comp = as_compressor(compressor)
    m = _node_size(node_size, P)
    c, _, _ = _layout(n, P, comp)
    return (n if m == 1 else P // m * c), c


def compressed_bytes(n: int, P: int, compressor: str | Compressor,
                     node_size: int | None = None) -> tuple[int, int]:
    """Exact (bytes_sent, bytes_recv) one rank hands to collectives in one ef_compressed_allreduce
    of n elements over P ranks (the CommStats counting rule; the same on every rank).

    Flat, with w = bytes of one packed chunk (codes + scales): all-to-all P*w in and out, then
    all-gather w in, P*w out: ((P+1) w, 2 P w). Hierarchical adds the fp32 reduce-scatter
    (P*c*4 in, k*c*4 out) and the all-gather of the packed shard (k*w in, P*w out), with the flat
    exchange over k = P/m ranks. Nothing moves at P = 1 or n = 0."""
    comp = as_compressor(compressor)
    m = _node_size(node_size, P)
    if P == 1 or n == 0:
        return 0, 0
    c, _, nb = _layout(n, P, comp)
    w = _wire_bytes(c, nb, comp)
    if m == 1:
        return (P + 1) * w, 2 * P * w
    k = P // m
    sent, recv = P * c * 4 + k * w, k * c * 4 + P * w
    if k > 1:
        sent, recv = sent + (k + 1) * w, recv + 2 * k * w
    return sent, recv


# ---- compress / decompress -----------------------------------------------------------------

_SCRATCH: dict[tuple[str, torch.device], torch.Tensor] = {}


def _scratch(tag: str, numel: int, device: torch.device) -> torch.Tensor:
    """A float32[numel] work buffer. On CPU one grow-only buffer per tag is kept between calls:
    a fresh allocation of the size of x page-faults on first touch every call (~0.1 s at 25M
    elements, as long as the compression itself); GPUs have torch's caching allocator."""
    if device.type != "cpu":
        return torch.empty(numel, dtype=torch.float32, device=device)
    buf = _SCRATCH.get((tag, device))
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[(tag, device)] = torch.empty(numel, dtype=torch.float32, device=device)
    return buf[:numel]


def _counts(valid: int, nblocks: int, B: int, device: torch.device) -> torch.Tensor:
    """Real elements in each of `nblocks` consecutive blocks whose first `valid` elements are
    real, as float32 (the divisor of the mean |y| and l2 scales)."""
    starts = torch.arange(nblocks, dtype=torch.int64, device=device) * B
    return (valid - starts).clamp_(0, B).to(torch.float32)


def _pieces(R: int, B: int, device: torch.device) -> Iterator[tuple[int, int, int, int]]:
    """Cover an R x B matrix of blocks in memory order with pieces (r0, r1, a, b) = rows r0..r1-1,
    columns a..b-1: whole rows, or a slice of one row, of at most CPU_BLOCK elements on CPU so
    the temporaries of each step stay in cache (as in comm.packing); one piece on GPUs. Piece
    boundaries fall on multiples of 8 elements (B is a multiple of the packing unit)."""
    limit = CPU_BLOCK if device.type == "cpu" else max(1, R * B)
    if B >= limit:
        for r in range(R):
            for a in range(0, B, limit):
                yield r, r + 1, a, min(B, a + limit)
    elif R:
        step = limit // B
        for r0 in range(0, R, step):
            yield r0, min(R, r0 + step), 0, B


def _max_abs(V: torch.Tensor) -> torch.Tensor:
    """max |v| per row of V, piece by piece (exact, so the piece size cannot change it; torch's
    aminmax and inf-norm kernels are several times slower on CPU)."""
    R, B = V.shape
    out = torch.zeros(R, dtype=torch.float32, device=V.device)
    pieces = list(_pieces(R, B, V.device))
    tmp = torch.empty(max((r1 - r0) * (b - a) for r0, r1, a, b in pieces) if R else 0,
                      dtype=torch.float32, device=V.device)
    for r0, r1, a, b in pieces:
        t = torch.abs(V[r0:r1, a:b], out=tmp[:(r1 - r0) * (b - a)].view(r1 - r0, b - a))
        torch.maximum(out[r0:r1], t.amax(dim=1), out=out[r0:r1])
    return out


def _scales(V: torch.Tensor, valid: int, comp: Compressor
            ) -> tuple[torch.Tensor | None, torch.Tensor | float, torch.Tensor | float | None]:
    """Per block (row of V): (the fp32 scale sent, or None; the decode scale s as an (R, 1)
    column or a float; the multiplier taking v to the code's range, or None)."""
    R, B = V.shape
    if comp.kind == "scaled_sign":
        counts = _counts(valid, R, B, V.device)
        if comp.scale == "mean_abs":
            s = torch.linalg.vector_norm(V, ord=1, dim=1) / counts.clamp(min=1)
        else:
            s = torch.linalg.vector_norm(V, ord=2, dim=1) / counts.clamp(min=1).sqrt()
        s = torch.where(counts > 0, s, 0.0)
        return s, s.unsqueeze(1), None
    if comp.kind == "binary_stochastic":
        if comp.bound is not None:
            return None, float(comp.bound), 1.0 / comp.bound
        s = _max_abs(V)
        return s, s.unsqueeze(1), torch.where(s > 0, 1.0 / s, 0.0).unsqueeze(1)
    amax = _max_abs(V)
    s = amax / INT4_LEVELS
    return s, s.unsqueeze(1), torch.where(amax > 0, INT4_LEVELS / amax, 0.0).unsqueeze(1)


def _compress(v: torch.Tensor, B: int, valid: int, comp: Compressor, err: torch.Tensor,
              err_beta: float, generator: torch.Generator | None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Compress v (float32[R*B], blocks of B; its first `valid` elements real) and update
    err[:valid] from v - D(C(v)) (see _error_step). Returns (packed codes uint8, scales sent).

    binary_stochastic draws u ~ U[0, 1) for the real elements in order, piece by piece: on CPU
    the same stream as one torch.rand(valid) (checked bitwise by the tests); padding gets
    u = 1, i.e. code -1, which never matters (padding is dropped or masked)."""
    R = v.numel() // B if B else 0
    scales, sc, mult = _scales(v.view(R, B), valid, comp)
    packed = torch.empty(v.numel() * comp.bits // 8, dtype=torch.uint8, device=v.device)
    size = max((r1 - r0) * (b - a) for r0, r1, a, b in _pieces(R, B, v.device)) if R else 0
    dtmp = torch.empty(size, dtype=torch.float32, device=v.device)
    ctmp = torch.empty(size, dtype=torch.bool if comp.bits == 1 else torch.int8, device=v.device)
    utmp = torch.empty(size if comp.kind == "binary_stochastic" else 0, dtype=torch.float32,
                       device=v.device)
    for r0, r1, a, b in _pieces(R, B, v.device):
        shape, lo = (r1 - r0, b - a), r0 * B + a
        L = shape[0] * shape[1]
        vp, d = v[lo:lo + L].view(shape), dtmp[:L].view(shape)
        s_p = sc[r0:r1] if isinstance(sc, torch.Tensor) else sc
        m_p = mult[r0:r1] if isinstance(mult, torch.Tensor) else mult
        if comp.bits == 1:
            f = ctmp[:L].view(shape)
            if comp.kind == "scaled_sign":
                torch.ge(vp, 0, out=f)                   # sign(0) = +1, as in DeepSpeed
            else:                                        # BinSGDM eq. 5: +1 w.p. (t + 1) / 2
                k = min(L, max(0, valid - lo))
                torch.rand(k, generator=generator, out=utmp[:k])
                utmp[k:L] = 1.0
                torch.mul(vp, m_p, out=d).clamp_(-1.0, 1.0).add_(1.0).mul_(0.5)
                torch.lt(utmp[:L].view(shape), d, out=f)
            # +-s exactly (2s - s, 0 - s); the flags as int8 0/1: torch's bool kernels are slow
            torch.mul(f.view(torch.int8), s_p * 2, out=d).sub_(s_p)
            packed[lo // 8:(lo + L) // 8] = _pack_flags(ctmp[:L].view(torch.uint8))
        else:                                            # LoCo int4: round half to even
            torch.mul(vp, m_p, out=d).round_().clamp_(-INT4_LEVELS, INT4_LEVELS)
            q8 = ctmp[:L]
            q8.copy_(dtmp[:L])
            lanes = q8.view(torch.uint8).add_(INT4_LEVELS)   # q + 7 in [0, 14] (uint8 wrap)
            packed[lo // 2:(lo + L) // 2] = pack_lanes(lanes, 4, check=False)
            d.mul_(s_p)
        hi = min(lo + L, valid)
        if hi > lo:
            _error_step(err[lo:hi], v[lo:hi], dtmp[:hi - lo], err_beta)
    return packed, scales


def _error_step(err: torch.Tensor, y: torch.Tensor, dec: torch.Tensor, err_beta: float) -> None:
    """err <- y - dec (err_beta = 0), else err_beta * err + (y - dec) * (1 - err_beta) (LoCo's
    moving average). Overwrites dec."""
    if err_beta == 0.0:
        torch.sub(y, dec, out=err)
    else:
        torch.sub(y, dec, out=dec).mul_(1.0 - err_beta)
        err.mul_(err_beta).add_(dec)


def _wire_scales(wire: torch.Tensor, cb: int, nb: int, comp: Compressor) -> torch.Tensor | None:
    """The fp32 scales of each packed chunk of wire uint8[rows, w], as float32[rows, nb]."""
    if not comp.has_scale:
        return None
    rows = wire.shape[0]
    out = torch.empty(rows, _SCALE_BYTES * nb, dtype=torch.uint8, device=wire.device)
    return out.copy_(wire[:, cb:]).view(torch.float32)   # a 4-byte aligned copy


def _decode(codes: torch.Tensor, scales: torch.Tensor | None, comp: Compressor, B: int,
            out: torch.Tensor, accumulate: bool = False) -> None:
    """out (float32, at most one packed chunk long) = D of the first out.numel() elements of one
    packed chunk (`codes`, blocks of B, `scales` float32[nb]); += with accumulate."""
    count = out.numel()
    R = codes.numel() * 8 // comp.bits // B if B else 0
    dev = codes.device
    size = max((r1 - r0) * (b - a) for r0, r1, a, b in _pieces(R, B, dev)) if R else 0
    table = _lut(1, dev, signs=True) if comp.bits == 1 else _lut(4, dev)
    lanes = torch.empty(size, dtype=torch.int8 if comp.bits == 1 else torch.uint8, device=dev)
    dtmp = torch.empty(size, dtype=torch.float32, device=dev)
    sc = scales.view(-1, 1) if scales is not None else float(comp.bound)
    for r0, r1, a, b in _pieces(R, B, dev):
        shape, lo = (r1 - r0, b - a), r0 * B + a
        L = shape[0] * shape[1]
        if lo >= count:
            break
        hi = min(L, count - lo)
        direct = hi == L and not accumulate
        d = (out[lo:lo + L] if direct else dtmp[:L]).view(shape)
        s_p = sc[r0:r1] if isinstance(sc, torch.Tensor) else sc
        if comp.bits == 1:                       # one lookup: bytes -> 8 int8 signs
            _lookup(table, codes[lo // 8:(lo + L) // 8], lanes[:L].view(torch.int64))
            torch.mul(lanes[:L].view(shape), s_p, out=d)
        else:                                    # bytes -> 2 uint8 lanes -> (lane - 7) * s
            _lookup(table, codes[lo // 2:(lo + L) // 2], lanes[:L].view(torch.int16))
            d.copy_(lanes[:L].view(shape))
            d.sub_(INT4_LEVELS).mul_(s_p)
        if accumulate:
            out[lo:lo + hi].add_(dtmp[:hi])
        elif not direct:
            out[lo:lo + hi].copy_(dtmp[:hi])


def _pack_wire(codes: torch.Tensor, scales: torch.Tensor | None, rows: int, w: int,
               comp: Compressor) -> torch.Tensor:
    """uint8[rows, w]: row r = codes of chunk r, then its scales' bytes."""
    if not comp.has_scale:
        return codes.view(rows, w)
    wire = torch.empty(rows, w, dtype=torch.uint8, device=codes.device)
    cb = codes.numel() // rows if rows else 0
    wire[:, :cb] = codes.view(rows, cb)
    wire[:, cb:] = scales.contiguous().view(rows, -1).view(torch.uint8)
    return wire


# ---- the collective ------------------------------------------------------------------------

def _exchange(wire: torch.Tensor, Q: int, group, timer: CallTimer) -> torch.Tensor:
    """All-to-all of the Q rows of `wire` among the Q ranks of `group` (timed as the collective):
    row i of the result is what rank i sent this one. Q = 1: `wire` itself, nothing sent."""
    if Q <= 1:
        return wire
    recv = torch.empty_like(wire)
    with timer.coll(sent=wire, recv=recv):
        dist.all_to_all_single(recv, wire, group=group)
    return recv


def _ef_exchange(src: torch.Tensor, werr: torch.Tensor, serr: torch.Tensor, comp: Compressor,
                 c: int, B: int, nb: int, group, Q: int, r: int, timer: CallTimer,
                 generator: torch.Generator | None, err_beta: float) -> torch.Tensor:
    """Steps 1-4 among the Q ranks of `group` (this one being r; Q = 1: no group, nothing sent)
    for the nr = src.numel() real elements, a prefix of the Q*c-long padded vector: updates
    werr (nr elements) and serr in place, returns the gathered packed chunks uint8[Q, w]
    (identical on every rank of the group)."""
    nr = src.numel()
    dev = src.device
    w = _wire_bytes(c, nb, comp)
    with timer.pack():
        y = _scratch("worker", Q * c, dev)
        torch.add(src, werr, out=y[:nr])
        y[nr:] = 0.0
        codes, scales = _compress(y, B, nr, comp, werr, err_beta, generator)
        wire = _pack_wire(codes, scales, Q, w, comp)
    recv = _exchange(wire, Q, group, timer)
    with timer.pack():
        cb = c * comp.bits // 8
        sc = _wire_scales(recv, cb, nb, comp)
        z = _scratch("server", c, dev)
        for i in range(Q):              # in rank order: the sum every simulation can reproduce
            _decode(recv[i, :cb], None if sc is None else sc[i], comp, B, z, accumulate=i > 0)
        z.div_(Q).add_(serr)
        valid = max(0, min(c, nr - r * c))
        z[valid:] = 0.0                 # padding never reaches the server scale or error
        codes, scales = _compress(z, B, valid, comp, serr, err_beta, generator)
        serr[valid:] = 0.0
        mine = _pack_wire(codes, scales, 1, w, comp).view(-1)
    if Q > 1:
        out = torch.empty(Q * w, dtype=torch.uint8, device=dev)
        with timer.coll(sent=mine, recv=out):
            all_gather_single(out, mine, group=group)
        return out.view(Q, w)
    return mine.view(1, w)


def _check_buffer(name: str, t: torch.Tensor, numel: int, x: torch.Tensor, hint: str) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != numel \
            or not t.is_contiguous() or t.device != x.device:
        got = (f"{t.numel()} elements of {t.dtype} on {t.device}"
               f"{'' if t.is_contiguous() else ', not contiguous'}"
               if isinstance(t, torch.Tensor) else repr(type(t)))
        raise ValueError(f"ef_compressed_allreduce: {name} has {got}; expected a contiguous "
                         f"float32 tensor of {numel} elements on {x.device} ({hint})")


def ef_compressed_allreduce(x: torch.Tensor, worker_error: torch.Tensor, server_error: torch.Tensor,
                            compressor: str | Compressor, step: int = 0, group=None,
                            stats: CommStats | None = None,
                            generator: torch.Generator | None = None, *,
                            err_beta: float = 0.0, node_size: int | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Error-feedback compressed mean of x over the ranks of `group` (module docstring): returns
    a tensor shaped like x, in x.dtype, bitwise identical on every rank, and updates
    worker_error and server_error in place (float32, sizes from ef_buffer_sizes; start them at
    zero and keep them, per rank, across calls and in checkpoints).

    compressor: "scaled_sign" | "binary_stochastic" | "int4" or a Compressor with options.
    step: accepted so that every sync collective takes the optimizer step; these compressors
    do not depend on it. generator: the random source of binary_stochastic (ignored otherwise).
    err_beta in [0, 1): LoCo's moving-average error (0 = plain error feedback). node_size: ranks
    per node for BinSGDM §4's hierarchical form (None or 1 = flat). out: a contiguous tensor
    like x to write the result into and return (out=x is allowed: x is read before it is
    written), sparing a result-sized allocation per call.
    Wire bytes: compressed_bytes(n, P, compressor, node_size)."""
    comp = as_compressor(compressor)
    stats = default_stats() if stats is None else stats
    P, rank = world(group)
    m = _node_size(node_size, P)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"ef_compressed_allreduce: x must be a floating-point tensor, got "
                         f"{x.dtype if isinstance(x, torch.Tensor) else type(x)}")
    if not (isinstance(err_beta, (int, float)) and 0.0 <= err_beta < 1.0):
        raise ValueError(f"ef_compressed_allreduce: err_beta={err_beta!r} must be in [0, 1) "
                         f"(0 = plain error feedback; LoCo uses 0.8)")
    if generator is not None and comp.kind == "binary_stochastic" \
            and torch.device(generator.device).type != x.device.type:
        raise ValueError(f"ef_compressed_allreduce: generator is on {generator.device} but x is on "
                         f"{x.device}; create the generator on x's device")
    if out is not None and (not isinstance(out, torch.Tensor) or out.shape != x.shape
                            or out.dtype != x.dtype or out.device != x.device
                            or not out.is_contiguous()):
        got = (f"{tuple(out.shape)} {out.dtype} on {out.device}" if isinstance(out, torch.Tensor)
               else repr(type(out)))
        raise ValueError(f"ef_compressed_allreduce: out is {got}; it must be a contiguous tensor "
                         f"of x's shape {tuple(x.shape)}, dtype {x.dtype} and device {x.device} "
                         f"(or None)")
    n = x.numel()
    wn, sn = ef_buffer_sizes(n, P, comp, m)
    hint = f"ef_buffer_sizes({n}, {P}, {comp.kind!r}, node_size={node_size}) = ({wn}, {sn})"
    _check_buffer("worker_error", worker_error, wn, x, hint)
    _check_buffer("server_error", server_error, sn, x, hint)
    c, B, nb = _layout(n, P, comp)
    flat = x.reshape(-1)
    werr, serr = worker_error.view(-1), server_error.view(-1)
    with stats.call(f"ef_compressed_allreduce[{comp.kind}]", device_of(x)) as timer:
        res = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
        if n == 0:
            return res
        if m == 1:
            wire = _ef_exchange(flat, werr, serr, comp, c, B, nb, group, P, rank, timer, generator,
                                err_beta)
        else:
            wire = _hierarchical(flat, werr, serr, comp, c, B, nb, m, group, timer, generator,
                                 err_beta)
        with timer.pack():
            dst = res.view(-1) if x.dtype == torch.float32 else _scratch("result", n, x.device)
            cb = c * comp.bits // 8
            sc = _wire_scales(wire, cb, nb, comp)
            for i in range(wire.shape[0]):
                _decode(wire[i, :cb], None if sc is None else sc[i], comp, B,
                        dst[i * c:min(n, (i + 1) * c)])
            if x.dtype != torch.float32:
                res.view(-1).copy_(dst)
            return res


def _hierarchical(flat: torch.Tensor, werr: torch.Tensor, serr: torch.Tensor, comp: Compressor,
                  c: int, B: int, nb: int, m: int, group, timer: CallTimer,
                  generator: torch.Generator | None, err_beta: float) -> torch.Tensor:
    """BinSGDM §4 (i)-(iv): returns the packed chunks of all P ranks, uint8[P, w]."""
    P, rank = world(group)
    k = P // m
    n = flat.numel()
    L = k * c
    intra, inter = node_groups(group, m)
    with timer.pack():
        buf = _scratch("worker", P * c, flat.device)   # free again before the exchange uses it
        buf[:n] = flat
        buf[n:] = 0.0
    shard = torch.empty(L, dtype=torch.float32, device=flat.device)
    with timer.coll(sent=buf, recv=shard):
        reduce_scatter_single(shard, buf, group=intra)
    l = rank % m
    nr = max(0, min(L, n - l * L))        # real elements of my shard: a prefix of it
    with timer.pack():
        shard.div_(m)                     # the node's mean
    mine = _ef_exchange(shard[:nr], werr[:nr], serr, comp, c, B, nb, inter, k, rank // m, timer,
                        generator, err_beta)
    w = mine.shape[1]
    out = torch.empty(P, w, dtype=torch.uint8, device=flat.device)
    mine = mine.reshape(-1)
    with timer.coll(sent=mine, recv=out):
        all_gather_single(out.view(-1), mine, group=intra)
    return out
