"""What this install holds, and how to add what a command lacks, worded for that install.

kiln installs two ways: with torch (``pip install torch-kiln``) and without it
(``scripts/install-restore.sh``, the ``kiln:restore`` image), where restore, inspect, push,
merge, bundle and sign run. Advice has to fit the install it is printed in: in a torch-free one,
``pip install 'torch-kiln[sign]'`` would pull torch in, and a command that needs torch must say
so in one line (exit 2) rather than die on ``import torch``. Torch-free.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from kiln.errors import UsageError

RESTORE_INSTALL = "scripts/install-restore.sh"


def has_torch() -> bool:
    """Whether ``import torch`` can succeed here, without importing it."""
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):  # a broken or stubbed-out entry in sys.modules
        return False


# torch/version.py's names for kiln.factors.BUILD_FACTORS.
_VERSION_NAMES = {"__version__": "torch.version", "git_version": "torch.git", "cuda": "torch.cuda"}


def torch_build() -> dict[str, str | None] | None:
    """The installed torch build as a fingerprint names it (:data:`kiln.factors.BUILD_FACTORS`),
    read from ``torch/version.py`` without importing torch; None when torch is not installed or
    the file does not say. Parsed, never run: a served process asks this before it trusts
    anything to run, and importing torch takes seconds on an image without bytecode."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    try:
        tree = ast.parse(Path(spec.origin).with_name("version.py").read_bytes())
    except (OSError, SyntaxError, ValueError):
        return None
    return _version_constants(tree)


def _version_constants(tree: ast.Module) -> dict[str, str | None] | None:
    """The three names of ``torch/version.py``, when each is bound exactly once, at the top
    level, to a string or None; else None (a value computed, rebound or imported is not read
    as a build: the caller then waits for torch's own answer)."""
    found: dict[str, str | None] = {}
    bindings = {name: 0 for name in _VERSION_NAMES}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
            names = [node.id]
        elif isinstance(node, ast.alias):
            names = [node.asname or node.name.split(".")[0]]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names = [node.name]
        elif isinstance(node, ast.Global | ast.Nonlocal):
            names = list(node.names)
        else:
            continue
        for name in names:
            if name in bindings:
                bindings[name] += 1
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        else:
            continue
        if not (isinstance(target, ast.Name) and target.id in _VERSION_NAMES):
            continue
        if isinstance(value, ast.Constant) and isinstance(value.value, str | None):
            found[_VERSION_NAMES[target.id]] = value.value
    if any(count != 1 for count in bindings.values()) or len(found) != len(_VERSION_NAMES):
        return None
    return found


def extra_hint(extra: str) -> str:
    """How to add the optional dependencies ``extra`` names, in this kind of install."""
    if has_torch():
        return f"pip install 'torch-kiln[{extra}]'"
    return (
        f"KILN_EXTRAS={extra} {RESTORE_INSTALL} PYTHON torch-kiln "
        f"(pip install 'torch-kiln[{extra}]' would pull in torch)"
    )


def require_torch(command: str) -> None:
    """Exit 2, in one line, when ``kiln COMMAND`` runs in an install without torch."""
    if not has_torch():
        raise UsageError(
            f"kiln {command} needs torch, and this install has none (a torch-free install, "
            f"as {RESTORE_INSTALL} makes, runs restore, inspect, push, merge, bundle and sign): "
            "install your torch build, then pip install torch-kiln; "
            "or run it in the kiln:bake image"
        )
