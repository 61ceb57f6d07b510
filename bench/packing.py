"""Quantize/pack/unpack and Lion-pass throughput against a copy of the input (the fast-path targets).

    python -m bench.packing [--n 25M] [--repeats 7] [--threads 1] [--P 4] [--device cpu]

In one run, the median time of each hot path of the quantized schemes, eager reference vs the
compiled kernels of comm.kernels (and optim.lion's fused passes) vs, on CPU, the C loops of
comm.native (the wire kernels; they have no Lion passes), and its ratio to `copy_` of the
n-element float32 input into a preallocated buffer (the memory-bandwidth floor of one read + one
write). On a GPU (--device cuda) every call is timed with CUDA events and nothing inside a timed
call syncs with the host:

    1-bit pack        tie-broken signs -> packed bits (comm.vote.tb_packed)
    L1 4-bit / 8-bit  Lion Cub eq. 1 per tensor + q + L in 4- / 8-bit lanes (int_allreduce's wire);
                      Linf 8-bit the same with M_inf (a segmented max)
    majority          P packed chunks -> exact majority with tie break -> packed (n/8 bytes in)
    sum, sum+sign     summed 4-bit wire -> int32 sums; -> sign of the sum as float32 (eager: the
                      int32 reference then torch.sign) and as the int8 update p-bit applies (eager:
                      one-byte lanes against the offset)
    Lion passes       direction + momentum (+ the fused single pass), apply; foreach vs compiled

The vector is split into tensors shaped like a small GPT (an embedding, matrices, a few tiny
norms), each its own quantization segment. Compile time is paid by kernels.warmup before any
timing and reported on its own. Every compiled and native result is checked byte for byte against
the reference. Each repeat runs copy_, eager, compiled and native back to back and the ratios are medians of
the per-repeat ratios. The load average is printed before and after: numbers taken above a
load of 2 on a shared machine are noise; rerun. The compiled unpack rows write into reused
buffers (as an optimizer does); the eager reference allocates its results, as int_allreduce and
torch.sign do. A compiled kernel call costs tens of microseconds of host time (guards, launch),
so at small n the eager path wins.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
from typing import Callable

import torch

from comm import max_levels
from comm.packing import pack_lanes
from comm import kernels, native
from comm.vote import local_majority, tb_packed
from optim.lion import (apply_update_, fused_apply_update_, fused_lion_direction_, fused_lion_direction_momentum_,
                        fused_momentum_update_, lion_direction, momentum_update_, warmup_fused_passes)

from .comm import parse_size


def segment_sizes(n: int) -> list[int]:
    """Tensor sizes of a small-GPT-like layout summing to n: an embedding (~40 %), 12 matrices,
    12 norm vectors of 768 (none a multiple of 8 apart from chance)."""
    norms = [768] * 12 if n > 100_000 else []
    rest = n - sum(norms)
    emb = int(rest * 0.4) + 3
    mats = [(rest - emb) // 12] * 12
    mats[-1] += rest - emb - sum(mats)
    return [emb] + [s for pair in zip(mats, norms or [0] * 12) for s in pair if s]


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """ms of one call: CUDA events on a GPU, no host sync inside the span (comm.kernels.time_ms,
    the timer of comm.kernels=auto's choice on CUDA)."""
    return lambda fn: kernels.time_ms(fn, device)


def measure(fns: list[Callable[[], object] | None], repeats: int, device: torch.device) -> list[tuple]:
    """Median ms of each fn and median of its per-repeat ratio to fns[0] (copy_), the fns run
    back to back within each repeat: on a shared machine the ratio survives load that comes and
    goes better than a ratio of medians taken minutes apart."""
    once = _timer(device)
    for fn in fns:
        if fn is not None:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            if fn is not None:
                times[i].append(once(fn))
    out = []
    for t in times:
        if not t:
            out.append((None, None))
            continue
        ratios = [a / b for a, b in zip(t, times[0])]
        out.append((statistics.median(t), statistics.median(ratios)))
    return out


def _load() -> str:
    try:
        return " ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "n/a"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=parse_size, default=parse_size("25M"), help="elements (default 25M)")
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--P", type=int, default=4, help="ranks for the majority and the sums (default 4)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    n, P = args.n, args.P
    load_before = _load()
    sizes = segment_sizes(n)
    segs, off = [], 0
    for s in sizes:
        segs.append((off, s))
        off += s
    L4, L8 = max_levels(P, 4), max_levels(P, 8)

    t0 = time.perf_counter()
    comp = kernels.Kernels("compiled", dev)  # the run's Kernels, one per implementation timed here
    compile_s = comp.warmup(bits=(4, 8), levels=(L4, L8), p=(1.0, math.inf), world_sizes=(P,)) + \
        warmup_fused_passes(dev, impl="compiled")
    warm_wall = time.perf_counter() - t0
    nat = native.unavailable(dev) is None  # the native loops: built once per host, not compiled
    natk = kernels.Kernels("native" if nat else "eager", dev)
    eag = kernels.Kernels("eager", dev)

    g = torch.Generator(device=dev)
    g.manual_seed(0)
    x = torch.randn(n, generator=g, device=dev)
    x[::97] = 0.0
    dst = torch.empty_like(x)
    recv = torch.randint(0, 256, (n // 8 // P * P,), generator=g, device=dev, dtype=torch.uint8)
    # a summed 4-bit wire of P ranks: lane values in [0, 2 P L]
    lanes = torch.randint(0, 2 * P * max(L4, 1) + 1, (n,), generator=g, device=dev, dtype=torch.uint8)
    wire4 = pack_lanes(lanes, 4, check=False)
    m = torch.randn(n, generator=g, device=dev)
    grad = torch.randn(n, generator=g, device=dev)
    p = torch.randn(n, generator=g, device=dev)
    c = torch.empty(n, device=dev)
    u = torch.sign(torch.randn(n, generator=g, device=dev))

    def views(t: torch.Tensor) -> list[torch.Tensor]:
        return [t[o:o + s] for o, s in segs]

    mv, gv, pv, cv, uv = views(m), views(grad), views(p), views(c), views(u)
    scratch = torch.empty(max(sizes), device=dev)
    sums = torch.empty(n, dtype=torch.int32, device=dev)  # the optimizer's reused update buffers
    upd = torch.empty(n, device=dev)
    upd8 = torch.empty(n, dtype=torch.int8, device=dev)
    lr, wd, b1, b2 = 3e-4, 0.1, 0.9, 0.99

    def q_eager(bits: int, L: int, p: float = 1.0):
        return lambda: kernels.wire_of(kernels.quantize_q(x, segs, L, p, 2.0), L, bits)

    def q_comp(bits: int, L: int, p: float = 1.0):
        return lambda: comp.quantize_pack(x, segs, L, p, 2.0, bits, scratch=scratch)

    def q_nat(bits: int, L: int, p: float = 1.0):
        return lambda: natk.quantize_pack(x, segs, L, p, 2.0, bits, scratch=scratch)

    def sum_eager(sign: bool):
        def f():
            t = kernels.unpack_sum_reference(wire4, 4, n, L4, P)
            return torch.sign(t).to(torch.float32) if sign else t
        return f

    def lion_eager():
        lion_direction(mv, gv, b1, out=cv)
        momentum_update_(mv, gv, b2)

    def lion_comp():
        fused_lion_direction_momentum_(mv, gv, b1, b2, cv, impl="compiled")

    def nat_or_none(fn: Callable) -> Callable | None:
        return fn if nat else None

    # (name, eager, compiled, native): the native loops cover the wire kernels except the int32 sums
    # and the float32 sign (comm.native writes the int8 update the optimizer applies)
    rows: list[tuple[str, Callable, Callable | None, Callable | None]] = [
        ("copy_ float32 into buffer", lambda: dst.copy_(x), None, None),
        ("1-bit tb sign -> packed bits", lambda: tb_packed(x, 1), lambda: comp.sign_pack(x, 1),
         nat_or_none(lambda: natk.sign_pack(x, 1))),
        (f"L1 quantize -> 4-bit lanes (L={L4})", q_eager(4, L4), q_comp(4, L4), nat_or_none(q_nat(4, L4))),
        (f"L1 quantize -> 8-bit lanes (L={L8})", q_eager(8, L8), q_comp(8, L8), nat_or_none(q_nat(8, L8))),
        (f"unpack + majority (P={P}, n/8 B in)", lambda: local_majority(recv, P, 1),
         lambda: comp.unpack_majority(recv, P, 1),
         nat_or_none(lambda: natk.unpack_majority(recv, P, 1))),
        (f"unpack + sum (4-bit, P={P}) -> int32", sum_eager(False),
         lambda: comp.unpack_sum(wire4, 4, n, L4, P, out=sums), None),
        (f"unpack + sum + sign (4-bit, P={P})", sum_eager(True),
         lambda: comp.unpack_sum(wire4, 4, n, L4, P, sign=True, out=upd), None),
        (f"unpack + sign -> int8 update (4-bit, P={P})",
         lambda: eag.unpack_sum(wire4, 4, n, L4, P, sign=True, dtype=torch.int8, out=upd8),
         lambda: comp.unpack_sum(wire4, 4, n, L4, P, sign=True, dtype=torch.int8, out=upd8),
         nat_or_none(lambda: natk.unpack_sum(wire4, 4, n, L4, P, sign=True, dtype=torch.int8, out=upd8))),
        (f"Linf quantize -> 8-bit lanes (L={L8})", q_eager(8, L8, math.inf), q_comp(8, L8, math.inf),
         nat_or_none(q_nat(8, L8, math.inf))),
        ("Lion direction c", lambda: lion_direction(mv, gv, b1, out=cv),
         lambda: fused_lion_direction_(mv, gv, b1, cv, impl="compiled"), None),
        ("Lion momentum m", lambda: momentum_update_(mv, gv, b2),
         lambda: fused_momentum_update_(mv, gv, b2, impl="compiled"), None),
        ("Lion direction + momentum", lion_eager, lion_comp, None),
        ("Lion apply p (u = sign)", lambda: apply_update_(pv, uv, lr, wd),
         lambda: fused_apply_update_(pv, uv, lr, wd, u_is_sign=True, impl="compiled"), None),
    ]

    # byte-identity of everything timed (the Lion passes on copies of the state)
    checks = {}
    for name, fe, fc, fn in rows[1:9]:
        ref = fe().clone()  # the int8 update rows reuse one out buffer
        checks[name] = torch.equal(ref, fc()) and (fn is None or torch.equal(ref, fn()))
    for name, run_e, run_c in (("Lion direction + momentum", lion_eager, lion_comp),):
        m0 = m.clone()
        run_e()
        ce, me = c.clone(), m.clone()
        m.copy_(m0)
        run_c()
        checks[name] = torch.equal(ce, c) and torch.equal(me, m)
        m.copy_(m0)
    p0 = p.clone()
    apply_update_(pv, uv, lr, wd)
    pe = p.clone()
    p.copy_(p0)
    fused_apply_update_(pv, uv, lr, wd, u_is_sign=True, impl="compiled")
    checks["Lion apply p (u = sign)"] = torch.equal(pe, p)
    p.copy_(p0)

    results = {}
    copy_fn = rows[0][1]
    for name, fe, fc, fn in rows[1:]:
        (c_ms, _), (e_ms, e_r), (k_ms, k_r), (n_ms, n_r) = measure([copy_fn, fe, fc, fn], args.repeats, dev)
        results[name] = (e_ms, e_r, k_ms, k_r, c_ms, n_ms, n_r)
    load_after = _load()

    print(f"bench.packing: n={n:,} ({len(sizes)} tensors) device={dev} threads={torch.get_num_threads()} "
          f"P={P} median of {args.repeats}; torch {torch.__version__}, {platform.processor() or platform.machine()}")
    print(f"load average before: {load_before}   after: {load_after}")
    print(f"compile (kernels.warmup and optim.lion's, outside timing): {compile_s:.1f} s wall")
    copies = [r[4] for r in results.values()]
    copy_ms = statistics.median(copies)
    print(f"copy_ of {n * 4 / 1e6:.1f} MB float32 into a buffer: median {copy_ms:.2f} ms "
          f"(range over rows {min(copies):.2f}-{max(copies):.2f}); ratios are per repeat, back to back")
    print(f"{'':42s} {'eager ms':>9s} {'x copy_':>8s} {'compiled ms':>12s} {'x copy_':>8s} {'speedup':>8s} "
          f"{'native ms':>10s} {'x copy_':>8s}  identical")
    for name, (e, er, k, kr, _, nm, nr) in results.items():
        same = "yes" if checks.get(name, True) else "NO"
        nat_cols = f"{nm:10.2f} {nr:8.2f}" if nm is not None else f"{'-':>10s} {'-':>8s}"
        print(f"{name:42s} {e:9.2f} {er:8.2f} {k:12.2f} {kr:8.2f} {e / k:7.2f}x {nat_cols}  {same}")
    return {"copy_ms": copy_ms, "results": results, "checks": checks, "compile_s": compile_s,
            "warmup_wall_s": warm_wall, "load_before": load_before, "load_after": load_after}


if __name__ == "__main__":
    main()
