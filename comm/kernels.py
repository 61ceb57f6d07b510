"""Fused wire kernels of Lion Cub's quantized schemes, next to their eager reference in comm/.

Lion Cub App. E warns that quantizing and packing can eat the bandwidth gain: the eager
whole-tensor torch code makes several passes over the update per step. Each hot path has one
reference (eager torch, the specification) and at most one fast implementation per device:

    sign_pack        x -> tie-broken sign bits             == comm.vote.tb_packed
    quantize_pack    c -> Lion Cub eq. 1 per tensor -> q + L in bits-wide lanes (the wire of
                     comm.int_allreduce; levels == 0: tie-broken signs as 0/1 lanes)
                                                            == wire_of(quantize_q(...))
    unpack_majority  P packed chunks -> exact majority with tie break -> packed
                                                            == comm.vote.local_majority
    unpack_sum       summed wire -> int32 sum (or its sign, fused, for the update)
                                                            == int_allreduce after its SUM

On CPU the fast implementation is comm.native (C loops: no Python compiler stack in the
process); on CUDA it is the kernel bodies of comm.kernel_bodies compiled by torch.compile
(Triton). `comm.kernels` picks per run: eager, native, compiled (the torch.compile kernels on any
device: on CPU inductor's C++ backend compiles the same graphs, which is how CPU-only tests check
the code the GPU runs), or auto: the device's fast implementation, checked against the reference
in warm-up and, where its speed against eager is not settled (CUDA's sign packing and majority),
timed against eager on the run's sizes. A `Kernels` object holds that choice and what the
kernels keep between calls (constants on the device, block plans); build one per run and pass it
as `impl`. Inputs shorter than SMALL elements, and dtypes a kernel does not cover, run the
reference: same bytes, and a kernel call would cost more than the work.

Exactness notes (why the fast paths look the way they do):
- M_p of Lion Cub eq. 1 is a reduction whose rounding depends on its summation order, so the
  fast path and the reference `quantize_q` both take it from `comm.quantize.segment_lp_means`
  (on CPU each value is `lp_mean`'s bit for bit; on CUDA the function defines the norms). M_inf,
  a max, is exact in any order: one segmented reduction over the block plan. Everything after
  the norm is one kernel over whole blocks of the flat vector plus one gathered pass over the
  blocks a tensor boundary cuts: no loop over tensors.
- Stochastic rounding draws its uniforms in one stream over the flat vector, in the chunks of
  `stochastic_bounds`, in the reference and the fast path alike. On CPU ATen's generator fills a
  tensor serially, so these are exactly `comm.quantize.lp_quantize`'s per-tensor draws; on CUDA
  (Philox gives each call its own offset) the chunked stream is the definition.
NaN payloads are not promised to match (NaN positions are).
"""
from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Sequence

import torch

from . import native
from .kernel_bodies import _SIGN_BITS, _WORD, _k_majority, _k_sign_bits, _k_sign_v, _k_tb_lanes, _k_unpack, eager_float, f32
from .kernel_check import check_against_reference
from .kernel_choice import choice_line, fastest, merge_choices, time_ms
from .kernel_compile import NO_COMPILE_ENV, Kernel, compile_unavailable, compiled_kernel, dtype_key
from .kernel_quant import (QBLOCK, SMALL, WIRE_BITS, _check_quantize_args, _check_segments, _sign_of_sum_eager,
                           native_quantizes, pack_v_into, quantize_lanes, quantize_lanes_stochastic, quantize_q,
                           stochastic_bounds, unpack_sum_reference, wire_of)
from .packing import ceil_div, lanes_per_word
from .vote import count_dtype, local_majority, majority_threshold, tb_packed

IMPLS = ("auto", "compiled", "eager", "native")
KERNELS = ("sign_pack", "quantize_pack", "unpack_sum", "unpack_majority")
# the kernels auto times against eager on CUDA: their compiled speed, from one process to the next,
# ranged from faster than eager's to slower; the other kernels' was faster in every process measured
# (docs/results/fast_path/kernels_simplified.md)
MEASURED_ON_CUDA = ("sign_pack", "unpack_majority")
_log = logging.getLogger(__name__)


class Kernels:
    """The wire kernels of one run on `device` under the comm.kernels `setting`: which
    implementation runs each kernel (`which`), what auto measured or rejected (`records`), and the
    device constants and block plans the kernels reuse between calls."""

    def __init__(self, setting: str | None = "eager", device: torch.device | str = "cpu") -> None:
        setting = "eager" if setting is None else setting
        if setting not in IMPLS:
            raise ValueError(f"kernels: impl={setting!r}; choose one of {IMPLS}")
        self.setting, self.device = setting, torch.device(device)
        self.records: list[dict] = []  # auto's measurements and rejections, latest last
        self.checked: set[tuple] = set()  # (candidate, configuration) pairs warm-up built and checked
        self.plans: dict = {}
        self._consts: dict = {}
        self.chosen: dict[str, str] = {}  # auto: kernel -> the implementation it runs
        self._ready = setting == "eager"  # a named implementation: checked that it can run here
        if setting == "auto":
            fast = "native" if self.device.type == "cpu" else "compiled"
            why = native.unavailable(self.device) if fast == "native" else compile_unavailable(self.device)
            if why is not None:
                warnings.warn(f"kernels: {why}; comm.kernels=auto runs the eager reference kernels", stacklevel=3)
            self.chosen = dict.fromkeys(KERNELS, "eager" if why else fast)

    def which(self, kernel: str) -> str:
        """The implementation that runs `kernel`: "eager", "compiled" or "native". A named setting
        that cannot run here raises, naming the reason."""
        if self.setting == "auto":
            return self.chosen[kernel]
        if not self._ready:
            why = native.unavailable(self.device) if self.setting == "native" else compile_unavailable(self.device)
            if why is not None:
                raise RuntimeError(f"kernels: impl={self.setting!r} was asked for but {why}; use impl='eager' or 'auto'")
            self._ready = True
        return self.setting

    def const(self, value, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 0-d device tensor kept for the run: a kernel argument that changes rarely, passed
        without recompiling and without a host-to-device copy per call."""
        key = (value, dtype, device)
        if key not in self._consts:
            self._consts[key] = torch.tensor(value, dtype=dtype, device=device)
        return self._consts[key]

    def lines(self) -> list[str]:
        """One readable line per kernel auto measured or rejected (the latest record of each)."""
        return [r["line"] for r in {r["kernel"]: r for r in self.records}.values()]

    # ---- the wire kernels ----------------------------------------------------------------------
    def sign_pack(self, x: torch.Tensor, step: int, length: int | None = None) -> torch.Tensor:
        """tb(x, step) as packed bits (1 = +1), zero-padded to `length` bits (a multiple of 8,
        default ceil(n/8)*8): byte j bit i = tb(x[8j+i]); == comm.vote.tb_packed(x, step, length)."""
        x = x.reshape(-1)
        n = x.numel()
        length = ceil_div(n, 8) * 8 if length is None else length
        if length % 8 or length < n:
            raise ValueError(f"sign_pack: length={length} must be a multiple of 8 and >= n={n}")
        nb = n // 8
        which = "eager" if n < SMALL or not x.is_floating_point() else self.which("sign_pack")
        if which == "eager" or (which == "native" and not native.supports(x)):
            return tb_packed(x, step, length)
        out = torch.empty(length // 8, dtype=torch.uint8, device=x.device)
        if which == "native":
            native.sign_bits(x[:8 * nb], bool(step % 2), out[:nb])
        else:
            compiled_kernel(_k_sign_bits)((x.device.type, dtype_key(x)), x[:8 * nb].view(nb, 8),
                                          self.const(bool(step % 2), torch.bool, x.device), out[:nb])
        if length > 8 * nb:  # the partial byte and the zero padding: a few bytes, reference code
            out[nb:] = tb_packed(x[8 * nb:], step, length - 8 * nb)
        return out

    def quantize_pack(self, c: torch.Tensor, segments: Sequence[tuple[int, int]], levels: int, p: float | None,
                      clip: float = 2.0, bits: int = 4, rounding: str = "nearest",
                      generator: torch.Generator | None = None, tie_step: int = 1, *,
                      scratch: torch.Tensor | None = None, means: torch.Tensor | None = None) -> torch.Tensor:
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
        which = "eager" if n < SMALL or not c.is_floating_point() else self.which("quantize_pack")
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
                                                   self.const(bool(tie_step % 2), torch.bool, dev), out[:full])
            if full < words:
                out[full:] = wire_of(quantize_q(c[full * per:], [], 0, None, tie_step=tie_step), 0, bits)
            return out
        if p is not None and rounding == "nearest":
            quantize_lanes(c, segs, levels, float(p), clip, bits, scratch, out, which == "native", means,
                           self.const, self.plans)
            return out
        if p is not None:  # stochastic: one stream over the flat vector
            quantize_lanes_stochastic(c, segs, levels, float(p), clip, bits, scratch, generator, out,
                                      which == "native", means, self.const, self.plans)
            return out
        v = out if bits == 8 else torch.empty(n, dtype=torch.uint8, device=dev)
        compiled_kernel(_k_sign_v)((dev.type, dtype_key(c)), c, self.const(levels, torch.int32, dev), v)
        if bits != 8:
            pack_v_into(v, bits, out)
        return out

    def unpack_sum(self, wire: torch.Tensor, bits: int, n: int, levels: int, P: int, *, sign: bool = False,
                   dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
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
                 else self.which("unpack_sum"))
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
                                                     self.const(mul, acc, dev), self.const(offset, acc, dev),
                                                     body.view(_WORD[g * per * esize]))
        if body.data_ptr() != res.data_ptr():
            res[:full * per].copy_(body.view(res.dtype) if body.dtype.itemsize == res.element_size() else body)
        if full * per < n:
            tail = unpack_sum_reference(flat[full:], bits, n - full * per, levels, P)
            res[full * per:] = torch.sign(tail).to(rdt) if sign else tail
        return res

    def unpack_majority(self, recv: torch.Tensor, P: int, step: int) -> torch.Tensor:
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
        which = "eager" if c <= 255 or P == 1 or cdt != torch.uint8 else self.which("unpack_majority")
        if which == "eager":
            return local_majority(recv, P, step)
        thr = majority_threshold(P, step)
        out = torch.empty(c, dtype=torch.uint8, device=recv.device)
        if which == "native":
            native.majority(recv.reshape(-1), P, thr, out)
            return out
        compiled_kernel(_k_majority)((recv.device.type,), recv.reshape(P, c), self.const(thr, cdt, recv.device), out)
        return out

    # ---- warm-up: build, check against the reference, and (auto on CUDA) time -------------------
    def warmup(self, *, bits: Sequence[int] = (), levels: Sequence[int] = (), p: Sequence[float | None] = (),
               rounding: Sequence[str] = ("nearest",), world_sizes: Sequence[int] = (),
               sign_dtypes: Sequence[torch.dtype] = (torch.float32,), check: bool = True,
               layout: Sequence[tuple[int, int]] | None = None, clip: float = 2.0, repeats: int = 15) -> float:
        """Build or compile every fast kernel the configuration will use, so no timed step pays it,
        and with check=True compare its bytes with the reference's on random, zero and tie inputs
        (a mismatch: `reject`). Under auto on CUDA, with the run's `layout` ((offset, size) of its
        tensors in the flat vector), then time the kernels of MEASURED_ON_CUDA against eager on
        the run's size (`choose`). The 1-bit configuration (world_sizes, no bits) uses sign_pack
        and unpack_majority, the p-bit one (bits) quantize_pack and unpack_sum. Returns seconds."""
        t0 = time.perf_counter()
        cfg = dict(bits=tuple(bits), levels=tuple(levels), p=tuple(p), rounding=tuple(rounding),
                   world_sizes=tuple(world_sizes), sign_dtypes=tuple(sign_dtypes))
        cands = {self.which(k) for k in KERNELS} - {"eager"}
        for cand in sorted(cands):
            key = (cand,) + tuple(cfg.items())  # each configuration builds and checks its own kernels
            if key not in self.checked:
                self.checked.add(key)
                bad = check_against_reference(Kernels(cand, self.device), cfg)
                if check:
                    self.reject(bad, cand)
        if self.setting == "auto" and layout is not None and self.device.type == "cuda" and "compiled" in cands:
            self._measure([(int(o), int(m)) for o, m in layout], cfg, clip, repeats)
        return time.perf_counter() - t0 if cands else 0.0

    def reject(self, bad: Sequence[str], cand: str) -> None:
        """The policy for kernels of `cand` whose bytes differ from the reference: raise when the
        setting names `cand`; under auto warn and run those kernels eager (recorded)."""
        if not bad:
            return
        msg = f"kernels.warmup: {cand} kernels differ from the reference on {self.device}: {', '.join(sorted(set(bad)))}"
        if self.setting != "auto":
            raise RuntimeError(msg + "; use impl='eager'")
        warnings.warn(msg + f"; not using the {cand} kernels", stacklevel=3)
        for kernel in sorted({b.split("[")[0] for b in bad}):
            if self.chosen.get(kernel) == cand:
                self.chosen[kernel] = "eager"
            self._record({"kernel": kernel, "device": self.device.type, "n": None, "chosen": self.chosen[kernel],
                          "ms": {"eager": 0.0}, "rejected": [cand]})

    def _record(self, rec: dict) -> None:
        rec["line"] = choice_line(rec)
        self.records.append(rec)
        _log.info("kernels auto: %s", rec["line"])

    def choose(self, kernel: str, candidates: dict[str, Callable[[], torch.Tensor]], *,
               reference: str | Callable[[], torch.Tensor] = "eager", repeats: int = 5, n: int | None = None) -> str:
        """Auto's choice for `kernel`: each candidate (name -> a call on the run's inputs, returning
        the result) runs once and is kept only if its bytes equal the reference's (a candidate's
        name, or a call giving the bytes to match), then is timed `repeats` times, interleaved; a
        candidate's time is its fastest call (the estimate a shared machine disturbs least); the
        fastest wins, a cheaper one within kernel_choice.TIE of it wins the tie (`fastest`)."""
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
                times[name].append(time_ms(fn, self.device))
        ms = {name: min(t) for name, t in times.items()}
        self.chosen[kernel] = fastest(ms)
        self._record({"kernel": kernel, "device": self.device.type, "n": n, "chosen": self.chosen[kernel], "ms": ms,
                      "rejected": rejected})
        return self.chosen[kernel]

    def _measure(self, segs: list[tuple[int, int]], cfg: dict, clip: float, repeats: int) -> None:
        n, P = sum(m for _, m in segs), max(cfg["world_sizes"] or (1,))
        if cfg["bits"] or not n:
            return
        gen = torch.Generator(device=self.device)
        gen.manual_seed(4321)
        x = torch.randn(n, generator=gen, device=self.device)
        length = ceil_div(n, 8 * P) * 8 * P
        fast = Kernels("compiled", self.device)
        if self.chosen["sign_pack"] == "compiled":
            self.choose("sign_pack", {"eager": lambda: tb_packed(x, 1, length),
                                      "compiled": lambda: fast.sign_pack(x, 1, length)}, repeats=repeats, n=n)
        if P > 1 and self.chosen["unpack_majority"] == "compiled":
            recv = torch.randint(0, 256, (length // 8,), generator=gen, device=self.device, dtype=torch.uint8)
            self.choose("unpack_majority", {"eager": lambda: local_majority(recv, P, 1),
                                            "compiled": lambda: fast.unpack_majority(recv, P, 1)}, repeats=repeats, n=n)

    def agree(self, group=None) -> None:
        """Make auto's measured choices the same on every rank of `group` (collective: every rank
        calls it after its warm-up): among the candidates every rank accepted, the one whose slowest
        rank is fastest (`merge_choices`). Ranks that exchange then run one code."""
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return
        latest = {r["kernel"]: r for r in self.records}
        mine = {f"{k}|{r['device']}": {"ms": r["ms"]} for k, r in latest.items()}
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, mine, group=group)
        for key, chosen in merge_choices(gathered).items():
            rec = dict(latest[key.split("|")[0]], chosen=chosen, agreed=len(gathered))
            self.chosen[rec["kernel"]] = chosen
            self._record(rec)


# ---- the settings as strings: callers that do not hold a Kernels --------------------------------
# A run builds one Kernels (the optimizer's kernel_set, handed to its exchange) and passes it; a call
# given a setting string gets a Kernels of its own, for that call only: there is no module-level
# state, so one caller's warm-up choices never leak into another's.
def of(impl: Kernels | str | None, device: torch.device | str) -> Kernels:
    """The Kernels a call runs on: `impl` itself, or a new one for a setting string (None: eager; "auto":
    the device's fast implementation, unchecked and untimed, since this call has no warm-up)."""
    return impl if isinstance(impl, Kernels) else Kernels(impl, device)


def resolve_impl(impl: Kernels | str | None) -> str:
    """The comm.kernels setting `impl` stands for (None: eager)."""
    return impl.setting if isinstance(impl, Kernels) else ("eager" if impl is None else impl)


def kernel_impl(impl: Kernels | str | None, device: torch.device | str, kernel: str) -> str:
    """Which implementation runs `kernel` on `device` under `impl`: "eager", "compiled" or "native"."""
    return of(impl, device).which(kernel)


def use_compiled(impl: Kernels | str | None, device: torch.device | str, kernel: str | None = None) -> bool:
    """Whether `kernel` (None: compiled code in general, e.g. optim.lion's passes) runs compiled under
    `impl` on `device`; an impossible impl='compiled' raises, naming the reason."""
    if kernel is not None:
        return kernel_impl(impl, device, kernel) == "compiled"
    setting = resolve_impl(impl)
    if setting not in IMPLS:
        raise ValueError(f"kernels: impl={setting!r}; choose one of {IMPLS}")
    if setting == "compiled":
        return Kernels("compiled", device).which("sign_pack") == "compiled"
    return setting == "auto" and compile_unavailable(device) is None


def sign_pack(x: torch.Tensor, step: int, length: int | None = None, *, impl: Kernels | str | None = None) -> torch.Tensor:
    """Kernels.sign_pack under `impl` (a Kernels or a setting)."""
    return of(impl, x.device).sign_pack(x, step, length)


def quantize_pack(c: torch.Tensor, segments: Sequence[tuple[int, int]], levels: int, p: float | None,
                  clip: float = 2.0, bits: int = 4, rounding: str = "nearest", generator: torch.Generator | None = None,
                  tie_step: int = 1, *, impl: Kernels | str | None = None, scratch: torch.Tensor | None = None,
                  means: torch.Tensor | None = None) -> torch.Tensor:
    """Kernels.quantize_pack under `impl` (a Kernels or a setting)."""
    return of(impl, c.device).quantize_pack(c, segments, levels, p, clip, bits, rounding, generator, tie_step,
                                            scratch=scratch, means=means)


def unpack_sum(wire: torch.Tensor, bits: int, n: int, levels: int, P: int, *, sign: bool = False,
               dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
               impl: Kernels | str | None = None) -> torch.Tensor:
    """Kernels.unpack_sum under `impl` (a Kernels or a setting)."""
    return of(impl, wire.device).unpack_sum(wire, bits, n, levels, P, sign=sign, dtype=dtype, out=out)


def unpack_majority(recv: torch.Tensor, P: int, step: int, *, impl: Kernels | str | None = None) -> torch.Tensor:
    """Kernels.unpack_majority under `impl` (a Kernels or a setting)."""
    return of(impl, recv.device).unpack_majority(recv, P, step)


def warmup(device: torch.device | str = "cpu", *, impl: Kernels | str | None = None, agree: bool = False, group=None,
           **config) -> float:
    """Kernels.warmup under `impl` (a Kernels or a setting: then of a Kernels built for this call, whose
    choices go with it; compiled and native code stays built for the process); with agree=True the ranks
    of `group` then agree on auto's measured choices (`Kernels.agree`, a collective). Returns seconds."""
    k = of(impl, device)
    seconds = k.warmup(**config)
    if agree and k.setting == "auto":
        k.agree(group)
    return seconds


def report_mismatch(bad: Sequence[str], device: torch.device | str, impl: Kernels | str | None,
                    cand: str = "compiled") -> None:
    """Kernels.reject for kernels outside the wire kernels (optim.lion's passes): raise when `impl`
    names `cand`, else warn (the caller keeps its reference)."""
    if not bad:
        return
    msg = f"kernels.warmup: {cand} kernels differ from the reference on {device}: {', '.join(sorted(set(bad)))}"
    if resolve_impl(impl) == cand:
        raise RuntimeError(msg + "; use impl='eager'")
    warnings.warn(msg + f"; not using the {cand} kernels", stacklevel=3)


__all__ = ["IMPLS", "KERNELS", "MEASURED_ON_CUDA", "NO_COMPILE_ENV", "QBLOCK", "SMALL", "Kernel", "Kernels",
           "compile_unavailable", "compiled_kernel", "dtype_key", "eager_float", "f32",
           "fastest", "kernel_impl", "native_quantizes", "of", "quantize_pack", "quantize_q", "report_mismatch",
           "resolve_impl", "sign_pack", "stochastic_bounds", "time_ms", "unpack_majority", "unpack_sum",
           "unpack_sum_reference", "use_compiled", "warmup", "wire_of"]
