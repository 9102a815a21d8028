"""What Dynamo said while a step ran: recompiles, graph breaks and the frames it traced; and
which kernels Inductor's autotuner benchmarked.

Torch's counters say *how many* graphs compiled; only its logs say *why* and *where*. kiln keeps
four of them, through logging handlers rather than by scraping stderr:

- recompiles (``torch._dynamo.guards.__recompiles``): the guard that failed, for verify's reasons;
- graph breaks (``torch._dynamo.symbolic_convert.__graph_breaks``): the file:line and torch's
  reason for each seam, and whether it depends on tensor data — the bake warns about those,
  since serving data may reach a frame after the break that the bake's inputs never did;
- frames (the "torchdynamo start compiling" debug line of ``torch._dynamo.convert_frame``): which
  code objects Dynamo traced, so a miss in ``torch_dynamo_resume_in_forward_at_42`` can be tied
  to the data-dependent break at line 42;
- kernels benchmarked (the "Benchmark all input configs for NAME" debug line of
  ``torch._inductor.runtime.triton_heuristics``, then one line per config): torch's metrics
  count the runs but name no kernel, and llm-default's every process benchmarking one kernel
  took a probe on the GPU to name (H100, 2026-12-06); a served process's line now names it.

The parsing is plain text work (:func:`parse_graph_break`) so that it is tested without torch.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.artifact.manifest import GraphBreak

_RECOMPILES = "torch._dynamo.guards.__recompiles"
_GRAPH_BREAKS = "torch._dynamo.symbolic_convert.__graph_breaks"
_CONVERT_FRAME = "torch._dynamo.convert_frame"
_FRAME_START = "torchdynamo start compiling"
_AUTOTUNER = "torch._inductor.runtime.triton_heuristics"
# CachingAutotuner.benchmark_all_configs's debug lines (torch 2.11 to 2.13): a header naming the
# kernel, then one line per config benchmarked.
_BENCHMARK_START = "Benchmark all input configs for %s, get:"
_BENCHMARK_CONFIG = "%s: %f, nreg %d, nspill %d, #shared-mem %s"

# Where each log stood (recompiles, graph breaks, frames, benchmarks): DynamoLog.mark().
Mark = tuple[int, int, int, int]

_WHERE = re.compile(r"in user code at (.+?:\d+)")
_REASON = re.compile(r"Graph Break Reason:\s*(.+)")
_GB_ID = re.compile(r"\b(?:gb|GB)(\d{4})\b")
_FIRST_LINE_LIMIT = 300
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")

# torch's graph-break registry (torch/_dynamo/graph_break_registry.json, 2.9+) ids whose break
# depends on tensor values, and the words older torch builds use for the same breaks.
DATA_DEPENDENT_IDS = frozenset(
    {"GB0018", "GB0033", "GB0034", "GB0035", "GB0036", "GB0037", "GB0109", "GB0124", "GB0170"}
    | {"GB0246"}
)
_DATA_DEPENDENT_WORDS = re.compile(
    r"data[- ]dependent|dynamic shape operator|Tensor\.item\(\)|\.tolist\(\)|unbacked",
    re.IGNORECASE,
)
RESUME_FRAME = re.compile(r"^torch_dynamo_resume_in_\w+?_at_(\d+)\b")


def parse_graph_break(message: str) -> GraphBreak | None:
    """One graph-break log message as a :class:`GraphBreak`, or None when it names no place.

    torch's message: "Graph break in user code at FILE:LINE", then "Graph Break Reason: …", a
    registry URL ending in ``gbNNNN.html`` (2.9+), and the user's stack.
    """
    where = _WHERE.search(message)
    if where is None:
        return None
    reason_match = _REASON.search(message)
    reason = reason_match.group(1).strip() if reason_match else ""
    if reason.startswith("Encountered graph break when attempting to trace"):
        # 2.10+ wraps the real reason: the first indented "Explanation" names it better.
        detail = re.search(r"\n\s*\n(.+?)\n\s*Explanation:\s*(.+)", message)
        if detail:
            reason = f"{detail.group(1).strip()}: {detail.group(2).strip()}"
    # Object addresses differ in every process: two bakes of one model must say the same thing.
    reason = _ADDRESS.sub("", reason)[:_FIRST_LINE_LIMIT] or "unknown reason"
    gb = _GB_ID.search(message)
    gb_id = f"GB{gb.group(1)}" if gb else None
    data_dependent = gb_id in DATA_DEPENDENT_IDS or bool(_DATA_DEPENDENT_WORDS.search(reason))
    return GraphBreak(
        where=where.group(1)[-_FIRST_LINE_LIMIT:],
        reason=reason,
        gb_id=gb_id,
        data_dependent=data_dependent,
    )


def merge_breaks(breaks: list[GraphBreak], limit: int) -> list[GraphBreak]:
    """One entry per (place, reason), the buckets that traced it united, in a stable order."""
    merged: dict[tuple[str, str], GraphBreak] = {}
    for b in breaks:
        key = (b.where, b.reason)
        seen = merged.get(key)
        if seen is None:
            merged[key] = b.model_copy(update={"buckets": list(b.buckets)})
        else:
            seen.buckets = list(dict.fromkeys([*seen.buckets, *b.buckets]))[:64]
    return sorted(merged.values(), key=lambda b: (not b.data_dependent, b.where, b.reason))[:limit]


@dataclass
class _Handler(logging.Handler):
    sink: list[logging.LogRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__(logging.DEBUG)

    def emit(self, record: logging.LogRecord) -> None:
        self.sink.append(record)

    __hash__ = logging.Handler.__hash__


class _DebugTap(logging.Filter):
    """On a logger set to DEBUG: hands each record below the level it printed at before to
    ``take`` (which keeps what kiln reads) and passes it no further, so that the rest of that
    logger's debug output does not bury the worker's log; records at that level go on.

    The tap runs inside torch's own calls (Inductor's autotuner logs mid-compile), so nothing it
    does may raise there: a record it cannot read is dropped. torch logs objects as well as
    format strings (``log.debug(config)``, whose ``__eq__`` raises against a string)."""

    def __init__(self, take: Callable[[logging.LogRecord], object], threshold: int) -> None:
        super().__init__()
        self.take, self.threshold = take, threshold

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= self.threshold:
            return True
        with contextlib.suppress(Exception):  # see the class docstring
            self.take(record)
        return False


def _tap(name: str, take: Callable[[logging.LogRecord], object]) -> None:
    """Turn logger ``name``'s DEBUG records on, for ``take`` alone (:class:`_DebugTap`)."""
    logger = logging.getLogger(name)
    tap = _DebugTap(take, logger.getEffectiveLevel())
    logger.setLevel(logging.DEBUG)
    logger.addFilter(tap)


class DynamoLog:
    """The four logs, collected for the whole process; :meth:`mark` and the ``since`` methods
    slice them per step."""

    def __init__(self) -> None:
        self._recompiles = _Handler()
        self._breaks = _Handler()
        self._frames: list[str] = []  # "NAME FILE:LINE" of each frame Dynamo started on
        self._benchmarks: list[list] = []  # [kernel name, configs benchmarked], in order

    def install(self) -> DynamoLog:
        """Turn the artifacts on (recompiles and graph breaks print to stderr as well, which the
        parent keeps in the worker's log)."""
        import torch

        torch._logging.set_logs(recompiles=True, graph_breaks=True)
        logging.getLogger(_RECOMPILES).addHandler(self._recompiles)
        logging.getLogger(_GRAPH_BREAKS).addHandler(self._breaks)
        _tap(_CONVERT_FRAME, self._take_frame_start)
        _tap(_AUTOTUNER, self._take_benchmark)
        return self

    def _take_frame_start(self, record: logging.LogRecord) -> None:
        """Read as it comes, inside the tap: what torch handed in is read where a failure to
        read it is dropped (:class:`_DebugTap`), not later in kiln's report."""
        args = record.args if isinstance(record.args, tuple) else ()
        if isinstance(record.msg, str) and record.msg.startswith(_FRAME_START) and len(args) >= 3:
            name, filename, line = args[:3]
            self._frames.append(f"{name} {filename}:{line}")

    def _take_benchmark(self, record: logging.LogRecord) -> None:
        """The autotuner's header names a kernel; each config line after it is one benchmark."""
        if not isinstance(record.msg, str):
            return
        args = record.args if isinstance(record.args, tuple) else ()
        if record.msg == _BENCHMARK_START and args:
            self._benchmarks.append([str(args[0])[:_FIRST_LINE_LIMIT], 0])
        elif record.msg == _BENCHMARK_CONFIG and self._benchmarks:
            self._benchmarks[-1][1] += 1

    def mark(self) -> Mark:
        return (
            len(self._recompiles.sink),
            len(self._breaks.sink),
            len(self._frames),
            len(self._benchmarks),
        )

    def benchmarked_since(self, mark: Mark) -> list[str]:
        """Each kernel whose launch configs were benchmarked: ``NAME (N configs)``."""
        return [f"{name} ({n} configs)" for name, n in self._benchmarks[mark[3] :]]

    def recompiles_since(self, mark: Mark) -> list[str]:
        return [r.getMessage() for r in self._recompiles.sink[mark[0] :]]

    def breaks_since(self, mark: Mark) -> list[GraphBreak]:
        parsed = (parse_graph_break(r.getMessage()) for r in self._breaks.sink[mark[1] :])
        return [b for b in parsed if b is not None]

    def frames_since(self, mark: Mark) -> list[str]:
        return list(dict.fromkeys(self._frames[mark[2] :]))
