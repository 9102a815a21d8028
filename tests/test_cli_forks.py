"""The fuzzers' safety net holds: ``limited_cli``'s limits bind a forked call and a plain one.

The fuzz properties (tests/test_merge_fuzz.py, tests/test_bundle_fuzz.py) say "within 1 GiB and
30 CPU seconds"; that only means something if a call over its limit fails, whichever way
tests/cli_forks.py ran it.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

from tests.conftest import limited_cli

MISSING = "none.kiln.tar.zst"


def test_a_forked_call_over_its_memory_limit_fails_inside_kiln(tmp_path: Path) -> None:
    roomy = limited_cli(tmp_path, "inspect", tmp_path / MISSING)
    assert roomy.returncode == 4, roomy.stderr  # README "Exit codes": no such artifact
    held = limited_cli(tmp_path, "inspect", tmp_path / MISSING, memory=1 << 20)
    # Forked, kiln is already imported: the child runs out of memory (a MemoryError, or a
    # library it loads late that cannot be mapped) inside kiln's own error handling; or, when
    # pydantic-core's allocator is the first to fail (which one is, varies between runs),
    # Rust's handler aborts the process, saying so: never a hang, a success or a wrong code.
    if held.returncode == -signal.SIGABRT:
        assert re.match(r"memory allocation of \d+ bytes failed", held.stderr), held.stderr[-500:]
    else:
        assert held.returncode == 1, held.stderr[-500:]
        assert held.stderr.startswith("kiln: error: internal error: "), held.stderr[-500:]


def test_a_plain_call_over_its_memory_limit_fails_before_python_starts(tmp_path: Path) -> None:
    env = {"PYTHONKILNTEST": "1"}  # a PYTHON* variable the fork server lacks: a plain process
    roomy = limited_cli(tmp_path, "inspect", tmp_path / MISSING, env=env)
    assert roomy.returncode == 4, roomy.stderr
    held = limited_cli(tmp_path, "inspect", tmp_path / MISSING, env=env, memory=1 << 20)
    # Started plain, the interpreter itself cannot load (the loader's exit 127).
    assert held.returncode == 127 and not held.stderr.startswith("kiln:"), held.stderr[-500:]
