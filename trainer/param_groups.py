"""Parameter groups: one per role (model.ROLES), with weight decay only on >= 2-D weights and
lr multipliers for embedding, head and 1-D scalars (Lion Cub App. F.3)."""
from __future__ import annotations

import torch

from model import MATRIX_ROLES, ROLES, param_layers, param_roles


def param_groups(model: torch.nn.Module, optim_cfg) -> list[dict]:
    """Groups {params, names, layers, role, matrix, lr, lr_mult, weight_decay} in role order; every
    parameter in exactly one group (asserted). `matrix` marks the hidden matrices (model.MATRIX_ROLES),
    the parameters Muon and Dion orthonormalize: optimizers read the flag, never role names."""
    o = optim_cfg
    mult = {"embedding": o.embedding_lr_mult, "head": o.head_lr_mult, "attn": 1.0, "mlp": 1.0,
            "norm": o.scalar_lr_mult}
    assert set(mult) == set(ROLES), "every role of model.ROLES needs an lr multiplier"
    roles, layers = param_roles(model), param_layers(model)
    named = dict(model.named_parameters())
    groups = []
    for role in ROLES:
        names = [n for n, r in roles.items() if r == role]
        if not names:
            continue
        params = [named[n] for n in names]
        wd = o.weight_decay if all(p.ndim >= 2 for p in params) else 0.0
        groups.append({"params": params, "names": names, "layers": [layers[n] for n in names], "role": role,
                       "matrix": role in MATRIX_ROLES, "lr_mult": mult[role], "lr": o.lr * mult[role], "weight_decay": wd})
    seen = [id(p) for g in groups for p in g["params"]]
    assert len(seen) == len(set(seen)) == len(named), "every parameter must be in exactly one group"
    return groups
