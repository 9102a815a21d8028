"""kiln's error types and the exit codes they map to.

Every failure a user can cause or meet in production is one of these classes, so the CLI can turn
it into one line on stderr and a documented exit code, and library callers can catch by meaning
rather than by message. The table is part of kiln's interface: scripts and probes depend on it.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    INTERNAL = 1
    USAGE = 2  # usage or spec error
    INTEGRITY = 3  # digest, signature, unsafe archive
    NOT_FOUND = 4
    INCOMPATIBLE = 5  # environment differs in a factor that is part of torch's cache keys
    VERIFICATION = 6  # a cache miss or recompile


class KilnError(Exception):
    """Base class: an expected failure with a one-line message and an exit code."""

    exit_code: ExitCode = ExitCode.INTERNAL

    def __init__(self, message: str, *, detail: object | None = None) -> None:
        super().__init__(message)
        self.message = message
        # Machine-readable context for --json error output (e.g. the differing factors).
        self.detail = detail
        # True when the command already printed its JSON report: stdout must stay one document.
        self.reported = False


class UsageError(KilnError):
    exit_code = ExitCode.USAGE


class ParameterError(UsageError):
    """A bad argument to a library function, named as the function names it (``sha256``).

    The library does not know it is behind a command line; the CLI words the same error as its
    flag (:meth:`as_flag`: ``--sha256 'x': ...``), as click's ``BadParameter`` does.
    """

    def __init__(self, param: str, value: object, problem: str) -> None:
        super().__init__(f"{param}={value!r}: {problem}")
        self.param, self.value, self.problem = param, value, problem

    def as_flag(self) -> str:
        """The message with the parameter spelled as the CLI's flag (``torch_version`` ->
        ``--torch-version``): every such parameter has the flag of the same name."""
        return f"--{self.param.replace('_', '-')} {self.value!r}: {self.problem}"


class SpecError(UsageError):
    """A spec problem, located as ``file:line:col: path.to.key: message``."""

    def __init__(
        self,
        message: str,
        *,
        file: str | None = None,
        line: int | None = None,
        col: int | None = None,
        key: str | None = None,
    ) -> None:
        where = file or "<spec>"
        if line is not None:
            where += f":{line}:{col or 1}"
        text = f"{where}: {key}: {message}" if key else f"{where}: {message}"
        super().__init__(text)
        self.file, self.line, self.col, self.key = file, line, col, key


class IntegrityError(KilnError):
    exit_code = ExitCode.INTEGRITY


class NotAnArtifactError(IntegrityError):
    """A file that is no kiln artifact at all (a spec, a README, any other archive): said so,
    naming it, rather than called corrupt. Exit 3 like any archive kiln cannot trust."""


class NotFoundError(KilnError):
    exit_code = ExitCode.NOT_FOUND


class IncompatibleError(KilnError):
    exit_code = ExitCode.INCOMPATIBLE


class VerificationError(KilnError):
    exit_code = ExitCode.VERIFICATION
