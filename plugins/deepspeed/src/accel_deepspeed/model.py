"""What ``prepare()`` returns for a model under DeepSpeed (imports torch: loaded only inside a worker)."""

from __future__ import annotations

from typing import Any

import torch

from accel.spi import map_tensors


def cast_floats(data: Any, dtype: torch.dtype) -> Any:
    """Floating-point tensors of a nested structure cast to ``dtype``; everything else unchanged."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, data)


class DeepSpeedModel(torch.nn.Module):
    """Calls the DeepSpeed engine (or a frozen model left as it is) with floating-point inputs cast to the
    engine's compute dtype (bf16/fp16 weights), so a script feeds fp32 batches exactly as it does under DDP.
    ``engine`` is the ``DeepSpeedEngine`` (``None`` for a frozen model that needs none). Other attributes are
    looked up on the engine, then on the user's module."""

    def __init__(self, target: torch.nn.Module, compute_dtype: torch.dtype | None):
        super().__init__()
        self.module = target
        self.compute_dtype = compute_dtype

    @property
    def engine(self) -> Any:
        from deepspeed import DeepSpeedEngine

        return self.module if isinstance(self.module, DeepSpeedEngine) else None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.compute_dtype is not None:
            args, kwargs = cast_floats(args, self.compute_dtype), cast_floats(kwargs, self.compute_dtype)
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)
