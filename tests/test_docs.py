"""The docs stay true to the tree: docs/ARCHITECTURE.md's module map names every module and the
README's layout table every package, both naming only paths that exist; every ``--flag`` the
README names is in the ``--help`` of the command it belongs to.

The tests read the tree and the parsers, so a rename or a new module fails here until the docs
say so; the docs change, not these tests. How a table cell names files (both tables): a path
from the repository root (``jaxserve/core/request.py``, or a folder ``jaxserve/tokenizer/``),
then further names relative to that path's folder, or to the folder itself
(``request_queue.py``, ``openai/api_server.py``).
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

from jaxserve.cli import COMMANDS, build_parser

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("jaxserve", "pallas_kernels")
CODE_NAME = re.compile(r"`([^`\s]+)`")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*(?![\w])")


# ---- tables --------------------------------------------------------------------------------------


def _table_first_cells(text: str, heading: str) -> list[str]:
    """The first cells of the rows of the first table under ``heading`` (a markdown heading)."""
    lines = text.splitlines()
    start = lines.index(heading)
    cells, in_table = [], False
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            in_table = True
            cell = line.split("|")[1].strip()
            if cell and not set(cell) <= set("-: "):
                cells.append(cell)
        elif in_table or line.startswith("#"):
            break
    return cells[1:]  # without the header row


def _named_paths(cell: str) -> list[str]:
    """Repository paths a first cell names (see the module docstring)."""
    paths, folder = [], None
    for name in CODE_NAME.findall(cell):
        if name.startswith(PACKAGES) or name.rstrip("/") in ("benchmarks", "scripts", "demos"):
            paths.append(name)
            folder = name if name.endswith("/") else name.rsplit("/", 1)[0] + "/"
        elif folder is not None and re.fullmatch(r"[\w/]+(\.py)?/?", name):
            paths.append(folder + name)
    return paths


def _is_face(path: Path) -> bool:
    """A package's ``__init__.py`` that only hands names on: no definition but the lazy
    ``__getattr__`` / ``__dir__``."""
    tree = ast.parse(path.read_text())
    return path.name == "__init__.py" and not any(
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.name not in ("__getattr__", "__dir__")
        for node in tree.body
    )


def _modules() -> set[str]:
    """Every module of the packages, as a repository path, faces and bundled data aside."""
    return {
        p.relative_to(REPO).as_posix()
        for package in PACKAGES
        for p in (REPO / package).rglob("*.py")
        if "checkpoints" not in p.parts and "__pycache__" not in p.parts and not _is_face(p)
    }


def _missing_paths(paths: list[str]) -> list[str]:
    return sorted(p for p in paths if not (REPO / p.rstrip("/")).exists())


def test_architecture_module_map_names_every_module():
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    named = [
        p
        for cell in _table_first_cells(text, "## Module map (who owns what)")
        for p in _named_paths(cell)
    ]
    assert not _missing_paths(named), (
        f"docs/ARCHITECTURE.md's module map names paths that do not exist: {_missing_paths(named)}"
    )
    covered = set(named)
    missing = sorted(m for m in _modules() if m not in covered)
    assert not missing, (
        f"docs/ARCHITECTURE.md's module map does not name {missing}: add each to a row's first cell"
    )


def test_readme_layout_names_every_package():
    text = (REPO / "README.md").read_text()
    named = [p for cell in _table_first_cells(text, "## Layout") for p in _named_paths(cell)]
    assert not _missing_paths(named), (
        f"README.md's layout table names paths that do not exist: {_missing_paths(named)}"
    )
    covered = {p.rstrip("/") for p in named}
    top = [
        p
        for p in (REPO / "jaxserve").iterdir()
        if (p.is_dir() and (p / "__init__.py").exists())
        or (p.suffix == ".py" and p.name != "__init__.py")
    ]
    missing = sorted(
        p.relative_to(REPO).as_posix() for p in top if p.relative_to(REPO).as_posix() not in covered
    )
    assert not missing, f"README.md's layout table does not name {missing}"


# ---- flags ---------------------------------------------------------------------------------------


def _options(parser: argparse.ArgumentParser, name: str, out: dict[str, set[str]]) -> None:
    """The options ``--help`` shows for ``name`` and each of its subcommands."""
    opts = out.setdefault(name, set())
    for action in parser._actions:  # argparse keeps no public list of its actions
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                _options(sub, f"{name} {sub_name}", out)
        elif action.help != argparse.SUPPRESS:
            opts.update(o for o in action.option_strings if o.startswith("--"))


@pytest.fixture(scope="module")
def help_options() -> dict[str, set[str]]:
    """Command ("serve", "bench serve", ...) -> its ``--help`` options."""
    out: dict[str, set[str]] = {}
    for name in COMMANDS:
        parser = build_parser([name])
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        _options(sub.choices[name], name, out)
    return out


def _command_on(line: str, commands: list[str]) -> list[str]:
    """The jaxserve commands a README line runs or names, longest first."""
    found = []
    for name in commands:
        if re.search(rf"(?<![\w-])(jaxserve |make ){re.escape(name)}(?![\w-])", line):
            found.append(name)
    return found


def test_readme_flags_are_in_their_commands_help(help_options):
    commands = sorted(help_options, key=len, reverse=True)  # "bench serve" before "serve"
    every = set().union(*help_options.values())
    lines = (REPO / "README.md").read_text().splitlines()
    foreign: set[str] = set()  # flags of other programs, from their command lines (pip, vllm)
    checks: list[tuple[int, str, set[str]]] = []  # (line number, flag, where it must be)
    in_code = in_flags_table = False
    continued: str | None = None  # the command of a code line ending with a backslash
    for number, line in enumerate(lines, start=1):
        if line.startswith("#"):
            in_flags_table = line == "## Flags"
        if line.startswith("```"):
            in_code = not in_code
            continue
        flags = set(FLAG.findall(line)) - {"--help"}
        code = in_code or line.startswith("    ")
        named = _command_on(line, commands)
        if code:
            command = named[0] if named else continued
            continued = command if line.rstrip().endswith("\\") else None
            if command is None:
                foreign |= flags
            else:
                checks += [(number, f, help_options[command]) for f in flags]
        elif in_flags_table and line.startswith("| `--"):
            cell = line.split("|")[1]
            checks += [(number, f, help_options["serve"]) for f in FLAG.findall(cell)]
        else:
            where = set().union(*(help_options[c] for c in named)) if named else every
            checks += [(number, f, where) for f in flags if f not in foreign]
    assert len(checks) > 50  # the README's flag table alone names more
    missing = [f"README.md:{n}: {f}" for n, f, where in checks if f not in where]
    assert not missing, f"flags named in the README but not in their command's --help: {missing}"
