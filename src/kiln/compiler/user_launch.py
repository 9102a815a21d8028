"""``kiln bake`` inside a launch the user started (torchrun, one node): K kiln processes, one bake.

When a distributed spec's bake runs with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` already set, every
rank of that launch runs ``kiln bake``. There is no scheduler to ask, so the ranks coordinate
through the bake's work folder (``$TMPDIR/kiln-bake-UID/NAME``, per machine: all ranks on one node,
or a shared ``TMPDIR``):

* rank 0 is the bake. It takes the work folder's lock (:func:`kiln.compiler.bake._stable_workdir`),
  writes :data:`MARKER` naming this launch, and runs the bake as kiln's own launch would, except
  that each worker pass (:func:`kiln.compiler.launch.run_worker`, bake passes and the proof's
  verify alike) is a *command*: rank 0 writes every rank's request into ``launch/N/``, runs its
  own rank's worker, and waits (bounded) for every other rank's outcome there.
* every other rank never takes the lock. It waits (bounded, :func:`timeout_s`) for the marker,
  then runs each command's worker for its own rank, in-process of the launch (the launcher's
  ``MASTER_ADDR``/``MASTER_PORT`` kept, so the workers' process group forms), and writes its
  outcome where rank 0 reads it, until rank 0 writes :data:`END`. It writes no artifact.

Each command's workers join their process group under a store prefix of their own
(:data:`PREFIX_VAR`): a launch's store outlives the worker processes, and the keys an earlier
pass's group left there would otherwise point the next pass at ranks that are gone.

Named for whose launch it is: :mod:`kiln.compiler.launch` is kiln's own, starting the worker (or
torchrun with K of them) itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from kiln.compiler import ranks
from kiln.compiler.process import read_outcome, spawn, worker_command
from kiln.compiler.protocol import WorkerOutcome, WorkerRequest
from kiln.errors import KilnError, UsageError
from kiln.events import EventSink
from kiln.serving import worker_env
from kiln.spec import Spec

MARKER = "launch.ready"  # rank 0 owns the work folder now; holds the launch's identity
END = "launch.end"  # rank 0 is done: "ok" or "failed"
COMMANDS = "launch"  # launch/N/: one worker pass of every rank
CWD = "cwd"  # launch/N/cwd: the folder every rank's worker runs in (kiln.workdir), when set
TIMEOUT_VAR = "KILN_LAUNCH_TIMEOUT_S"
TIMEOUT_S = 600.0  # how long a rank waits for another before it gives up
PREFIX_VAR = "KILN_LAUNCH_PREFIX"  # the store prefix of one command's process group
_POLL_S = 0.05
_BYE_S = 30.0  # rank 0 waits this long for the others to see END before removing the folder
_WATCH_S = 0.5  # a follower looks for END this often while its worker runs
_STOP_S = 10.0  # after a failure, this long for their workers to die (torchrun's grace: 30 s)
# What a worker keeps of the launch's environment: how to reach the launch's store and who it is.
_KEPT = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID")


class LaunchTimeout(KilnError):
    """A rank waited longer than :func:`timeout_s` for another rank (exit 1)."""


def timeout_s(environ: Mapping[str, str] | None = None) -> float:
    """Seconds one rank waits for another: ``KILN_LAUNCH_TIMEOUT_S``, default 600."""
    environ = os.environ if environ is None else environ
    text = environ.get(TIMEOUT_VAR, "").strip()
    try:
        seconds = float(text) if text else TIMEOUT_S
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise UsageError(f"{TIMEOUT_VAR}={text!r}: give a positive number of seconds")
    return seconds


def in_launch(spec: Spec, environ: Mapping[str, str] | None = None) -> ranks.Rank | None:
    """This process's rank when a distributed spec's bake runs inside a user's launch; None
    otherwise. A launch of another size than the spec's is exit 2, naming both."""
    rank = ranks.current(environ)
    if spec.distributed is None or rank is None:
        return None
    if rank.world_size != spec.world_size:
        raise UsageError(
            f"{spec.name}: the launch has WORLD_SIZE={rank.world_size}, the spec "
            f"distributed.world_size={spec.world_size}: launch {spec.world_size} ranks"
        )
    if not 0 <= rank.rank < rank.world_size:
        raise UsageError(f"RANK={rank.rank} is no rank of WORLD_SIZE={rank.world_size}")
    environ = os.environ if environ is None else environ
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not environ.get(v)]
    if missing:
        raise UsageError(
            f"{spec.name}: a launch of {rank.world_size} ranks sets MASTER_ADDR and MASTER_PORT "
            f"(torchrun does); {' and '.join(missing)} missing"
        )
    return rank


def identity(environ: Mapping[str, str] | None = None) -> str:
    """What every rank of one launch shares and another launch does not: a follower takes a
    marker left by an earlier bake of the same name for its own only if the launch is the same."""
    environ = os.environ if environ is None else environ
    keys = ("TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")
    return "|".join(environ.get(k, "") for k in keys)


def _write(path: Path, text: str) -> None:
    """Whole or not at all: another rank polls for ``path``."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def wait_for(path: Path, what: str, limit: float, *, content: str | None = None) -> str:
    """``path``'s text once it exists (and equals ``content``, when given); a
    :class:`LaunchTimeout` naming ``what`` after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while True:
        with contextlib.suppress(OSError):
            text = path.read_text()
            if content is None or text == content:
                return text
        if time.monotonic() > deadline:
            raise LaunchTimeout(
                f"waited {limit:g}s for {what} ({path}); raise {TIMEOUT_VAR} if it is only slow"
            )
        time.sleep(_POLL_S)


@dataclass
class Session:
    """Rank 0's side: the work folder the ranks share, and the commands issued so far."""

    work: Path
    rank: ranks.Rank
    ident: str
    limit: float
    issued: int = 0

    def command_env(self, env: Mapping[str, str], number: int) -> dict[str, str]:
        return {**env, PREFIX_VAR: f"kiln/{self.ident}/{number}"}


_ACTIVE: Session | None = None


def active() -> Session | None:
    """The in-launch bake this process leads (rank 0), if any: run_worker issues commands."""
    return _ACTIVE


@contextlib.contextmanager
def lead(work: Path, rank: ranks.Rank) -> Iterator[Session]:
    """Rank 0, holding ``work``'s lock: announce the folder, issue commands, and on the way out
    tell the others. After a success it gives them a moment to see it before the folder goes.
    After a failure (SIGTERM included) it waits only for the followers whose worker is still
    running: the launcher stops every rank at once, and a follower's worker that outlives rank 0
    by a few milliseconds would write into the folder while it is removed and leave part of it
    behind. A follower reports ``doneR`` once its worker is dead (:func:`follow`)."""
    global _ACTIVE
    session = Session(work=work, rank=rank, ident=identity(), limit=timeout_s())
    _write(work / MARKER, session.ident)
    _ACTIVE = session
    outcome = "failed"
    try:
        yield session
        outcome = "ok"
    finally:
        _ACTIVE = None
        _write(work / END, outcome)
        if outcome == "ok":
            waits, limit = [work / f"launch.bye{r}" for r in range(1, rank.world_size)], _BYE_S
        else:
            waits, limit = _running_followers(session), _STOP_S
        deadline = time.monotonic() + limit
        while not all(w.exists() for w in waits) and time.monotonic() < deadline:
            time.sleep(_POLL_S)


def _running_followers(session: Session) -> list[Path]:
    """The ``doneR`` files of the last command's followers that started a worker for it."""
    if not session.issued:
        return []
    folder = session.work / COMMANDS / str(session.issued - 1)
    world = session.rank.world_size
    return [folder / f"done{r}" for r in range(1, world) if (folder / f"rank{r}").is_dir()]


def worker_environment(env: Mapping[str, str], rank: ranks.Rank) -> dict[str, str]:
    """A worker of this launch: kiln's worker environment, the launch's own variables kept
    (RANK, LOCAL_RANK, WORLD_SIZE and how to reach the store)."""
    child = ranks.launch_env(worker_env(dict(env)))
    kept = {k: os.environ[k] for k in _KEPT if k in os.environ}
    own = {
        "RANK": str(rank.rank),
        "LOCAL_RANK": str(rank.local_rank),
        "WORLD_SIZE": str(rank.world_size),
    }
    return {**child, **kept, **own}


def own_request(folder: Path, rank: ranks.Rank) -> Path:
    """This rank's request of a command, on its own device (cuda:LOCAL_RANK)."""
    path = folder / f"request{rank.rank}.json"
    request = WorkerRequest.model_validate_json(path.read_bytes())
    mine = folder / f"request{rank.rank}.local.json"
    mine.write_text(request.replace(device_index=rank.local_rank).model_dump_json())
    return mine


def issue(
    session: Session,
    requests: list[WorkerRequest],
    env: Mapping[str, str],
    on_event: EventSink | None,
    heartbeat_s: float | None,
    timeout: float | None,
    cwd: Path | None = None,
) -> tuple[float, int, str, list[WorkerOutcome | None]]:
    """One worker pass of every rank: rank 0's here, the others' by the followers; (start epoch,
    rank 0's exit code, every rank's log, every rank's outcome or None). ``cwd``: the folder
    every rank's worker runs in (kiln.workdir), written beside the command for the followers."""
    number = session.issued
    session.issued += 1
    folder = session.work / COMMANDS / str(number)
    folder.mkdir(parents=True)
    for i, req in enumerate(requests):
        (folder / f"request{i}.json").write_text(req.model_dump_json())
    command_env = session.command_env(env, number)
    _write(folder / "env.json", json.dumps(command_env))
    if cwd is not None:
        _write(folder / CWD, str(cwd))
    _write(folder / "go", session.ident)
    me = session.rank
    args = [str(own_request(folder, me)), str(folder / f"outcome{me.rank}.json")]
    child_env = worker_environment(command_env, me)
    log_dir = folder / "rank0"
    log_dir.mkdir()
    spawned, returncode = spawn(
        log_dir, worker_command(args), child_env, on_event, heartbeat_s, timeout, cwd=cwd
    )
    world = me.world_size
    for r in range(1, world):
        wait_for(folder / f"done{r}", f"rank {r} to finish pass {number}", session.limit)
    logs = [(log_dir / "stderr.log").read_text(errors="replace")]
    logs += [_read(folder / f"stderr{r}.log") for r in range(1, world)]
    outcomes = [read_outcome(folder / f"outcome{r}.json") for r in range(world)]
    return spawned, returncode, "\n".join(logs), outcomes


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


class RankZeroEnded(Exception):
    """Rank 0 ended while this rank's worker ran: it failed (it ends well only after every
    rank's ``doneR``), and it removes the folder once this rank's worker is dead."""


def until_ended(work: Path) -> EventSink:
    """A follower's event sink, called on every event and every :data:`_WATCH_S` of silence:
    raises :class:`RankZeroEnded` once rank 0 wrote ``END``, so that spawn kills the worker
    at once (a failure of rank 0 alone, a timeout, sends no signal to the followers)."""

    def sink(_event: object) -> None:
        if (work / END).exists():
            raise RankZeroEnded

    return sink


def _run_command(folder: Path, rank: ranks.Rank, work: Path) -> bool:
    """Run this rank's worker of the command in ``folder``; False when rank 0 had already
    ended. ``rankR`` is made before ``END`` is looked at, and rank 0 writes ``END`` before it
    looks for ``rankR`` (:func:`_running_followers`): so either this rank starts no worker, or
    rank 0 waits for its ``doneR``, which is written whatever happens once ``rankR`` exists."""
    mine = folder / f"rank{rank.rank}"
    try:
        mine.mkdir()
        if (work / END).exists():
            return False
        env = json.loads((folder / "env.json").read_text())
        args = [str(own_request(folder, rank)), str(folder / f"outcome{rank.rank}.json")]
        watch = until_ended(work)
        cwd = Path((folder / CWD).read_text()) if (folder / CWD).exists() else None
        spawn(
            mine,
            worker_command(args),
            worker_environment(env, rank),
            watch,
            _WATCH_S,
            None,
            cwd=cwd,
        )
        return True
    except (FileNotFoundError, RankZeroEnded):  # rank 0 ended (the folder may be gone)
        return False
    finally:
        with contextlib.suppress(OSError):
            (folder / f"stderr{rank.rank}.log").write_bytes((mine / "stderr.log").read_bytes())
        with contextlib.suppress(OSError):
            _write(folder / f"done{rank.rank}", "")


def follow(spec: Spec, rank: ranks.Rank, work: Path) -> None:
    """Rank R > 0: wait for rank 0's work folder, run every command's worker for this rank,
    until rank 0 ends. Raises :class:`LaunchTimeout` when rank 0 stays silent too long, and a
    :class:`KilnError` when rank 0's bake failed (its own error says why)."""
    limit, ident = timeout_s(), identity()
    wait_for(work / MARKER, f"rank 0 to start the bake of {spec.name}", limit, content=ident)
    number = 0
    while True:
        folder = work / COMMANDS / str(number)
        deadline = time.monotonic() + limit
        while not (folder / "go").exists() and not (work / END).exists():
            if time.monotonic() > deadline:
                raise LaunchTimeout(
                    f"waited {limit:g}s for rank 0's next step of {spec.name}; "
                    f"raise {TIMEOUT_VAR} if it is only slow"
                )
            time.sleep(_POLL_S)
        if not (folder / "go").exists():
            break
        if not _run_command(folder, rank, work):
            break
        number += 1
    ended = _read(work / END) or "failed"  # gone: rank 0 removed the folder after a failure
    if ended == "ok":  # after a failure rank 0 is removing the folder: write nothing into it
        with contextlib.suppress(OSError):
            _write(work / f"launch.bye{rank.rank}", "")
    else:
        raise KilnError(
            f"rank {rank.rank}: rank 0's bake of {spec.name} failed (its error says why)"
        )
