"""Traffic logs: the request shapes a server saw, for ``kiln plan`` and ``--traffic`` replays.

Two formats, told apart by the first character that is not blank:

- JSON lines: one object per line, ``{"batch": 3, "seq": 137}``, with an optional ``"count"``;
- CSV: a header row naming the axes (and an optional ``count`` column), then one row per shape.

Every axis of the spec must be given on every line; other keys or columns (a timestamp, a
route) are ignored, so a server's own log can be read as it is. A log comes from elsewhere, so
reading is bounded (size, line length, values, counts) and every problem is one line,
``LOG:LINE: message``, exit 2. Torch-free.
"""

from __future__ import annotations

import csv
import io
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import NotFoundError, UsageError
from kiln.spec import MAX_SIZE

MAX_TRAFFIC_BYTES = 1 << 30  # the file
MAX_LINE_BYTES = 1 << 16  # one line
MAX_COUNT = 1 << 40  # one line's count
COUNT = "count"


class TrafficError(UsageError):
    """A traffic log that cannot be read, located as ``LOG:LINE: message`` (exit 2)."""


@dataclass(frozen=True)
class Traffic:
    """Request shapes in log order: each line's sizes (in ``axes`` order) and its count."""

    axes: tuple[str, ...]
    lines: tuple[tuple[tuple[int, ...], int], ...]

    def counts(self) -> Counter[tuple[int, ...]]:
        """Requests per distinct shape."""
        out: Counter[tuple[int, ...]] = Counter()
        for sizes, count in self.lines:
            out[sizes] += count
        return out

    @property
    def requests(self) -> int:
        return sum(count for _, count in self.lines)

    def sizes(self, sizes: tuple[int, ...]) -> dict[str, int]:
        return dict(zip(self.axes, sizes, strict=True))


def read_traffic(path: str | Path, axes: Sequence[str]) -> Traffic:
    """Read ``path`` (JSON lines or CSV) for the axes ``axes``; see the module docstring."""
    p = Path(path)
    try:
        with open(p, "rb") as fh:
            data = fh.read(MAX_TRAFFIC_BYTES + 1)
    except FileNotFoundError:
        raise NotFoundError(f"{path}: no such traffic log") from None
    except OSError as exc:
        raise TrafficError(f"{path}: cannot read the traffic log: {exc.strerror or exc}") from None
    if len(data) > MAX_TRAFFIC_BYTES:
        raise TrafficError(f"{path}: larger than {MAX_TRAFFIC_BYTES} bytes")
    return parse_traffic(data, tuple(axes), str(path))


def parse_traffic(data: bytes, axes: tuple[str, ...], name: str = "<traffic>") -> Traffic:
    """A traffic log's bytes; every problem a :class:`TrafficError` naming ``name:LINE``."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise TrafficError(f"{name}:{line}: not UTF-8 text") from None
    lines = text.splitlines()
    for i, line in enumerate(lines, 1):
        if len(line.encode("utf-8", "surrogatepass")) > MAX_LINE_BYTES:
            raise TrafficError(f"{name}:{i}: a line longer than {MAX_LINE_BYTES} bytes")
    first = next((line.lstrip() for line in lines if line.strip()), "")
    if not first:
        raise TrafficError(f"{name}: no requests in the traffic log")
    reader = _json_lines if first.startswith("{") else _csv_rows
    out = tuple(reader(lines, axes, name))
    if not out:
        raise TrafficError(f"{name}: no requests in the traffic log")
    return Traffic(axes, out)


def _json_lines(lines: list[str], axes: tuple[str, ...], name: str):  # type: ignore[no-untyped-def]
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise TrafficError(f"{name}:{i}: not a JSON object ({_short(exc)})") from None
        if not isinstance(row, dict):
            raise TrafficError(f"{name}:{i}: not a JSON object")
        yield _entry(row, axes, f"{name}:{i}")


def _csv_rows(lines: list[str], axes: tuple[str, ...], name: str):  # type: ignore[no-untyped-def]
    rows = csv.reader(io.StringIO("\n".join(lines)), strict=True)
    header: list[str] | None = None
    try:
        for row in rows:
            i = rows.line_num
            if not any(cell.strip() for cell in row):
                continue
            if header is None:
                header = [cell.strip() for cell in row]
                missing = [a for a in axes if a not in header]
                if missing:
                    raise TrafficError(
                        f"{name}:{i}: the CSV header names no column for axis "
                        f"{', '.join(map(repr, missing))} (it has {', '.join(map(repr, header))})"
                    )
                if len(set(header)) != len(header):
                    raise TrafficError(f"{name}:{i}: the CSV header names a column twice")
                continue
            if len(row) != len(header):
                raise TrafficError(
                    f"{name}:{i}: {len(row)} values for the header's {len(header)} columns"
                )
            yield _entry(
                dict(zip(header, (c.strip() for c in row), strict=True)), axes, f"{name}:{i}"
            )
    except csv.Error as exc:
        raise TrafficError(f"{name}:{rows.line_num}: not CSV ({exc})") from None


def _entry(
    row: dict[str, object], axes: tuple[str, ...], where: str
) -> tuple[tuple[int, ...], int]:
    sizes = []
    for axis in axes:
        if axis not in row:
            raise TrafficError(f"{where}: no value for axis {axis!r}")
        sizes.append(_number(row[axis], axis, where, MAX_SIZE))
    count = _number(row[COUNT], COUNT, where, MAX_COUNT) if COUNT in row else 1
    return tuple(sizes), count


def _number(value: object, key: str, where: str, most: int) -> int:
    """A whole number 1..most, as JSON or a CSV cell writes it."""
    number: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 20:
        number = int(value)
    if number is None or not 1 <= number <= most:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:40] + "…"
        raise TrafficError(f"{where}: {key} is {shown}: a whole number from 1 to {most}")
    return number


def _short(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
