"""The command line as users run it: strict choices, exit codes, and --json everywhere.

Every case here fails before anything is compiled, so the commands run in real subprocesses with
torch blocked (``no_torch=True``): a bad flag must be exit 2 without importing torch or baking.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer

import kiln
from kiln.cli import app
from kiln.errors import NotFoundError
from tests.conftest import mlp_spec


def one_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("kiln: error: "), stderr
    return lines[0]


@pytest.mark.parametrize("command", ["verify", "bench"])
def test_order_is_a_choice_and_a_bad_one_is_exit_2(
    cli, write_spec, tmp_path: Path, command: str
) -> None:
    spec = write_spec(mlp_spec())
    extra = ["--cache", str(tmp_path)] if command == "verify" else []
    proc = cli(command, spec, *extra, "--order", "random", no_torch=True)
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc.stderr)
    assert "'random'" in line and all(o in line for o in ("shuffle", "grid", "reverse")), line
    assert proc.stdout == ""
    as_json = cli(command, spec, *extra, "--order", "random", "--json", no_torch=True)
    assert as_json.returncode == 2, as_json.stderr
    assert json.loads(as_json.stdout)["exit_code"] == 2


def test_env_device_is_a_choice(cli) -> None:
    proc = cli("env", "--device", "tpu", no_torch=True)
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc.stderr)
    assert "'tpu'" in line and "cpu" in line and "cuda" in line


def test_schema_takes_json_like_every_command(cli) -> None:
    plain = cli("schema", no_torch=True)
    as_json = cli("schema", "--json", no_torch=True)
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout) == json.loads(plain.stdout)


def test_every_command_takes_json() -> None:
    """The README promises it; a command added without it fails here."""
    group = typer.main.get_command(app)
    for name, command in group.commands.items():  # type: ignore[attr-defined]
        flags = {opt for param in command.params for opt in param.opts}
        assert "--json" in flags, name


def test_usage_errors_are_one_line_and_json_with_json(cli, write_spec) -> None:
    """Flags click rejects go through kiln's one error path: one line, and JSON on stdout."""
    proc = cli("bake", write_spec(mlp_spec()), "--passes", "0", "--json", no_torch=True)
    assert proc.returncode == 2, proc.stderr
    assert "--passes" in one_error_line(proc.stderr)
    assert json.loads(proc.stdout)["exit_code"] == 2
    missing = cli("verify", no_torch=True)
    assert missing.returncode == 2
    assert "Missing argument" in one_error_line(missing.stderr)


def test_env_devices_are_the_devices_a_spec_names() -> None:
    from typing import get_args

    from kiln.cli.options import Device
    from kiln.spec import ModelSpec

    named = set(get_args(ModelSpec.model_fields["device"].annotation))
    assert {d.value for d in Device} == named


@pytest.mark.slow  # `kiln check` and kiln.activate() import torch in two fresh processes
def test_check_and_activate_word_an_incompatibility_alike(cli, tmp_path: Path) -> None:
    """One CheckReport method words the miss: `kiln check` exits 5 with what activate raises."""
    import kiln
    from tests.archives import FILES, manifest_for, reg, write_archive

    fingerprint = {"device.type": "cpu", "torch.version": "0.0.1+elsewhere"}
    manifest = manifest_for(FILES, name="old-torch", fingerprint=fingerprint)
    artifact = write_archive(
        tmp_path / "old.kiln.tar.zst", manifest, [reg(p, d) for p, d in sorted(FILES.items())]
    )
    proc = cli("check", artifact)
    assert proc.returncode == 5, proc.stderr
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("kiln: error: ")]
    assert "torch.version (baked '0.0.1+elsewhere', here '" in line

    restored = tmp_path / "restored"
    kiln.restore(artifact, restored)
    served = subprocess.run(  # activate() sets this process's environment: a fresh one
        [
            sys.executable,
            "-c",
            "import kiln\n"
            "from kiln.errors import IncompatibleError\n"
            "try:\n"
            f"    kiln.activate({str(restored)!r}, compat='fail')\n"
            "except IncompatibleError as exc:\n"
            "    print(exc.message)\n",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert served.returncode == 0, served.stderr
    assert line == f"kiln: error: {served.stdout.strip()}"


@pytest.mark.parametrize(
    ("shard", "why"),
    [
        ("3/3", "the index counts from 0, so it is at most 2"),
        ("1", "expected INDEX/COUNT"),
        ("0/0", "at least 1"),
        ("0/4", "4 shards for a grid of 3 bucket(s)"),
    ],
)
def test_a_bad_shard_is_one_line_exit_2(cli, write_spec, shard: str, why: str) -> None:
    """Issue 14: `--shard I/N` is checked before anything compiles (torch blocked here)."""
    proc = cli("bake", write_spec(mlp_spec()), "--shard", shard, no_torch=True)
    assert proc.returncode == 2, proc.stderr
    assert why in one_error_line(proc.stderr)
    dynamic = cli("bake", write_spec(mlp_spec(dynamic="null")), "--shard", "0/2", no_torch=True)
    assert dynamic.returncode == 2, dynamic.stderr
    assert "sharding needs compile.dynamic: false" in one_error_line(dynamic.stderr)


def test_bake_output_folder_and_unwritable_paths(tmp_path: Path) -> None:
    """``-o`` an existing folder (or a path ending in ``/``) writes NAME.kiln.tar.zst in it,
    as push does; a path that cannot be written is refused before any work."""
    from kiln.artifact.archive import artifact_target
    from kiln.errors import ParameterError

    name = "m.shard-0-of-2.kiln.tar.zst"
    assert artifact_target(tmp_path, name) == tmp_path / name
    assert artifact_target(f"{tmp_path}/new/", name) == tmp_path / "new" / name
    assert artifact_target(tmp_path / "a" / "b.kiln.tar.zst", name) == tmp_path / "a/b.kiln.tar.zst"
    (tmp_path / name).mkdir()
    with pytest.raises(ParameterError, match="is a folder"):
        artifact_target(tmp_path, name)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ParameterError, match=f"{tmp_path}/file is not a folder"):
        artifact_target(tmp_path / "file" / "sub" / "x.kiln.tar.zst", name)


def test_bake_to_an_unwritable_output_is_exit_2_before_torch(
    cli, write_spec, read_only_mount: Path
) -> None:
    """The bake was lost: it compiled for minutes, then failed to write OUT (exit 1)."""
    spec = write_spec(mlp_spec())
    subprocess.run(["mount", "-o", "remount,ro", str(read_only_mount)], check=True)
    for out in (read_only_mount, read_only_mount / "sub" / "x.kiln.tar.zst"):
        proc = cli("bake", spec, "-o", out, no_torch=True)  # torch blocked: nothing compiles
        assert proc.returncode == 2, proc.stderr
        assert one_error_line(proc.stderr) == (
            f"kiln: error: --out '{out}': {read_only_mount} is not writable"
        )


@pytest.mark.slow  # a real bake (one pass, unproven)
def test_bake_into_an_existing_folder_keeps_the_artifact_name(cli, write_spec, tmp_path) -> None:
    """`kiln bake spec -o out/` baked fully, then failed to rename its temporary file onto the
    folder (exit 1, the bake lost); push and restore already took a folder."""
    spec = write_spec(mlp_spec(buckets="batch: [2]"))
    out = tmp_path / "out"
    out.mkdir()
    proc = cli("bake", spec, "-o", out, "--no-prove", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    artifact = out / "tiny-mlp.kiln.tar.zst"
    assert json.loads(proc.stdout)["artifact"] == str(artifact)
    assert [p.name for p in out.iterdir()] == [artifact.name]


# --- issue 29, item 5: a file that is no artifact is named as such ----------------------------
def not_artifacts(tmp_path: Path) -> dict[str, Path]:
    """Files people hand to kiln by mistake: text, a plain tarball, zstd that is no tar."""
    import io
    import tarfile

    import zstandard

    readme = tmp_path / "README.md"
    readme.write_text((Path(__file__).parent.parent / "README.md").read_text()[:4000])
    spec = tmp_path / "spec.yaml"
    spec.write_text(mlp_spec())
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("notes.txt")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    other = tmp_path / "other.tar.zst"
    other.write_bytes(zstandard.ZstdCompressor().compress(buf.getvalue()))
    text_zst = tmp_path / "log.zst"
    text_zst.write_bytes(zstandard.ZstdCompressor().compress(b"just a log\n" * 100))
    empty = tmp_path / "empty.kiln.tar.zst"
    empty.write_bytes(b"")
    return {"readme": readme, "spec": spec, "tarball": other, "zstd": text_zst, "empty": empty}


@pytest.mark.parametrize("what", ["readme", "spec", "tarball", "zstd", "empty"])
@pytest.mark.parametrize("command", ["inspect", "restore", "merge", "push", "sign"])
def test_a_file_that_is_no_artifact_says_so(cli, tmp_path: Path, command: str, what: str) -> None:
    from tests.keys import make_key

    path = not_artifacts(tmp_path)[what]
    store = tmp_path / "store"
    args = {
        "inspect": [],
        "restore": ["--dest", str(tmp_path / "cache")],
        "merge": ["-o", str(tmp_path / "m.kiln.tar.zst")],
        "push": [str(store) + "/"],
        "sign": ["--key", str(make_key(tmp_path, "k").private)],
    }[command]
    proc = cli(command, path, *args, no_torch=True)
    assert proc.returncode == 3, proc.stderr
    line = one_error_line(proc.stderr)
    assert f"{path}: not a kiln artifact" in line, line
    assert "corrupt" not in line
    assert not store.exists() and not (tmp_path / "cache").exists()
    assert not (tmp_path / "m.kiln.tar.zst").exists()
    assert not Path(f"{path}.intoto.jsonl").exists()


def test_check_of_a_file_that_is_no_artifact_says_so(cli, tmp_path: Path) -> None:
    path = not_artifacts(tmp_path)["readme"]
    proc = cli("check", path)
    assert proc.returncode == 3, proc.stderr
    assert f"{path}: not a kiln artifact" in one_error_line(proc.stderr)


def test_a_path_that_does_not_exist_is_named_as_what_was_expected(cli, tmp_path: Path) -> None:
    """check takes an artifact or a restored folder; verify's --cache a folder: a missing
    path says which, with exit 4 (README "Exit codes")."""
    missing = tmp_path / "nope"
    check = cli("check", missing)
    assert check.returncode == 4, check.stderr
    assert f"{missing}: no such artifact file or restored folder" in one_error_line(check.stderr)
    spec = tmp_path / "m.yaml"
    spec.write_text(mlp_spec())
    verify = cli("verify", spec, "--cache", missing)
    assert verify.returncode == 4, verify.stderr
    assert f"{missing}: no such folder (restore an artifact" in one_error_line(verify.stderr)
    artifact = tmp_path / "a.kiln.tar.zst"
    artifact.write_bytes(b"")
    verify = cli("verify", spec, "--cache", artifact)
    assert verify.returncode == 4, verify.stderr
    said = one_error_line(verify.stderr)
    assert f"{artifact}: a file, not a restored folder (an artifact is served once" in said
    assert "kiln restore FILE --dest DIR, then serve DIR)" in said
    # kiln.activate() takes a restored folder only: an artifact file is said to be one, before
    # anything is read or set (it raised NotADirectoryError on FILE/inductor).
    with pytest.raises(NotFoundError, match="a file, not a restored folder") as raised:
        kiln.activate(artifact)
    assert str(raised.value) == said.split("kiln: error: ", 1)[-1]
    with pytest.raises(NotFoundError) as raised:
        kiln.activate(missing)
    assert str(raised.value) == (
        f"{missing}: no such folder (restore an artifact there first: kiln restore ARTIFACT "
        f"--dest {missing})"
    )


def test_sign_of_a_bundle_says_bundles_are_signed_per_variant(cli, tmp_path: Path) -> None:
    from kiln.artifact.bundle import write_bundle
    from tests.archives import variant_archive
    from tests.keys import make_key

    art = variant_archive(tmp_path / "cpu.kiln.tar.zst", {"device.type": "cpu"})
    bundle = write_bundle([art], tmp_path / "release.kiln.tar.zst").path
    proc = cli("sign", bundle, "--key", make_key(tmp_path, "k").private, no_torch=True)
    assert proc.returncode == 2, proc.stderr
    line = one_error_line(proc.stderr)
    assert "bundles are signed per variant" in line and str(bundle) in line
    assert not Path(f"{bundle}.intoto.jsonl").exists()


def test_a_truncated_artifact_is_still_called_corrupt(cli, tmp_path: Path) -> None:
    import random

    from tests.archives import good_archive

    payload = random.Random(0).randbytes(300_000)  # incompressible: the cut lands in it
    art = good_archive(tmp_path / "a.kiln.tar.zst", {"inductor/x": payload})
    art.write_bytes(art.read_bytes()[:-1000])
    proc = cli("restore", art, "--dest", tmp_path / "cache", no_torch=True)
    assert proc.returncode == 3, proc.stderr
    assert "not a kiln artifact" not in proc.stderr


# --- issue 29, item 4: check names where this process's caches really are ---------------------
def test_the_cache_location_factor(tmp_path: Path) -> None:
    """A moved or copied folder's kiln.env still names the old path: a miss, named; unset is a
    note (kiln.activate sets it); an artifact file is restored nowhere yet."""
    from kiln.artifact.archive import read_manifest
    from kiln.artifact.restore import restore
    from kiln.compiler.location import FACTOR, location_factor
    from tests.archives import good_archive

    art = good_archive(tmp_path / "a.kiln.tar.zst")
    dest = tmp_path / "cache"
    restore(art, dest)
    manifest = read_manifest(dest)
    assert location_factor(art, manifest, None, {}) is None
    unset = location_factor(dest, manifest, None, {})
    assert unset is not None and unset.name == FACTOR and not unset.causes_miss
    assert "kiln.activate" in unset.note
    right = location_factor(dest, manifest, None, {FACTOR[4:]: str(dest / "inductor")})
    assert right is not None and right.matches
    moved = location_factor(dest, manifest, None, {FACTOR[4:]: str(tmp_path / "old/inductor")})
    assert moved is not None and moved.causes_miss and not moved.matches
    assert moved.baked == str(dest / "inductor") and moved.here == str(tmp_path / "old/inductor")
    # Worded as what it compares: DIR's own folder (no baked value), and where this process
    # looks (a moved folder's kiln.env names the old path), never "baked" for the new path.
    from kiln.compiler.check import CheckReport

    message = CheckReport("demo", [moved], {}, {}).miss_message()
    assert message == (
        f"demo: caches will miss: {FACTOR} (DIR's caches are in '{dest}/inductor', this process "
        f"uses '{tmp_path}/old/inductor')"
    )


def test_a_moved_triton_cache_is_unset_by_kiln_env_and_named_by_check(tmp_path: Path) -> None:
    """TRITON_CACHE_DIR set in the serving image would move Inductor's Triton kernels (and the
    launchers Triton builds for them) out of DIR: kiln.env unsets it; check names it as a note
    (judged as kiln.env and activate() leave the process), unless it points into DIR."""
    from kiln.artifact.restore import restore
    from kiln.compiler.location import moved_cache_factors
    from tests.archives import good_archive

    dest = tmp_path / "cache"
    restore(good_archive(tmp_path / "a.kiln.tar.zst"), dest)
    sourced = subprocess.run(
        ["sh", "-c", '. "$1/kiln.env" && printf %s "${TRITON_CACHE_DIR-unset}"', "sh", dest],
        env={"PATH": os.environ["PATH"], "TRITON_CACHE_DIR": str(tmp_path / "elsewhere")},
        capture_output=True,
        text=True,
        check=True,
    )
    assert sourced.stdout == "unset"
    inductor = dest / "inductor"
    assert moved_cache_factors({}, inductor) == []
    (moved,) = moved_cache_factors({"TRITON_CACHE_DIR": "/x"}, inductor)
    assert moved.name == "env.TRITON_CACHE_DIR" and (moved.baked, moved.here) == ("unset", "/x")
    assert not moved.matches and not moved.causes_miss and "kiln.env unsets it" in moved.note
    # Where torch puts it itself, at its first Triton kernel: DIR's own folder.
    assert moved_cache_factors({"TRITON_CACHE_DIR": str(inductor / "triton" / "0")}, inductor) == []
    assert len(moved_cache_factors({"TRITON_CACHE_DIR": "/x"}, None)) == 1  # an artifact file


@pytest.mark.slow  # each check compiles Inductor's CPU-ISA probes: ~25 s on 2 cores
@pytest.mark.usefixtures("real_isa_probes")  # the archive was made without the run's setting
def test_check_of_a_moved_folder_is_exit_5_naming_the_cache_location(cli, tmp_path: Path) -> None:
    import shutil

    from kiln.artifact.restore import restore
    from tests.archives import good_archive

    first = tmp_path / "first"
    restore(good_archive(tmp_path / "a.kiln.tar.zst"), first)
    moved = tmp_path / "moved"
    # As `cp -R` copies: links stay links (DEST/inductor/locks links to /tmp, never copied).
    shutil.copytree(first, moved, symlinks=True)
    shutil.rmtree(first)
    sourced = {"TORCHINDUCTOR_CACHE_DIR": str(first / "inductor")}  # first's kiln.env, sourced
    proc = cli("check", moved, env=sourced)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    line = one_error_line(proc.stderr)
    assert "env.TORCHINDUCTOR_CACHE_DIR" in line and str(first / "inductor") in line
    assert "compatible" not in proc.stdout.replace("incompatible", "")
    # A serving setting outside the cache keys is named; on the CPU it is a note, not a miss.
    # So is a TRITON_CACHE_DIR of the server's own (kiln.env unsets it): a note everywhere.
    threads = {"TORCHINDUCTOR_COMPILE_THREADS": "4", "TRITON_CACHE_DIR": str(tmp_path / "t")}
    ok = cli("check", moved, env={"TORCHINDUCTOR_CACHE_DIR": str(moved / "inductor"), **threads})
    assert ok.returncode == 0, ok.stderr
    assert "TORCHINDUCTOR_COMPILE_THREADS" in ok.stdout, ok.stdout
    assert "env.TRITON_CACHE_DIR" in ok.stdout, ok.stdout
    assert " ".join(ok.stdout.split()).endswith("will hit here"), ok.stdout
    # Judged as a server has it after kiln.env: a shell without it is told so in the verdict.
    bare = cli("check", moved, env={"TORCHINDUCTOR_CACHE_DIR": ""})
    assert bare.returncode == 0, bare.stderr
    verdict = " ".join(bare.stdout.split())
    assert f"will hit here once the server sources {moved}/kiln.env or calls" in verdict, verdict


@pytest.mark.slow  # the session's real bake, and two checks that compile the CPU-ISA probes
def test_check_in_a_server_environment_names_each_kiln_env_variable_it_lacks(
    baked, cli, tmp_path: Path
) -> None:
    """A server whose environment is its own (TORCHINDUCTOR_CACHE_DIR set in an image, nothing
    else of kiln.env) misses every bucket without the bake's env: check judged it with the
    artifact's env on top and said "compatible". Sourced kiln.env, it is compatible."""
    import kiln

    _, result = baked
    dest = tmp_path / "cache"
    kiln.restore(result.artifact, dest)
    assert result.manifest.env["TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS"] == "0"
    partial = cli("check", dest, env={"TORCHINDUCTOR_CACHE_DIR": str(dest / "inductor")})
    assert partial.returncode == 5, partial.stdout + partial.stderr
    line = one_error_line(partial.stderr)
    assert "env.TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS (baked '0', here None)" in line, line
    assert "kiln.env exports TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS=0" in partial.stdout
    dumped = subprocess.run(
        ["sh", "-c", '. "$1" && env -0', "sh", dest / "kiln.env"],
        capture_output=True,
        check=True,
    ).stdout.decode()
    sourced = dict(item.split("=", 1) for item in dumped.split("\0") if "=" in item)
    full = cli("check", dest, env=sourced)
    assert full.returncode == 0, full.stdout + full.stderr
    assert " ".join(full.stdout.split()).endswith(f"{result.manifest.name} will hit here")


def test_restore_says_how_to_serve_a_folder_whose_path_has_a_space(cli, tmp_path: Path) -> None:
    """The line restore prints is pasted into a shell: a path with a space is quoted."""
    from tests.archives import good_archive

    dest = tmp_path / "my cache"
    proc = cli("restore", good_archive(tmp_path / "a.kiln.tar.zst"), "--dest", dest, no_torch=True)
    assert proc.returncode == 0, proc.stderr
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("serve with: ")]
    assert line == f"serve with: . '{dest}/kiln.env'"
    pasted = line.removeprefix("serve with: ") + ' && printf %s "$KILN_CACHE_DIR"'
    sourced = subprocess.run(["sh", "-c", pasted], capture_output=True, text=True, check=True)
    assert sourced.stdout == str(dest)


def test_verify_names_a_moved_folder_by_the_path_its_kiln_env_names(tmp_path: Path) -> None:
    """A folder moved, copied or mounted at another path than restore wrote it for is not
    "something wrote into it": its kiln.env names the other path, and verify says so."""
    import shutil

    from kiln.artifact.archive import read_manifest
    from kiln.artifact.restore import restore
    from kiln.compiler.verify import changed_line, folder_changes, moved_env
    from tests.archives import good_archive

    first = tmp_path / "first"
    restore(good_archive(tmp_path / "a.kiln.tar.zst"), first)
    manifest = read_manifest(first)
    moved = tmp_path / "moved"
    shutil.copytree(first, moved, symlinks=True)
    changes = folder_changes(moved, manifest)
    assert changes == ["~kiln.env"] and moved_env(moved, manifest, changes) == str(first)
    assert changed_line(changes, str(first)).startswith(
        f"kiln.env names {first}, where the folder was restored, not this path (moved, copied "
        "or mounted elsewhere)"
    )
    (tmp_path / "link").symlink_to(first)  # the same folder by another spelling: not moved
    assert moved_env(tmp_path / "link", manifest, ["~kiln.env"]) is None
    # Edited, where it was restored or after a move: no other path restore wrote it for.
    for folder in (first, moved):
        with open(folder / "kiln.env", "a") as env:
            env.write("export X=1\n")
        edited = folder_changes(folder, manifest)
        assert edited == ["~kiln.env"] and moved_env(folder, manifest, edited) is None
    assert "something wrote into it" in changed_line(edited, None)


def test_check_names_a_serving_setting_the_server_overrides() -> None:
    from kiln.compiler.check import serving_env_factors

    assert serving_env_factors({}, "cuda") == []  # unset: kiln.env / activate() set it
    assert serving_env_factors({"TORCHINDUCTOR_COMPILE_THREADS": "1"}, "cuda") == []
    (cuda,) = serving_env_factors({"TORCHINDUCTOR_COMPILE_THREADS": "8"}, "cuda")
    assert cuda.name == "env.TORCHINDUCTOR_COMPILE_THREADS" and cuda.causes_miss
    assert (cuda.baked, cuda.here) == ("1", "8") and "benchmarks them again" in cuda.note
    (cpu,) = serving_env_factors({"TORCHINDUCTOR_COMPILE_THREADS": "8"}, "cpu")
    assert not cpu.matches and not cpu.causes_miss


def test_a_server_environment_is_told_each_variable_kiln_env_exports() -> None:
    """In a process whose environment is the server's own, every variable of the manifest's
    env it lacks is named: a miss where the fingerprint keys by it, else a note."""
    from kiln.compiler.check import exported_env_factors
    from kiln.factors import compare

    env = {"TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0", "TORCH_LOGS": "recompiles"}
    baked = {"env": {"TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0"}}
    factors = exported_env_factors(compare(baked, {"env": {}}), env, {})
    keyed, logs = factors
    assert (keyed.name, keyed.baked, keyed.here, keyed.causes_miss) == (
        "env.TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS",
        "0",
        None,
        True,
    )
    assert keyed.note.startswith("kiln.env exports TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS=0,")
    assert (logs.name, logs.here, logs.matches, logs.causes_miss) == (
        "env.TORCH_LOGS",
        None,
        False,
        False,
    )
    same = {"TORCHINDUCTOR_CPP_CACHE_PRECOMPILE_HEADERS": "0", "TORCH_LOGS": "recompiles"}
    matching = compare(baked, {"env": dict(baked["env"])})
    assert exported_env_factors(matching, env, same) == matching
