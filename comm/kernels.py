"""Fused wire kernels of Lion Cub's quantized schemes, next to their eager reference in comm/.

Lion Cub App. E warns that quantizing and packing can eat the bandwidth gain; measured here, the
eager whole-tensor torch code spends several passes over the update per step. This module owns
one fused kernel per hot path, written once in torch ops and compiled by `torch.compile`
(inductor emits C++/OpenMP on CPU and Triton on GPU), next to the eager code it must reproduce
byte for byte:

    sign_pack        x -> tie-broken sign bits             == comm.vote.tb_packed
    quantize_pack    c -> Lion Cub eq. 1 per tensor -> q + L in bits-wide lanes (the wire of
                     comm.int_allreduce; levels == 0: tie-broken signs as 0/1 lanes)
    unpack_majority  P packed chunks -> exact majority with tie break -> packed
                                                            == comm.vote.local_majority
    unpack_sum       summed wire -> int32 sum (or its sign, fused, for the update)
                                                            == int_allreduce after its SUM

The dispatch below (`use_compiled`, `compiled_kernel`, `const`, `warmup`'s bookkeeping) is shared
with the fused Lion passes, which live with Lion in optim/lion.py.

Dispatch: every function takes impl="compiled" | "eager" | "native" | "auto" (None: the module
default, `set_impl`, initially $LIONCUB_KERNELS or "eager"). "native" runs the C loops of
comm.native (CPU only: the same bytes without inductor in the process). "auto" compiles where a
compiler exists and otherwise runs eager after a one-line warning; "compiled" raises instead,
naming the reason (LIONCUB_NO_COMPILE=1, no C++ compiler, no Triton). Once `warmup(...,
layout=...)` has timed a kernel on the run's sizes (`choose`), "auto" runs whichever of eager,
compiled and native was fastest there with identical bytes, per kernel and device type
(compiled Triton lost to eager for sign packing and the majority on an H100); on CPU that
measurement runs in a child process (comm.kernel_probe), so a training process imports inductor
only when a compiled kernel won. Compiled kernels take dynamic shapes, so one
compilation serves every length of a given (kernel, dtype, device); `warmup()` pays it (and
checks the compiled result against the reference) before the first timed step, and
`compile_seconds()` reports it. Inputs shorter than SMALL elements, and dtypes a kernel does not
cover, run the reference: same bytes, and a kernel launch would cost more than the work.

Exactness notes (why the compiled code looks the way it does):
- M_p of Lion Cub eq. 1 is a reduction whose rounding depends on its summation order, so the
  compiled path and the reference `quantize_q` both take it from `comm.quantize.segment_lp_means`:
  the tensors of one size reduced together as the rows of a matrix (ATen reduces each row as it
  reduces a vector of that length, so on CPU each value is `lp_mean`'s bit for bit; on CUDA the
  function defines the norms), a few calls per distinct size, not per tensor. M_inf, a max, is
  exact in any order and comes from one segmented reduction over the block plan. Everything
  after the norm is one kernel over whole blocks of the flat vector (the block's tensor's
  scale, gathered once per block) plus one gathered pass over the blocks a tensor boundary
  cuts: no loop over tensors.
- Stochastic rounding draws its uniforms in one stream over the flat vector, in the chunks of
  `stochastic_bounds` (a draw per chunk, in order), in the reference `quantize_q` and in the fused
  path alike, so the quantizer runs like the nearest one (a kernel per chunk of whole blocks, the
  boundary words gathered) with no loop over tensors. On CPU ATen's generator fills a tensor
  serially, one draw per element, so these are exactly the per-tensor `torch.rand` draws of
  `comm.quantize.lp_quantize` (same values, same generator state after; tested). On CUDA Philox
  gives each call its own offset, so no chunking reproduces per-tensor draws: there the chunked
  stream is the definition (as `segment_lp_means` defines the norms), with chunks of 16M elements.
NaN payloads are not promised to match (NaN positions are).
"""
from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Sequence

import torch

from . import native
from .allreduce import check_lanes
from .packing import ceil_div, lane_max, lanes_per_word, pack_lanes, pack_words16, unpack_lanes, unpack_words16
from .quantize import MAX_LEVELS, ROUNDINGS, lp_quantize, segment_lp_means
from .vote import count_dtype, local_majority, majority_threshold, tb_packed
# the kernel bodies, the compiled-kernel machinery, the quantizer helpers and the auto choice's
# arithmetic live in modules of their own; every name stays importable (and patchable) here
from .kernel_bodies import (_INDUCTOR_OPTIONS, _INDUCTOR_OPTIONS_EAGER_FLOAT_CUDA, _SIGN_BITS, _WORD, _consts,
                            _k_majority, _k_pack_v, _k_quant_blocks, _k_quant_blocks_stoch, _k_sign_bits,
                            _k_sign_v, _k_tb_lanes, _k_unpack, _lane_of, _pack_groups, const, eager_float, f32)
from .kernel_choice import COST_ORDER, TIE, _choice_line, fastest, merge_choices, time_ms
from .kernel_compile import (_KERNELS, NO_COMPILE_ENV, Kernel, _bound, _compile_seconds, _find_unavailable, _plain,
                             _unavailable, compile_seconds, compile_unavailable, compiled_kernel, dtype_key)
from .kernel_quant import (QBLOCK, WIRE_BITS, _block_plan, _check_quantize_args, _check_segments, _PLANS,
                           _scales_of, _segment_max_abs, _segment_scales,
                           _sign_of_sum_eager, native_quantizes, unpack_sum_reference, wire_of)

IMPLS = ("auto", "compiled", "eager", "native")
IMPL_ENV = "LIONCUB_KERNELS"
SMALL = 64  # elements; below this the reference runs (dynamo also specialises sizes 0 and 1)


_impl_default = os.environ.get(IMPL_ENV, "eager")
_warned: set[str] = set()
_auto: dict[tuple[str, str], str] = {}  # (kernel, device type) -> the candidate "auto" measured fastest
_auto_log: list[dict] = []
_rejected: dict[tuple[str, str], set[str]] = {}  # (kernel, device type) -> candidates whose bytes differed
# the auto warm-ups of this process: (device, configuration, check, impl, candidates built and checked)
_warmups: list[tuple[torch.device, dict, bool, str | None, set[str]]] = []
_log = logging.getLogger(__name__)


# ---- dispatch ------------------------------------------------------------------------------
def set_impl(impl: str) -> None:
    """Module default for `impl=None`: "compiled", "eager", "native" or "auto"."""
    global _impl_default
    if impl not in IMPLS:
        raise ValueError(f"kernels.set_impl: impl={impl!r}; choose one of {IMPLS}")
    _impl_default = impl


def get_impl() -> str:
    return _impl_default


def resolve_impl(impl: str | None) -> str:
    """`impl`, or the module default for None."""
    return _impl_default if impl is None else impl


def use_compiled(impl: str | None, device: torch.device, kernel: str | None = None) -> bool:
    """Whether `kernel` runs compiled under `impl` on `device`: "auto" follows the measured choice
    of `warmup` for (kernel, device type) once there is one (`choose`), else compiles where a
    compiler exists; raises for an impossible 'compiled', warns once and runs eager for 'auto'
    without a compiler."""
    impl = resolve_impl(impl)
    if impl not in IMPLS:
        raise ValueError(f"kernels: impl={impl!r}; choose one of {IMPLS}")
    if impl in ("eager", "native"):
        return False
    if impl == "auto" and (kernel, torch.device(device).type) in _auto:
        return _auto[(kernel, torch.device(device).type)] == "compiled"
    reason = compile_unavailable(device)
    if reason is None:
        return True
    if impl == "compiled":
        raise RuntimeError(f"kernels: impl='compiled' was asked for but {reason}; install a C++ "
                           f"compiler (CPU) or Triton (GPU), or use impl='eager' / 'auto'")
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"kernels: {reason}; running the eager reference kernels", stacklevel=3)
    return False


def kernel_impl(impl: str | None, device: torch.device | str, kernel: str) -> str:
    """Which implementation runs `kernel` on `device` under `impl`: "eager", "compiled" or "native"
    (auto: the measured choice once there is one, else as `use_compiled`). impl="native" where the
    native kernels cannot run raises, naming the reason."""
    impl = resolve_impl(impl)
    dev = torch.device(device)
    if impl == "native":
        why = native.unavailable(dev)
        if why is not None:
            raise RuntimeError(f"kernels: impl='native' was asked for but {why}; use impl='eager', "
                               f"'compiled' or 'auto'")
        return "native"
    if impl == "auto" and _auto.get((kernel, dev.type)) == "native":
        return "native"
    return "compiled" if use_compiled(impl, dev, kernel) else "eager"


def choose(kernel: str, device: torch.device | str, candidates: dict[str, Callable[[], torch.Tensor]], *,
           reference: str | Callable[[], torch.Tensor] = "eager", repeats: int = 5, n: int | None = None) -> str:
    """The choice of impl="auto" for (kernel, device type): each candidate (name -> a call on the
    run's real inputs, returning the result) is run once and kept only if its bytes equal the
    reference's (a candidate's name, or a call that only gives the bytes to match), then timed
    `repeats` times, interleaved; each candidate's time is its fastest call (timing noise on a shared
    machine only adds: preemption, another rank's cache traffic; the minimum is the estimate it
    disturbs least), the fastest candidate wins and is recorded (`auto_choices`, and one log line of
    this module's logger); a cheaper candidate within TIE of the fastest wins the tie (`fastest`). A
    candidate whose result differs is never chosen, however fast."""
    device = torch.device(device)
    ref = reference() if callable(reference) else candidates[reference]()
    ok, rejected = {}, []
    for name, fn in candidates.items():
        got = ref if name == reference else fn()
        if got.dtype == ref.dtype and torch.equal(got, ref):
            ok[name] = fn
        else:
            rejected.append(name)
    times: dict[str, list[float]] = {name: [] for name in ok}
    for _ in range(repeats):
        for name, fn in ok.items():
            times[name].append(time_ms(fn, device))
    ms = {name: min(t) for name, t in times.items()}
    chosen = fastest(ms)
    _auto[(kernel, device.type)] = chosen
    rec = {"kernel": kernel, "device": device.type, "n": n, "chosen": chosen, "ms": ms, "rejected": rejected}
    rec["line"] = _choice_line(rec)
    _auto_log.append(rec)
    _log.info("kernels auto: %s", rec["line"])
    return chosen


def agree_choices(group=None, own: dict[str, str] | None = None) -> None:
    """Make impl="auto"'s choices the same on every rank of `group` (collective; call on every rank
    after the warm-up's measurements). Each rank times its candidates alone, so two ranks could keep
    different ones; they give the same bytes by construction and by the warm-up's check, but ranks
    that exchange with each other run one code, so a kernel whose bytes differ on one host kind can
    never split them (`merge_choices`); each agreed record's line says so (`kernel_choices`).
    own: this rank's choices from its warm-up's child process, not yet followed: the agreed ones
    replace them, and a kernel the group has nothing to agree on keeps this rank's."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if own:  # nobody to agree with: this rank's own choices
            adopt(own)
        return
    mine = {f"{r['kernel']}|{r['device']}": {"ms": r["ms"]} for r in auto_choices()}
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    merged = merge_choices(gathered)
    adopt({**(own or {}), **merged}, len(gathered), set(merged))


def adopt(choices: dict[str, str], agreed: int | None = None, agreed_keys: set[str] | None = None) -> None:
    """Follow `choices` ({"kernel|device": candidate}, e.g. what the ranks agreed), and warm up (build or
    compile, and check) every candidate they name that this process's warm-ups have not: a rank whose
    own measurement kept native may be asked to run compiled, which must not compile inside a step."""
    for key, chosen in choices.items():
        kernel, dev = key.split("|")
        _auto[(kernel, dev)] = chosen
        for r in _auto_log:
            if (r["kernel"], r["device"]) == (kernel, dev):
                r["chosen"] = chosen
                if agreed and (agreed_keys is None or key in agreed_keys):
                    r["agreed"] = agreed
                r["line"] = _choice_line(r)
    for device, cfg, check, impl, checked in _warmups:
        for cand in sorted({c for k, c in choices.items() if k.endswith(f"|{device.type}")} - {"eager"} - checked):
            _check_candidate(cand, device, cfg, check, impl)
            checked.add(cand)


def auto_choices() -> list[dict]:
    """The choices impl="auto" follows now, the latest measurement per (kernel, device type):
    kernel, device, n, chosen, ms (the fastest call per candidate), rejected, line (one readable line)."""
    latest = {(r["kernel"], r["device"]): r for r in _auto_log}
    return list(latest.values())


# ---- sign -> packed bits ---------------------------------------------------------------------
def sign_pack(x: torch.Tensor, step: int, length: int | None = None, *,
              impl: str | None = None) -> torch.Tensor:
    """tb(x, step) as packed bits (1 = +1), zero-padded to `length` bits (a multiple of 8,
    default ceil(n/8)*8): byte j bit i = tb(x[8j+i]); == comm.vote.tb_packed(x, step, length)."""
    x = x.reshape(-1)
    n = x.numel()
    length = ceil_div(n, 8) * 8 if length is None else length
    if length % 8 or length < n:
        raise ValueError(f"sign_pack: length={length} must be a multiple of 8 and >= n={n}")
    nb = n // 8
    which = "eager" if n < SMALL or not x.is_floating_point() else kernel_impl(impl, x.device, "sign_pack")
    if which == "eager" or (which == "native" and not native.supports(x)):
        return tb_packed(x, step, length)
    out = torch.empty(length // 8, dtype=torch.uint8, device=x.device)
    if which == "native":
        native.sign_bits(x[:8 * nb], bool(step % 2), out[:nb])
    else:
        compiled_kernel(_k_sign_bits)((x.device.type, dtype_key(x)), x[:8 * nb].view(nb, 8),
                                      const(bool(step % 2), torch.bool, x.device), out[:nb])
    if length > 8 * nb:  # the partial byte and the zero padding: a few bytes, reference code
        out[nb:] = tb_packed(x[8 * nb:], step, length - 8 * nb)
    return out


# ---- quantize -> packed lanes ------------------------------------------------------------------
Q_PIECE = 1 << 20  # elements: quantize_q's nearest-rounding pieces (4 MiB of float32 temporaries)


def quantize_q(c: torch.Tensor, segments: Sequence[tuple[int, int]], levels: int, p: float | None,
               clip: float = 2.0, rounding: str = "nearest", generator: torch.Generator | None = None,
               tie_step: int = 1, *, means: torch.Tensor | None = None) -> torch.Tensor:
    """The reference quantized votes q (int8[n]) of the p-bit scheme (Lion Cub §4.2 eq. 1, App.
    F.1): levels == 0 -> tb(c, tie_step) in {-1, +1}; p None -> sign(c) (the "sign" quantizer);
    else lp_quantize per segment (offset, size), each parameter tensor with its own M_p, the M_p of
    all segments from comm.quantize.segment_lp_means (lp_mean's bits on CPU; its definition of
    the per-tensor norms on CUDA). means: the segments' M_p when the caller has them (a sharded
    tensor's whole-tensor M_p, comm.quantize.sharded_lp_means)."""
    c = c.reshape(-1)
    if levels == 0:  # signs only, 0 forced by the tie break (Lion Cub App. F.1, "1/-1 values")
        fill = torch.tensor(1 if tie_step % 2 == 1 else -1, dtype=torch.int8, device=c.device)
        return torch.where(c > 0, 1, torch.where(c < 0, -1, fill)).to(torch.int8)
    if p is None:  # sign(c) as int8 without a float sign of c's size (4 bytes per element)
        return (c > 0).to(torch.int8).sub_((c < 0).to(torch.int8))
    q = torch.empty(c.numel(), dtype=torch.int8, device=c.device)
    if means is None:
        means = segment_lp_means(c, segments, p)  # on CPU == lp_mean per segment, bit for bit
    if rounding == "nearest":
        # elementwise given M_p: in pieces of Q_PIECE, so its float temporaries are a piece's,
        # not the largest tensor's
        for k, (off, n) in enumerate(segments):
            for lo in range(0, n, Q_PIECE):
                hi = min(n, lo + Q_PIECE)
                q[off + lo:off + hi] = lp_quantize(c[off + lo:off + hi], levels, p, clip, rounding, mean=means[k])
        return q
    # stochastic: one stream of uniforms over the flat vector, a draw per chunk of stochastic_bounds
    # (on CPU these are the per-tensor draws of lp_quantize, value for value)
    bounds = stochastic_bounds(c.numel(), c.device)
    u = torch.empty(max((b - a for a, b in zip(bounds, bounds[1:])), default=0), device=c.device,
                    dtype=means.dtype)
    k = 0
    for a, b in zip(bounds, bounds[1:]):
        ui = u[:b - a].uniform_(generator=generator)
        while k < len(segments) and sum(segments[k]) <= a:
            k += 1
        j = k
        while j < len(segments) and segments[j][0] < b:
            off, n = segments[j]
            lo, hi = max(off, a), min(off + n, b)
            if hi > lo:
                q[lo:hi] = lp_quantize(c[lo:hi], levels, p, clip, rounding, mean=means[j], uniforms=ui[lo - a:hi - a])
            j += 1
    return q


def _pack_v_into(v: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Pack uint8 lane values v[n] into out (uint8, or int32 words for bits=16)."""
    per = lanes_per_word(bits)
    n = v.numel()
    full = n // per
    if full * per >= SMALL:
        compiled_kernel(_k_pack_v, bits)((v.device.type,), v[:full * per].view(full, per), out[:full])
    else:
        full = 0
    if full < out.numel():
        tail = v[full * per:]
        out[full:] = pack_words16(tail.to(torch.int32)) if bits == 16 else pack_lanes(tail, bits, check=False)


def _quantize_lanes(c: torch.Tensor, segs: list[tuple[int, int]], levels: int, p: float, clip: float,
                    bits: int, scratch: torch.Tensor | None, out: torch.Tensor, use_native: bool = False,
                    means: torch.Tensor | None = None) -> None:
    """Nearest-rounding Lion Cub eq. 1 straight into packed lanes, whatever the number of
    tensors: the per-segment scales, then one kernel over the whole blocks of the flat vector and
    one gathered pass over the words of boundary blocks (`_block_plan`); p = inf's norms are a
    segmented reduction over the same plan."""
    dev, per = c.device, lanes_per_word(bits)
    plan = _block_plan(segs, per, c.numel(), dev)
    nb, bseg, _, elems, seg_of, slot, lane, words = plan
    scales = _segment_scales(c, segs, levels, p, clip, scratch, plan, means)
    lv = const(float(levels), scales.dtype, dev)
    if nb and use_native:
        native.quant_blocks(c[:nb * QBLOCK], scales[bseg], levels, bits, out[:nb * QBLOCK // per])
    elif nb:
        # the scale of each block gathered outside: inside, dynamo's duck shaping would tie the
        # number of segments to the number of blocks whenever the two happen to be equal
        compiled_kernel(_k_quant_blocks, bits)((dev.type, dtype_key(c)), c[:nb * QBLOCK].view(nb, -1, per),
                                               scales[bseg], lv, out[:nb * QBLOCK // per].view(nb, -1))
    if words.numel():  # the same float ops as the kernel, so the same lane values
        y = torch.clamp(torch.round(c[elems].to(scales.dtype) * scales[seg_of]), -levels, levels)
        vals = torch.zeros(words.numel(), dtype=torch.int32, device=dev)
        vals.index_add_(0, slot, _lane_of(y, lv) << (lane.to(torch.int32) * bits))
        out[words] = vals.to(out.dtype)


STOCH_CHUNK = 256  # whole blocks per draw of uniforms on CPU (1 MiB of float32)
STOCH_CHUNK_CUDA = 16384  # on CUDA (64 MiB of float32: a handful of draws per model, and the draws' definition)


def stochastic_bounds(n: int, device: torch.device | str) -> list[int]:
    """Where stochastic rounding of an n-element vector cuts its stream of uniforms: positions
    0 = b_0 < b_1 < ... < b_k = n (or [0, 0] for n = 0); chunk i is one draw of b_{i+1} - b_i
    uniforms, in order. Chunks are whole QBLOCK blocks (STOCH_CHUNK of them on CPU, STOCH_CHUNK_CUDA
    on CUDA), the last one taking the partial block, never a chunk of one block (dynamo specialises
    a size-1 dimension); under 2 blocks the whole vector is one chunk. Shared by the reference
    `quantize_q` and the fused path, so both draw the same stream."""
    nb = n // QBLOCK
    nb = nb if nb >= 2 else 0
    per = STOCH_CHUNK_CUDA if torch.device(device).type == "cuda" else STOCH_CHUNK
    cuts = list(range(0, nb, per)) + [nb] if nb else [0, 0]
    if len(cuts) > 2 and cuts[-1] - cuts[-2] == 1:
        del cuts[-2]
    return [b * QBLOCK for b in cuts[:-1]] + [n]


def _quantize_lanes_stochastic(c: torch.Tensor, segs: list[tuple[int, int]], levels: int, p: float, clip: float,
                               bits: int, scratch: torch.Tensor | None, generator: torch.Generator | None,
                               out: torch.Tensor, use_native: bool = False,
                               means: torch.Tensor | None = None) -> None:
    """Stochastic-rounding Lion Cub eq. 1 straight into packed lanes, whatever the number of
    tensors: the uniforms are drawn chunk after chunk of `stochastic_bounds` in flat order, as the
    reference `quantize_q` draws them. Each chunk's whole blocks are one kernel call, and its share
    of the boundary words (`_block_plan`) one gathered pass; the uniforms live in one chunk-sized
    buffer, never one of the vector's length."""
    dev, per, n = c.device, lanes_per_word(bits), c.numel()
    plan = _block_plan(segs, per, n, dev)
    nb, bseg, _, elems, seg_of, slot, lane, words = plan
    scales = _segment_scales(c, segs, levels, p, clip, scratch, plan, means)
    dt = scales.dtype
    lv = const(float(levels), dt, dev)
    bounds = stochastic_bounds(n, dev)
    cuts = [b // QBLOCK for b in bounds[:-1]] + [nb]
    lo = torch.searchsorted(elems, torch.tensor(bounds, device=dev)).tolist()
    first = slot[[i for i in lo[:-1] if i < elems.numel()]].tolist()
    u = torch.empty(max(b - a for a, b in zip(bounds, bounds[1:])), dtype=dt, device=dev)
    bscale = scales[bseg]
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        ui = u[:b - a].uniform_(generator=generator)  # == the reference's torch.rand, in flat order
        b0, b1 = cuts[i], cuts[i + 1]
        if b1 > b0 and use_native:
            native.quant_blocks(c[b0 * QBLOCK:b1 * QBLOCK], bscale[b0:b1], levels, bits,
                                out[b0 * QBLOCK // per:b1 * QBLOCK // per], u=ui[:(b1 - b0) * QBLOCK])
        elif b1 > b0:
            compiled_kernel(_k_quant_blocks_stoch, bits)(
                (dev.type, dtype_key(c)), c[b0 * QBLOCK:b1 * QBLOCK].view(b1 - b0, -1, per), bscale[b0:b1],
                ui[:(b1 - b0) * QBLOCK].view(b1 - b0, -1, per), lv,
                out[b0 * QBLOCK // per:b1 * QBLOCK // per].view(b1 - b0, -1))
        if lo[i + 1] > lo[i]:  # this chunk's boundary words: the kernel's float ops, gathered
            e = elems[lo[i]:lo[i + 1]]
            y = c[e].to(dt) * scales[seg_of[lo[i]:lo[i + 1]]]
            low = torch.floor(y)
            y = torch.clamp(low + (ui[e - a] < (y - low)).to(dt), -levels, levels)
            s0 = first[i]
            sl = slot[lo[i]:lo[i + 1]] - s0
            vals = torch.zeros(int(sl[-1]) + 1, dtype=torch.int32, device=dev)
            vals.index_add_(0, sl, _lane_of(y, lv) << (lane[lo[i]:lo[i + 1]].to(torch.int32) * bits))
            out[words[s0:s0 + vals.numel()]] = vals.to(out.dtype)


def quantize_pack(c: torch.Tensor, segments: Sequence[tuple[int, int]], levels: int, p: float | None,
                  clip: float = 2.0, bits: int = 4, rounding: str = "nearest",
                  generator: torch.Generator | None = None, tie_step: int = 1, *,
                  impl: str | None = None, scratch: torch.Tensor | None = None,
                  means: torch.Tensor | None = None) -> torch.Tensor:
    """The p-bit wire of c: wire_of(quantize_q(c, ...), levels, bits), fused.

    segments: (offset, size) of each parameter tensor in c, tiling [0, n) in order (each gets its
    own M_p, Lion Cub Fig. 3). levels == 0 sends tb(c, tie_step) as 0/1 lanes; p None is the
    "sign" quantizer. Returns uint8[ceil(n*bits/8)] (int32 words for bits = 16), the bytes
    comm.int_allreduce would SUM. Stochastic rounding draws from `generator` exactly as the
    reference does. scratch: optional float buffer (float32; float64 for float64 c) of at least
    the largest segment, reused for |c| when p = 1. means: every segment's M_p, where the caller
    has them (a sharded tensor's whole M_p, comm.quantize.sharded_lp_means); else computed here."""
    _check_quantize_args(levels, p, clip, bits, rounding)
    c = c.reshape(-1)
    n = c.numel()
    segs = [(int(o), int(m)) for o, m in segments]
    _check_segments(segs, n)
    which = "eager" if n < SMALL or not c.is_floating_point() else kernel_impl(impl, c.device, "quantize_pack")
    if which == "native" and not native_quantizes(c, levels, p, bits):
        which = "eager"  # a configuration comm.native has no loop for: the reference's bytes
    if which == "eager":
        return wire_of(quantize_q(c, segs, levels, p, clip, rounding, generator, tie_step, means=means), levels, bits)
    dev = c.device
    per = lanes_per_word(bits)
    words = ceil_div(n, per)
    out = torch.empty(words, dtype=torch.int32 if bits == 16 else torch.uint8, device=dev)
    if levels == 0:
        full = n // per
        if which == "native":
            native.tb_lanes(c[:full * per], bool(tie_step % 2), bits, out[:full])
        else:
            compiled_kernel(_k_tb_lanes, bits)((dev.type, dtype_key(c)), c[:full * per].view(full, per),
                                               const(bool(tie_step % 2), torch.bool, dev), out[:full])
        if full < words:
            out[full:] = wire_of(quantize_q(c[full * per:], [], 0, None, tie_step=tie_step), 0, bits)
        return out
    if p is not None and rounding == "nearest":
        _quantize_lanes(c, segs, levels, float(p), clip, bits, scratch, out, which == "native", means)
        return out
    if p is not None:  # stochastic: one stream over the flat vector
        _quantize_lanes_stochastic(c, segs, levels, float(p), clip, bits, scratch, generator, out,
                                   which == "native", means)
        return out
    v = out if bits == 8 else torch.empty(n, dtype=torch.uint8, device=dev)
    compiled_kernel(_k_sign_v)((dev.type, dtype_key(c)), c, const(levels, torch.int32, dev), v)
    if bits != 8:
        _pack_v_into(v, bits, out)
    return out


# ---- unpack -> sum / majority ------------------------------------------------------------------
def unpack_sum(wire: torch.Tensor, bits: int, n: int, levels: int, P: int, *, sign: bool = False,
               dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
               impl: str | None = None) -> torch.Tensor:
    """Summed p-bit wire -> the int32[n] sum over P ranks of q (== int_allreduce's result), or
    with sign=True torch.sign of it in `dtype` (default float32): the applied update of the
    p-bit scheme, fused. out: optional contiguous [n] buffer of the result dtype to fill."""
    if bits not in WIRE_BITS:
        raise ValueError(f"unpack_sum: bits={bits!r}; choose one of {WIRE_BITS}")
    rdt = (dtype or torch.float32) if sign else torch.int32
    per = lanes_per_word(bits)
    flat = wire.reshape(-1)
    want = torch.int32 if bits == 16 else torch.uint8
    if flat.dtype != want:
        raise TypeError(f"unpack_sum: a {bits}-bit wire is {want}, got {flat.dtype}")
    if n < 0 or flat.numel() * per < n:
        raise ValueError(f"unpack_sum: {flat.numel()} wire words cannot hold n={n} {bits}-bit lanes")
    if out is not None and (out.numel() != n or out.dtype != rdt or not out.is_contiguous()):
        raise ValueError(f"unpack_sum: out must be a contiguous {rdt} tensor of {n} elements, got "
                         f"{out.dtype} of {out.numel()}")
    full = n // per
    which = ("eager" if full * per < SMALL or (sign and rdt not in _SIGN_BITS)
             else kernel_impl(impl, flat.device, "unpack_sum"))
    if which == "native" and sign and rdt == torch.int8:
        res = torch.empty(n, dtype=rdt, device=flat.device) if out is None else out
        mul, offset = (2, P) if levels == 0 else (1, P * levels)
        native.unpack_sign(flat[:full], bits, mul, offset, res[:full * per])
        if full * per < n:
            res[full * per:] = torch.sign(unpack_sum_reference(flat[full:], bits, n - full * per, levels, P)).to(rdt)
        return res
    if which != "compiled":  # eager, or what comm.native has no loop for (int32 sums, other dtypes)
        if sign and bits != 16:
            return _sign_of_sum_eager(flat, bits, n, levels, P, rdt, out)
        total = unpack_sum_reference(flat, bits, n, levels, P)
        res = torch.sign(total).to(rdt) if sign else total
        return res if out is None else out.copy_(res)
    res = torch.empty(n, dtype=rdt, device=flat.device) if out is None else out
    dev = flat.device
    esize, plus, minus = _SIGN_BITS[rdt] if sign else (4, None, None)
    if per * esize > 8:  # 1- and 2-bit lanes into 4-byte results: small ints via an int8 pass
        esize, plus, minus = (1, 1, -1) if sign else (1, None, None)
    g = 2 if per * esize == 2 else 1  # two wire words per int32 word rather than an int16 word
    full = full // g * g
    body = res[:full * per]
    if esize != res.element_size() or body.storage_offset() * esize % (g * per * esize):
        body = torch.empty(full * per, dtype=_WORD[esize], device=dev)  # int8 pass, or unaligned out
    acc = torch.int64 if g * per * esize > 4 else torch.int32
    # small integers as cached device scalars: dynamo would specialise the values 0 and 1
    mul, offset = (2, P) if levels == 0 else (1, P * levels)
    compiled_kernel(_k_unpack, bits, esize, plus, minus)((dev.type,), flat[:full].view(full // g, g),
                                                 const(mul, acc, dev), const(offset, acc, dev),
                                                 body.view(_WORD[g * per * esize]))
    if body.data_ptr() != res.data_ptr():
        res[:full * per].copy_(body.view(res.dtype) if body.dtype.itemsize == res.element_size() else body)
    if full * per < n:
        tail = unpack_sum_reference(flat[full:], bits, n - full * per, levels, P)
        res[full * per:] = torch.sign(tail).to(rdt) if sign else tail
    return res


def unpack_majority(recv: torch.Tensor, P: int, step: int, *, impl: str | None = None) -> torch.Tensor:
    """recv: uint8[P * c] packed sign chunks, row r from rank r -> packed tb(2*plus - P, step),
    the exact majority with tie break (== comm.vote.local_majority)."""
    if recv.dtype != torch.uint8 or P < 1 or recv.numel() % P:
        raise ValueError(f"unpack_majority: need uint8 bytes in P={P} equal chunks, got "
                         f"{recv.numel()} {recv.dtype}")
    c = recv.numel() // P
    cdt = count_dtype(P)
    # P = 1 would get a graph of its own (dynamo specialises size-1 dimensions) for a vote that
    # never runs: comm/ skips the collective at world size 1
    # c > 255 >= P: dynamo's duck shaping would tie the symbols of P and c if they were equal
    which = "eager" if c <= 255 or P == 1 or cdt != torch.uint8 else kernel_impl(impl, recv.device,
                                                                                "unpack_majority")
    if which == "eager":
        return local_majority(recv, P, step)
    thr = majority_threshold(P, step)
    out = torch.empty(c, dtype=torch.uint8, device=recv.device)
    if which == "native":
        native.majority(recv.reshape(-1), P, thr, out)
        return out
    compiled_kernel(_k_majority)((recv.device.type,), recv.reshape(P, c), const(thr, cdt, recv.device), out)
    return out


# ---- warm-up ---------------------------------------------------------------------------------
def warmup(device: torch.device | str = "cpu", *, bits: Sequence[int] = (), levels: Sequence[int] = (),
           p: Sequence[float | None] = (), rounding: Sequence[str] = ("nearest",),
           world_sizes: Sequence[int] = (), sign_dtypes: Sequence[torch.dtype] = (torch.float32,),
           impl: str | None = None, check: bool = True, layout: Sequence[tuple[int, int]] | None = None,
           clip: float = 2.0, repeats: int = 15, agree: bool = False, group=None) -> float:
    """Compile (and with check=True verify against the reference, on random, zero and tie inputs)
    every wire kernel the given configuration will use, so no timed step pays compilation; the
    native kernels (comm.native) are built and verified the same way. Returns the seconds spent.
    A kernel that disagrees with the reference raises RuntimeError under impl='compiled' or
    'native', or under 'auto' warns and is never chosen (`report_mismatch`, the policy shared with
    optim.lion's warm-up of the Lion passes).

    With impl="auto" and the run's `layout` ((offset, size) of its tensors in the flat vector),
    each kernel the configuration uses is then timed against its eager reference on inputs of the
    run's real size (`choose`): "auto" keeps the fastest of the byte-identical candidates, per
    kernel and device type. The 1-bit configuration (world_sizes, no bits) times sign_pack and
    unpack_majority, the p-bit one (bits) quantize_pack and unpack_sum. On CPU the timing runs in
    a child process (comm.kernel_probe: the same code, the same thread count), whose choices this
    process adopts, then builds and verifies only the chosen candidates: inductor is imported here
    only when a compiled kernel won (its import and compiled code cost 60-150 MiB of RSS); a host's
    later runs with the same key read the child's answer from its cache (comm.kernel_probe). With
    agree=True the ranks of `group` first agree on the choices (`agree_choices`, a collective: every
    rank calls warmup), so what is built is what the group runs."""
    device = torch.device(device)
    r = resolve_impl(impl)
    t0 = time.perf_counter()
    cfg = dict(bits=tuple(bits), levels=tuple(levels), p=tuple(p), rounding=tuple(rounding),
               world_sizes=tuple(world_sizes), sign_dtypes=tuple(sign_dtypes), clip=clip, repeats=repeats)
    if r == "auto" and layout is not None and device.type == "cpu" and use_compiled(impl, device):
        from . import kernel_probe

        if not kernel_probe.inside():
            try:
                records = kernel_probe.measure([(int(o), int(m)) for o, m in layout], cfg)
            except kernel_probe.ChildCrashed as e:  # what crashed the child must not crash this process
                records = None
                where = native.library_path()
                native.disable(f"the auto measurement's child process was {e}; the native library {where} is not "
                               f"loaded in this process")
                warnings.warn(f"kernels: the auto measurement's child process was {e}; the native kernel library "
                              f"{where or '(none built)'} is not loaded in this process (it may be what crashed "
                              f"the child; delete it to have it rebuilt); measuring the other candidates here",
                              stacklevel=2)
            if records is not None:
                for rec in records:
                    rec["line"] = _choice_line(rec)
                    _auto_log.append(rec)
                _warmups.append((device, cfg, check, impl, set()))
                # agree first, then build and check what the ranks will run (adopt): a rank whose own
                # timing kept compiled, overruled by the others, never imports inductor
                own = {f"{rec['kernel']}|{rec['device']}": rec["chosen"] for rec in records}
                if agree:
                    agree_choices(group, own)
                else:
                    adopt(own)
                return time.perf_counter() - t0
    from . import kernel_probe

    key = None  # an in-process measurement (CUDA; LIONCUB_KERNEL_PROBE=0) is cached like the child's
    in_child = os.environ.get(kernel_probe.ENV) == "child"  # the child measures: its parent caches the answer
    if r == "auto" and layout is not None and not in_child and use_compiled(impl, device):
        key = kernel_probe.cache_key(kernel_probe.request([(int(o), int(m)) for o, m in layout], cfg), device)
        hit = kernel_probe.cached(key)
        if hit is not None:
            for rec in hit:
                rec["cached"] = kernel_probe.cache_file(key)
                rec["line"] = _choice_line(rec)
                _auto_log.append(rec)
            _warmups.append((device, cfg, check, impl, set()))
            own = {f"{rec['kernel']}|{rec['device']}": rec["chosen"] for rec in hit}
            if agree:  # the ranks agree as after a measurement; then what they follow is built and checked
                agree_choices(group, own)
            else:
                adopt(own)
            return time.perf_counter() - t0
    cands = []
    if use_compiled(impl, device):
        cands.append("compiled")
    if r == "native" or (r == "auto" and native.unavailable(device) is None):
        cands.append("native")
    for cand in cands:
        _check_candidate(cand, device, cfg, check, impl)
    if r == "auto" and cands:
        _warmups.append((device, cfg, check, impl, set(cands)))
    if layout is not None and r == "auto" and cands:
        _measure(device, [(int(o), int(m)) for o, m in layout], **{k: v for k, v in cfg.items()
                                                                    if k != "sign_dtypes"})
        if key is not None:  # this rank's own measurement, before any agreement
            kernel_probe.store(key, [dict(rec) for rec in auto_choices() if rec["device"] == device.type])
    if agree and r == "auto":  # every rank gathers once here, whichever path it took (a failed child too)
        agree_choices(group)
    return time.perf_counter() - t0 if cands else 0.0


def _check_candidate(cand: str, device: torch.device, cfg: dict, check: bool, impl: str | None) -> None:
    """Run (compiling or building) every kernel of the configuration under `cand` on small random,
    zero and tie inputs and, with check, compare its bytes with the reference's (`report_mismatch`)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(1234)
    n = 2 * QBLOCK + 4 * SMALL + 13  # two whole quantizer blocks, one with a segment boundary
    x = torch.randn(n, generator=gen, device=device)
    x[::5] = 0.0
    segs = [(0, 2 * SMALL + 1), (2 * SMALL + 1, n - 2 * SMALL - 1)]
    bad: list[str] = []

    def same(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        if check and not torch.equal(a, b):
            bad.append(name)

    for dt in cfg["sign_dtypes"]:
        for step in (1, 2):
            xd = x.to(dt)
            same(f"sign_pack[{dt}]", sign_pack(xd, step, impl=cand), tb_packed(xd, step))
    for P in cfg["world_sizes"]:
        recv = torch.randint(0, 256, (P * 301,), generator=gen, device=device, dtype=torch.uint8)
        for step in (1, 2):
            same(f"unpack_majority[P={P}]", unpack_majority(recv, P, step, impl=cand),
                 local_majority(recv, P, step))
    for b in cfg["bits"]:
        for L in cfg["levels"]:
            for pp in (cfg["p"] or [1.0]):
                for rnd in cfg["rounding"]:
                    try:
                        check_lanes(1, L, b)
                    except ValueError:
                        continue
                    g1, g2 = torch.Generator(device=device), torch.Generator(device=device)
                    g1.manual_seed(7)
                    g2.manual_seed(7)
                    w = quantize_pack(x, segs, L, pp, 2.0, b, rnd, g1, 1, impl=cand)
                    same(f"quantize_pack[bits={b},L={L},p={pp},{rnd}]", w,
                         wire_of(quantize_q(x, segs, L, pp, 2.0, rnd, g2, 1), L, b))
                    for P in cfg["world_sizes"] or (1,):
                        try:
                            check_lanes(P, L, b)
                        except ValueError:
                            continue
                        for sgn, dt in ((False, None), (True, torch.float32), (True, torch.int8)):
                            ref = unpack_sum_reference(w, b, n, L, P)
                            same(f"unpack_sum[bits={b},L={L},sign={sgn},{dt}]",
                                 unpack_sum(w, b, n, L, P, sign=sgn, dtype=dt, impl=cand),
                                 torch.sign(ref).to(dt) if sgn else ref)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    report_mismatch(bad, device, impl, cand)


def _measure(device: torch.device, segs: list[tuple[int, int]], bits: Sequence[int], levels: Sequence[int],
             p: Sequence[float | None], rounding: Sequence[str], world_sizes: Sequence[int], clip: float,
             repeats: int) -> None:
    """`choose` for each kernel of the configuration, on random inputs of the layout's size: eager
    against compiled and native where they run and were not rejected by the warm-up's check."""
    n = sum(m for _, m in segs)
    gen = torch.Generator(device=device)
    gen.manual_seed(4321)
    x = torch.randn(n, generator=gen, device=device)
    P = max(world_sizes or (1,))
    dev = device.type

    def cands(kernel: str, fns: dict[str, Callable]) -> dict[str, Callable]:
        ok = {"eager": fns["eager"]}
        if use_compiled("auto", device) and "compiled" not in _rejected.get((kernel, dev), ()):
            ok["compiled"] = fns["compiled"]
        if ("native" in fns and native.unavailable(device) is None
                and "native" not in _rejected.get((kernel, dev), ())):
            ok["native"] = fns["native"]
        return ok

    if not bits:
        length = ceil_div(n, 8 * P) * 8 * P
        choose("sign_pack", device, cands("sign_pack", {
            "eager": lambda: tb_packed(x, 1, length),
            "compiled": lambda: sign_pack(x, 1, length, impl="compiled"),
            "native": lambda: sign_pack(x, 1, length, impl="native")}), repeats=repeats, n=n)
        if P > 1:
            recv = torch.randint(0, 256, (length // 8,), generator=gen, device=device, dtype=torch.uint8)
            choose("unpack_majority", device, cands("unpack_majority", {
                "eager": lambda: local_majority(recv, P, 1),
                "compiled": lambda: unpack_majority(recv, P, 1, impl="compiled"),
                "native": lambda: unpack_majority(recv, P, 1, impl="native")}), repeats=repeats, n=n)
        return
    b, L, pp, rnd = bits[0], (levels or (0,))[0], (p or (1.0,))[0], rounding[0]
    seed = torch.Generator(device=device)

    def fresh() -> torch.Generator:  # every candidate draws the same stochastic-rounding stream
        return seed.manual_seed(99)

    fns = {"eager": lambda: wire_of(quantize_q(x, segs, L, pp, clip, rnd, fresh(), 1), L, b),
           "compiled": lambda: quantize_pack(x, segs, L, pp, clip, b, rnd, fresh(), 1, impl="compiled"),
           "native": lambda: quantize_pack(x, segs, L, pp, clip, b, rnd, fresh(), 1, impl="native")}
    if not native_quantizes(x, L, pp, b):
        del fns["native"]
    choose("quantize_pack", device, cands("quantize_pack", fns), repeats=repeats, n=n)
    wire = quantize_pack(x, segs, L, pp, clip, b, rnd, fresh(), 1, impl="eager")
    choose("unpack_sum", device, cands("unpack_sum", {
        "eager": lambda: unpack_sum(wire, b, n, L, P, sign=True, dtype=torch.int8, impl="eager"),
        "compiled": lambda: unpack_sum(wire, b, n, L, P, sign=True, dtype=torch.int8, impl="compiled"),
        "native": lambda: unpack_sum(wire, b, n, L, P, sign=True, dtype=torch.int8, impl="native")}),
        reference=lambda: torch.sign(unpack_sum_reference(wire, b, n, L, P)).to(torch.int8), repeats=repeats, n=n)


def report_mismatch(bad: Sequence[str], device: torch.device, impl: str | None, cand: str = "compiled") -> None:
    """The warm-up's policy for kernels of candidate `cand` ("compiled" or "native") whose bytes
    differ from the reference: raise when `cand` was asked for by name; under impl='auto' warn and
    never choose it for those kernels (recorded as a measurement that rejected it, so
    agree_choices makes the other ranks of the group drop it too); under a module default of
    'compiled', switch the module to eager."""
    if not bad:
        return
    msg = (f"kernels.warmup: {cand} kernels differ from the reference on {device}: "
           f"{', '.join(sorted(set(bad)))}")
    r = resolve_impl(impl)
    if r == cand:
        raise RuntimeError(msg + "; use impl='eager'")
    warnings.warn(msg + f"; not using the {cand} kernels", stacklevel=3)
    if r != "auto":
        set_impl("eager")
    dev = torch.device(device).type
    for kernel in sorted({b.split("[")[0] for b in bad}):
        _rejected.setdefault((kernel, dev), set()).add(cand)
        if _auto.get((kernel, dev), cand) == cand:
            _auto[(kernel, dev)] = "eager"
        rec = {"kernel": kernel, "device": dev, "n": None, "chosen": _auto[(kernel, dev)], "ms": {"eager": 0.0},
               "rejected": [cand]}
        rec["line"] = _choice_line(rec)
        _auto_log.append(rec)


__all__ = ["IMPLS", "QBLOCK", "SMALL", "Kernel", "adopt", "auto_choices", "choose", "compile_seconds",
           "compile_unavailable", "compiled_kernel", "const", "dtype_key", "eager_float", "f32", "fastest", "get_impl", "kernel_impl",
           "quantize_pack", "quantize_q", "report_mismatch", "resolve_impl", "set_impl", "sign_pack", "stochastic_bounds",
           "time_ms", "unpack_majority", "unpack_sum", "unpack_sum_reference", "use_compiled", "warmup", "wire_of"]
