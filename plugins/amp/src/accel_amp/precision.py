"""The mixed-precision component: autocast for the forward of prepared models, a gradient scaler for fp16,
torchao float8 layers for fp8. torch is imported inside methods so the CLI can list and launch without it.

When it is part of a run it is in charge of precision: a strategy that realises the precision itself (FSDP's
MixedPrecisionPolicy, DeepSpeed's bf16/fp16) declares it (``"precision:bf16"`` in its ``provides``), and the kernel
then leaves this component out of the run altogether (no autocast, no scaler, no fp8 layers).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import warnings
import weakref
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from accel.spi import Component, Settings, UsageError, hookimpl

if TYPE_CHECKING:
    import torch

    from accel.spi import KernelView


def device_problem(mode: str, device: torch.device, emulate: bool = False) -> str | None:
    """Why ``mode`` cannot run on ``device`` (one sentence), or None when it can."""
    import torch

    if not torch.amp.is_autocast_available(device.type):
        return f"mixed_precision={mode} needs autocast, which torch does not have for device {device.type!r}"
    if mode == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        name = torch.cuda.get_device_name(device)
        return (
            f"mixed_precision=bf16 needs a CUDA GPU of compute capability 8.0 or newer, and {name} is older; use fp16"
        )
    if mode == "fp8":
        if not emulate and device.type != "cuda":
            return (
                f"mixed_precision=fp8 needs a CUDA GPU of compute capability 8.9 or newer (H100, L4, RTX 4090), "
                f"and this process trains on {device.type}; use bf16, or fp8_emulate to test the fp8 recipe slowly"
            )
        if not emulate and torch.cuda.get_device_capability(device) < (8, 9):
            major, minor = torch.cuda.get_device_capability(device)
            return (
                f"mixed_precision=fp8 needs a CUDA GPU of compute capability 8.9 or newer, and "
                f"{torch.cuda.get_device_name(device)} has {major}.{minor}; use bf16"
            )
        if importlib.util.find_spec("torchao") is None:
            return "mixed_precision=fp8 needs torchao: pip install 'accel-plugin-amp[fp8]'"
    return None


def step_with_scaler(scaler: Any, optimizer: torch.optim.Optimizer) -> bool:
    """``scaler.step(optimizer)``; return whether the parameters were updated (False: inf/NaN gradients).

    Told by an optimizer step pre-hook: GradScaler calls ``optimizer.step`` only when the gradients are finite,
    except for optimizers that skip by themselves (fused Adam), which it hands ``found_inf`` to."""
    applied: list[bool] = []

    def seen(opt: Any, args: Any, kwargs: Any) -> None:
        found_inf = getattr(opt, "found_inf", None)
        applied.append(found_inf is None or not bool(found_inf.item()))

    handle = optimizer.register_step_pre_hook(seen)
    try:
        scaler.step(optimizer)
    finally:
        handle.remove()
    return bool(applied) and applied[0]


class AmpPrecision(Component):
    """fp16: autocast + ``torch.amp.GradScaler`` (on CPU too); bf16: autocast; fp8: torchao float8 Linear layers
    plus bf16 autocast for the other operations."""

    role = "precision"
    provides = frozenset({"precision:fp16", "precision:bf16", "precision:fp8"})

    def __init__(self, settings: Settings):
        self.settings = settings
        self.mode = settings.mixed_precision
        self.scaler: Any = None  # torch.amp.GradScaler for fp16
        self._optimizers: list[weakref.ref[Any]] = []
        self._unscaled: set[int] = set()  # optimizers unscaled since the last scaler.update()
        self._stepped: set[int] = set()  # optimizers stepped since the last scaler.update()
        self._converted: weakref.WeakSet[Any] = weakref.WeakSet()

    # ---- set-up -------------------------------------------------------------------------------------------

    @hookimpl
    def accel_autocast(self, kernel: KernelView) -> Callable[[], AbstractContextManager[Any]]:
        import torch

        device = kernel.device
        problem = device_problem(self.mode, device, emulate=bool(self.settings["fp8_emulate"]))
        if problem:
            raise UsageError(problem)
        if self.mode == "fp16":
            s = self.settings
            self.scaler = torch.amp.GradScaler(
                device.type,
                init_scale=s["grad_scaler_init_scale"],
                growth_factor=s["grad_scaler_growth_factor"],
                backoff_factor=s["grad_scaler_backoff_factor"],
                growth_interval=s["grad_scaler_growth_interval"],
                enabled=s["grad_scaler_enabled"],
            )
        dtype = torch.float16 if self.mode == "fp16" else torch.bfloat16
        extra: dict[str, Any] = {"enabled": self.settings["autocast_enabled"]}
        if self.settings["autocast_cache_enabled"] is not None:
            extra["cache_enabled"] = self.settings["autocast_cache_enabled"]
        return functools.partial(torch.autocast, device.type, dtype=dtype, **extra)

    @hookimpl(tryfirst=True)
    def accel_transform_model(self, kernel: KernelView, model: torch.nn.Module) -> None:
        """fp8: swap ``nn.Linear`` layers for torchao ``Float8Linear`` in place (same parameters), before the
        model is compiled or wrapped."""
        if self.mode != "fp8" or model in self._converted:
            return
        import torch
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        s = self.settings
        config = dataclasses.replace(
            Float8LinearConfig.from_recipe_name(s["fp8_recipe"]),
            emulate=bool(s["fp8_emulate"]),
            pad_inner_dim=bool(s["fp8_pad_inner_dim"]),
            enable_fsdp_float8_all_gather=bool(s["fp8_enable_fsdp_float8_all_gather"]),
        )
        pad = config.pad_inner_dim
        swapped: list[str] = []

        def eligible(module: torch.nn.Module, fqn: str) -> bool:
            ok = (
                fqn != ""
                and isinstance(module, torch.nn.Linear)
                and (pad or (module.in_features % 16 == 0 and module.out_features % 16 == 0))
            )
            if ok:
                swapped.append(fqn)
            return ok

        convert_to_float8_training(model, config=config, module_filter_fn=eligible)
        self._converted.add(model)
        if not swapped:
            warnings.warn(
                "mixed_precision=fp8: no nn.Linear layer with both dimensions divisible by 16 was found, "
                "so nothing runs in fp8 (set fp8_pad_inner_dim to convert the others)",
                RuntimeWarning,
                stacklevel=2,
            )

    @hookimpl(wrapper=True)
    def accel_prepare_training(
        self, kernel: KernelView, models: list[Any], optimizers: list[Any], schedulers: list[Any]
    ) -> Any:
        """Remember the optimizers the strategy returned: the scaler unscales them all before clipping."""
        result = yield
        if result is not None:
            self._optimizers.extend(weakref.ref(o) for o in result[1])
        return result

    # ---- training step ------------------------------------------------------------------------------------

    def _live_optimizers(self) -> list[Any]:
        return [o for o in (ref() for ref in self._optimizers) if o is not None]

    def _update(self) -> None:
        """``scaler.update()`` once every optimizer that stepped since the last one is done (called after a step
        when all prepared optimizers stepped, else before the next backward or checkpoint)."""
        if self._stepped:
            self.scaler.update()
            self._stepped.clear()
            self._unscaled.clear()

    # ---- checkpoints --------------------------------------------------------------------------------------

    @hookimpl
    def accel_state_items(self, kernel: KernelView) -> Mapping[str, Any] | None:
        if self.scaler is None:
            return None
        self._update()
        return {"grad_scaler": self.scaler}


class ScaledAmpPrecision(AmpPrecision):
    """fp16: the gradient scaler's hooks on every step (scaled backward, unscaling before clipping, the scaler's
    optimizer step). A class of its own so that bf16 and fp8 runs do not implement these hooks at all: with only the
    kernel's defaults answering them, the kernel makes the plain PyTorch calls itself (``accel.dispatch.HotHooks``),
    about seven Python calls fewer per training step."""

    @hookimpl
    def accel_backward(self, kernel: KernelView, loss: torch.Tensor, backward_kwargs: dict[str, Any]) -> bool | None:
        if self.scaler is None:  # made by accel_autocast; another plugin may have answered that hook first
            return None
        self._update()
        self.scaler.scale(kernel.scale_for_accumulation(loss)).backward(**backward_kwargs)
        return True

    @hookimpl
    def accel_unscale_gradients(self, kernel: KernelView) -> None:
        if self.scaler is None:
            return
        for opt in self._live_optimizers():
            if id(opt) not in self._unscaled and id(opt) not in self._stepped:
                self.scaler.unscale_(opt)
                self._unscaled.add(id(opt))

    @hookimpl
    def accel_optimizer_step(self, kernel: KernelView, optimizer: torch.optim.Optimizer) -> bool | None:
        if self.scaler is None:
            return None
        applied = step_with_scaler(self.scaler, optimizer)
        self._stepped.add(id(optimizer))
        if all(id(o) in self._stepped for o in self._live_optimizers()):
            self._update()
        return applied
