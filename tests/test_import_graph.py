"""No import cycles in ``jaxserve/`` and ``pallas_kernels/``, counting function-level imports
and imports by name (``importlib.import_module`` of a module a string names: the model
registry's families, ``jaxserve.model``'s lazy names). ``typing.TYPE_CHECKING`` blocks are not
imports; optional third-party packages (ray, orbax, llguidance, zmq, gguf) are not ours and
not in the graph."""

from __future__ import annotations

import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("jaxserve", "pallas_kernels")


def _modules() -> dict[str, str]:
    """Dotted module name -> file, for every module of ``PACKAGES``."""
    out = {}
    for package in PACKAGES:
        for root, _, files in os.walk(os.path.join(REPO, package)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(root, f), REPO)[: -len(".py")]
                    name = rel.replace(os.sep, ".").removesuffix(".__init__")
                    out[name] = os.path.join(root, f)
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: str, modules: dict[str, str]) -> set[str]:
    """The modules of ``modules`` that ``name`` imports anywhere in its file."""
    with open(path) as f:
        tree = ast.parse(f.read())
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found: set[str] = set()
    strings: set[str] = set()
    by_name = False
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names}
            found.update(subs)
            if not subs <= modules.keys():  # `from pkg import module` imports the module
                found.add(base)
        elif isinstance(node, ast.Attribute) and node.attr == "import_module":
            by_name = True
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            strings.add(node.value)
        stack.extend(ast.iter_child_nodes(node))
    if by_name:  # a module that imports by name may import every module it names
        found.update(strings)
    return {m for m in found if m in modules and m != name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    modules = _modules()
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert len(graph) > 80 and "jaxserve.core.scheduler" in graph
    assert graph["jaxserve.model.registry"] >= {"jaxserve.model.models.llama"}  # by name
    cycles = _cycles(graph)
    assert not cycles, f"import cycles (each a list of modules importing each other): {cycles}"


def test_the_checker_sees_imports_in_functions_and_by_name(tmp_path):
    """Guards the test above: a loop closed by an import inside a function, or by
    ``importlib.import_module`` of a named module, is a cycle; a TYPE_CHECKING import is not."""
    files = {
        "pkg.a": "def f():\n    from pkg import b\n",
        "pkg.b": "import importlib\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
        "    import pkg.c\nM = 'pkg.a'\n\ndef g():\n    return importlib.import_module(M)\n",
        "pkg.c": "import pkg.b\n",
    }
    modules = {}
    for name, text in files.items():
        (tmp_path / f"{name}.py").write_text(text)
        modules[name] = str(tmp_path / f"{name}.py")
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.b"}}
    assert _cycles(graph) == [["pkg.a", "pkg.b"]]
