"""Memory-mapped token shards -> (x, y) batches, each rank its own slice of every global batch.

The train split is read as one token stream: every epoch visits all train shards in an order
permuted by (seed, epoch), shard after shard, and wraps into the next epoch. One global batch is
the next world_size * batch_size * block_size + 1 tokens of that stream; rank r takes tokens
[r*B*T, (r+1)*B*T + 1) of it (x = first B*T, y = the same shifted by one), and the stream then
advances by world_size*B*T (modded-nanogpt's distributed loader, but batches may span shard and
epoch boundaries, so small shards lose nothing). The position (epoch, shard, position) is the
same on every rank, so any rank's `state_dict()` restores all of them exactly.

`val_batches` reads the val shards in index order with the same rank slicing, without wrapping.
`MixLoader` draws whole global batches from several datasets by weight (config data.mix).

Given the model's `vocab_size`, every shard's token ids are checked the first time it is read
(one vectorised max; see data.shards.check_token_range): ids >= vocab_size, and ids the dataset's
tokenizer (manifest.json) cannot produce, are a DataError naming the file, the value and its position.
"""
from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from data.shards import DataError, check_token_range, list_shards, open_shard, read_manifest
from data.sources import LOCAL_EXTS


def split_shards(data_dir: str | os.PathLike, split: str) -> list[Path]:
    """The `split` shard paths of a prepared dir; clear errors for a missing dir or no shards."""
    d = Path(data_dir)
    if not d.exists():
        raise DataError(f"data dir {d} does not exist; prepare one with `python -m data.prepare "
                        f"text --input FILES --out {d}` or use data.dataset=builtin")
    if not d.is_dir():
        raise DataError(f"data dir {d} is not a directory (expected a folder of *.bin shards)")
    paths = list_shards(d, split)
    if not paths and split == "val" and list_shards(d, "train") and (d / "manifest.json").is_file():
        raise DataError(f"data dir {d} holds train shards but no val split (prepared with --val-fraction 0?); "
                        f"every run evaluates at its end: prepare it again with a --val-fraction > 0, or train on "
                        f"it through data.mix={{{d}: 1}} with data.dataset naming a prepared dataset that has a val "
                        f"split")
    raw = [] if paths else [p.name for p in sorted(d.iterdir()) if p.suffix.lower() in LOCAL_EXTS
                            and p.name != "manifest.json" and not p.name.startswith("tokenizer")]
    if not paths and raw and not list_shards(d, "train"):  # documents, not shards: prepare them elsewhere
        raise DataError(f"data dir {d} holds documents ({', '.join(raw[:3])}{', ...' if len(raw) > 3 else ''}), not "
                        f"prepared shards; prepare them "
                        f"with `python -m data.prepare text --input {d} --out {d.parent / (d.name + '-prepared')}` "
                        f"and point data.dataset there")
    if not paths:
        found = sorted(p.name for p in d.iterdir())[:8]
        raise DataError(f"data dir {d} has no {split}_XXXXXX.bin (or llm.c NAME_{split}_XXXXXX.bin) shards "
                        f"(found: {found or 'nothing'}); prepare it with `python -m data.prepare ... --out {d}`")
    return paths


def tokenizer_vocab(data_dir: str | os.PathLike) -> tuple[int | None, str | None]:
    """(vocabulary size, name) of the tokenizer that wrote a dataset, from its manifest; (None, None)
    without one (e.g. llm.c shards)."""
    manifest = read_manifest(data_dir)
    tok = (manifest or {}).get("tokenizer") or {}
    return (int(tok["n_vocab"]) if "n_vocab" in tok else None), tok.get("name")


def tokenizer_identity(data_dir: str | os.PathLike) -> tuple | None:
    """What tells two datasets' tokenizers apart, from the manifest: (name, sha256 of a tokenizer.json,
    vocabulary size); None without a manifest tokenizer (e.g. llm.c shards)."""
    tok = (read_manifest(data_dir) or {}).get("tokenizer") or {}
    return (tok.get("name"), tok.get("sha256"), tok.get("n_vocab")) if tok else None


def _check_geometry(batch_size: int, block_size: int, rank: int, world_size: int) -> None:
    if batch_size < 1 or block_size < 1:
        raise ValueError(f"batch_size and block_size must be >= 1, got {batch_size} and {block_size}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank} world_size={world_size}")


class _Stream:
    """Concatenation of shards in an order that may change per epoch; positions are
    (epoch, index into that epoch's order, offset in that shard), kept with offset < shard length."""

    def __init__(self, arrays: list[np.ndarray], seed: int | None, check=None):
        self.arrays, self.seed = arrays, seed
        self._order_cache: tuple[int, np.ndarray] | None = None
        self._check = check  # check(index): range-check shard `index` (once, on first read)
        self._unchecked = set(range(len(arrays))) if check else set()

    def order(self, epoch: int) -> np.ndarray:
        if self.seed is None:
            if self._order_cache is None:
                self._order_cache = (0, np.arange(len(self.arrays)))
            return self._order_cache[1]
        if self._order_cache is None or self._order_cache[0] != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.arrays))
            self._order_cache = (epoch, perm)
        return self._order_cache[1]

    def _len(self, epoch: int, shard: int) -> int:
        return len(self.arrays[self.order(epoch)[shard]])

    def normalize(self, pos: tuple[int, int, int]) -> tuple[int, int, int]:
        epoch, shard, off = pos
        while off >= self._len(epoch, shard):  # also skips empty shards; total > 0 is checked
            off -= self._len(epoch, shard)
            shard += 1
            if shard == len(self.arrays):
                epoch, shard = epoch + 1, 0
        return epoch, shard, off

    def advance(self, pos: tuple[int, int, int], n: int) -> tuple[int, int, int]:
        epoch, shard, off = pos
        return self.normalize((epoch, shard, off + n))

    def read(self, pos: tuple[int, int, int], n: int) -> np.ndarray:
        out = np.empty(n, dtype=np.int64)
        filled = 0
        epoch, shard, off = self.normalize(pos)
        while filled < n:
            index = self.order(epoch)[shard]
            if index in self._unchecked:
                self._check(index)
                self._unchecked.discard(index)
            arr = self.arrays[index]
            take = min(n - filled, len(arr) - off)
            out[filled:filled + take] = arr[off:off + take]
            filled += take
            epoch, shard, off = self.advance((epoch, shard, off), take)
        return out


def _to_xy(buf: np.ndarray, batch_size: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.from_numpy(buf)
    return t[:-1].view(batch_size, block_size), t[1:].view(batch_size, block_size)


def _range_checker(paths: list[Path], arrays: list[np.ndarray], data_dir, vocab_size: int | None):
    tok_vocab, tok_name = tokenizer_vocab(data_dir)
    if vocab_size is None and tok_vocab is None:
        return None

    def check(index: int) -> None:
        check_token_range(paths[index], arrays[index], vocab_size, tok_vocab, tok_name)

    return check


ORDERS = ("sequential", "shuffled")
"""data.order: sequential = the stream in order, each global batch the next world x batch x seq_len tokens,
split into adjacent per-rank chunks (shards permuted per epoch); shuffled = non-overlapping seq_len windows
of the stream in a seeded permutation per epoch, each rank its own windows of a global batch, so no two ranks
(and no two rows) read adjacent text and still no token is read twice in an epoch."""


def check_order(order: str) -> None:
    if order not in ORDERS:
        raise DataError(f"data.order={order!r}: expected one of {', '.join(ORDERS)}")


def _windows(stream: "_Stream", starts: Sequence[int], block_size: int,
             offsets: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y), each (len(starts), block_size): window w is the block_size tokens from w * block_size
    (x) and the same shifted by one (y). `offsets`: the stream's shard starts (cumulative lengths from
    0), so a read begins in its own shard."""
    out = []
    for w in starts:
        g = int(w) * block_size
        shard = int(np.searchsorted(offsets, g, side="right")) - 1
        out.append(stream.read((0, shard, g - int(offsets[shard])), block_size + 1))
    t = torch.from_numpy(np.concatenate(out).reshape(len(out), block_size + 1))
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _offsets(lengths: Sequence[int]) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


class ShardLoader:
    """Train batches for one rank; deterministic given (data, seed, geometry, order), exactly resumable.
    `vocab_size`: the model's; each shard's ids are range-checked when it is first read. `order`: ORDERS."""

    def __init__(self, data_dir: str | os.PathLike, split: str, batch_size: int, block_size: int,
                 rank: int, world_size: int, seed: int, vocab_size: int | None = None, order: str = "sequential"):
        _check_geometry(batch_size, block_size, rank, world_size)
        check_order(order)
        self.order = order
        if seed < 0:
            raise ValueError(f"seed must be >= 0 (it seeds the per-epoch shard order), got {seed}")
        self.paths = split_shards(data_dir, split)
        self.split, self.batch_size, self.block_size = split, batch_size, block_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        arrays = [open_shard(p) for p in self.paths]
        self.lengths = [len(a) for a in arrays]
        need = world_size * batch_size * block_size + 1
        if sum(self.lengths) < need:
            raise DataError(f"{split} split of {data_dir} holds {sum(self.lengths)} tokens, fewer than one "
                             f"global batch ({world_size} ranks x {batch_size} x {block_size} + 1 = {need}); "
                             f"use a smaller batch_size/block_size or more data")
        self._check = _range_checker(self.paths, arrays, data_dir, vocab_size)
        self._stream = _Stream(arrays, seed if order == "sequential" else None, self._check)
        self._pos = (0, 0, 0)
        # shuffled: (epoch, index of the next global batch's first window in that epoch's permutation)
        self.n_windows = (sum(self.lengths) - 1) // block_size
        self._offsets = _offsets(self.lengths)
        self._wpos = (0, 0)
        self._perm_cache: tuple[int, np.ndarray] | None = None

    def _perm(self, epoch: int) -> np.ndarray:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            # int32 where it fits (the same permutation as of range(n_windows); half the memory on big corpora)
            idx = np.arange(self.n_windows, dtype=np.int32 if self.n_windows < 2 ** 31 else np.int64)
            self._perm_cache = (epoch, np.random.default_rng([self.seed, epoch, 1]).permutation(idx))
        return self._perm_cache[1]

    def check_all(self) -> None:
        """Range-check every shard now instead of on first read (reads all the data once)."""
        if self._check:
            for i in range(len(self.paths)):
                self._check(i)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) int64 (batch_size, block_size): this rank's slice of the next global batch."""
        if self.order == "shuffled":
            epoch, k = self._wpos
            per_batch = self.world_size * self.batch_size
            if k + per_batch > self.n_windows:  # a position saved at another geometry: its epoch has no room left
                epoch, k = epoch + 1, 0
            mine = self._perm(epoch)[k + self.rank * self.batch_size:k + (self.rank + 1) * self.batch_size]
            k += per_batch
            self._wpos = (epoch + 1, 0) if k + per_batch > self.n_windows else (epoch, k)
            return _windows(self._stream, mine, self.block_size, self._offsets)
        local = self.batch_size * self.block_size
        start = self._stream.advance(self._pos, self.rank * local)
        buf = self._stream.read(start, local + 1)
        self._pos = self._stream.advance(self._pos, self.world_size * local)
        return _to_xy(buf, self.batch_size, self.block_size)

    def state_dict(self) -> dict:
        mine = {"seed": self.seed, "split": self.split, "shards": [p.name for p in self.paths],
                "shard_tokens": list(self.lengths)}
        if self.order == "shuffled":
            return {"order": "shuffled", "epoch": self._wpos[0], "window": self._wpos[1],
                    "block_size": self.block_size, **mine}
        epoch, shard, position = self._stream.normalize(self._pos)
        return {"epoch": epoch, "shard": shard, "position": position, **mine}

    def load_state_dict(self, state: dict) -> None:
        """Restore a position saved by `state_dict()` (any rank's; world size may differ)."""
        if "mix" in state:
            raise DataError(f"loader state is of a data.mix run ({[s['dataset'] for s in state['mix']]}); resume "
                            f"with the same data.mix")
        mine = {"seed": self.seed, "split": self.split, "shards": [p.name for p in self.paths],
                "shard_tokens": list(self.lengths)}
        for key, value in mine.items():
            if key in state and state[key] != value:
                raise DataError(f"loader state does not match this data: {key} was {state[key]!r}, now "
                                f"{value!r}; resume with the same data dir and seed")
        was = state.get("order", "sequential")  # states written before data.order were sequential
        if was != self.order:
            raise DataError(f"loader state is of a data.order={was} run, this run has data.order={self.order}; "
                            f"resume with the same data.order")
        if self.order == "shuffled":
            epoch, k = int(state["epoch"]), int(state["window"])
            if state.get("block_size") != self.block_size:
                raise DataError(f"loader state has windows of {state.get('block_size')} tokens, this run "
                                f"{self.block_size} (data.seq_len); resume with the same data.seq_len")
            if epoch < 0 or not 0 <= k < self.n_windows:
                raise DataError(f"loader state (epoch={epoch}, window={k}) is out of range for "
                                f"{self.n_windows} windows")
            self._wpos = (epoch, k)
            return
        epoch, shard, position = int(state["epoch"]), int(state["shard"]), int(state["position"])
        in_range = epoch >= 0 and 0 <= shard < len(self.paths)
        if not (in_range and 0 <= position < self.lengths[self._stream.order(epoch)[shard]]):
            raise DataError(f"loader state (epoch={epoch}, shard={shard}, position={position}) is out of range "
                            f"for {len(self.paths)} {self.split} shards")
        self._pos = (epoch, shard, position)


class MixLoader:
    """Train batches drawn from several prepared datasets by weight (config `data.mix`). Each global
    batch comes whole from one source, its own ShardLoader (every rank its slice, as above); the
    source is the one furthest behind its share: argmax_i (w_i * (k + 1) - taken_i) at batch k, ties
    to the first listed. So after any k batches every source has given within one batch of
    w_i * k, the same order on every rank, without randomness; `state_dict()` keeps each source's
    position and count, so a resume continues the mix exactly."""

    def __init__(self, sources: list[tuple[str, str | os.PathLike, float]], split: str, batch_size: int,
                 block_size: int, rank: int, world_size: int, seed: int, vocab_size: int | None = None,
                 order: str = "sequential"):
        """`sources`: (name as configured, prepared directory, weight > 0) per dataset."""
        if not sources:
            raise ValueError("MixLoader needs at least one source")
        bad = [(name, w) for name, _, w in sources if not 0 < w < float("inf")]
        if bad:  # an infinite weight would make every other source's share nan or 0
            raise DataError(f"data.mix: weights must be finite and > 0, got {bad}; drop a source instead of "
                            f"weighting it 0")
        total = sum(w for _, _, w in sources)
        self.names = [name for name, _, _ in sources]
        self.weights = [w / total for _, _, w in sources]
        self.loaders = [ShardLoader(d, split, batch_size, block_size, rank, world_size, seed, vocab_size, order)
                        for _, d, _ in sources]
        self.taken = [0] * len(sources)

    def next_source(self) -> int:
        k = sum(self.taken)
        behind = [w * (k + 1) - t for w, t in zip(self.weights, self.taken)]
        return behind.index(max(behind))

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        i = self.next_source()
        self.taken[i] += 1
        return self.loaders[i].next_batch()

    def check_all(self) -> None:
        for loader in self.loaders:
            loader.check_all()

    def state_dict(self) -> dict:
        return {"mix": [{"dataset": n, "weight": w, "taken": t, "loader": ld.state_dict()}
                        for n, w, t, ld in zip(self.names, self.weights, self.taken, self.loaders)]}

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("mix")
        if saved is None or [(s["dataset"], s["weight"]) for s in saved] != list(zip(self.names, self.weights)):
            was = [(s["dataset"], s["weight"]) for s in saved] if saved else "a single dataset"
            raise DataError(f"loader state does not match this data: the run drew from {was}, now data.mix is "
                            f"{list(zip(self.names, self.weights))}; resume with the same data.mix")
        for loader, s in zip(self.loaders, saved):
            loader.load_state_dict(s["loader"])
        self.taken = [int(s["taken"]) for s in saved]


def train_tokens_read(batch_size: int, block_size: int, world_size: int, steps: int, grad_accum: int = 1) -> int:
    """Train-stream tokens a run of `steps` optimizer steps reads: every micro-batch advances the
    stream by world_size x batch_size x block_size tokens, and the last one reads one more (its
    targets)."""
    _check_geometry(batch_size, block_size, 0, world_size)
    return steps * grad_accum * world_size * batch_size * block_size + 1


def check_no_repeat(data_dir: str | os.PathLike, batch_size: int, block_size: int, world_size: int, steps: int,
                    grad_accum: int = 1, order: str = "sequential") -> str:
    """For a run that must never read a training token twice (a study of pretraining, not of
    memorisation): return the line 'train tokens read R of A available (x %)', or raise a DataError
    when R > A, i.e. when the stream would wrap into a second epoch (order="shuffled": when its global
    batches of whole windows would run past the epoch's windows)."""
    check_order(order)
    total = sum(len(open_shard(p)) for p in split_shards(data_dir, "train"))
    seen = train_tokens_read(batch_size, block_size, world_size, steps, grad_accum)
    line = f"train tokens read {seen:,} of {total:,} available ({100 * seen / max(total, 1):.1f} %)"
    per_batch = world_size * batch_size
    fits = steps * grad_accum <= ((total - 1) // block_size) // per_batch if order == "shuffled" else seen <= total
    if not fits:
        per_step = grad_accum * world_size * batch_size * block_size
        if order == "shuffled":
            raise DataError(f"{data_dir}: a run of {steps} steps with data.order=shuffled would read training tokens "
                            f"twice: {line}; run at most {((total - 1) // block_size) // per_batch // grad_accum} "
                            f"steps with this geometry, or use more data")
        raise DataError(f"{data_dir}: a run of {steps} steps ({world_size} ranks x {grad_accum} x {batch_size} x "
                        f"{block_size} tokens per step) would read training tokens twice: {line}; run at most "
                        f"{max(0, (total - 1) // per_step)} steps with this geometry, or use more data")
    return line


def val_batch_count(data_dir: str | os.PathLike, batch_size: int, block_size: int, world_size: int) -> int:
    """How many full global batches (world_size x batch_size x block_size, +1) the val split holds."""
    _check_geometry(batch_size, block_size, 0, world_size)
    total = sum(len(open_shard(p)) for p in split_shards(data_dir, "val"))
    return max(0, (total - 1) // (world_size * batch_size * block_size))


def val_batches(data_dir: str | os.PathLike, batch_size: int, block_size: int, rank: int,
                world_size: int, n_batches: int | None,
                vocab_size: int | None = None,
                order: str = "sequential") -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The first `n_batches` global batches of the val shards (index order, no wrap), this rank's
    slice of each (order="shuffled": windows of block_size at evenly spread starts over the whole
    split). `n_batches=None` yields every full global batch the val split holds; asking for more
    than that raises DataError (checked here, before the first batch; `val_batch_count`
    says how many there are). `vocab_size`: the model's, to range-check the ids read."""
    _check_geometry(batch_size, block_size, rank, world_size)
    paths = split_shards(data_dir, "val")
    arrays = [open_shard(p) for p in paths]
    total = sum(len(a) for a in arrays)
    local = batch_size * block_size
    available = max(0, (total - 1) // (world_size * local))
    if n_batches is None:
        n_batches = available
    if n_batches < 0 or n_batches > available or available == 0:
        raise DataError(f"val split of {data_dir} holds {total} tokens = {available} global batches of "
                         f"{world_size} ranks x {batch_size} x {block_size} (+1), asked for {n_batches}; "
                         f"evaluate on at most {available} batches (train.eval_steps; `python -m eval val --batches N`, "
                         f"or without --batches: all of them), use a smaller "
                         f"batch, or prepare more val data")
    check_order(order)
    stream = _Stream(arrays, seed=None, check=_range_checker(paths, arrays, data_dir, vocab_size))
    n_win, wanted = (total - 1) // block_size, n_batches * world_size * batch_size
    offsets = _offsets([len(a) for a in arrays])

    def gen() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for i in range(n_batches):
            if order == "shuffled":  # windows spread evenly over the whole split: every part of it is judged
                first = (i * world_size + rank) * batch_size
                yield _windows(stream, [(j * n_win) // wanted for j in range(first, first + batch_size)],
                               block_size, offsets)
                continue
            start = stream.normalize((0, 0, (i * world_size + rank) * local))
            yield _to_xy(stream.read(start, local + 1), batch_size, block_size)

    return gen()
