"""Multi-rank (tensor-parallel) models (issue 15): the spec section, the per-rank layout and its
copies in the manifest, restore of a K-rank artifact, ``kiln.env`` sourced per rank, the rank
factors of ``kiln check``, sharded K-rank bakes merged rank by rank by ``kiln merge``, and
real 2-rank gloo bakes (whole, and as 2 merged shards) → restore → verify on the CPU."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from kiln.artifact.archive import parse_manifest, read_manifest
from kiln.artifact.manifest import FileEntry, Manifest
from kiln.artifact.restore import restore
from kiln.errors import IntegrityError, KilnError, SpecError, UsageError
from kiln.layout import lock_links
from kiln.serving import cuda_cache_copy, env_file_text, serving_rank
from kiln.spec import parse_spec
from tests.archives import reg, tree, write_archive
from tests.conftest import MODELS, hard_limit, once, shared_dir

ROOT = Path(__file__).resolve().parent.parent


def tp_spec(world: str = "{world_size: 2, backend: gloo}", extra: str = "") -> str:
    """A 2-rank tensor-parallel MLP spec (line 11 is ``distributed``)."""
    return "\n".join(
        [
            "name: tp-mlp",
            "model:",
            f"  factory: {MODELS}:tp_mlp",
            "  kwargs: {dim: 16, hidden: 64" + extra + "}",
            "compile:",
            "  dynamic: false",
            "inputs:",
            "  - {name: x, shape: [batch, 16], dtype: float32, fill: randn}",
            "buckets:",
            "  batch: [1, 4]",
            f"distributed: {world}",
            "warmup: {calls: 2}",
            "",
        ]
    )


# --- the spec ------------------------------------------------------------------------------
def test_distributed_section_parses() -> None:
    spec = parse_spec(tp_spec())
    assert spec.distributed is not None
    assert (spec.world_size, spec.distributed.backend) == (2, "gloo")
    assert spec.canonical()["distributed"] == {"world_size": 2, "backend": "gloo"}


def test_a_one_rank_spec_keeps_its_digest() -> None:
    """No ``distributed`` key in the canonical form: 1-rank artifacts still match their specs."""
    text = tp_spec().replace("distributed: {world_size: 2, backend: gloo}\n", "")
    spec = parse_spec(text)
    assert spec.distributed is None and spec.world_size == 1
    assert "distributed" not in spec.canonical()


@pytest.mark.parametrize(
    ("world", "extra", "where", "says"),
    [
        ("{world_size: 0, backend: gloo}", "", "11:15: distributed.world_size", "greater than"),
        ("{world_size: 65, backend: gloo}", "", "distributed.world_size", "less than"),
        ("{world_size: 2, backend: mpi}", "", "11:30: distributed.backend", "gloo"),
        ("{world_size: 2, backend: nccl}", "", "distributed.backend", "nccl needs"),
        ("{world_size: 2}", "", "distributed.backend", "required"),
        ("{world_size: 2, backend: gloo, ranks: 2}", "", "distributed.ranks", "unknown key"),
        ("{world_size: 2, backend: gloo}", ", rank: 1", "model.kwargs.rank", "passed by kiln"),
    ],
)
def test_distributed_errors_are_located(world: str, extra: str, where: str, says: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(tp_spec(world, extra), file="tp.yaml")
    assert where in str(info.value) and says in str(info.value)


# --- kiln.env, sourced by a real shell per rank ------------------------------------------
HOSTILE_DEST = Path("/tmp/it's $(touch pwned) `x` here/cache")


def _copy_digest(dest: Path) -> bytes:
    return cuda_cache_copy(dest, None, {}).name.rsplit("-", 1)[1].encode()


def _source(text: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "kiln.env").write_text(text)
    script = (
        f'. "{tmp_path}/kiln.env"; printf "%s|%s" "${{TORCHINDUCTOR_CACHE_DIR-}}" "$KILN_CACHE_DIR"'
    )
    return subprocess.run(
        ["sh", "-euc", script],
        env={"PATH": "/usr/bin:/bin", **env},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )


@pytest.mark.parametrize(
    ("env", "rank"),
    [({"RANK": "0"}, "0"), ({"RANK": "1"}, "1"), ({"LOCAL_RANK": "1"}, "1"), ({"RANK": ""}, None)],
)
def test_kiln_env_picks_the_rank_folder_when_sourced(
    tmp_path: Path, env: dict[str, str], rank: str | None
) -> None:
    proc = _source(env_file_text(HOSTILE_DEST, "tp", {"TORCH_X": "a'b"}, 2), tmp_path, **env)
    cache_dir, kiln_dir = proc.stdout.split("|")
    assert kiln_dir == str(HOSTILE_DEST)
    if rank is None:
        assert cache_dir == "" and "not a rank of this 2-rank artifact" in proc.stderr
    else:
        assert cache_dir == f"{HOSTILE_DEST}/ranks/{rank}/inductor"
    assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize("value", ["2", "01", "-1", "1 ", "$(touch pwned)", "`touch pwned`", "९"])
def test_kiln_env_refuses_a_rank_outside_the_artifact(tmp_path: Path, value: str) -> None:
    proc = _source(env_file_text(HOSTILE_DEST, "tp", {}, 2), tmp_path, RANK=value)
    assert proc.stdout.split("|")[0] == ""
    assert "not a rank of this 2-rank artifact" in proc.stderr
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(ValueError, match="not a rank"):
        serving_rank(2, {"RANK": value})


def test_one_rank_kiln_env_is_unchanged() -> None:
    assert "RANK" not in env_file_text(Path("/c"), "x", {})


def test_a_one_rank_distributed_kiln_env_points_at_its_rank_folder(tmp_path: Path) -> None:
    """``distributed: {world_size: 1}`` bakes into ranks/0/: kiln.env must point there (it
    pointed at an empty DIR/inductor, and a server sourcing it missed every cache)."""
    proc = _source(env_file_text(HOSTILE_DEST, "tp", {}, 1), tmp_path, RANK="0")
    assert proc.stdout.split("|")[0] == f"{HOSTILE_DEST}/ranks/0/inductor"


# --- the manifest's per-rank layout and copies -------------------------------------------
def _entry(path: str, data: bytes) -> dict[str, Any]:
    return {
        "path": path,
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "kind": "x",
    }


STORED = {"ranks/0/inductor/a.py": b"code\n", "ranks/1/inductor/b.so": b"\x7fELF rank 1"}
COPIES = [{"path": "ranks/1/inductor/a.py", "source": "ranks/0/inductor/a.py"}]


def rank_manifest(**changes: Any) -> dict[str, Any]:
    fp = {"device.type": "cpu"}
    data: dict[str, Any] = {
        "format": 2,
        "name": "tp",
        "created": "1970-01-01T00:00:00+00:00",
        "spec": {},
        "spec_sha256": "0" * 64,
        "fingerprint": fp,
        "grid": [],
        "files": [_entry(p, d) for p, d in sorted(STORED.items())],
        "copies": COPIES,
        "distributed": {
            "world_size": 2,
            "backend": "gloo",
            "ranks": [{"rank": 0, "fingerprint": fp}, {"rank": 1, "fingerprint": fp}],
        },
    }
    return {**data, **changes}


def test_a_rank_manifest_validates_and_counts_its_copies() -> None:
    m = Manifest.model_validate(rank_manifest())
    assert m.world_size == 2 and len(m.entries()) == 3
    assert m.total_bytes == m.stored_bytes + len(b"code\n")


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"format": 1}, "need format 2"),
        ({"distributed": None}, "only for the ranks"),
        ({"copies": [{"path": "ranks/1/x", "source": "ranks/1/y"}]}, "not a stored file"),
        ({"copies": [{"path": "ranks/1/x", "source": "ranks/1/inductor/a.py"}]}, "not a stored"),
        ({"copies": [*COPIES, *COPIES]}, "listed twice"),
        (
            {"copies": [{"path": "ranks/0/inductor/a.py", "source": "ranks/0/inductor/a.py"}]},
            "twice",
        ),
        ({"copies": [{"path": "ranks/1/../../x", "source": "ranks/0/inductor/a.py"}]}, "traversal"),
        ({"copies": [{"path": "/etc/x", "source": "ranks/0/inductor/a.py"}]}, "absolute"),
        ({"copies": [{"path": "kiln.env", "source": "ranks/0/inductor/a.py"}]}, "writes"),
        (
            {"copies": [{"path": "ranks/1/inductor/b.so/x", "source": "ranks/0/inductor/a.py"}]},
            "file and as a folder",
        ),
        ({"copies": [{"path": "ranks/2/a.py", "source": "ranks/0/inductor/a.py"}]}, "no rank"),
        ({"copies": [{"path": "inductor/a.py", "source": "ranks/0/inductor/a.py"}]}, "no rank"),
        # One bytecode tree at the root is the only thing outside the rank folders: a copy, or
        # a file of another kind, there is refused.
        (
            {"copies": [{"path": "bytecode/x.cpython-311.pyc", "source": "ranks/0/inductor/a.py"}]},
            "no rank",
        ),
        (
            {"files": [_entry(p, d) for p, d in STORED.items()] + [_entry("bytecode/x", b"")]},
            "no rank",
        ),
        ({"files": [_entry("inductor/a.py", b"")]}, "not a stored file"),
        ({"megacache": "ranks/1/inductor/b.so"}, "rank 0's"),
    ],
)
def test_hostile_rank_manifests_are_refused(changes: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        Manifest.model_validate(rank_manifest(**changes))


def test_a_rank_manifest_keeps_one_bytecode_tree_at_its_root_and_copies_none_of_it() -> None:
    """A stored pyc under ``bytecode/`` is the one thing a K-rank manifest may keep outside its
    rank folders; a copy of it into a rank folder (a pyc where Python never looks) is refused."""
    from tests.archives import PYC_TAG, pyc

    at, data, fields = pyc("/usr/lib/python3.12/json/decoder.py")
    stored = [_entry(p, d) for p, d in sorted(STORED.items())]
    stored.append({**_entry(at, data), **fields})
    bytecode = {"python": PYC_TAG, "modules": 1}
    m = Manifest.model_validate(rank_manifest(files=stored, bytecode=bytecode))
    assert [e.path for e in m.entries() if e.is_bytecode] == [at]
    copies = [*COPIES, {"path": "ranks/1/decoder.pyc", "source": at}]
    with pytest.raises(ValidationError, match="its source is bytecode"):
        Manifest.model_validate(rank_manifest(files=stored, bytecode=bytecode, copies=copies))


def test_hostile_rank_layouts_are_refused() -> None:
    ranks = rank_manifest()["distributed"]["ranks"]
    for distributed in (
        {"world_size": 2, "backend": "gloo", "ranks": ranks[:1]},
        {"world_size": 2, "backend": "gloo", "ranks": ranks[::-1]},
        {"world_size": 2, "backend": "gloo", "ranks": [ranks[0], {**ranks[1], "same_as": 1}]},
        {"world_size": 2, "backend": "gloo", "ranks": [ranks[0], {**ranks[1], "megacache": "x"}]},
        {"world_size": 99, "backend": "gloo", "ranks": ranks},
    ):
        with pytest.raises(ValidationError):
            Manifest.model_validate(rank_manifest(distributed=distributed))


def _rank_archive(path: Path, manifest: dict[str, Any] | None = None, **members: bytes) -> Path:
    files = {**STORED, **members}
    return write_archive(
        path, manifest or rank_manifest(), [reg(p, d) for p, d in sorted(files.items())]
    )


def test_restore_writes_each_copy_from_its_checked_source(tmp_path: Path) -> None:
    result = restore(_rank_archive(tmp_path / "a.kiln.tar.zst"), tmp_path / "cache")
    got = tree(tmp_path / "cache")
    assert got["ranks/1/inductor/a.py"] == got["ranks/0/inductor/a.py"] == b"code\n"
    assert got["ranks/1/inductor/b.so"] == STORED["ranks/1/inductor/b.so"]
    assert result.files == 3 and result.summary()["ranks"] == 2
    assert '/ranks/"$kiln_rank"/inductor' in got["kiln.env"].decode()
    assert '/ranks/"$kiln_rank"/cuda-cache' in got["kiln.env"].decode()
    # Copies, never links: a rank writing into its folder cannot change another rank's file.
    a, b = (tmp_path / "cache/ranks" / r / "inductor/a.py" for r in "01")
    assert not a.samefile(b) and a.stat().st_nlink == 1


def test_a_copy_is_not_a_member_of_the_archive(tmp_path: Path, installed: Path) -> None:
    """A member at a copy's path is unlisted (the copy is restore's to write): exit 3."""
    before = tree(installed)
    art = _rank_archive(tmp_path / "a.kiln.tar.zst", **{"ranks/1/inductor/a.py": b"evil"})
    with pytest.raises(IntegrityError, match="not in the manifest"):
        restore(art, installed)
    assert tree(installed) == before


# --- fuzzing the copies ---------------------------------------------------------------------
_PARTS = st.sampled_from(["ranks", "0", "1", "2", "inductor", "a.py", "..", ".", "", "kiln.env"])
_PATHS = st.lists(_PARTS, min_size=1, max_size=5).map("/".join) | st.sampled_from(
    [*STORED, "ranks/1/inductor/a.py", "ranks/1/new/c.py", "/abs", "ranks/0"]
)
FUZZ = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@FUZZ
@given(copies=st.lists(st.fixed_dictionaries({"path": _PATHS, "source": _PATHS}), max_size=4))
def test_fuzzed_copies_restore_exactly_the_manifest_or_nothing(
    tmp_path_factory: pytest.TempPathFactory, copies: list[dict[str, str]]
) -> None:
    """Whatever copies a manifest lists, restore installs exactly its entries (each copy with
    its source's bytes, inside DEST) or refuses with exit 3 and leaves DEST as it was."""
    tmp = tmp_path_factory.mktemp("fuzz")
    dest = tmp / "cache"
    restore(_rank_archive(tmp / "old.kiln.tar.zst"), dest)
    before = tree(dest)
    manifest = rank_manifest(copies=copies)
    try:
        with hard_limit(10):
            parsed = Manifest.model_validate(manifest)
    except ValidationError:
        parsed = None
    art = _rank_archive(tmp / "new.kiln.tar.zst", manifest)
    try:
        with hard_limit(10):
            restore(art, dest)
    except (IntegrityError, UsageError) as exc:
        assert parsed is None, exc
        assert tree(dest) == before
        return
    except KilnError as exc:  # pragma: no cover - any other kiln error is a finding
        pytest.fail(f"unexpected {type(exc).__name__}: {exc}")
    assert parsed is not None
    got = tree(dest)
    expected = {c.path: STORED[c.source] for c in parsed.copies} | STORED
    assert {p: d for p, d in got.items() if p.startswith("ranks/")} == expected
    own_links = {dest / link for link in lock_links(parsed.rank_world)}  # restore's own
    assert all(p.resolve().is_relative_to(dest) for p in dest.rglob("*") if p not in own_links)


# --- the bake's side, without compiling ---------------------------------------------------
def _file(path: str, data: bytes, kind: str = "code") -> FileEntry:
    return FileEntry(path=path, size=len(data), sha256=hashlib.sha256(data).hexdigest(), kind=kind)


def test_store_once_serves_a_rank_with_rank_0s_keys_from_rank_0s_files() -> None:
    from kiln.artifact.rank_copies import store_once

    def rank(r: int, entry: bytes, so: bytes) -> list[FileEntry]:
        return [
            _file(
                f"ranks/{r}/inductor/fxgraph/k1/{hashlib.md5(entry).hexdigest()}", entry, "fxgraph"
            ),
            _file(f"ranks/{r}/inductor/ab/cab.py", b"kernel"),
            _file(f"ranks/{r}/inductor/ab/cab.so", so, "native"),
        ]

    same = store_once([rank(0, b"t=1", b"so0"), rank(1, b"t=2", b"so1")])
    assert same.same_as == [None, 0] and len(same.files) == 3
    assert {c.source for c in same.copies} == {f.path for f in same.files}
    # Other keys (cuda:1 in them): only byte-identical files are shared.
    other = rank(1, b"t=2", b"so1")
    other[0] = _file("ranks/1/inductor/fxgraph/k2/e", b"t=2", "fxgraph")
    mixed = store_once([rank(0, b"t=1", b"so0"), other])
    assert mixed.same_as == [None, None] and len(mixed.files) == 5
    assert [c.path for c in mixed.copies] == ["ranks/1/inductor/ab/cab.py"]
    # Two of rank 0's files with equal bytes (seen on a CPU where two kernels' sources came out
    # the same): the second is a copy, and rank 1's copies point at the stored one.
    twin = [*rank(0, b"t=1", b"so0"), _file("ranks/0/inductor/cd/ccd.py", b"kernel")]
    both = store_once(
        [twin, [*rank(1, b"t=2", b"so1"), _file("ranks/1/inductor/cd/ccd.py", b"kernel")]]
    )
    assert both.same_as == [None, 0] and len(both.files) == 3
    assert {c.source for c in both.copies} == {f.path for f in both.files}


def test_rank_requests_move_every_path_into_the_rank_folder(tmp_path: Path) -> None:
    from kiln.compiler.protocol import WorkerRequest
    from kiln.compiler.ranks import rank_requests

    base = WorkerRequest(
        order=["batch=1"],
        torch_kwargs={},
        cache_root=str(tmp_path / "inductor"),
        megacache_save=str(tmp_path / "megacache.bin"),
    )
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "TORCH_X": "1"}
    one = rank_requests(base, env, 2)[1]
    assert one.cache_root == str(tmp_path / "ranks/1/inductor")
    assert one.megacache_save == str(tmp_path / "ranks/1/megacache.bin")
    assert one.env == {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ranks/1/inductor")}
    assert one.device_index == 1 and (tmp_path / "ranks/1/inductor").is_dir()


def test_check_names_a_world_size_or_rank_mismatch() -> None:
    from kiln.compiler.check import compare_manifest

    m = Manifest.model_validate(rank_manifest())
    here = {"device.type": "cpu"}
    assert compare_manifest(m, here, rank=1, world_size=2).ok
    wrong = compare_manifest(m, here, rank=1, world_size=4)
    assert [f.name for f in wrong.misses] == ["distributed.world_size"]
    assert "baked 2, here 4" in wrong.miss_message()
    outside = compare_manifest(m, here, rank=3, world_size=2)
    assert [f.name for f in outside.misses] == ["distributed.rank"]
    unknown = compare_manifest(m, here)
    assert unknown.ok and {f.name for f in unknown.factors} >= {"distributed.rank"}


def test_check_cli_names_the_mismatch_from_the_launch_environment(tmp_path: Path, cli: Any) -> None:
    dest = tmp_path / "cache"
    restore(_rank_archive(tmp_path / "a.kiln.tar.zst"), dest)
    proc = cli("check", dest, env={"RANK": "1", "WORLD_SIZE": "3"})
    assert proc.returncode == 5, proc.stderr
    assert "distributed.world_size (baked 2, here 3)" in proc.stderr


def test_activate_needs_the_rank_of_a_k_rank_artifact(tmp_path: Path, monkeypatch: Any) -> None:
    from kiln.compiler.activate import _rank

    m = parse_manifest(Manifest.model_validate(rank_manifest()).to_bytes())
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(UsageError, match="needs RANK or LOCAL_RANK"):
        _rank(tmp_path, m, None)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert _rank(tmp_path, m, None) == 1
    with pytest.raises(UsageError, match="not a rank"):
        _rank(tmp_path, m, 2)


# --- the real thing: 2 ranks, gloo, all_reduce in forward ----------------------------------
@pytest.fixture(scope="session")
def tp_benched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    """``kiln bench`` of ``tp_spec()`` (eager and kiln), once per run: its spec, the artifact its
    bake left in the work folder (a plain ``kiln.bake`` of the spec, proof included) and its
    report. The bench test reads the report; the restore-and-verify test serves the artifact."""
    import json

    import kiln

    folder = shared_dir(tmp_path_factory, "tp-bench")
    spec_path, saved = folder / "tp.yaml", folder / "report.json"
    with once(folder) as todo:
        if todo:
            spec_path.write_text(tp_spec())
            report = kiln.bench(spec_path, modes=("eager", "kiln"), workdir=folder / "work")
            saved.write_text(json.dumps(report.to_dict()))
    return spec_path, folder / "work" / "bench.kiln.tar.zst", json.loads(saved.read_text())


@pytest.mark.slow  # a bench's 2-rank bake (2 compiling ranks, a 2-rank proof), a 2-rank verify
def test_two_rank_bake_restore_verify_hits_on_both_ranks(tp_benched, tmp_path: Path) -> None:
    """Baked by 2 ranks under torchrun, restored at a new path, verified in the grid's order and
    the reverse one: zero compiles on both ranks; each rank's folder and fingerprint are in
    the manifest, and rank 1 (same keys on the CPU) is served from copies of rank 0's files."""
    import kiln
    from kiln.artifact.archive import sha256_file

    spec_path, artifact, _ = tp_benched
    m = read_manifest(artifact)
    assert m.format == 2 and m.distributed is not None and m.world_size == 2
    assert [r.rank for r in m.distributed.ranks] == [0, 1]
    assert all(r.fingerprint.get("device.type") == "cpu" for r in m.distributed.ranks)
    assert all(len(r.grid) == 2 for r in m.distributed.ranks)
    # Rank 1 is rank 0's cache: it stores nothing of its own (rank 0 may hold copies too).
    assert m.distributed.ranks[1].same_as == 0
    assert all(f.path.startswith("ranks/0/") for f in m.files)
    dest = tmp_path / "elsewhere" / "cache"
    kiln.restore(artifact, dest, sha256=sha256_file(artifact))
    assert (dest / "ranks/0/inductor").is_dir() and (dest / "ranks/1/inductor").is_dir()
    # Both orders a 2-bucket grid has: the bake's proof served the one its pass did not (the
    # reverse), here the grid's.
    assert m.proof is not None and m.proof.compiles == 0 and m.proof.order == ["batch=4", "batch=1"]
    report = kiln.verify(spec_path, dest, order="grid", routes=("plain",))
    assert report.ok, report.reasons()
    keys = {b.key for b in report.buckets}
    assert keys == {f"rank {r} · batch={n}" for r in (0, 1) for n in (1, 4)}
    assert all(b.fx_hits >= 1 for b in report.buckets)
    # A spec for another world size is refused before anything runs.
    other = tmp_path / "tp3.yaml"
    other.write_text(tp_spec("{world_size: 3, backend: gloo}").replace("64", "96"))
    with pytest.raises(KilnError, match="baked for 2 rank"):
        kiln.verify(other, dest)


@pytest.mark.slow  # a 2-rank bake (shared), then eager and kiln with 2 ranks each
def test_bench_runs_every_rank(tp_benched) -> None:
    """kiln bench of a 2-rank spec serves both ranks in each mode; the restored one compiles
    nothing on either rank."""
    _, _, report = tp_benched
    for mode in ("eager", "kiln"):
        keys = {b["key"] for b in report["modes"][mode]["buckets"]}
        assert keys == {f"rank {r} · batch={n}" for r in (0, 1) for n in (1, 4)}, keys
    assert report["modes"]["kiln"]["compiles"] == 0


def users_torchrun(*args: object) -> tuple[list[str], dict[str, str]]:
    """The command and environment of ``torchrun --standalone --nproc-per-node 2 ARGS``, as a
    user launches it (this checkout's kiln first on ``PYTHONPATH``)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", *map(str, args)]
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    return command, {**os.environ, "PYTHONPATH": path}


FOLLOWER = """
import json, os, sys
import kiln
result = kiln.bake(sys.argv[1], sys.argv[2], prove=False, passes=1)
fields = {"type": type(result).__name__, "rank": getattr(result, "rank", None),
          "world_size": getattr(result, "world_size", None),
          "message": getattr(result, "message", None),
          # where each rank's worker ran (kiln.workdir), as rank 0 collected them
          "workdirs": [r.workdir for run in getattr(result, "runs", []) for r in run.results]}
with open(f"{sys.argv[3]}.{os.environ['RANK']}.json", "w") as fh:
    json.dump(fields, fh)
"""


@pytest.mark.slow  # ~1 min: 2 library bakes of one bucket under torchrun
def test_bake_on_a_follower_rank_returns_what_it_did_not_none(tmp_path: Path) -> None:
    """``kiln.bake`` inside a user's launch: rank 0 returns the artifact's BakeResult; rank 1 a
    FollowerResult saying rank 0 writes it (issue 28: not None, for the CLI to explain)."""
    import json

    spec = tmp_path / "tp.yaml"
    text = (ROOT / "configs" / "tp-mlp-cpu.yaml").read_text().replace("[1, 4, 16]", "[4]")
    app = tmp_path / "app"  # every rank's worker runs there, the followers' too
    app.mkdir()
    text = text.replace("../examples/", f"{ROOT}/examples/") + f"serve: {{workdir: {app}}}\n"
    spec.write_text(text)
    script = tmp_path / "follower.py"
    script.write_text(FOLLOWER)
    out, report = tmp_path / "tp.kiln.tar.zst", tmp_path / "result"
    command, env = users_torchrun(script, spec, out, report)
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lead, follower = (json.loads(Path(f"{report}.{r}.json").read_text()) for r in (0, 1))
    assert lead["type"] == "BakeResult" and out.is_file()
    assert lead["workdirs"] == [str(app), str(app)]
    assert follower == {
        "type": "FollowerResult",
        "rank": 1,
        "world_size": 2,
        "message": "rank 1: baked; rank 0 writes the artifact",
        "workdirs": [],
    }


@pytest.mark.slow  # ~15 s: 2 kiln processes under torchrun, stopped while compiling
def test_sigterm_to_a_users_torchrun_stops_every_rank_and_removes_the_work_folder(
    tmp_path: Path,
) -> None:
    """SIGTERM to the user's launcher mid-bake: every kiln process kills its worker, rank 0
    removes the shared work folder, nothing is left running and no artifact is written."""
    import signal
    import tempfile
    import time

    name = "tp-mlp-sigterm"
    spec_path = tmp_path / "tp.yaml"
    spec_path.write_text(tp_spec().replace("name: tp-mlp", f"name: {name}"))
    work = Path(tempfile.gettempdir()) / f"kiln-bake-{os.getuid()}" / name
    out = tmp_path / "x.kiln.tar.zst"
    command, env = users_torchrun("-m", "kiln", "bake", spec_path, "-o", out)
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (work / "launch/0/rank1").is_dir():  # rank 1's worker is running
            assert proc.poll() is None and time.monotonic() < deadline, "never started"
            time.sleep(0.1)
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode != 0
    time.sleep(1)
    assert not work.exists() and not out.exists()
    left = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().decode(errors="replace")
        except OSError:
            continue
        if str(work) in text:
            left.append(text.replace("\0", " "))
    assert not left, left


def test_a_failed_lead_removes_nothing_before_a_running_followers_worker_is_dead(
    tmp_path: Path,
) -> None:
    """After a failure, rank 0 leaves the work folder only once every follower that started a
    worker for the last command has reported it dead; a follower that never started one is not
    waited for. (The SIGTERM test above races this on a real launch.)"""
    import threading
    import time

    from kiln.compiler import ranks, user_launch

    rank0 = ranks.Rank(rank=0, local_rank=0, world_size=3)
    started: dict[str, float] = {}

    def follower_dies_late(folder: Path) -> None:
        time.sleep(0.5)
        started["dead"] = time.monotonic()
        (folder / "done1").write_text("")

    with pytest.raises(RuntimeError), user_launch.lead(tmp_path, rank0) as session:
        session.issued = 1
        folder = tmp_path / user_launch.COMMANDS / "0"
        (folder / "rank1").mkdir(parents=True)  # rank 1 runs a worker; rank 2 never started one
        threading.Thread(target=follower_dies_late, args=(folder,), daemon=True).start()
        raise RuntimeError("SIGTERM")
    assert time.monotonic() >= started["dead"]
    assert (tmp_path / user_launch.END).read_text() == "failed"


def test_a_followers_running_worker_is_stopped_once_rank_0_ends(tmp_path: Path) -> None:
    """Rank 0 failing on its own (a timeout: no signal reaches the followers) ends a follower's
    running worker within a second, so rank 0's wait for its ``doneR`` is short."""
    import threading
    import time

    from kiln.compiler import user_launch
    from kiln.compiler.process import spawn

    ended = tmp_path / user_launch.END
    threading.Timer(0.3, ended.write_text, args=("failed",)).start()
    t0 = time.monotonic()
    command = [sys.executable, "-c", "import time; time.sleep(60)"]
    with pytest.raises(user_launch.RankZeroEnded):
        spawn(tmp_path, command, dict(os.environ), user_launch.until_ended(tmp_path), 0.5, None)
    assert time.monotonic() - t0 < 5


def test_a_follower_starts_no_worker_and_writes_nothing_more_once_rank_0_failed(
    tmp_path: Path,
) -> None:
    """A follower that finds a command's ``go`` but rank 0's failed END runs no worker, reports
    the command done (rank 0 may be waiting for it), and writes no bye into the folder rank 0
    is removing: its error is rank 0's failure."""
    from kiln.compiler import ranks, user_launch

    (tmp_path / user_launch.MARKER).write_text(user_launch.identity())
    folder = tmp_path / user_launch.COMMANDS / "0"
    folder.mkdir(parents=True)
    (folder / "go").write_text("")  # no env.json, no request: reading them would fail
    (tmp_path / user_launch.END).write_text("failed")
    rank1 = ranks.Rank(rank=1, local_rank=1, world_size=2)
    with pytest.raises(KilnError, match="rank 0's bake of tp-mlp failed"):
        user_launch.follow(parse_spec(tp_spec()), rank1, tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == ["done1", "go", "rank1"]
    assert not list(tmp_path.glob("launch.bye*"))


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_launch_of_another_size_than_the_spec_is_exit_2_naming_both(
    tmp_path: Path, cli: Any, rank: str
) -> None:
    """Inside a user's launch, a WORLD_SIZE other than the spec's is refused before anything
    runs, on every rank, naming both sizes."""
    spec_path = tmp_path / "tp.yaml"
    spec_path.write_text(tp_spec())
    env = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": "3"}
    proc = cli("bake", spec_path, "-o", tmp_path / "x.kiln.tar.zst", env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "WORLD_SIZE=3" in proc.stderr and "distributed.world_size=2" in proc.stderr
    assert not (tmp_path / "x.kiln.tar.zst").exists()


def test_a_rank_of_a_users_launch_waits_for_rank_0_without_the_lock(
    tmp_path: Path, cli: Any
) -> None:
    """Rank 1 never takes the work folder's lock (rank 0 holds it for the whole bake): with the
    lock held elsewhere and no rank 0, it gives up after its bounded wait, with a clear error,
    instead of blocking on the lock; and it writes no artifact."""
    import fcntl
    import tempfile

    spec_path = tmp_path / "tp.yaml"
    spec_path.write_text(tp_spec().replace("name: tp-mlp", "name: tp-mlp-follower"))
    base = Path(tempfile.gettempdir()) / f"kiln-bake-{os.getuid()}"
    base.mkdir(mode=0o700, exist_ok=True)
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "KILN_LAUNCH_TIMEOUT_S": "0.5"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
    with open(base / "tp-mlp-follower.lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        proc = cli("bake", spec_path, "-o", tmp_path / "x.kiln.tar.zst", env=env, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "waited 0.5s for rank 0 to start the bake of tp-mlp-follower" in proc.stderr
    assert "KILN_LAUNCH_TIMEOUT_S" in proc.stderr
    assert not (tmp_path / "x.kiln.tar.zst").exists()


def test_a_launch_without_master_addr_is_exit_2(tmp_path: Path, monkeypatch: Any) -> None:
    import kiln

    spec_path = tmp_path / "tp.yaml"
    spec_path.write_text(tp_spec())
    for var, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(UsageError, match="MASTER_ADDR missing"):
        kiln.bake(spec_path, tmp_path / "x.kiln.tar.zst")


def test_verify_inside_someone_elses_launch_is_still_refused(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Only bake follows a user's launch; verify and bench start their K ranks themselves."""
    from kiln.compiler.launch import run_worker
    from kiln.compiler.protocol import WorkerRequest
    from kiln.spec import load_spec

    spec_path = tmp_path / "tp.yaml"
    spec_path.write_text(tp_spec())
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    request = WorkerRequest(order=["batch=1"], torch_kwargs={}, calls=1)
    with pytest.raises(UsageError, match="starts the 2 ranks itself"):
        run_worker(load_spec(spec_path), request, {})


@pytest.mark.slow  # a fresh worker process (torch imported: ~4 s)
def test_a_factory_without_rank_kwargs_is_the_specs_problem(tmp_path: Path) -> None:
    import kiln

    spec_path = tmp_path / "tp.yaml"
    spec_path.write_text(
        tp_spec("{world_size: 1, backend: gloo}")
        .replace("tp_mlp", "tiny_mlp")
        .replace("hidden: 64", "hidden: 32")
    )
    with pytest.raises(SpecError, match="takes rank= and world_size="):
        kiln.bake(spec_path, tmp_path / "x.kiln.tar.zst")
    assert not (tmp_path / "x.kiln.tar.zst").exists()


# --- sharded K-rank bakes and kiln merge ---------------------------------------------------
RANK_FP = {"device.type": "cpu", "torch.version": "2.13.0+cpu", "python": "3.11.7"}


def rank_shard(
    tmp: Path,
    spec_path: Path,
    index: int,
    count: int,
    *,
    identical: bool = False,
    rank_fps: list[dict[str, Any]] | None = None,
    name: str | None = None,
    extra: dict[str, bytes] | None = None,
) -> Path:
    """Shard ``index``/``count`` of a 2-rank spec as `kiln bake --shard` writes it, by hand:
    per rank one FX entry per bucket it owns, a kernel every rank and shard compiled (stored
    once, the other rank's a copy), a Mega-Cache blob, and unless ``identical`` a file of the
    rank's own (so rank 1 is not rank 0's cache and only byte-equal files are shared), and
    ``extra`` in every rank's folder."""
    from kiln.artifact.archive import write_artifact
    from kiln.artifact.manifest import BucketStats, PassStats, ShardInfo
    from kiln.artifact.rank_copies import store_once
    from kiln.grid import Shard, expand, shard_buckets
    from kiln.spec import load_spec
    from tests.test_merge import megacache_blob

    spec = load_spec(spec_path)
    world = spec.world_size
    fps = rank_fps or [RANK_FP] * world
    buckets = shard_buckets(expand(spec), Shard(index, count))
    root = tmp / f"root-{name or index}"
    by_rank: list[list[FileEntry]] = []
    for rank in range(world):
        content = {"inductor/th/kernel.so": b"\x7fELF kernel"}
        content |= {f"inductor/fxgraph/{b.key}/entry": f"graph {b.key}".encode() for b in buckets}
        if not identical:
            content[f"inductor/own/{rank}.py"] = b"rank %d" % rank
        content |= extra or {}
        content["megacache.bin"] = megacache_blob(
            {"inductor": [(f"fkey{index}", b"entry %d" % index)], "aot_autograd": []}
        )
        files = []
        for rel, data in sorted(content.items()):
            path = f"ranks/{rank}/{rel}"
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_bytes(data)
            kind = "megacache" if rel == "megacache.bin" else "other"
            files.append(_file(path, data, kind))
        by_rank.append(files)
    stored = store_once(by_rank)
    grid = [
        BucketStats(key=b.key, sizes=b.as_dict(), first_call_s=1.0, steady_s=0.01, fx_misses=1)
        for b in buckets
    ]
    passes = [PassStats(order=[b.key for b in buckets], compiles=len(buckets), wall_s=1.0)]
    ranks = [
        {
            "rank": rank,
            "fingerprint": fps[rank],
            "grid": grid,
            "passes": passes,
            "megacache": f"ranks/{rank}/megacache.bin",
            "same_as": stored.same_as[rank],
        }
        for rank in range(world)
    ]
    manifest = Manifest.model_validate(
        {
            "format": 2,
            "name": spec.name,
            "created": "2026-12-03T10:00:00+00:00",
            "spec": spec.canonical(),
            "spec_sha256": spec.sha256(),
            "fingerprint": fps[0],
            "grid": grid,
            "passes": passes,
            "files": stored.files,
            "copies": stored.copies,
            "megacache": "ranks/0/megacache.bin",
            "compile_kwargs": {"backend": "inductor", "dynamic": False},
            "shard": ShardInfo.of(count, [index]),
            "distributed": {"world_size": world, "backend": "gloo", "ranks": ranks},
        }
    )
    out = tmp / f"{name or f'shard-{index}'}.kiln.tar.zst"
    write_artifact(out, manifest, root)
    return out


@pytest.mark.parametrize("identical", [False, True])
def test_two_rank_shards_merge_rank_by_rank_and_restore(
    tmp_path: Path, write_spec: Any, cli: Any, identical: bool
) -> None:
    """Two 2-rank shards merge into one 2-rank artifact: each rank's grid is the union, each
    rank's Mega-Cache blob holds both shards' entries, storage is decided across ranks again
    (rank 1 is rank 0's cache when its keys are; else only byte-equal files are copies), the
    same bytes in either order, torch-free, and it restores with every rank's files."""
    from kiln.artifact.archive import read_manifest
    from kiln.artifact.blobs import read_megacache

    spec_path = write_spec(tp_spec())
    shards = [rank_shard(tmp_path, spec_path, i, 2, identical=identical) for i in (0, 1)]
    a, b = tmp_path / "a.kiln.tar.zst", tmp_path / "b.kiln.tar.zst"
    for out, order in ((a, shards), (b, shards[::-1])):
        proc = cli("merge", *order, "-o", out, no_torch=True)
        assert proc.returncode == 0, proc.stderr
    assert a.read_bytes() == b.read_bytes()

    m = read_manifest(a)
    assert m.format == 2 and m.distributed is not None and m.world_size == 2
    assert m.shard is not None and m.shard.complete
    keys = ["batch=1", "batch=4"]
    assert [s.key for s in m.grid] == keys
    for r in m.distributed.ranks:
        assert [s.key for s in r.grid] == keys and len(r.passes) == 2
        assert r.megacache == f"ranks/{r.rank}/megacache.bin"
        assert r.same_as == (0 if identical and r.rank == 1 else None)
    assert m.megacache == m.distributed.ranks[0].megacache
    assert m.payload_sha256 is not None and not m.warnings
    paths = {f.path for f in m.files} | {c.path for c in m.copies}
    for rank in (0, 1):
        assert {f"ranks/{rank}/inductor/fxgraph/{k}/entry" for k in keys} <= paths
    if identical:
        assert all(f.path.startswith("ranks/0/") for f in m.files)
    else:
        assert "ranks/1/inductor/own/1.py" in {f.path for f in m.files}
        copied = {c.path: c.source for c in m.copies}
        assert copied["ranks/1/inductor/th/kernel.so"] == "ranks/0/inductor/th/kernel.so"

    dest = tmp_path / "elsewhere" / "cache"
    result = restore(a, dest)
    got = tree(dest)
    assert result.summary()["ranks"] == 2 and result.files == len(m.entries())
    for rank in (0, 1):
        for k in keys:
            assert got[f"ranks/{rank}/inductor/fxgraph/{k}/entry"] == f"graph {k}".encode()
        blob = dest / f"ranks/{rank}/megacache.bin"
        assert {e.key for e in read_megacache(blob)} == {"fkey0", "fkey1"}
    assert '/ranks/"$kiln_rank"/inductor' in got["kiln.env"].decode()
    proc = _source(got["kiln.env"].decode(), tmp_path, RANK="1")
    assert proc.stdout.split("|")[0] == f"{dest}/ranks/1/inductor"


def test_a_rank_file_that_is_another_shards_folder_is_exit_3(
    tmp_path: Path, write_spec: Any, cli: Any
) -> None:
    """Issue 27, item 6: was FileExistsError (exit 1)."""
    spec_path = write_spec(tp_spec())
    a = rank_shard(tmp_path, spec_path, 0, 2, extra={"inductor/xy": b"a file"})
    b = rank_shard(tmp_path, spec_path, 1, 2, extra={"inductor/xy/k.py": b"k"})
    proc = cli("merge", a, b, "-o", tmp_path / "m.kiln.tar.zst", no_torch=True)
    assert proc.returncode == 3, proc.stderr
    assert "'ranks/0/inductor/xy' is a file in shard-0" in proc.stderr
    assert not (tmp_path / "m.kiln.tar.zst").exists()


def test_same_as_names_what_it_may_be() -> None:
    """Issue 27, item 7: ``same_as: 1`` on rank 1 was refused as "only 0 or itself"."""
    ranks = rank_manifest()["distributed"]["ranks"]
    distributed = {
        "world_size": 2,
        "backend": "gloo",
        "ranks": [ranks[0], {**ranks[1], "same_as": 1}],
    }
    with pytest.raises(ValidationError) as info:
        Manifest.model_validate(rank_manifest(distributed=distributed))
    message = str(info.value)
    assert "rank 1: same_as 1" in message and "only 0" in message and "itself" not in message


def test_rank_shards_of_another_world_size_are_exit_2(tmp_path: Path, write_spec: Any) -> None:
    import kiln

    two = rank_shard(tmp_path, write_spec(tp_spec(), "two.yaml"), 0, 2)
    three_spec = write_spec(tp_spec("{world_size: 3, backend: gloo}"), "three.yaml")
    three = rank_shard(tmp_path, three_spec, 1, 2, name="three")
    out = tmp_path / "out.kiln.tar.zst"
    with pytest.raises(UsageError, match=r"for 3 ranks \(gloo\) and .* for 2 ranks \(gloo\)"):
        kiln.merge([two, three], out)
    assert not out.exists()


def test_a_ranks_other_fingerprint_is_exit_5_naming_factor_and_rank(
    tmp_path: Path, write_spec: Any, cli: Any
) -> None:
    spec_path = write_spec(tp_spec())
    a = rank_shard(tmp_path, spec_path, 0, 2)
    other = {**RANK_FP, "torch.version": "2.12.0+cpu"}
    b = rank_shard(tmp_path, spec_path, 1, 2, rank_fps=[RANK_FP, other])
    proc = cli("merge", a, b, "-o", tmp_path / "out.kiln.tar.zst", no_torch=True)
    assert proc.returncode == 5, proc.stderr
    assert "on rank 1: torch.version" in proc.stderr
    assert not (tmp_path / "out.kiln.tar.zst").exists()


def test_a_distributed_spec_shards_like_any_other(write_spec: Any) -> None:
    from kiln.grid import Shard, expand, shard_buckets, shard_grid
    from kiln.spec import load_spec

    spec = load_spec(write_spec(tp_spec()))
    for index in (0, 1):
        sliced = shard_grid(spec, expand(spec), Shard(index, 2))
        assert sliced == shard_buckets(expand(spec), Shard(index, 2)) and len(sliced) == 1


@pytest.mark.slow  # two 2-rank CPU bakes (unproven), a merge, a restore and a 2-rank verify
def test_two_rank_shards_bake_merge_restore_and_verify(tmp_path: Path) -> None:
    """configs/tp-mlp-cpu.yaml baked as 2 shards of 2 ranks each, merged, restored at a new
    path: zero compiles on both ranks (``--no-prove``: the verify below is the proof). Shard 0
    is kiln's own launch; shard 1 a user's (``torchrun --nproc-per-node 2 -m kiln bake``): each
    kiln process runs its own rank's worker, rank 0 writes the artifact, rank 1 says it baked
    and writes none. With ``bytecode: always``: each shard ships one bytecode tree at the root
    for both ranks, and the merge keeps one (the union)."""
    import kiln

    text = (ROOT / "configs" / "tp-mlp-cpu.yaml").read_text()
    spec_path = tmp_path / "tp-mlp-cpu.yaml"
    spec_path.write_text(text.replace("../examples/", f"{ROOT}/examples/") + "bytecode: always\n")
    shards = [tmp_path / f"shard-{index}.kiln.tar.zst" for index in (0, 1)]
    kiln.bake(spec_path, shards[0], shard="0/2", prove=False)
    bake = ("-m", "kiln", "bake", spec_path, "-o", shards[1], "--shard", "1/2", "--no-prove")
    command, env = users_torchrun(*bake)
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("rank 1: baked; rank 0 writes the artifact") == 1
    for shard in shards:
        m = read_manifest(shard)
        assert m.world_size == 2 and m.shard is not None and m.distributed is not None
        assert [r.rank for r in m.distributed.ranks] == [0, 1]
        assert m.bytecode is not None and m.bytecode.modules > 100
    merged = kiln.merge(shards[::-1], tmp_path / "merged.kiln.tar.zst")
    m = merged.manifest
    assert m.distributed is not None and m.shard is not None and m.shard.complete
    pycs = [e.path for e in m.entries() if e.kind == "bytecode"]
    assert m.bytecode is not None and m.bytecode.modules == len(pycs) > 100
    assert all(p.startswith("bytecode/") for p in pycs)  # one tree, in no rank folder
    keys = ["batch=1", "batch=4", "batch=16"]
    assert all([s.key for s in r.grid] == keys for r in m.distributed.ranks)
    dest = tmp_path / "elsewhere" / "cache"
    kiln.restore(merged.artifact, dest, sha256=merged.sha256)
    assert (dest / pycs[0]).is_file()
    report = kiln.verify(spec_path, dest, order="shuffle", seed=1, routes=("plain",))
    assert report.ok, report.reasons()
    assert {b.key for b in report.buckets} == {f"rank {r} · {k}" for r in (0, 1) for k in keys}
    assert sum(b.compiles for b in report.buckets) == 0


def test_a_bundle_of_a_two_rank_artifact_restores_every_rank(tmp_path: Path) -> None:
    """A bundle keeps each variant whole: a 2-rank variant restores with its copies and the
    per-rank kiln.env, exactly as the artifact alone does."""
    from kiln.artifact.bundle import write_bundle

    fp = {"device.type": "cpu", "torch.version": "2.13.0"}
    manifest = rank_manifest(fingerprint=fp)
    manifest["distributed"]["ranks"] = [
        {"rank": 0, "fingerprint": fp},
        {"rank": 1, "fingerprint": fp},
    ]
    artifact = _rank_archive(tmp_path / "tp.kiln.tar.zst", manifest)
    bundle = write_bundle([artifact], tmp_path / "release.kiln.tar.zst").path
    restore(bundle, tmp_path / "cache", torch_version="2.13.0")
    restore(artifact, tmp_path / "alone")
    got, alone = tree(tmp_path / "cache"), tree(tmp_path / "alone")
    assert got["ranks/1/inductor/a.py"] == got["ranks/0/inductor/a.py"] == b"code\n"
    # Equal but for the path, and the name of a read-only folder's driver-cache copy, which is
    # the path's digest (kiln.serving.cuda_cache_copy).
    assert (
        got["kiln.env"]
        .replace(b"/cache", b"/alone")
        .replace(_copy_digest(tmp_path / "cache"), _copy_digest(tmp_path / "alone"))
        == alone["kiln.env"]
    )
    assert {k for k in got if k.startswith("ranks/")} == {
        k for k in alone if k.startswith("ranks/")
    }
