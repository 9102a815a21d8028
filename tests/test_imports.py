"""kiln's own imports point one way (issue 28): no circle between its modules, and the torch-free
side loads nothing of the compiler side."""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

import pytest

import kiln
from tests.conftest import NO_TORCH, ROOT

SRC = ROOT / "src"


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The kiln modules ``path`` imports anywhere (inside functions too: a deferred import is
    still a dependency), except under ``if TYPE_CHECKING:``, which never runs."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def resolve(dotted: str) -> None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        if dotted and dotted != name:
            found.add(dotted)

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                for stmt in child.orelse:
                    visit(stmt)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    resolve(alias.name)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package
                    for _ in range(child.level - 1):
                        up = up.rpartition(".")[0]
                    base = f"{up}.{base}" if base else up
                for alias in child.names:  # `from kiln import bytecode` imports a module
                    resolve(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    files = {_module_name(p, src): p for p in src.rglob("*.py")}
    modules = set(files)
    return {name: _imports(path, name, modules) for name, path in files.items()}


def test_no_import_circle_between_kiln_modules() -> None:
    graph = import_graph()
    assert "kiln.artifact.restore" in graph and graph["kiln.compiler.launch"]  # read something
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as exc:
        pytest.fail(f"import circle: {' -> '.join(exc.args[1])}")


def _package(root: Path, **modules: str) -> Path:
    """A package ``kiln`` under ``root`` with these modules (name: source), for the finders."""
    pkg = root / "kiln"
    pkg.mkdir()
    for name, source in modules.items():
        (pkg / f"{name}.py").write_text(source)
    return pkg


def test_the_circle_finder_finds_a_circle(tmp_path: Path) -> None:
    """The check above can fail: two modules that import each other inside functions, and a
    relative import, are a circle; one under TYPE_CHECKING is not."""
    _package(
        tmp_path,
        __init__="",
        a="def f():\n    from kiln.b import g\n",
        b="def g():\n    from . import a\n",
        c="from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import kiln.a\n",
    )
    graph = import_graph(tmp_path)
    assert graph["kiln.a"] == {"kiln.b"} and graph["kiln.b"] == {"kiln.a"} and not graph["kiln.c"]
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(graph).prepare()


# What storage may import outside itself: errors, the chunk size, the extras' install hint.
STORAGE_MAY_IMPORT = {"kiln.errors", "kiln.files", "kiln.installs"}


def test_storage_knows_nothing_of_the_layers_above() -> None:
    """Storage moves bytes (as httpx transports do): kiln's bundles, manifests and attestations
    are mapped onto a registry above it (kiln.artifact.oci_layout and its neighbours)."""
    graph = import_graph()
    storage = {m for m in graph if m.startswith("kiln.artifact.storage")}
    assert "kiln.artifact.storage.oci" in storage  # read something
    above = {
        f"{module} imports {dep}"
        for module in storage
        for dep in graph[module] - storage - STORAGE_MAY_IMPORT
    }
    assert not above, sorted(above)


@pytest.mark.parametrize(
    ("module", "loaded"),
    [
        ("kiln.artifact.restore, kiln.artifact.archive", "[]"),
        # The CLI (kiln restore in an init container): the compiler package's init alone, for
        # its warning filter; every command that launches a worker imports that when it runs.
        ("kiln.cli", "['kiln.compiler']"),
    ],
)
def test_torch_free_entry_points_load_no_launch_code(module: str, loaded: str) -> None:
    """``import kiln.artifact.restore`` (the init container's path) runs ``kiln/__init__`` first,
    and the CLI imports every command group: neither may pull in the compiler side's modules,
    which would import torch the moment they are used."""
    code = (
        NO_TORCH + f"import {module}; "
        "print(sorted(m for m in sys.modules if m.startswith('kiln.compiler')))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == loaded


def test_public_names_load_on_first_use() -> None:
    assert sorted(kiln.__all__) == sorted([*kiln._HOMES, "__version__"])
    for name, home in kiln._HOMES.items():
        assert getattr(kiln, name) is getattr(sys.modules[home], name), name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        kiln.nope  # noqa: B018


def _from_imports(path: Path) -> list[tuple[int, str, str]]:
    """Every ``from kiln.x import name`` in ``path`` (in functions too), with its line."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        module = node.module if isinstance(node, ast.ImportFrom) and not node.level else None
        if module is not None and (module == "kiln" or module.startswith("kiln.")):
            found += [(node.lineno, module, alias.name) for alias in node.names]
    return found


def test_every_name_kiln_imports_from_itself_exists() -> None:
    """A name moved out of a module breaks every importer, even one that imports it only inside
    a function, or one merged from another branch: each must still be there."""
    import importlib

    missing = []
    for path in sorted(SRC.rglob("*.py")):
        for line, module, name in _from_imports(path):
            target = importlib.import_module(module)
            if not hasattr(target, name):
                try:
                    importlib.import_module(f"{module}.{name}")
                except ModuleNotFoundError:
                    missing.append(f"{path.relative_to(ROOT)}:{line}: {module}.{name}")
    assert not missing, "\n".join(missing)


def _bound_here(path: Path) -> tuple[set[str], set[str]]:
    """The names ``path`` defines at module level (def, class, assignment: under ``if`` and
    ``try`` too), and the names its ``__all__`` lists."""
    defined: set[str] = set()
    listed: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                defined.add(stmt.name)
            elif isinstance(stmt, ast.Assign | ast.AnnAssign | ast.AugAssign):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for target in targets:
                    defined.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
                if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                    listed.update(ast.literal_eval(stmt.value))  # type: ignore[arg-type]
            elif isinstance(stmt, ast.If | ast.Try):
                visit(stmt.body)
                visit(stmt.orelse)
                for handler in getattr(stmt, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(path.read_text(), str(path)).body)
    return defined, listed


def _kiln_module_paths() -> dict[str, Path]:
    return {_module_name(p, SRC): p for p in SRC.rglob("*.py")}


def _imported_from_elsewhere(roots: list[Path], modules: dict[str, Path]) -> list[str]:
    """Each ``from kiln.x import name`` where ``kiln.x`` neither defines ``name`` nor lists it
    in an ``__all__`` (a package's public API), but only imports it: the reader is sent to a
    module that is not the name's home."""
    bound = {name: _bound_here(path) for name, path in modules.items()}
    found = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            for line, module, name in _from_imports(path):
                if module not in bound or f"{module}.{name}" in modules:
                    continue  # not kiln's, or a submodule
                defined, listed = bound[module]
                if name not in defined | listed:
                    found.append(f"{path}:{line}: {module}.{name}")
    return found


def test_each_name_is_imported_from_its_home() -> None:
    """No re-export shims (issue 28): src, tests, scripts and examples import every kiln name
    from the module that defines it, or from a package's declared API (``__all__``)."""
    roots = [ROOT / d for d in ("src", "tests", "scripts", "examples")]
    found = _imported_from_elsewhere(roots, _kiln_module_paths())
    assert not found, "\n".join(found)


def test_the_shim_finder_finds_a_shim(tmp_path: Path) -> None:
    """The check above can fail: a name imported through a module that only imports it is
    found; one the module defines, or its package lists in ``__all__``, is not."""
    pkg = _package(
        tmp_path,
        __init__="from kiln.home import g\n__all__ = ['g']\n",
        home="def g(): ...\nif True:\n    H = 1\n",
        shim="from kiln.home import H, g\n",
        user=(
            "from kiln import g\nfrom kiln.home import H\n"
            "def f():\n    from kiln.shim import H, g\n"
        ),
    )
    modules = {_module_name(p, tmp_path): p for p in pkg.rglob("*.py")}
    found = _imported_from_elsewhere([pkg], modules)
    assert [f.rpartition(": ")[2] for f in found] == ["kiln.shim.H", "kiln.shim.g"]


def _private_imports(root: Path) -> list[str]:
    """Each ``from kiln.x import _name`` where ``kiln.x`` is another module: a private name is
    its module's own; what two modules share is public, in the module whose job it is."""
    found = []
    for path in sorted(root.rglob("*.py")):
        here = _module_name(path, root)
        for line, module, name in _from_imports(path):
            if name.startswith("_") and not name.startswith("__") and module != here:
                found.append(f"{path.relative_to(root)}:{line}: {module}.{name}")
    return found


def test_no_module_imports_another_s_private_names() -> None:
    found = _private_imports(SRC)
    assert not found, "\n".join(found)


def test_the_private_import_finder_finds_one(tmp_path: Path) -> None:
    _package(
        tmp_path,
        a="def _f(): ...\ndef g(): ...\n",
        b="from kiln.a import g\ndef h():\n    from kiln.a import _f\n",
    )
    assert _private_imports(tmp_path) == ["kiln/b.py:3: kiln.a._f"]


def _import_time_environment_reads(root: Path) -> list[str]:
    """Where a module reads the environment while it is imported: module and class bodies, and
    default values, which run at import; function bodies run when called. The ``cli`` fixture
    forks each command from a process that imported kiln before the call's environment was set
    (tests/cli_forks.py), which is only a fresh process's equal while this list is empty."""
    found = []

    def visit(node: ast.AST, path: Path) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                for default in (*child.args.defaults, *child.args.kw_defaults):
                    if default is not None:
                        visit(ast.Expression(default), path)
                for decorator in getattr(child, "decorator_list", []):
                    visit(ast.Expression(decorator), path)
                continue
            if isinstance(child, ast.Attribute) and child.attr in ("environ", "getenv", "environb"):
                found.append(f"{path.relative_to(root)}:{child.lineno}")
            visit(child, path)

    for path in sorted(root.rglob("*.py")):
        visit(ast.parse(path.read_text()), path)
    return found


def test_no_module_reads_the_environment_at_import() -> None:
    found = _import_time_environment_reads(SRC)
    assert not found, "\n".join(found)


def test_the_environment_read_finder_finds_them(tmp_path: Path) -> None:
    _package(
        tmp_path,
        a="import os\nHOME = os.environ.get('HOME')\ndef f():\n    return os.getenv('X')\n",
        b="import os\ndef g(x=os.getenv('Y')):\n    return x\nclass C:\n    z = os.environ\n",
    )
    assert _import_time_environment_reads(tmp_path) == ["kiln/a.py:2", "kiln/b.py:2", "kiln/b.py:5"]
