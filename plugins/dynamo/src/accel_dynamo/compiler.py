"""The compiler component: ``torch.compile`` applied to each prepared model, in place.

In place matters twice. The user's module stays the module (``unwrap_model`` returns it, ``state_dict`` keys have
no ``_orig_mod.`` prefix), and the model is compiled *before* the strategy wraps it: ``torch.compile(DDP(m))``
graph-breaks inside ``DDP.forward`` and silently runs uncompiled, while ``DDP(m)`` around an in-place compiled
``m`` runs the compiled forward.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import warnings
import weakref
from typing import TYPE_CHECKING, Any

from accel.spi import Component, Settings, UsageError, did_you_mean, hookimpl

if TYPE_CHECKING:
    import torch

    from accel.spi import KernelView

#: Debug backends ``torch._dynamo.list_backends()`` hides by default; offered in messages next to the others.
DEBUG_BACKENDS = ("eager", "aot_eager")


def available_backends() -> tuple[list[str], list[str]]:
    """(every registered backend name, the ones worth showing a user)."""
    import torch._dynamo

    everything = torch._dynamo.list_backends(exclude_tags=None)
    shown = sorted(set(torch._dynamo.list_backends()) | set(DEBUG_BACKENDS))
    return everything, shown


def resolve_backend(name: str) -> str:
    """The torch.compile backend for a user's spelling (``INDUCTOR`` -> ``inductor``), or a UsageError."""
    backend = str(name).strip().lower()
    everything, shown = available_backends()
    if backend not in everything:
        raise UsageError(
            f"dynamo_backend {name!r} is not a torch.compile backend of this torch "
            f"(available: {', '.join(shown)}){did_you_mean(backend, everything)}"
        )
    return backend


def compile_in_place(module: torch.nn.Module, **options: Any) -> None:
    """``module.compile(**options)``, made to work for every module.

    ``nn.Module.compile`` hands dynamo ``Module._call_impl``; for a module whose code lives in ``torch.nn``
    (``nn.Sequential``, ``nn.Linear``, ``nn.TransformerEncoder``) that top frame is one dynamo skips, so such a
    model silently ran uncompiled. Compiling a function of ours that calls ``_call_impl`` makes dynamo inline it,
    hooks included, for any module; the slot it fills is the one ``nn.Module.compile`` fills."""
    import torch

    call = module._call_impl

    def compiled_call(*args: Any, **kwargs: Any) -> Any:
        return call(*args, **kwargs)

    module._compiled_call_impl = torch.compile(compiled_call, **options)


def regions(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks of the outermost ``nn.ModuleList``s of ``model`` (transformer layers), in order."""
    import torch

    found: list[torch.nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if isinstance(module, torch.nn.ModuleList):
            found.extend(module)
            inside.update(id(m) for m in module.modules())
    return found


class DynamoCompiler(Component):
    """Compiles every prepared model with the configured backend, mode, fullgraph and dynamic settings."""

    role = "compiler"
    provides = frozenset({"compile"})

    def __init__(self, settings: Settings):
        self.settings = settings
        self.backend = resolve_backend(settings["dynamo_backend"])
        self.mode: str = settings["dynamo_mode"]
        self.fullgraph = bool(settings["dynamo_use_fullgraph"])
        dynamic = settings["dynamo_use_dynamic"]
        self.dynamic: bool | None = None if dynamic is None else bool(dynamic)
        self.regional = bool(settings["dynamo_use_regional_compilation"])
        self._compiled: weakref.WeakSet[Any] = weakref.WeakSet()
        if self.mode != "default" and self.backend != "inductor":
            warnings.warn(
                f"dynamo_mode={self.mode} only applies to the inductor backend; backend {self.backend} ignores it",
                RuntimeWarning,
                stacklevel=2,
            )

    def options(self) -> dict[str, Any]:
        """The keyword arguments handed to ``torch.compile``."""
        options: dict[str, Any] = {"backend": self.backend, "fullgraph": self.fullgraph, "dynamic": self.dynamic}
        if self.backend == "inductor" and self.mode != "default":
            options["mode"] = self.mode
        return options

    def _check_toolchain(self, device: torch.device) -> None:
        """inductor generates C++ on CPU and Triton kernels on GPUs: say so now rather than at the first step."""
        if self.backend != "inductor":
            return
        if device.type == "cpu":
            if not (os.environ.get("CXX") or any(shutil.which(c) for c in ("g++", "clang++", "c++"))):
                raise UsageError(
                    "dynamo_backend=inductor on CPU needs a C++ compiler (g++ or clang++) and none "
                    "was found; install one, set CXX, or use dynamo_backend=aot_eager"
                )
        elif importlib.util.find_spec("triton") is None:
            raise UsageError(f"dynamo_backend=inductor on {device.type} needs triton (pip install triton)")

    @hookimpl
    def accel_transform_model(self, kernel: KernelView, model: torch.nn.Module) -> None:
        from torch._dynamo.eval_frame import OptimizedModule

        if model in self._compiled or isinstance(model, OptimizedModule):
            return  # compiled already (by us, or by the user with torch.compile)
        self._check_toolchain(kernel.device)
        targets = regions(model) if self.regional else []
        for module in targets or [model]:
            compile_in_place(module, **self.options())
        self._compiled.add(model)
