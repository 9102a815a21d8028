"""Starting a grid worker (:mod:`kiln.compiler.worker`) in a fresh process and reading it back.

Bake, verify and bench each call :func:`run_worker` with a typed
:class:`~kiln.compiler.protocol.WorkerRequest` and the environment they mean (on top of
:func:`kiln.serving.worker_env`, which drops every inherited cache location). It relays the
worker's progress events as they arrive, sends a :class:`~kiln.events.Heartbeat` while a step
stays silent (a long compile in a piped CI log otherwise looks hung), and returns a
:class:`WorkerRun`: the parsed :class:`~kiln.compiler.protocol.WorkerResult` and the wall-clock
times around it. A failure becomes kiln's error for it: the spec's (exit 2, at its key), an
incompatibility (exit 5), or a :class:`~kiln.compiler.process.WorkerError` with the tail of
torch's log (:func:`kiln.compiler.process.failure_error`).
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kiln.compiler import ranks, user_launch
from kiln.compiler.process import (
    WorkerError,
    failure_error,
    heartbeat_interval,
    log_tail,
    read_outcome,
    spawn,
    worker_command,
)
from kiln.compiler.protocol import WorkerFailure, WorkerOutcome, WorkerRequest, WorkerResult
from kiln.errors import UsageError
from kiln.events import EventSink
from kiln.serving import worker_env
from kiln.spec import Spec


@dataclass(frozen=True)
class WorkerRun:
    """One finished worker: what it measured, and when it was started and ended (epochs)."""

    result: WorkerResult
    spawned: float
    ended: float
    log: str
    # Every rank's result, rank 0's first, for a distributed spec (``result`` is rank 0's).
    ranks: tuple[WorkerResult, ...] = ()

    @property
    def results(self) -> tuple[WorkerResult, ...]:
        """Each rank's result (one for a 1-rank spec)."""
        return self.ranks or (self.result,)

    @property
    def time_to_ready(self) -> float:
        """Process start until every bucket has run once (interpreter + torch import included)."""
        return self.result.first_pass_done - self.spawned

    @property
    def startup(self) -> float:
        """Process start until the model is built and compiled or loaded, before any call."""
        return self.result.model_ready - self.spawned

    @property
    def time_to_warm(self) -> float:
        return self.result.warm_done - self.spawned

    @property
    def wall_s(self) -> float:
        return self.ended - self.spawned


def run_worker(
    spec: Spec,
    request: WorkerRequest,
    env: dict[str, str],
    *,
    on_event: EventSink | None = None,
    timeout: float | None = None,
    cwd: Path | None = None,
) -> WorkerRun:
    """Run one grid pass of ``spec`` in a fresh interpreter; raise a :class:`KilnError` on failure.
    ``cwd``: the working directory it runs in, as a server started there (kiln.workdir); None:
    this process's.

    The worker leads its own process group, so that when this call is interrupted (Ctrl-C, or
    SIGTERM, which the CLI turns into an exception) it is killed together with the compile
    processes Inductor started under it before the temporary folder is removed: nothing is left
    running or writing into a folder that no longer exists.

    A distributed spec runs K workers under torchrun (:mod:`kiln.compiler.ranks`), each rank in
    its rank folder of the layout ``request`` names; the run fails with the error of the lowest
    rank whose failure kiln names (its spec, the machine, the folder), else of the lowest failing
    rank, and its result is rank 0's with every rank's in ``ranks``.
    """
    heartbeat_s = heartbeat_interval()
    request = request.replace(spec=spec.canonical(), spec_base=str(spec.base_dir.absolute()))
    world = spec.world_size if spec.distributed else 0
    session = user_launch.active() if world else None
    if world and session is None and ranks.current() is not None:
        raise UsageError(
            f"{spec.name}: run kiln once, outside torchrun: it starts the "
            f"{world} ranks itself (this process is rank {os.environ['RANK']} of a launch)"
        )
    requests = ranks.rank_requests(request, env, world) if world else [request]
    if session is not None:  # rank 0 of a user's launch: every rank runs its own worker
        spawned, returncode, log, outcomes = user_launch.issue(
            session, requests, env, on_event, heartbeat_s, timeout, cwd
        )
        ended = time.time()
    else:
        spawned, ended, returncode, log, outcomes = _run_here(
            requests,
            env,
            world,
            on_event,
            heartbeat_s,
            timeout,
            cwd,
        )
    failed = [(i, o.failure) for i, o in enumerate(outcomes) if o and o.failure is not None]
    if failed:
        # The cause first: a rank that failed for a reason kiln names (its spec, the folder)
        # takes its peers down in their collectives, which fail as torch's "connection closed".
        rank, failure = min(failed, key=lambda f: f[1].kind == "internal")
        return _raise(spec, failure, log, f"rank {rank}: " if world else "")
    missing = [i for i, o in enumerate(outcomes) if o is None]
    if missing:
        who = f"rank {missing[0]} of {world}" if world else "worker"
        raise WorkerError(f"{who} {_death(returncode)}:\n{log_tail(log)}")
    results = tuple(o.result for o in outcomes if o is not None and o.result is not None)
    return WorkerRun(
        result=results[0],
        spawned=spawned,
        ended=ended,
        log=log,
        ranks=results if world else (),
    )


def _run_here(
    requests: list[WorkerRequest],
    env: dict[str, str],
    world: int,
    on_event: EventSink | None,
    heartbeat_s: float | None,
    timeout: float | None,
    cwd: Path | None,
) -> tuple[float, float, int, str, list[WorkerOutcome | None]]:
    """One worker, or torchrun starting ``world`` of them, from this process; (start and end
    epochs, exit code, log, each rank's outcome or None)."""
    suffix = ranks.RANK_PLACEHOLDER if world else ""  # each rank reads and writes its own
    with tempfile.TemporaryDirectory(prefix="kiln-worker-") as tmp:
        folder = Path(tmp)
        for i, req in enumerate(requests):
            (folder / f"request{i if world else ''}.json").write_text(req.model_dump_json())
        args = [str(folder / f"request{suffix}.json"), str(folder / f"outcome{suffix}.json")]
        command = ranks.launch_command(world, args) if world else worker_command(args)
        child_env = ranks.launch_env(worker_env(env)) if world else worker_env(env)
        if "TMPDIR" not in env:  # a served process's own (verify watches it) stands
            child_env["TMPDIR"] = str(private_tmp(folder))
        spawned, returncode = spawn(
            folder,
            command,
            child_env,
            on_event,
            heartbeat_s,
            timeout,
            graceful=bool(world),
            cwd=cwd,
        )
        ended = time.time()
        log = (folder / "stderr.log").read_text(errors="replace")
        paths = [folder / f"outcome{i}.json" for i in range(world)] or [folder / "outcome.json"]
        outcomes = [read_outcome(path) for path in paths]
    return spawned, ended, returncode, log, outcomes


def private_tmp(folder: Path) -> Path:
    """The worker's ``TMPDIR``: inside its own ``kiln-worker-*`` folder, which is removed when
    the worker ends, SIGTERM and Ctrl-C included. What torch and gcc put under ``TMPDIR`` goes
    with it: Inductor's precompiled headers (``torchinductor_$USER/precompiled_headers``, over
    100 MB, left behind by every bake otherwise) and gcc's temporary files of a compile that was
    killed. The bake's cache root is chosen by the parent, so no cache path depends on it."""
    tmp = folder / "tmp"
    tmp.mkdir(exist_ok=True)
    return tmp


def _raise(spec: Spec, failure: WorkerFailure, log: str, where: str) -> WorkerRun:
    if failure.kind != "spec" and where:
        failure = failure.model_copy(update={"message": where + failure.message})
    raise failure_error(spec, failure, log)


def _death(returncode: int) -> str:
    """How the worker ended, in words: a SIGKILL nobody asked for is usually the OOM killer."""
    if returncode >= 0:
        return f"died with exit code {returncode}"
    name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else "?"
    hint = " (out of memory?)" if -returncode == signal.SIGKILL else ""
    return f"was killed by {name}{hint}"
