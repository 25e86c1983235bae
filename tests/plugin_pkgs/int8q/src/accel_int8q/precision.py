"""The int8 precision component: inside the forward of prepared models (the kernel's autocast context), every
``F.linear`` sees its weight fake-quantised to int8 (symmetric, one scale per tensor; the gradient passes straight
through to the full-precision weight). Outside the forward nothing changes. No torch import at module level."""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from accel.spi import Component, KernelView, hookimpl

if TYPE_CHECKING:
    import torch


def fake_int8(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` rounded to 255 levels of one scale (int8's symmetric range), as a float tensor whose gradient is
    the identity (straight-through estimator)."""
    import torch

    scale = weight.detach().abs().amax().clamp(min=1e-12) / 127
    quantised = torch.clamp(torch.round(weight.detach() / scale), -127, 127) * scale
    return weight + (quantised - weight).detach()


@functools.cache
def int8_linear_mode() -> type:
    """A ``TorchFunctionMode`` that hands ``F.linear`` the fake-quantised weight (torch imported on first use)."""
    import torch
    from torch.overrides import TorchFunctionMode

    class Int8Linear(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            kwargs = dict(kwargs or {})
            if func is torch.nn.functional.linear:
                if len(args) > 1:
                    args = (args[0], fake_int8(args[1]), *args[2:])
                else:
                    kwargs["weight"] = fake_int8(kwargs["weight"])
            return func(*args, **kwargs)

    return Int8Linear


class Int8Precision(Component):
    role = "precision"
    provides = frozenset({"precision:int8"})

    @hookimpl
    def accel_autocast(self, kernel: KernelView) -> Callable[[], AbstractContextManager[Any]]:
        return int8_linear_mode()
