"""Which float rounding this host's torch CPU kernels produce: the key of a host's golden digests.

Bit-identical training (tests/trainer/test_golden.py) holds per host, not across hosts: torch picks its CPU
kernels by the host's vector width (AVX2, AVX-512), MKL picks its GEMM kernels by the CPU, and a
vectorized reduction or exp adds and rounds in another order on another host. The same code and
seed then give parameters that differ in the last bits after one step. So the golden digests are
recorded per host kind, keyed by this fingerprint: the SHA-256 of a few kernels the tiny model's
step uses (GEMMs of its shapes and their transposes in fp32 and bf16, softmax cross-entropy,
RMSNorm-style rsqrt of a mean, SiLU, exp), run on inputs built from integers so that the inputs
themselves are the same everywhere. Two hosts with the same fingerprint round those kernels alike.

Run as a script (`python -m tests.golden.host`), it prints the fingerprint, one thread as the
workers run (OMP_NUM_THREADS=1).
"""
from __future__ import annotations

import hashlib


def _grid(rows: int, cols: int, salt: int):
    """A fixed (rows, cols) float32 matrix in [-0.5, 0.5) from integer arithmetic only."""
    import torch

    i = torch.arange(rows * cols, dtype=torch.int64) * 2654435761 + salt * 40503
    return ((i % 1009).to(torch.float32) / 1009.0 - 0.5).reshape(rows, cols)


def fingerprint() -> str:
    import torch

    torch.set_num_threads(1)
    h = hashlib.sha256()
    x = _grid(64, 128, 1).requires_grad_(True)  # (tokens, width) of the tiny model
    w1 = _grid(512, 128, 2).requires_grad_(True)
    w2 = _grid(128, 512, 3).requires_grad_(True)
    emb = _grid(1000, 128, 4).requires_grad_(True)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    y = torch.nn.functional.silu(y @ w1.t()) @ w2.t()
    logits = y @ emb.t()
    target = torch.arange(64) * 7 % 1000
    loss = torch.nn.functional.cross_entropy(logits, target)
    loss.backward()
    bf = (_grid(64, 128, 5).bfloat16() @ _grid(128, 96, 6).bfloat16()).float()
    for t in (y, logits, loss, x.grad, w1.grad, w2.grad, emb.grad, bf, torch.exp(_grid(64, 64, 7) * 8),
              torch.softmax(_grid(16, 1000, 8) * 10, dim=-1)):
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


if __name__ == "__main__":
    print(fingerprint())
