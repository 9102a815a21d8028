"""Spec validation: every error names file:line:col and the key, and exits 2."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.errors import SpecError
from kiln.serving import MODE_OPTIONS, cold_torch_kwargs, torch_kwargs
from kiln.spec import RANDINT_RANGE, load_spec
from tests.conftest import MODELS, mlp_spec


def error_of(write_spec, text: str) -> str:
    path = write_spec(text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    return str(info.value).replace(str(path), "spec.yaml")


def test_valid_spec_loads(write_spec) -> None:
    spec = load_spec(write_spec(mlp_spec()))
    assert spec.name == "tiny-mlp"
    assert torch_kwargs(spec.compile) == {
        "backend": "inductor",
        "dynamic": False,
        "fullgraph": False,
        "mode": "default",
    }
    assert spec.sha256() == load_spec(write_spec(mlp_spec() + "\n# comment\n", "b.yaml")).sha256()


def test_unknown_key(write_spec) -> None:
    text = mlp_spec().replace("  dynamic: false", "  dynamic: false\n  dynamc: true")
    assert error_of(write_spec, text) == (
        "spec.yaml:8:3: compile.dynamc: unknown key 'dynamc' (did you mean 'dynamic'?)"
    )
    text = mlp_spec() + "bogus: 1\n"
    assert error_of(write_spec, text) == "spec.yaml:13:1: bogus: unknown key 'bogus'"


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (  # the typo, not the `buckets` it leaves missing (which pydantic lists first)
            "buckets:",
            "bucket:",
            "spec.yaml:10:1: bucket: unknown key 'bucket' (did you mean 'buckets'?)",
        ),
        (
            "  factory:",
            "  factroy:",
            "spec.yaml:3:3: model.factroy: unknown key 'factroy' (did you mean 'factory'?)",
        ),
        (
            "dtype: float32, fill",
            "dtyp: float32, fill",
            "spec.yaml:9:35: inputs.0.dtyp: unknown key 'dtyp' (did you mean 'dtype'?)",
        ),
        (
            "warmup: {calls: 2}",
            "warmup: {call: 2, passes: many}",
            "spec.yaml:12:10: warmup.call: unknown key 'call' (did you mean 'calls'?)",
        ),
        (
            "shape: [batch, 16]",
            "shape: [bach, 16]",
            "spec.yaml:9:23: inputs.0.shape.0: axis 'bach' is not declared in buckets "
            "(did you mean 'batch'?)",
        ),
    ],
    ids=["top-level", "model", "input", "warmup", "axis"],
)
def test_a_typo_is_named_with_a_suggestion_before_what_it_leaves_missing(
    write_spec, old: str, new: str, expected: str
) -> None:
    assert error_of(write_spec, mlp_spec().replace(old, new)) == expected


def test_an_axis_no_input_uses_is_refused_at_its_line(write_spec) -> None:
    """An unused axis only multiplies the grid: each bucket would be compiled twice, the same."""
    text = mlp_spec(buckets="batch: [2, 3]\nseq: [8, 16]")
    assert error_of(write_spec, text) == (
        "spec.yaml:12:3: buckets.seq: axis 'seq' is used by no input"
    )


def test_wrong_type(write_spec) -> None:
    text = mlp_spec().replace("warmup: {calls: 2}", "warmup: {calls: many}")
    msg = error_of(write_spec, text)
    assert msg.startswith("spec.yaml:12:10: warmup.calls: ")
    assert "integer" in msg


def test_duplicate_key(write_spec) -> None:
    text = mlp_spec() + "name: again\n"
    assert error_of(write_spec, text) == (
        "spec.yaml:13:1: name: duplicate key (first defined on line 1)"
    )


def test_nested_duplicate_key(write_spec) -> None:
    text = mlp_spec().replace("  dynamic: false", "  dynamic: false\n  dynamic: true")
    assert error_of(write_spec, text).startswith("spec.yaml:8:3: compile.dynamic: duplicate key")


def test_bad_factory_module(write_spec) -> None:
    text = mlp_spec().replace(f"{'factory: '}", "factory: no_such_module_xyz:make #", 1)
    assert error_of(write_spec, text) == (
        "spec.yaml:3:3: model.factory: factory module 'no_such_module_xyz' not found "
        "(looked next to the spec, then sys.path)"
    )


def test_bad_factory_file(write_spec) -> None:
    text = mlp_spec().replace("factory: ", "factory: missing.py:make #", 1)
    assert error_of(write_spec, text).startswith(
        "spec.yaml:3:3: model.factory: factory file 'missing.py' not found"
    )


def test_bad_factory_syntax(write_spec) -> None:
    text = mlp_spec().replace("factory: ", "factory: nocolon #", 1)
    assert error_of(write_spec, text).startswith(
        "spec.yaml:3:3: model.factory: String should match"
    )


def test_mode_and_options_together(write_spec) -> None:
    text = mlp_spec().replace(
        "  dynamic: false",
        "  dynamic: false\n  mode: max-autotune\n  options: {max_autotune: true}",
    )
    assert error_of(write_spec, text) == (
        "spec.yaml:9:3: compile.options: mode and options are mutually exclusive "
        "(torch.compile refuses both)"
    )


def test_precompile_route_follows_fullgraph(write_spec) -> None:
    """precompile: true bakes AOT forwards for a full graph, else Dynamo's saved frames."""
    text = mlp_spec().replace("  dynamic: false", "  dynamic: false\n  precompile: true")
    frames = load_spec(write_spec(text))
    assert frames.compile.precompile_route == "frames"
    aot = load_spec(
        write_spec(text.replace("precompile: true", "precompile: true\n  fullgraph: true"))
    )
    assert aot.compile.precompile_route == "aot" and "precompile" not in torch_kwargs(aot.compile)
    assert load_spec(write_spec(mlp_spec())).compile.precompile_route is None


def test_mode_table_matches_torch() -> None:
    import torch._inductor

    assert {mode: torch._inductor.list_mode_options(mode) for mode in MODE_OPTIONS} == MODE_OPTIONS


LOADING = {"use_static_cuda_launcher": False, "compile_threads": 1}


@pytest.mark.parametrize(
    ("compile_lines", "options"),
    [
        (
            "  mode: max-autotune-no-cudagraphs",
            {"max_autotune": True, "coordinate_descent_tuning": True, **LOADING},
        ),
        ("  options: {max_autotune: true}", {"max_autotune": True, **LOADING}),
        (  # the spec's own choices stand
            "  options: {coordinate_descent_tuning: true, use_static_cuda_launcher: true,"
            " compile_threads: 4}",
            {
                "coordinate_descent_tuning": True,
                "use_static_cuda_launcher": True,
                "compile_threads": 4,
            },
        ),
        ("  mode: reduce-overhead", None),
    ],
)
def test_autotuning_specs_load_tuned_kernels_in_process(
    write_spec, compile_lines: str, options: dict | None
) -> None:
    text = mlp_spec().replace("  dynamic: false", "  dynamic: false\n" + compile_lines)
    spec = load_spec(write_spec(text))
    kwargs = torch_kwargs(spec.compile)
    assert spec.compile.autotunes is (options is not None)
    assert spec.compile.cudagraphs is ("reduce-overhead" in compile_lines)
    assert kwargs.get("options") == options
    assert ("mode" in kwargs) is (options is None)
    cold = cold_torch_kwargs(spec.compile)
    # A cold compile keeps the worker pool unless the spec itself limits it.
    assert cold.get("options", {}).get("compile_threads") == (
        4 if "compile_threads: 4" in compile_lines else None
    )
    assert {k: v for k, v in cold.items() if k != "options"} == {
        k: v for k, v in kwargs.items() if k != "options"
    }
    import torch

    for checked in (kwargs, cold):
        torch.compile(torch.nn.Identity(), **checked)  # torch checks every option name here


def test_undeclared_axis(write_spec) -> None:
    text = mlp_spec().replace("shape: [batch, 16]", "shape: [batch, seq]")
    assert error_of(write_spec, text) == (
        "spec.yaml:9:30: inputs.0.shape.1: axis 'seq' is not declared in buckets"
    )


def test_randint_needs_high(write_spec) -> None:
    text = mlp_spec().replace("fill: randn", "fill: randint")
    assert "inputs.0.fill: fill: randint needs `high`" in error_of(write_spec, text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (  # the bracket never closed, not the end of the file after it
            "name: x\nmodel: [unclosed\n\n# more\n",
            "spec.yaml:2:8: invalid YAML: ",
        ),
        ("name: x\nmodel: [unclosed\nfoo: 1\n", "spec.yaml:2:8: invalid YAML: "),
        (  # the key missing its ':', not the line after it
            "name: x\nmodel\n  factory: a\n",
            "spec.yaml:2:1: invalid YAML: could not find expected ':' "
            "(while scanning a simple key)",
        ),
        ("name: x\nmodel\n", "spec.yaml:2:1: invalid YAML: could not find expected ':'"),
        ("name: 'x\nmodel: 1\n", "spec.yaml:1:7: invalid YAML: found unexpected end of stream"),
        # problems that are on the line PyYAML names stay there
        ("name: x\nmodel:\n  factory: a\n kwargs: {}\n", "spec.yaml:4:2: invalid YAML: "),
        ("name: x\nmodel: factory: a\n", "spec.yaml:2:15: invalid YAML: mapping values"),
        ("name: x\nmodel: {a: 1 b: 2}\n", "spec.yaml:2:15: invalid YAML: "),
    ],
    ids=[
        "unclosed-eof",
        "unclosed-more",
        "no-colon",
        "no-colon-eof",
        "quote",
        "indent",
        "nested-map",
        "no-comma",
    ],
)
def test_yaml_syntax_error_points_at_its_line(write_spec, text: str, expected: str) -> None:
    msg = error_of(write_spec, text)
    assert msg.startswith(expected), msg


def test_exclude_unknown_axis(write_spec) -> None:
    msg = error_of(write_spec, mlp_spec() + "exclude: [{seq: 3}]\n")
    assert msg == "spec.yaml:13:12: exclude.0.seq: unknown axis 'seq'"


def test_exclude_of_a_size_the_grid_lacks_is_refused_at_it(write_spec) -> None:
    """It would exclude nothing, silently: the grid compiles what the spec meant to leave out."""
    msg = error_of(write_spec, mlp_spec() + "exclude: [{batch: 2}, {batch: 4}]\n")
    assert msg == (
        "spec.yaml:13:24: exclude.1.batch: batch=4 is no size of the grid, so this excludes no "
        "bucket (batch: 2, 3, 5)"
    )


def test_an_exclude_that_empties_the_grid_is_located(write_spec) -> None:
    msg = error_of(write_spec, mlp_spec() + "exclude: [{batch: 2}, {batch: 3}, {batch: 5}]\n")
    assert msg == "spec.yaml:13:1: exclude: the grid is empty after `exclude`"


def test_cli_spec_error_exit_2(cli, write_spec) -> None:
    path = write_spec(mlp_spec() + "bogus: 1\n")
    proc = cli("bake", path, "-o", "out.kiln.tar.zst", no_torch=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[0].endswith(f"{path}:13:1: bogus: unknown key 'bogus'")
    assert proc.stdout == ""


def test_cli_json_error_is_json(cli, write_spec) -> None:
    path = write_spec(mlp_spec() + "bogus: 1\n")
    proc = cli("bake", path, "--json", no_torch=True)
    assert proc.returncode == 2
    assert json.loads(proc.stdout)["exit_code"] == 2


def test_schema_command(cli) -> None:
    proc = cli("schema", no_torch=True)
    assert proc.returncode == 0
    schema = json.loads(proc.stdout)
    assert set(schema["properties"]) >= {"name", "model", "compile", "inputs", "buckets", "env"}
    assert schema["additionalProperties"] is False


def test_committed_schema_is_current() -> None:
    """configs/ point editors at docs/spec.schema.json: it must match the models."""
    from kiln.spec import spec_json_schema
    from tests.conftest import ROOT

    committed = json.loads((ROOT / "docs" / "spec.schema.json").read_text())
    assert committed == spec_json_schema(), "regenerate: kiln schema > docs/spec.schema.json"


# --- issue 11: the environment a spec may set (item 1) ---------------------------------------


@pytest.mark.parametrize(
    ("key", "problem"),
    [
        ("A=1; touch pwned; B", "'A=1; touch pwned; B' is not a shell variable name"),
        ("LD_PRELOAD", "LD_PRELOAD does not affect compilation"),
        ("PYTHONPATH", "PYTHONPATH does not affect compilation"),
        ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR moves a cache"),
        ("TRITON_HOME", "TRITON_HOME moves a cache"),
        ("CUDA_CACHE_PATH", "CUDA_CACHE_PATH moves a cache"),
        ("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "TORCHINDUCTOR_FORCE_DISABLE_CACHES moves a cache"),
    ],
)
def test_env_keys_follow_the_allow_list(write_spec, key: str, problem: str) -> None:
    msg = error_of(write_spec, mlp_spec() + f"env: {{'{key}': '1'}}\n")
    assert msg.startswith(f"spec.yaml:13:7: env.{key}: {problem}")


def test_compilation_env_keys_are_accepted(write_spec) -> None:
    text = mlp_spec() + "env: {TORCHINDUCTOR_MAX_AUTOTUNE: 1, TORCH_COMPILE_JOB_ID: x}\n"
    assert load_spec(write_spec(text)).compile_env() == {
        "TORCHINDUCTOR_MAX_AUTOTUNE": "1",
        "TORCH_COMPILE_JOB_ID": "x",
    }


def test_cli_refuses_an_injected_env_key_before_baking(cli, write_spec) -> None:
    """The reported hole: this spec baked with exit 0 and wrote the key into the manifest."""
    path = write_spec(mlp_spec() + "env: {'A=1; touch pwned; B': x}\n")
    proc = cli("bake", path, "-o", "out.kiln.tar.zst", no_torch=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"kiln: error: {path}:13:7: env.A=1; touch pwned; B: "
        "'A=1; touch pwned; B' is not a shell variable name"
    )


# --- hostile YAML (items 5 and 10) ------------------------------------------------------------


def alias_bomb(levels: int = 9) -> str:
    """Billion laughs: each level lists the previous one 9 times (9**levels strings)."""
    lines = ["l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        lines.append(f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def test_alias_bomb_is_refused_at_once(write_spec) -> None:
    text = mlp_spec() + alias_bomb()
    assert len(text.encode()) < 1024 + len(mlp_spec())
    t0 = time.monotonic()
    msg = error_of(write_spec, text)
    assert time.monotonic() - t0 < 0.5
    assert msg == (
        "spec.yaml:17:15: the document holds more than 20000 values (an alias counts as "
        "everything it repeats): refused"
    )


def test_small_aliases_are_fine(write_spec) -> None:
    """Anchors stay usable for what a spec needs them for: sharing a list of sizes."""
    text = mlp_spec(buckets="batch: &sizes [2, 3]\nrows: *sizes").replace(
        "shape: [batch, 16]", "shape: [batch, rows, 16]"
    )
    spec = load_spec(write_spec(text))
    assert spec.buckets == {"batch": [2, 3], "rows": [2, 3]}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (  # PyYAML's unsafe loaders would call os.system here
            mlp_spec().replace("name: tiny-mlp", "name: !!python/object/apply:os.system [id]"),
            "spec.yaml:1:7: tag !!python/object/apply:os.system is not allowed in a spec",
        ),
        (
            mlp_spec().replace("calls: 2", "calls: !custom 2"),
            "spec.yaml:12:17: tag !custom is not allowed in a spec",
        ),
        (
            mlp_spec().replace("inputs:", "inputs: !!set"),
            "spec.yaml:8:9: tag !!set is not allowed in a spec",
        ),
        (
            mlp_spec().replace("calls: 2", "calls: !!int two"),
            "spec.yaml:12:17: 'two' is not a 64-bit integer",
        ),
        (
            mlp_spec().replace("calls: 2", 'calls: !!int ""'),
            "spec.yaml:12:17: '' is not a 64-bit integer",
        ),
        (
            mlp_spec().replace("{scale: 2.0}", '{scale: !!float ""}'),
            "spec.yaml:5:24: '' is not a valid !!float",
        ),
        (
            mlp_spec().replace("dynamic: false", "dynamic: !!bool maybe"),
            "spec.yaml:7:12: 'maybe' is not a valid !!bool",
        ),
        (
            mlp_spec() + "env: {1: x}\n",
            "spec.yaml:13:7: mapping keys must be strings",
        ),
        (
            mlp_spec().replace("{dim: 16, hidden: 32}", "{dim: 16, hidden: 32, on: 1}"),
            "spec.yaml:4:33: mapping keys must be strings",
        ),
        (
            mlp_spec() + "? [a, b]\n: 1\n",
            "spec.yaml:13:3: mapping keys must be strings",
        ),
        (
            mlp_spec() + "exclude: &loop [*loop]\n",
            "spec.yaml:13:17: recursive alias *loop (used inside its own anchor)",
        ),
        (
            mlp_spec() + "base: &b {calls: 2}\nwarmup2: {<<: *b}\n",
            "spec.yaml:14:11: merge keys (<<) are not supported",
        ),
        (
            mlp_spec() + "exclude: " + "[" * 40 + "]" * 40 + "\n",
            "spec.yaml:13:41: nested deeper than 32 levels: refused",
        ),
        (
            mlp_spec() + "exclude: " + "[" * 5000 + "]" * 5000 + "\n",
            "spec.yaml:13:",  # libyaml's own depth limit, or kiln's
        ),
        (
            mlp_spec() + "---\nname: other\n",
            "spec.yaml:13:1: a spec is one YAML document",
        ),
        (
            mlp_spec().replace("name: tiny-mlp", "name: " + "a" * 200),
            "spec.yaml:1:1: name: String should have at most 128 characters",
        ),
        (
            mlp_spec().replace("batch: [2, 3, 5]", "batch: [2, 99999999999999999999999]"),
            "spec.yaml:11:14: integer beyond 64 bits",
        ),
        (
            mlp_spec().replace("{scale: 2.0}", "{scale: " + "9" * 5000 + "}"),
            "spec.yaml:5:24: '9999999999999999999999999999999999999999'… is not a 64-bit integer",
        ),
        (
            mlp_spec().replace("name: tiny-mlp", 'name: "a\\0b"'),
            "spec.yaml:1:7: strings must not contain NUL characters",
        ),
        (
            mlp_spec().replace("name: tiny-mlp", "name: a\x07b"),
            "spec.yaml:1:8: invalid YAML",
        ),
        ("- a\n- b\n", "spec.yaml:1:1: a spec is a mapping of keys"),
        (  # a key's line break must not split the one-line error
            mlp_spec() + '"a\\nb\\rc": 1\n',
            "spec.yaml:13:1: a\\nb\\rc: unknown key",
        ),
    ],
    ids=lambda v: v[:50] if isinstance(v, str) and v.startswith("spec.yaml") else "",
)
def test_hostile_yaml_is_a_located_spec_error(write_spec, text: str, expected: str) -> None:
    assert error_of(write_spec, text).startswith(expected)


def test_recursion_and_depth_stay_bounded_whatever_the_recursion_limit(write_spec) -> None:
    """Deep nesting was a RecursionError (exit 1); kiln's depth bound fires long before."""
    path = write_spec(mlp_spec() + "exclude: " + "[" * 200 + "]" * 200 + "\n")
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(200)
    try:
        with pytest.raises(SpecError, match="nested deeper than 32 levels"):
            load_spec(path)
    finally:
        sys.setrecursionlimit(limit)


def test_oversized_spec_file_is_refused_without_reading_it_all(write_spec, tmp_path) -> None:
    path = write_spec(mlp_spec() + "# " + "x" * (2 << 20) + "\n")
    with pytest.raises(SpecError, match=r"spec is larger than 1048576 bytes"):
        load_spec(path)
    with pytest.raises(SpecError, match=r"spec is larger than 1048576 bytes"):
        load_spec("/dev/zero")


# --- numeric bounds (item 10) -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        (
            "calls: 2",
            "calls: 1000000000",
            "12:10: warmup.calls: Input should be less than or equal to 1000",
        ),
        (
            "calls: 2",
            "calls: 2, passes: 100",
            "12:20: warmup.passes: Input should be less than or equal to 8",
        ),
        (
            "[2, 3, 5]",
            "[2, 2147483648]",
            "11:14: buckets.batch.1: Input should be less than or equal to 2147483647",
        ),
        (
            "[2, 3, 5]",
            "[2, 0]",
            "11:14: buckets.batch.1: Input should be greater than or equal to 1",
        ),
        (
            "shape: [batch, 16]",
            "shape: [batch, 4294967296]",
            "9:30: inputs.0.shape.1: sizes must be >= 1 and <= 2147483647",
        ),
        (
            "[2, 3, 5]",
            "[2, 2147483647]",
            "9:15: inputs.0.shape: 34359738352 elements at the "
            "largest bucket; one input may have at most 2147483648",
        ),
        (
            "shape: [batch, 16]",
            "shape: [batch" + ", 1" * 16 + "]",
            "9:15: inputs.0.shape: List should have at most 16 items",
        ),
        (
            "  batch: [2, 3, 5]",
            "  batch: ["
            + ", ".join(map(str, range(1, 65)))
            + "]\n  b2: ["
            + ", ".join(map(str, range(1, 66)))
            + "]",
            "12:3: buckets.b2: the grid has more than 4096 buckets",
        ),
        (
            "fill: randn}",
            "fill: randint, high: 9223372036854775808}",
            "9:72: integer beyond 64 bits",
        ),
        (
            "fill: randn}",
            "fill: randint, low: -9223372036854775809, high: 2}",
            "9:71: integer beyond 64 bits",
        ),
        (
            "dtype: float32, fill: randn}",
            "dtype: int32, fill: randint, high: 2147483649}",
            "9:64: inputs.0.high: int32 values end below 2147483648",
        ),
        (
            "dtype: float32, fill: randn}",
            "dtype: float16, fill: randint, high: 100000}",
            "9:66: inputs.0.high: float16 values end below 65505",
        ),
        (
            "dtype: float32, fill: randn}",
            "dtype: bool, fill: randint, low: -1, high: 2}",
            "9:63: inputs.0.low: bool values start at 0",
        ),
        (
            "fill: randn}",
            "fill: randn}\n  - {name: x, shape: [batch]}",
            "10:6: inputs.1.name: input 'x' is also input 0",
        ),
        (
            "{scale: 2.0}",
            "{scale: 2.0, x: 1}",
            "5:29: model.call_kwargs.x: 'x' is already an input's name",
        ),
    ],
)
def test_numbers_are_bounded_at_parse_time(write_spec, old: str, new: str, expected: str) -> None:
    text = mlp_spec()
    assert old in text
    msg = error_of(write_spec, text.replace(old, new, 1))
    assert msg.startswith(f"spec.yaml:{expected}"), msg


def test_bounds_allow_the_largest_legal_values(write_spec) -> None:
    text = (
        mlp_spec(buckets="batch: [1, 2147483647]")
        .replace("shape: [batch, 16]", "shape: [batch]")
        .replace(
            "dtype: float32, fill: randn",
            "dtype: int64, fill: randint, low: -9223372036854775808, high: 9223372036854775807",
        )
        .replace("calls: 2", "calls: 1000, passes: 8")
    )
    spec = load_spec(write_spec(text))
    assert spec.warmup.calls == 1000 and spec.inputs[0].high == 2**63 - 1


def test_randint_ranges_match_torch() -> None:
    """RANDINT_RANGE restates torch's bounds (parsing is torch-free): hold it to torch."""
    import warnings

    import torch

    for dtype, (low, high) in RANDINT_RANGE.items():
        dt = getattr(torch, dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.randint(low, high, (2,), dtype=dt)
            for bad_low, bad_high in ((low - 1, high), (low, high + 1)):
                with pytest.raises(RuntimeError, match="out of bounds"):
                    torch.randint(bad_low, bad_high, (2,), dtype=dt)


# --- problems only the worker can see (item 10): one line, exit 2, at the key ------------------


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


@pytest.mark.slow  # a fresh worker process each (torch imported: ~4 s)
@pytest.mark.parametrize(
    ("old", "new", "expected", "limited"),
    [
        (
            "  call_kwargs: {scale: 2.0}",
            "  call_kwargs: {scale: 2.0}\n  device: cuda",
            ":6:3: model.device: device: cuda, but torch sees no CUDA device here",
            False,
        ),
        (
            "{scale: 2.0}",
            "{scale: 2.0, temperature: 1}",
            ":5:29: model.call_kwargs.temperature: forward() has no argument 'temperature' "
            "(it takes: x, scale)",
            False,
        ),
        (  # 8 GiB of float32 under a 4 GiB address-space limit: refused before allocating
            "batch: [2, 3, 5]",
            "batch: [2, 134217728]",
            ":9:15: inputs.0.shape: bucket batch=134217728 needs 8.00 GiB for its inputs ('x' "
            "[134217728, 16] float32: 8.00 GiB), more than the 4.00 GiB this process may "
            "allocate (RLIMIT_AS)",
            True,
        ),
        (
            "{dim: 16, hidden: 32}",
            "{dim: 16, hidden: -1}",
            ":4:3: model.kwargs: the factory raised RuntimeError: Trying to create tensor with "
            "negative dimension -1",
            False,
        ),
        (
            "  dynamic: false",
            "  dynamic: false\n  backend: no_such_backend",
            ":8:3: compile.backend: torch.compile refused it: Invalid backend: 'no_such_backend'",
            False,
        ),
        (  # torch's refusal lists every option, cpu_backend among them: no backend error
            "  dynamic: false",
            "  dynamic: false\n  options: {max_autotun: true}",
            ":8:13: compile.options.max_autotun: torch.compile refused it: unknown Inductor "
            "option 'max_autotun' (did you mean 'max_autotune'?)",
            False,
        ),
    ],
    ids=["no-cuda", "call-kwargs", "too-large", "factory-raises", "backend", "option-typo"],
)
def test_worker_spec_problems_are_one_located_line(
    tmp_path, old: str, new: str, expected: str, limited: bool
) -> None:
    path = tmp_path / "spec.yaml"
    path.write_text(mlp_spec().replace(old, new))
    lines = _failed_bake(path, limited=limited)
    assert len(lines) == 1 and lines[0].startswith(f"kiln: error: {path}{expected}"), lines


def _failed_bake(path: Path, *, limited: bool = False) -> list[str]:
    """``kiln bake PATH``'s stderr lines, which must exit 2 without an artifact. A loaded
    machine's slow start-up adds progress lines ("  still running: start-up …"), left out."""
    out = path.parent / "o.kiln.tar.zst"
    proc = subprocess.run(
        [sys.executable, "-m", "kiln", "bake", str(path), "-o", str(out)],
        cwd=path.parent,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=_limit_memory if limited else None,
    )
    assert proc.returncode == 2, proc.stderr
    assert not out.exists()
    return [ln for ln in proc.stderr.strip().splitlines() if not ln.startswith("  still running")]


_ENCODER = "\n".join(
    [
        "name: enc",
        "model:",
        f"  factory: {MODELS}:masked_encoder",
        "inputs:",
        "  - {name: input_ids, shape: [batch, seq], dtype: int64, fill: randint, high: 1000}",
        "  - {name: attention_mask, shape: [batch, seq], dtype: int64, fill: ones}",
        "buckets:",
        "  batch: [1, 2]",
        "  seq: [8, 16]",
        "",
    ]
)


@pytest.mark.slow  # a fresh worker process each (torch imported: ~4 s), nothing compiled
@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            mlp_spec().replace("[batch, 16]", "[batch, 15]"),
            ":8:1: inputs: the model refused bucket batch=2's inputs: RuntimeError: mat1 and "
            "mat2 shapes cannot be multiplied (2x15 and 16x32)",
        ),
        (
            mlp_spec().replace("  call_kwargs:", "  dtype: bfloat16\n  call_kwargs:"),
            ":5:3: model.dtype: the model refused bucket batch=2's inputs: RuntimeError: mat1 "
            "and mat2 must have the same dtype, but got Float and BFloat16 (model.dtype is "
            "bfloat16, input 'x' is float32)",
        ),
        (  # the vocabulary is 1000
            _ENCODER.replace("high: 1000", "high: 5000"),
            ":5:73: inputs.0.high: the model refused bucket batch=1,seq=8's inputs: IndexError: "
            "index out of range in self (input 'input_ids' draws from [0, 5000))",
        ),
        (  # the position table has 512 rows: only the longer bucket breaks it
            _ENCODER.replace("seq: [8, 16]", "seq: [8, 600]"),
            ":9:12: buckets.seq.1: the model refused bucket batch=1,seq=600's inputs: "
            "IndexError: index out of range in self (smaller buckets passed: seq=600 is past "
            "what the model takes)",
        ),
    ],
    ids=["shape", "dtype", "index-range", "one-bucket"],
)
def test_inputs_the_model_refuses_are_found_before_compiling(
    tmp_path, text: str, expected: str
) -> None:
    """An eager call of each bucket before the first compile: one located line, exit 2, where
    torch.compile failed after 15 to 60 s with Dynamo's or a generated file's traceback."""
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    assert _failed_bake(path) == [f"kiln: error: {path}{expected}"]


def test_bake_passes_are_bounded_before_anything_runs(write_spec, tmp_path: Path, cli) -> None:
    import kiln
    from kiln.errors import UsageError

    spec = write_spec(mlp_spec())
    with pytest.raises(UsageError, match="passes"):
        kiln.bake(spec, tmp_path / "a.kiln.tar.zst", passes=1_000_000)
    proc = cli("bake", spec, "--passes", "1000000", no_torch=True)
    assert proc.returncode == 2, proc.stderr
    assert not (tmp_path / "a.kiln.tar.zst").exists()
