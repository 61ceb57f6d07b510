"""What a candidate's communication costs per step on measured links (trainer.advise's step 4, and
comm.mode=auto's through it): the registry's alpha-beta models at the world ring's fit, with the node
layout's corrections; a candidate's momentum sync; a local-update scheme's own prediction. It changes
with the registry and comm.cost_model; the measurements and the ranking (trainer/advise.py) do not."""
from __future__ import annotations

from comm import cost_model
from model import param_layers, param_roles
from model.memory import local_numel
from optim import sync


def node_layout(links: dict, P: int):
    """comm.cost_model.NodeLayout of the measured axes (None on one node): the world's ring fit
    feeds the formulas, the intra- and inter-node fits the phases that run inside / across nodes."""
    L = links["world"].get("node_size", 1)
    if not 1 < L < P:
        return None
    pick = (lambda k: (links[k]["alpha_s"], links[k]["beta_s_per_bit"]) if k in links else None)
    return cost_model.NodeLayout(P, L, intra=pick("intra-node"), inter=pick("inter-node"))


def predict_comm(opt, links: dict, P: int) -> float:
    """Seconds of one step's communication of optimizer `opt` on the measured links: the
    registry's formulas at the world axis's ring fit, with the layout's corrections for the
    collectives that cross the nodes' ports differently from a ring (comm.cost_model docstring).
    Why the world fit and not the inter-node axis: a ring over all ranks in rank order crosses
    every node's port once each way with a flat ring's volume, so on several nodes the world fit
    already is the inter-node link's, whereas the inter-node axis is measured with its node_size
    groups sharing the ports at once (the share the vote of a hierarchical exchange gets). Why the
    layout: an all-to-all puts L(P-L)/(P-1) times a flat rank's bytes through a port, a bound the
    flat model breaks, and a naive server's port carries P-L payloads. The two-node measurements
    behind both: docs/results/code_notes.md, "Several nodes: which link fit predicts what"."""
    world = links["world"]
    with cost_model.node_layout(node_layout(links, P)):
        return opt.predict_comm_seconds(world["alpha_s"], world["beta_s_per_bit"], P)


# ------------------------------------------------------------------------------------------------
# a local-update scheme (DiLoCo): compared with the per-step schemes per inner step
# ------------------------------------------------------------------------------------------------

def param_layout(model) -> list[tuple[str, int]]:
    """(layer, numel) of every parameter of `model` in its order: layer "block.<i>" inside transformer
    block i, "" outside (model.param_layers): what a local-update scheme's prediction fragments
    (optim.sync LocalScheme.predict_local)."""
    where = param_layers(model)
    return [(where[name], p.numel()) for name, p in model.named_parameters()]


def momentum_sync_per_step(opt, model, links: dict, P: int) -> tuple[float, float]:
    """(seconds, bytes one rank sends) per step of comm.momentum_sync, averaged over its interval: the fp32
    mean allreduce of the selected layers' momenta (CommOptimizer._sync_momenta: it books the buffer's bytes
    as sent) every `every` steps, on the world ring of the measured links. (0, 0) without momentum sync or
    at one rank. CommOptimizer.wire_bytes_per_step leaves it out (it is not the scheme's exchange)."""
    ms = getattr(opt, "momentum_sync", None)
    if ms is None or not ms.every or P <= 1:
        return 0.0, 0.0
    roles, named = param_roles(model), dict(model.named_parameters())
    m = sum(named[n].numel() for n, r in roles.items() if ms.selects(r))
    world = links["world"]
    with cost_model.node_layout(node_layout(links, P)):
        t = cost_model.ring_allreduce(P, m, 32, world["alpha_s"], world["beta_s_per_bit"])
    return t / ms.every, 4.0 * m / ms.every


def predict_candidate_comm(cfg, opt, links: dict, P: int, model, step_compute_s: float,
                           rank: int = 0) -> tuple[float, float]:
    """(seconds of communication, bytes one rank sends) per step of a candidate: config `cfg`, its
    optimizer `opt`, on the measured links. A per-step scheme: predict_comm and the registry's
    wire_bytes_per_step, plus its momentum sync averaged over its interval (momentum_sync_per_step). A local-update scheme (kind LOCAL) predicts itself (LocalScheme.predict_local
    on cfg.comm.options) on `model`'s parameters (param_layout): its cycle's exchanges per inner step,
    less what the inner steps of `step_compute_s` that follow an exchange hide on the background
    thread the trainer runs it on; same links and node layout as predict_comm."""
    scheme = sync.get(cfg.comm.mode)
    if scheme.kind != sync.LOCAL:
        sync_s, sync_bytes = momentum_sync_per_step(opt, model, links, P)
        return (predict_comm(opt, links, P) + sync_s,
                sum(s for s, _ in opt.wire_bytes_per_step(P, rank).values()) + sync_bytes)
    world = links["world"]
    with cost_model.node_layout(node_layout(links, P)):
        pred = scheme.predict_local(cfg.comm.options, P, param_layout(model), world["alpha_s"],
                                    world["beta_s_per_bit"], step_compute_s=step_compute_s, background=True)
    return pred.comm_s, pred.bytes_per_step


# ------------------------------------------------------------------------------------------------
# hybrid sharding (parallel.shard_size = S > 1): FSDP inside a shard group, the scheme across replicas
# ------------------------------------------------------------------------------------------------

def sharded_param_layout(model, S: int) -> list[tuple[str, int]]:
    """param_layout of the largest local shard (rank 0's) of every parameter when FSDP2 splits it over
    S ranks on dim 0 (its default and AdamW's, Lion's; trainer/parallel.py): ceil(rows / S) rows. What
    a rank's replicate-axis exchange carries at S > 1 (its shards of the model). Optimizers that
    shard another dimension (Dion, Muon: optim.registry shard_dims) split within one row of this."""
    where = param_layers(model)
    return [(where[name], local_numel(tuple(p.shape), S)) for name, p in model.named_parameters()]


def fsdp_comm(model, S: int, alpha: float, beta: float, micro_steps: int = 1) -> tuple[float, int]:
    """(seconds, bytes one rank sends) of one training step's FSDP2 traffic inside a shard group of S
    ranks on a link of (alpha, beta), as trainer/parallel.py wraps the model: every transformer block,
    then the root (everything outside the blocks), parameters and gradients in their own dtype (no
    mixed-precision policy). Per micro-step (data.grad_accum of them: no gradient-sync pause) each
    block's parameters are all-gathered for forward and again for backward (resharded after forward),
    the root's once (FSDP2 keeps the root unsharded after forward), and every unit's gradients are
    reduce-scattered: ring all-gather / reduce-scatter of comm.cost_model, one call per unit, on each
    parameter padded as FSDP2 pads it (dim 0 up to a multiple of S). Booked whole, as if exposed: an
    upper bound, since FSDP2 overlaps a block's all-gather with the previous block's compute."""
    if S <= 1:
        return 0.0, 0
    where = param_layers(model)
    units: dict[str, int] = {}
    for name, p in model.named_parameters():
        padded = S * local_numel(tuple(p.shape), S)  # every rank's chunk as large as rank 0's
        units[where[name]] = units.get(where[name], 0) + padded * p.element_size() * 8
    seconds, bits_sent = 0.0, 0.0
    for unit, bits in units.items():
        gathers = 2 if unit.startswith("block.") else 1
        seconds += (gathers * cost_model.all_gather_time(S, bits, alpha, beta)
                    + cost_model.reduce_scatter_time(S, bits, alpha, beta))
        bits_sent += (gathers + 1) * (S - 1) / S * bits
    return micro_steps * seconds, int(micro_steps * bits_sent / 8)


__all__ = ["fsdp_comm", "momentum_sync_per_step", "node_layout", "param_layout", "predict_candidate_comm",
           "predict_comm", "sharded_param_layout"]
