"""The registry of synchronisation schemes: what crosses the network in one training step.

A scheme is one named `comm.mode`. Its entry declares, in one place:
- `kind`: GRADIENT (every rank averages its gradient, then steps one shared optimizer state) or
  UPDATE (every rank keeps its own state; only the aggregated update crosses the network);
- `result`: what the exchange returns: MEAN (an estimate of the mean of the inputs over ranks)
  or SIGN (an aggregated sign in {-1, 0, +1}, or a mean of votes), so an optimizer can say which
  schemes it can use;
- `options`: a typed dataclass (optim.options.Options) that validates itself at a world size;
- `build(options, ctx) -> Exchange`: the function that performs the exchange, built once per
  optimizer (it may hold state: error feedback, a random generator);
- `wire_bytes(options, P, n, rank, rows)`: the exact payload bytes (sent, received) of one
  exchange of n elements on `rank`, as comm.CommStats counts them;
- `predict(options, P, n, alpha, beta, rows)`: its alpha-beta time (comm.cost_model formulas);
- `wire`: one line for the README's table of what crosses the network;
- `cycle(options)`: the steps over which its traffic repeats (`cycle_steps`; None = 1, every step).

A local-update scheme (kind LOCAL, a `LocalScheme`: DiLoCo) sends nothing on most inner steps; it
also declares `predict_cycle`, its own prediction of a cycle's communication on a model
(`predict_local` -> `LocalPrediction`), which comm.mode=auto (trainer.advise) and the benchmarks
ask instead of knowing the scheme. Every scheme reads its options from a config's `comm` section
through `options_from`.

Everything that lists modes (the config's allowed `comm.mode` values, `--help-config`, the
benchmarks, the README tables via `python -m optim`) iterates over this registry. Adding a
mode: write one module with its options, exchange, byte formula and prediction, and `register`
it (docs/architecture.md, "How to add a communication mode").
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

import torch

from comm import CommStats

from ..options import Options

GRADIENT = "gradient"
UPDATE = "update"
LOCAL = "local"
"""The kind of a local-update scheme: no exchange per step; an outer synchronisation every H steps."""
MEAN = "mean"
SIGN = "sign"


@dataclass
class SchemeOptions(Options):
    """Options of a sync scheme; keys live in the config's `comm` section."""


@dataclass
class ExchangeContext:
    """What an exchange may need to know about the flat vector it aggregates and the group."""

    world_size: int
    rank: int
    group: Any = None
    stats: CommStats = dataclasses.field(default_factory=CommStats)
    segments: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    """(offset, numel) of every parameter tensor in the flat vector (role order); empty = one segment."""
    rows: list[int] = dataclasses.field(default_factory=list)
    """Rows of every segment (dim 0 of a >= 2-D parameter; 1 for 0-/1-D), parallel to segments."""
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    seed: int = 0
    """Seed for per-rank random streams (stochastic rounding, stochastic compressors)."""
    kernels: Any = "eager"
    """The run's wire kernels: a comm.kernels.Kernels (what the optimizer hands its exchange: one object
    per run holding auto's choices), or a comm.kernels setting (eager, compiled, native or auto);
    every implementation gives the same bytes and updates."""
    shard_group: Any = None
    """Hybrid sharding (parallel.shard_size > 1): the group holding the other shards of every tensor
    whose local shard is in the vector (`group` is then the replicate group); None = whole tensors.
    A scheme whose math reduces over a whole tensor (pbit's Lp scale) also reduces over it."""

    def segments_for(self, n: int) -> list[tuple[int, int]]:
        return self.segments or [(0, n)]

    def rows_for(self, n: int) -> list[int]:
        return self.rows or [1]

    def restrict(self, lo: int, hi: int) -> "ExchangeContext":
        """The context of the part [lo, hi) of the flat vector (whole segments only): a bucket."""
        if not self.segments:
            return dataclasses.replace(self, segments=[(0, hi - lo)], rows=[1])
        keep = [(k, (o, n)) for k, (o, n) in enumerate(self.segments) if lo <= o and o + n <= hi]
        if sum(n for _, (_, n) in keep) != hi - lo:
            raise ValueError(f"part [{lo}, {hi}) does not consist of whole segments")
        return dataclasses.replace(self, segments=[(o - lo, n) for _, (o, n) in keep],
                                   rows=[self.rows[k] for k, _ in keep])


class Exchange:
    """One built exchange. Call it with the flat vector of this step; it returns the aggregate
    (identical on every rank). Stateful exchanges save and restore their state. Whether it may be
    called on parts of the vector is its scheme's `bucketable`."""

    def __call__(self, x: torch.Tensor, step: int) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {}

    def warmup(self) -> float:
        """Compile whatever this exchange compiles, before the first timed step; returns seconds."""
        return 0.0

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} holds no state but the checkpoint has {sorted(state)}")

    remaps_state: ClassVar[bool] = False
    """Whether `reshard_state` maps saved per-rank state to another world size. False (the default):
    any saved state is refused, so a resume may refuse at the first old rank whose exchange holds some
    (CommOptimizer.load_resharded) without reading, or holding, the others'."""

    def reshard_state(self, states: list[dict]) -> dict:
        """This rank's state from the states every rank saved in a run with another world size
        (len(states) ranks; on a sharded run's remesh, trainer.sharded_checkpoint, the states of the
        old ranks this rank read: its old replica's, so not a world size). Stateless exchanges need
        nothing; a stateful one must say how its per-rank state maps (and set `remaps_state`), or refuse."""
        if any(states):
            raise ValueError(f"comm.mode exchange {type(self).__name__} keeps per-rank state that cannot be "
                             f"remapped to another world size; resume with {len(states)} ranks")
        return {}


@dataclass(frozen=True)
class SyncScheme:
    name: str
    kind: str
    result: str
    options: type[SchemeOptions]
    build: Callable[[SchemeOptions, ExchangeContext], Exchange]
    wire_bytes: Callable[..., tuple[int, int]]
    predict: Callable[..., float]
    wire: str
    help: str
    state_bytes: Callable[[SchemeOptions, int, int], int] | None = None
    """Bytes of the exchange's own state (error feedback) for a vector of n elements over P ranks:
    state_bytes(options, P, n) (model.memory); None = a stateless exchange."""
    shards: bool = True
    """Runs across the replicate axis on local shards (parallel.shard_size > 1). False where the
    scheme has its own notion of nodes (hierarchical), which the mesh replaces."""
    bucketable: bool = False
    """Its exchange may run on parts of the vector (buckets of whole tensors: comm.bucket_mb,
    comm.overlap) with the same result element by element; False = whole-vector (its state or
    its scales span the vector). A bucketable mean exchange also has `start(x, step)`
    (asynchronous), a bucketable sign exchange takes `ctx=` (the part's ExchangeContext.restrict)."""
    cycle: Callable[[SchemeOptions], int] | None = None
    """cycle(options): the steps over which the scheme's traffic repeats (a local-update scheme: the
    inner steps in which every fragment's average is sent once); None = 1, a per-step scheme.
    Read through `cycle_steps`."""
    model_changes: Callable[[SchemeOptions, int], list[int]] | None = None
    """model_changes(options, max_steps): the steps (ascending) after which the model a run evaluates
    changes, where it does not change after every step (a local-update scheme evaluates its global
    parameters: they move at outer steps and at the end); None = after every step. Read through
    `changes_at`: bench.time_to_loss reads such a curve at them."""
    buffers: Callable[..., int] | None = None
    """buffers(options, P, n, layout): the bytes one exchange of an n-element vector holds at once on a
    rank where that is not its per-call bytes (a local-update scheme's bytes_per_call is an average over
    its cycle, while its largest fragment's average holds that fragment's pseudo-gradient and wire
    buffers whole); `layout` the model's (layer, numel) pairs where known (None: n alone). None = the sent
    and received bytes of one call. Read through `buffer_bytes` (model.memory)."""

    def __post_init__(self) -> None:
        if self.kind not in (GRADIENT, UPDATE):
            raise ValueError(f"scheme {self.name}: kind must be {GRADIENT!r} or {UPDATE!r}, got {self.kind!r}")
        if self.result not in (MEAN, SIGN):
            raise ValueError(f"scheme {self.name}: result must be {MEAN!r} or {SIGN!r}, got {self.result!r}")
        if not (dataclasses.is_dataclass(self.options) and issubclass(self.options, SchemeOptions)):
            raise TypeError(f"scheme {self.name}: options must be a SchemeOptions dataclass")

    def default_options(self) -> SchemeOptions:
        return self.options()

    def options_from(self, section: dict | None) -> SchemeOptions:
        """Its options from a config's `comm` section as config.yaml holds it (a mapping): the keys
        this scheme declares, sub-sections included (DiLoCo's comm.diloco); the section's common
        keys and other schemes' keys are not its own and are left out. ValueError naming a bad key."""
        c = section or {}
        return self.options(**{k: c[k] for k in self.options.field_names() if k in c})

    def cycle_steps(self, options: SchemeOptions) -> int:
        """Steps over which a run's communication (and so its step time) repeats with `options`: 1 for
        a scheme that exchanges every step, the declared `cycle` otherwise (e.g. DiLoCo's inner_steps)."""
        if self.cycle is None:
            return 1
        n = self.cycle(options)
        if not (isinstance(n, int) and not isinstance(n, bool) and n >= 1):
            raise ValueError(f"scheme {self.name}: cycle(options) gave {n!r}; it must be an integer >= 1")
        return n

    def changes_at(self, options: SchemeOptions, max_steps: int) -> list[int] | None:
        """The steps after which the evaluated model changes in a run of `max_steps` (`model_changes`), or
        None where it changes after every step."""
        return None if self.model_changes is None else list(self.model_changes(options, int(max_steps)))

    @property
    def stateful(self) -> bool:
        """Its exchange keeps state across calls (error feedback), sized for the vector it was built
        on: declared by `state_bytes`."""
        return self.state_bytes is not None

    @property
    def per_rank_state(self) -> bool:
        """Every rank keeps its own optimizer state (UPDATE kind), so momenta can drift apart and
        momentum sync applies."""
        return self.kind == UPDATE

    @property
    def syncs_momenta(self) -> bool:
        """comm.momentum_sync applies: every rank keeps its own momenta and steps with the others every
        step (UPDATE kind); a local-update scheme's workers exchange nothing between outer steps."""
        return self.per_rank_state

    @property
    def phase(self) -> str:
        """The step phase its exchange books into (optim.accounting): grad_sync for a GRADIENT
        scheme, update_sync for an UPDATE scheme."""
        return "update_sync" if self.kind == UPDATE else "grad_sync"

    def run_problems(self, options: SchemeOptions, world_size: int | None = None, *, bucket_mb: float = 0.0,
                     overlap: bool = False, grad_clip: float = 0.0, momentum_sync_every: int = 0,
                     shard_size: int = 1) -> list[str]:
        """Every problem of running this scheme with `options` at `world_size` ranks (None: the checks
        that need it are skipped) and these run settings. The one place these rules live: the
        config's validation and every optimizer's constructor ask it."""
        p = list(options.problems(world_size))
        if not bucket_mb >= 0:
            p.append(f"comm.bucket_mb: {bucket_mb} must be >= 0 (0 = one bucket: the whole vector)")
        elif bucket_mb > 0 and not self.bucketable:
            p.append(f"comm.bucket_mb / comm.overlap: comm.mode={self.name} exchanges its vector as a whole (its "
                     f"state or its scales span it); set comm.bucket_mb=0 and comm.overlap=false")
        if overlap and shard_size > 1:  # buckets are refused there too (trainer.config_validate): no circle
            p.append(f"comm.overlap: true with parallel.shard_size={shard_size}: FSDP already overlaps its "
                     f"reduce-scatter with backward and the exchange across replicas runs after it; set "
                     f"comm.overlap=false")
        elif overlap and not bucket_mb > 0:
            p.append("comm.overlap: true needs buckets; set comm.bucket_mb > 0 (e.g. 25, DDP's default)")
        elif overlap and self.per_rank_state and grad_clip > 0:
            p.append(f"comm.overlap: true with comm.mode={self.name} (update sync) needs optim.grad_clip=0: a bucket's "
                     f"update is launched during backward, before the whole gradient's norm is known")
        if momentum_sync_every and not self.syncs_momenta:
            fits = [s.name for s in _REGISTRY.values() if s.syncs_momenta]
            p.append(f"comm.momentum_sync.every: {momentum_sync_every} but comm.mode={self.name} already shares one "
                     f"state (gradient sync); momentum sync applies to update-sync modes: {', '.join(fits)}; set "
                     f"comm.momentum_sync.every=0 or choose one of them")
        if shard_size > 1 and not self.shards:
            fits = [s.name for s in _REGISTRY.values() if s.shards]
            p.append(f"parallel.shard_size: {shard_size} but comm.mode={self.name} does not run across replicas of a "
                     f"sharded model; use one of {', '.join(fits)}, or parallel.shard_size=1")
        return p

    def bytes_per_call(self, options: SchemeOptions, P: int, n: int, rank: int = 0, rows: int = 1) -> tuple[int, int]:
        """(sent, received) payload bytes of one exchange of n elements on `rank` (0 at P = 1)."""
        if P <= 1:
            return 0, 0
        return self.wire_bytes(options, P, n, rank, rows)

    def buffer_bytes(self, options: SchemeOptions, P: int, n: int,
                     layout: Sequence[tuple[str, int]] | None = None) -> int:
        """Bytes of one exchange's buffers held at once on a rank (`buffers`, else sent + received of one call;
        0 at P = 1); `layout`: the model's (layer, numel) pairs (layer "block.<i>" or ""), where known."""
        if P <= 1:
            return 0
        if self.buffers is not None:
            return self.buffers(options, P, n, layout)
        return sum(self.bytes_per_call(options, P, n))


@dataclass(frozen=True)
class LocalPrediction:
    """A local-update scheme's communication on one link (comm.cost_model's alpha-beta), over one
    cycle and per inner step: what its `predict_cycle` returns."""
    cycle_steps: int        # H: the inner steps of one cycle (every fragment synchronised once)
    comm_s: float           # exposed seconds per inner step, averaged over a cycle: what ranks it with per-step schemes
    cycle_comm_s: float     # exposed seconds of one cycle
    wire_s: float           # alpha-beta seconds of the cycle's exchanges before any overlap hides them
    bytes_per_step: float   # bytes one rank sends per inner step, averaged over the cycle
    peak_step_bytes: int    # the most bytes sent after one inner step (one fragment's exchange)
    cycle_bytes: int        # bytes one rank sends over one cycle


@dataclass(frozen=True)
class LocalScheme(SyncScheme):
    """A sync scheme of the local-update kind (LOCAL): every worker keeps its own optimizer state and
    parameters between outer steps (`per_rank_state`), and inner steps exchange nothing, so inner
    momenta have no place to be synchronised (comm.momentum_sync is refused). It declares its `cycle`
    (the steps in which every fragment is synchronised once), which the benchmarks read through
    `cycle_steps` to measure over whole cycles, and `predict_cycle`, its communication on a model,
    which auto and the benchmarks read through `predict_local`."""

    predict_cycle: Callable[..., LocalPrediction] | None = None
    """predict_cycle(options, P, params, alpha, beta, step_compute_s, background) -> LocalPrediction:
    the scheme's communication over P workers (the replicate axis) at alpha (s per message) and beta
    (s per bit) for a model whose parameters are `params`, (layer, numel) in the model's order (layer
    "block.<i>" inside transformer block i, "" outside: model.param_layers); `step_compute_s`, the
    seconds of one inner step's compute, and `background`, whether exchanges run on a background
    thread while the next inner steps compute (as the trainer runs them), say what overlap hides."""

    def __post_init__(self) -> None:
        if self.kind != LOCAL:
            raise ValueError(f"scheme {self.name}: a LocalScheme has kind {LOCAL!r}, got {self.kind!r}")
        if self.result != MEAN:
            raise ValueError(f"scheme {self.name}: the outer average is a mean; result must be {MEAN!r}")
        if not (dataclasses.is_dataclass(self.options) and issubclass(self.options, SchemeOptions)):
            raise TypeError(f"scheme {self.name}: options must be a SchemeOptions dataclass")
        if self.cycle is None:
            raise ValueError(f"scheme {self.name}: a LocalScheme declares its cycle: cycle(options) -> the inner "
                             f"steps in which every fragment is synchronised once")
        if self.predict_cycle is None:
            raise ValueError(f"scheme {self.name}: a LocalScheme declares its prediction: predict_cycle(options, P, "
                             f"params, alpha, beta, step_compute_s, background) -> LocalPrediction")

    @property
    def per_rank_state(self) -> bool:
        return True

    @property
    def syncs_momenta(self) -> bool:
        return False

    def run_problems(self, options: SchemeOptions, world_size: int | None = None, *, momentum_sync_every: int = 0,
                     **run: Any) -> list[str]:
        p = super().run_problems(options, world_size, momentum_sync_every=0, **run)
        if momentum_sync_every:
            p.append(f"comm.momentum_sync.every: {momentum_sync_every} but comm.mode={self.name} is a local-update "
                     f"scheme: its workers' inner steps exchange nothing between outer steps; set "
                     f"comm.momentum_sync.every=0")
        return p

    def predict_local(self, options: SchemeOptions, P: int, params: Sequence[tuple[str, int]], alpha: float,
                      beta: float, *, step_compute_s: float = 0.0, background: bool = False) -> LocalPrediction:
        """The scheme's own prediction (`predict_cycle`) of its communication per inner step and per
        cycle, for a model of parameters `params` ((layer, numel) in the model's order)."""
        pred = self.predict_cycle(options, P, list(params), alpha, beta, step_compute_s, background)
        if not isinstance(pred, LocalPrediction):
            raise TypeError(f"scheme {self.name}: predict_cycle returned {type(pred).__name__}, not a LocalPrediction")
        return pred


_REGISTRY: dict[str, SyncScheme] = {}


def register(scheme: SyncScheme, *, replace: bool = False) -> SyncScheme:
    """Add a scheme. Option names shared with other schemes must mean the same thing: the same
    type and default, since they share one flat config key."""
    if scheme.name in _REGISTRY and not replace:
        raise ValueError(f"sync scheme {scheme.name!r} is already registered; pass replace=True to override it")
    for other in _REGISTRY.values():
        if other.name == scheme.name:
            continue
        mine = {f.name: f for f in dataclasses.fields(scheme.options)}
        for f in dataclasses.fields(other.options):
            g = mine.get(f.name)
            if g is not None and (str(g.type) != str(f.type) or _default(g) != _default(f)):
                raise ValueError(f"sync scheme {scheme.name!r}: option {f.name!r} clashes with scheme "
                                 f"{other.name!r} (type or default differs); rename it")
    _REGISTRY[scheme.name] = scheme
    return scheme


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return dataclasses.MISSING


def get(name: str) -> SyncScheme:
    if name not in _REGISTRY:
        raise ValueError(f"comm.mode={name!r} is unknown; registered modes: {', '.join(names())}")
    return _REGISTRY[name]


def names() -> list[str]:
    return list(_REGISTRY)


def schemes() -> list[SyncScheme]:
    return list(_REGISTRY.values())


def option_owners() -> dict[str, list[str]]:
    """Option key -> the schemes that declare it (for 'this key belongs to mode X' errors)."""
    out: dict[str, list[str]] = {}
    for s in _REGISTRY.values():
        for name in s.options.field_names():
            out.setdefault(name, []).append(s.name)
    return out
