"""Lion's fused step replayed as one CUDA graph: the kernels of optim.lion.FusedLionStep, launched by
one graph replay instead of one Python-side launch per tensor (and the compiled function's guard
checks on every tensor), so a step that starts on an idle GPU waits microseconds, not the host time of
every launch, for its first kernel.

The replay runs the very kernels FusedLionStep runs, on the same tensors, so its bytes are that
step's bytes. A graph holds addresses: it is captured for the tensors of one call and replayed while
every parameter, gradient and momentum keeps its storage; a call on other storage runs the compiled
step directly and captures again at the next one.
The hyperparameter rows travel into a device tensor the graph reads, so a schedule needs no capture.
A capture that fails raises GraphCaptureError: a capture records kernels without launching them, so
that call changed no parameter or momentum and its caller can run the plain fused step for it.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


class GraphCaptureError(RuntimeError):
    """The capture of a GraphedLionStep call failed; nothing of that call ran (the message names the error)."""


class GraphedLionStep:
    """A FusedLionStep (same call) whose kernels replay from a CUDA graph after the first two calls: the
    first compiles and steps, the second captures and replays, the later ones copy the rows and replay.
    Wraps the step it is given and gathers its inputs through that step's `inputs` (this module does not
    import optim.lion, so optim.lion may import it)."""

    def __init__(self, fused) -> None:
        """`fused`: the optim.lion.FusedLionStep to replay (its compiled step is reused)."""
        self.device = torch.device(fused.device)
        if self.device.type != "cuda":
            raise ValueError(f"GraphedLionStep needs a CUDA device, not {self.device}; use optim.lion.FusedLionStep")
        self.fused = fused
        self.graph: torch.cuda.CUDAGraph | None = None
        self._key: tuple | None = None
        self._hyper: torch.Tensor | None = None
        self.calls = self.captures = 0

    def __call__(self, state: dict, groups: Sequence[tuple[dict, Sequence[torch.Tensor]]]) -> None:
        ps, gs, ms, rows, hyper = self.fused.inputs(state, groups)
        if not ps:
            return
        key = (rows, tuple(t.data_ptr() for t in ps + gs + ms))
        if self.fused._rows != rows:
            self.fused._build(rows)
        h = torch.tensor(hyper, dtype=torch.float32, pin_memory=True)
        if self._hyper is None or self._hyper.shape != h.shape:
            self._hyper, self.graph = torch.empty(h.shape, dtype=torch.float32, device=self.device), None
        self._hyper.copy_(h, non_blocking=True)  # in stream order, before the kernels that read it
        if self.graph is not None and key == self._key:
            self.graph.replay()
        elif self._key == key:  # compiled and run once for these tensors: capture (nothing runs), then replay
            self.graph = self._capture(ps, gs, ms)
            self.captures += 1
            self.graph.replay()
        else:  # first call, or the tensors moved: the compiled step directly
            self.graph, self._key = None, key
            self.fused._run(ps, gs, ms, self._hyper)
        self.calls += 1

    def _capture(self, ps: list, gs: list, ms: list) -> torch.cuda.CUDAGraph:
        """The graph of one compiled step over these tensors; GraphCaptureError where the capture fails.
        The capture's kernels are recorded, not launched, so a failure leaves every tensor as it was."""
        stream = torch.cuda.current_stream(self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.fused._run(ps, gs, ms, self._hyper)
        except Exception as e:  # noqa: BLE001  (any failure: the caller steps without the graph)
            # a capture_end that raises skips the exit of the capture's side stream: make the caller's current again
            torch.cuda.set_stream(stream)
            raise GraphCaptureError(f"{type(e).__name__}: {' '.join(str(e).split())[:200]}") from e
        return graph
