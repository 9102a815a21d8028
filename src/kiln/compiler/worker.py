"""The grid runner: runs a spec's buckets through torch.compile in *this* (fresh) process.

kiln never compiles in the caller's process. Torch reads its cache locations and much of its
Inductor config from the environment at import time, and keeps in-memory caches that would turn
a cold compile into a fake hit, so bake, verify and bench each start
``python -m kiln.compiler.worker`` with exactly the environment they mean and read back what it
did. The same loop serves all three so that "what bake compiled" and "what verify hit" are
measured the same way.

Protocol: argv is ``REQUEST.json RESULT.json``; progress goes to stdout as JSON lines; the
result (or the error) is written to RESULT.json; everything torch prints goes to stderr, which
the parent keeps in a log.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import json
import logging
import math
import os
import resource
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from kiln.compiler.capture import AUTOTUNE_SUFFIXES, NATIVE_SUFFIXES, snapshot
from kiln.grid import Bucket, expand
from kiln.serving import torch_kwargs
from kiln.spec import Spec, load_spec

_START = time.time()
_NEW_FILES_SAMPLE = 12
_COMPILED_SUFFIXES = (*NATIVE_SUFFIXES, *AUTOTUNE_SUFFIXES)


def _emit(event: str, **data: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, "t": time.time(), **data}) + "\n")
    sys.stdout.flush()


class _RecompileLog(logging.Handler):
    """Keeps torch's own words for every recompile: verify names the reason, not just a count."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _counters() -> dict[str, dict[str, int]]:
    from torch._dynamo.utils import counters

    return {k: dict(v) for k, v in counters.items()}


def _compile_seconds() -> float:
    from torch._dynamo.utils import compilation_time_metrics

    return float(sum(compilation_time_metrics.get("_compile.compile_inner", [])))


def _delta(
    before: dict[str, dict[str, int]], after: dict[str, dict[str, int]], group: str, key: str
) -> int:
    return after.get(group, {}).get(key, 0) - before.get(group, {}).get(key, 0)


def resolve_factory(spec: Spec) -> Any:
    """Import the spec's factory, looking next to the spec file first."""
    target, _, attr = spec.model.factory.partition(":")
    if target.endswith(".py"):
        origin = spec.factory_origin()
        assert origin is not None
        base, module_name = str(origin.parent), origin.stem
    else:
        base, module_name = str(spec.base_dir), target
    sys.path.insert(0, base)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise _SpecProblem("model.factory", f"cannot import {target!r}: {exc}") from exc
    except Exception as exc:  # the module's own code failed (a SyntaxError, a raise at import)
        raise _SpecProblem(
            "model.factory", f"importing {target!r} raised {type(exc).__name__}: {_one_line(exc)}"
        ) from exc
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(base)
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise _SpecProblem("model.factory", f"{target!r} has no attribute {attr!r}")
    if not callable(obj):
        raise _SpecProblem("model.factory", f"{spec.model.factory!r} is not callable")
    return obj


class _Incompatible(Exception):
    """This process cannot use what was baked (exit 5, as ``kiln check`` would say)."""


class _SpecProblem(Exception):
    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


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
            raise _SpecProblem(
                f"inputs.{i}",
                f"cannot make input {inp.name!r} {list(shape)} {inp.dtype} on {device} for "
                f"bucket {bucket.key}: {_one_line(exc)}",
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
            raise _SpecProblem(
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


def _one_line(exc: BaseException, limit: int = 300) -> str:
    """torch's messages can run to pages (every option name, a C++ trace): the first line."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


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
            raise _SpecProblem(
                f"inputs.{i}.name", f"forward() has no argument {inp.name!r} (it takes: {takes})"
            )
    for key in spec.model.call_kwargs:
        if not accepts(key):
            raise _SpecProblem(
                f"model.call_kwargs.{key}",
                f"forward() has no argument {key!r} (it takes: {takes})",
            )
    given = {inp.name for inp in spec.inputs} | set(spec.model.call_kwargs)
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    for name, p in params.items():
        required = p.default is inspect.Parameter.empty and p.kind not in variadic
        if required and (name not in given or p.kind is inspect.Parameter.POSITIONAL_ONLY):
            raise _SpecProblem(
                "inputs", f"forward() needs {name!r}, which no input or call_kwargs gives"
            )


def _is_allocation_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError)
        and ("out of memory" in text or "can't allocate memory" in text)
    )


def run(request: dict[str, Any]) -> dict[str, Any]:
    import_start = time.time()
    import torch

    torch_import_s = time.time() - import_start
    spec = load_spec(request["spec_path"])
    device_index = int(request.get("device_index", 0))
    device = torch.device(spec.model.device, device_index if spec.model.device == "cuda" else None)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA support"
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            hidden = "" if visible is None else f"; CUDA_VISIBLE_DEVICES={visible!r}"
            raise _SpecProblem(
                "model.device",
                f"device: cuda, but torch sees no CUDA device here (torch {torch.__version__} "
                f"with {build}{hidden})",
            )
        torch.cuda.set_device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    cache_root = Path(request["cache_root"]) if request.get("cache_root") else None

    megacache: dict[str, Any] = {}
    if request.get("megacache_load"):
        blob = Path(request["megacache_load"]).read_bytes()
        info = torch.compiler.load_cache_artifacts(blob)
        megacache["loaded"] = info is not None
        megacache["entries"] = _cache_info_counts(info)

    buckets = {b.key: b for b in expand(spec)}
    order = [buckets[k] for k in request["order"]]
    torch._dynamo.config.recompile_limit = max(8, 2 * len(buckets) + 2)
    torch._dynamo.config.accumulated_recompile_limit = max(256, 8 * len(buckets))
    recompiles = _RecompileLog()
    if request.get("compile", True):
        torch._logging.set_logs(recompiles=True)
        logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(recompiles)

    check_input_memory(spec, device)
    factory = resolve_factory(spec)
    kwargs_key = "model.kwargs" if spec.model.kwargs else "model.factory"
    try:
        model = factory(**spec.model.kwargs)
    except TypeError as exc:
        raise _SpecProblem("model.kwargs", f"factory rejected its kwargs: {exc}") from exc
    except Exception as exc:  # the factory is the spec's code: its failure is the spec's
        raise _SpecProblem(
            kwargs_key, f"the factory raised {type(exc).__name__}: {_one_line(exc)}"
        ) from exc
    if isinstance(model, torch.nn.Module):
        try:
            model = model.to(device=device, dtype=getattr(torch, spec.model.dtype)).eval()
        except Exception as exc:
            if not _is_allocation_error(exc):
                raise
            raise _SpecProblem(
                kwargs_key, f"the model does not fit on {device}: {_one_line(exc)}"
            ) from exc
    check_call(model, spec)
    sync()  # the start-up figure includes moving the weights to the device
    precompiled, precompile_load_s = _precompiled(request, spec, model)
    if precompiled is not None:
        fn: Any = precompiled
    elif request.get("compile", True):
        kwargs = _torch_kwargs(request, spec)
        try:
            fn = torch.compile(model, **kwargs)
        except RuntimeError as exc:  # torch checks the backend and option names here
            key = "compile.backend" if "backend" in str(exc).lower() else "compile.options"
            message = _one_line(exc).split(", known options are")[0]
            raise _SpecProblem(key, f"torch.compile refused it: {message}") from exc
    else:
        fn = model
    building = precompiled is not None and bool(request.get("precompile_save"))
    call_kwargs = dict(spec.model.call_kwargs)
    grid_index = {k: i for i, k in enumerate(buckets)}
    calls = max(int(request.get("calls", 2)), 3 if spec.compile.cudagraphs else 1)
    steady_calls = int(request.get("steady_calls", 5))
    model_ready_t = time.time()
    _emit("start", buckets=len(order), torch_import_s=torch_import_s)

    stats: dict[str, dict[str, Any]] = {}

    def timed_call(inputs: dict[str, Any]) -> float:
        sync()
        t0 = time.perf_counter()
        fn(**inputs, **call_kwargs)
        sync()
        return time.perf_counter() - t0

    def misses() -> int:
        return precompiled.misses if precompiled is not None else 0

    def measure(body: Any) -> dict[str, Any]:
        before, c0, n0 = _counters(), _compile_seconds(), len(recompiles.messages)
        files0 = snapshot(cache_root) if cache_root else set()
        p0 = misses()
        result = body()
        after = _counters()
        new = (snapshot(cache_root) - files0) if cache_root else set()
        bundled = _delta(before, after, "inductor", "triton_bundler_read_and_emit_kernel")
        compiled_files = sorted(n for n in new if n.endswith(_COMPILED_SUFFIXES))
        fx_compiled = _delta(before, after, "inductor", "fxgraph_cache_miss") + _delta(
            before, after, "inductor", "fxgraph_cache_bypass"
        )
        return {
            "result": result,
            "compile_s": _compile_seconds() - c0,
            "fx_hits": _delta(before, after, "inductor", "fxgraph_cache_hit"),
            "fx_misses": _delta(before, after, "inductor", "fxgraph_cache_miss"),
            "fx_bypass": _delta(before, after, "inductor", "fxgraph_cache_bypass"),
            "aot_hits": _delta(before, after, "aot_autograd", "autograd_cache_hit"),
            "aot_misses": _delta(before, after, "aot_autograd", "autograd_cache_miss"),
            "kernel_loads": _delta(before, after, "inductor", "async_compile_cache_miss"),
            "bundled_kernels": bundled,
            "new_native": max(0, sum(1 for n in new if n.endswith(NATIVE_SUFFIXES)) - bundled),
            # An FX cache hit *replays* the inductor counters its compile recorded
            # (CompiledFxGraph.counter_deltas), GEMM autotuning included: count that one only
            # when a graph really compiled. Coordinate-descent benchmarks run at call time and
            # are never replayed.
            "autotunes": (
                _delta(before, after, "inductor", "select_algorithm_autotune") if fx_compiled else 0
            )
            + _delta(before, after, "inductor", "coordesc_tuning_bench")
            + sum(1 for n in new if n.endswith(AUTOTUNE_SUFFIXES)),
            "unique_graphs": _delta(before, after, "stats", "unique_graphs"),
            "graph_breaks": sum(after.get("graph_break", {}).values())
            - sum(before.get("graph_break", {}).values()),
            "recompile_reasons": recompiles.messages[n0:],
            "precompile_misses": misses() - p0,
            "new_files": compiled_files[:_NEW_FILES_SAMPLE],
        }

    def add(into: dict[str, Any], more: dict[str, Any]) -> None:
        for k, v in more.items():
            if k == "result":
                continue
            into[k] = into.get(k, [] if isinstance(v, list) else 0) + v
        into["new_files"] = into["new_files"][:_NEW_FILES_SAMPLE]

    with torch.inference_mode():
        # Phase 1: every bucket once, in request order. "Ready" in bench terms ends here.
        for i, bucket in enumerate(order):
            seed = grid_index[bucket.key]
            inputs = make_inputs(spec, bucket, device, seed)

            def first(inputs: dict[str, Any] = inputs) -> float:
                if not building:
                    return timed_call(inputs)
                # A precompile bake compiles the bucket ahead of its first call: count both.
                t0 = time.perf_counter()
                precompiled.add(**inputs, **call_kwargs)
                timed_call(inputs)
                return time.perf_counter() - t0

            m = measure(first)
            stats[bucket.key] = {
                "key": bucket.key,
                "sizes": bucket.as_dict(),
                "first_call_s": m["result"],
            }
            add(stats[bucket.key], m)
            _emit("bucket", phase="first", index=i, key=bucket.key, first_call_s=m["result"])
        first_pass_t = time.time()
        _emit("first_pass_done")
        # Phase 2: the remaining warmup calls (CUDA graphs record here), then a fresh "first real
        # request" and the steady-state latency. Compiles here count too: a bucket that
        # recompiles on its second call is not warm.
        for i, bucket in enumerate(order):
            seed = grid_index[bucket.key]
            inputs = make_inputs(spec, bucket, device, seed)

            def warm(
                inputs: dict[str, Any] = inputs, bucket: Bucket = bucket
            ) -> tuple[float | None, float]:
                for _ in range(calls - 1):
                    timed_call(inputs)
                first_request = None
                if request.get("first_request", False):
                    fresh = make_inputs(spec, bucket, device, 10_000 + grid_index[bucket.key])
                    first_request = timed_call(fresh)
                steady = statistics.median(timed_call(inputs) for _ in range(max(1, steady_calls)))
                return first_request, steady

            m = measure(warm)
            s = stats[bucket.key]
            s["first_request_s"], s["steady_s"] = m["result"]
            add(s, m)
            _emit("bucket", phase="warm", index=i, key=bucket.key, steady_s=s["steady_s"])
    warm_t = time.time()

    if building:
        blob = precompiled.to_bytes()
        Path(request["precompile_save"]).write_bytes(blob)
    if request.get("megacache_save"):
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            Path(request["megacache_save"]).write_bytes(saved[0])
            megacache["saved"] = True
            megacache["entries"] = _cache_info_counts(saved[1])
        else:
            megacache["saved"] = False

    fp = None
    if request.get("fingerprint"):
        from kiln.compiler.fingerprint import fingerprint

        fp = fingerprint(spec.model.device, device_index=device_index)
    return {
        "buckets": [stats[b.key] for b in order],
        "process_start": _START,
        "torch_import_s": torch_import_s,
        "model_ready": model_ready_t,
        "precompile_load_s": precompile_load_s,
        "first_pass_done": first_pass_t,
        "warm_done": warm_t,
        "megacache": megacache,
        "fingerprint": fp,
    }


def _torch_kwargs(request: dict[str, Any], spec: Spec) -> dict[str, Any]:
    """What the caller asked for (a bake pass, or what the artifact recorded), else the spec's."""
    return request.get("torch_kwargs") or torch_kwargs(spec.compile)


def _precompiled(request: dict[str, Any], spec: Spec, model: Any) -> tuple[Any, float | None]:
    """The precompiled forward this run builds (bake) or loads (serve), with its load time."""
    save, load = request.get("precompile_save"), request.get("precompile_load")
    if not (save or load):
        return None, None
    from kiln.compiler.precompile import PrecompiledForward, unsupported_reason

    reason = unsupported_reason()
    if reason:
        raise _SpecProblem("compile.precompile", reason)
    kwargs = _torch_kwargs(request, spec)
    if save:
        return PrecompiledForward.empty(model, kwargs), None
    t0 = time.time()
    try:
        loaded = PrecompiledForward.load(model, kwargs, Path(load).read_bytes())
    except Exception as exc:  # torch's checks raise assorted types
        raise _Incompatible(
            f"this torch refuses the precompiled forwards ({type(exc).__name__}: {exc}); "
            "`kiln check` names the factor that differs"
        ) from exc
    return loaded, time.time() - t0


def _cache_info_counts(info: Any) -> dict[str, int]:
    if info is None:
        return {}
    artifacts = getattr(info, "artifacts", None)
    if isinstance(artifacts, dict):
        return {k: len(v) for k, v in artifacts.items()}
    return {k: len(v) for k, v in vars(info).items() if isinstance(v, list)}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    request_path, result_path = Path(args[0]), Path(args[1])
    request = json.loads(request_path.read_text())
    try:
        result = {"ok": True, **run(request)}
        code = 0
    except _Incompatible as exc:
        traceback.print_exc()
        result = {"ok": False, "kind": "incompatible", "message": str(exc)}
        code = 5
    except _SpecProblem as exc:
        result = {"ok": False, "kind": "spec", "key": exc.key, "message": str(exc)}
        code = 2
    except Exception as exc:
        traceback.print_exc()
        result = {"ok": False, "kind": "internal", "message": f"{type(exc).__name__}: {exc}"}
        code = 1
    result_path.write_text(json.dumps(result))
    return code


if __name__ == "__main__":
    sys.exit(main())
