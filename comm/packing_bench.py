"""Packing throughput against the memory-bandwidth floor (issue 4, "Performance").

    OMP_NUM_THREADS=1 python -m comm.packing_bench [--n 25000000] [--repeats 7] [--device cpu]

Times (median of repeats) pack + unpack of n signs and compares them with a plain copy of the
n-element float32 input: "signs" = x (float32) -> tie-broken 1-bit flags -> packed bytes, and
packed bytes -> int8 +-1 (what sign_vote_1bit does locally), plus pack_bits/unpack_bits on a
bool tensor and 4-bit lanes.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from .packing import pack_bits, pack_lanes, unpack_bits, unpack_lanes, unpack_signs
from .vote import tb_packed


def _median_ms(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=25_000_000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    dev = torch.device(args.device)
    n = args.n
    x = torch.randn(n, device=dev)
    dst = torch.empty_like(x)
    packed = tb_packed(x, 1)
    b = x > 0
    v4 = torch.randint(0, 16, (n,), dtype=torch.uint8, device=dev)
    p4 = pack_lanes(v4, 4)
    rows = {
        "copy float32 (clone)": lambda: x.clone(),
        "copy float32 (into buffer)": lambda: dst.copy_(x),
        "pack signs (float32 -> tb -> bits)": lambda: tb_packed(x, 1),
        "unpack signs (bits -> int8 +-1)": lambda: unpack_signs(packed, n),
        "pack_bits (bool -> bits)": lambda: pack_bits(b),
        "unpack_bits (bits -> bool)": lambda: unpack_bits(packed, n),
        "pack_lanes 4-bit": lambda: pack_lanes(v4, 4, check=False),
        "unpack_lanes 4-bit": lambda: unpack_lanes(p4, 4, n),
    }
    ms = {k: _median_ms(f, args.repeats, dev) for k, f in rows.items()}
    copy = ms["copy float32 (clone)"]
    print(f"n={n} device={dev} threads={torch.get_num_threads()} (median of {args.repeats})")
    for k, v in ms.items():
        print(f"  {k:40s} {v:8.2f} ms  ({v / copy:5.2f}x clone)")
    signs = ms["pack signs (float32 -> tb -> bits)"] + ms["unpack signs (bits -> int8 +-1)"]
    bools = ms["pack_bits (bool -> bits)"] + ms["unpack_bits (bits -> bool)"]
    print(f"pack+unpack signs: {signs:.2f} ms = {signs / copy:.2f}x clone, "
          f"{signs / ms['copy float32 (into buffer)']:.2f}x copy_ into a buffer")
    print(f"pack_bits+unpack_bits: {bools:.2f} ms = {bools / copy:.2f}x clone")


if __name__ == "__main__":
    main()
