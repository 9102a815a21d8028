"""The spec's model, made real in a worker: its factory imported (next to the spec first), the
model built on the spec's device and dtype and checked against the inputs, and each bucket's
inputs made. Every failure is the spec's, at the key that caused it (:class:`SpecProblem`).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import math
import resource
import sys
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from kiln.compiler import ranks
from kiln.compiler.failures import SpecProblem, one_line
from kiln.compiler.ranks import Rank
from kiln.grid import Bucket, bucket_cost, expand
from kiln.spec import Spec
from kiln.spec_yaml import did_you_mean


def factory_module(factory: str) -> str:
    """The module name a spec's ``model.factory`` is imported as: a file's stem
    (``models/enc.py:make`` is ``enc``, its folder put on ``sys.path``), else the dotted name.
    Classes the factory's module defines are that module's, which precompiled guards check."""
    target = factory.partition(":")[0]
    return PurePosixPath(target).stem if target.endswith(".py") else target


def resolve_factory(spec: Spec) -> Any:
    """Import the spec's factory, looking next to the spec file first."""
    target, _, attr = spec.model.factory.partition(":")
    module_name = factory_module(spec.model.factory)
    if target.endswith(".py"):
        origin = spec.factory_origin()
        assert origin is not None
        base = str(origin.parent)
    else:
        base = str(spec.base_dir)
    sys.path.insert(0, base)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SpecProblem("model.factory", f"cannot import {target!r}: {exc}") from exc
    except Exception as exc:  # the module's own code failed (a SyntaxError, a raise at import)
        raise SpecProblem(
            "model.factory", f"importing {target!r} raised {type(exc).__name__}: {one_line(exc)}"
        ) from exc
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(base)
    obj: Any = module
    for part in attr.split("."):
        owner, obj = obj, getattr(obj, part, None)
        if obj is None:
            names = [n for n in dir(owner) if not n.startswith("_")]
            raise SpecProblem(
                "model.factory", f"{target!r} has no attribute {attr!r}{did_you_mean(part, names)}"
            )
    if not callable(obj):
        raise SpecProblem("model.factory", f"{spec.model.factory!r} is not callable")
    return obj


def make_inputs(spec: Spec, bucket: Bucket, device: Any, seed: int) -> dict[str, Any]:
    """A bucket's inputs; torch refusing one (allocation, range) is a spec problem at that input."""
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    out: dict[str, Any] = {}
    for i, inp in enumerate(spec.inputs):
        shape = bucket.shape_of(inp.shape)
        dtype = getattr(torch, inp.dtype)
        try:
            if inp.fill == "randint":
                high = inp.high or inp.low + 1
                t = torch.randint(inp.low, high, shape, generator=gen, dtype=dtype)
            elif inp.fill == "randn":
                t = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
            elif inp.fill == "ones":
                t = torch.ones(shape, dtype=dtype)
            else:
                t = torch.zeros(shape, dtype=dtype)
            out[inp.name] = t.to(device)
        except (RuntimeError, ValueError, OverflowError, MemoryError) as exc:
            raise SpecProblem(
                f"inputs.{i}",
                f"cannot make input {inp.name!r} {list(shape)} {inp.dtype} on {device} for "
                f"bucket {bucket.key}: {one_line(exc)}",
            ) from exc
    return out


_ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "bool": 1}


def check_input_memory(spec: Spec, device: Any) -> None:
    """Refuse a grid whose largest bucket's inputs cannot fit, before compiling anything.

    The spec's bounds stop absurd sizes at parse time, but what fits depends on the machine: an
    allocation past it is an opaque allocator error at best and the OOM killer at worst.
    """
    budget, where = _memory_budget(device)
    if budget is None:
        return
    for bucket in expand(spec):
        sizes = [
            (math.prod(bucket.shape_of(inp.shape)) * _ITEM_BYTES[inp.dtype], i)
            for i, inp in enumerate(spec.inputs)
        ]
        total = sum(n for n, _ in sizes)
        if total > budget:
            largest, i = max(sizes)
            inp = spec.inputs[i]
            raise SpecProblem(
                f"inputs.{i}.shape",
                f"bucket {bucket.key} needs {_gib(total)} for its inputs ({inp.name!r} "
                f"{list(bucket.shape_of(inp.shape))} {inp.dtype}: {_gib(largest)}), more than "
                f"the {_gib(budget)} {where}",
            )


def _memory_budget(device: Any) -> tuple[int | None, str]:
    """Bytes this process can still allocate on ``device`` (None: unknown), and what bounds it."""
    import torch

    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0]), f"free on {device}"
    bounds: list[tuple[int, str]] = []
    for limit, name in ((resource.RLIMIT_AS, "RLIMIT_AS"), (resource.RLIMIT_DATA, "RLIMIT_DATA")):
        soft, _ = resource.getrlimit(limit)
        if soft != resource.RLIM_INFINITY:
            bounds.append((soft, f"this process may allocate ({name})"))
    with contextlib.suppress(OSError, ValueError):
        info = dict(
            (line.split(":")[0], int(line.split()[1]) * 1024)
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.split()[1:2] and line.split()[1].isdigit()
        )
        bounds.append((info["MemAvailable"] + info.get("SwapFree", 0), "available on this machine"))
    with contextlib.suppress(OSError, ValueError):  # a cgroup v2 memory limit (containers)
        cgroup = Path("/sys/fs/cgroup")
        limit_text = (cgroup / "memory.max").read_text().strip()
        if limit_text != "max":
            used = int((cgroup / "memory.current").read_text())
            bounds.append((int(limit_text) - used, "left under this container's memory limit"))
    return min(bounds) if bounds else (None, "")


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_call(model: Any, spec: Spec) -> None:
    """Refuse inputs or call_kwargs the forward cannot take, before compiling it.

    Called with a keyword it lacks, a compiled forward fails deep inside Dynamo with a
    traceback; the signature says the same thing in one line, at the key.
    """
    import torch

    target = model.forward if isinstance(model, torch.nn.Module) else model
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check against
        return
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items() if p.kind in keyword]

    def accepts(name: str) -> bool:
        return takes_any or name in named

    takes = ", ".join(named) or "no keyword arguments"
    for i, inp in enumerate(spec.inputs):
        if not accepts(inp.name):
            raise SpecProblem(
                f"inputs.{i}.name", f"forward() has no argument {inp.name!r} (it takes: {takes})"
            )
    for key in spec.model.call_kwargs:
        if not accepts(key):
            raise SpecProblem(
                f"model.call_kwargs.{key}",
                f"forward() has no argument {key!r} (it takes: {takes})",
            )
    given = {inp.name for inp in spec.inputs} | set(spec.model.call_kwargs)
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    for name, p in params.items():
        required = p.default is inspect.Parameter.empty and p.kind not in variadic
        if required and (name not in given or p.kind is inspect.Parameter.POSITIONAL_ONLY):
            raise SpecProblem(
                "inputs", f"forward() needs {name!r}, which no input or call_kwargs gives"
            )


def _is_allocation_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError)
        and ("out of memory" in text or "can't allocate memory" in text)
    )


def build_model(spec: Spec, device: Any, launched: Rank | None) -> Any:
    """The factory's model on the spec's device and dtype, in eval mode, checked against the
    inputs; each failure is the spec's, at the key that caused it."""
    import torch

    check_input_memory(spec, device)
    factory = resolve_factory(spec)
    kwargs_key = "model.kwargs" if spec.model.kwargs else "model.factory"
    rank_kwargs, refused = ranks.factory_kwargs(spec, factory, launched)
    if refused:
        raise SpecProblem("distributed", refused)
    try:
        model = factory(**spec.model.kwargs, **rank_kwargs)
    except TypeError as exc:
        raise SpecProblem("model.kwargs", f"factory rejected its kwargs: {exc}") from exc
    except Exception as exc:  # the factory is the spec's code: its failure is the spec's
        raise SpecProblem(
            kwargs_key, f"the factory raised {type(exc).__name__}: {one_line(exc)}"
        ) from exc
    if isinstance(model, torch.nn.Module):
        try:
            model = model.to(device=device, dtype=getattr(torch, spec.model.dtype)).eval()
        except Exception as exc:
            if not _is_allocation_error(exc):
                raise
            raise SpecProblem(
                kwargs_key, f"the model does not fit on {device}: {one_line(exc)}"
            ) from exc
    check_call(model, spec)
    return model


def check_eager(
    model: Any,
    spec: Spec,
    seeds: dict[Bucket, int],
    device: Any,
    sync: Callable[[], None] | None = None,
) -> None:
    """Call the model eagerly on each bucket's first inputs, smallest bucket first, before
    anything compiles: a spec the model refuses (a shape, a dtype, an index range) is then the
    spec's one-line problem in the time of a call, where a compile failed after seconds to a
    minute with Dynamo's or a generated file's traceback (exit 1). Every bucket, not only the
    smallest: a size only some buckets break (a sequence longer than a position table) would
    pass the smallest. Measured on the CPU, the calls cost what one of the pass's own calls per
    bucket does (the pass makes at least seven). An allocation failure stops the check without
    a word: what fits compiled is the compile's concern, not the spec's. Run by the bake's first
    process only (``WorkerRequest.check_eager``), under ``inference_mode`` as the pass's calls."""
    import torch

    call_kwargs = dict(spec.model.call_kwargs)
    passed: list[Bucket] = []
    for bucket in sorted(seeds, key=bucket_cost):
        inputs = make_inputs(spec, bucket, device, seeds[bucket])
        try:
            with torch.inference_mode():
                model(**inputs, **call_kwargs)
                if sync is not None:
                    sync()  # a device-side assert (an index out of range) surfaces here
        except Exception as exc:  # the model's own code: any type
            if _is_allocation_error(exc):
                break
            key, hint = _refused_at(spec, exc, bucket, passed)
            raise SpecProblem(
                key,
                f"the model refused bucket {bucket.key}'s inputs: "
                f"{type(exc).__name__}: {one_line(exc)}{hint}",
            ) from exc
        finally:
            del inputs
        passed.append(bucket)
    if device.type == "cuda":  # the compile starts from the allocator it would have had
        torch.cuda.empty_cache()


def _refused_at(
    spec: Spec, exc: Exception, bucket: Bucket, passed: list[Bucket]
) -> tuple[str, str]:
    """The spec key most likely at fault for the model refusing ``bucket``'s inputs, and a
    hint. Smaller buckets passed: the size of this one that none of them reached (a sequence
    longer than a position table). Else a dtype mismatch is ``model.dtype`` against a floating
    input of another dtype; an index out of range, the ``high`` of the one ``randint`` input;
    anything else, ``inputs``."""
    if passed:
        sizes = bucket.as_dict()
        beyond = [a for a in sizes if all(sizes[a] > b.as_dict()[a] for b in passed)]
        if len(beyond) == 1:
            axis = beyond[0]
            return f"buckets.{axis}.{spec.buckets[axis].index(sizes[axis])}", (
                f" (smaller buckets passed: {axis}={sizes[axis]} is past what the model takes)"
            )
        return "buckets", " (smaller buckets passed)"
    text = str(exc).lower()
    floating = ("float32", "float16", "bfloat16")
    if "dtype" in text or "scalar type" in text:
        for inp in spec.inputs:
            if inp.dtype in floating and inp.dtype != spec.model.dtype:
                return "model.dtype", (
                    f" (model.dtype is {spec.model.dtype}, input {inp.name!r} is {inp.dtype})"
                )
    randint = [i for i, inp in enumerate(spec.inputs) if inp.fill == "randint"]
    if len(randint) == 1 and (isinstance(exc, IndexError) or "index" in text):
        inp = spec.inputs[randint[0]]
        high = inp.high or inp.low + 1
        return f"inputs.{randint[0]}.high", f" (input {inp.name!r} draws from [{inp.low}, {high}))"
    return "inputs", ""
