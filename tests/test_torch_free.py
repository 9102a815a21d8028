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
        + "kiln.artifact.blobs, kiln.artifact.payload, kiln.factors, kiln.cli.merge, "
        + "kiln.artifact.bundle, kiln.artifact.machine; print('ok')"
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


def test_bundle_restore_and_inspect_without_torch(tmp_path: Path, cli) -> None:
    """Issue 14: bundling, choosing a variant (GPU detection included) and inspecting a bundle
    all run without torch."""
    from kiln.artifact.machine import detect
    from tests.archives import CPU_FP, H200_FP, variant_archive

    cpu = variant_archive(tmp_path / "cpu.kiln.tar.zst", CPU_FP)
    gpu = variant_archive(tmp_path / "gpu.kiln.tar.zst", H200_FP)
    out = tmp_path / "release.kiln.tar.zst"
    proc = cli("bundle", cpu, gpu, "-o", out, no_torch=True)
    assert proc.returncode == 0, proc.stderr
    proc = cli("inspect", out, "--json", no_torch=True)
    assert proc.returncode == 0 and json.loads(proc.stdout)["bundle"] is True, proc.stderr
    # --variant installs that variant on any machine; without it, this machine's variant: the
    # CPU one here, the H200 one on the GPU machine, none (exit 5) on any other GPU.
    gpus = detect().gpus
    here = None if gpus and gpus[0].name != "NVIDIA H200" else "cuda" if gpus else "cpu"
    h200 = "h200-sm90-torch2.11.0-cu130"
    for args, device in (((), here), (("--variant", h200), "cuda")):
        dest = tmp_path / f"cache{len(args)}"
        proc = cli("restore", out, "--dest", dest, "--json", *args, no_torch=True)
        assert "Traceback" not in proc.stderr  # importing torch would have crashed it
        if device is None:
            assert proc.returncode == 5 and "no variant matches" in proc.stderr, proc.stderr
            continue
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["variant"]["device"] == device


@pytest.mark.slow  # the session's real CPU bake (`baked`): ~30 s
def test_inspect_real_artifact_without_torch(baked, cli) -> None:
    _, result = baked
    proc = cli("inspect", result.artifact, no_torch=True)
    assert proc.returncode == 0, proc.stderr
    for word in ("tiny-mlp", "batch=5", "fxgraph", "native", "torch", "torch.compile(backend="):
        assert word in proc.stdout
    # The bake's proof, as the manifest records it (issue 13).
    assert "proven: a fresh process served the packed artifact at another path: 0 compiles" in (
        " ".join(proc.stdout.split())
    )


def test_env_command(cli) -> None:
    proc = cli("env", "--json")
    assert proc.returncode == 0, proc.stderr
    fp = json.loads(proc.stdout)
    assert fp["torch.version"].startswith("2.") and "inductor" in fp and "python" in fp


@pytest.mark.parametrize(
    "args",
    [
        ("check", "{art}"),
        ("env",),
        ("env", "--device", "cuda"),
        ("verify", "{spec}", "--cache", "{tmp}/cache"),
        ("bake", "{spec}", "-o", "{tmp}/out.kiln.tar.zst"),
        ("bench", "{spec}"),
    ],
)
def test_torch_commands_in_a_torch_free_install_say_so(
    tmp_path: Path, cli, write_spec, args: tuple[str, ...]
) -> None:
    """Issue 29, item 3: a command that needs torch, run where there is none (the install
    scripts/install-restore.sh makes), is one line saying so and how to get it, exit 2; no
    worker starts, nothing is written."""
    from tests.conftest import mlp_spec

    values = {
        "art": str(good_archive(tmp_path / "a.kiln.tar.zst")),
        "spec": str(write_spec(mlp_spec())),
        "tmp": str(tmp_path),
    }
    argv = [a.format(**values) for a in args]
    for extra in ([], ["--json"]):
        proc = cli(*argv, *extra, no_torch=True)
        assert proc.returncode == 2, proc.stderr
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith(f"kiln: error: kiln {args[0]} needs torch, and this install has")
        assert "install your torch build" in line and "Traceback" not in proc.stderr
        if extra:
            assert json.loads(proc.stdout)["exit_code"] == 2
    assert not (tmp_path / "out.kiln.tar.zst").exists() and not (tmp_path / "cache").exists()


def test_missing_extra_advice_fits_a_torch_free_install(tmp_path: Path, cli) -> None:
    """Without torch, `pip install 'torch-kiln[sign]'` would pull torch in: the advice is the
    torch-free installer with KILN_EXTRAS instead."""
    art = good_archive(tmp_path / "a.kiln.tar.zst")
    (tmp_path / "k.pem").write_text("x")
    code = "sys.modules['securesystemslib'] = None; sys.modules['cryptography'] = None; "
    argv = ["kiln", "sign", str(art), "--key", str(tmp_path / "k.pem")]
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            f"{NO_TORCH}{code}sys.argv = {argv!r}; import kiln.cli as c; c.main()",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "KILN_EXTRAS=sign scripts/install-restore.sh PYTHON torch-kiln" in line, line
    assert "would pull in torch" in line
