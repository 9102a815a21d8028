"""``kiln ARGS`` as a real process that starts with kiln already imported: the ``cli`` fixture.

Each call is its own process, with its own argv, environment, working folder, stdin (empty),
stdout and stderr (files, read back as ``capture_output`` would) and exit code, running the
console script's own ``kiln.cli.main``: what a user's shell starts, less the interpreter's
start-up. That start-up was most of the fast suite: ~440 CLI processes, each ~0.35 s importing
typer, rich, pydantic and kiln's models before its first line of work (2-core CI machine,
2026-12-07; the work itself is mostly milliseconds).

A small server, one per pytest process and prelude, runs the caller's prelude
(``tests/conftest.py``'s ``NO_TORCH`` where torch must stay out, so a command that reaches for
it still fails the same way), imports ``kiln.cli`` once and forks a child per call.
The server is a fresh interpreter that runs nothing else: no threads, no torch, no pytest
state in the child. kiln reads no environment variable at import (``tests/test_imports.py``
checks it), so a child that sets the call's environment before ``main()`` behaves as a process
started with it. What stays a plain subprocess: a call whose ``PYTHON*`` or ``LD_*`` variables
differ from the server's (the interpreter and the loader read them at start-up:
``PYTHONDONTWRITEBYTECODE``, ``PYTHONPYCACHEPREFIX``, ``LD_PRELOAD``), calls that overlap (a
test's threads), and the tests whose subject is the interpreter's start-up or the import graph
(they run their own).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

# The server: read one request per line, fork, report the child's pid, then its exit status.
_SERVER = r"""
import json, os, sys
exec(sys.argv[1])  # the caller's prelude, e.g. torch blocked
import kiln.cli  # noqa: F401  (the point: imported once, before the fork)
requests, replies = sys.stdin.buffer, os.fdopen(os.dup(1), "w")


def child(request):
    code = 1
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        for fd, path, flags in (
            (0, os.devnull, os.O_RDONLY),
            (1, request["stdout"], os.O_WRONLY | os.O_TRUNC),
            (2, request["stderr"], os.O_WRONLY | os.O_TRUNC),
        ):
            opened = os.open(path, flags)
            os.dup2(opened, fd)
            os.close(opened)
        os.close(replies.fileno())
        if request["limits"]:  # what a preexec_fn would set; this child's CPU time starts at 0
            import resource
            memory, cpu_s = request["limits"]
            resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
            resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        import tempfile
        tempfile.tempdir = None  # read from TMPDIR again, as a new process does
        sys.argv = request["argv"]
        try:
            from kiln.cli import main
            main()
            code = 0
        except SystemExit as exit:
            if exit.code is None:
                code = 0
            elif isinstance(exit.code, int):
                code = exit.code
            else:
                print(exit.code, file=sys.stderr)
        except BaseException:
            sys.excepthook(*sys.exc_info())
        # What interpreter shutdown does: wait for threads, run atexit, flush.
        import atexit, threading
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code & 0xFF)


for line in requests:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(request)
    replies.write(json.dumps({"pid": pid}) + "\n")
    replies.flush()
    _, status = os.waitpid(pid, 0)
    replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
    replies.flush()
"""


class _Server:
    def __init__(self, prelude: str) -> None:
        self.busy = threading.Lock()
        self.interpreter = _interpreter_settings(os.environ)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _SERVER, prelude],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=tempfile.gettempdir(),
        )

    def _reply(self, timeout: float) -> dict:
        """The server's next line, read a byte at a time from the pipe itself: a buffered
        ``readline`` could take both of a quick call's lines at once and leave ``select``
        waiting for one already read."""
        assert self.proc.stdout is not None
        fd, line = self.proc.stdout.fileno(), b""
        deadline = time.monotonic() + timeout
        while not line.endswith(b"\n"):
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            byte = os.read(fd, 1) if ready else b""
            if not byte:
                raise TimeoutError
            line += byte
        return json.loads(line)

    def run(
        self,
        argv: list[str],
        cwd: Path,
        env: dict[str, str],
        timeout: float,
        limits: tuple[int, int] | None,
    ) -> subprocess.CompletedProcess[str]:
        with tempfile.TemporaryDirectory(prefix="kiln-cli-") as scratch:
            out, err = Path(scratch, "stdout"), Path(scratch, "stderr")
            out.touch()
            err.touch()
            request = {
                "argv": argv,
                "cwd": str(cwd),
                "env": env,
                "stdout": str(out),
                "stderr": str(err),
                "limits": limits,
            }
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            pid = self._reply(30)["pid"]
            try:
                returncode = self._reply(timeout)["returncode"]
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                self._reply(30)
                raise subprocess.TimeoutExpired(argv, timeout) from None
            return subprocess.CompletedProcess(argv, returncode, out.read_text(), err.read_text())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


_servers: dict[str, _Server] = {}


def _interpreter_settings(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(("PYTHON", "LD_"))}


def run_cli(
    argv: list[str],
    cwd: Path,
    env: dict[str, str],
    *,
    prelude: str,
    timeout: float,
    limits: tuple[int, int] | None = None,
) -> subprocess.CompletedProcess[str] | None:
    """``argv`` run by a forked child of the server that ran ``prelude``; None where a fork would
    not be a fresh process's equal (the caller starts a plain process instead): the call sets
    the interpreter's start-up differently, or the server is busy with another thread's call.
    ``limits`` (bytes of address space, CPU seconds) hold the child as ``setrlimit`` in a
    ``preexec_fn`` holds a new process; the server's own imports are in the child's address
    space either way (no torch: ~45 MB)."""
    server = _servers.get(prelude)
    if server is None or server.proc.poll() is not None:
        server = _servers[prelude] = _Server(prelude)
    if _interpreter_settings(env) != server.interpreter:
        return None
    if not server.busy.acquire(blocking=False):
        return None
    try:
        return server.run(argv, cwd, env, timeout, limits)
    finally:
        server.busy.release()


@atexit.register
def close() -> None:
    for server in _servers.values():
        server.close()
    _servers.clear()
