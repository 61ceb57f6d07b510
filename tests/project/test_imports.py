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
