"""The working directory, which the CUDA driver keys cuDNN's runtime-compiled kernels by
(kiln.workdir): the bake runs its processes in ``serve.workdir``, the manifest records it where
shipped driver entries carry it, and ``kiln.env`` and ``kiln check`` name a server elsewhere.

The entries themselves come only from a GPU (tests/test_aoti_gpu.py); here the artifact that
ships one is made by hand, with the bytes an H100's entry holds (kiln.workdir).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import kiln
from kiln.artifact.manifest import FileEntry, Workdir
from kiln.workdir import keyed_entries
from tests.archives import manifest_for, reg, write_archive
from tests.conftest import ROOT, Cli

# What an H100's cuDNN attention kernel entry holds (bytes trimmed): its source's name, then
# the working directory it was JIT-compiled in.
KERNEL = b"cudnn_generated_fort_native_sdpa_sm90_flash_fprop_knob_7_kernel0_0.cu"


def entry(folder: str) -> bytes:
    return b"\x00ELF" + KERNEL + folder.encode() + b"lgenfe: EDG 6.6\x00"


def test_an_entry_is_keyed_by_the_folder_it_holds(tmp_path: Path) -> None:
    files = {"a": entry("/srv/app"), "b": entry("/work/main"), "c": b".nopCudnnHardwareDetection"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    paths = [tmp_path / name for name in files]
    assert keyed_entries(paths, "/srv/app") == 1
    assert keyed_entries(paths, "/elsewhere") == 0


def test_the_folder_is_named_as_a_shell_started_there_names_it(tmp_path: Path) -> None:
    """``$PWD`` where it names the working directory (a symlinked path stays the link), else
    the resolved path (a ``PWD`` left from elsewhere): as glibc's get_current_dir_name, which
    NVRTC's compile-unit directory follows (measured on an H100: a symlink's entries differ
    from its target's)."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    code = "from kiln.workdir import logical_cwd; print(logical_cwd())"
    named = {}
    for pwd in (tmp_path / "link", tmp_path / "elsewhere"):
        run = subprocess.run(
            [sys.executable, "-c", code],
            cwd=tmp_path / "link",
            env={**os.environ, "PWD": str(pwd)},
            capture_output=True,
            text=True,
            check=True,
        )
        named[pwd.name] = run.stdout.strip()
    assert named == {"link": str(tmp_path / "link"), "elsewhere": str(real)}


FACTORY = """\
import os
from pathlib import Path

import torch


def mlp(record: str) -> torch.nn.Module:
    with open(record, "a") as f:
        f.write(os.getcwd() + " " + os.environ.get("PWD", "") + "\\n")
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
"""


def workdir_spec(folder: Path, workdir: str, record: Path) -> Path:
    (folder / "model.py").write_text(FACTORY)
    spec = folder / "spec.yaml"
    spec.write_text(
        "name: workdir-mlp\n"
        "model:\n"
        "  factory: model.py:mlp\n"
        f"  kwargs: {{record: {json.dumps(str(record))}}}\n"
        "inputs:\n"
        "  - {name: input, shape: [batch, 8]}\n"
        "buckets: {batch: [2]}\n"
        "warmup: {calls: 1}\n"
        f"serve: {{workdir: {json.dumps(workdir)}}}\n"
    )
    return spec


def test_the_bake_runs_every_process_in_serve_workdir(tmp_path: Path) -> None:
    """The passes and the proof each build the model in the declared folder, named as a shell
    started there names it; the CPU writes no driver entry, so the manifest records none."""
    app = tmp_path / "app"
    app.mkdir()
    record = tmp_path / "cwd.txt"
    spec = workdir_spec(tmp_path, str(app), record)
    result = kiln.bake(spec, tmp_path / "a.kiln.tar.zst")
    assert result is not None
    seen = record.read_text().splitlines()
    assert len(seen) >= 2  # the pass and the proof, each a process of its own
    assert set(seen) == {f"{app} {app}"}
    assert result.manifest.workdir is None
    assert result.manifest.spec["serve"] == {"workdir": str(app)}


def test_a_workdir_the_bake_machine_lacks_is_a_located_error(tmp_path: Path, cli) -> None:
    spec = workdir_spec(tmp_path, str(tmp_path / "missing"), tmp_path / "cwd.txt")
    run = cli("bake", spec, "-o", tmp_path / "a.kiln.tar.zst")
    assert run.returncode == 2, run.stderr
    assert f"{spec}:9:9: serve.workdir: {tmp_path / 'missing'} is no folder" in run.stderr
    assert not (tmp_path / "cwd.txt").exists()  # refused before any process ran
    spec.write_text(spec.read_text().replace(json.dumps(str(tmp_path / "missing")), "app"))
    run = cli("bake", spec, "-o", tmp_path / "a.kiln.tar.zst")
    assert run.returncode == 2
    assert f"{spec}:9:9: serve.workdir: must be an absolute path" in run.stderr
    # As a shell names a folder, or the server's $PWD never matches it.
    spec.write_text(spec.read_text().replace("workdir: app", "workdir: /srv/../app/"))
    run = cli("bake", spec, "-o", tmp_path / "a.kiln.tar.zst")
    assert run.returncode == 2
    assert f"{spec}:9:9: serve.workdir: must be written as a shell names it (/app)" in run.stderr


def keyed_artifact(path: Path, workdir: str) -> Path:
    """An artifact shipping one driver entry JIT-compiled in ``workdir``."""
    files = {"inductor/fxgraph/a/entry": b"A" * 100, "cuda-cache/4/4/4aa7b38c": entry(workdir)}
    manifest = manifest_for(files, workdir=Workdir(path=workdir, keyed=1))
    manifest.files = [
        FileEntry.model_construct(**{**f.model_dump(), "kind": "driver"})
        if f.path.startswith("cuda-cache/")
        else f
        for f in manifest.files
    ]
    return write_archive(path, manifest, [reg(p, d) for p, d in sorted(files.items())])


def test_kiln_env_and_check_name_a_server_in_another_folder(tmp_path: Path, cli) -> None:
    app, other = tmp_path / "app", tmp_path / "other"
    app.mkdir()
    other.mkdir()
    artifact = keyed_artifact(tmp_path / "a.kiln.tar.zst", str(app))
    dest = tmp_path / "dest"
    assert cli("restore", artifact, "--dest", dest, no_torch=True).returncode == 0
    shown = cli("inspect", artifact, no_torch=True)
    assert f"serve in {app}: 1 CUDA driver entry keyed by the folder" in shown.stdout
    said = {}
    for where in (app, other):
        run = subprocess.run(
            ["sh", "-c", '. "$1/kiln.env" && echo "$CUDA_CACHE_PATH"', "sh", str(dest)],
            cwd=where,
            env={**os.environ, "PWD": str(where)},
            capture_output=True,
            text=True,
            check=True,
        )
        assert run.stdout.strip() == str(dest / "cuda-cache")
        said[where.name] = run.stderr
    assert said["app"] == ""
    assert said["other"] == (
        f"kiln.env: this process runs in {other}; the CUDA driver kernels in the artifact were "
        f"JIT-compiled in {app} and are keyed by it: cuDNN compiles them again here at each new "
        "shape (start the server there, or bake with serve.workdir)\n"
    )
    checked = {}
    for where in (app, other):
        run = Cli(where)("check", dest, "--json", env={"PWD": str(where)})
        report = json.loads(run.stdout)
        factor = next(f for f in report["factors"] if f["name"] == "process.workdir")
        checked[where.name] = run.returncode, factor["matches"], factor["here"]
    assert checked["app"][1:] == (True, str(app))
    assert checked["other"] == (5, False, str(other))


def test_verify_blames_the_folder_for_the_driver_jit_only() -> None:
    """The working directory keys no graph: a graph miss beside a differing folder is not put
    down to it (its own cause is named), a driver JIT is."""
    from kiln.artifact.manifest import BucketStats
    from kiln.compiler.check import CheckReport
    from kiln.compiler.verify import VerifyReport
    from kiln.workdir import workdir_factor

    base = {"first_call_s": 1, "compile_s": 0, "steady_s": 0.001}
    graph = BucketStats(key="batch=1", sizes={"batch": 1}, fx_misses=1, **base)
    jit = BucketStats(
        key="batch=2",
        sizes={"batch": 2},
        written=2,
        new_files=["DIR/cuda-cache/4/4/4aa7b38c", "DIR/cuda-cache/index"],
        **base,
    )
    factor = workdir_factor("/app", "/srv")
    assert factor is not None and factor.causes_miss
    report = VerifyReport(
        name="m",
        order=["batch=1", "batch=2"],
        buckets=[graph, jit],
        check=CheckReport("m", [factor], {}, {}),
        time_to_ready_s=1.0,
        time_to_warm_s=1.0,
        spec_matches=True,
    )
    graph_line, jit_line = report.reasons()
    assert "process.workdir" not in graph_line and "no cached entry matched" in graph_line
    assert jit_line.endswith("driver cache lacks (environment differs: process.workdir))")
    # Verify on a machine without the spec's serve.workdir served in its own folder: said first.
    from kiln.compiler.verify import _unserved_workdir
    from kiln.spec import ServeSpec, load_spec

    spec = load_spec(ROOT / "configs" / "tiny-gpt.yaml")
    missing = spec.model_copy(update={"serve": ServeSpec(workdir="/nonexistent/app")})
    report.extra["unserved_workdir"] = _unserved_workdir(missing)
    assert report.reasons()[0] == (
        "serve.workdir /nonexistent/app is no folder on this machine: verify served in "
        f"{Path.cwd()}"
    )
    here = spec.model_copy(update={"serve": ServeSpec(workdir=str(Path.cwd()))})
    assert _unserved_workdir(here) is None and _unserved_workdir(spec) is None


def test_a_removed_working_directory_is_unknown_not_a_crash(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    gone.mkdir()
    code = (
        "import os; os.chdir(os.environ['GONE']); os.rmdir(os.environ['GONE']); "
        "from kiln.workdir import logical_cwd; print(logical_cwd())"
    )
    env = {**os.environ, "GONE": str(gone), "PWD": str(gone)}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip() == "None", run.stderr


def test_the_bake_records_the_folder_its_shipped_entries_carry(tmp_path: Path) -> None:
    """Driver entries (a rank's too) that hold the folder are counted; the driver's index and
    files outside a driver cache are not, whatever they hold."""
    from kiln.compiler.bake import keyed_workdir

    app = "/srv/app"
    files = {
        "cuda-cache/4/4/a": entry(app),
        "ranks/1/cuda-cache/f/c/b": entry(app),
        "cuda-cache/a/2/c": b".nopCudnnHardwareDetection",
        "cuda-cache/index": entry(app),
        "inductor/x/y.py": entry(app),
    }
    entries = []
    for path, data in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(data)
        entries.append(FileEntry(path=path, size=len(data), sha256="0" * 64, kind="other"))
    assert keyed_workdir(tmp_path, entries, Path(app)) == Workdir(path=app, keyed=2)
    assert keyed_workdir(tmp_path, entries, Path("/elsewhere")) is None
