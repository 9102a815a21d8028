"""Precompiled forwards (``compile.precompile: true``): a restored process that skips Dynamo.

With the folder caches alone, a fresh process still re-traces the model with Dynamo once per
bucket and then looks the graph up: on the reference LLM that re-trace is most of a restored
start. torch's AOT route (``OptimizedModule._aot_compile``, experimental since 2.9) traces and
compiles one full graph per example input at bake time and serializes graphs *and guards*; a
serving process deserializes them and dispatches by guard, with no tracing at all. It needs
``fullgraph=True`` (no graph breaks), and the compiled code still reads its native kernels
(``.so``/``.cubin``) from the Inductor cache folder, which the artifact restores beside it.

Weights are not in the blob: the compiled graphs take the module as an argument, so the serving
process builds its model as usual and the blob only replaces ``forward``. A call whose inputs
match no baked guard (a shape outside the grid, a different grad mode) is not an error: it falls
back to a normal ``torch.compile`` of the same module, compiles (the one silent miss kiln exists
to prevent, so it is logged and counted in :attr:`PrecompiledForward.misses`). kiln bakes for
inference: call the forwards under ``torch.inference_mode()``, as the bake and verify do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kiln")


def unsupported_reason() -> str | None:
    """Why this torch cannot precompile, or None. Checked before a bake spends minutes."""
    import torch
    from torch._dynamo.eval_frame import OptimizedModule

    try:
        from torch._dynamo import aot_compile
    except ImportError:
        aot_compile = None
    if (
        not hasattr(aot_compile, "AOTCompiledModel")
        or not hasattr(OptimizedModule, "_aot_compile")
        or not hasattr(torch._dynamo.config, "enable_aot_compile")
    ):
        return f"torch {torch.__version__} has no AOT precompile (needs torch >= 2.9)"
    return None


def _dynamic_config(dynamic: bool | None) -> dict[str, bool]:
    """Dynamo config equivalent to ``torch.compile(dynamic=...)`` (as torch's own patcher sets)."""
    if dynamic is None:
        return {}
    if dynamic:
        return {"assume_static_by_default": False}
    return {"automatic_dynamic_shapes": False, "assume_static_by_default": True}


class PrecompiledForward:
    """Calls the baked graph whose guards accept the inputs; otherwise compiles as torch would.

    Guards are checked once here (torch's own dispatcher checks them twice on a hit and raises
    on a miss), so each graph's internal check is switched off.
    """

    def __init__(self, module: Any, torch_kwargs: dict[str, Any], results: list[Any]) -> None:
        self.module = module
        self.results = results
        for r in results:
            r.disable_guard_check()
        self._torch_kwargs = {**torch_kwargs, "fullgraph": True}
        self._fallback: Callable[..., Any] | None = None
        self.misses = 0
        self.miss_reason: str | None = None  # the last miss's failing guard, as torch words it
        # The module the bake imported the model's factory as (activate() sets it from the
        # spec): a guard on the class's identity that fails names it (:meth:`why_not`).
        self.baked_module: str | None = None

    @classmethod
    def empty(cls, module: Any, torch_kwargs: dict[str, Any]) -> PrecompiledForward:
        return cls(module, torch_kwargs, [])

    @classmethod
    def load(cls, module: Any, torch_kwargs: dict[str, Any], blob: bytes) -> PrecompiledForward:
        """Deserialize baked forwards for ``module``; raises if this torch/GPU cannot take them.

        Loaded under ``torch.inference_mode()``, as kiln bakes: torch rebuilds the tensor guards
        against the grad mode current at load time (measured on 2.13: a blob loaded outside
        inference mode rejects every inference-mode call on a dispatch-key mismatch).
        """
        import torch
        from torch._dynamo.aot_compile import AOTCompiledModel

        with torch.inference_mode():
            results = AOTCompiledModel.deserialize(module, blob).compiled_results
        return cls(module, torch_kwargs, results)

    def add(self, **example: Any) -> None:
        """Trace and compile one full graph for these keyword inputs, in the current grad mode."""
        import torch
        from torch._dynamo.aot_compile import ModelInput

        torch._dynamo.config.enable_aot_compile = True
        compiled = torch.compile(self.module, **self._torch_kwargs)
        # The module AOT route ignores torch.compile's `dynamic` (2.13): without this, automatic
        # dynamic shapes turns the second bucket into a dynamic graph that swallows the grid.
        with torch._dynamo.config.patch(**_dynamic_config(self._torch_kwargs.get("dynamic"))):
            compiled._aot_compile([ModelInput((), example, [])])
        (result,) = compiled.forward.compiled_results
        result.disable_guard_check()
        self.results.append(result)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for r in self.results:
            if r.guard_check(self.module, *args, **kwargs):
                return r(self.module, *args, **kwargs)
        return self._miss(*args, **kwargs)

    def _miss(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        self.misses += 1
        reason = self.why_not(*args, **kwargs)
        if reason != self.miss_reason:  # once per distinct cause, not once per request
            log.warning(
                "kiln: inputs match no precompiled bucket (%s): compiling with torch.compile",
                reason,
            )
        self.miss_reason = reason
        if self._fallback is None:
            self._fallback = torch.compile(self.module, **self._torch_kwargs)
        return self._fallback(*args, **kwargs)

    def why_not(self, *args: Any, **kwargs: Any) -> str:
        """Why no baked graph takes these inputs: the first failing guard of each, as torch's
        ``check_verbose`` words it. A guard on anything but a size (grad mode, a global flag, a
        dtype, a stride, a device) names the factor outright, so it is preferred over the size
        guards every other bucket fails. Uses torch's private guard API; says so if that moved."""
        if not self.results:
            return "no graph was baked"
        failing: list[str] = []
        for r in self.results:
            try:
                f_locals = r.prepare_f_locals(self.module, *args, **kwargs)
                info = r._artifacts.guard_manager.check_verbose(f_locals)
                parts = [str(p).strip() for p in getattr(info, "verbose_code_parts", [])]
            except Exception as exc:  # a private API: a torch that moved it still serves
                return f"guards not readable in this torch: {type(exc).__name__}"
            if parts:
                failing.append(" ".join(parts))
        if not failing:
            return "every guard passes (another cause: see torch's recompile log)"
        named = [f for f in failing if "size mismatch" not in f]
        if not named:
            return f"no baked bucket has this shape ({failing[0][:240]})"
        return named[0][:300] + (self._class_hint() if "___check_type_id" in named[0] else "")

    def _class_hint(self) -> str:
        """Why a guard on the model's class fails, as far as cheaply known: the graphs hold the
        class object the bake imported (from its factory's module), and a class imported under
        another module name (``myapp.models`` for ``mymodels``, or loaded from its file with
        ``spec_from_file_location``) is another object, which no graph accepts."""
        cls = type(self.module)
        here, baked = cls.__module__, self.baked_module
        if baked is None:
            return (
                f": this model's class {here}.{cls.__qualname__} is not the object the bake "
                "traced: import it under the module name the bake used (docs/serving.md)"
            )
        if here == baked:
            return (
                f": this model's class {here}.{cls.__qualname__} is not the object the bake "
                f"traced (a second copy of module {here!r}: loaded from its file, or imported "
                f"twice): `import {baked}` as the bake did (docs/serving.md)"
            )
        return (
            f": this model's class is {here}.{cls.__qualname__}, the bake's came from module "
            f"{baked!r} (its factory's): `import {baked}` as the bake did (docs/serving.md)"
        )

    def to_bytes(self) -> bytes:
        from torch._dynamo.aot_compile import AOTCompiledModel

        return AOTCompiledModel(self.module, self.results).serialize()
