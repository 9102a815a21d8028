"""How many fresh-process passes a bake runs, and when a last pass that compiled is a warning
(unit: no process started; the bakes themselves are test_roundtrip's)."""

from __future__ import annotations

from pathlib import Path

from kiln.artifact.manifest import BucketStats, PassStats
from kiln.compiler.bake import _missed, _pass_count, _serving_missed, _unsettled
from kiln.compiler.launch import WorkerRun
from kiln.compiler.protocol import WorkerResult
from kiln.compiler.verify import VerifyReport
from kiln.spec import Spec, load_spec
from tests.conftest import mlp_spec

PRECOMPILE = "  dynamic: false\n  fullgraph: true\n  precompile: true"


def spec(tmp_path: Path, compile_lines: str = "  dynamic: false") -> Spec:
    path = tmp_path / "spec.yaml"
    path.write_text(mlp_spec().replace("  dynamic: false", compile_lines))
    return load_spec(path)


def passes(*compiles: int) -> tuple[list[WorkerRun], list[PassStats]]:
    result = WorkerResult.model_construct(buckets=[])  # only the last pass's buckets are named
    runs = [WorkerRun(result=result, spawned=0.0, ended=0.0, log="") for _ in compiles]
    return runs, [PassStats(order=["batch=2"], compiles=n, wall_s=1.0) for n in compiles]


def test_static_shapes_bake_one_pass_and_precompiled_forwards_two(tmp_path: Path) -> None:
    assert _pass_count(spec(tmp_path), None) == (1, True)
    # the forwards, then plain torch.compile's entries (one pass: the proof would re-bake)
    assert _pass_count(spec(tmp_path, PRECOMPILE), None) == (2, True)
    assert _pass_count(spec(tmp_path, PRECOMPILE), 3) == (3, False)  # asked for: as asked
    assert _pass_count(spec(tmp_path, "  dynamic: null"), None) == (4, True)  # until quiet


def test_a_compiling_last_pass_is_a_warning_past_the_passes_that_compile_by_design(
    tmp_path: Path,
) -> None:
    plain, pre = spec(tmp_path), spec(tmp_path, PRECOMPILE)
    assert _unsettled(plain, *passes(9)) == []  # one pass: nothing to judge by
    (warning,) = _unsettled(plain, *passes(9, 2))
    assert "after 2 fresh-process passes a new process still compiles 2 time(s)" in warning
    # precompiled forwards: the second pass is plain torch.compile's first, and compiles
    assert _unsettled(pre, *passes(9, 2)) == []
    assert _unsettled(pre, *passes(9, 2, 0)) == []
    (warning,) = _unsettled(pre, *passes(9, 2, 1))
    assert "after 3 fresh-process passes" in warning


def test_a_proof_missing_the_same_in_another_order_is_stuck() -> None:
    """The bake stops re-baking when the next proof misses what the last did: judged per bucket
    and kind of work, not by the proof's reason lines, which change with the order (torch names
    the shape it traced before)."""

    def proof(order: list[int], fx: dict[int, int], folder: tuple[str, ...] = ()) -> VerifyReport:
        buckets = [
            BucketStats(
                key=f"batch={b}",
                sizes={"batch": b},
                first_call_s=1.0,
                steady_s=0.1,
                fx_misses=fx.get(b, 0),
                recompile_reasons=[f"size mismatch: expected {order[i - 1]}"] if i else [],
            )
            for i, b in enumerate(order)
        ]
        keys = [b.key for b in buckets]
        return VerifyReport("m", keys, buckets, None, 1.0, 1.0, True, folder_changes=list(folder))

    first, again = proof([2, 3, 5], {2: 1, 3: 1}), proof([5, 3, 2], {2: 1, 3: 1})
    assert first.reasons() != again.reasons() and _missed(first) == _missed(again)
    assert _missed(first) != _missed(proof([5, 3, 2], {2: 1, 3: 2}))  # more work: moved
    assert _missed(first) != _missed(proof([3, 2, 5], {2: 1}))  # a bucket filled: moved
    assert _missed(first) != _missed(proof([2, 3, 5], {2: 1, 3: 1}, ["added: inductor/x"]))


def test_the_aot_serving_pass_names_what_a_rank_missed() -> None:
    """The AOT route's serving-imports pass serves the built packages in a fresh process: what
    it missed there is a warning even when no proof runs (``--no-prove``), per rank."""

    def rank(misses: int) -> WorkerResult:
        bucket = BucketStats(
            key="batch=2", sizes={"batch": 2}, first_call_s=1.0, steady_s=0.1,
            precompile_misses=misses,
        )  # fmt: skip
        return WorkerResult.model_construct(buckets=[bucket])

    def run(*ranks: WorkerResult) -> WorkerRun:
        return WorkerRun(result=ranks[0], spawned=0.0, ended=0.0, log="", ranks=ranks)

    assert _serving_missed(run(rank(0))) == ""
    assert _serving_missed(run(rank(0), rank(0))) == ""
    warning = _serving_missed(run(rank(0), rank(1)))
    assert (
        "in 1 bucket(s): rank 1: batch=2: 1 compile(s): 1 call no package took (no package "
        "takes these inputs)"
    ) in warning
    assert warning.endswith("`kiln verify` will fail")
    assert "rank" not in _serving_missed(run(rank(2)))  # one rank: no rank named
