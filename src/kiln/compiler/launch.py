"""Starting ``kiln.compiler.worker`` in a fresh process with exactly the environment we mean.

Inherited environment is the enemy of reproducible caches: a user's ``TORCHINDUCTOR_CACHE_DIR``
would leak entries into a bake, a remote-cache switch would make a verify hit over the network.
So the child gets the caller's environment minus every cache-location and remote-cache variable,
plus what kiln sets. Its stderr (torch's chatter) goes to a log whose tail is shown on failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.errors import IncompatibleError, KilnError
from kiln.serving import worker_env
from kiln.spec import Spec, error_at

Event = dict[str, Any]
EventSink = Callable[[Event], None]


@dataclass
class WorkerRun:
    result: dict[str, Any]
    spawned: float  # wall clock when the process was started
    ended: float
    log: str

    @property
    def time_to_ready(self) -> float:
        """Process start until every bucket has run once (interpreter + torch import included)."""
        return float(self.result["first_pass_done"]) - self.spawned

    @property
    def startup(self) -> float:
        """Process start until the model is built and compiled or loaded, before any call."""
        return float(self.result.get("model_ready", self.result["first_pass_done"])) - self.spawned

    @property
    def time_to_warm(self) -> float:
        return float(self.result["warm_done"]) - self.spawned


class WorkerError(KilnError):
    pass


def run_worker(
    spec: Spec,
    request: dict[str, Any],
    env: dict[str, str],
    *,
    on_event: EventSink | None = None,
    timeout: float | None = None,
) -> WorkerRun:
    """Run one grid pass in a fresh interpreter; raise a :class:`KilnError` on failure.

    The worker leads its own process group, so that when this call is interrupted (Ctrl-C, or
    SIGTERM, which the CLI turns into an exception) it is killed together with the compile
    processes Inductor started under it before the temporary folder is removed: nothing is left
    running or writing into a folder that no longer exists.
    """
    request = {"spec_path": str(spec.path), **request}
    with tempfile.TemporaryDirectory(prefix="kiln-worker-") as tmp:
        req, res, log = Path(tmp, "request.json"), Path(tmp, "result.json"), Path(tmp, "stderr.log")
        req.write_text(json.dumps(request))
        with open(log, "wb") as err:
            spawned = time.time()
            proc = subprocess.Popen(
                [sys.executable, "-m", "kiln.compiler.worker", str(req), str(res)],
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=worker_env(env),
                text=True,
                start_new_session=True,
            )
            try:
                assert proc.stdout is not None
                for line in proc.stdout:
                    if on_event and line.startswith("{"):
                        with contextlib.suppress(json.JSONDecodeError):
                            on_event(json.loads(line))
                proc.wait(timeout=timeout)
            except BaseException:
                # The leader is not reaped yet, so its group id cannot have been reused.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise
        ended = time.time()
        log_text = log.read_text(errors="replace")
        result = json.loads(res.read_text()) if res.exists() else None
    if result is None:
        tail = "\n".join(log_text.strip().splitlines()[-15:])
        raise WorkerError(f"worker {_death(proc.returncode)}:\n{tail}")
    if not result.get("ok"):
        if result.get("kind") == "spec":
            raise error_at(spec, result["key"], result["message"])
        if result.get("kind") == "incompatible":
            raise IncompatibleError(result["message"])
        tail = "\n".join(log_text.strip().splitlines()[-15:])
        raise WorkerError(f"{result.get('message')}\n{tail}".strip())
    return WorkerRun(result=result, spawned=spawned, ended=ended, log=log_text)


def _death(returncode: int) -> str:
    """How the worker ended, in words: a SIGKILL nobody asked for is usually the OOM killer."""
    if returncode >= 0:
        return f"died with exit code {returncode}"
    name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else "?"
    hint = " (out of memory?)" if -returncode == signal.SIGKILL else ""
    return f"was killed by {name}{hint}"
