"""The flat layout of an optimizer's trainable parameters (Lion Cub App. D.2), built once.

Two flat vectors describe the same parameters:
- `FlatLayout`: every trainable parameter once, ordered by role (embedding, head, attn, mlp, norm:
  each role one contiguous slice) or, given `order`, in that order (buckets, optim/overlap.py); the
  update-sync vector (Lion Cub's c_local), momentum sync and the diagnostics use its views;
- `GradBuffers`: ONE flat gradient buffer per dtype, in the model's parameter order (or an order
  the optimizer picks); every parameter's `.grad` is a view of it, so backward accumulates in
  place and a gradient exchange is one collective per dtype.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch



def is_matrix_param(p: torch.Tensor, group: dict) -> bool:
    """A hidden matrix (Entry.matrix): a 2-D weight of a group whose `matrix` flag is set or absent."""
    flag = group.get("matrix")
    return p.ndim == 2 and (flag is None or bool(flag))

@dataclass
class Entry:
    """One trainable parameter in the role-ordered layout."""

    group: int
    role: str
    name: str
    layer: str
    param: torch.nn.Parameter
    offset: int
    numel: int
    matrix: bool = False
    """A hidden matrix (what Muon and Dion orthonormalize): the group's `matrix` flag, which the model's
    parameter groups set (model.MATRIX_ROLES); a group without the flag counts its 2-D weights."""

    @property
    def rows(self) -> int:
        return self.param.shape[0] if self.param.ndim >= 2 else 1


def _trainable(param_groups: list[dict]) -> list[tuple[int, str, str, str, torch.nn.Parameter]]:
    """(group, role, name, layer, param) of every trainable parameter, in group order."""
    out = []
    for gi, g in enumerate(param_groups):
        role = g.get("role", "all")
        names = g.get("names") or [f"group{gi}.{k}" for k in range(len(g["params"]))]
        layers = g.get("layers") or [""] * len(g["params"])
        for p, name, layer in zip(g["params"], names, layers):
            if p.requires_grad:
                out.append((gi, role, name, layer, p))
    return out


def role_order(param_groups: list[dict]) -> list[torch.nn.Parameter]:
    """The trainable parameters by role (roles in order of first appearance among the groups,
    group order within a role): FlatLayout's default order."""
    roles: dict[str, int] = {}
    raw = _trainable(param_groups)
    for e in raw:
        roles.setdefault(e[1], len(roles))
    return [e[4] for e in sorted(raw, key=lambda e: roles[e[1]])]  # stable: group order within a role


def model_order(param_groups: list[dict], param_order: list[torch.nn.Parameter] | None) -> list[torch.nn.Parameter]:
    """The trainable parameters in `param_order` (the model's), or by role when it does not list
    every one of them."""
    trainable = {id(e[4]) for e in _trainable(param_groups)}
    order = [p for p in (param_order or []) if id(p) in trainable]
    return order if len(order) == len(trainable) else role_order(param_groups)


class FlatLayout:
    """Trainable parameters ordered by role (`role_order`), so every role is one contiguous slice
    of a flat vector; or, given `order` (a list of parameters: buckets, optim.overlap), in that
    order."""

    def __init__(self, param_groups: list[dict], order: list[torch.nn.Parameter] | None = None) -> None:
        raw = _trainable(param_groups)
        pos = {id(p): k for k, p in enumerate(order if order is not None else role_order(param_groups))}
        raw.sort(key=lambda e: pos.get(id(e[4]), len(pos)))
        self.entries: list[Entry] = []
        off = 0
        for gi, role, name, layer, p in raw:
            matrix = is_matrix_param(p, param_groups[gi])
            self.entries.append(Entry(gi, role, name, layer, p, off, p.numel(), matrix))
            off += p.numel()
        self.numel = off
        self.by_role: dict[str, list[Entry]] = {}
        for e in self.entries:
            self.by_role.setdefault(e.role, []).append(e)
        self.per_group: dict[int, list[int]] = {}
        for k, e in enumerate(self.entries):
            self.per_group.setdefault(e.group, []).append(k)
        dtypes = {e.param.dtype for e in self.entries}
        self.dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        self.device = self.entries[0].param.device if self.entries else torch.device("cpu")
        self._role_index: torch.Tensor | None = None

    @property
    def roles(self) -> list[str]:
        return list(self.by_role)

    @property
    def segments(self) -> list[tuple[int, int]]:
        return [(e.offset, e.numel) for e in self.entries]

    @property
    def rows(self) -> list[int]:
        return [e.rows for e in self.entries]

    def role_index(self) -> torch.Tensor:
        """The role number (`roles` order) of every entry, on the layout's device; made once."""
        if self._role_index is None:
            roles = self.roles
            self._role_index = torch.tensor([roles.index(e.role) for e in self.entries], device=self.device)
        return self._role_index

    def views(self, flat: torch.Tensor, idx: Iterable[int]) -> list[torch.Tensor]:
        """Views of `flat` shaped like the parameters of entries `idx`."""
        return [flat[self.entries[k].offset:self.entries[k].offset + self.entries[k].numel]
                .view_as(self.entries[k].param) for k in idx]

    def params(self, idx: Iterable[int]) -> list[torch.nn.Parameter]:
        return [self.entries[k].param for k in idx]

    def new_flat(self) -> torch.Tensor:
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)


def attach_flat_grads(params: list[torch.nn.Parameter]) -> dict[torch.dtype, torch.Tensor]:
    """Point every parameter's .grad at a slice of one zeroed flat buffer per dtype (in the given
    order), so backward accumulates in place and a gradient exchange is one collective."""
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    buffers = {}
    for dtype, ps in by_dtype.items():
        flat = torch.zeros(sum(p.numel() for p in ps), dtype=dtype, device=ps[0].device)
        off = 0
        for p in ps:
            p.grad = flat[off:off + p.numel()].view_as(p)
            off += p.numel()
        buffers[dtype] = flat
    return buffers


class GradBuffers:
    """The flat gradient buffers (`attach_flat_grads`) of `params`, in that order, and the view each
    parameter's .grad must stay."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.order = list(params)
        self.buffers = attach_flat_grads(self.order)
        self.views: dict[int, torch.Tensor] = {id(p): p.grad for p in self.order}
        """id(parameter) -> the view of its gradient."""

    def zero_(self) -> None:
        for buf in self.buffers.values():
            buf.zero_()

    def adopt(self) -> None:
        """A .grad replaced from outside (assigned, or set to None) is copied back into its view."""
        for p in self.order:
            view = self.views[id(p)]
            g = p.grad
            if g is view:
                continue
            if g is None:
                view.zero_()  # no gradient this step counts as 0: the flat collective is the same on every rank
            else:
                view.copy_(g)
            p.grad = view

    def local_norm(self) -> torch.Tensor:
        """L2 norm (fp32, on the device) of this rank's buffers."""
        return flat_norm(list(self.buffers.values()))


def flat_norm(bufs: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm (fp32, on the device) of the concatenation of `bufs`: the norm of the per-buffer norms."""
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(b, dtype=torch.float32) for b in bufs]))


__all__ = ["Entry", "FlatLayout", "GradBuffers", "attach_flat_grads", "flat_norm", "is_matrix_param", "model_order",
           "role_order"]
