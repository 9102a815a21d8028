"""kiln.layout: one rule for where a rank's caches and an artifact's own files live, the same in a
bake's work folder, an archive's member names and a restored folder."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kiln import layout as layout_module
from kiln.layout import CacheLayout, lock_links, rank_of
from kiln.serving import cache_env
from tests.conftest import ROOT as REPO

ROOT = Path("/srv/cache")


def test_a_one_rank_layout_is_the_root_itself() -> None:
    layout = CacheLayout(ROOT)
    assert layout.dir == ROOT
    assert layout.inductor == ROOT / "inductor"
    assert layout.triton_home == ROOT / "triton-home"
    assert layout.cuda_cache == ROOT / "cuda-cache"
    assert layout.megacache == ROOT / "megacache.bin"
    assert layout.precompiled == ROOT / "precompiled.bin"
    assert layout.frames == ROOT / "inductor/dynamo"
    assert layout.locks == ROOT / "inductor/locks"
    assert layout.aoti == ROOT / "aoti"
    assert layout.prefix == ""


def test_a_rank_keeps_the_same_layout_in_its_own_folder() -> None:
    layout = CacheLayout(ROOT, 3)
    assert layout.dir == ROOT / "ranks/3"
    assert layout.inductor == ROOT / "ranks/3/inductor"
    assert layout.triton_home == ROOT / "ranks/3/triton-home"
    assert layout.cuda_cache == ROOT / "ranks/3/cuda-cache"
    assert layout.megacache == ROOT / "ranks/3/megacache.bin"
    assert layout.precompiled == ROOT / "ranks/3/precompiled.bin"
    assert layout.locks == ROOT / "ranks/3/inductor/locks"
    assert layout.aoti == ROOT / "ranks/3/aoti"
    assert layout.prefix == "ranks/3/"


@pytest.mark.parametrize("rank", [None, 0, 5])
def test_the_artifacts_own_files_are_at_the_root_whatever_the_rank(rank: int | None) -> None:
    layout = CacheLayout(ROOT, rank)
    assert layout.manifest == ROOT / "manifest.json"
    assert layout.env_file == ROOT / "kiln.env"
    assert layout.state_file == ROOT / ".kiln-installed.json"
    assert layout.bytecode == ROOT / "bytecode"
    assert layout.ranks_dir == ROOT / "ranks"


@pytest.mark.parametrize("root", [ROOT, Path()])
def test_member_names_are_posix_and_relative_to_the_root(root: Path) -> None:
    one, rank = CacheLayout(root), CacheLayout(root, 1)
    assert one.member(one.megacache) == "megacache.bin"
    assert one.member(one.frames) == "inductor/dynamo"
    assert rank.member(rank.precompiled) == "ranks/1/precompiled.bin"
    assert rank.member(rank.dir) == rank.prefix.rstrip("/")
    assert rank.prefix + "inductor/x" == rank.member(rank.inductor / "x")


def test_ranks_lists_every_ranks_layout() -> None:
    assert CacheLayout.ranks(ROOT, None) == [CacheLayout(ROOT)]
    assert [layout.dir for layout in CacheLayout.ranks(ROOT, 3)] == [
        ROOT / "ranks/0",
        ROOT / "ranks/1",
        ROOT / "ranks/2",
    ]


@pytest.mark.parametrize("world", [None, 1, 4])
def test_of_dir_finds_the_layout_whose_folder_it_is(world: int | None) -> None:
    for layout in CacheLayout.ranks(ROOT, world):
        assert CacheLayout.of_dir(layout.dir) == layout


@pytest.mark.parametrize("name", ["01", "x", "-1", "९"])
def test_of_dir_takes_a_folder_that_is_no_rank_as_a_root(name: str) -> None:
    folder = ROOT / "ranks" / name
    assert CacheLayout.of_dir(folder) == CacheLayout(folder)


def test_lock_links_are_each_ranks_lock_folder() -> None:
    assert lock_links(None) == ["inductor/locks"]
    assert lock_links(1) == ["ranks/0/inductor/locks"]  # distributed: {world_size: 1}
    assert lock_links(2) == ["ranks/0/inductor/locks", "ranks/1/inductor/locks"]


@pytest.mark.parametrize("rank", [None, 0, 2])
def test_a_served_process_caches_where_the_layout_says(rank: int | None) -> None:
    env = cache_env(ROOT, {}, rank)
    layout = CacheLayout(ROOT, rank)
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(layout.inductor)
    assert env["TRITON_HOME"] == str(layout.triton_home)
    assert env["CUDA_CACHE_PATH"] == str(layout.cuda_cache)
    assert env["KILN_CACHE_DIR"] == str(ROOT)


@given(st.integers(0, 63), st.sampled_from(["inductor/a", "megacache.bin", "aoti/0/x.so"]))
def test_rank_of_reads_back_the_rank_of_every_members_name(rank: int, name: str) -> None:
    layout = CacheLayout(Path(), rank)
    assert rank_of(layout.member(layout.dir / name)) == rank
    assert rank_of(CacheLayout(Path()).member(Path(name))) is None


@given(st.text(alphabet=st.sampled_from("ranks/0123456789९x-. "), max_size=24) | st.text())
def test_rank_of_any_text_is_a_rank_only_under_that_ranks_folder(path: str) -> None:
    """A manifest's paths are untrusted: any text gives None or the rank its prefix spells."""
    rank = rank_of(path)
    if rank is not None:
        assert path.startswith(f"ranks/{rank}/")
        assert path.count("/") >= 2


def test_no_module_but_the_layout_joins_a_layout_name_onto_a_path() -> None:
    """``folder / INDUCTOR_DIR`` and the like belong in CacheLayout (issue 28): a hand join
    elsewhere is how a rank's folder or a new cache folder gets missed in one place."""
    names = {n for n in vars(layout_module) if n.endswith(("_DIR", "_NAME"))}
    src = REPO / "src" / "kiln"
    joins = [
        f"{path.relative_to(src)}:{node.lineno}"
        for path in src.rglob("*.py")
        if path != src / "layout.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.Div)
        and {n.id for n in ast.walk(node.right) if isinstance(n, ast.Name)} & names
    ]
    assert "INDUCTOR_DIR" in names and "RANKS_DIR" in names
    assert joins == []
