"""Property-based fuzzing of spec parsing: every input parses or is one located SpecError.

A spec arrives from CI, a pull request or a pipeline variable, so the parser is an input
boundary: whatever the text, ``parse_spec`` returns a Spec or raises :class:`SpecError` (exit 2,
one line), never another exception (exit 1, a traceback) and never a hang. The strategies
cover arbitrary text, YAML-shaped text built from scalars, tags, anchors and aliases, deep
nesting, huge integers and odd Unicode, and valid specs with values, keys and characters
perturbed. A hard timer turns a hang into a failure instead of a stuck suite.
"""

from __future__ import annotations

import json
import string
from datetime import timedelta
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.errors import ExitCode, SpecError
from kiln.grid import expand
from kiln.serving import torch_kwargs
from kiln.spec import Spec, parse_spec
from tests.conftest import hard_limit, mlp_spec

FUZZ = settings(
    max_examples=150,
    deadline=timedelta(seconds=3),  # 2 shared cores; a real spec parses in milliseconds
    database=None,  # nothing written into the work tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
HARD_LIMIT_S = 10  # a hang, not a slow example


def check(text: str) -> Spec | None:
    """The property: a Spec, or a one-line SpecError with exit code 2."""
    with hard_limit(HARD_LIMIT_S):
        try:
            spec = parse_spec(text, file="fuzz.yaml")
        except SpecError as exc:
            assert exc.exit_code == ExitCode.USAGE
            message = str(exc)
            assert message.startswith("fuzz.yaml"), message
            assert message.isprintable(), message  # one line, whatever the spec's keys hold
            return None
        # What bake, verify and the manifest derive from a spec must hold for any valid one.
        assert 1 <= len(expand(spec)) <= 4096  # `exclude` never empties it, nor names no size
        spec.sha256()
        spec.compile_env()
        torch_kwargs(spec.compile)
        return spec


# --- arbitrary text ---------------------------------------------------------------------------


@FUZZ
@given(st.text(st.characters(codec=None, exclude_categories=()), max_size=400))
def test_arbitrary_text(text: str) -> None:
    check(text)


@FUZZ
@given(st.binary(max_size=300))
def test_arbitrary_bytes_as_latin1(data: bytes) -> None:
    check(data.decode("latin-1"))


# --- YAML-shaped text --------------------------------------------------------------------------

ODD = st.text(
    st.sampled_from(
        [*"ab_:-#&*!|>%@`'\"{}[],? \t\\", "\n", "\u0085", "\u2028", "\ufeff", "é", "𝔘", "\x00"]
    ),
    max_size=12,
)
PLAIN_WORDS = st.sampled_from(
    [
        "x",
        "yes",
        "no",
        "on",
        "off",
        "~",
        "null",
        ".inf",
        "-.inf",
        ".nan",
        "2024-01-01",
        "2024-13-45",
        "2001-12-14t21:59:43.10-05:00",
        "=",
        "<<",
        "0x1F",
        "0o17",
        "0b101",
        "017",
        "1:30:00",
        "1_000",
        "+12",
        "-0",
        "1e400",
        "9" * 30,
        "-" + "9" * 30,
        str(2**63),
        str(-(2**63) - 1),
        "9" * 5000,
        "float32",
        "randint",
        "cuda",
        "batch",
    ]
)
SCALARS = st.one_of(
    PLAIN_WORDS,
    st.integers().map(str),
    st.floats().map(repr),
    st.text(max_size=20).map(json.dumps),  # double-quoted, with escapes
    ODD.map(lambda s: "'" + s.replace("'", "''") + "'"),
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True),
)
TAGS = st.sampled_from(
    [
        "",
        "",
        "",
        "!!python/object/apply:os.system ",
        "!!python/name:os.system ",
        "!!str ",
        "!!int ",
        "!!float ",
        "!!bool ",
        "!!null ",
        "!!binary ",
        "!!timestamp ",
        "!!set ",
        "!!omap ",
        "!!map ",
        "!!seq ",
        "!custom ",
        "!<tag:example.com,2024:x> ",
        "! ",
    ]
)
ANCHORS = st.sampled_from(["", "", "", "&a ", "&b ", "&a1 "])
ALIASES = st.sampled_from(["*a", "*b", "*a1", "*undefined"])


def _node(children: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    seq = st.lists(children, max_size=5).map(lambda xs: "[" + ", ".join(xs) + "]")
    pairs = st.lists(
        st.tuples(st.one_of(SCALARS, children.map(lambda k: "? " + k)), children), max_size=5
    )
    mapping = pairs.map(lambda kvs: "{" + ", ".join(f"{k}: {v}" for k, v in kvs) + "}")
    return st.one_of(
        st.tuples(TAGS, ANCHORS, seq).map("".join), st.tuples(TAGS, ANCHORS, mapping).map("".join)
    )


YAMLISH = st.recursive(
    st.one_of(st.tuples(TAGS, ANCHORS, SCALARS).map("".join), ALIASES), _node, max_leaves=40
)
DEEP = st.one_of(
    st.integers(1, 3000).map(lambda n: "[" * n + "]" * n),
    st.integers(1, 3000).map(lambda n: "{a: " * n + "1" + "}" * n),
    st.integers(1, 300).map(lambda n: "".join(f"{'  ' * i}k{i}:\n" for i in range(n))),
    st.integers(1, 12).map(
        lambda n: "\n".join(
            f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}" if i else "lol"] * 9) + "]" for i in range(n)
        )
    ),
)

# Places in a valid spec where a fragment replaces the value (each key occurs once in mlp_spec).
SLOTS = [
    "name: tiny-mlp",
    "kwargs: {dim: 16, hidden: 32}",
    "call_kwargs: {scale: 2.0}",
    "dynamic: false",
    "shape: [batch, 16]",
    "batch: [2, 3, 5]",
    "warmup: {calls: 2}",
]


@FUZZ
@given(st.one_of(YAMLISH, DEEP))
def test_yaml_shaped_documents(fragment: str) -> None:
    check(fragment)


@FUZZ
@given(st.sampled_from(SLOTS), st.one_of(YAMLISH, DEEP))
def test_yaml_shaped_values_inside_a_valid_spec(slot: str, fragment: str) -> None:
    key = slot.split(":")[0]
    text = mlp_spec().replace(slot, f"{key}: {fragment}" if "\n" not in fragment else key + ":")
    if "\n" in fragment:  # a block fragment goes on its own lines
        text += fragment + "\n"
    check(text)


@FUZZ
@given(
    st.one_of(YAMLISH, DEEP),
    st.one_of(st.sampled_from(["env", "exclude", "extra", "compile"]), ODD.map(json.dumps)),
)
def test_yaml_shaped_top_level_keys(fragment: str, key: str) -> None:
    check(mlp_spec() + (f"{key}: {fragment}\n" if "\n" not in fragment else fragment + "\n"))


# --- mutated valid specs ------------------------------------------------------------------------

VALUES = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 10**30]),
        st.floats(),
        st.text(max_size=20),
        st.sampled_from(["cuda", "cpu", "randint", "int32", "bool", "float16", "batch", ""]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(
            st.one_of(st.text(max_size=10), st.sampled_from(["name", "x"])), inner, max_size=4
        ),
    ),
    max_leaves=12,
)
KEYS = st.one_of(
    st.text(max_size=12),
    st.sampled_from(
        [
            "high",
            "low",
            "fill",
            "device",
            "passes",
            "precompile",
            "mode",
            "options",
            "exclude",
            "env",
            "LD_PRELOAD",
            "TORCHINDUCTOR_CACHE_DIR",
            "TORCH_LOGS",
            "A=1; touch pwned; B",
            "a\nb",
            "\u2028",
            "x\ry",
        ]
    ),
)


def _containers(data: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Paths of every dict and list in ``data`` (mutation sites)."""
    found = [path] if isinstance(data, dict | list) else []
    items = (
        data.items()
        if isinstance(data, dict)
        else enumerate(data)
        if isinstance(data, list)
        else ()
    )
    for key, value in items:
        found += _containers(value, (*path, key))
    return found


def _at(data: Any, path: tuple[Any, ...]) -> Any:
    for part in path:
        data = data[part]
    return data


@st.composite
def mutated_specs(draw: st.DrawFn) -> str:
    data = yaml.safe_load(mlp_spec())
    for _ in range(draw(st.integers(1, 4))):
        sites = _containers(data)
        target = _at(data, draw(st.sampled_from(sites)))
        action = draw(st.sampled_from(["set", "delete", "add"]))
        if isinstance(target, dict):
            if action == "add" or not target:
                target[draw(KEYS)] = draw(VALUES)
            elif action == "delete":
                del target[draw(st.sampled_from(sorted(target)))]
            else:
                target[draw(st.sampled_from(sorted(target)))] = draw(VALUES)
        elif isinstance(target, list):
            if action == "add" or not target:
                target.append(draw(VALUES))
            elif action == "delete":
                target.pop(draw(st.integers(0, len(target) - 1)))
            else:
                target[draw(st.integers(0, len(target) - 1))] = draw(VALUES)
    style = draw(st.sampled_from(["block", "flow", "json"]))
    if style == "json":
        return json.dumps(data, ensure_ascii=draw(st.booleans()))
    return yaml.safe_dump(data, default_flow_style=style == "flow", allow_unicode=True)


@FUZZ
@given(mutated_specs())
def test_mutated_valid_specs(text: str) -> None:
    check(text)


@FUZZ
@given(
    st.lists(
        st.tuples(
            st.floats(0, 1),
            st.sampled_from(["insert", "delete", "replace"]),
            st.lists(
                st.sampled_from([*string.printable, "&a ", "*a", "!!", "\u2028", "é"]),
                min_size=1,
                max_size=3,
            ).map("".join),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_character_level_mutations(edits: list[tuple[float, str, str]]) -> None:
    text = mlp_spec()
    for where, action, chars in edits:
        i = int(where * len(text))
        if action == "insert":
            text = text[:i] + chars + text[i:]
        elif action == "delete":
            text = text[:i] + text[i + len(chars) :]
        else:
            text = text[:i] + chars + text[i + len(chars) :]
    check(text)


def test_the_unmutated_spec_parses() -> None:
    """The seed of the mutations is valid: otherwise they test nothing but the first error."""
    assert check(mlp_spec()) is not None
    data = yaml.safe_load(mlp_spec())
    assert check(json.dumps(data)) is not None
    assert check(yaml.safe_dump(data, default_flow_style=True)) is not None


# --- the CLI: exit 2, one line, no traceback ----------------------------------------------------


def _bomb() -> str:
    return "\n".join(
        f"l{i}: &l{i} [" + ", ".join([f"*l{i - 1}" if i else "lol"] * 9) + "]" for i in range(9)
    )


@pytest.mark.parametrize(
    "hostile",
    [
        mlp_spec() + _bomb() + "\n",
        mlp_spec().replace("name: tiny-mlp", "name: !!python/object/apply:os.system [touch pwned]"),
        mlp_spec() + "exclude: " + "[" * 3000 + "]" * 3000 + "\n",
        mlp_spec() + "exclude: &x [*x]\n",
        mlp_spec().replace("calls: 2", "calls: " + "9" * 5000),
        mlp_spec() + "env: {'A=1; touch pwned; B': x}\n",
    ],
    ids=["alias-bomb", "python-tag", "deep", "recursive-alias", "huge-int", "env-injection"],
)
def test_cli_maps_hostile_specs_to_one_line_exit_2(cli, write_spec, tmp_path, hostile: str) -> None:
    path = write_spec(hostile)
    proc = cli("bake", path, "-o", "out.kiln.tar.zst", no_torch=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kiln: error: {path}:"), proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "pwned").exists()
