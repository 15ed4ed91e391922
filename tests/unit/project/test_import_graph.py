"""The layers of spectrain_workloads, read from the source with ast (nothing is imported).

- harvest/ (the components every trainer uses), hooks/ (the public API for a user's trainer) and
  specdec/ (speculative decoding, under `spectrain generate` and RL) import neither target/ (the
  built-in trainer) nor rl/ (mode RL);
- no cycle runs through a top-level package: the graph's nodes are the top-level packages and
  modules (a cycle between two packages may pass through a module), its edges every import of one
  from another, at any level (function-local and TYPE_CHECKING imports included).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT_PACKAGE = "spectrain_workloads"
PACKAGE_DIR = Path(__file__).resolve().parents[3] / "workloads" / ROOT_PACKAGE
LOWER_LAYERS = ("harvest", "hooks", "specdec")     # may import neither of FORBIDDEN_BELOW
FORBIDDEN_BELOW = ("target", "rl")


@dataclass(frozen=True)
class Import:
    importer: str      # dotted module name, e.g. spectrain_workloads.hooks.ddp
    imported: str      # dotted name as resolved, e.g. spectrain_workloads.harvest.comm_hook
    line: int


def module_name(path: Path, package_dir: Path) -> str:
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, package_dir: Path) -> Iterator[Import]:
    """Every import statement in the file, anywhere in it; relative ones resolved. `from a import b`
    yields both a and a.b, as b may be a submodule."""
    name = module_name(path, package_dir)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(name, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            yield Import(name, target, node.lineno)
            for alias in node.names:
                yield Import(name, f"{target}.{alias.name}", node.lineno)


def all_imports(package_dir: Path = PACKAGE_DIR) -> list[Import]:
    return [imp for path in sorted(package_dir.rglob("*.py")) for imp in imports_of(path, package_dir)]


def top_level(dotted: str) -> str | None:
    """The top-level package or module of a spectrain_workloads name; None outside it or for the
    root package itself."""
    parts = dotted.split(".")
    return parts[1] if parts[0] == ROOT_PACKAGE and len(parts) > 1 else None


def unit_graph(imports: list[Import]) -> dict[str, dict[str, list[Import]]]:
    """importer unit -> imported unit -> the imports that make the edge (a unit: a top-level
    package or module)."""
    graph: dict[str, dict[str, list[Import]]] = defaultdict(lambda: defaultdict(list))
    for imp in imports:
        src, dst = top_level(imp.importer), top_level(imp.imported)
        if src is not None and dst is not None and src != dst:
            graph[src][dst].append(imp)
    return graph


def strongly_connected(graph: Mapping[str, Mapping[str, object]]) -> list[set[str]]:
    """Tarjan's algorithm (iterative); components of one node are left out (no self-edges here)."""
    nodes = set(graph) | {d for edges in graph.values() for d in edges}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    for root in sorted(nodes):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = []
        todo: str | None = root
        while todo is not None or work:
            if todo is not None:         # enter a node
                index[todo] = low[todo] = len(index)
                stack.append(todo)
                on_stack.add(todo)
                work.append((todo, iter(sorted(graph.get(todo, {})))))
                todo = None
            v, children = work[-1]
            child = next(children, None)
            if child is None:            # leave v
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp: set[str] = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(comp)
            elif child not in index:
                todo = child
            elif child in on_stack:
                low[v] = min(low[v], index[child])
    return out


def packages(package_dir: Path = PACKAGE_DIR) -> set[str]:
    return {p.parent.name for p in package_dir.glob("*/__init__.py")}


def cycle_report(graph: Mapping[str, Mapping[str, list[Import]]], components: list[set[str]]) -> str:
    lines = []
    for comp in components:
        lines.append(f"cycle among {sorted(comp)}:")
        for src in sorted(comp):
            for dst in sorted(set(graph.get(src, {})) & comp):
                where = ", ".join(sorted({f"{i.importer}:{i.line}" for i in graph[src][dst]})[:3])
                lines.append(f"  {src} -> {dst}  ({where})")
    return "\n".join(lines)


def test_the_graph_is_read() -> None:
    """Guards the two tests below against passing on an empty or misread tree."""
    graph = unit_graph(all_imports())
    assert {"harvest", "hooks", "target", "rl"} <= packages()
    assert "harvest" in graph["hooks"] and "harvest" in graph["target"]


def test_lower_layers_import_neither_target_nor_rl() -> None:
    bad = [imp for imp in all_imports()
           if top_level(imp.importer) in LOWER_LAYERS and top_level(imp.imported) in FORBIDDEN_BELOW]
    assert not bad, f"{', '.join(LOWER_LAYERS)} must not import {' or '.join(FORBIDDEN_BELOW)}:\n" + "\n".join(
        f"  {i.importer}:{i.line} imports {i.imported}" for i in bad)


def test_no_cycle_through_a_package() -> None:
    graph = unit_graph(all_imports())
    pkgs = packages()
    cycles = [comp for comp in strongly_connected(graph) if comp & pkgs]
    assert not cycles, "import cycles between top-level packages:\n" + cycle_report(graph, cycles)


def test_the_checks_fail_on_a_cycle_and_a_layer_breach(tmp_path: Path) -> None:
    """A tree with hooks -> target -> rl -> target: both rules see it."""
    root = tmp_path / ROOT_PACKAGE
    files = {
        "__init__.py": "",
        "hooks/__init__.py": "",
        "hooks/api.py": "def f():\n    from spectrain_workloads.target import entry\n",
        "target/__init__.py": "",
        "target/entry.py": "from ..rl import grpo\n",
        "rl/__init__.py": "",
        "rl/grpo.py": "from spectrain_workloads.model_io import load\n",
        "model_io.py": "import spectrain_workloads.target.entry\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    imports = all_imports(root)
    assert any(top_level(i.importer) == "hooks" and top_level(i.imported) == "target" for i in imports)
    graph = unit_graph(imports)
    cycles = [comp for comp in strongly_connected(graph) if comp & packages(root)]
    assert cycles == [{"target", "rl", "model_io"}]
    report = cycle_report(graph, cycles)
    assert "target -> rl  (spectrain_workloads.target.entry:1)" in report
    assert "model_io -> target" in report
