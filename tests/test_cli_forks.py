"""The fuzzers' safety net holds: ``limited_cli``'s limits bind a forked call and a plain one.

The fuzz properties (tests/test_merge_fuzz.py, tests/test_bundle_fuzz.py) say "within 1 GiB and
30 CPU seconds"; that only means something if a call over its limit fails, whichever way
tests/cli_forks.py ran it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import limited_cli


@pytest.mark.parametrize(
    "env",
    [{}, {"PYTHONKILNTEST": "1"}],  # a PYTHON* variable the server lacks: a plain process
    ids=["forked", "plain"],
)
def test_a_call_over_its_memory_limit_fails(tmp_path: Path, env: dict[str, str]) -> None:
    roomy = limited_cli(tmp_path, "inspect", tmp_path / "none.kiln.tar.zst", env=env)
    assert roomy.returncode == 4, roomy.stderr  # README "Exit codes": no such artifact
    held = limited_cli(tmp_path, "inspect", tmp_path / "none.kiln.tar.zst", env=env, memory=1 << 20)
    # a fork runs out inside kiln (MemoryError, exit 1), a new interpreter before it starts
    assert held.returncode not in (0, roomy.returncode), held.stderr[-500:]
    assert "no such artifact" not in held.stderr
