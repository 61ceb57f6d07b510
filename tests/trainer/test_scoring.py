"""trainer/scoring.py and its command `python -m eval`: multiple-choice accuracy against a hand
computation, the HellaSwag file format and its errors, batched scoring against one-sequence scoring,
and validation loss."""
from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import eval as ev
from trainer import scoring
from data.shards import shard_name, write_shard
from model import GPT, get_preset

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hellaswag_mini.jsonl"


# ----------------------------------------------------------------------------- hand-made fixture
# A bigram "model" whose next-token log-probabilities are written down by hand: ROWS[prev][next].
# Each row is a distribution (the rest of its mass sits on a filler token), so log_softmax leaves it
# unchanged and every score below can be added up by hand.
ROWS = {
    "qa": {"a": -3.0, "b": -1.0},      # item A: " a" vs " b c"
    "b": {"c": -1.5},
    "qb": {"x": -2.0, "y": -1.0},      # item B: " x" vs " y z w"
    "y": {"z": -1.0},
    "z": {"w": -1.0},
    "qc": {"longword": -4.0, "s": -1.5},  # item C: " longword" vs " s t"
    "s": {"t": -1.5},
}
HAND_ITEMS = [scoring.MCItem("qa", ["a", "b c"], 1), scoring.MCItem("qb", ["x", "y z w"], 1),
              scoring.MCItem("qc", ["longword", "s t"], 0)]
WORDS = ["<filler>"] + sorted({w for row in ROWS for w in [row, *ROWS[row]]})
ID = {w: i for i, w in enumerate(WORDS)}


def encode_words(text: str) -> list[int]:
    return [ID[w] for w in text.split()]


class BigramStub(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(block_size=32)
        table = torch.full((len(WORDS), len(WORDS)), -1e9)
        table[:, 0] = 0.0  # rows not written down: all mass on the filler
        for prev, nxt in ROWS.items():
            for w, lp in nxt.items():
                table[ID[prev], ID[w]] = lp
            table[ID[prev], 0] = math.log(1 - sum(math.exp(v) for v in nxt.values()))
        self.register_buffer("table", table)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        return self.table[idx]


def hand_accuracy(items: list[scoring.MCItem]) -> dict:
    """Score every ending by adding up ROWS by hand: sum, per byte of the ending, per word."""
    right = {"acc": 0, "acc_norm": 0, "acc_per_token": 0}
    for it in items:
        scores = []
        for ending in it.endings:
            words = ending.split()
            prev = [it.ctx.split()[-1]] + words[:-1]
            ll = sum(ROWS[p][w] for p, w in zip(prev, words))
            scores.append({"acc": ll, "acc_norm": ll / len(ending.encode()), "acc_per_token": ll / len(words)})
        for key in right:
            best = max(range(len(scores)), key=lambda i: scores[i][key])
            right[key] += best == it.label
    return {k: v / len(items) for k, v in right.items()}


def test_multiple_choice_matches_the_hand_computation() -> None:
    expected = hand_accuracy(HAND_ITEMS)
    # the three scores disagree on these items, so a mix-up between them would show
    assert len({expected["acc"], expected["acc_norm"], expected["acc_per_token"]}) == 3
    got = scoring.multiple_choice(BigramStub(), HAND_ITEMS, encode_words, "cpu", batch_size=1)
    assert got["n"] == 3
    for key in expected:
        assert got[key] == pytest.approx(expected[key])
    assert got["correct"] == round(expected["acc"] * 3) and got["correct_norm"] == round(expected["acc_norm"] * 3)


def test_ranks_split_the_items_and_their_counts_add_up() -> None:
    items = HAND_ITEMS * 3
    whole = scoring.multiple_choice(BigramStub(), items, encode_words, batch_size=4)
    parts = [scoring.multiple_choice(BigramStub(), items, encode_words, batch_size=4, rank=r, world_size=2) for r in (0, 1)]
    assert [p["n"] for p in parts] == [5, 4]
    for key in ("n", "correct", "correct_norm", "correct_per_token"):
        assert sum(p[key] for p in parts) == whole[key]


# ----------------------------------------------------------------------------- the file format

def test_fixture_loads_both_layouts() -> None:
    items = scoring.load_mc_file(FIXTURE)
    raw = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    assert len(items) == len(raw) == 4
    assert items[0].ctx == raw[0]["ctx"]  # ctx wins when both layouts are present
    assert items[1].ctx == raw[1]["ctx_a"]  # empty ctx_b: the context is ctx_a alone
    assert items[3].label == 0 and isinstance(items[3].label, int)  # "0" read as an index
    assert [len(i.endings) for i in items] == [4, 4, 3, 4]
    assert len(scoring.load_mc_file(FIXTURE, limit=2)) == 2
    # HellaSwag's definition of ctx from its parts
    item = scoring.item_from({"ctx_a": "A man sits.", "ctx_b": "he", "endings": ["a", "b"], "label": 1}, "x")
    assert item.ctx == "A man sits. He"


@pytest.mark.parametrize("line, message", [
    ('{"endings": ["a", "b"], "label": 0}', r"bad\.jsonl:2: missing field 'ctx' \(or HellaSwag's 'ctx_a'/'ctx_b'\)"),
    ('{"ctx": "c", "label": 0}', r"bad\.jsonl:2: missing field 'endings'"),
    ('{"ctx": "c", "endings": ["a", "b"]}', r"bad\.jsonl:2: missing field 'label'"),
    ('{"ctx": "c", "endings": ["a", "b"], "label": 2}', r"bad\.jsonl:2: field 'label' must be an index into endings \(0\.\.1\), got 2"),
    ('{"ctx": "c", "endings": "ab", "label": 0}', r"bad\.jsonl:2: field 'endings' must be a list"),
    ('{"ctx": "c", "endings": ["a"', r"bad\.jsonl:2: not valid JSON"),
])
def test_wrong_format_names_the_line_and_field(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"ctx": "ok", "endings": ["a", "b"], "label": 0}\n' + line + "\n")
    with pytest.raises(scoring.MCFormatError, match=message):
        scoring.load_mc_file(path)


def test_missing_file_says_where_to_get_hellaswag(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="hellaswag_val.jsonl.*rowanz/hellaswag"):
        scoring.load_mc_file(tmp_path / "nope.jsonl")


# ----------------------------------------------------------------------------- a real model

def test_batched_scores_equal_one_sequence_at_a_time() -> None:
    torch.manual_seed(0)
    model = GPT(get_preset("debug", block_size=24)).eval()
    ctx = torch.randint(0, 50257, (9,)).tolist()
    endings = [torch.randint(0, 50257, (n,)).tolist() for n in (1, 4, 7, 20)]  # the last one overflows the block
    got = scoring.ending_logprobs(model, ctx, endings, "cpu", batch_size=3)
    for (ll, n), end in zip(got, endings):
        seq = (ctx + end)[-24:]
        keep = min(len(end), len(seq) - 1)
        with torch.no_grad():
            logp = F.log_softmax(model.logits(torch.tensor([seq])).float(), dim=-1)[0]
        ref = sum(float(logp[t - 1, seq[t]]) for t in range(len(seq) - keep, len(seq)))
        assert n == keep and ll == pytest.approx(ref, abs=1e-4)


def make_val_data(d: Path, n_tokens: int) -> np.ndarray:
    d.mkdir(parents=True)
    tokens = np.random.default_rng(0).integers(0, 50257, n_tokens)
    write_shard(d / shard_name("train", 0), tokens)
    write_shard(d / shard_name("val", 0), tokens[:n_tokens // 2])
    write_shard(d / shard_name("val", 1), tokens[n_tokens // 2:])
    return tokens


def test_val_loss_equals_cross_entropy_over_the_val_stream(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GPT(get_preset("debug", block_size=32))
    tokens = torch.from_numpy(make_val_data(tmp_path / "d", 3 * 2 * 16 + 5).astype(np.int64))
    res = scoring.val_loss(model, tmp_path / "d", batch_size=2, seq_len=16)
    assert res["batches"] == 3 and res["tokens"] == 96
    losses = []
    with torch.no_grad():
        for i in range(3):  # batch i = the 33 stream tokens from 32 * i, cut into 2 rows of 16
            chunk = tokens[32 * i:32 * i + 33]
            x, y = chunk[:-1].view(2, 16), chunk[1:].view(2, 16)
            losses.append(F.cross_entropy(model.logits(x).view(-1, model.config.vocab_size), y.reshape(-1)))
    assert res["loss"] == pytest.approx(float(torch.stack(losses).mean()), rel=1e-5)
    assert res["ppl"] == pytest.approx(math.exp(res["loss"]))
    assert model.training  # the caller's mode is restored


def test_cli_val_and_mc(tmp_path: Path, capsys) -> None:
    from tests.model.test_export import make_run

    run = make_run(tmp_path / "run", tie=True)
    make_val_data(tmp_path / "d", 600)
    assert ev.main(["val", str(run), "--data", str(tmp_path / "d"), "--batch-size", "2", "--seq-len", "32",
                    "--device", "cpu", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["batches"] == (600 - 1) // 64 and res["tokens"] == res["batches"] * 64 and res["ppl"] == pytest.approx(math.exp(res["loss"]))
    assert ev.main(["mc", str(run), "--file", str(FIXTURE), "--device", "cpu", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["n"] == 4 and 0 <= res["correct"] <= 4 and res["acc"] == res["correct"] / 4
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"ctx": "c", "endings": ["a", "b"]}\n')
    assert ev.main(["mc", str(run), "--file", str(bad), "--device", "cpu"]) == 2
    assert "bad.jsonl:1: missing field 'label'" in capsys.readouterr().err


def test_cli_val_reads_the_batches_of_the_runs_own_data_order(tmp_path: Path, capsys) -> None:
    """`--order run` (the default) evaluates the val batches the run's own evaluation read: for a run
    trained with data.order=shuffled, windows spread over the whole split, not the split's first ones."""
    from tests.model.test_export import make_run

    run = make_run(tmp_path / "run", tie=True)
    make_val_data(tmp_path / "d", 2000)
    args = ["val", str(run), "--data", str(tmp_path / "d"), "--batch-size", "2", "--seq-len", "32",
            "--batches", "3", "--device", "cpu", "--json"]

    def cli(*extra: str) -> dict:
        assert ev.main(args + list(extra)) == 0
        return json.loads(capsys.readouterr().out)

    from trainer.sampling import load

    model = load(run, "cpu")[0]
    want = {o: scoring.val_loss(model, tmp_path / "d", 2, 32, 3, order=o)["loss"] for o in ("sequential", "shuffled")}
    assert want["sequential"] != pytest.approx(want["shuffled"], rel=1e-6)  # the two orders read other text
    seq, shuf = cli("--order", "sequential"), cli("--order", "shuffled")
    assert (seq["order"], shuf["order"]) == ("sequential", "shuffled")
    assert seq["loss"] == pytest.approx(want["sequential"], rel=1e-6)
    assert shuf["loss"] == pytest.approx(want["shuffled"], rel=1e-6)
    assert cli()["order"] == "sequential"  # the run's config names no order: the loader's default
    meta = run / "ckpt" / "step_000010" / "meta.json"
    m = json.loads(meta.read_text())
    m["config"]["data"]["order"] = "shuffled"
    meta.write_text(json.dumps(m))
    res = cli()
    assert res["order"] == "shuffled" and res["loss"] == pytest.approx(want["shuffled"], rel=1e-6)
    with pytest.raises(SystemExit) as exc:  # argparse refuses another order, naming the choices
        ev.main(args + ["--order", "random"])
    assert exc.value.code == 2 and "choose from 'run', 'sequential', 'shuffled'" in capsys.readouterr().err



def test_eval_takes_flags_only_and_says_so_in_one_line(capsys) -> None:
    """util/cli.py's convention for a command with no config: a config file or key=value is refused by name,
    every error is one line with exit code 2 (argparse printed its usage block first)."""
    for argv, want in ((['val', 'runs/x', '--data', 'builtin', 'configs/default.yaml'], "'configs/default.yaml': this command takes no config"), (['mc', 'runs/x'], 'required: --file')):
        with pytest.raises(SystemExit) as e:
            ev.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and want in err and err.count("\n") == 1, err


def test_cli_val_defaults_to_the_run_s_data_and_refuses_another_tokenizer_s(tmp_path: Path, capsys) -> None:
    """`eval val RUN` reads the run's data.dataset when --data is not given; data prepared with another
    tokenizer than the run's (their manifests differ) is one error, not a meaningless loss."""
    from tests.model.test_export import make_run

    run = make_run(tmp_path / "run", tie=True)
    for name, tok in (("mine", {"name": "gpt2", "n_vocab": 50257}),
                      ("other", {"name": "tokenizer.json", "sha256": "ab" * 32, "n_vocab": 50257})):
        make_val_data(tmp_path / name, 600)
        (tmp_path / name / "manifest.json").write_text(json.dumps({"tokenizer": tok}))
    meta = run / "ckpt" / "step_000010" / "meta.json"
    m = json.loads(meta.read_text())
    m["config"]["data"]["dataset"] = str(tmp_path / "mine")
    meta.write_text(json.dumps(m))
    args = ["val", str(run), "--batch-size", "2", "--seq-len", "32", "--batches", "2", "--device", "cpu", "--json"]
    assert ev.main(args) == 0
    default = json.loads(capsys.readouterr().out)
    assert ev.main(args + ["--data", str(tmp_path / "mine")]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] == default["loss"]
    assert ev.main(args + ["--data", str(tmp_path / "other")]) == 2
    err = capsys.readouterr().err
    assert "was prepared with tokenizer tokenizer.json (50257 ids, sha256 abababababab), the model's run with gpt2" \
        in err and "its loss would mean nothing" in err, err
