"""The hostile-archive corpus (tests/archives.py): every entry is exit 3 with DEST untouched.

Also the two ways untrusted text used to escape: into ``kiln.env`` (a shell runs it) and into
rich markup (a member name crashed the error printer, a pattern lost its brackets).
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from kiln.artifact.archive import read_manifest, write_artifact
from kiln.artifact.restore import restore
from kiln.errors import IntegrityError, UsageError
from kiln.layout import ENV_NAME, MAX_MANIFEST_BYTES
from tests.archives import (
    FILES,
    HOSTILE,
    HOSTILE_BUNDLES,
    MARKUP,
    Hostile,
    manifest_for,
    reg,
    tree,
    write_archive,
)

BY_ID = {h.id: h for h in HOSTILE}


def leftovers(dest: Path) -> list[str]:
    return [p.name for p in dest.parent.iterdir() if ".kiln-" in p.name]


@pytest.mark.parametrize("case", HOSTILE, ids=[h.id for h in HOSTILE])
def test_restore_refuses_hostile_archive(tmp_path: Path, installed: Path, case: Hostile) -> None:
    art = case.build(tmp_path / f"{case.id}.kiln.tar.zst")
    before = tree(installed)
    t0 = time.monotonic()
    with pytest.raises(IntegrityError, match=case.match):
        restore(art, installed)
    assert time.monotonic() - t0 < 5, "refused, but only after reading far too much"
    assert tree(installed) == before
    assert leftovers(installed) == []


@pytest.mark.parametrize(
    "case",
    [h for h in HOSTILE if h.manifest_level],
    ids=[h.id for h in HOSTILE if h.manifest_level],
)
def test_read_manifest_refuses_hostile_archive(tmp_path: Path, case: Hostile) -> None:
    art = case.build(tmp_path / f"{case.id}.kiln.tar.zst")
    with pytest.raises(IntegrityError, match=case.match):
        read_manifest(art)


@pytest.mark.parametrize("case", HOSTILE_BUNDLES, ids=[h.id for h in HOSTILE_BUNDLES])
def test_restore_refuses_hostile_bundle(tmp_path: Path, installed: Path, case: Hostile) -> None:
    """A bundle is read as rigorously as an artifact: exit 3, DEST untouched, quickly."""
    from kiln.artifact.machine import Machine

    art = case.build(tmp_path / f"{case.id}.kiln.tar.zst")
    before = tree(installed)
    t0 = time.monotonic()
    with pytest.raises(IntegrityError, match=case.match):
        restore(art, installed, machine=Machine())  # a CPU machine: the cpu variant is chosen
    assert time.monotonic() - t0 < 5, "refused, but only after reading far too much"
    assert tree(installed) == before
    assert leftovers(installed) == []


@pytest.mark.parametrize(
    "case",
    [h for h in HOSTILE_BUNDLES if h.manifest_level],
    ids=[h.id for h in HOSTILE_BUNDLES if h.manifest_level],
)
def test_inspect_refuses_hostile_bundle(tmp_path: Path, case: Hostile) -> None:
    from kiln.artifact.bundle import read_head

    art = case.build(tmp_path / f"{case.id}.kiln.tar.zst")
    with pytest.raises(IntegrityError, match=case.match):
        read_head(art)


def test_cli_hostile_bundle_is_exit_3(tmp_path: Path, installed: Path, cli) -> None:
    by_id = {h.id: h for h in HOSTILE_BUNDLES}
    art = by_id["bundle-gpu-control"].build(tmp_path / "evil.kiln.tar.zst")
    for args in (("inspect", art), ("restore", art, "--dest", installed, "--variant", "cpu")):
        r = cli(*args, no_torch=True)
        assert r.returncode == 3, r.stderr
        assert "Traceback" not in r.stderr
        assert "\\x1b[2J" in r.stderr and "\x1b" not in r.stderr  # shown escaped, not obeyed


# --- item 1: kiln.env injection through the manifest -------------------------------------------


@pytest.mark.parametrize(
    "case_id", ["env-key-injection", "env-ld-preload", "env-cache-dir", "name-newline"]
)
def test_cli_refuses_env_injection_and_nothing_runs(
    tmp_path: Path, installed: Path, cli, case_id: str
) -> None:
    art = BY_ID[case_id].build(tmp_path / "evil.kiln.tar.zst")
    before = tree(installed)
    r = cli("restore", art, "--dest", installed, no_torch=True)
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr
    assert tree(installed) == before
    # The pod sources whatever kiln.env DEST holds: it must still be the old, harmless one.
    sourced = subprocess.run(
        ["bash", "-c", f". {installed / ENV_NAME} && echo $TORCHINDUCTOR_CACHE_DIR"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert sourced.stdout.strip() == str(installed / "inductor")
    assert not list(tmp_path.rglob("pwned"))


def test_allowed_env_value_is_quoted_when_sourced(tmp_path: Path) -> None:
    """An allowed key with a hostile value restores, and sourcing kiln.env only sets it."""
    value = "$(touch pwned) `touch pwned`; touch pwned\n'"
    art = write_archive(
        tmp_path / "a.kiln.tar.zst",
        manifest_for(FILES, env={"TORCHINDUCTOR_FREEZING": value}),
        [reg(p, d) for p, d in sorted(FILES.items())],
    )
    dest = tmp_path / "cache"
    restore(art, dest)
    out = subprocess.run(
        ["bash", "-c", f'. {dest / ENV_NAME} && printf %s "$TORCHINDUCTOR_FREEZING"'],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout == value
    assert not list(tmp_path.rglob("pwned"))


# --- item 4: untrusted text is never rich markup -------------------------------------------------


def test_cli_markup_member_name_is_exit_3_and_shown_intact(
    tmp_path: Path, installed: Path, cli
) -> None:
    art = BY_ID["markup-name"].build(tmp_path / "m.kiln.tar.zst")
    r = cli("restore", art, "--dest", installed, no_torch=True)
    assert r.returncode == 3, r.stderr
    assert "Traceback" not in r.stderr
    assert f"'{MARKUP}': sha256 differs" in r.stderr
    # The same name refused by the manifest reader (listed twice), through inspect.
    data = manifest_for({MARKUP: b"x"}).model_dump(mode="json")
    data["files"] *= 2
    twice = write_archive(tmp_path / "twice.kiln.tar.zst", data, [])
    r = cli("inspect", twice, no_torch=True)
    assert r.returncode == 3, r.stderr
    assert f"'{MARKUP}' is listed twice" in r.stderr


def test_cli_spec_pattern_error_shown_intact(tmp_path: Path, cli) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: Bad Name\nmodel:\n  factory: models.py:f\n")
    r = cli("bake", spec, no_torch=True)
    assert r.returncode == 2, r.stderr
    assert "^[a-z0-9._-]+$" in r.stderr


def test_cli_inspect_shows_manifest_fields_verbatim(tmp_path: Path, cli) -> None:
    """Markup, emoji codes and terminal escapes in a manifest are shown, never interpreted."""
    fingerprint = {
        "gpu.name": "[bold]GPU[/bold] :smile:",
        "cpu.model": "\x1b]0;owned\x07\x1b[2J",
        "env": {"TORCH_X": "[/]"},
    }
    manifest = manifest_for(
        FILES, fingerprint=fingerprint, created="[red]today", kiln_version="[/bold]"
    )
    manifest.files[0].kind = "[/kind]"
    art = write_archive(
        tmp_path / "a.kiln.tar.zst", manifest, [reg(p, d) for p, d in sorted(FILES.items())]
    )
    r = cli("inspect", art, no_torch=True)
    assert r.returncode == 0, r.stderr
    for shown in ("[bold]GPU[/bold] :smile:", "created [red]today", "kiln [/bold]", "[/kind]"):
        assert shown in r.stdout
    assert "│ [/]" in r.stdout
    assert "\x1b" not in r.stdout and "\\x1b]0;owned\\x07\\x1b[2J" in r.stdout


# --- item 6: paths, entries and sizes that were exit 1 --------------------------------------------


@pytest.mark.parametrize(
    "case_id",
    [
        "path-5000",
        "member-5000",
        "file-and-folder",
        "reserved-env",
        "reserved-state",
        "duplicate-conflicting",
        "manifest-9mib",
    ],
)
def test_cli_unsafe_entries_are_exit_3(tmp_path: Path, installed: Path, cli, case_id: str) -> None:
    case = BY_ID[case_id]
    art = case.build(tmp_path / "evil.kiln.tar.zst")
    before = tree(installed)
    r = cli("restore", art, "--dest", installed, no_torch=True)
    assert r.returncode == 3, r.stderr
    assert len(r.stderr.splitlines()) == 1 and len(r.stderr) < 400, r.stderr
    assert tree(installed) == before
    if case.manifest_level:
        assert cli("inspect", art, no_torch=True).returncode == 3


def test_manifest_size_refused_from_its_header(tmp_path: Path) -> None:
    """The 9 MiB archive holds only the manifest's header, no body: refusing it as too large
    (not as truncated) shows the size was judged before a byte of the manifest was read."""
    art = BY_ID["manifest-9mib"].build(tmp_path / "big.kiln.tar.zst")
    assert art.stat().st_size < 4096
    with pytest.raises(IntegrityError, match=f"more than kiln reads \\({MAX_MANIFEST_BYTES}\\)"):
        read_manifest(art)


def test_oversized_manifest_in_restored_folder_refused(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / "manifest.json").write_bytes(b" " * (MAX_MANIFEST_BYTES + 1))
    with pytest.raises(IntegrityError, match="more than kiln reads"):
        read_manifest(folder)


def test_write_artifact_refuses_a_manifest_no_reader_would_accept(tmp_path: Path) -> None:
    manifest = manifest_for({}, fingerprint={"padding": "x" * MAX_MANIFEST_BYTES})
    out = tmp_path / "out.kiln.tar.zst"
    with pytest.raises(UsageError, match="more than restore accepts"):
        write_artifact(out, manifest, tmp_path)
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_valid_archive_still_restores(tmp_path: Path) -> None:
    """The bounds leave real archives alone: deep-ish paths, folder entries, non-ASCII names."""
    files = {
        "inductor/triton/0/" + "h" * 52 + "/k.cubin": b"\x7fELF",
        "inductor/fxgraph/ab/é/entry": b"fx",
        "megacache.bin": b"blob",
    }
    manifest = manifest_for(files, megacache="megacache.bin")
    folder = reg("inductor/fxgraph", b"")[0]
    folder.type = b"5"
    members = [(folder, b""), *(reg(p, d) for p, d in sorted(files.items()))]
    art = write_archive(tmp_path / "ok.kiln.tar.zst", manifest, members)
    result = restore(art, tmp_path / "cache")
    assert result.files == 3
    assert json.loads((tmp_path / "cache/manifest.json").read_text())["megacache"] == (
        "megacache.bin"
    )


# --- README: the threat model says what these tests enforce ------------------------------------


def test_readme_threat_model_matches_the_rules() -> None:
    """Item 12 and the allow-list: docs/restore.md (linked from the README) states them, in
    sync with kiln.envrules."""
    from kiln.envrules import CACHE_LOCATION_VARS, ENV_ALLOWED_PREFIXES

    readme = (Path(__file__).resolve().parent.parent / "docs/restore.md").read_text()
    code_is = readme.index("*A compile cache is code*")
    spec_is = readme.index("*A spec is code too*")
    assert 0 < spec_is - code_is < 3000, "say it next to 'a compile cache is code'"
    said = readme[spec_is : spec_is + 400]
    for word in ("`bake`", "`verify`", "`bench`", "factory", "`restore`", "`inspect`"):
        assert word in said
    for prefix in ENV_ALLOWED_PREFIXES:
        assert f"`{prefix}*`" in readme
    for var in CACHE_LOCATION_VARS - {"TORCHINDUCTOR_REDIS_HOST", "TORCHINDUCTOR_REDIS_PORT"}:
        assert f"`{var}`" in readme, var


@pytest.mark.parametrize(
    "key",
    ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "CUDA_VISIBLE_DEVICES", "TRITON_KERNEL_OVERRIDE"],
)
def test_prefix_allowed_variables_that_are_not_about_compiled_code_are_refused(key: str) -> None:
    """A review found these pass the prefix rule while changing what the server trusts or sees."""
    from kiln.envrules import env_key_problem

    assert env_key_problem(key) is not None
    assert env_key_problem("TORCHINDUCTOR_MAX_AUTOTUNE") is None
