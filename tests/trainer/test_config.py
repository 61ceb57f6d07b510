import dataclasses
import glob
import subprocess
import sys
from pathlib import Path

import pytest

from optim import optimizer_names, sync
from trainer.config import ConfigError, describe, load_config, validate
from trainer.config_schema import field_docs

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(glob.glob(str(ROOT / "configs" / "**" / "*.yaml"), recursive=True))


def test_configs_exist():
    names = {str(Path(p).relative_to(ROOT / "configs")) for p in CONFIGS}
    assert {"default.yaml", "gpt2_124m.yaml", "variants/lioncub_1bit.yaml", "gpt2_774m/lioncub_8bit_l1.yaml"} <= names
    assert len([n for n in names if n.startswith("variants/")]) >= 15


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: str(Path(p).relative_to(ROOT)))
def test_every_shipped_config_loads_and_validates(path):
    cfg = load_config(path)
    # every shipped config is also legal at the world sizes our docs run it with
    for world in (1, 2, 4, 8):
        assert validate(cfg, world_size=world, raise_error=False) == [], (path, world)


def test_extends_chain_and_overrides():
    cfg = load_config(ROOT / "configs/gpt2_774m/lioncub_4bit_synchead.yaml", ["train.max_steps=7", "comm.bits=8"])
    assert cfg.model.preset == "gpt2-774m" and cfg.model.tie_embeddings is False
    assert cfg.comm.mode == "pbit" and cfg.comm.bits == 8 and cfg.comm.momentum_sync.every == 10
    assert cfg.optim.lr == 6e-5 and cfg.train.max_steps == 7
    assert load_config(None, ["optim.lr=3e-4"]).optim.lr == 3e-4  # YAML 1.1 would read a string
    assert cfg.train.out_dir == "runs/gpt2_774m/lioncub_4bit_synchead"


def test_unknown_keys_name_the_closest_valid_key_and_all_problems_at_once():
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/default.yaml", ["train.max_stpes=3", "optim.lr=fast", "comm.mode=carrier",
                                                    "optimm.name=lion"])
    msg = str(e.value)
    assert "4 config problem(s)" in msg
    assert "train.max_stpes: unknown key; did you mean train.max_steps?" in msg
    assert "optim.lr: expected float, got 'fast'" in msg
    assert f"comm.mode: 'carrier' is not one of {', '.join(sync.names())}" in msg
    assert "optimm: unknown section; did you mean optim?" in msg
    assert "did you mean" not in msg.split("comm.mode:")[1].split("\n")[0]     # 'carrier' is near no mode


def test_a_key_in_the_wrong_section_a_near_mode_and_a_missing_file_name_the_fix():
    """A practitioner review's first-hour mistakes: train.lr (optim.lr), optim.max_steps (train.max_steps, not
    optim.warmup_steps), comm.mode=onebitt (onebit), a variant file that does not exist (the nearest one)."""
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/default.yaml", ["train.lr=1e-3", "optim.max_steps=3", "comm.mode=onebitt"])
    msg = str(e.value)
    assert "train.lr: unknown key; did you mean optim.lr?" in msg
    assert "optim.max_steps: unknown key; did you mean train.max_steps?" in msg
    assert "is not one of" in msg and "; did you mean onebit?" in msg
    with pytest.raises(ConfigError, match=r"lioncub_2bit.yaml; did you mean .*/configs/variants/lioncub_4bit.yaml\?"):
        load_config([ROOT / "configs/default.yaml", ROOT / "configs/variants/lioncub_2bit.yaml"])
    with pytest.raises(ConfigError, match=r"zzzz.yaml; .*/configs/variants holds adamw_fp32.yaml, "):
        load_config([ROOT / "configs/variants/zzzz.yaml"])
    # ... and says nothing misleading: a nested key is not another section's (comm.diloco.lr is no optim.lr),
    # a number is never "near" another, a missing directory is named as such
    with pytest.raises(ConfigError) as e:
        load_config(None, ["comm.mode=diloco", "comm.diloco.lr=1", "train.max_steps=600"])
    assert "comm.diloco.lr: unknown key" in str(e.value) and "optim.lr" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(None, ["comm.mode=pbit", "comm.bits=32"])
    assert "comm.bits: 32 is not one of" in str(e.value) and "did you mean" not in str(e.value)
    with pytest.raises(ConfigError, match=r"nope/x.yaml \(its directory .*nope does not exist\)"):
        load_config([ROOT / "nope" / "x.yaml"])


def test_bad_combinations():
    with pytest.raises(ConfigError, match="optim.name=adamw needs a gradient-sync scheme: one of fp32, bf16, loco, "
                                          "diloco; onebit works with optim.name=lion"):
        load_config(None, ["optim.name=adamw", "comm.mode=onebit"])
    with pytest.raises(ConfigError, match="data.seq_len: 4096 exceeds the model's block size 256"):
        load_config(None, ["data.seq_len=4096"])
    with pytest.raises(ConfigError, match="momentum sync applies to update-sync modes: onebit, ps, hierarchical, pbit, "
                                          "compressed; set"):   # not diloco, which refuses it
        load_config(None, ["comm.momentum_sync.every=10"])
    # a key of another mode is named as such, not silently ignored
    with pytest.raises(ConfigError, match=r"comm.bits: not an option of comm.mode=onebit \(it belongs to pbit\)"):
        load_config(None, ["comm.mode=onebit", "comm.bits=8"])
    with pytest.raises(ConfigError, match="comm.tie_brake: unknown key; did you mean comm.tie_break"):
        load_config(None, ["comm.mode=onebit", "comm.tie_brake=plus"])


def test_world_size_dependent_checks():
    cfg = load_config(ROOT / "configs/gpt2_774m/lioncub_4bit.yaml")
    assert validate(cfg, world_size=15, raise_error=False) == []
    problems = validate(cfg, world_size=16, raise_error=False)
    assert len(problems) == 1 and "at most 15 ranks" in problems[0] and "comm.bits=8" in problems[0]
    l1 = load_config(ROOT / "configs/gpt2_774m/lioncub_8bit_l1.yaml")
    assert validate(l1, world_size=127, raise_error=False) == []  # L = 255 // 254 = 1
    assert "no quantization level for comm.quantizer=l1 at 128 ranks" in validate(l1, world_size=128,
                                                                                   raise_error=False)[0]
    ternary = load_config(None, ["comm.mode=pbit", "comm.bits=4", "comm.quantizer=sign", "comm.levels=1"])
    assert validate(ternary, world_size=7, raise_error=False) == []
    assert "overflow 4-bit lanes" in validate(ternary, world_size=8, raise_error=False)[0]
    set_levels = load_config(None, ["comm.mode=pbit", "comm.bits=8", "comm.quantizer=l1", "comm.levels=16"])
    assert "overflow 8-bit lanes" in validate(set_levels, world_size=8, raise_error=False)[0]


def test_help_text_covers_every_field():
    text = describe()
    for line in text.splitlines():
        if line.startswith("  "):
            assert line.split(":", 1)[1].strip(), f"field without help: {line}"
    assert "comm:" in text and "mode (str, default fp32): What crosses the network" in text
    # every registered scheme's and optimizer's options are listed, under the values that select them
    for scheme in sync.schemes():
        for key in scheme.options.field_names():
            line = next(ln for ln in text.splitlines() if ln.startswith(f"  {key} (") and "[comm.mode=" in ln)
            assert scheme.name in line.split("]")[0], (key, scheme.name, line)
    assert "ps_aggregate (str, default vote): [comm.mode=ps]" in text
    # an option that is a section of its own (comm.diloco) lists each of its keys, dotted, with its help
    nested = 0
    for scheme in sync.schemes():
        for f in dataclasses.fields(scheme.options):
            value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if not dataclasses.is_dataclass(value):
                continue
            docs = field_docs(type(value))
            for g in dataclasses.fields(value):
                line = next(ln for ln in text.splitlines() if ln.startswith(f"  {f.name}.{g.name} ("))
                assert f"[comm.mode={scheme.name}]" in line and docs[g.name] in line, line
                nested += 1
    assert nested >= 12
    assert "  diloco.inner_steps (int, default 500): [comm.mode=diloco] H: inner steps" in text
    assert "bits (int, default 4): [comm.mode=pbit]" in text
    assert all(name in text for name in optimizer_names())
    # each key's type and default, nested sections dotted
    for expected in ("lr (float, default 0.0003):", "tie_embeddings (bool or null, default null):",
                     "betas (list, default [0.9, 0.99]):", "max_steps (int, default 300):",
                     "momentum_sync.layers (list, default [head]):", "wandb (str, default ''):"):
        assert f"  {expected}" in text, expected


def test_cli_reports_config_errors_without_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "train.py", "configs/default.yaml", "train.max_step=3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "did you mean train.max_steps" in proc.stderr and "Traceback" not in proc.stderr
    missing = subprocess.run([sys.executable, "train.py", str(tmp_path / "nope.yaml")], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "config file not found" in missing.stderr


def test_review_gaps_are_config_errors():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["optim.name=lion", "comm.mode=pbit", "comm.quantizer=lp", "comm.p=-1", "comm.levels=200",
                           "comm.bits=16", "comm.momentum_sync.every=5", "comm.momentum_sync.layers=[]",
                           "comm.momentum_sync.start=10", "comm.momentum_sync.stop=5"])
    msg = str(e.value)
    for needle in ("start=10 is after stop=5", "layers: empty", "comm.p: -1.0 must be >= 0", "exceeds 127"):
        assert needle in msg, (needle, msg)


def test_warmup_past_the_horizon_is_an_error_and_shipped_configs_stay_valid_when_shortened():
    with pytest.raises(ConfigError, match=r"optim.warmup_steps: 20 >= train.max_steps=20: the lr would never leave"):
        load_config(None, ["optim.warmup_steps=20", "train.max_steps=20"])
    with pytest.raises(ConfigError, match=r"optim.warmup_steps: 50 >= optim.schedule_steps=40"):
        load_config(None, ["optim.warmup_steps=50", "train.max_steps=100", "optim.schedule_steps=40"])
    with pytest.raises(ConfigError, match=r"optim.decay_fraction: warmup \(10\) \+ decay \(10 steps\) exceed"):
        load_config(None, ["optim.schedule=wsd", "optim.warmup_steps=10", "optim.decay_fraction=0.5",
                           "train.max_steps=19"])
    with pytest.raises(ConfigError, match="optim.decay_shape: 'exp' is not one of linear, cosine, sqrt"):
        load_config(None, ["optim.schedule=wsd", "optim.decay_shape=exp"])
    # the shipped configs give warmup as a fraction: a short smoke run keeps a valid schedule
    from trainer.config import warmup_steps
    for path, steps, warm in [("configs/default.yaml", 20, 1), ("configs/default.yaml", 300, 20),
                              ("configs/default.yaml", 1, 0), ("configs/gpt2_124m/lion_fp32.yaml", 50, 1),
                              ("configs/gpt2_124m/lion_fp32.yaml", 50000, 1000),
                              ("configs/cpu_30m/lion_fp32.yaml", 300, 20), ("configs/cpu_30m/lion_fp32.yaml", 13, 0)]:
        cfg = load_config(ROOT / path, [f"train.max_steps={steps}"])
        assert warmup_steps(cfg.optim, steps) == warm, (path, steps)


def test_a_checkpoint_written_before_a_key_existed_resumes_when_the_key_is_at_its_default(tmp_path):
    import json

    from trainer.rundir import flatten, resume_problem

    now = load_config(ROOT / "configs/default.yaml").to_dict()
    old = json.loads(json.dumps(now))
    for key in ("decay_fraction", "decay_shape", "schedule_steps"):
        del old["optim"][key]  # what a checkpoint written before these keys holds
    ckpt = tmp_path / "ckpt" / "step_000004"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"step": 4, "world_size": 1, "config": old}))
    assert resume_problem(tmp_path / "ckpt", now) == ""
    changed = load_config(ROOT / "configs/default.yaml", ["optim.decay_fraction=0.5"]).to_dict()
    assert "optim.decay_fraction: None -> 0.5" in resume_problem(tmp_path / "ckpt", changed)
    assert set(flatten(now)) - set(flatten(old)) == {"optim.decay_fraction", "optim.decay_shape",
                                                     "optim.schedule_steps"}


def test_resume_checks_the_checkpoint_the_fallback_would_load(tmp_path):
    """The newest checkpoint's meta.json is damaged, so train.resume=auto would fall back to an older one: a
    config that differs from that one in a key a resumed run cannot change is refused all the same."""
    import json

    from trainer.rundir import resume_problem

    base = load_config(ROOT / "configs/default.yaml").to_dict()
    changed = load_config(ROOT / "configs/default.yaml", ["model.n_layer=3"]).to_dict()
    for step, meta in ((2, json.dumps({"step": 2, "world_size": 1, "config": base})), (4, "{not json")):
        d = tmp_path / "ckpt" / f"step_{step:06d}"
        d.mkdir(parents=True)
        (d / "meta.json").write_text(meta)
    assert resume_problem(tmp_path / "ckpt", base) == ""
    problem = resume_problem(tmp_path / "ckpt", changed)
    assert "step_000002" in problem and "model.n_layer" in problem


def test_a_size_file_and_a_variant_file_compose_on_the_command_line():
    from trainer.config import split_config_args

    kept = load_config(ROOT / "configs/gpt2_774m/lioncub_8bit_l1.yaml").to_dict()
    composed = load_config([ROOT / "configs/gpt2_774m.yaml", ROOT / "configs/variants/lioncub_8bit_l1.yaml"])
    assert composed.to_dict() == kept                       # same keys, same run directory
    assert composed.train.out_dir == "runs/gpt2_774m/lioncub_8bit_l1"
    over = load_config([ROOT / "configs/gpt2_774m.yaml", ROOT / "configs/variants/lion_fp32.yaml"],
                       ["train.out_dir=/tmp/x", "optim.lr=1e-4"])
    assert over.train.out_dir == "/tmp/x" and over.optim.lr == 1e-4 and over.model.preset == "gpt2-774m"
    assert load_config([ROOT / "configs/default.yaml"]).train.out_dir == "runs/default"  # one file: as written
    # every file composes wherever it stands (util/cli.py's convention); a stray word goes to the overrides' check
    assert split_config_args(["a.yaml", "x.y=1", "b.yml", "c"]) == (["a.yaml", "b.yml"], ["x.y=1", "c"])


def test_train_py_takes_files_and_overrides_in_any_order():
    from trainer.config import load_config_args

    want = load_config([ROOT / "configs/gpt2_774m.yaml", ROOT / "configs/variants/lioncub_1bit.yaml"],
                       ["train.max_steps=7", "optim.lr=1e-4"]).to_dict()
    for argv in (["configs/gpt2_774m.yaml", "configs/variants/lioncub_1bit.yaml", "train.max_steps=7", "optim.lr=1e-4"],
                 ["train.max_steps=7", "configs/gpt2_774m.yaml", "optim.lr=1e-4", "configs/variants/lioncub_1bit.yaml"]):
        got = load_config_args([str(ROOT / a) if a.endswith(".yaml") else a for a in argv]).to_dict()
        assert got == want and got["train"]["out_dir"] == "runs/gpt2_774m/lioncub_1bit"
    with pytest.raises(ConfigError, match="^configs/default: expected a config file"):
        load_config_args([str(ROOT / "configs/default.yaml"), "configs/default"])


def test_every_variant_composes_with_every_size_file():
    sizes = sorted((ROOT / "configs").glob("*.yaml"))
    sizes = [s for s in sizes if s.name != "default.yaml"]
    assert {s.stem for s in sizes} >= {"cpu_30m", "gpt2_124m", "gpt2_774m"}
    problems = []
    for size in sizes:
        for variant in sorted((ROOT / "configs/variants").glob("*.yaml")):
            try:
                cfg = load_config([size, variant])
            except ConfigError as e:
                problems.append(f"{size.name} + {variant.name}: {e}")
                continue
            for world in (1, 2, 4, 8):  # legal at the world sizes our docs run it with
                problems += [f"{size.name} + {variant.name} at {world}: {p}"
                             for p in validate(cfg, world_size=world, raise_error=False)]
    # the only pairs that may not compose: a head sync on a model that ties embedding and head
    assert all("ties embedding and head" in p for p in problems), problems


def test_a_size_files_lion_lr_multipliers_do_not_reach_another_optimizer():
    """configs/gpt2_774m_fineweb.yaml sets Lion's App. F.3 group multipliers (x1000 embedding, x100 head and
    scalars): composed with a variant of another optimizer family they are reset to 1 (AdamW once trained its
    embedding at lr 0.6 this way, silently); the Lion family keeps them. BinSGDM's file takes the base's Lion
    lr on purpose (its update is +-lr per element like Lion's), so it keeps them too. The startup line shows
    multipliers that are not 1."""
    from types import SimpleNamespace

    from trainer.logger import _lr_mults

    size = ROOT / "configs/gpt2_774m_fineweb.yaml"
    base = load_config(size).optim
    lion_like = {base.name, "binsgdm"}
    assert (base.embedding_lr_mult, base.head_lr_mult, base.scalar_lr_mult) == (1000, 100, 100)
    kept, reset = [], []
    for variant in sorted((ROOT / "configs/variants").glob("*.yaml")):
        o = load_config([size, variant]).optim
        mults = (o.embedding_lr_mult, o.head_lr_mult, o.scalar_lr_mult)
        (kept if mults == (1000, 100, 100) else reset).append(variant.stem)
        if o.name in lion_like:
            assert mults == (1000, 100, 100), variant.name
        else:
            assert mults == (1, 1, 1), f"{variant.name} ({o.name}) inherits Lion's multipliers {mults}"
    assert {"adamw_fp32", "onebit_adam", "loco_adamw", "diloco_h10", "diloco_h50", "streaming_diloco", "muon",
            "dion"} <= set(reset) and {"lion_fp32", "lioncub_1bit", "binsgdm"} <= set(kept)
    assert load_config(ROOT / "configs/gpt2_774m_fineweb/adamw_fp32.yaml").optim.embedding_lr_mult == 1
    assert _lr_mults(base) == " (x1000 embedding, x100 head, x100 scalar)"
    assert _lr_mults(SimpleNamespace(embedding_lr_mult=1.0, head_lr_mult=1.0, scalar_lr_mult=1.0)) == ""


def test_a_word_yaml_read_as_a_boolean_is_named_as_such():
    """log.wandb=off and train.resume=yes reach a str key as booleans (YAML 1.1): the error says so and how
    to fix it, instead of "expected str, got False (bool)"; a quoted word reaches the key's own check."""
    for over, said in (("log.wandb=off", "log.wandb: expected a word, got false: YAML reads an unquoted false, no "
                                         "or off as a boolean"),
                       ("train.resume=yes", "train.resume: expected a word, got true: YAML reads an unquoted true, "
                                            "yes or on as a boolean")):
        with pytest.raises(ConfigError) as e:
            load_config(None, [over])
        assert said in str(e.value) and "--help-config" in str(e.value) and "(bool)" not in str(e.value)
    with pytest.raises(ConfigError, match="log.wandb: 'off' is not one of online, offline, disabled"):
        load_config(None, ["log.wandb='off'"])
    with pytest.raises(ConfigError, match=r"model.preset: expected str, got 5 \(int\)"):
        load_config(None, ["model.preset=5"])


def test_train_py_wants_a_config_file(capsys):
    import train

    assert train.main(["optim.lr=1e-3"]) == 2
    err = capsys.readouterr().err
    assert "expected a config file (*.yaml)" in err and err.count("\n") == 1


def test_a_mode_option_under_comm_mode_auto_names_the_mode_it_belongs_to():
    """comm.tie_break is onebit's (and others') option: under comm.mode=auto it was an "unknown key"; it is a
    key with no mode to belong to, said so, while a typo is still an unknown key."""
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/default.yaml", ["comm.mode=auto", "comm.tie_break=alternate", "comm.tmeout_s=5"])
    msg = str(e.value)
    assert "comm.tie_break: an option of comm.mode=" in msg and "onebit" in msg and "set with comm.mode=auto" in msg
    assert "comm.tmeout_s: unknown key" in msg and "comm.tie_break: unknown key" not in msg
    assert load_config(ROOT / "configs/default.yaml", ["comm.mode=auto"]).comm.mode == "auto"
