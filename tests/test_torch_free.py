"""The restore path (`kiln restore`, `kiln inspect`, `import kiln.cli`) never imports torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.archives import good_archive
from tests.conftest import NO_TORCH


def test_import_kiln_cli_without_torch() -> None:
    code = (
        NO_TORCH
        + "import kiln, kiln.cli, kiln.artifact.restore, kiln.artifact.archive, "
        + "kiln.artifact.attestation, kiln.artifact.keys, kiln.cli.sign, kiln.artifact.merge, "
        + "kiln.artifact.blobs, kiln.artifact.payload, kiln.factors, kiln.cli.merge; print('ok')"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    code = "import sys, kiln.cli; print('torch' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip()
        == "False"
    )


def test_restore_and_inspect_without_torch(tmp_path: Path, cli) -> None:
    art = good_archive(tmp_path / "a.kiln.tar.zst")
    proc = cli("restore", art, "--dest", tmp_path / "cache", "--json", no_torch=True)
    assert proc.returncode == 0, proc.stderr
    proc = cli("inspect", art, "--json", no_torch=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["name"] == "demo"
    proc = cli("inspect", tmp_path / "cache", no_torch=True)
    assert proc.returncode == 0 and "demo" in proc.stdout


@pytest.mark.slow  # the session's real CPU bake (`baked`): ~30 s
def test_inspect_real_artifact_without_torch(baked, cli) -> None:
    _, result = baked
    proc = cli("inspect", result.artifact, no_torch=True)
    assert proc.returncode == 0, proc.stderr
    for word in ("tiny-mlp", "batch=5", "fxgraph", "native", "torch", "torch.compile(backend="):
        assert word in proc.stdout


def test_env_command(cli) -> None:
    proc = cli("env", "--json")
    assert proc.returncode == 0, proc.stderr
    fp = json.loads(proc.stdout)
    assert fp["torch.version"].startswith("2.") and "inductor" in fp and "python" in fp
