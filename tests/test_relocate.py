"""Restore points Triton's cache groups at DEST: a restored kernel is found where it now lives."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.artifact.relocate import GROUP_PREFIX, is_group
from kiln.artifact.restore import read_installed, restore
from kiln.layout import STATE_NAME
from tests.archives import good_archive

BAKED = "/tmp/kiln-bake-0/demo/inductor/triton/0/ABC"  # where the bake's Triton wrote them
KERNEL = "inductor/triton/0/ABC"
GROUP = f"{KERNEL}/{GROUP_PREFIX}triton_poi_0.json"
CHILDREN = ("triton_poi_0.cubin", "triton_poi_0.json", "triton_poi_0.ptx")


def _files(group: bytes | None = None) -> dict[str, bytes]:
    """A kernel as Triton's FileCacheManager files it: the children, then put_group's JSON."""
    files = {f"{KERNEL}/{name}": name.encode() * 8 for name in CHILDREN}
    if group is None:
        group = json.dumps({"child_paths": {n: f"{BAKED}/{n}" for n in CHILDREN}}).encode()
    files[GROUP] = group
    files["inductor/fxgraph/a/entry"] = b"A" * 100
    return files


def _found(group: Path) -> dict[str, str]:
    """What Triton's ``FileCacheManager.get_group`` returns: the children whose path exists."""
    children = json.loads(group.read_text())["child_paths"]
    return {c: p for c, p in children.items() if Path(p).exists()}


def test_groups_name_their_files_where_restore_put_them(tmp_path: Path) -> None:
    art = good_archive(tmp_path / "a.kiln.tar.zst", _files())
    for where in ("one", "two"):
        dest = tmp_path / where / "cache"
        restore(art, dest)
        found = _found(dest / GROUP)
        assert found == {n: str(dest / KERNEL / n) for n in CHILDREN}
        installed = read_installed(dest)
        assert installed is not None and not installed.changes
        assert [e.path for e in installed.relocated] == [GROUP]
        assert restore(art, dest).noop  # what restore rewrote is no change


def test_a_max_autotune_cache_of_hundreds_of_groups_stays_installed(tmp_path: Path) -> None:
    """H100, tiny-gpt-cuda-tuned: 594 relocated groups made restore's state file pass the 64 KiB
    its reader allowed; the install then read as absent, so verify of a fresh restore named
    every group as changed (exit 6) and a repeat restore installed again."""
    files: dict[str, bytes] = {}
    for i in range(600):
        kernel = f"inductor/triton/0/{'K' * 52}{i:04d}"
        children = {n: f"/tmp/kiln-bake-0/demo/{kernel}/{n}" for n in CHILDREN}
        files.update({f"{kernel}/{n}": n.encode() for n in CHILDREN})
        files[f"{kernel}/{GROUP_PREFIX}triton_poi_{i}.json"] = json.dumps(
            {"child_paths": children}
        ).encode()
    art = good_archive(tmp_path / "a.kiln.tar.zst", files)
    dest = tmp_path / "cache"
    restore(art, dest)
    assert (dest / STATE_NAME).stat().st_size > 64 << 10
    installed = read_installed(dest)
    assert installed is not None and len(installed.relocated) == 600
    assert not installed.changes
    assert restore(art, dest).noop


def test_a_group_edited_after_restore_is_a_change(tmp_path: Path) -> None:
    art = good_archive(tmp_path / "a.kiln.tar.zst", _files())
    dest = tmp_path / "cache"
    restore(art, dest)
    (dest / GROUP).write_text(json.dumps({"child_paths": {"x": "/elsewhere/x"}}))
    installed = read_installed(dest)
    assert installed is not None and installed.changes.changed == [GROUP]
    again = restore(art, dest)
    assert not again.noop and set(_found(dest / GROUP)) == set(CHILDREN)


def test_groups_kiln_cannot_place_are_left_as_baked(tmp_path: Path) -> None:
    """A child that is not a file of the group's folder, or JSON of another shape: untouched
    (Triton compiles that kernel, and verify counts it), and the restore still succeeds."""
    odd = {
        "elsewhere": json.dumps({"child_paths": {"x.so": "/usr/lib/x.so"}}).encode(),
        "not json": b"\xff\x00 not json",
        "no children": json.dumps({"other": 1}).encode(),
        "a list": b"[1, 2]",
    }
    for label, group in odd.items():
        dest = tmp_path / label.replace(" ", "-")
        restore(good_archive(tmp_path / f"{dest.name}.kiln.tar.zst", _files(group)), dest)
        assert (dest / GROUP).read_bytes() == group, label
        installed = read_installed(dest)
        assert installed is not None and installed.relocated == () and not installed.changes


def test_only_triton_group_names_count() -> None:
    assert is_group(GROUP)
    assert not is_group(f"{KERNEL}/triton_poi_0.json")
    assert not is_group(f"{KERNEL}/{GROUP_PREFIX}x.cubin")


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    group=st.one_of(
        st.binary(max_size=300),
        st.recursive(
            st.none() | st.booleans() | st.integers() | st.text(max_size=20),
            lambda inner: (
                st.lists(inner, max_size=4)
                | st.dictionaries(st.text(max_size=12), inner, max_size=4)
            ),
            max_leaves=12,
        ).map(lambda v: json.dumps({"child_paths": v}).encode()),
    )
)
def test_any_group_content_restores(tmp_path_factory, group: bytes) -> None:
    """A group is the artifact's (digest-checked, maybe signed) but kiln parses it: no content
    makes a restore fail; it is rewritten only into Triton's shape, naming files that exist."""
    tmp = tmp_path_factory.mktemp("fuzz")
    dest = tmp / "cache"
    restore(good_archive(tmp / "a.kiln.tar.zst", _files(group)), dest)
    now = (dest / GROUP).read_bytes()
    if now != group:
        children = json.loads(now)["child_paths"]
        assert all(Path(p).is_file() and Path(p).parent == dest / KERNEL for p in children.values())
    installed = read_installed(dest)
    assert installed is not None and not installed.changes
