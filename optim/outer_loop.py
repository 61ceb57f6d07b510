"""comm.mode=diloco in a run: `OuterLoop` binds one worker's `DiLoCo` (optim/diloco.py: the algorithm,
its schedule and its checkpoint state) to a run's optimizer: the fragments of its parameters, the
replicate group as the workers, the averages on a private group and thread, the bytes and waits each
step books, the workers' drift on diagnostic steps, evaluation on the global parameters, the end of
training and the run's checkpoint. It changes with the trainer and the optimizer base; the algorithm
does not (docs/diloco.md)."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Sequence

import torch

import comm
from comm import CommStats

from . import sync
from .diloco import (DiLoCo, background_averages, build_averages, drift_from_scalars, drift_scalars,
                     strided_fragments)


class OuterLoop:
    """comm.mode=diloco in a run: the `DiLoCo` of this rank over its optimizer's parameters (the
    model's, or a sharded model's local shards), with the replicate group as the workers. The
    strategy (optim/strategy.py LocalSync) builds it when the optimizer is built, runs
    `after_inner_step` after every applied update, and the optimizer's checkpoint carries
    `state_dict()` (the outer state plus this rank's local parameters, which differ between
    workers within a cycle) as its exchange's state.

    On a step that takes diagnostics (`diagnosed_inner_step`), each fragment sent in it reports the
    workers' drift (`drift`): an exact fp32 mean of the pseudo-gradients (one allreduce, apart from
    the wire's average), four float64 scalars per worker, one all-gather of them over `group`."""

    def __init__(self, outer: DiLoCo, booked: Sequence[CommStats] = (), into: CommStats | None = None, *,
                 group: Any = None, shard_group: Any = None, world_size: int = 1,
                 diag_stats: CommStats | None = None, clock: Any = None) -> None:
        self.outer = outer
        self.group, self.shard_group, self.world_size = group, shard_group, world_size
        self.diag_stats = CommStats(timing=False) if diag_stats is None else diag_stats
        self.clock = clock
        self._put_aside: list[torch.Tensor] | None = None   # the local parameters while global_params() runs
        # background averages book into a CommStats per fragment (only the averaging thread writes
        # it while that fragment's average runs); the main thread moves the bytes into the step's
        # phase once the average is waited for, at its outer step
        self.booked, self.into = list(booked), into
        self.moved = [(0, 0)] * len(self.booked)
        # the bytes of averages that were in flight when the checkpoint this run resumed from was
        # written: sent by the run that wrote it, booked here at their outer step as in a run never stopped
        self.carried: dict[int, tuple[int, int]] = {}

    @classmethod
    def for_optimizer(cls, opt: Any) -> "OuterLoop":
        """From a CommOptimizer built on a DiLoCoSchemeOptions plan: fragments from its parameter
        groups' `layers` ("block.<i>" per parameter, trainer/param_groups.py; groups without them are
        one block), averages over its group (the replicate axis) booked in its scheme's phase.
        ValueError naming the comm.diloco key when the options do not fit the model or world size."""
        o = opt.scheme_options.diloco
        blocks: dict[int, list[torch.Tensor]] = {}
        rest: list[torch.Tensor] = []
        for g in opt.param_groups:
            for p, layer in zip(g["params"], g.get("layers") or [""] * len(g["params"])):
                if str(layer).startswith("block."):
                    blocks.setdefault(int(str(layer).split(".", 1)[1]), []).append(p)
                else:
                    rest.append(p)
        ordered = [blocks[i] for i in sorted(blocks)]
        if not ordered:
            ordered, rest = [rest], []
        o.check(world_size=opt.world_size, blocks=len(ordered))
        fragments = strided_fragments(ordered, rest, o.fragments)
        phase = opt.stats[opt.scheme.phase]
        ctx = sync.ExchangeContext(world_size=opt.world_size, rank=opt.rank, group=opt.group, stats=phase,
                                   device=opt.layout.device, seed=opt.ctx.seed, kernels=opt.ctx.kernels,
                                   shard_group=opt.shard_group)
        numels = [sum(p.numel() for p in f) for f in fragments]
        diag = {"group": opt.group, "shard_group": opt.shard_group, "world_size": opt.world_size,
                "diag_stats": opt.stats["diag"], "clock": opt.clock}
        if not (o.overlap_steps and opt.world_size > 1):
            return cls(DiLoCo(fragments, o, build_averages(o, numels, ctx)), **diag)
        # tau > 0: the averages run on a background thread while the next tau inner steps compute,
        # over a group of their own (the main thread's collectives, the divergence guard's on the
        # replicate group among them, never interleave with theirs)
        ctx = dataclasses.replace(ctx, group=_private_group(opt.group))
        booked = [CommStats(timing=False) for _ in numels]
        averages = [build_averages(o, [n], dataclasses.replace(ctx, stats=s))[0] for n, s in zip(numels, booked)]
        return cls(DiLoCo(fragments, o, background_averages(averages, opt.layout.device)), booked, phase, **diag)

    def after_inner_step(self) -> list[int]:
        done = self.outer.after_inner_step()
        self._move_bytes(done)
        return done

    def diagnosed_inner_step(self) -> tuple[dict[str, float], float]:
        """`after_inner_step` on a step that takes diagnostics: also the drift of the fragment sent
        after it, if any (at most one per step: the offsets are distinct), and the seconds the
        diagnostic took. The parameters and the outer state end as without it."""
        out: dict[str, float] = {}
        spent = 0.0

        def observe(k: int, delta: torch.Tensor) -> None:
            nonlocal spent
            t0 = self.clock.now() if self.clock is not None else 0.0
            out.update(self.drift(k, delta))
            spent += (self.clock.now() - t0) if self.clock is not None else 0.0

        done = self.outer.after_inner_step(observe)
        self._move_bytes(done)
        return out, spent

    @torch.no_grad()
    def drift(self, k: int, delta: torch.Tensor) -> dict[str, float]:
        """The workers' drift of fragment k's pseudo-gradients (`worker_drift`'s numbers) without
        gathering them: the exact mean by one fp32 SUM allreduce of a copy of this worker's delta over
        the workers (the wire's own average is an estimate on a compressed wire), this worker's
        `drift_scalars` (summed over its shard group under hybrid sharding), then one all-gather of
        the four scalars per worker. Booked in the optimizer's "diag" phase. Keys: diag/diloco_drift_
        spread, cos_min, cos_mean (over the workers) and fragment (k)."""
        import torch.distributed as dist

        mean = comm.allreduce_mean(delta, wire_dtype=torch.float32, group=self.group, stats=self.diag_stats)
        mine = drift_scalars(delta, mean)
        device = mine.device if mine.is_cuda else None
        with self.diag_stats.call("diloco_drift_scalars[float64]", device) as timer:
            if self.shard_group is not None:
                with timer.coll(sent=mine, recv=mine):
                    dist.all_reduce(mine, op=dist.ReduceOp.SUM, group=self.shard_group)
            every = [torch.empty_like(mine) for _ in range(self.world_size)]
            if self.world_size > 1:
                with timer.coll(sent=mine, recv=every):
                    dist.all_gather(every, mine, group=self.group)
            else:
                every = [mine]
        d = drift_from_scalars(torch.stack(every))
        return {"diag/diloco_drift_spread": d["spread"], "diag/diloco_drift_cos_min": min(d["cosine"]),
                "diag/diloco_drift_cos_mean": sum(d["cosine"]) / len(d["cosine"]),
                "diag/diloco_drift_fragment": float(k)}

    def _move_bytes(self, fragments: Sequence[int]) -> None:
        """Book the background averages of `fragments`, just applied, into the step's phase: the bytes
        their collectives booked (plus any carried over a resume) and, as the call's seconds, the time
        this thread was blocked waiting for them (the exchange the overlapped inner steps did not hide)."""
        for k in fragments if self.booked else ():
            totals, (d_sent, d_recv) = self._unbooked(k)
            self.carried.pop(k, None)
            waited = self.outer.waited.pop(k, 0.0)
            if d_sent or d_recv or waited:
                self.into.add_bytes(f"diloco_average[{k}]", d_sent, d_recv, coll_s=waited)
            self.moved[k] = totals

    def _unbooked(self, k: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """Fragment k's background CommStats totals (sent, received), and the bytes of its average that no
        step has booked yet: those totals past what was moved, plus any carried over a resume."""
        t = self.booked[k].totals()
        totals = (int(t["bytes_sent"]), int(t["bytes_recv"]))
        carried = self.carried.get(k, (0, 0))
        return totals, (totals[0] - self.moved[k][0] + carried[0], totals[1] - self.moved[k][1] + carried[1])

    def _in_flight_bytes(self) -> dict[int, list[int]]:
        """Per fragment still in flight: the bytes its average sent that no step has booked yet."""
        return {k: list(self._unbooked(k)[1]) for k in (self.outer.pending if self.booked else ())}

    @contextlib.contextmanager
    def global_params(self) -> Iterator[None]:
        """The global parameters in the model for the duration (evaluation reports the model DiLoCo
        trains, identical on every worker); the local ones are put back after."""
        d = self.outer
        if self._put_aside is not None:
            raise RuntimeError("OuterLoop.global_params: already inside global_params()")
        with torch.no_grad():
            saved = [d._flat(k) for k in range(len(d.local))]
            for k in range(len(d.local)):
                d._write(k, d.glob[k])
        self._put_aside = saved
        try:
            yield
        finally:
            self._put_aside = None
            with torch.no_grad():
                for k in range(len(d.local)):
                    d._write(k, saved[k])

    @torch.no_grad()
    def finish(self) -> None:
        """The end of training: apply the averages in flight, then every worker adopts the global
        parameters (the model DiLoCo reports; the replicas end bit-identical)."""
        d = self.outer
        self._move_bytes(d.finish())
        for k in range(len(d.local)):
            d._write(k, d.glob[k])

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        d = self.outer
        # waits for the averages in flight; their bytes join the step of their outer step, as without a
        # save. Inside global_params() (a checkpoint's model holds the global parameters) the local
        # parameters are the ones put aside
        local = ([x.clone() for x in self._put_aside] if self._put_aside is not None
                 else [d._flat(k) for k in range(len(d.local))])
        outer = d.state_dict()  # waits for the averages in flight: their bytes are booked after this
        # a run resumed from this checkpoint books them at their outer step (this one, going on, too)
        return {**outer, "local": local, "in_flight_bytes": self._in_flight_bytes()}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        local = state.pop("local", None)
        in_flight = state.pop("in_flight_bytes", None) or {}  # absent from checkpoints of older versions
        d = self.outer
        if local is None or len(local) != len(d.local):
            raise ValueError("comm.mode=diloco: the checkpoint lacks this rank's local parameters (its exchange state "
                             "has no 'local' entry per fragment)")
        # a rollback loads into a running loop: the averages it has in flight finish first (their thread
        # must not be inside a collective, or write a wire's error feedback, while the state is replaced),
        # and their results are dropped. Their bytes are not booked: the steps that sent them are replayed
        # and send them again, so the records after a rollback read as those of a run resumed here
        for handle in d.pending.values():
            handle.wait()
        d.load_state_dict(state)
        self.moved = [self._unbooked(k)[0] for k in range(len(self.booked))]
        d.waited = {}
        for k, flat in enumerate(local):
            if flat.numel() != d.glob[k].numel():
                raise ValueError(f"DiLoCo: the checkpoint's local parameters of fragment {k} hold {flat.numel()} "
                                 f"elements, this model's {d.glob[k].numel()}")
            d._write(k, flat)
        self.carried = {int(k): (int(v[0]), int(v[1])) for k, v in in_flight.items()}


def _private_group(group: Any) -> Any:
    """A process group with the ranks of `group` (None: the world) that nothing else uses. Every
    rank of the world creates every rank's (new_group is collective over the world and must see the
    groups in one order), so the replicate groups of all shard indices are made alike."""
    import torch.distributed as dist

    mine = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, sorted(mine))
    out = None
    for ranks in sorted({tuple(r) for r in every}):
        g = dist.new_group(list(ranks))
        if dist.get_rank() in ranks:
            out = g
    return out
