"""The package's shape: no import cycles, no private names across modules, a small top level.

A static walk over the source (ast), so it sees every module whether or not a test imports it.
`passes/` and `costmodel/` count as `autopar.passes` and `autopar.costmodel`, as they install.
Imports under `if TYPE_CHECKING:` are annotations only and do not count.
"""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"autopar": ROOT / "autopar", "autopar.passes": ROOT / "passes", "autopar.costmodel": ROOT / "costmodel"}
TOP_LEVEL_LIMIT = 12


def _modules() -> dict[str, Path]:
    out = {}
    for package, folder in FOLDERS.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()


def _runtime_imports(tree: ast.Module):
    """Import statements, skipping `if TYPE_CHECKING:` blocks."""
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for body in node.body for n in ast.walk(body)}
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skip]


def _imports(name: str, path: Path) -> list[tuple[str, str | None, str | None]]:
    """(module imported, name imported from it or None, local alias) for each import in `path`."""
    out = []
    for node in _runtime_imports(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, None, a.asname or a.name) for a in node.names]
            continue
        if node.level:  # relative: resolve against this module's package
            base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
            base = base[:len(base) - node.level + 1]
            module = ".".join(base + ([node.module] if node.module else []))
        else:
            module = node.module or ""
        out += [(module, a.name, a.asname or a.name) for a in node.names]
    return out


def _graph() -> nx.DiGraph:
    g = nx.DiGraph()
    for name, path in MODULES.items():
        g.add_node(name)
        for module, item, _ in _imports(name, path):
            target = f"{module}.{item}" if item and f"{module}.{item}" in MODULES else module
            if target in MODULES and target != name:
                g.add_edge(name, target)
    return g


def test_no_import_cycles():
    cycles = [sorted(c) for c in nx.strongly_connected_components(_graph()) if len(c) > 1]
    assert not cycles, f"import cycles inside autopar: {cycles}"


def test_no_private_names_across_modules():
    """What another module needs is public in its owner: no `from m import _x`, no `m._x`."""
    found = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        aliases = {}
        for module, item, alias in _imports(name, path):
            if module not in MODULES:
                continue
            if item is None or f"{module}.{item}" in MODULES:
                aliases[alias] = f"{module}.{item}" if item else module
            elif item.startswith("_") and not item.startswith("__"):
                found.append(f"{name}: from {module} import {item}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{name}: {aliases[node.value.id]}.{node.attr}")
    assert not found, "private names used across modules:\n" + "\n".join(sorted(set(found)))


def test_top_level_is_small_and_every_module_sits_in_its_stage():
    top = [p.stem for p in FOLDERS["autopar"].glob("*.py") if not p.stem.startswith("__")]
    assert len(top) <= TOP_LEVEL_LIMIT, f"{len(top)} modules at autopar/'s top level: {sorted(top)}"
    folders = {p.name for p in FOLDERS["autopar"].iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert all((FOLDERS["autopar"] / f / "__init__.py").exists() for f in folders), folders


def test_no_symlinks_in_the_package():
    """A link inside a package folder (a developer's symlink tree written into the repo by mistake) makes
    the wheel recurse into itself: autopar/passes/passes/... ."""
    links = [str(p.relative_to(ROOT)) for folder in FOLDERS.values() for p in folder.rglob("*") if p.is_symlink()]
    assert not links, f"symlinks in the package: {links}"


def test_the_graph_walk_sees_imports():
    """The checks above are only as good as the walk: it must find known edges and a made-up cycle."""
    g = _graph()
    assert g.has_edge("autopar.api", "autopar.planning.spmd")
    assert g.has_edge("autopar.passes.lower_collectives", "autopar.passes.moe_dispatch")
    g.add_edge("autopar.planning.spmd", "autopar.api")
    assert any(len(c) > 1 for c in nx.strongly_connected_components(g))
