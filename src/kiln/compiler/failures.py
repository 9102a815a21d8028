"""What a worker pass fails with: the spec's problem at a key (exit 2), or what was baked being
unusable here (exit 5); a restored package that no longer loads is
:class:`kiln.errors.PackageLoadError` (exit 6). The worker's ``main`` (and replay's) turns each
into its :class:`~kiln.compiler.protocol.WorkerFailure` kind; the parent words the spec's at its
``file:line:col``. Torch-free.
"""

from __future__ import annotations


class Incompatible(Exception):
    """This process cannot use what was baked (exit 5, as ``kiln check`` would say)."""


class SpecProblem(Exception):
    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


def one_line(exc: BaseException, limit: int = 300) -> str:
    """torch's messages can run to pages (every option name, a C++ trace): the first line."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"
