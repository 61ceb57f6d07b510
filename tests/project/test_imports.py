"""The import graph of the project's own modules, built from EVERY import statement (module level,
inside functions and methods, under `if`/`try`, and importlib.import_module / __import__ with a
constant name): no cycle anywhere, the product never imports the lab, comm/ imports nothing of ours,
and no private name (a leading underscore) is imported from another top-level package
(docs/architecture.md, "Two layers" and "Dependency rules"). An import deferred into a function is
still a dependency: it runs the first time the function does.

The two layers:
- product: model, data, optim, comm, trainer, util and the root commands (train.py, sample.py,
  eval.py): what a user installs to train, sample, evaluate, export and prepare the supported corpora;
- lab: bench (the benchmarks, the advice command, the reproduction framework and its studies, the
  prose-corpus builder, the bandwidth simulator netsim) and the scripts under docs/results.
The lab imports the product, never the reverse.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("model", "data", "optim", "comm", "trainer", "util", "train", "sample", "eval")
LAB = ("bench", "docs")
SKIP = {"tests", "build", "site-packages", "node_modules"}


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def project_modules(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file of every .py file of the project outside tests/ (packages, the root
    scripts, scripts kept beside results)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(p in SKIP or p.startswith(".") for p in rel[:-1]):
            continue
        out[_module_name(path, root)] = path
    return out


def _in(name: str, roots: tuple[str, ...]) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


def is_product(name: str) -> bool:
    return _in(name, PRODUCT)


def is_lab(name: str) -> bool:
    return _in(name, LAB)


def _dynamic_target(node: ast.Call) -> str | None:
    """The constant module name of importlib.import_module("x") / __import__("x"), else None."""
    f = node.func
    named = (isinstance(f, ast.Name) and f.id in ("__import__", "import_module")) or (
        isinstance(f, ast.Attribute) and f.attr == "import_module")
    if named and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return node.args[0].value
    return None


def imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str, int]]:
    """(imported module of ours, imported name or "", line) of every import statement in the file,
    wherever it stands. `from P import x` is an import of module P.x when that is one of ours, else
    of P (x a name P defines); importing P.Q also runs P's __init__, so P is listed too."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    tops = {m.split(".")[0] for m in modules}
    found: list[tuple[str, str, int]] = []

    def add(module: str, what: str, line: int) -> None:
        parts = module.split(".")
        for k in range(1, len(parts)):  # the packages above it, whose __init__ runs first
            if ".".join(parts[:k]) in modules:
                found.append((".".join(parts[:k]), "", line))
        found.append((module, what, line))

    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            for a in n.names:
                if a.name.split(".")[0] in tops:
                    add(a.name, "", n.lineno)
        elif isinstance(n, ast.ImportFrom):
            if n.level:
                base = ".".join(here[:len(here) - n.level + 1] + ([n.module] if n.module else []))
            else:
                base = n.module or ""
            if base.split(".")[0] not in tops:
                continue
            for a in n.names:
                sub = f"{base}.{a.name}"
                if sub in modules:
                    add(sub, "", n.lineno)
                else:
                    add(base, a.name, n.lineno)
        elif isinstance(n, ast.Call):
            target = _dynamic_target(n)
            if target and target.split(".")[0] in tops:
                add(target, "", n.lineno)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = project_modules(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for m, path in modules.items():
        for target, _, _ in imports(m, path, modules):
            # a module importing a package it lies in gets the partly initialised package (Python
            # sets the package up before its submodules run): not a cycle Python trips on, and
            # every package that imports its own submodules would otherwise be one
            if target in modules and target != m and not m.startswith(target + "."):
                graph[m].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def one_loop(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """One closed path through a cycle's modules, for the failure message: a -> b -> ... -> a."""
    members, start = set(comp), comp[0]
    path, seen = [start], {start}
    while True:
        nxt = sorted(w for w in graph[path[-1]] if w in members)
        back = [w for w in nxt if w in seen]
        if back:
            return path[path.index(back[0]):] + [back[0]]
        path.append(nxt[0])
        seen.add(nxt[0])


def _violations(root: Path, importer, imported) -> list[str]:
    """'file line N: imports M' for every import by a module `importer` accepts of a module
    `imported` accepts (of a package and its submodule on one line, the submodule)."""
    modules = project_modules(root)
    out = []
    for m, path in modules.items():
        if not importer(m):
            continue
        hits: dict[int, str] = {}
        for t, _, line in imports(m, path, modules):
            if imported(t) and len(t) > len(hits.get(line, "")):
                hits[line] = t
        out += [f"{path.relative_to(root).as_posix()} line {line}: imports {t}" for line, t in sorted(hits.items())]
    return out


def layer_violations(root: Path = ROOT) -> list[str]:
    """Every import of a lab module by a product module."""
    return _violations(root, is_product, is_lab)


def below_trainer_violations(root: Path = ROOT) -> list[str]:
    """Every import of the trainer by the packages under it (model, data, optim, comm, util): the
    trainer sees them all, they see none of it (a command of theirs that needs a config lives in
    trainer/)."""
    return _violations(root, lambda m: _in(m, ("model", "data", "optim", "comm", "util")),
                       lambda t: _in(t, ("trainer",)))


def problems(root: Path = ROOT) -> list[str]:
    """What the dependency rules find in the tree at `root`: each cycle as one loop, then each
    import of the lab from the product."""
    graph = import_graph(root)
    return ([f"import cycle: {' -> '.join(one_loop(graph, c))}" for c in cycles(graph)]
            + [f"the product imports the lab: {v}" for v in layer_violations(root)]
            + [f"a package under the trainer imports it: {v}" for v in below_trainer_violations(root)])


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert one_loop({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c"]) == ["a", "b", "c", "a"]


def _plant(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return root


def test_the_checker_finds_a_cycle_hidden_in_a_function_and_a_product_import_of_the_lab(tmp_path):
    """A planted tree: optim.base imports the registry inside a method, the registry imports an
    optimizer at module level and the optimizer imports the base (the cycle this project had); a
    trainer module imports the lab inside a function, another through importlib."""
    root = _plant(tmp_path, {
        "optim/__init__.py": "",
        "optim/base.py": "class Base:\n    def check(self):\n        from .registry import rule\n        return rule\n",
        "optim/registry.py": "from .adamw import AdamW\n\ndef rule():\n    return AdamW\n",
        "optim/adamw.py": "from optim.base import Base\n\nclass AdamW(Base):\n    pass\n",
        "trainer/__init__.py": "",
        "trainer/loop.py": "def go():\n    from bench import advise\n    return advise\n",
        "trainer/plug.py": "import importlib\n\ndef go():\n    return importlib.import_module('bench.advise')\n",
        "bench/__init__.py": "",
        "model/__init__.py": "",
        "model/memory.py": "def main():\n    from trainer.config import load_config\n",
        "bench/advise.py": "import optim.adamw\n",  # the lab imports the product: allowed
        "tests/test_x.py": "import bench.advise\n",  # tests are no module of the graph
    })
    found = problems(root)
    assert "import cycle: optim.adamw -> optim.base -> optim.registry -> optim.adamw" in found
    assert "the product imports the lab: trainer/loop.py line 2: imports bench.advise" in found
    assert "the product imports the lab: trainer/plug.py line 4: imports bench.advise" in found
    assert "a package under the trainer imports it: model/memory.py line 2: imports trainer.config" in found
    assert len(found) == 4, found
    # the same tree with the import moved out of the base: no cycle is left
    (root / "optim/base.py").write_text("class Base:\n    pass\n")
    assert not [p for p in problems(root) if p.startswith("import cycle")]


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    assert "optim.lion" in graph and "comm.kernels" in graph["optim.lion"]  # module level
    assert "model.hf" in graph["model.load"]  # load_model's, inside a function


def test_no_import_cycle_and_the_product_never_imports_the_lab():
    found = problems()
    assert not found, "\n".join(found)


def test_comm_imports_nothing_of_ours_outside_comm():
    modules = project_modules()
    bad = [f"{m} line {line}: {t}" for m, path in modules.items() if m.split(".")[0] == "comm"
           for t, _, line in imports(m, path, modules) if t.split(".")[0] != "comm"]
    assert not bad


def test_no_private_name_imported_from_another_package():
    modules = project_modules()
    bad = []
    for m, path in modules.items():
        for target, name, line in imports(m, path, modules):
            if target.split(".")[0] == m.split(".")[0]:
                continue
            private = [p for p in target.split(".")[1:] + [name] if p.startswith("_") and not p.startswith("__")]
            if private:
                bad.append(f"{m} line {line}: {target} {name}".strip())
    assert not bad


# ---------------------------------------------------------------------------------------------
# One home per rule: the lane maximum 2**bits - 1, the lane-sum levels (2**bits - 1) // (2 P) and
# eq. (1)'s levels 2**(bits-1) - 1 are each written in exactly one function; everything else calls it.

FORMULA_HOMES = {
    "lane maximum 2**b - 1": ("comm/packing.py", "lane_max"),
    "eq. (1) levels 2**(b-1) - 1": ("comm/quantize.py", "levels_for_bits"),
    "lane-sum levels top // (2 P)": ("comm/allreduce.py", "max_levels"),
}


def _is_power_of_two_of(node: ast.AST) -> ast.AST | None:
    """E when `node` is `1 << E` or `2 ** E` with a non-constant E (constants such as 2**63 are not a rule)."""
    if isinstance(node, ast.BinOp) and isinstance(node.right, ast.AST) and not isinstance(node.right, ast.Constant):
        if isinstance(node.op, ast.LShift) and isinstance(node.left, ast.Constant) and node.left.value == 1:
            return node.right
        if isinstance(node.op, ast.Pow) and isinstance(node.left, ast.Constant) and node.left.value == 2:
            return node.right
    return None


def _formula(node: ast.AST) -> str | None:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) \
            and isinstance(node.right, ast.Constant) and node.right.value == 1:
        e = _is_power_of_two_of(node.left)
        if e is not None:
            minus_one = isinstance(e, ast.BinOp) and isinstance(e.op, ast.Sub) \
                and isinstance(e.right, ast.Constant) and e.right.value == 1
            return "eq. (1) levels 2**(b-1) - 1" if minus_one else "lane maximum 2**b - 1"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv) and isinstance(node.right, ast.BinOp) \
            and isinstance(node.right.op, ast.Mult) \
            and any(isinstance(s, ast.Constant) and s.value == 2 for s in (node.right.left, node.right.right)):
        return "lane-sum levels top // (2 P)"
    return None


def formula_sites(source: str, filename: str = "<src>") -> list[tuple[str, str, int]]:
    """(rule, enclosing function or "", line) of every place `source` writes one of the rules."""
    tree = ast.parse(source, filename)
    found = []

    def visit(node: ast.AST, func: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            func = node.name
        rule = _formula(node)
        if rule:
            found.append((rule, func, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, func)

    visit(tree, "")
    return found


def test_formula_scanner_finds_each_rule():
    src = ("def a(bits, P):\n    top = (1 << bits) - 1\n    return top // (2 * P)\n"
           "def b(n):\n    return 2 ** (n - 1) - 1\n"
           "SEED = 2 ** 63 - 1\n")
    assert sorted((r, f) for r, f, _ in formula_sites(src)) == sorted([
        ("lane maximum 2**b - 1", "a"), ("lane-sum levels top // (2 P)", "a"), ("eq. (1) levels 2**(b-1) - 1", "b")])


def test_each_levels_and_lanes_rule_has_one_home():
    sites: dict[str, list[str]] = {rule: [] for rule in FORMULA_HOMES}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests",) or rel.parts[0].startswith(".") or "site-packages" in rel.parts:
            continue
        for rule, func, line in formula_sites(path.read_text(), str(path)):
            sites[rule].append(f"{rel.as_posix()}:{line} ({func or 'module level'})")
    for rule, (home_file, home_func) in FORMULA_HOMES.items():
        others = [s for s in sites[rule] if not s.startswith(f"{home_file}:") or f"({home_func})" not in s]
        assert not others, (f"the {rule} rule is written again at {others}; call {home_file.replace('/', '.')[:-3]}."
                            f"{home_func} instead")
        assert any(s.startswith(f"{home_file}:") for s in sites[rule]), f"{rule}: its home {home_file} lost it"
