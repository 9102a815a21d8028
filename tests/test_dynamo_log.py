"""What torch logs while a step runs, kept by kiln (kiln.compiler.dynamo_log): here, which
kernels Inductor's autotuner benchmarked, so that a served process's miss names them."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.compiler import dynamo_log
from kiln.compiler.dynamo_log import DynamoLog

_LOGGERS = (dynamo_log._CONVERT_FRAME, dynamo_log._AUTOTUNER)


@pytest.fixture
def installed() -> Iterator[DynamoLog]:
    """A DynamoLog installed as a served process installs it; this process's logging as it was
    afterwards (the xdist worker runs other tests)."""
    import torch

    before = {name: logging.getLogger(name).level for name in _LOGGERS}
    log = DynamoLog().install()
    yield log
    for name, level in before.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        for f in list(logger.filters):
            logger.removeFilter(f)
    torch._logging.set_logs()


class _Seen(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_the_autotuners_benchmarks_are_named_and_not_printed(installed) -> None:
    """The autotuner's own debug lines name the kernel, then one line per config; kiln keeps
    them per step and passes none of them on to a handler, while the logger's warnings pass."""
    mark = installed.mark()
    autotuner = logging.getLogger(dynamo_log._AUTOTUNER)
    seen = _Seen()  # what reaches handlers: the logger's filters have run
    autotuner.addHandler(seen)
    autotuner.debug(dynamo_log._BENCHMARK_START, "triton_red_fused_mean_6")
    for r0 in (1024, 512):
        config = f"XBLOCK: 2, R0_BLOCK: {r0}, num_warps: 8"
        autotuner.debug(dynamo_log._BENCHMARK_CONFIG, config, 0.093, 40, 0, 0)
    autotuner.debug("Triton cache dir: %s", "/elsewhere")
    autotuner.warning("a warning of the autotuner")
    assert installed.benchmarked_since(mark) == ["triton_red_fused_mean_6 (2 configs)"]
    assert installed.benchmarked_since(installed.mark()) == []
    autotuner.removeHandler(seen)
    assert seen.messages == ["a warning of the autotuner"]


class _Config:
    """Like triton.Config, which Inductor logs as a record's message (``log.debug(c)``): its
    ``__eq__`` fails against anything but a Config."""

    def __eq__(self, other: object) -> bool:
        return other.all_kwargs() == {}  # type: ignore[attr-defined]

    __hash__ = object.__hash__


def test_a_record_kiln_cannot_read_never_fails_torchs_call(installed) -> None:
    """Both taps see every debug record of their logger, objects included; one they cannot read
    is dropped (an exception there was an InductorError in the middle of a GPU bake)."""
    mark = installed.mark()
    for name in _LOGGERS:
        logging.getLogger(name).debug(_Config())
    autotuner = logging.getLogger(dynamo_log._AUTOTUNER)
    autotuner.debug(dynamo_log._BENCHMARK_START, "triton_poi_fused_0")
    autotuner.debug(_Config())
    assert installed.benchmarked_since(mark) == ["triton_poi_fused_0 (0 configs)"]
    assert installed.frames_since(mark) == []


class _Hostile:
    """An object every comparison or string conversion of which raises."""

    def __eq__(self, other: object) -> bool:
        raise RuntimeError("eq")

    def __str__(self) -> str:
        raise RuntimeError("str")

    __hash__ = object.__hash__


_MESSAGES = st.one_of(
    st.sampled_from([dynamo_log._BENCHMARK_START, dynamo_log._BENCHMARK_CONFIG]),
    st.sampled_from([dynamo_log._FRAME_START]).map(lambda m: m + " %s %s %s"),
    st.text(max_size=40),
    st.builds(_Hostile),
    st.builds(_Config),
    st.none(),
    st.integers(),
)
_ARGS = st.one_of(
    st.none(),
    st.lists(st.one_of(st.text(max_size=20), st.integers(), st.builds(_Hostile)), max_size=6).map(
        tuple
    ),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(records=st.lists(st.tuples(_MESSAGES, _ARGS, st.sampled_from([10, 20, 30])), max_size=8))
def test_any_record_passes_through_both_taps_without_raising(records) -> None:
    """Whatever torch logs, as whatever message and arguments, a tap returns whether to pass the
    record on (debug records never, the rest always) and never raises into torch's call."""
    log = DynamoLog()
    taps = [
        dynamo_log._DebugTap(take, logging.INFO)
        for take in (log._take_frame_start, log._take_benchmark)
    ]
    for msg, args, level in records:
        record = logging.LogRecord("torch", level, __file__, 1, msg, None, None)
        record.args = args  # as logging keeps them, a tuple or one mapping
        for tap in taps:
            assert tap.filter(record) is (level >= logging.INFO)
    mark = (0, 0, 0, 0)
    assert all(isinstance(name, str) for name in log.benchmarked_since(mark))
    assert all(isinstance(frame, str) for frame in log.frames_since(mark))


def test_the_lines_kiln_reads_are_the_installed_torchs() -> None:
    """The two messages kiln keys on, as this torch's autotuner words them (2.11 printed on the
    H100 says the same): a torch that rewords them fails here, not silently in a pod."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    source = inspect.getsource(CachingAutotuner.benchmark_all_configs)
    assert f'"{dynamo_log._BENCHMARK_START}", self.fn.__name__' in source
    assert f'"{dynamo_log._BENCHMARK_CONFIG}"' in source
