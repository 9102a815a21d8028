"""Padding to the grid: pad values in the spec, the bucket a request fits, and the padded call's
outputs sliced back (in-process; the restored-artifact proof is tests/test_padding_serve.py)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from typing import NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiln.errors import SpecError
from kiln.padding import OffGridError, PadGrid, ShapeError
from kiln.serving import ON_MISS
from kiln.spec import parse_spec
from tests.conftest import MODELS


def spec_text(
    inputs: str, buckets: str = "batch: [1, 4, 16]\n  seq: [128, 256, 512]", extra: str = ""
) -> str:
    return (
        "name: t\n"
        "model:\n"
        f"  factory: {MODELS}:tiny_mlp\n"
        "inputs:\n"
        f"{inputs}"
        "buckets:\n"
        f"  {buckets}\n"
        f"{extra}"
    )


TOKENS = "  - {name: ids, shape: [batch, seq], dtype: int64, pad: 0}\n"
MASK = "  - {name: mask, shape: [batch, seq], dtype: bool, pad: false}\n"


def test_fit_picks_the_smallest_bucket_that_holds_the_request() -> None:
    grid = PadGrid.from_spec(parse_spec(spec_text(TOKENS + MASK)))
    assert grid.fit(batch=3, seq=137) == {"batch": 4, "seq": 256}
    assert grid.fit({"batch": 4, "seq": 256}) == {"batch": 4, "seq": 256}
    assert grid.fit(batch=1, seq=1) == {"batch": 1, "seq": 128}
    with pytest.raises(OffGridError, match=r"seq=513 is larger than its largest bucket \(512\)"):
        grid.fit(batch=1, seq=513)
    with pytest.raises(ShapeError, match="missing seq"):
        grid.fit(batch=1)


def test_an_empty_axis_is_off_the_grid() -> None:
    """Padded up, a request of seq=0 would be served a bucket of padding alone."""
    grid = PadGrid.from_spec(parse_spec(spec_text(TOKENS + MASK)))
    with pytest.raises(OffGridError, match=r"^batch=3,seq=0 is off the grid: seq is empty"):
        grid.fit(batch=3, seq=0)
    assert grid.lookup({"batch": 0, "seq": 5}) is None


def test_a_negative_size_is_a_shape_error_naming_its_axis() -> None:
    """No tensor has one: an engine that sizes its own requests has a bug, which a bucket that
    "holds" it (every bucket does) would hide."""
    grid = PadGrid.from_spec(parse_spec(spec_text(TOKENS + MASK)))
    with pytest.raises(ShapeError, match=r"never negative: seq=-1$"):
        grid.fit(batch=3, seq=-1)
    with pytest.raises(ShapeError, match=r"never negative: batch=-3, seq=-5$"):
        grid.lookup({"batch": -3, "seq": -5})


def test_fit_honours_exclusions() -> None:
    spec = parse_spec(spec_text(TOKENS, extra="exclude:\n  - {batch: 4, seq: 256}\n"))
    grid = PadGrid.from_spec(spec)
    # batch=4,seq=256 was not baked: 4x512 (2048) is smaller than 16x256 (4096)
    assert grid.fit(batch=3, seq=137) == {"batch": 4, "seq": 512}


def test_an_axis_without_pad_on_every_input_is_matched_exactly() -> None:
    text = spec_text(TOKENS + "  - {name: pos, shape: [batch, 4], dtype: int64}\n")
    grid = PadGrid.from_spec(parse_spec(text))
    assert grid.paddable == {"seq"}
    assert grid.fit(batch=4, seq=130) == {"batch": 4, "seq": 256}
    with pytest.raises(OffGridError, match="batch is not padded"):
        grid.fit(batch=3, seq=130)


def test_axis_sizes_are_read_from_the_inputs_and_checked() -> None:
    grid = PadGrid.from_spec(parse_spec(spec_text(TOKENS + MASK)))
    assert grid.axis_sizes({"ids": (3, 7), "mask": (3, 7)}) == {"batch": 3, "seq": 7}
    with pytest.raises(ShapeError, match="axis 'seq' is 7 in one input and 8 in 'mask'"):
        grid.axis_sizes({"ids": (3, 7), "mask": (3, 8)})
    with pytest.raises(ShapeError, match="'mask' is missing"):
        grid.axis_sizes({"ids": (3, 7)})
    with pytest.raises(ShapeError, match="3 dimensions"):
        grid.axis_sizes({"ids": (3, 7, 1), "mask": (3, 7)})


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=4, unique=True),
    st.lists(st.integers(1, 40), min_size=1, max_size=4, unique=True),
    st.sets(st.tuples(st.integers(0, 3), st.integers(0, 3)), max_size=4),
    st.integers(1, 45),
    st.integers(1, 45),
)
def test_fit_is_the_least_work_bucket_that_holds_the_request(
    batches: list[int], seqs: list[int], excluded: set[tuple[int, int]], b: int, s: int
) -> None:
    points = [
        p
        for i, p in enumerate(itertools.product(batches, seqs))
        if (i // len(seqs), i % len(seqs)) not in excluded
    ]
    grid = PadGrid(("batch", "seq"), tuple(points), (), frozenset({"batch", "seq"}))
    holding = [p for p in points if p[0] >= b and p[1] >= s]
    found = grid.lookup({"batch": b, "seq": s})
    if not holding:
        assert found is None
        return
    assert found is not None
    assert math.prod(found.values()) == min(math.prod(p) for p in holding)
    assert found["batch"] >= b and found["seq"] >= s


@pytest.mark.parametrize(
    ("inputs", "expected"),
    [
        (
            "  - {name: ids, shape: [batch, seq], dtype: int64, pad: 0.5}\n",
            "5:52: inputs.0.pad: an int64 input pads with an integer",
        ),
        (
            "  - {name: ids, shape: [batch, seq], dtype: int64, pad: '0'}\n",
            "5:52: inputs.0.pad: a pad value is a number or true/false, not str",
        ),
        (
            "  - {name: ids, shape: [batch, seq], dtype: float16, pad: 70000.0}\n",
            "does not fit float16",
        ),
        ("  - {name: ids, shape: [batch, seq], pad: .inf}\n", "a pad value is finite"),
        (  # YAML 1.1 (PyYAML's) reads these as strings: the error spells the float they mean
            "  - {name: ids, shape: [batch, seq], pad: -1e9}\n",
            "5:38: inputs.0.pad: a pad value is a number, not the string '-1e9' (YAML 1.1 reads "
            "an exponent float only with a dot and a signed exponent): write -1.0e+9",
        ),
        ("  - {name: ids, shape: [batch, seq], pad: 2.5E3}\n", "write 2.5e+3"),
        ("  - {name: ids, shape: [batch, seq], pad: '.5e4'}\n", "write 0.5e+4"),
        (
            "  - {name: ids, shape: [batch, seq], dtype: bool, pad: 0}\n",
            "a bool input pads with true or false",
        ),
        ("  - {name: ids, shape: [batch, seq], pad: true}\n", "a float32 input pads with a number"),
        (
            "  - {name: ids, shape: [batch, seq], dtype: int32, pad: 3000000000}\n",
            "does not fit int32",
        ),
        (
            TOKENS + "  - {name: mask, shape: [batch, seq], dtype: bool}\n",
            "5:52: inputs.0.pad: input 'ids' is never padded: 'mask' also carries its axes",
        ),
        (
            TOKENS + "  - {name: w, shape: [4], pad: 0}\n",
            "6:27: inputs.1.pad: input 'w' has no bucket axis to pad",
        ),
    ],
)
def test_pad_values_are_checked_at_load_with_their_location(inputs: str, expected: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_spec(spec_text(inputs), file="spec.yaml")
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("written", "meant"), [("-1e9", -1e9), ("2.5E3", 2.5e3), ("1.e5", 1e5)])
def test_the_spelling_a_pad_error_offers_loads_as_the_float_meant(
    written: str, meant: float
) -> None:
    def pad(value: str) -> str:
        return spec_text(f"  - {{name: ids, shape: [batch, seq], pad: {value}}}\n")

    with pytest.raises(SpecError) as err:
        parse_spec(pad(written))
    spelled = str(err.value).rpartition("write ")[2]
    assert parse_spec(pad(spelled)).inputs[0].pad == meant


def test_on_miss_is_one_of_the_policies() -> None:
    text = spec_text(TOKENS, extra="compile: {on_miss: retry}\n")
    with pytest.raises(SpecError, match=r"compile\.on_miss"):
        parse_spec(text)
    for policy in ON_MISS:
        spec = parse_spec(spec_text(TOKENS, extra=f"compile: {{on_miss: {policy}}}\n"))
        assert spec.canonical()["compile"]["on_miss"] == policy


def test_a_spec_without_padding_keeps_its_digest() -> None:
    """pad and on_miss were added later: absent, they leave the canonical spec (and so every
    existing artifact's spec digest) as it was."""
    spec = parse_spec(spec_text("  - {name: ids, shape: [batch, seq], dtype: int64}\n"))
    canonical = spec.canonical()
    assert "on_miss" not in canonical["compile"]
    assert all("pad" not in i for i in canonical["inputs"])
    padded = parse_spec(spec_text(TOKENS))
    assert padded.canonical()["inputs"][0]["pad"] == 0
    assert padded.sha256() != spec.sha256()


def test_the_grid_comes_from_a_manifest_without_torch(tmp_path) -> None:
    """An engine that pads itself reads the baked buckets (only those) and pad values from a
    restored folder's manifest in a process where torch cannot be imported."""
    import subprocess
    import sys

    from kiln.artifact.manifest import BucketStats
    from tests.archives import manifest_for
    from tests.conftest import NO_TORCH

    spec = parse_spec(spec_text(TOKENS + MASK, extra="exclude:\n  - {batch: 4, seq: 256}\n"))
    grid = [
        BucketStats(
            key=f"batch={b},seq={s}", sizes={"batch": b, "seq": s}, first_call_s=1, steady_s=0
        )
        for b, s in itertools.product([1, 4, 16], [128, 256, 512])
        if (b, s) != (4, 256)
    ]
    manifest = manifest_for({}, spec=spec.canonical(), grid=grid)
    (tmp_path / "manifest.json").write_text(manifest.model_dump_json())
    code = (
        NO_TORCH + "from kiln.artifact.archive import read_manifest; "
        "from kiln.padding import PadGrid; "
        f"g = PadGrid.from_manifest(read_manifest({str(tmp_path)!r})); "
        "print(g.fit(batch=3, seq=137), sorted(g.paddable), "
        "PadGrid.from_manifest(read_manifest("
        f"{str(tmp_path)!r}), paddable=['seq']).lookup({{'batch': 3, 'seq': 5}}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", "import sys; " + code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "{'batch': 4, 'seq': 512} ['batch', 'seq'] None"
    # A policy the caller passes that is none is the caller's argument, not the artifact's.
    from kiln.compiler.padded import with_padding
    from kiln.errors import ParameterError

    with pytest.raises(ParameterError, match="on_miss='bogus': one of error, eager, compile"):
        with_padding(print, None, manifest, on_miss="bogus")  # type: ignore[arg-type]


def test_the_cli_offers_exactly_the_on_miss_policies() -> None:
    from kiln.cli.options import OnMissChoice

    assert tuple(c.value for c in OnMissChoice) == ON_MISS


# --- the padded call, in process (an eager model stands in for the compiled one) ----------
torch = pytest.importorskip("torch")


class Halves(NamedTuple):
    first: object
    second: object


@dataclasses.dataclass
class Out:
    hidden: object
    pooled: object


class Echo(torch.nn.Module):
    """Returns its input in every structure the padding path unpads, plus a fixed-size output
    whose size equals a padded bucket (16), which must not be sliced."""

    def forward(self, ids, mask):  # type: ignore[no-untyped-def]
        x = ids.float() * mask
        fixed = torch.zeros(ids.shape[0], 16)
        return {
            "tuple": (x, x.sum(1)),
            "named": Halves(x, fixed),
            "data": Out(x[..., None].expand(-1, -1, 3), x.sum(1) / mask.sum(1).clamp(min=1)),
            "doubled": torch.cat([x, x], dim=1),
        }


def served(on_miss: str = "error", keep=(), calls=None):  # type: ignore[no-untyped-def]
    from kiln.compiler.padded import PaddedModel

    text = spec_text(
        "  - {name: ids, shape: [batch, seq], dtype: int64, pad: 0}\n"
        "  - {name: mask, shape: [batch, seq], dtype: int64, pad: 0}\n",
        buckets="batch: [2, 4]\n  seq: [8, 16]",
    )
    model = Echo()

    def compiled(**kw):  # type: ignore[no-untyped-def]
        if calls is not None:
            calls.append({k: tuple(v.shape) for k, v in kw.items()})
        return model(**kw)

    grid = PadGrid.from_spec(parse_spec(text))
    return model, PaddedModel(compiled, model, grid, on_miss=on_miss, keep=keep)  # type: ignore[arg-type]


def close(a, b) -> bool:  # type: ignore[no-untyped-def]
    from kiln.compiler.padded import tensor_leaves

    la, lb = dict(tensor_leaves(a)), dict(tensor_leaves(b))
    return la.keys() == lb.keys() and all(
        la[k].shape == lb[k].shape and torch.equal(la[k], lb[k]) for k in la
    )


def test_outputs_are_sliced_back_on_every_dimension_that_carried_a_padded_size(caplog) -> None:
    calls: list[dict] = []
    model, fn = served(calls=calls)
    ids = torch.arange(1, 16).view(3, 5)
    mask = torch.ones(3, 5, dtype=torch.int64)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        out = fn(ids, mask=mask)  # positional arguments bind by forward()'s names
    assert calls == [{"ids": (4, 8), "mask": (4, 8)}]
    ref = model(ids=ids, mask=mask)
    # doubled (2 * seq) cannot be unpadded by slicing: left as the bucket gave it, said once
    assert out["doubled"].shape == (3, 16)
    assert "doubled changes with seq other than one for one" in caplog.text
    del out["doubled"], ref["doubled"]
    assert close(out, ref)
    assert isinstance(out["named"], Halves) and isinstance(out["data"], Out)
    assert out["named"].second.shape == (3, 16)  # 16 is a bucket size, but not this axis
    assert fn.stats.padded == 1 and fn.stats.probes == 2
    fn(ids=ids, mask=mask)
    assert fn.stats.probes == 2  # once per bucket and axis


class Reads(torch.nn.Module):
    """Reads a value in Python: fake tensors cannot run it, so outputs are sliced by size."""

    def forward(self, ids, mask):  # type: ignore[no-untyped-def]
        return ids.float() * float(mask.max().item())


def test_carriers_the_bake_records_serve_as_a_probe_would(caplog) -> None:
    """The AOT route's bake finds the carriers (bake_carriers) and the manifest carries them:
    its server, which runs no probe, unpads as one that probes, warning alike."""
    from kiln.artifact.manifest import PadCarriers
    from kiln.compiler.padded import PaddedModel, bake_carriers

    model, probing = served()
    at = {"ids": torch.ones(4, 8, dtype=torch.int64), "mask": torch.ones(4, 8, dtype=torch.int64)}
    records = [
        PadCarriers.model_validate_json(r.model_dump_json())  # through the manifest's JSON
        for r in bake_carriers(model, probing.grid, "batch=4,seq=8", at)
    ]
    assert [r.axis for r in records] == ["batch", "seq"]
    given = PaddedModel(model, model, probing.grid, carriers=records)
    ids, mask = torch.arange(1, 16).view(3, 5), torch.ones(3, 5, dtype=torch.int64)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        out = given(ids=ids, mask=mask)
    assert "doubled changes with seq other than one for one" in caplog.text
    assert close(out, probing(ids=ids, mask=mask)) and out["doubled"].shape == (3, 16)
    assert given.stats.probes == 0 and probing.stats.probes == 2

    reads = Reads()
    blind_records = bake_carriers(reads, probing.grid, "batch=4,seq=8", at)
    assert [(r.axis, r.by_size, r.outputs) for r in blind_records] == [
        ("batch", True, []),
        ("seq", True, []),
    ]
    blind = PaddedModel(reads, reads, probing.grid, carriers=blind_records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kiln"):
        assert blind(ids=ids, mask=mask).shape == (3, 5)
    said = "could not trace output shapes on fake tensors: slicing dimensions whose size is the "
    assert f"{said}padded batch" in caplog.text
    assert blind.stats.probes == 0


class Pools(torch.nn.Module):
    """A pooling with ``ceil_mode``: its seq dim is 8 at seq 15 as at 16, 4 at 8."""

    def forward(self, ids, mask):  # type: ignore[no-untyped-def]
        x = (ids.float() * mask)[:, None]
        return {"halved": torch.nn.functional.avg_pool1d(x, 2, 2, ceil_mode=True), "x": x}


def test_an_output_that_moves_otherwise_is_found_whatever_size_comes_first(caplog) -> None:
    """At seq 15 alone the pooled dim looks fixed (8 at 15 and at 16): the probe runs at two
    sizes the request does not choose, so the server and the bake both leave it padded, and
    say so, instead of returning it unsliced and unannounced."""
    from kiln.compiler.padded import PaddedModel, bake_carriers

    _, probing = served()
    pools = Pools()
    fn = PaddedModel(pools, pools, probing.grid)
    ids, mask = torch.ones(3, 15, dtype=torch.int64), torch.ones(3, 15, dtype=torch.int64)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        out = fn(ids=ids, mask=mask)
    assert "output halved changes with seq other than one for one" in caplog.text
    assert out["halved"].shape == (3, 1, 8) and out["x"].shape == (3, 1, 15)
    at = {"ids": torch.ones(4, 16, dtype=torch.int64), "mask": torch.ones(4, 16, dtype=torch.int64)}
    (batch, seq) = bake_carriers(pools, probing.grid, "batch=4,seq=16", at)
    assert {tuple(o.path): o.sliceable for o in seq.outputs} == {("halved",): False, ("x",): True}
    assert all(o.sliceable and o.dims == [0] for o in batch.outputs)


def test_an_input_of_another_dtype_follows_on_miss(caplog) -> None:
    """torch compiles a graph per input dtype: an int32 ``ids`` where the bake used int64 is no
    baked graph's, off the grid by its dtype, never compiled silently in the server."""
    _, fn = served()
    ids, mask = torch.ones(3, 5, dtype=torch.int32), torch.ones(3, 5, dtype=torch.int64)
    with pytest.raises(OffGridError, match="input 'ids' is int32, the bake's is int64"):
        fn(ids=ids, mask=mask)
    model, eager = served(on_miss="eager")
    with caplog.at_level(logging.WARNING, logger="kiln"):
        out = eager(ids=ids, mask=mask)
    assert close(out, model(ids=ids, mask=mask))
    assert dict(eager.stats.off_grid) == {
        "batch=3,seq=5 (input 'ids' is int32, the bake's is int64)": 1
    }
    assert eager.stats.padded == 0 and "served eager (on_miss: eager)" in caplog.text


def test_an_input_that_is_no_tensor_is_named_as_such() -> None:
    _, fn = served()
    with pytest.raises(ShapeError, match="input 'ids' is a list, not a tensor"):
        fn(ids=[[1, 2]], mask=torch.ones(1, 2, dtype=torch.int64))


def test_keep_returns_an_output_unsliced() -> None:
    _, fn = served(keep=("tuple.0", "data"))
    out = fn(ids=torch.ones(3, 5, dtype=torch.int64), mask=torch.ones(3, 5, dtype=torch.int64))
    assert out["tuple"][0].shape == (4, 8) and out["tuple"][1].shape == (3,)
    assert out["data"].hidden.shape == (4, 8, 3)
    assert out["named"].first.shape == (3, 5)


def test_a_keep_path_no_output_has_is_refused_naming_the_outputs() -> None:
    """A misspelt path would keep nothing: the output it meant would come back sliced."""
    from kiln.errors import ParameterError

    ids = torch.ones(3, 5, dtype=torch.int64)
    _, fn = served(keep=("tuple.0", "tupel.1"))
    with pytest.raises(ParameterError) as err:
        fn(ids=ids, mask=ids)
    assert str(err.value) == (
        "keep='tupel.1': no output is at this path (did you mean 'tuple.1'?) (the outputs: "
        "data, doubled, named, tuple, data.hidden, data.pooled, named.0, named.1, tuple.0, "
        "tuple.1)"
    )
    _, exact = served(keep=("named.first",))  # a named tuple's items are its indexes
    with pytest.raises(ParameterError, match=r"keep='named\.first': no output is at this path"):
        exact(ids=torch.ones(2, 8, dtype=torch.int64), mask=torch.ones(2, 8, dtype=torch.int64))
    # An unset field (a ModelOutput's attentions=None) names what another call returns.
    from kiln.compiler.padded import output_paths

    assert list(output_paths(Out(torch.ones(1), None))) == [("hidden",), ("pooled",)]


def test_an_exact_bucket_is_passed_through() -> None:
    calls: list[dict] = []
    _, fn = served(calls=calls)
    ids = torch.ones(2, 8, dtype=torch.int64)
    fn(ids=ids, mask=ids)
    assert calls == [{"ids": (2, 8), "mask": (2, 8)}]
    assert fn.stats.exact == 1 and fn.stats.probes == 0


@pytest.mark.parametrize("policy", ON_MISS)
def test_off_grid_requests_follow_on_miss_counted_and_logged_once(policy: str, caplog) -> None:
    calls: list[dict] = []
    model, fn = served(on_miss=policy, calls=calls)
    big = torch.ones(5, 3, dtype=torch.int64)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        for _ in range(2):
            if policy == "error":
                with pytest.raises(OffGridError, match="batch=5 is larger than its largest bucket"):
                    fn(ids=big, mask=big)
            else:
                out = fn(ids=big, mask=big)
                assert close(out, model(ids=big, mask=big))
    assert fn.stats.off_grid == {"batch=5,seq=3": 2}
    assert calls == ([{"ids": (5, 3), "mask": (5, 3)}] * 2 if policy == "compile" else [])
    logged = caplog.text.count("batch=5,seq=3 is off the grid")
    assert logged == (0 if policy == "error" else 1)


@pytest.mark.parametrize("policy", ON_MISS)
def test_a_request_with_an_empty_axis_follows_on_miss(policy: str) -> None:
    calls: list[dict] = []
    model, fn = served(on_miss=policy, calls=calls)
    empty = torch.ones(3, 0, dtype=torch.int64)
    if policy == "error":
        with pytest.raises(OffGridError, match=r"seq is empty, and no bucket is \(on_miss"):
            fn(ids=empty, mask=empty)
    else:
        assert close(fn(ids=empty, mask=empty), model(ids=empty, mask=empty))
    assert fn.stats.off_grid == {"batch=3,seq=0": 1} and fn.stats.padded == 0
    assert calls == ([{"ids": (3, 0), "mask": (3, 0)}] if policy == "compile" else [])


def test_inconsistent_inputs_are_a_shape_error() -> None:
    _, fn = served()
    with pytest.raises(ShapeError, match="axis 'seq'"):
        fn(ids=torch.ones(2, 5, dtype=torch.int64), mask=torch.ones(2, 6, dtype=torch.int64))


# --- a spec without pad values on the torch.compile route: the grid served exactly ---------
def _unpadded(dynamic: str = "false", on_miss: str = ""):  # type: ignore[no-untyped-def]
    """A compile-route manifest of a spec that pads nothing (batch [1, 4]), and its model."""
    from kiln.artifact.manifest import BucketStats
    from tests.archives import manifest_for

    compile_lines = f"compile:\n  dynamic: {dynamic}\n" + (
        f"  on_miss: {on_miss}\n" if on_miss else ""
    )
    spec = parse_spec(
        spec_text(
            "  - {name: x, shape: [batch, 16]}\n", buckets="batch: [1, 4]", extra=compile_lines
        )
    )
    grid = [
        BucketStats(key=f"batch={b}", sizes={"batch": b}, first_call_s=1, steady_s=0)
        for b in (1, 4)
    ]
    return manifest_for({}, spec=spec.canonical(), grid=grid)


class Linear16(torch.nn.Linear):
    def __init__(self) -> None:
        super().__init__(16, 4)

    def forward(self, x):  # type: ignore[no-untyped-def, override]
        return super().forward(x)


@pytest.mark.parametrize("policy", ON_MISS)
def test_a_spec_without_pad_serves_its_buckets_exactly_and_follows_on_miss(
    policy: str, caplog
) -> None:
    """A user's report: without `pad`, on_miss was ignored (a bogus one accepted; batch=3 on a
    grid of 1 and 4 compiled in the server under on_miss error)."""
    from kiln.compiler.padded import PaddedModel, miss_policy, with_padding
    from kiln.errors import ParameterError

    manifest = _unpadded()
    model = Linear16()
    calls: list[tuple[int, ...]] = []

    def compiled(x):  # type: ignore[no-untyped-def]
        calls.append(tuple(x.shape))
        return model(x)

    with pytest.raises(ParameterError, match="on_miss='bogus': one of error, eager, compile"):
        with_padding(compiled, model, manifest, on_miss="bogus")  # type: ignore[arg-type]
    assert miss_policy(manifest) == "error"  # the documented default: None means error
    fn = with_padding(compiled, model, manifest, on_miss=policy)  # type: ignore[arg-type]
    assert isinstance(fn, PaddedModel)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        assert fn(torch.ones(4, 16)).shape == (4, 4) and calls == [(4, 16)]  # a bucket: as is
        off = torch.ones(3, 16)
        if policy == "error":
            with pytest.raises(OffGridError) as refused:
                fn(x=off)
            assert str(refused.value) == (
                "batch=3 is off the grid: batch is not padded (no input declares `pad`) and 3 is "
                "not a baked size (1, 4) (on_miss: error)"
            )
        else:
            assert torch.equal(fn(x=off), model(off))
    assert calls == [(4, 16)] + ([(3, 16)] if policy == "compile" else [])
    assert fn.stats.to_dict()["off_grid_shapes"] == {"batch=3": 1} and fn.stats.exact == 1


def test_dynamic_graphs_without_pad_are_served_as_compiled(caplog) -> None:
    """dynamic: true (or None) graphs serve shapes between and beyond the buckets: nothing
    holds the requests to the grid, so the policy that applies is torch's, compile, and an
    on_miss asked for says it does not apply."""
    from kiln.compiler.padded import miss_policy, with_padding

    manifest = _unpadded(dynamic="true", on_miss="error")
    assert miss_policy(manifest) == "compile"
    with caplog.at_level(logging.WARNING, logger="kiln"):
        assert with_padding(print, None, manifest) is print
    assert "on_miss: error does not apply: dynamic graphs" in caplog.text


def test_an_off_grid_request_that_compiled_under_on_miss_error_fails_the_replay() -> None:
    """on_miss: error promises a server compiles nothing: an off-grid request that compiled
    anyway (a served callable that did not hold it to the grid) fails verify --traffic, and
    one refused or served under another policy does not."""
    from kiln.compiler.replay import ReplayReport, ReplayResult, RequestRecord

    def report(policy: str, compiles: int, latency: float | None) -> ReplayReport:
        records = [
            RequestRecord(key="batch=1", bucket="batch=1", compiles=0, latency_s=0.01),
            RequestRecord(key="batch=3", bucket=None, compiles=compiles, latency_s=latency),
        ]
        result = ReplayResult(records=records, startup_s=1.0)
        return ReplayReport("m", "t.jsonl", policy, result, 1.0)

    compiled = report("error", 9, 10.4)
    assert not compiled.ok
    assert compiled.reasons() == ["batch=3 (off the grid, on_miss: error): 9 compile(s)"]
    assert report("error", 0, None).ok and report("compile", 9, 10.4).ok
