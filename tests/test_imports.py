"""The import graph of mmldlm/, read from the source with `ast`: no cycle between its packages, and none
between the modules of mmldlm/data. Every `import` and `from ... import` counts, at the top of a file
or inside a function (a lazy import is still a dependency).

A node of the package graph is a subpackage (data, model, training, ...) or a top-level module
(config, errors, ...). The root `mmldlm/__init__.py` is no node: Python runs it before any submodule,
so an import of it (`from mmldlm import __version__`) says nothing about layering, and its lazy
`MMLDLM` is the public face above every package."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mmldlm"


def module_names() -> dict[str, Path]:
    """Every module under mmldlm/ by its dotted name; a package by its own name (its __init__)."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported_modules(name: str, source: str, is_package: bool, modules) -> set[str]:
    """The mmldlm modules that module `name` imports: `from a.b import c` is a.b.c where c is a module,
    else a.b; relative imports are resolved against the module's package."""
    package = name if is_package else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {target for target in found if target in modules and target != name}


def graph(node_of) -> dict[str, set[str]]:
    """Edges between the nodes `node_of` maps modules to (None: not a node), self-loops left out."""
    modules = module_names()
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        source = node_of(name)
        if source is None:
            continue
        imported = imported_modules(name, path.read_text(), path.name == "__init__.py", modules)
        targets = {node_of(target) for target in imported}
        edges.setdefault(source, set()).update(targets - {None, source})
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def described(edges: dict[str, set[str]], component: list[str]) -> str:
    inside = set(component)
    return "; ".join(f"{a} -> {b}" for a in component for b in sorted(edges[a] & inside))


def package_of(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else None


def data_module_of(name: str) -> str | None:
    return name if name.startswith("mmldlm.data.") else None


@pytest.mark.parametrize(
    "node_of", [package_of, data_module_of], ids=["between packages", "between the modules of data"]
)
def test_the_imports_form_no_cycle(node_of):
    edges = graph(node_of)
    assert not [described(edges, c) for c in cycles(edges)]


def test_the_reader_sees_lazy_relative_and_from_package_imports():
    """The graph is only as good as its reading: an import inside a function is an edge, a relative
    import is resolved, and `from mmldlm.data import format` names the module format, not data."""
    source = (
        "from mmldlm.data import format, DataError\n"
        "from .sampler import Sampler\n"
        "def load():\n"
        "    import mmldlm.training.checkpoint\n"
        "    from ..model import mmdit\n"
    )
    modules = {"mmldlm.data", "mmldlm.data.format", "mmldlm.sampling.sampler", "mmldlm.training.checkpoint"}
    modules |= {"mmldlm.model", "mmldlm.model.mmdit", "mmldlm.sampling", "mmldlm.training"}
    assert imported_modules("mmldlm.sampling.run", source, False, modules) == {
        "mmldlm.data",
        "mmldlm.data.format",
        "mmldlm.sampling.sampler",
        "mmldlm.training.checkpoint",
        "mmldlm.model.mmdit",
    }


def test_training_and_sampling_meet_only_in_runs():
    """Training and sampling both read run directories through runs/ and never import each other; runs/
    imports neither training nor what reports on a run (evaluation, export), and those import no training."""
    edges = graph(package_of)
    assert "sampling" not in edges["training"] and "training" not in edges["sampling"]
    assert not edges["runs"] & {"training", "evaluation", "export"}
    assert "training" not in edges["evaluation"] | edges["export"]
