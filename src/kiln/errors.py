"""kiln's error types and the exit codes they map to.

Every failure a user can cause or meet in production is one of these classes, so the CLI can turn
it into one line on stderr and a documented exit code, and library callers can catch by meaning
rather than by message. The table is part of kiln's interface: scripts and probes depend on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any


class ExitCode(IntEnum):
    OK = 0
    INTERNAL = 1
    USAGE = 2  # usage or spec error
    INTEGRITY = 3  # digest, signature, unsafe archive
    NOT_FOUND = 4
    INCOMPATIBLE = 5  # environment differs in a factor that is part of torch's cache keys
    VERIFICATION = 6  # a cache miss or recompile


class KilnError(Exception):
    """Base class: an expected failure with a one-line message and an exit code.

    A message that names the library's parameters is :class:`Worded`, so the CLI can say its
    flags instead (:func:`as_flags`).
    """

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


@dataclass(frozen=True)
class Param:
    """A library parameter named inside a message, with the value it was given (``shown``, as
    the message writes it) and, for a mapping parameter, the entry (``key``).

    The library speaks of its parameters (``weights['seq']=9``); the CLI words the same message
    with its flags (``--weight seq=9``, :meth:`as_flag`), as click's ``BadParameter`` does: the
    library never knows it is behind a command line.
    """

    name: str
    shown: str | None = None
    key: str | None = None

    def __str__(self) -> str:
        name = self.name if self.key is None else f"{self.name}[{self.key!r}]"
        return name if self.shown is None else f"{name}={self.shown}"

    def as_flag(self, flag: str) -> str:
        """This parameter as the option ``flag`` that sets it: ``--shard 0/2``, ``--weight seq``."""
        if self.key is None:
            return flag if self.shown is None else f"{flag} {self.shown}"
        return f"{flag} {self.key}" if self.shown is None else f"{flag} {self.key}={self.shown}"


def flag_of(name: str, flags: Mapping[str, str] | None = None) -> str:
    """The option that sets parameter ``name``: ``flags[name]`` where the CLI spells it
    otherwise, else the same name (``torch_version`` -> ``--torch-version``)."""
    return (flags or {}).get(name) or f"--{name.replace('_', '-')}"


class Worded(str):
    """Text that names library parameters: as a string, what a library caller reads (the
    parameter names); :meth:`as_flags`, the same text as the CLI words it (the flags).

    A plain ``str`` subclass, so everything that takes a message takes it; built from parts
    (text and :class:`Param`), a nested ``Worded`` keeping its own.
    """

    parts: tuple[str | Param, ...]

    def __new__(cls, *parts: str | Param) -> Worded:
        flat: list[str | Param] = []
        for part in parts:
            flat.extend(part.parts if isinstance(part, Worded) else (part,))
        text = super().__new__(cls, "".join(str(p) for p in flat))
        text.parts = tuple(flat)
        return text

    def removeprefix(self, prefix: str) -> str:
        """As ``str.removeprefix``, still worded when the prefix is plain text (a location
        that wrapping code strips before putting the message in its own)."""
        first = self.parts[0] if self.parts else ""
        if not self.startswith(prefix):
            return self
        if isinstance(first, str) and first.startswith(prefix):
            return Worded(first[len(prefix) :], *self.parts[1:])
        return super().removeprefix(prefix)  # the prefix cuts a parameter: plain text

    def as_flags(self, flags: Mapping[str, str] | None = None) -> str:
        return "".join(
            p.as_flag(flag_of(p.name, flags)) if isinstance(p, Param) else p for p in self.parts
        )


def as_flags(text: str, flags: Mapping[str, str] | None = None) -> str:
    """``text`` with its parameters worded as flags (plain text as it is)."""
    return text.as_flags(flags) if isinstance(text, Worded) else str(text)


class ParameterError(UsageError):
    """A bad argument to a library function, named as the function names it (``sha256='x': ...``).

    The CLI words the same error as its flag (``--sha256 'x': ...``): see :class:`Param`. The
    value is shown as its ``repr`` unless ``shown`` says how (``shard=0/2``); ``key`` names the
    entry of a mapping parameter (``weights['seq']=9``).
    """

    def __init__(
        self,
        param: str,
        value: object,
        problem: str,
        *,
        shown: str | None = None,
        key: str | None = None,
        detail: object | None = None,
    ) -> None:
        shown = repr(value) if shown is None else shown
        super().__init__(Worded(Param(param, shown, key), ": ", problem), detail=detail)
        self.param, self.value, self.problem = param, value, problem
        self.shown, self.key = shown, key

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its arguments (an Exception pickles its message alone).
        kwargs = {"shown": self.shown, "key": self.key, "detail": self.detail}
        return (_rebuild, (type(self), (self.param, self.value, self.problem), kwargs))

    def as_flag(self, flags: Mapping[str, str] | None = None) -> str:
        """The message with the parameter spelled as the CLI's flag."""
        return as_flags(self.message, flags)


def _rebuild(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return cls(*args, **kwargs)


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


class PackageLoadError(VerificationError):
    """A restored AOTInductor package's library is gone or damaged (missing, or dlopen refuses
    the file itself): the folder is no longer what was restored, so it cannot serve its buckets
    (exit 6, as a miss). ``problem`` is the message without its ``advice``; verify gives the
    folder's drift as the advice instead."""

    def __init__(self, problem: str, advice: str = "restore the artifact again") -> None:
        super().__init__(f"{problem}: {advice}")
        self.problem, self.advice = problem, advice

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its arguments (an Exception pickles its message alone).
        return (type(self), (self.problem, self.advice))
