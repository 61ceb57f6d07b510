"""Shard loader: rank slicing, epochs, exact resume, val iterator, and the errors users hit."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from data import DataError, resolve_dataset
from data.loader import ShardLoader, val_batch_count, val_batches
from data.shards import HEADER_BYTES, open_shard, read_header, shard_name, write_shard

SHARD_LENS = [300, 1, 517, 0, 250]  # uneven, one 1-token and one empty shard


def make_shards(d: Path, lens=SHARD_LENS, split: str = "train") -> list[np.ndarray]:
    """Shard s holds s*10000 + i: every token tells which shard and offset it came from."""
    d.mkdir(parents=True, exist_ok=True)
    arrays = [np.arange(n, dtype=np.int64) + s * 10000 for s, n in enumerate(lens)]
    for s, a in enumerate(arrays):
        write_shard(d / shard_name(split, s), a)
    return arrays


def test_shard_round_trip_and_header(tmp_path: Path) -> None:
    arr = np.array([0, 1, 50256, 65535], dtype=np.int64)
    write_shard(tmp_path / "train_000000.bin", arr)
    raw = (tmp_path / "train_000000.bin").read_bytes()
    header = np.frombuffer(raw[:HEADER_BYTES], dtype=np.int32)
    assert header[:3].tolist() == [20240520, 1, 4] and not header[3:].any()
    assert len(raw) == 1024 + 2 * 4
    assert read_header(tmp_path / "train_000000.bin") == 4
    assert open_shard(tmp_path / "train_000000.bin").tolist() == arr.tolist()
    with pytest.raises(ValueError, match="65536"):
        write_shard(tmp_path / "train_000001.bin", np.array([65536]))


def stream_walk(tokens: np.ndarray, lens=SHARD_LENS) -> list[list[int]]:
    """Split a sequential token stream into epochs, asserting it walks whole shards contiguously;
    returns the shard order of every complete epoch."""
    n_nonempty = sum(1 for n in lens if n)
    epochs, current, prev = [], [], None
    for t in tokens.tolist():
        s, i = divmod(t, 10000)
        if prev is not None and prev[0] == s and i == prev[1] + 1:
            prev = (s, i)
            continue
        assert i == 0, f"jumped into shard {s} at offset {i}"
        assert prev is None or prev[1] == lens[prev[0]] - 1, f"left shard {prev[0]} at {prev[1]} early"
        if len(current) == n_nonempty:
            epochs.append(current)
            current = []
        assert s not in current, f"shard {s} twice in one epoch"
        current.append(s)
        prev = (s, i)
    return epochs


def sequential_stream(d: Path, n_batches: int, rows: int, T: int, seed: int) -> np.ndarray:
    L = ShardLoader(d, "train", rows, T, 0, 1, seed)
    out = []
    for _ in range(n_batches):
        x, y = L.next_batch()
        assert torch.equal(x.flatten()[1:], y.flatten()[:-1])
        out.append(x.flatten().numpy())
    out.append(y.flatten()[-1:].numpy())
    return np.concatenate(out)


def test_stream_visits_every_shard_once_per_epoch_in_seeded_order(tmp_path: Path) -> None:
    make_shards(tmp_path)
    total = sum(SHARD_LENS)
    stream = sequential_stream(tmp_path, n_batches=4 * total // 64, rows=4, T=16, seed=7)
    epochs = stream_walk(stream)
    assert len(epochs) >= 3
    assert all(sorted(e) == [0, 1, 2, 4] for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1, "shard order should change between epochs"
    other = stream_walk(sequential_stream(tmp_path, n_batches=4 * total // 64, rows=4, T=16, seed=8))
    assert other[:3] != epochs[:3], "a different seed should give a different order"
    again = sequential_stream(tmp_path, n_batches=4 * total // 64, rows=4, T=16, seed=7)
    assert np.array_equal(stream, again)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_take_disjoint_slices_whose_union_is_the_sequential_stream(tmp_path: Path, world_size: int) -> None:
    make_shards(tmp_path)
    B, T, steps = 2, 24, 40  # 40 global batches of 96-144 tokens: several epochs
    ranks = [ShardLoader(tmp_path, "train", B, T, r, world_size, seed=3) for r in range(world_size)]
    seq = ShardLoader(tmp_path, "train", B * world_size, T, 0, 1, seed=3)
    for _ in range(steps):
        xs, ys = zip(*(L.next_batch() for L in ranks))
        sx, sy = seq.next_batch()
        assert all(x.shape == (B, T) and x.dtype == torch.int64 for x in xs)
        assert torch.equal(torch.cat(xs), sx) and torch.equal(torch.cat(ys), sy)
        # within one global batch the ranks read distinct stream positions (tokens are unique
        # per position until the stream wraps, which a 144-token batch of 1068 cannot do)
        flat = torch.cat([x.flatten() for x in xs])
        assert len(set(flat.tolist())) == flat.numel()


def test_state_restore_reproduces_next_batches(tmp_path: Path) -> None:
    make_shards(tmp_path)
    a = ShardLoader(tmp_path, "train", 3, 20, 1, 2, seed=11)
    for _ in range(23):  # past the first epoch boundary (1068 tokens, 120 per step)
        a.next_batch()
    state = a.state_dict()
    assert state["epoch"] >= 1 and state["seed"] == 11
    expected = [a.next_batch() for _ in range(15)]
    b = ShardLoader(tmp_path, "train", 3, 20, 1, 2, seed=11)
    b.load_state_dict(state)
    # rank 0 restored from rank 1's state: the position is global, rank 0 reads the other slice
    c = ShardLoader(tmp_path, "train", 3, 20, 0, 2, seed=11)
    c.load_state_dict(state)
    for (ex, ey) in expected:
        x, y = b.next_batch()
        assert torch.equal(x, ex) and torch.equal(y, ey)
        cx, _ = c.next_batch()
        assert not torch.equal(cx, ex)
    fresh = ShardLoader(tmp_path, "train", 3, 20, 1, 2, seed=11)
    assert not torch.equal(fresh.next_batch()[0], expected[0][0])
    with pytest.raises(ValueError, match="seed was 11, now 12"):
        ShardLoader(tmp_path, "train", 3, 20, 1, 2, seed=12).load_state_dict(state)


def test_val_batches_deterministic_disjoint_and_bounded(tmp_path: Path) -> None:
    make_shards(tmp_path, lens=[100, 130], split="val")
    B, T, W = 2, 10, 2  # 40 tokens per global batch: (230 - 1) // 40 = 5 batches
    per_rank = [list(val_batches(tmp_path, B, T, r, W, None)) for r in range(W)]
    assert [len(p) for p in per_rank] == [5, 5] and val_batch_count(tmp_path, B, T, W) == 5
    assert val_batch_count(tmp_path, B, T, 1) == 11 and val_batch_count(tmp_path, 23, 10, 1) == 0
    seq = list(val_batches(tmp_path, B * W, T, 0, 1, None))
    assert len(seq) == 5
    for k in range(5):
        assert torch.equal(torch.cat([per_rank[0][k][0], per_rank[1][k][0]]), seq[k][0])
    stream = torch.cat([x.flatten() for x, _ in seq]).tolist()
    assert stream == list(range(100)) + list(range(10000, 10100))  # index order, no shuffling
    again = list(val_batches(tmp_path, B, T, 1, W, 3))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(again, per_rank[1][:3]))
    with pytest.raises(ValueError, match="holds 230 tokens = 5 global batches.*asked for 6"):
        val_batches(tmp_path, B, T, 0, W, 6)


def corrupt(path: Path, offset: int, value: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + 4] = np.int32(value).tobytes()
    path.write_bytes(bytes(raw))


def test_bad_shards_are_refused_with_file_and_expected_values(tmp_path: Path) -> None:
    make_shards(tmp_path, lens=[500, 400])
    bad = tmp_path / "train_000001.bin"
    good = bad.read_bytes()
    corrupt(bad, 0, 12345)
    with pytest.raises(ValueError, match=r"train_000001\.bin has magic 12345, expected 20240520"):
        ShardLoader(tmp_path, "train", 2, 8, 0, 1, seed=0)
    bad.write_bytes(good)
    corrupt(bad, 4, 2)
    with pytest.raises(ValueError, match=r"train_000001\.bin has format version 2, expected 1"):
        ShardLoader(tmp_path, "train", 2, 8, 0, 1, seed=0)
    bad.write_bytes(good[:-6])
    with pytest.raises(ValueError, match=r"train_000001\.bin is 1818 bytes but its header announces 400 tokens "
                                         r"\(1824 bytes expected\)"):
        ShardLoader(tmp_path, "train", 2, 8, 0, 1, seed=0)
    bad.write_bytes(good[:100])
    with pytest.raises(ValueError, match="shorter than the 1024-byte header"):
        ShardLoader(tmp_path, "train", 2, 8, 0, 1, seed=0)


def test_missing_empty_and_too_small_data(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"does not exist.*data\.prepare"):
        ShardLoader(tmp_path / "nope", "train", 2, 8, 0, 1, seed=0)
    with pytest.raises(DataError, match=r"does not exist"):
        resolve_dataset(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.md").write_text("x")
    with pytest.raises(DataError, match=r"no train_XXXXXX\.bin \(or llm.c NAME_train_XXXXXX.bin\) shards \(found: \['notes\.md'\]\)"):
        resolve_dataset(str(tmp_path / "empty"))
    (tmp_path / "raw").mkdir()  # documents where shards belong: the fix prepares them into another folder
    (tmp_path / "raw" / "docs.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(DataError, match=r"holds documents \(docs.jsonl\), not prepared shards; prepare them with "
                                        r"`python -m data.prepare text --input .*raw --out .*raw-prepared`"):
        resolve_dataset(str(tmp_path / "raw"))
    (tmp_path / "gone").mkdir()  # a prepared dir whose shards are gone: not "documents"
    (tmp_path / "gone" / "manifest.json").write_text("{}")
    (tmp_path / "gone" / "tokenizer.json").write_text("{}")
    with pytest.raises(DataError, match=r"gone has no train_XXXXXX\.bin"):
        resolve_dataset(str(tmp_path / "gone"))
    make_shards(tmp_path / "small", lens=[30])
    with pytest.raises(ValueError, match=r"holds 30 tokens, fewer than one global batch \(2 ranks x 2 x 8 \+ 1 = 33\)"):
        ShardLoader(tmp_path / "small", "train", 2, 8, 1, 2, seed=0)
    with pytest.raises(DataError, match="no val_XXXXXX.bin"):
        val_batches(tmp_path / "small", 1, 8, 0, 1, None)
    (tmp_path / "small" / "manifest.json").write_text("{}")  # ours, prepared with --val-fraction 0: says what to do
    with pytest.raises(DataError, match=r"holds train shards but no val split \(prepared with --val-fraction 0\?\); "
                                        r"every run evaluates at its end: .* or train on it through data.mix"):
        val_batches(tmp_path / "small", 1, 8, 0, 1, None)
    (tmp_path / "small" / "manifest.json").unlink()
    with pytest.raises(ValueError, match="rank=2 world_size=2"):
        ShardLoader(tmp_path / "small", "train", 1, 8, 2, 2, seed=0)
    assert resolve_dataset(str(tmp_path / "small")) == tmp_path / "small"


def test_mix_proportions_within_one_batch_and_exact_resume(tmp_path: Path) -> None:
    from data.loader import MixLoader

    dirs = []
    for k, lens in enumerate(([400, 300], [700], [90, 90, 90])):
        d = tmp_path / f"src{k}"
        d.mkdir()
        for s, n in enumerate(lens):  # source k's tokens are k*20000 + shard*1000 + offset: each tells its source
            write_shard(d / shard_name("train", s), np.arange(n, dtype=np.int64) + k * 20000 + s * 1000)
        dirs.append(d)
    weights = [5.0, 3.0, 2.0]
    sources = [(f"s{k}", d, w) for k, (d, w) in enumerate(zip(dirs, weights))]

    def mix(rank=0, world=2):
        return MixLoader(sources, "train", 2, 8, rank, world, seed=3)

    a, b = mix(0), mix(1)
    counts = [0, 0, 0]
    n_batches = 200
    for k in range(1, n_batches + 1):
        xa, _ = a.next_batch()
        xb, _ = b.next_batch()
        src = {int(t) // 20000 for t in torch.cat([xa, xb]).flatten()}
        assert len(src) == 1  # a global batch comes from one source, the same on every rank
        counts[src.pop()] += 1
        # the stated bound: after any k batches, every source within one batch of its share
        assert all(abs(c - w / 10 * k) <= 1 for c, w in zip(counts, weights)), (k, counts)
    assert counts == [100, 60, 40]
    # exact resume of the mix: a fresh loader restored from the state continues with the same batches
    a_state = a.state_dict()
    ref = [a.next_batch()[0] for _ in range(37)]
    c = mix(0)
    c.load_state_dict(a_state)
    assert all(torch.equal(x, c.next_batch()[0]) for x in ref)
    # ... on another world size too (the positions are global), and another mix is refused
    d1 = MixLoader(sources, "train", 2, 8, 0, 1, seed=3)
    d1.load_state_dict(a_state)
    assert d1.taken == [s["taken"] for s in a_state["mix"]] and sum(d1.taken) == n_batches
    with pytest.raises(DataError, match="resume with the same data.mix"):
        MixLoader(sources[:2], "train", 2, 8, 0, 2, seed=3).load_state_dict(a_state)
    with pytest.raises(DataError, match="data.mix run"):
        ShardLoader(dirs[0], "train", 2, 8, 0, 2, seed=3).load_state_dict(a_state)


# data.order=shuffled: seq_len windows in a seeded permutation per epoch

def _window_of(x: torch.Tensor, y: torch.Tensor, T: int, lens=SHARD_LENS) -> list[int]:
    """The window index of each row: rows must be whole windows of the concatenated stream (shard s's token
    i is s*10000 + i), their targets the inputs shifted by one."""
    flat = np.concatenate([np.arange(n) + s * 10000 for s, n in enumerate(lens)])
    out = []
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        start = int(np.flatnonzero(flat == row_x[0])[0])
        assert start % T == 0 and row_x == flat[start:start + T].tolist(), "not a whole window"
        assert row_y == flat[start + 1:start + T + 1].tolist()
        out.append(start // T)
    return out


@pytest.mark.parametrize("world_size", [1, 3])
def test_shuffled_order_reads_every_window_once_per_epoch_disjoint_across_ranks(tmp_path: Path,
                                                                              world_size: int) -> None:
    make_shards(tmp_path)
    B, T, seed = 2, 16, 5
    n_win = (sum(SHARD_LENS) - 1) // T
    per_epoch = n_win // (world_size * B)
    loaders = [ShardLoader(tmp_path, "train", B, T, r, world_size, seed, order="shuffled")
               for r in range(world_size)]
    epochs: list[list[int]] = []
    for _ in range(2):
        seen = []
        for _ in range(per_epoch):
            for ld in loaders:
                seen += _window_of(*ld.next_batch(), T)
        assert len(seen) == len(set(seen)) == per_epoch * world_size * B  # no window twice in an epoch
        epochs.append(seen)
    assert epochs[0] != epochs[1] and epochs[0] != sorted(epochs[0])  # a permutation, another each epoch
    if per_epoch * world_size * B == n_win:
        assert sorted(epochs[0]) == list(range(n_win))  # every window read
    # not the sequential layout, where every row follows the one before: here few do (by chance only)
    pairs = list(zip(epochs[0][::2], epochs[0][1::2]))  # each batch's two rows (B = 2)
    assert sum(b == a + 1 for a, b in pairs) <= len(pairs) // 4
    first = _window_of(*ShardLoader(tmp_path, "train", B, T, 0, world_size, seed, order="shuffled").next_batch(), T)
    # the same seed gives the same windows; another seed others
    again = ShardLoader(tmp_path, "train", B, T, 0, world_size, seed, order="shuffled").next_batch()
    other = ShardLoader(tmp_path, "train", B, T, 0, world_size, seed + 1, order="shuffled").next_batch()
    assert _window_of(*again, T) == first and _window_of(*other, T) != first


def test_shuffled_order_resumes_exactly_and_refuses_another_order(tmp_path: Path) -> None:
    make_shards(tmp_path)
    a = ShardLoader(tmp_path, "train", 2, 16, 1, 2, 3, order="shuffled")
    for _ in range(17):  # past an epoch boundary (66 windows, 4 per global batch: 16 batches an epoch)
        a.next_batch()
    state = a.state_dict()
    assert state["order"] == "shuffled" and state["epoch"] == 1
    b = ShardLoader(tmp_path, "train", 2, 16, 1, 2, 3, order="shuffled")
    b.load_state_dict(state)
    for _ in range(10):
        xa, ya = a.next_batch()
        xb, yb = b.next_batch()
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    seq = ShardLoader(tmp_path, "train", 2, 16, 1, 2, 3)
    with pytest.raises(DataError, match="data.order=shuffled run"):
        seq.load_state_dict(state)
    with pytest.raises(DataError, match="data.order=sequential run"):
        b.load_state_dict(seq.state_dict())
    with pytest.raises(DataError, match="data.order='random'"):
        ShardLoader(tmp_path, "train", 2, 16, 0, 1, 3, order="random")


def test_shuffled_resume_at_another_world_size_starts_a_fresh_epoch_where_no_batch_fits(tmp_path: Path) -> None:
    """A position saved at 2 ranks x 2 rows may leave too few windows for a global batch of 4 ranks: every
    rank then moves on to the next epoch together (no short or empty batch, no rank left behind)."""
    make_shards(tmp_path)  # 66 windows of 16
    a = ShardLoader(tmp_path, "train", 2, 16, 0, 2, 3, order="shuffled")
    for _ in range(15):
        a.next_batch()
    state = a.state_dict()
    assert (state["epoch"], state["window"]) == (0, 60)  # 6 windows left: not enough for 4 ranks x 2 rows
    wide = [ShardLoader(tmp_path, "train", 2, 16, r, 4, 3, order="shuffled") for r in range(4)]
    fresh = [ShardLoader(tmp_path, "train", 2, 16, r, 4, 3, order="shuffled") for r in range(4)]
    for ld, f in zip(wide, fresh):
        ld.load_state_dict(state)
        f.load_state_dict({**state, "window": 0, "epoch": 1})
        x, y = ld.next_batch()
        assert x.shape == (2, 16) and torch.equal(x, f.next_batch()[0])
    assert all(ld.state_dict()["epoch"] == 1 for ld in wide)


def test_shuffled_val_batches_spread_over_the_whole_split(tmp_path: Path) -> None:
    make_shards(tmp_path / "d", lens=[400, 600], split="val")
    B, T, W = 2, 10, 2
    n = val_batch_count(tmp_path / "d", B, T, W)  # 24 global batches of 40 tokens fit in 1000
    rows = [_window_of(x, y, T, lens=[400, 600]) for r in range(W)
            for x, y in val_batches(tmp_path / "d", B, T, r, W, 3, order="shuffled")]
    starts = sorted(w for row in rows for w in row)
    assert len(starts) == len(set(starts)) == 3 * W * B
    assert max(starts) >= 80 and min(starts) == 0  # 3 of 24 batches, yet reaching the split's end (99 windows)
    seq = [x for x, _ in val_batches(tmp_path / "d", B, T, 0, W, 3)]
    assert max(int(x.max()) for x in seq) < 120 and n == 24  # sequential: the first 120 tokens only


def test_no_repeat_check_counts_whole_windows_when_shuffled(tmp_path: Path) -> None:
    from data.loader import check_no_repeat
    make_shards(tmp_path)  # 1068 tokens: 66 windows of 16, 16 global batches of 2 ranks x 2
    assert "train tokens read" in check_no_repeat(tmp_path, 2, 16, 2, 16, order="shuffled")
    with pytest.raises(DataError, match="run at most 16 steps"):
        check_no_repeat(tmp_path, 2, 16, 2, 17, order="shuffled")
