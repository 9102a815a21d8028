"""kiln.bytecode: a serving image that compiles torch's Python at every start is named, with the
command that fixes it (a real package on disk, compiled for real by compileall)."""

from __future__ import annotations

import compileall
import subprocess
import sys
from pathlib import Path

from kiln.bytecode import uncached_reason

CHECK = "import sys; from kiln.bytecode import uncached_reason; print(uncached_reason(sys.argv[1]))"


def _package(root: Path, name: str) -> Path:
    pkg = root / name
    (pkg / "_inductor").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_inductor" / "__init__.py").write_text("")
    (pkg / "_inductor" / "compile_fx.py").write_text("X = 1\n")
    return pkg


def _check(root: Path, name: str, *flags: str) -> str:
    """The check in a fresh interpreter (sys.path and the bytecode flag as a server has them)."""
    env = {"PYTHONPATH": f"{root}:{Path(__file__).parents[1] / 'src'}"}
    proc = subprocess.run(
        [sys.executable, *flags, "-c", CHECK, name], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_uncached_bytecode_is_named_with_the_fix(tmp_path: Path) -> None:
    pkg = _package(tmp_path, "fakepkg_uncached")
    said = _check(tmp_path, "fakepkg_uncached", "-B")
    assert "fakepkg_uncached's Python bytecode is not cached here" in said
    assert "PYTHONDONTWRITEBYTECODE is set" in said
    assert f"python -m compileall -q {pkg}" in said
    assert compileall.compile_dir(pkg, quiet=1)
    assert _check(tmp_path, "fakepkg_uncached", "-B") == "None"


def test_installed_torch_and_missing_packages() -> None:
    assert uncached_reason("no_such_package_kiln") is None
    # This venv's torch came from pip, which compiles bytecode at install.
    assert uncached_reason("torch") is None
