"""comm.kernels' warm-up check: every fast kernel a configuration uses against the eager reference,
on small random, zero and tie inputs."""
from __future__ import annotations

import torch

from .allreduce import check_lanes
from .kernel_quant import QBLOCK, SMALL, quantize_q, unpack_sum_reference, wire_of
from .vote import local_majority, tb_packed


def check_against_reference(k, cfg: dict) -> list[str]:
    """Run (compiling or building) every kernel of the configuration `cfg` (Kernels.warmup's
    keywords) through `k` (a comm.kernels.Kernels of one named implementation) on small random,
    zero and tie inputs; the names of the kernels whose bytes differ from the reference's."""
    device = k.device
    gen = torch.Generator(device=device)
    gen.manual_seed(1234)
    # three whole quantizer blocks, one with a segment boundary: a block count equal to a lane count
    # (1, 2, 4, 8) would be tied to it by dynamo's duck shaping, and the graph specialised on it
    n = 3 * QBLOCK + 4 * SMALL + 13
    x = torch.randn(n, generator=gen, device=device)
    x[::5] = 0.0
    segs = [(0, 2 * SMALL + 1), (2 * SMALL + 1, n - 2 * SMALL - 1)]
    bad: list[str] = []

    def same(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        if not torch.equal(a, b):
            bad.append(name)

    for dt in cfg["sign_dtypes"]:
        for step in (1, 2):
            same(f"sign_pack[{dt}]", k.sign_pack(x.to(dt), step), tb_packed(x.to(dt), step))
    for P in cfg["world_sizes"]:
        recv = torch.randint(0, 256, (P * 301,), generator=gen, device=device, dtype=torch.uint8)
        for step in (1, 2):
            same(f"unpack_majority[P={P}]", k.unpack_majority(recv, P, step), local_majority(recv, P, step))
    for b in cfg["bits"]:
        for L in cfg["levels"]:
            for pp in (cfg["p"] or [1.0]):
                for rnd in cfg["rounding"]:
                    try:
                        check_lanes(1, L, b)
                    except ValueError:
                        continue
                    g1, g2 = torch.Generator(device=device).manual_seed(7), torch.Generator(device=device).manual_seed(7)
                    w = k.quantize_pack(x, segs, L, pp, 2.0, b, rnd, g1, 1)
                    same(f"quantize_pack[bits={b},L={L},p={pp},{rnd}]", w,
                         wire_of(quantize_q(x, segs, L, pp, 2.0, rnd, g2, 1), L, b))
                    for P in cfg["world_sizes"] or (1,):
                        try:
                            check_lanes(P, L, b)
                        except ValueError:
                            continue
                        for sgn, dt in ((False, None), (True, torch.float32), (True, torch.int8)):
                            ref = unpack_sum_reference(w, b, n, L, P)
                            same(f"unpack_sum[bits={b},L={L},sign={sgn},{dt}]", k.unpack_sum(w, b, n, L, P, sign=sgn, dtype=dt),
                                 torch.sign(ref).to(dt) if sgn else ref)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return bad
