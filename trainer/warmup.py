"""What a run pays before its first timed step, so that it is reported apart and never lands in a
step's timing: the wire kernels' warm-up (built, compiled, checked against the reference, and with
comm.kernels=auto on CUDA timed) and the model's torch.compile."""
from __future__ import annotations

import time

import torch


def warm_up_kernels(optimizer, logger, step: int) -> None:
    """Build, compile, check (and with comm.kernels=auto on CUDA time) the wire kernels before any timed
    step, and log what it cost and what auto chose; nothing when the kernels need no warm-up."""
    compile_s = optimizer.warmup()
    if not compile_s:
        return
    choices = optimizer.kernel_choices()  # what auto timed (on CUDA; on CPU auto runs the native loops untimed)
    logger.console(f"kernels: {optimizer.kernels}, warmed up (built or compiled, checked against "
                   f"the reference{', timed' if choices else ''}) in {compile_s:.1f} s")
    for line in choices:
        logger.console(f"kernels: auto chose {line}")
    logger.log({"step": step, "event": "kernels", "compile_s": compile_s, "choices": choices})


def compile_model(model, forward, batch_size: int, seq_len: int, autocast, device: torch.device, *,
                  evaluation: bool = True) -> float:
    """Compile the model's training forward and backward (`forward`: the compiled model) on a batch
    of zeros. The gradients are returned by autograd.grad, not accumulated: no .grad, optimizer
    state or backward hook (a comm.overlap bucket) sees them, and the parameters are untouched.
    With `evaluation` (the run evaluates), the evaluation's forward too: it runs in eval mode
    without grad, which torch.compile guards on, so it is another graph; compiled here, its time is
    booked with the compile instead of hiding in the first evaluation. Returns seconds."""
    x = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
    params = [p for p in model.parameters() if p.requires_grad]
    t0 = time.perf_counter()
    if evaluation:
        model.eval()
        with torch.no_grad(), autocast:
            forward(x, torch.zeros_like(x))
    model.train()
    with autocast:
        _, loss = forward(x, torch.zeros_like(x))  # x and y distinct: aliasing would be another graph
    torch.autograd.grad(loss, params)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


__all__ = ["compile_model", "warm_up_kernels"]
