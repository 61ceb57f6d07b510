"""Per-rank memory of a training run; its command is `python -m trainer.memory CONFIG [MORE.yaml ...]
[key=value ...] --world N [--shard-size S] [--device-gib G] [--variants A.yaml B.yaml]` (trainer/memory.py:
it reads a config).

What one rank holds, for the config's model, optimizer and comm mode at world size N with S ranks
sharding one copy of the model (parallel.shard_size; replicate = N / S):
- parameters: the fp32 master weights of this rank's shards (FSDP2 splits every tensor along
  dim 0 into S chunks of ceil(rows / S) rows; rank 0 holds a full chunk, the largest);
- gradients: one flat fp32 buffer over the same local elements (optim/layout.py attach_flat_grads);
- optimizer state: the optimizer registry's `state_words` per element (hidden matrix or not) and the sync
  scheme's `state_bytes` for the exchanged vector (error feedback), both on N / S ... local elements
  over the R = N / S replicas;
- communication buffers (estimate): the payload one exchange hands to its collective (the scheme's
  byte formula at P = R), an update-sync scheme's fp32 vector (the optimizer registry's
  `update_buffer`: Lion Cub's wave scratch, c being written over the gradient), and with S > 1 FSDP's unsharded
  parameters of the largest unit twice (the current one and the prefetched one) and its unsharded
  gradient (the reduce-scatter input);
- activations (estimate): what one micro-batch's forward keeps for backward, train.dtype wide
  (bfloat16 on CUDA), residual stream and logits in fp32.

Parameters, gradients and optimizer state are exact tensor sizes (tests/model/test_memory.py compares
them with the tensors a step leaves behind); buffers and activations are estimates.

This module sits above the rest of model/: it asks the optimizer and sync registries (optim) about a
config object it is handed, so the model itself never imports it; it imports nothing of the trainer.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field

import torch

from .gpt import MATRIX_ROLES

GIB = 2 ** 30


@dataclass
class Memory:
    """Bytes per rank by kind (rank 0: the largest shards)."""

    params: int = 0
    grads: int = 0
    optim_state: int = 0
    comm_buffers: int = 0
    activations: int = 0
    local_elements: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def model_state(self) -> int:
        """Parameters + gradients + optimizer state (what tests measure)."""
        return self.params + self.grads + self.optim_state

    @property
    def total(self) -> int:
        return self.model_state + self.comm_buffers + self.activations


def local_rows(rows: int, shards: int, index: int = 0) -> int:
    """Rows of dim 0 that shard `index` of `shards` holds (FSDP2's torch.chunk split)."""
    chunk = -(-rows // shards)
    return max(0, min(chunk, rows - index * chunk))


def local_numel(shape: tuple[int, ...], shards: int, index: int = 0) -> int:
    if not shape:
        return 1 if index == 0 or shards == 1 else 0
    return local_rows(shape[0], shards, index) * math.prod(shape[1:])


def model_shapes(model_config) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, role, shape) of every trainable parameter, built on the meta device (no memory)."""
    return [(n, role, shape) for n, role, shape, _ in _model_params(model_config)]


def _model_params(model_config) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(name, role, shape, layer) of every trainable parameter (layer: gpt.param_layers, "block.<i>" or "")."""
    from .gpt import GPT, param_layers, param_roles

    with torch.device("meta"):
        model = GPT(model_config)
    roles, layers = param_roles(model), param_layers(model)
    return [(n, roles[n], tuple(p.shape), layers[n]) for n, p in model.named_parameters()]


def fsdp_units(model_config) -> list[int]:
    """Elements of every FSDP unit (one per transformer block; the root holds the rest)."""
    shapes = model_shapes(model_config)
    blocks: dict[str, int] = {}
    for name, _, shape in shapes:
        parts = name.split(".")
        unit = ".".join(parts[:3]) if parts[:2] == ["transformer", "h"] else "root"
        blocks[unit] = blocks.get(unit, 0) + math.prod(shape)
    return list(blocks.values())


def activation_bytes(model_config, batch: int, seq: int, act_bytes: int) -> int:
    """Estimate of what one micro-batch's forward keeps for backward: per block the inputs of every
    matmul, norm and attention (about 10 d + 4 h values per token at `act_bytes`, h the SwiGLU width)
    and the fp32 residual stream (2 d), then the logits (train dtype, their fp32 copy and its
    gradient's log-softmax, 3 V values per token)."""
    c = model_config
    tokens = batch * seq
    per_block = tokens * ((10 * c.n_embd + 4 * c.mlp_hidden) * act_bytes + 2 * c.n_embd * 4)
    logits = tokens * c.vocab_size * (act_bytes + 8)
    return c.n_layer * per_block + logits


def estimate(cfg, world: int, shard_size: int = 1, *, device: str = "cuda", model_config=None) -> Memory:
    """Per-rank Memory of the run `cfg` (a trainer.config.Config) at `world` ranks and shard size S."""
    from optim import sync
    from optim.registry import get_optimizer

    from .presets import resolve_config

    if shard_size < 1 or world % shard_size:
        raise ValueError(f"--shard-size {shard_size} must be >= 1 and divide --world {world}")
    replicas = world // shard_size
    mc = model_config or resolve_config(vars(cfg.model))
    spec, scheme = get_optimizer(cfg.optim.name), sync.get(cfg.comm.mode)
    mem = Memory()
    layout = []   # (layer, local numel): what a local-update scheme's fragments are made of
    for _, role, shape, layer in _model_params(mc):
        n = local_numel(shape, shard_size)
        mem.local_elements += n
        layout.append((layer, n))
        if spec.state_words is None:
            continue
        mem.optim_state += int(4 * spec.state_words(cfg.optim.options, scheme, role in MATRIX_ROLES and len(shape) == 2) * n)
    if spec.state_words is None:
        mem.notes.append(f"optim.name={spec.name} declares no state_words: its state is not counted")
    n = mem.local_elements
    mem.params = mem.grads = 4 * n
    if scheme.stateful:
        mem.optim_state += scheme.state_bytes(cfg.comm.options, replicas, n)
    # one exchange's buffers at once (a local-update scheme: its largest fragment's average, not the cycle mean);
    # update sync: the exchanged vector's buffer, as the optimizer declares it (Lion Cub: a wave scratch,
    # c being written over the gradient; the whole vector with comm.overlap)
    separate = bool(cfg.comm.overlap and cfg.comm.bucket_mb > 0)
    vector = spec.update_buffer(n, separate) if spec.update_buffer is not None else n
    mem.comm_buffers = (scheme.buffer_bytes(cfg.comm.options, replicas, n, layout)
                        + (4 * vector if scheme.kind == sync.UPDATE else 0))
    if shard_size > 1:
        mem.comm_buffers += 3 * 4 * max(fsdp_units(mc))
    act = 2 if device == "cuda" and cfg.train.dtype == "bfloat16" else 4
    mem.activations = activation_bytes(mc, cfg.data.batch_size, cfg.data.seq_len, act)
    return mem


def measure(model: torch.nn.Module, optimizer) -> dict[str, int]:
    """Bytes of the tensors a rank holds after a step: its parameters (local shards of DTensors),
    the optimizer's flat gradient buffers and every tensor of the optimizer's state_dict (its
    exchange's state included), each storage counted once."""
    seen: set[tuple[int, int]] = set()

    def nbytes(t: torch.Tensor) -> int:
        local = t.to_local() if hasattr(t, "to_local") else t
        key = (local.untyped_storage().data_ptr(), local.storage_offset())
        if key in seen or local.numel() == 0:
            return 0
        seen.add(key)
        return local.numel() * local.element_size()

    def walk(x) -> int:
        if isinstance(x, torch.Tensor):
            return nbytes(x)
        if isinstance(x, dict):
            return sum(walk(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return sum(walk(v) for v in x)
        return 0

    params = sum(nbytes(p) for p in model.parameters())
    grads = sum(nbytes(b) for b in optimizer.grad_buffers.values())
    state = walk(optimizer.state_dict())
    return {"params": params, "grads": grads, "optim_state": state, "model_state": params + grads + state}


def _fmt(b: int) -> str:
    return f"{b / GIB:8.2f} GiB" if b >= GIB / 10 else f"{b / 2 ** 20:8.2f} MiB"


def report(mem: Memory, device_gib: float) -> str:
    fits = mem.total <= device_gib * GIB
    lines = [f"  parameters        {_fmt(mem.params)}  ({mem.local_elements:,} local elements, fp32)",
             f"  gradients         {_fmt(mem.grads)}",
             f"  optimizer state   {_fmt(mem.optim_state)}",
             f"  comm buffers      {_fmt(mem.comm_buffers)}  (estimate)",
             f"  activations       {_fmt(mem.activations)}  (estimate, one micro-batch)",
             f"  total             {_fmt(mem.total)}  of {device_gib:g} GiB: {'fits' if fits else 'does NOT fit'}"]
    return "\n".join(lines + [f"  note: {n}" for n in mem.notes])


def moved(argv: list[str] | None = None) -> int:
    """The command used to live here; it reads a config, which is the trainer's, so it is
    `python -m trainer.memory` now (the model imports nothing of the trainer)."""
    ap = argparse.ArgumentParser(prog="python -m model.memory",
                                 description="moved: python -m trainer.memory CONFIG [MORE.yaml ...] [key=value ...] "
                                             "--world N")
    ap.parse_known_args(argv)
    print("error: the memory estimate's command is `python -m trainer.memory CONFIG [MORE.yaml ...] [key=value ...] "
          "--world N [--shard-size S] [--device-gib G] [--variants A.yaml B.yaml]` (the same arguments, in any "
          "order); run that", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(moved())
