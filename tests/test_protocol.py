"""The worker protocol, its events and counters, the serving module's compile arguments, and
progress as a piped log shows it (issue 16; issue 17 item 4)."""

from __future__ import annotations

import ast
import dataclasses
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError
from rich.console import Console

import kiln
from kiln.artifact.manifest import (
    MAX_TUNED,
    NEW_FILES_SAMPLE,
    Aoti,
    BucketStats,
    CompileCounts,
)
from kiln.cli.output import Output
from kiln.compiler.bench import ALL_MODES, EXTRA_MODES, MODES
from kiln.compiler.counters import CompileCounters, compile_counts
from kiln.compiler.process import (
    HEARTBEAT_S,
    LOG_TAIL,
    WorkerError,
    failure_error,
    heartbeat_interval,
    relay_events,
)
from kiln.compiler.protocol import WorkerFailure, WorkerOutcome, WorkerRequest
from kiln.errors import ExitCode, IncompatibleError, SpecError, UsageError
from kiln.events import (
    WORKER_EVENTS,
    BucketDone,
    BucketStarted,
    FirstPassDone,
    Heartbeat,
    ModeStarted,
    WorkerStarted,
)
from kiln.serving import (
    COMPILE_DEFAULTS,
    GPU_COMPILE_DEFAULTS,
    compile_env,
    served_torch_kwargs,
    torch_kwargs,
    with_compile_threads,
    worker_env,
)
from kiln.spec import load_spec
from tests.archives import manifest_for
from tests.conftest import ROOT, mlp_spec


# --- the request, the outcome ------------------------------------------------------------------
def test_worker_request_is_typed_and_always_carries_the_compile_arguments() -> None:
    with pytest.raises(ValidationError, match="torch_kwargs"):
        WorkerRequest(order=["batch=2"])  # type: ignore[call-arg]  # no default: the caller decides
    eager = WorkerRequest(order=["batch=2"], torch_kwargs=None)
    assert eager.calls == 2 and eager.cache_root is None
    with pytest.raises(ValidationError, match="extra"):
        WorkerRequest.model_validate({"order": [], "torch_kwargs": None, "compile": False})
    with pytest.raises(ValidationError, match="need torch_kwargs"):
        eager.replace(precompile_load="/x/precompiled.bin")
    with pytest.raises(ValidationError):
        eager.replace(calls=0)  # replace() validates; model_copy(update=...) would not
    compiled = eager.replace(torch_kwargs={"backend": "inductor"}, precompile_save="/x/p.bin")
    assert WorkerRequest.model_validate_json(compiled.model_dump_json()) == compiled
    # The packages a bake's serving-imports pass serves describe its folder, and need one.
    packages = Aoti(device="cpu", weights="external", on_miss="eager", inputs=[], programs=[])
    with pytest.raises(ValidationError, match="aoti_packages describes aoti_load's folder"):
        eager.replace(aoti_packages=[packages])
    served = eager.replace(aoti_load="/work", aoti_packages=[packages])
    assert WorkerRequest.model_validate_json(served.model_dump_json()) == served


def test_the_spec_crosses_the_process_boundary_by_value(tmp_path: Path, write_spec) -> None:
    """Issue 28: the worker gets the parent's validated spec, not a path to parse again: an
    edit to the file after the bake started changes nothing, and the factory file is still
    found next to where the spec was."""
    (tmp_path / "models.py").write_text((ROOT / "examples" / "models.py").read_text())
    text = mlp_spec().replace(str(ROOT / "examples" / "models.py"), "models.py")
    spec = load_spec(write_spec(text))
    request = WorkerRequest(order=["batch=2"], torch_kwargs=None).replace(
        spec=spec.canonical(), spec_base=str(spec.base_dir)
    )
    (tmp_path / "spec.yaml").write_text(text.replace("hidden: 32", "hidden: 64"))
    sent = WorkerRequest.model_validate_json(request.model_dump_json()).load_spec()
    assert sent.sha256() == spec.sha256() and sent.model.kwargs["hidden"] == 32
    assert sent.factory_origin() == tmp_path / "models.py"
    with pytest.raises(ValueError, match="without a spec"):
        WorkerRequest(order=[], torch_kwargs=None).load_spec()
    bad = request.spec | {"buckets": {"batch": []}}
    with pytest.raises(ValidationError):  # validated again on the worker's side
        request.replace(spec=bad).load_spec()


def test_worker_outcome_holds_a_result_or_a_failure() -> None:
    failure = WorkerFailure(kind="spec", key="model.kwargs", message="bad")
    back = WorkerOutcome.model_validate_json(WorkerOutcome(failure=failure).model_dump_json())
    assert back.failure == failure and back.result is None
    with pytest.raises(ValidationError, match="a result or a failure"):
        WorkerOutcome()
    with pytest.raises(ValidationError):
        WorkerFailure(kind="oops", message="x")  # type: ignore[arg-type]


def test_a_worker_failure_becomes_kiln_s_error_for_it(write_spec) -> None:
    """One mapping for the grid worker and replay's process (kiln.compiler.process): the spec's
    failure at its key (exit 2), an incompatibility (exit 5), anything else exit 1 with the
    last LOG_TAIL lines of the worker's log."""
    spec = load_spec(write_spec(mlp_spec()))
    log = "\n".join(f"line {i}" for i in range(40))
    at_key = failure_error(spec, WorkerFailure(kind="spec", key="model.kwargs", message="bad"), log)
    assert isinstance(at_key, SpecError) and at_key.exit_code == ExitCode.USAGE
    assert str(at_key).startswith(f"{spec.path}:4:") and "bad" in str(at_key)
    other = failure_error(spec, WorkerFailure(kind="incompatible", message="no GPU"), log)
    assert isinstance(other, IncompatibleError) and str(other) == "no GPU"
    crash = failure_error(spec, WorkerFailure(kind="internal", message="boom"), log)
    assert isinstance(crash, WorkerError) and crash.exit_code == ExitCode.INTERNAL
    assert str(crash).splitlines() == ["boom", *(f"line {i}" for i in range(40 - LOG_TAIL, 40))]


# --- counters ------------------------------------------------------------------------------------
def test_compile_counters_subtract() -> None:
    after = CompileCounters(fx_misses=3, fx_bypass=1, gemm_autotunes=4, compile_s=2.5)
    before = CompileCounters(fx_misses=1, compile_s=0.5)
    diff = after - before
    assert diff == CompileCounters(fx_misses=2, fx_bypass=1, gemm_autotunes=4, compile_s=2.0)
    assert diff.graphs_compiled == 3


def test_compile_counters_read_torch_own_counters() -> None:
    """:meth:`CompileCounters.read` reads each field from the counter torch bumps for it."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    bumps = {
        ("inductor", "fxgraph_cache_miss"): 2,
        ("aot_autograd", "autograd_cache_hit"): 1,
        ("aot_autograd", "total"): 2,
        ("aot_autograd", "ok"): 1,
        ("inductor", "async_compile_cache_miss"): 4,
        ("graph_break", "a reason"): 3,
    }
    timings = {"_compile.compile_inner": 1.5, "CachingAutotuner.benchmark_all_configs": 0.25}
    before = CompileCounters.read()
    for (group, name), n in bumps.items():
        counters[group][name] += n
    for name, seconds in timings.items():
        compilation_time_metrics.setdefault(name, []).append(seconds)
    try:
        diff = CompileCounters.read() - before
    finally:  # this process's counters as they were: other tests read them too
        for (group, name), n in bumps.items():
            counters[group][name] -= n
        for name in timings:
            compilation_time_metrics[name].pop()
    assert diff == CompileCounters(
        fx_misses=2,
        aot_hits=1,
        aot_runs=2,
        aot_finished=1,
        kernel_loads=4,
        graph_breaks=3,
        compile_s=1.5,
        kernel_tunings=1,
    )
    assert CompileCounters.read() == before


def test_bucket_compiles_count_what_a_step_built() -> None:
    new = {
        "fxgraph/ab/entry",
        "triton/0/A/k1.cubin",
        "triton/0/B/k2.cubin",
        "xy/cxy.so",
        "ab/k1.best_config",
    }
    # An FX hit replays the GEMM autotunes its compile recorded: not counted without a compile.
    hit = compile_counts(CompileCounters(fx_hits=1, gemm_autotunes=5, bundled_kernels=2), new)
    assert (hit.new_native, hit.autotunes) == (1, 1)  # 3 binaries, 2 bundled; 1 .best_config
    assert hit.new_files == sorted(new - {"fxgraph/ab/entry"})
    miss = compile_counts(
        CompileCounters(fx_misses=1, gemm_autotunes=5, coordesc_benchmarks=2),
        set(),
        recompile_reasons=["size mismatch"],
        precompile_misses=1,
    )
    assert miss.autotunes == 7
    both = hit + miss
    assert both.recompile_reasons == ["size mismatch"] and both.precompile_misses == 1
    stats = BucketStats(
        key="batch=2", sizes={"batch": 2}, first_call_s=1, steady_s=0.1, **both.counts()
    )
    assert stats.compiles == 1 + 1 + 8 + 1  # FX miss, binary, autotunes, precompile miss
    many = CompileCounts(new_files=[f"{i}.so" for i in range(10)])
    assert len((many + many).new_files) == NEW_FILES_SAMPLE
    # Kernels benchmarked are named where a served process benchmarked them (a miss), kept to
    # MAX_TUNED however many steps add up; a bake pass tunes by design and names none.
    tuned = [f"triton_red_{i} (2 configs)" for i in range(MAX_TUNED)]
    served = compile_counts(
        CompileCounters(kernel_tunings=1), set(), served=True, benchmarked=tuned
    )
    assert served.tuned_kernels == tuned and (served + served).tuned_kernels == tuned
    assert compile_counts(CompileCounters(), set(), benchmarked=tuned).tuned_kernels == []


def test_counts_named_alike_are_carried_as_measured() -> None:
    """Every count the manifest's CompileCounts shares by name with CompileCounters is the
    measured difference itself (one name, one meaning, on both sides of the process boundary)."""
    fields = dataclasses.fields(CompileCounters)
    diff = CompileCounters(**{f.name: i + 1 for i, f in enumerate(fields)})
    restarts = diff.aot_bypass + 2  # two abandoned lookups beyond the step's bypasses
    diff = dataclasses.replace(diff, aot_runs=diff.aot_finished + diff.aot_failed + restarts)
    assert 0 < diff.aot_compiles < diff.aot_misses
    counts = compile_counts(diff, set())
    shared = {f.name for f in fields} & set(CompileCounts.model_fields)
    assert shared >= {"fx_hits", "fx_misses", "aot_misses", "kernel_loads", "compile_s"}
    # but AOT misses, which count the lookups AOTAutograd went on to compile (next test)
    carried = shared - {"aot_misses", "aot_restarts"}
    assert {n: getattr(counts, n) for n in carried} == {n: getattr(diff, n) for n in carried}
    assert counts.aot_misses == diff.aot_compiles


def test_an_aot_lookup_a_dynamo_restart_abandoned_is_no_compile() -> None:
    """``dynamic=True``: Dynamo traces a graph with symbolic floats, AOTAutograd looks it up
    (a miss: that graph is never finished, so never saved), then the scalars are specialized
    and the frame traced again, which hits. torch counts the run started, neither finished nor
    failed; a served process that only did that compiled nothing."""
    restarted = CompileCounters(aot_misses=1, aot_hits=1, fx_hits=1, aot_runs=2, aot_finished=1)
    assert restarted.aot_compiles == 0
    served = compile_counts(restarted, set(), served=True)
    assert served.compiles == 0 and served.aot_restarts == 1  # where the first call's time went
    # The same restart in a cold process, whose second trace missed and compiled for real.
    cold = CompileCounters(aot_misses=2, fx_misses=1, aot_runs=2, aot_finished=1)
    assert compile_counts(cold, set()).aot_misses == 1
    # A failed run (not_ok) is no restart: its miss stays a miss; so does one without a run.
    failed = CompileCounters(aot_misses=1, aot_runs=1, aot_failed=1)
    assert failed.aot_compiles == 1 and CompileCounters(aot_misses=1).aot_compiles == 1
    # An abandoned lookup that bypassed the cache: the step's one miss is another graph's.
    bypassed = CompileCounters(aot_misses=1, aot_bypass=1, aot_runs=2, aot_finished=1)
    assert bypassed.aot_compiles == 1


# --- events --------------------------------------------------------------------------------------
def test_events_cross_the_process_boundary_typed() -> None:
    for event in (
        WorkerStarted(buckets=3, torch_import_s=1.5),
        BucketStarted(phase="first", index=0, key="batch=2"),
        BucketDone(phase="warm", index=2, key="batch=5", seconds=0.01),
        FirstPassDone(),
    ):
        assert WORKER_EVENTS.validate_json(event.model_dump_json()) == event
    assert ModeStarted(mode="kiln", run=2, runs=3).label == "kiln 2/3"
    assert ModeStarted(mode="bake").label == "bake"


def test_launch_relays_events_and_sends_heartbeats_while_the_worker_is_silent() -> None:
    """A real child that starts a bucket, stays silent, prints a non-event, then finishes it."""
    started = BucketStarted(phase="first", index=0, key="batch=2").model_dump_json()
    done = BucketDone(phase="first", index=0, key="batch=2", seconds=0.6).model_dump_json()
    child = (
        "import sys, time\n"
        f"print({started!r}, flush=True)\n"
        "time.sleep(0.7)\n"
        "print('{a model that prints json-ish text', flush=True)\n"
        f"print({done!r}, flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    events: list[object] = []
    with proc.stdout:
        relay_events(proc.stdout, events.append, heartbeat_s=0.2)
    assert proc.wait() == 0
    relayed = [e for e in events if not isinstance(e, Heartbeat)]
    assert relayed == [  # the line that is no event is skipped
        BucketStarted(phase="first", index=0, key="batch=2"),
        BucketDone(phase="first", index=0, key="batch=2", seconds=0.6),
    ]
    # (A child slow to start on a loaded machine may add start-up beats before the bucket.)
    beats = events[events.index(relayed[0]) + 1 : events.index(relayed[1])]
    assert len(beats) >= 2 and {b.what for b in beats} == {"batch=2: first call"}
    assert beats[-1].elapsed_s >= 0.5


def test_heartbeat_interval_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KILN_HEARTBEAT_S", raising=False)
    assert heartbeat_interval() == HEARTBEAT_S == 15
    monkeypatch.setenv("KILN_HEARTBEAT_S", "2.5")
    assert heartbeat_interval() == 2.5
    monkeypatch.setenv("KILN_HEARTBEAT_S", "0")
    assert heartbeat_interval() is None  # off
    for bad in ("soon", "-1", "nan", "inf"):
        monkeypatch.setenv("KILN_HEARTBEAT_S", bad)
        with pytest.raises(UsageError, match="KILN_HEARTBEAT_S"):
            heartbeat_interval()


def test_piped_progress_names_the_bucket_and_the_bench_mode() -> None:
    out = Output()
    stream = io.StringIO()
    out.err = Console(file=stream, emoji=False, width=200)  # not a terminal: plain lines
    with out.progress() as sink:
        sink(ModeStarted(mode="kiln", run=2, runs=3))
        sink(WorkerStarted(buckets=2))
        sink(BucketStarted(phase="first", index=0, key="batch=2"))
        sink(Heartbeat(what="batch=2: first call", elapsed_s=15.2))
        sink(BucketDone(phase="first", index=0, key="batch=2", seconds=0.5))
        sink(BucketStarted(phase="warm", index=0, key="batch=2"))
        sink({"event": "fetched", "bytes": 1, "total": 2})  # restore's dicts still draw
    assert stream.getvalue().splitlines() == [
        "bench: kiln 2/3",
        "  kiln 2/3 · batch=2: start (1/2)",
        "  kiln 2/3 · still running: batch=2: first call (15 s)",
        "  kiln 2/3 · batch=2: first call 0.50s",
    ]


# --- bench validates its own modes ----------------------------------------------------------------
def test_bench_refuses_unknown_modes_before_any_work(tmp_path: Path) -> None:
    assert (*MODES, *EXTRA_MODES) == ALL_MODES
    missing = tmp_path / "no-such-spec.yaml"  # never read: the modes are checked first
    with pytest.raises(UsageError, match=r"unknown bench mode\(s\): warp \(known: eager") as info:
        kiln.bench(missing, modes=("kiln", "warp"))
    assert info.value.exit_code == ExitCode.USAGE


# --- the serving module ---------------------------------------------------------------------------
def test_worker_env_runs_this_kiln_without_inherited_cache_locations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")
    monkeypatch.setenv("TORCHINDUCTOR_REMOTE_CACHE_URL", "redis://x")
    env = worker_env({"TRITON_HOME": "/mine"})
    assert "TORCHINDUCTOR_CACHE_DIR" not in env and "TORCHINDUCTOR_REMOTE_CACHE_URL" not in env
    assert env["TRITON_HOME"] == "/mine"
    first = Path(env["PYTHONPATH"].split(os.pathsep)[0])
    assert (first / "kiln" / "__init__.py").resolve() == Path(kiln.__file__).resolve()


def test_compile_env_pins_the_job_id_where_shapes_may_be_dynamic(write_spec) -> None:
    static = load_spec(write_spec(mlp_spec()))
    assert compile_env(static) == COMPILE_DEFAULTS
    dynamic = load_spec(write_spec(mlp_spec("dyn", dynamic="null"), "d.yaml"))
    assert compile_env(dynamic) == COMPILE_DEFAULTS | {"TORCH_COMPILE_JOB_ID": "kiln-dyn"}
    own = load_spec(write_spec(mlp_spec(dynamic="true") + "env: {TORCH_COMPILE_JOB_ID: x}\n"))
    assert compile_env(own) == COMPILE_DEFAULTS | {"TORCH_COMPILE_JOB_ID": "x"}
    # A spec's own value of a default stands.
    pch = "env: {TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS: '1'}\n"
    mine = load_spec(write_spec(mlp_spec() + pch, "p.yaml"))
    assert compile_env(mine) == {"TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "1"}
    # A GPU spec adds the GPU defaults (their reason: kiln.serving); its own value stands too.
    gpu_text = mlp_spec("g").replace("  call_kwargs:", "  device: cuda\n  call_kwargs:")
    gpu = load_spec(write_spec(gpu_text, "g.yaml"))
    assert compile_env(gpu) == COMPILE_DEFAULTS | GPU_COMPILE_DEFAULTS
    scaled = load_spec(write_spec(gpu_text + "env: {TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK: '1'}\n"))
    assert compile_env(scaled)["TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK"] == "1"


def test_activate_sets_each_compile_default_on_an_imported_config() -> None:
    """The compile defaults are in Inductor's FX key and torch reads them once, at import: a
    server that imported Dynamo before activate() keys its graphs as the bake did only if
    activate() sets the config too, to the value torch would have read."""
    from kiln.compiler.activate import _CONFIG_BACKED

    defaults = COMPILE_DEFAULTS | GPU_COMPILE_DEFAULTS
    # One process reads them all (each variable names its own config attribute, so setting
    # them together shows what each sets alone): a fresh torch import each was 3 s more.
    reads = [_CONFIG_BACKED[var][:2] for var in defaults]
    script = "import importlib\n" + "".join(
        f"print(repr(importlib.import_module({module!r}).{attr}))\n" for module, attr in reads
    )
    read = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, **defaults},
        capture_output=True,
        text=True,
        check=True,
    )
    expected = [repr(_CONFIG_BACKED[var][2](value)) for var, value in defaults.items()]
    assert read.stdout.split("\n")[:-1] == expected, list(defaults)


def test_served_torch_kwargs_are_what_the_bake_recorded(write_spec) -> None:
    spec = load_spec(write_spec(mlp_spec()))
    recorded = manifest_for({}, compile_kwargs={"backend": "eager", "fullgraph": True})
    assert served_torch_kwargs(recorded) == {"backend": "eager", "fullgraph": True}
    older = manifest_for({}, spec=spec.canonical(), compile_kwargs=None)
    assert served_torch_kwargs(older) == torch_kwargs(spec.compile)
    # kiln-serial: the mode becomes its options (torch.compile takes one or the other).
    assert with_compile_threads(torch_kwargs(spec.compile), 1) == {
        "backend": "inductor",
        "dynamic": False,
        "fullgraph": False,
        "options": {"compile_threads": 1},
    }


# --- the shape of the code (issue 16: no function of 190 lines with six closures) ----------------
def test_no_long_functions_in_the_compile_side() -> None:
    src = ROOT / "src" / "kiln"
    files = [*(src / "compiler").glob("*.py"), src / "serving.py", src / "events.py"]
    long = [
        f"{path.relative_to(src)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
        for path in files
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > 80
    ]
    assert long == []


# --- a piped bake (issue 17 item 4) ---------------------------------------------------------------
@pytest.mark.slow
def test_piped_bake_says_which_bucket_starts_and_that_it_is_alive(write_spec, cli) -> None:
    """stderr is a pipe here, as in CI: a line per bucket as it starts, heartbeats between."""
    proc = cli(
        "bake",
        write_spec(mlp_spec("piped", buckets="batch: [2, 3]")),
        "-o",
        "p.kiln.tar.zst",
        "--no-prove",  # the pass's progress is the subject; the proof's is the same kind
        env={"KILN_HEARTBEAT_S": "0.5"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stderr.splitlines()
    for i, key in enumerate(("batch=2", "batch=3")):
        start = lines.index(f"  {key}: start ({i + 1}/2)")
        done = next(n for n, line in enumerate(lines) if line.startswith(f"  {key}: first call "))
        assert start < done
    # The first bucket compiles for seconds on 2 cores: silence is filled in.
    assert any(line.startswith("  still running: batch=2: first call (") for line in lines)
    assert any(line.startswith("  still running: start-up (") for line in lines)
