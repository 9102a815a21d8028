"""Library errors name the parameters of the function called; the CLI words the same errors as
its flags (issue 28: "library errors speak CLI"). Each case calls the library directly, then
the command that reaches the same check, and compares both lines in full."""

from __future__ import annotations

import ast
import json
import pickle
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from kiln.cli.output import FLAGS, classify, flagged, json_text
from kiln.errors import PackageLoadError, Param, ParameterError, UsageError, Worded
from tests.archives import good_archive
from tests.conftest import mlp_spec
from tests.test_plan import SPEC, long_tail

ROOT = Path(__file__).resolve().parent.parent
FILES = {"inductor/fxgraph/a/entry": b"A" * 1000}


# --- the wording itself ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("param", "library", "cli"),
    [
        (Param("shard", "0/2"), "shard=0/2", "--shard 0/2"),
        (Param("sha256", "'abc'"), "sha256='abc'", "--sha256 'abc'"),
        (Param("torch_version"), "torch_version", "--torch-version"),
        (Param("weights", "9", key="seq"), "weights['seq']=9", "--weight seq=9"),
        (Param("weights", key="seq"), "weights['seq']", "--weight seq"),
        (Param("verify_keys", "pub.pem"), "verify_keys=pub.pem", "--verify-key pub.pem"),
        (Param("variant", "NAME"), "variant=NAME", "--variant NAME"),
    ],
)
def test_a_parameter_reads_as_its_name_and_on_the_cli_as_its_flag(
    param: Param, library: str, cli: str
) -> None:
    text = Worded("x: ", param, ": y")
    assert text == f"x: {library}: y"
    assert flagged(text) == f"x: {cli}: y"


def test_worded_text_keeps_its_flags_through_nesting_prefixes_pickles_and_json() -> None:
    inner = Worded(Param("attestation"), " needs ", Param("verify_keys"))
    text = Worded("/a: ", inner, ": without a key nothing is verified")
    assert text == "/a: attestation needs verify_keys: without a key nothing is verified"
    want = "/a: --attestation needs --verify-key: without a key nothing is verified"
    assert flagged(text) == want
    assert flagged(text.removeprefix("/a: ")) == want.removeprefix("/a: ")
    assert flagged(text.removeprefix("/b: ")) == want  # no such prefix: the same text
    error = pickle.loads(pickle.dumps(UsageError(text)))
    assert classify(error)[1] == want and error.message == text
    bad = pickle.loads(pickle.dumps(ParameterError("weights", 9.0, "too big", shown="9", key="s")))
    assert (bad.param, bad.value, bad.key, bad.message) == (
        "weights",
        9.0,
        "s",
        "weights['s']=9: too big",
    )
    assert classify(bad)[1] == "--weight s=9: too big"
    document = json.loads(json_text({"variant": {"reason": Worded(Param("variant", "cpu"))}}))
    assert document == {"variant": {"reason": "--variant cpu"}}
    assert flagged("--plain text, as it is") == "--plain text, as it is"


def test_every_flag_the_cli_table_names_is_an_option_of_a_command() -> None:
    """FLAGS maps library parameters to options spelled otherwise: a renamed option fails here."""
    import typer

    from kiln.cli import app

    options = {
        opt
        for command in typer.main.get_command(app).commands.values()  # type: ignore[attr-defined]
        for param in command.params
        for opt in param.opts
    }
    assert set(FLAGS.values()) <= options
    assert not set(FLAGS) & {o.removeprefix("--").replace("-", "_") for o in FLAGS.values()}


# --- library vs command line, check by check ---------------------------------------------------
def _plan_case(tmp_path: Path, **kwargs: object) -> Callable[[], object]:
    from kiln.plan import plan
    from kiln.spec import load_spec
    from kiln.traffic import read_traffic

    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    log = long_tail(tmp_path / "traffic.jsonl", 20)
    parsed = load_spec(spec)
    return lambda: plan(parsed, read_traffic(log, tuple(parsed.buckets)), **kwargs)  # type: ignore[arg-type]


def _plan_argv(tmp_path: Path, *flags: str) -> list[object]:
    return ["plan", tmp_path / "spec.yaml", "--shapes", tmp_path / "traffic.jsonl", *flags]


def _shard(tmp_path: Path) -> tuple[Callable[[], object], list[object]]:
    from kiln.grid import Shard

    spec = tmp_path / "spec.yaml"
    spec.write_text(mlp_spec())
    return lambda: Shard.of("3/3"), ["bake", spec, "--shard", "3/3"]


def _dynamic_shard(tmp_path: Path) -> tuple[Callable[[], object], list[object]]:
    from kiln.grid import Shard, expand, shard_grid
    from kiln.spec import load_spec

    spec = tmp_path / "spec.yaml"
    spec.write_text(mlp_spec(dynamic="null"))
    parsed = load_spec(spec)
    return lambda: shard_grid(parsed, expand(parsed), Shard(0, 2)), ["bake", spec, "--shard", "0/2"]


def _variant(tmp_path: Path) -> tuple[Callable[[], object], list[object]]:
    from kiln.artifact.restore import restore

    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    dest = tmp_path / "cache"
    return lambda: restore(art, dest, variant="x"), [
        "restore",
        art,
        "--dest",
        dest,
        "--variant",
        "x",
    ]


def _attestation(tmp_path: Path) -> tuple[Callable[[], object], list[object]]:
    from kiln.artifact.restore import restore

    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    dest, seen = tmp_path / "cache", str(tmp_path / "a.intoto.jsonl")
    return (
        lambda: restore(art, dest, attestation=seen),
        ["restore", art, "--dest", dest, "--attestation", seen],
    )


def _verify_key(tmp_path: Path) -> tuple[Callable[[], object], list[object]]:
    pytest.importorskip("securesystemslib")
    from kiln.artifact.restore import restore

    art = good_archive(tmp_path / "a.kiln.tar.zst", FILES)
    dest, key = tmp_path / "cache", str(tmp_path / "missing.pem")
    return (
        lambda: restore(art, dest, verify_keys=[key]),
        ["restore", art, "--dest", dest, "--verify-key", key],
    )


CASES: dict[str, tuple[Callable[[Path], tuple[Callable[[], object], list[object]]], str, str]] = {
    "shard": (
        _shard,
        "shard=3/3: the index counts from 0, so it is at most 2",
        "--shard 3/3: the index counts from 0, so it is at most 2",
    ),
    "shard of a dynamic spec": (
        _dynamic_shard,
        "shard=0/2: sharding needs compile.dynamic: false (this spec has None)",
        "--shard 0/2: sharding needs compile.dynamic: false (this spec has None)",
    ),
    "weight of no axis": (
        lambda t: (_plan_case(t, weights={"nope": 1.0}), _plan_argv(t, "--weight", "nope=1")),
        "weights['nope']: not an axis of enc (batch, seq)",
        "--weight nope: not an axis of enc (batch, seq)",
    ),
    "weight too large": (
        lambda t: (_plan_case(t, weights={"seq": 9.0}), _plan_argv(t, "--weight", "seq=9")),
        "weights['seq']=9: a weight is above 0 and at most 8",
        "--weight seq=9: a weight is above 0 and at most 8",
    ),
    "coverage": (
        lambda t: (_plan_case(t, coverage=2.0), _plan_argv(t, "--coverage", "2")),
        "coverage=2: a share above 0 and at most 1",
        "--coverage 2: a share above 0 and at most 1",
    ),
    "budget without timings": (
        lambda t: (_plan_case(t, budget_s=60.0), _plan_argv(t, "--budget-s", "60")),
        "budget_s needs bake to estimate each bucket's bake time",
        "--budget-s needs --artifact (an artifact or restored folder of this spec) to "
        "estimate each bucket's bake time",
    ),
    "variant of a plain artifact": (
        _variant,
        "variant='x': not a bundle",
        "--variant 'x': not a bundle",
    ),
    "attestation without a key": (
        _attestation,
        "attestation needs verify_keys: without a key nothing is verified",
        "--attestation needs --verify-key: without a key nothing is verified",
    ),
    "verify key that is no file": (
        _verify_key,
        "verify_keys={dir}/missing.pem: no such file",
        "--verify-key {dir}/missing.pem: no such file",
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_the_library_names_the_parameter_and_the_cli_the_flag(
    tmp_path: Path, cli, name: str
) -> None:
    make, library, flags = CASES[name]
    library, flags = library.format(dir=tmp_path), flags.format(dir=tmp_path)
    call, argv = make(tmp_path)
    with pytest.raises(UsageError) as caught:
        call()
    message = caught.value.message
    assert message.startswith(library) or f": {library}" in message, message
    assert "--" not in message, message  # no flag in what a library caller reads
    proc = cli(*argv, no_torch=True)
    assert proc.returncode == 2, proc.stderr
    (line,) = [s for s in proc.stderr.splitlines() if s.startswith("kiln: error: ")]
    if name != "budget without timings":  # kiln plan checks that one itself: --artifact is
        assert line.removeprefix("kiln: error: ") == flagged(message), line  # the library's bake
    assert flags in line, line
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    ("call", "library"),
    [
        ("plan_max_buckets", "max_buckets=0: from 1 to"),
        ("replay_on_miss", "on_miss=bogus: one of "),
        ("bench_repeat", "repeat must be at least 1"),
    ],
)
def test_checks_the_cli_does_before_the_library_still_name_the_parameter(
    tmp_path: Path, call: str, library: str
) -> None:
    """typer refuses ``--max-buckets 0``, ``--on-miss bogus`` and ``--repeat 0`` itself; a
    library caller meets the library's own check, in its own words."""
    if call == "plan_max_buckets":
        run = _plan_case(tmp_path, max_buckets=0)
    elif call == "replay_on_miss":
        from kiln.compiler.replay import replay

        (tmp_path / "cache" / "inductor").mkdir(parents=True)
        spec = tmp_path / "spec.yaml"
        spec.write_text(mlp_spec())
        run = lambda: replay(spec, tmp_path / "cache", tmp_path / "log", on_miss="bogus")  # type: ignore[arg-type]  # noqa: E731
    else:
        from kiln.compiler.bench import bench

        run = lambda: bench(tmp_path / "none.yaml", repeat=0)  # noqa: E731
    with pytest.raises(UsageError) as caught:
        run()
    assert caught.value.message.startswith(library), caught.value.message
    assert flagged(caught.value.message).startswith("--"), caught.value.message


# --- no flag spelled inside a library module --------------------------------------------------
# Real command lines a library module runs or quotes: argv of torchrun, strip and nvidia-smi,
# and the interpreter's own option.
COMMAND_LINES = {
    "compiler/ranks.py": {
        "--standalone",
        "--nnodes",
        "--nproc-per-node",
        "--max-restarts",
        "--monitor-interval",
    },
    "compiler/aoti_bake.py": {"--strip-debug"},
    "artifact/machine.py": {"--query-gpu", "--format"},
    "bytecode.py": {"--check-hash-based-pycs"},
}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _docstrings(tree: ast.AST) -> set[int]:
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, nodes)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def test_no_library_module_words_a_message_as_a_flag() -> None:
    """A string outside ``kiln/cli/`` (docstrings aside) that spells ``--flag`` is a message
    written for the command line: name the parameter (:class:`kiln.errors.Param`) instead.
    A string that quotes a whole ``kiln COMMAND --flag`` line is a command, not a message."""
    package = ROOT / "src" / "kiln"
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        if rel.startswith("cli/"):
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _docstrings(tree)
        allowed = COMMAND_LINES.get(rel, set())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
                continue
            if id(node) in skip:
                continue
            text = re.sub(r"kiln [a-z]+( [A-Z]+)?( --[a-z-]+( [A-Z]+)?)+", "", node.value)
            found += [f"{rel}:{node.lineno}: {f}" for f in FLAG.findall(text) if f not in allowed]
    assert found == []


def test_a_package_load_error_keeps_its_parts_through_a_pickle() -> None:
    """Its message is built from problem and advice: pickled as a plain Exception, the advice
    would be added twice."""
    error = pickle.loads(pickle.dumps(PackageLoadError("library a.so is missing", advice="redo")))
    assert (str(error), error.problem, error.advice) == (
        "library a.so is missing: redo",
        "library a.so is missing",
        "redo",
    )
    assert error.exit_code == 6
