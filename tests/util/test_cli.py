"""util/cli.py: the one argument convention (config files, then key=value overrides in any order with
flags; several files compose; --variants compares) and its one-line errors."""
from __future__ import annotations

import argparse

import pytest

from util.cli import Parser, is_config, is_override, split_words, variant_name, variant_runs


def memory_like(**kw) -> Parser:
    p = Parser(prog="python -m x", require_config=True, **kw)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--json", default="")
    return p


def test_the_words_are_sorted_by_shape():
    assert is_override("train.max_steps=5") and is_override("optim.lr=-1e-3") and is_override("x=1")
    assert not is_override("--world=8") and not is_override("runs/lr=1e-3/config.yaml")
    assert is_config("a.yaml") and is_config("B.YML") and is_config("runs/lr=1e-3/config.yaml")
    assert not is_config("train.out_dir=a.yaml") and not is_config("runs/default")
    assert split_words(["a.yaml", "x.y=1", "study", "b.yml", "comm.mode=onebit"]) == (
        ["a.yaml", "b.yml"], ["x.y=1", "comm.mode=onebit"], ["study"])


@pytest.mark.parametrize("argv", [
    ["a.yaml", "--world", "8", "train.max_steps=5"],      # an override after a flag (refused before)
    ["--world", "8", "a.yaml", "train.max_steps=5"],
    ["a.yaml", "train.max_steps=5", "--world=8"],
    ["train.max_steps=5", "a.yaml", "--world", "8"],
])
def test_configs_overrides_and_flags_in_any_order(argv):
    ns = memory_like().parse_args(argv)
    assert (ns.configs, ns.overrides, ns.world) == (["a.yaml"], ["train.max_steps=5"], 8)


def test_several_config_files_keep_their_order_and_flag_values_stay_flag_values():
    ns = memory_like().parse_args(["size.yaml", "--json", "out.yaml", "variant.yaml", "a.b=1", "--world", "2",
                                   "c.d=x=y"])
    assert ns.configs == ["size.yaml", "variant.yaml"] and ns.json == "out.yaml"
    assert ns.overrides == ["a.b=1", "c.d=x=y"]


def _error(parser: Parser, argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err  # one line, exit 2, no usage block
    return err


def test_errors_are_one_line_with_exit_2(capsys):
    assert "expected a config file" in _error(memory_like(), ["--world", "8", "a.b=1"], capsys)
    assert "'runs/default': expected a config file" in _error(memory_like(), ["runs/default", "--world", "8"], capsys)
    assert "--world" in _error(memory_like(), ["a.yaml"], capsys)            # argparse's own errors too
    assert "unrecognized arguments: --wrld" in _error(memory_like(), ["a.yaml", "--world", "1", "--wrld", "8"], capsys)


def test_a_command_without_configs_refuses_an_override_by_name(capsys):
    p = Parser(prog="python -m sample")
    p.add_argument("src")
    p.add_argument("--prompt", default="")
    assert p.parse_args(["--prompt", "a=b c.yaml", "runs/x"]).prompt == "a=b c.yaml"  # a flag's value is a value
    err = _error(p, ["runs/x", "train.max_steps=5"], capsys)
    assert "'train.max_steps=5': this command takes no config file" in err
    # a subcommand's parser is one of ours too
    q = Parser(prog="python -m eval")
    sub = q.add_subparsers(dest="cmd", required=True)
    sub.add_parser("val").add_argument("src")
    assert "takes no config file" in _error(q, ["val", "runs/x", "a.yaml"], capsys)
    assert "invalid choice" in _error(q, ["bogus"], capsys)


def test_named_positionals_beside_configs(capsys):
    p = Parser(prog="python -m bench.reproduce", configs=True, positionals=("study",))
    p.add_argument("--quick", action="store_true")
    ns = p.parse_args(["--quick", "optim.lr=1e-3", "table2"])
    assert (ns.study, ns.overrides, ns.configs, ns.quick) == ("table2", ["optim.lr=1e-3"], [], True)
    assert p.parse_args([]).study is None
    assert "'fig5': expected a config file" in _error(p, ["table2", "fig5"], capsys)


def test_variants_compare_and_files_outside_them_compose(capsys):
    p = memory_like(variants=True)
    ns = p.parse_args(["base.yaml", "--variants", "v/a.yaml", "v/b.yaml", "train.max_steps=5", "--world", "8"])
    assert ns.variants == ["v/a.yaml", "v/b.yaml"] and ns.overrides == ["train.max_steps=5"]
    assert variant_runs(ns) == [("a", ["base.yaml", "v/a.yaml"]), ("b", ["base.yaml", "v/b.yaml"])]
    # without --variants the same files compose into one config
    ns = p.parse_args(["base.yaml", "v/a.yaml", "v/b.yaml", "--world", "8"])
    assert ns.configs == ["base.yaml", "v/a.yaml", "v/b.yaml"] and ns.variants == [] and variant_runs(ns) == []
    # --variants alone satisfies require_config: each candidate is its own file
    ns = p.parse_args(["--world", "1", "--variants", "a.yaml", "b.yaml"])
    assert variant_runs(ns) == [("a", ["a.yaml"]), ("b", ["b.yaml"])]
    with pytest.raises(ValueError, match="given twice"):
        variant_runs(p.parse_args(["--world", "1", "--variants", "a.yaml", "a.yaml"]))
    with pytest.raises(ValueError, match="lion_fp32: expected a config file"):
        variant_runs(p.parse_args(["--world", "1", "--variants", "lion_fp32"]))
    ns = p.parse_args(["--world", "1", "--variants", "lion_fp32", "c.yaml"])
    assert variant_runs(ns, resolve=lambda n: f"configs/variants/{n}.yaml") == [
        ("lion_fp32", ["configs/variants/lion_fp32.yaml"]), ("c", ["c.yaml"])]


def test_words_a_many_valued_flag_took_go_back_in_their_place():
    p = Parser(prog="python -m bench.reproduce", configs=True, positionals=("study",), override_lists=("sets",))
    p.add_argument("--set", dest="sets", nargs="+", action="extend", default=[])
    ns = p.parse_args(["a.yaml", "--set", "x.y=1", "b.yaml", "table2", "--set", "z.w=2", "c.yaml", "k.v=3"])
    assert (ns.configs, ns.sets, ns.overrides, ns.study) == (["a.yaml", "b.yaml", "c.yaml"],
                                                             ["x.y=1", "z.w=2", "k.v=3"], [], "table2")
    ns = p.parse_args(["--set", "x.y=1", "c.yaml", "b.yaml"])  # the order of the line, not of the gathering
    assert ns.configs == ["c.yaml", "b.yaml"] and ns.sets == ["x.y=1"]


def test_alike_stems_are_named_by_path():
    files = ["configs/gpt2_774m/onebit_adam.yaml", "configs/variants/onebit_adam.yaml", "x/muon.yaml"]
    assert [variant_name(f, files) for f in files] == ["configs/gpt2_774m/onebit_adam",
                                                        "configs/variants/onebit_adam", "muon"]


def test_help_exits_zero_and_names_the_convention(capsys):
    p = memory_like(variants=True)
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "CONFIG.yaml|section.key=value" in out and "--variants" in out


def test_a_namespace_passed_in_is_filled():
    ns = memory_like().parse_args(["a.yaml", "--world", "3"], argparse.Namespace(extra=1))
    assert ns.extra == 1 and ns.world == 3 and ns.configs == ["a.yaml"]
