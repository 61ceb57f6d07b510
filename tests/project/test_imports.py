"""The import graph of the project's own modules: no cycle anywhere, comm/ imports nothing of ours,
and no private name (a leading underscore) is imported from another top-level package
(docs/architecture.md, "Dependency rules")."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").exists() and p.name != "tests")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            out[_module_name(path)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str, int]]:
    """(imported module, imported name or "", line) of every module-level import of ours: the ones
    that run when the module is imported (imports inside functions run later)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    found = []
    for node in tree.body:
        nodes = [node]
        if isinstance(node, ast.If | ast.Try):
            nodes = [n for n in ast.walk(node) if isinstance(n, ast.Import | ast.ImportFrom)]
        for n in nodes:
            if isinstance(n, ast.Import):
                found += [(a.name, "", n.lineno) for a in n.names if a.name.split(".")[0] in PACKAGES]
            elif isinstance(n, ast.ImportFrom):
                if n.level:
                    base = ".".join(here[:len(here) - n.level + 1] + ([n.module] if n.module else []))
                else:
                    base = n.module or ""
                if base.split(".")[0] not in PACKAGES:
                    continue
                for a in n.names:
                    sub = f"{base}.{a.name}"
                    found.append((sub, "", n.lineno) if sub in modules else (base, a.name, n.lineno))
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for m, path in modules.items():
        for target, _, _ in _imports(m, path, modules):
            # a submodule importing its own package's __init__ gets the partly initialised package:
            # not a cycle Python trips on, and every package import would otherwise be one
            if target in modules and not m.startswith(target + "."):
                graph[m].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
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
            if len(comp) > 1 or v in graph[v]:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_the_projects_modules():
    graph = _graph()
    assert "optim.lion" in graph and "comm.kernels" in graph["optim.lion"]  # the graph sees our imports
    assert _cycles(graph) == []


def test_comm_imports_nothing_of_ours_outside_comm():
    modules = _modules()
    bad = [f"{m} line {line}: {t}" for m, path in modules.items() if m.split(".")[0] == "comm"
           for t, _, line in _imports(m, path, modules) if t.split(".")[0] != "comm"]
    assert not bad


def test_no_private_name_imported_from_another_package():
    modules = _modules()
    bad = []
    for m, path in modules.items():
        for target, name, line in _imports(m, path, modules):
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
