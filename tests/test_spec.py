"""Spec validation: every error names file:line:col and the key, and exits 2."""

from __future__ import annotations

import json

import pytest

from kiln.errors import SpecError
from kiln.spec import MODE_OPTIONS, load_spec
from tests.conftest import mlp_spec


def error_of(write_spec, text: str) -> str:
    path = write_spec(text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    return str(info.value).replace(str(path), "spec.yaml")


def test_valid_spec_loads(write_spec) -> None:
    spec = load_spec(write_spec(mlp_spec()))
    assert spec.name == "tiny-mlp"
    assert spec.compile.torch_kwargs() == {
        "backend": "inductor",
        "dynamic": False,
        "fullgraph": False,
        "mode": "default",
    }
    assert spec.sha256() == load_spec(write_spec(mlp_spec() + "\n# comment\n", "b.yaml")).sha256()


def test_unknown_key(write_spec) -> None:
    text = mlp_spec().replace("  dynamic: false", "  dynamic: false\n  dynamc: true")
    assert error_of(write_spec, text) == "spec.yaml:8:3: compile.dynamc: unknown key"


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


def test_precompile_needs_fullgraph(write_spec) -> None:
    text = mlp_spec().replace("  dynamic: false", "  dynamic: false\n  precompile: true")
    assert error_of(write_spec, text) == (
        "spec.yaml:8:3: compile.precompile: precompile: true needs fullgraph: true "
        "(no graph breaks)"
    )
    ok = load_spec(
        write_spec(text.replace("precompile: true", "precompile: true\n  fullgraph: true"))
    )
    assert ok.compile.precompile and "precompile" not in ok.compile.torch_kwargs()


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
    kwargs = spec.compile.torch_kwargs()
    assert spec.compile.autotunes is (options is not None)
    assert spec.compile.cudagraphs is ("reduce-overhead" in compile_lines)
    assert kwargs.get("options") == options
    assert ("mode" in kwargs) is (options is None)
    cold = spec.compile.cold_torch_kwargs()
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


def test_yaml_syntax_error(write_spec) -> None:
    msg = error_of(write_spec, "name: x\nmodel: [unclosed\n")
    assert msg.startswith("spec.yaml:3:1: invalid YAML")


def test_exclude_unknown_axis(write_spec) -> None:
    msg = error_of(write_spec, mlp_spec() + "exclude: [{seq: 3}]\n")
    assert msg == "spec.yaml:13:12: exclude.0.seq: unknown axis 'seq'"


def test_cli_spec_error_exit_2(cli, write_spec) -> None:
    path = write_spec(mlp_spec() + "bogus: 1\n")
    proc = cli("bake", path, "-o", "out.kiln.tar.zst", no_torch=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[0].endswith(f"{path}:13:1: bogus: unknown key")
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
