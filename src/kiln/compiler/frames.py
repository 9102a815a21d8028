"""Precompiled frames (``compile.precompile`` on a model with graph breaks): no Dynamo re-trace.

With the folder caches alone, a restored process traces every frame of every bucket with
Dynamo again (for a model with one graph break: the forward up to the break and the resume
function after it) and only then finds the compiled graphs. The AOT route
(:mod:`kiln.compiler.precompile`) skips that but needs one full graph. For the rest, torch
has the Dynamo cache precompile (``torch._dynamo.config.caching_precompile``): the bake
records each traced frame's guards and bytecode, resume functions included, into
``TORCHINDUCTOR_CACHE_DIR/dynamo/<key>/entry``; ``torch.compile(model)`` in a later process
loads and installs them, and calls that pass the guards run with no tracing.

As shipped (2.11, 2.13), three torch bugs stand in the route; the workarounds live here and
nowhere else:

- **Guards rebuilt under the wrong grad mode.** ``torch.compile()`` rebuilds the saved tensor
  guards with the dispatch keys of the thread state at that moment, not the bake's
  (pytorch/pytorch#175025; fix in review as #184850, "Serialize guard TLS state"). Compiled
  outside ``inference_mode``, every inference-mode call fails them silently and Dynamo traces
  as if nothing was loaded. kiln bakes under ``inference_mode``, so :func:`compile_model` calls
  ``torch.compile`` under it too. Serving calls must be made under ``inference_mode``.
- **A name clash on the next trace.** Installing the frames puts the bake's globals
  (``__builtins_dict___0``, ``__resume_at_…_N``) into the model module; the process's own next
  trace (a shape outside the grid) draws the same names from a counter that starts at 0 in
  every process and crashes (``AssertionError: Name '__builtins_dict___0' already exists in
  scope``; upstream #195354). :func:`serve` starts that counter far above any bake's.
- **CUDA graphs dropped on load.** A saved graph is loaded inside ``torch.compile()``, not by
  Inductor's ``compile_fx``, so the mode's settings (``reduce-overhead``: ``triton.cudagraphs``)
  are not in force: torch reads the global config (``deserialize_bundled_cache_entry`` in
  ``torch/_functorch/_aot_autograd/aot_autograd_result.py``, marked TODO there), and a
  ``reduce-overhead`` model then serves without CUDA graphs (measured on the H200 with 2.11:
  1.2 ms per call in every bucket, as eager, against 0.35-0.98 ms cold).
  :func:`compile_model` holds the mode's settings while torch.compile loads.

Risks a server takes on with the route (docs/serving.md): with it on, Dynamo
drops identity guards (``ID_MATCH``, closure and dict-version guards) for every compile in the
process; and the saved frames name the model's module, so the forward must come from a module
of the same name as at bake time (:func:`mismatch` checks before kiln turns the route on).
"""

from __future__ import annotations

import itertools
from typing import Any

from kiln.serving import inductor_options

# The first torch release whose names no longer clash (None: none we know of). Past it,
# :func:`serve` leaves torch's counter alone.
_NAME_CLASH_FIXED_IN: tuple[int, int] | None = None
# Where this process's trace names start: far above the few thousand a bake draws.
_NAME_COUNTER_START = 1 << 30


def unsupported_reason() -> str | None:
    """Why this torch has no Dynamo cache precompile, or None (checked before a bake)."""
    import torch

    try:
        from torch._dynamo import package
    except ImportError:
        package = None
    if package is None or not hasattr(torch._dynamo.config, "caching_precompile"):
        return f"torch {torch.__version__} has no Dynamo cache precompile (needs torch >= 2.11)"
    return None


def record() -> None:
    """Bake: record every frame Dynamo compiles; ``torch.compiler.save_cache_artifacts()``
    then writes them under the cache root."""
    import torch

    torch._dynamo.config.caching_precompile = True


def serve() -> None:
    """Serve: load the saved frames at ``torch.compile``, and let a later trace in this
    process (a shape outside the grid) compile without clashing with their names. Process-wide,
    like the setting it turns on: call it before the first ``torch.compile``."""
    import torch

    torch._dynamo.config.caching_precompile = True
    if _NAME_CLASH_FIXED_IN is None or _torch_version() < _NAME_CLASH_FIXED_IN:
        from torch._dynamo import bytecode_transformation as bt

        counter = getattr(bt, "_unique_id_counter", None)
        if isinstance(counter, itertools.count):  # never back to a name this process drew
            bt._unique_id_counter = itertools.count(max(next(counter), _NAME_COUNTER_START))


def compile_model(model: Any, torch_kwargs: dict[str, Any]) -> Any:
    """``torch.compile`` under ``inference_mode``, where the saved guards are rebuilt: kiln's
    grad mode for baking and serving (see the module docstring for why it matters), with the
    mode's Inductor settings in force while the saved graphs are loaded (third bug there)."""
    import torch

    settings = torch_kwargs.get("options") or inductor_options(torch_kwargs.get("mode"), {})
    with torch.inference_mode(), torch._inductor.config.patch(dict(settings)):
        return torch.compile(model, **torch_kwargs)


def module_of(model: Any) -> str | None:
    """The module of the model's ``forward``: the saved frames belong to its code."""
    forward = getattr(type(model), "forward", None)
    return getattr(forward, "__module__", None)


def mismatch(model: Any, baked_module: str) -> str | None:
    """Why the saved frames cannot serve ``model`` here, or None.

    torch looks the module up by its baked name while installing the frames: another name
    raises inside ``torch.compile`` (ModuleNotFoundError), or, where a module of the baked name
    exists too, fails the first call. Said here instead, so the caller compiles as usual.
    """
    here = module_of(model)
    if here != baked_module:
        return f"frames were baked for {baked_module}.forward, this model's is {here}.forward"
    return None


def _torch_version() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)
