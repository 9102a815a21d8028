"""YAML with source positions and bounds, for the spec (:mod:`kiln.spec`).

pydantic knows an error's path (``inputs.0.shape``), PyYAML knows where each node was written,
and PyYAML left alone keeps the last of two duplicate keys and expands aliases without limit.
This module composes the node tree itself, bounded, builds plain Python values from it, and maps
a pydantic error (or a :class:`LocatedValueError` from a model's cross-field check) back to the
``file:line:col`` of its key. It knows YAML and pydantic, not the spec's models: those are
handed in. Torch-free.
"""

from __future__ import annotations

import difflib
import re
import types
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from kiln.errors import SpecError

# --- limits --------------------------------------------------------------------------------
# A spec is input from CI, so every number in it is bounded where it is parsed: a typo or a
# hostile value is exit 2 with its location, never a worker that compiles, allocates or loops
# until it is killed. The bounds are far beyond any real grid (docs/spec.md).
MAX_SPEC_BYTES = 1 << 20  # the file itself
MAX_YAML_NODES = 20_000  # values in the document, each alias counted at its expanded size
MAX_YAML_DEPTH = 32  # levels of nesting (a spec needs 5)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # every integer in a spec (torch's widest)


class LocatedValueError(ValueError):
    """A cross-field error that knows which key it belongs to (pydantic only knows the model)."""

    def __init__(self, loc: tuple[str | int, ...], message: str) -> None:
        super().__init__(message)
        self.loc = loc
        self.message = message


def did_you_mean(word: str, choices: Any) -> str:
    """`` (did you mean 'x'?)`` when one of ``choices`` is close to ``word``, else nothing."""
    close = difflib.get_close_matches(word, [str(c) for c in choices], n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


# An exponent float as YAML 1.2 and JSON write it (``1e9``, ``-1.5E-3``): YAML 1.1, which PyYAML
# reads, takes a float only with a dot and a signed exponent, and reads these as strings.
_EXPONENT_FLOAT = re.compile(r"([-+]?)([0-9]*)(?:\.([0-9]*))?[eE]([-+]?)([0-9]+)")


def yaml11_float(text: str) -> str | None:
    """``text`` as YAML 1.1 spells the float it means (``-1e9``: ``-1.0e+9``), when it is an
    exponent float that YAML 1.1 read as a string; else None. A value that reached the spec as
    the string ``"-1e9"`` was meant as a number: the error names the spelling that is one."""
    match = _EXPONENT_FLOAT.fullmatch(text)
    if match is None:
        return None
    sign, whole, fraction, exp_sign, exponent = match.groups()
    if not (whole or fraction):
        return None
    spelled = f"{sign}{whole or '0'}.{fraction or '0'}e{exp_sign or '+'}{exponent}"
    return spelled if isinstance(yaml.safe_load(spelled), float) else None


def fields_at(model: type[BaseModel], loc: tuple[str | int, ...]) -> list[str]:
    """The keys ``model`` allows at ``loc`` (``()`` is the top level); [] where free-form.

    Follows the models' annotations (a model, a list of models, an optional model), so an
    unknown key is compared with its own level's fields, however deep it is.
    """
    annotation: Any = model
    for part in loc:
        annotation = _without_none(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(str(part))
            if field is None:
                return []
            annotation = field.annotation
        elif get_origin(annotation) is list and isinstance(part, int):
            annotation = get_args(annotation)[0]
        else:
            return []
    annotation = _without_none(annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return list(annotation.model_fields)
    return []


def _without_none(annotation: Any) -> Any:
    """``X`` for ``X | None``; any other annotation as it is."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


# --- YAML with positions and bounds -------------------------------------------------------
#
# A spec may come from anywhere (a pull request, a pipeline variable), and PyYAML left alone will
# expand a kilobyte of nested aliases into billions of nodes, recurse until RecursionError on deep
# nesting, and raise assorted exceptions on tags it cannot construct. So kiln composes the node
# tree itself, with bounds, and builds plain Python values from it: only strings, 64-bit
# integers, floats, booleans, null, lists and mappings with string keys. Anchors and aliases stay
# allowed (a shared size list is handy) but count at their expanded size, so a bomb stops at
# MAX_YAML_NODES; an alias inside its own anchor is refused; merge keys (``<<``) are refused.

_TAG = "tag:yaml.org,2002:"
_SCALAR_TAGS = frozenset(_TAG + t for t in ("str", "int", "float", "bool", "null"))
# Implicitly resolved tags that kiln reads as the plain text they are written as: YAML 1.1
# timestamps (``2024-01-01``), ``=`` and ``<<`` as a value are not values a spec needs (``<<`` as
# a key is refused, see check_key).
_PLAIN_TAGS = frozenset(_TAG + t for t in ("timestamp", "value", "yaml", "merge"))


# libyaml's parser where PyYAML was built with it (several times faster), else PyYAML's own; both
# give the same events, and kiln composes and constructs from those itself.
_Loader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _tag_name(tag: str) -> str:
    return "!!" + tag.removeprefix(_TAG) if tag.startswith(_TAG) else tag


class _Composer:
    """Builds a node tree from PyYAML's event stream, refusing what a spec never needs.

    Depth and expanded size are checked as events arrive, so a hostile document is refused after
    at most MAX_YAML_NODES nodes of work, whatever its size once expanded.
    """

    def __init__(self, text: str, file: str) -> None:
        self.loader = _Loader(text)
        self.file = file
        self.expanded = 0  # nodes composed so far, each alias counted at its expanded size
        # anchor -> (node, expanded size, height); size None while the anchored node is open
        self.anchors: dict[str, tuple[yaml.Node, int | None, int]] = {}

    def error(self, message: str, mark: Any) -> SpecError:
        return SpecError(
            message,
            file=self.file,
            line=mark.line + 1 if mark is not None else None,
            col=mark.column + 1 if mark is not None else None,
        )

    def document(self) -> yaml.Node | None:
        loader = self.loader
        loader.get_event()  # stream start
        if loader.check_event(yaml.StreamEndEvent):
            return None
        loader.get_event()  # document start
        node, _ = self.node(1)
        loader.get_event()  # document end
        if not loader.check_event(yaml.StreamEndEvent):
            event = loader.get_event()
            raise self.error("a spec is one YAML document (found a second one)", event.start_mark)
        return node

    def count(self, n: int, mark: Any) -> None:
        self.expanded += n
        if self.expanded > MAX_YAML_NODES:
            raise self.error(
                f"the document holds more than {MAX_YAML_NODES} values (an alias counts "
                "as everything it repeats): refused",
                mark,
            )

    def node(self, depth: int) -> tuple[yaml.Node, int]:
        """The next node and its height (levels of nesting, aliases expanded)."""
        event = self.loader.peek_event()
        if isinstance(event, yaml.AliasEvent):
            return self.alias(depth)
        self.check_depth(depth, event.start_mark)
        anchor = event.anchor
        if anchor is not None and anchor in self.anchors:
            raise self.error(f"duplicate anchor &{anchor}", event.start_mark)
        start = self.expanded
        self.count(1, event.start_mark)
        if isinstance(event, yaml.ScalarEvent):
            node: yaml.Node = self.scalar()
            if anchor is not None:
                self.anchors[anchor] = (node, 1, 1)
            return node, 1
        collection, height = self.collection(depth, anchor)
        if anchor is not None:
            self.anchors[anchor] = (collection, self.expanded - start, height)
        return collection, height

    def alias(self, depth: int) -> tuple[yaml.Node, int]:
        """An alias: its anchor's node, counted at its expanded size and height."""
        event = self.loader.get_event()
        if event.anchor not in self.anchors:
            raise self.error(f"undefined alias *{event.anchor}", event.start_mark)
        target, size, height = self.anchors[event.anchor]
        if size is None:
            raise self.error(
                f"recursive alias *{event.anchor} (used inside its own anchor)",
                event.start_mark,
            )
        self.count(size, event.start_mark)
        self.check_depth(depth + height - 1, event.start_mark)
        return target, height

    def collection(
        self, depth: int, anchor: str | None
    ) -> tuple[yaml.SequenceNode | yaml.MappingNode, int]:
        """A sequence or mapping and its height; while it is open, its anchor names it with
        no size yet, so an alias to it inside itself is refused."""
        loader = self.loader
        event = loader.get_event()
        kind = "seq" if isinstance(event, yaml.SequenceStartEvent) else "map"
        if event.tag not in (None, "!", _TAG + kind):
            raise self.error(
                f"tag {_tag_name(event.tag)} is not allowed in a spec", event.start_mark
            )
        collection: yaml.SequenceNode | yaml.MappingNode
        if kind == "seq":
            collection = yaml.SequenceNode(_TAG + kind, [], event.start_mark, None)
        else:
            collection = yaml.MappingNode(_TAG + kind, [], event.start_mark, None)
        if anchor is not None:
            self.anchors[anchor] = (collection, None, 0)
        height = 1
        end = yaml.SequenceEndEvent if kind == "seq" else yaml.MappingEndEvent
        while not loader.check_event(end):
            if kind == "seq":
                item, h = self.node(depth + 1)
                collection.value.append(item)
            else:
                key, _ = self.node(depth + 1)
                self.check_key(key)
                item, h = self.node(depth + 1)
                collection.value.append((key, item))
            height = max(height, h + 1)
        collection.end_mark = loader.get_event().end_mark
        return collection, height

    def scalar(self) -> yaml.ScalarNode:
        event = self.loader.get_event()
        if event.tag in (None, "!"):
            tag = self.loader.resolve(yaml.ScalarNode, event.value, event.implicit)
            if tag in _PLAIN_TAGS:
                tag = _TAG + "str"
        elif event.tag in _SCALAR_TAGS:
            tag = event.tag
        else:
            raise self.error(
                f"tag {_tag_name(event.tag)} is not allowed in a spec (plain strings, numbers, "
                "booleans, null, lists and mappings only)",
                event.start_mark,
            )
        return yaml.ScalarNode(tag, event.value, event.start_mark, event.end_mark, event.style)

    def check_key(self, key: yaml.Node) -> None:
        if isinstance(key, yaml.ScalarNode) and key.value == "<<" and not key.style:
            raise self.error(
                "merge keys (<<) are not supported: write the keys out", key.start_mark
            )
        if not isinstance(key, yaml.ScalarNode) or key.tag != _TAG + "str":
            raise self.error(
                "mapping keys must be strings (quote a key that reads as a number, boolean or "
                "null)",
                key.start_mark,
            )

    def check_depth(self, depth: int, mark: Any) -> None:
        if depth > MAX_YAML_DEPTH:
            raise self.error(f"nested deeper than {MAX_YAML_DEPTH} levels: refused", mark)


def compose(text: str, file: str) -> yaml.Node | None:
    """The document's bounded node tree; every problem is a located :class:`SpecError`."""
    if len(text) > MAX_SPEC_BYTES or len(text.encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
        raise SpecError(f"spec is larger than {MAX_SPEC_BYTES} bytes", file=file)
    try:
        return _Composer(text, file).document()
    except yaml.MarkedYAMLError as exc:
        message, mark = _syntax_error(exc)
        raise SpecError(
            f"invalid YAML: {message}",
            file=file,
            line=mark.line + 1 if mark else None,
            col=mark.column + 1 if mark else None,
        ) from None
    except yaml.reader.ReaderError as exc:
        before = text[: exc.position]
        raise SpecError(
            f"invalid YAML: character {_codepoint(exc.character)} is not allowed",
            file=file,
            line=before.count("\n") + 1,
            col=exc.position - (before.rfind("\n") + 1) + 1,
        ) from None
    except yaml.YAMLError as exc:  # no position known
        raise SpecError(f"invalid YAML: {exc}", file=file) from None
    except UnicodeError:  # lone surrogates in text that did not come from a file
        raise SpecError("invalid YAML: the text is not valid Unicode", file=file) from None


def _syntax_error(exc: yaml.MarkedYAMLError) -> tuple[str, Any]:
    """What PyYAML (or libyaml) found, and where the mistake is.

    The parser notices a missing thing only at the next token, which is often on a later line:
    a key without its ':' is reported on the line after it, an unclosed quote or bracket at the
    end of the file. Its *context* mark is where it started the construct it could not finish;
    when that is on an earlier line, the mistake is there. Block contexts are the exception:
    "while parsing a block mapping" starts at the mapping's first key, while a mis-indented line
    is the problem mark's own.
    """
    problem, context = exc.problem, exc.context
    message = problem or context or "syntax error"
    p, c = exc.problem_mark, exc.context_mark
    if (
        p is not None
        and c is not None
        and context
        and c.line < p.line
        and not context.startswith("while parsing a block")
    ):
        return f"{message} ({context})" if problem else message, c
    return message, p or c


def _codepoint(character: str | int | bytes) -> str:
    """PyYAML's reader reports a str, libyaml's an int, a decoding error a byte."""
    if isinstance(character, bytes):
        return "0x" + character.hex()
    return f"U+{character if isinstance(character, int) else ord(character):04X}"


def construct(loader: yaml.SafeLoader, node: yaml.Node, file: str, path: tuple[str, ...]) -> Any:
    """Plain Python values from a composed tree (aliases already bounded by the composer)."""
    if isinstance(node, yaml.MappingNode):
        out: dict[str, Any] = {}
        first: dict[str, yaml.Node] = {}
        for key_node, value_node in node.value:
            key = _scalar(loader, key_node, file)
            where = (*path, key)
            if key in first:
                raise SpecError(
                    f"duplicate key (first defined on line {first[key].start_mark.line + 1})",
                    file=file,
                    line=key_node.start_mark.line + 1,
                    col=key_node.start_mark.column + 1,
                    key=printable(".".join(where)),
                )
            first[key] = key_node
            out[key] = construct(loader, value_node, file, where)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [construct(loader, item, file, (*path, str(i))) for i, item in enumerate(node.value)]
    return _scalar(loader, node, file)


def _scalar(loader: yaml.SafeLoader, node: yaml.Node, file: str) -> Any:
    def refuse(message: str) -> SpecError:
        return SpecError(
            message, file=file, line=node.start_mark.line + 1, col=node.start_mark.column + 1
        )

    try:
        value = loader.construct_object(node, deep=True)
    except Exception:  # PyYAML's converters raise what they meet (`!!int ""`: IndexError)
        shown = repr(node.value) if len(node.value) <= 40 else repr(node.value[:40]) + "…"
        what = "a 64-bit integer" if node.tag == _TAG + "int" else f"a valid {_tag_name(node.tag)}"
        raise refuse(f"{shown} is not {what}") from None
    if (
        isinstance(value, int)
        and not isinstance(value, bool)
        and not INT64_MIN <= value <= INT64_MAX
    ):
        raise refuse("integer beyond 64 bits")
    if isinstance(value, str) and "\0" in value:
        raise refuse("strings must not contain NUL characters")
    return value


def locate(root: yaml.Node | None, loc: tuple[str | int, ...]) -> tuple[int, int] | None:
    """Source position of the deepest node along ``loc`` (the key itself when it is a key)."""
    node = root
    best: yaml.Node | None = root
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if str(key_node.value) == str(part):
                    best, node = key_node, value_node
                    break
            else:
                break
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                break
            node = best = node.value[part]
        else:
            break
    if best is None:
        return None
    return best.start_mark.line + 1, best.start_mark.column + 1


def dotted(loc: tuple[str | int, ...]) -> str:
    return printable(".".join(str(p) for p in loc)) or "<root>"


def printable(text: str) -> str:
    """Keys come from the spec: a line break in one must not split the one-line error."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def without_type_tags(loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
    """pydantic appends union member names ("str", "int", "function-after[...]") to locs."""
    return tuple(
        p
        for p in loc
        if not (
            isinstance(p, str)
            and (p in {"str", "int", "float", "bool", "none", "list", "dict"} or "[" in p)
        )
    )


def read_mapping(text: str, file: str) -> tuple[yaml.MappingNode, dict[str, Any]]:
    """The document's node tree (for :func:`locate`) and its plain values; a document that is
    empty or not a mapping is a located :class:`SpecError`."""
    root = compose(text, file)
    if root is None:
        raise SpecError("empty spec", file=file, line=1, col=1)
    if not isinstance(root, yaml.MappingNode):
        line, col = root.start_mark.line + 1, root.start_mark.column + 1
        raise SpecError("a spec is a mapping of keys", file=file, line=line, col=col)
    return root, construct(yaml.SafeLoader(""), root, file, ())


def located_error(
    exc: ValidationError, root: yaml.Node, file: str, model: type[BaseModel]
) -> SpecError:
    """``model``'s validation error as one :class:`SpecError` at its key's ``file:line:col``."""
    errors = exc.errors()
    # A typo'd key is the cause of the "missing" error it leaves behind: name it first.
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc: tuple[str | int, ...] = tuple(err["loc"])
    message = err["msg"]
    located = (err.get("ctx") or {}).get("error")
    if isinstance(located, LocatedValueError):
        loc, message = without_type_tags(loc) + located.loc, located.message
    elif err["type"] == "extra_forbidden":
        # the last part is the spec's own key, never a type tag, whatever it spells
        parent, key = without_type_tags(loc[:-1]), str(loc[-1])
        loc, message = (*parent, key), f"unknown key {key!r}"
        message += did_you_mean(key, fields_at(model, parent))
    else:
        loc = without_type_tags(loc)
    pos = locate(root, loc)
    line, col = pos if pos else (None, None)
    return SpecError(
        printable(message.removeprefix("Value error, ")),
        file=file,
        line=line,
        col=col,
        key=dotted(loc),
    )
