"""Bench: what does a baked cache buy, against eager, a cold compile and the stock alternatives?

Each mode runs the whole grid in its own fresh process on this machine, in one run, so the numbers
compare like with like: time-to-ready (process start → every bucket ran once, interpreter and
torch import included), per-bucket first-call time, steady-state latency, and compiles counted.

Modes: ``eager`` (no compile) · ``cold`` (torch.compile, empty cache) · ``kiln`` (restored from
the artifact this run baked, at a new path, through ``kiln.env``) · ``megacache`` (the Mega-Cache
blob alone, loaded into an empty cache folder) · ``copied`` (the raw cache folder copied to a new
path: the hand-rolled approach) · opt-in ``kiln-blob`` (the restored folder and its Mega-Cache
blob hot-loaded, as ``kiln.activate`` does) · opt-in ``kiln-serial`` (``kiln`` with
``compile_threads: 1``: kernels load in the serving process and no compile worker pool starts,
as kiln already serves autotuning specs; it measures what that costs or saves the rest). ``cold``
is the bake's own first pass unless ``cold_run`` asks for a separate bare loop: both are a fresh
process compiling into an empty cache. For a ``precompile`` spec, ``kiln`` loads the precompiled
forwards, and ``cold``, ``megacache`` and ``copied`` come from a separate plain ``torch.compile``
run, as a user without kiln would have them.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.artifact.manifest import BucketStats
from kiln.artifact.restore import restore
from kiln.compiler.bake import BakeResult, bake
from kiln.compiler.launch import EventSink, WorkerRun, run_worker
from kiln.compiler.verify import served_request
from kiln.errors import UsageError
from kiln.grid import expand, ordered
from kiln.serving import (
    INDUCTOR_DIR,
    MEGACACHE_NAME,
    cache_env,
    cold_torch_kwargs,
    compile_env,
    with_compile_threads,
)
from kiln.spec import Spec, load_spec

MODES = ("eager", "cold", "kiln", "megacache", "copied")
# Opt-in: the restored folder *plus* the hot-loaded blob (kiln.activate's route), and kiln with
# kernels loaded in-process.
EXTRA_MODES = ("kiln-blob", "kiln-serial")


@dataclass
class ModeResult:
    mode: str
    time_to_ready_s: float
    time_to_warm_s: float
    startup_s: float  # process start → model built (and precompiled forwards loaded)
    buckets: list[BucketStats]
    note: str = ""
    ready_runs_s: list[float] = field(default_factory=list)  # every repeat's time to ready

    @property
    def compiles(self) -> int:
        return sum(b.compiles for b in self.buckets)

    @property
    def first_calls_s(self) -> float:
        return sum(b.first_call_s for b in self.buckets)

    @property
    def worst_first_request_ratio(self) -> float | None:
        """Max over buckets of first real request (after warmup) / steady latency."""
        ratios = [
            b.first_request_s / b.steady_s for b in self.buckets if b.first_request_s and b.steady_s
        ]
        return max(ratios) if ratios else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "time_to_ready_s": round(self.time_to_ready_s, 3),
            "time_to_warm_s": round(self.time_to_warm_s, 3),
            "startup_s": round(self.startup_s, 3),
            "ready_runs_s": [round(t, 3) for t in self.ready_runs_s],
            "first_calls_s": round(self.first_calls_s, 3),
            "compiles": self.compiles,
            "steady_median_s": statistics.median(b.steady_s for b in self.buckets),
            "worst_first_request_ratio": self.worst_first_request_ratio,
            "note": self.note,
            "buckets": [b.model_dump(mode="json") | {"compiles": b.compiles} for b in self.buckets],
        }


@dataclass
class BenchReport:
    name: str
    spec: dict[str, Any]
    fingerprint: dict[str, Any]
    modes: dict[str, ModeResult]
    bake_wall_s: float
    bare_compile_wall_s: float
    artifact_bytes: int
    restore_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def ratio(self, a: str, b: str) -> float | None:
        if a in self.modes and b in self.modes and self.modes[b].time_to_ready_s > 0:
            return self.modes[a].time_to_ready_s / self.modes[b].time_to_ready_s
        return None

    def ratios(self) -> dict[str, float | None]:
        out = {
            f"{a}/{b}": self.ratio(a, b)
            for a, b in (
                ("kiln", "cold"),
                ("kiln-blob", "kiln"),
                ("kiln-serial", "kiln"),
                ("kiln", "megacache"),
                ("kiln", "copied"),
                ("kiln", "eager"),
                ("copied", "eager"),
                ("megacache", "eager"),
                ("cold", "eager"),
            )
        }
        out["bake/bare_compile"] = (
            self.bake_wall_s / self.bare_compile_wall_s if self.bare_compile_wall_s else None
        )
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "spec": self.spec,
            "fingerprint": {k: v for k, v in self.fingerprint.items() if k not in ("inductor",)},
            "bake_wall_s": round(self.bake_wall_s, 3),
            "bare_compile_wall_s": round(self.bare_compile_wall_s, 3),
            "artifact_bytes": self.artifact_bytes,
            "restore_s": round(self.restore_s, 3),
            "ratios": self.ratios(),
            "modes": {k: v.to_dict() for k, v in self.modes.items()},
            **self.extra,
        }


def _mode(mode: str, run: WorkerRun, note: str = "") -> ModeResult:
    return ModeResult(
        mode=mode,
        time_to_ready_s=run.time_to_ready,
        time_to_warm_s=run.time_to_warm,
        startup_s=run.startup,
        buckets=[BucketStats.model_validate(b) for b in run.result["buckets"]],
        note=note,
    )


def bench(
    spec: Spec | str | Path,
    *,
    modes: tuple[str, ...] = MODES,
    order: str = "shuffle",
    seed: int = 0,
    cold_run: bool = False,
    repeat: int = 1,
    workdir: str | Path | None = None,
    on_event: EventSink | None = None,
) -> BenchReport:
    """Bake ``spec`` then time every mode in a fresh process; see the module docstring.

    ``repeat`` runs each served mode (all but ``cold``) that many times, interleaved in rotating
    order, and reports the run with the median time to ready plus every run's time: on a shared
    machine process start-up alone varies by seconds, and one run per mode cannot tell that
    apart from a real difference.
    """
    if repeat < 1:
        raise UsageError("--repeat must be at least 1")
    spec = spec if isinstance(spec, Spec) else load_spec(spec)
    emit = on_event or (lambda _e: None)
    work = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix=f"kiln-bench-{spec.name}-"))
    work.mkdir(parents=True, exist_ok=True)
    keys = [b.key for b in ordered(expand(spec), order, seed)]
    env = compile_env(spec)
    try:
        emit({"event": "mode", "mode": "bake"})
        baked: BakeResult = bake(
            spec, work / "bench.kiln.tar.zst", keep_workdir=True, on_event=emit
        )
        assert baked.workdir is not None
        results: dict[str, ModeResult] = {}
        first = baked.runs[0]
        bare_wall = first.ended - first.spawned
        # A precompile bake fills its folder through torch's AOT route, which a plain
        # torch.compile only partly hits: the stock alternatives get a plain compile's caches.
        plain_cold = cold_run or spec.compile.precompile
        if "cold" in modes and not plain_cold:
            results["cold"] = _mode(
                "cold", first, "the bake's first pass (fresh process, empty cache)"
            )
        t0 = time.time()
        restored = work / "restored"
        restore(baked.artifact, restored)
        restore_s = time.time() - t0

        def run(mode: str, extra_env: dict[str, str], **request: Any) -> WorkerRun:
            emit({"event": "mode", "mode": mode})
            return run_worker(
                spec,
                {
                    "order": keys,
                    "calls": spec.warmup.calls,
                    "first_request": True,
                    "steady_calls": 10,
                    **request,
                },
                extra_env,
                on_event=emit,
            )

        def empty(name: str) -> Path:
            p = work / name / INDUCTOR_DIR
            p.mkdir(parents=True)
            return p

        stock_root, stock_blob = baked.workdir / INDUCTOR_DIR, baked.workdir / MEGACACHE_NAME
        if plain_cold and {"cold", "megacache", "copied"} & set(modes):
            stock_root, stock_blob = empty("cold"), work / "cold" / MEGACACHE_NAME
            r = run(
                "cold",
                {**env, "TORCHINDUCTOR_CACHE_DIR": str(stock_root)},
                cache_root=str(stock_root),
                megacache_save=str(stock_blob),
                torch_kwargs=cold_torch_kwargs(spec.compile),
            )
            results["cold"] = _mode("cold", r, "plain torch.compile, empty cache")
            if cold_run:
                bare_wall = r.ended - r.spawned
        precompiled = baked.manifest.precompiled

        # Every run of a served mode gets its own fresh folder: a process writes into the cache
        # it reads (output code, kernels), and a second run must not start warmer than the first.
        def eager(i: int) -> WorkerRun:
            root = empty(f"eager-{i}")
            return run("eager", {"TORCHINDUCTOR_CACHE_DIR": str(root)}, compile=False)

        def kiln_run(i: int, mode: str = "kiln") -> WorkerRun:
            dest = work / f"{mode}-{i}"
            restore(baked.artifact, dest)
            request = served_request(dest, baked.manifest)
            if mode == "kiln-blob":
                request["megacache_load"] = str(dest / MEGACACHE_NAME)
            if mode == "kiln-serial":
                request["torch_kwargs"] = with_compile_threads(request["torch_kwargs"], 1)
            return run(mode, cache_env(dest, baked.manifest.env), **request)

        def megacache(i: int) -> WorkerRun:
            root = empty(f"megacache-{i}")
            env_ = {**env, "TORCHINDUCTOR_CACHE_DIR": str(root)}
            return run("megacache", env_, cache_root=str(root), megacache_load=str(stock_blob))

        def copied(i: int) -> WorkerRun:
            root = work / f"copied-{i}" / INDUCTOR_DIR
            shutil.copytree(stock_root, root)
            return run(
                "copied", {**env, "TORCHINDUCTOR_CACHE_DIR": str(root)}, cache_root=str(root)
            )

        plans: dict[str, tuple[Any, str]] = {
            "eager": (eager, ""),
            "kiln": (
                kiln_run,
                "restored artifact at a new path, via kiln.env"
                + (" + precompiled" if precompiled else ""),
            ),
            "kiln-blob": (
                lambda i: kiln_run(i, "kiln-blob"),
                "restored folder + Mega-Cache blob loaded",
            ),
            "kiln-serial": (
                lambda i: kiln_run(i, "kiln-serial"),
                "kiln, kernels loaded in-process (compile_threads: 1)",
            ),
            "megacache": (megacache, "Mega-Cache blob alone into an empty folder"),
            "copied": (copied, "raw cache folder copied to a new path"),
        }
        if not (restored / MEGACACHE_NAME).is_file():
            plans.pop("kiln-blob")
        if not stock_blob.is_file():
            plans.pop("megacache")
        chosen = [m for m in plans if m in modes]
        runs: dict[str, list[WorkerRun]] = {m: [] for m in chosen}
        for i in range(repeat):
            # Rotate the order each round: no mode is always the first process after the bake.
            k = i % max(1, len(chosen))
            for m in chosen[k:] + chosen[:k]:
                runs[m].append(plans[m][0](i))
        for m in chosen:
            median = sorted(runs[m], key=lambda w: w.time_to_ready)[(len(runs[m]) - 1) // 2]
            results[m] = _mode(m, median, plans[m][1])
            results[m].ready_runs_s = [w.time_to_ready for w in runs[m]]
        ordered_results = {m: results[m] for m in (*MODES, *EXTRA_MODES) if m in results}
        return BenchReport(
            name=spec.name,
            spec=spec.canonical(),
            fingerprint=baked.manifest.fingerprint,
            modes=ordered_results,
            bake_wall_s=baked.wall_s,
            bare_compile_wall_s=bare_wall,
            artifact_bytes=baked.size,
            restore_s=restore_s,
            extra={
                "order": keys,
                "cold_source": "separate plain run" if plain_cold else "bake pass 1",
            },
        )
    finally:
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)
