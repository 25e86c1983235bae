"""Build a model without allocating its weights: ``init_empty_weights`` (meta device) and ``init_on_device``."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


@contextmanager
def init_empty_weights(include_buffers: bool = False) -> Iterator[None]:
    """Within this context, parameters registered by ``nn.Module``s are created on the meta device: no memory is
    allocated and initialisation is free. Buffers stay real (on CPU) unless ``include_buffers=True``; buffers computed
    in ``__init__`` (rotary frequencies, position ids) and not stored in checkpoints then keep their values.

    Load the weights afterwards with :func:`accel_bigmodel.load_checkpoint_and_dispatch`."""
    with init_on_device(torch.device("meta"), include_buffers=include_buffers):
        yield


@contextmanager
def init_on_device(device: torch.device | str, include_buffers: bool = False) -> Iterator[None]:
    """Within this context, parameters registered by ``nn.Module``s are created on ``device`` (buffers too with
    ``include_buffers=True``). ``init_on_device("meta")`` is :func:`init_empty_weights`."""
    device = torch.device(device)
    original_parameter = nn.Module.register_parameter
    original_buffer = nn.Module.register_buffer

    def register_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original_parameter(module, name, param)
        if param is not None and param.device != device:  # an existing parameter (a tied weight) stays itself
            registered = module._parameters[name]
            assert registered is not None
            cls = type(registered)
            extra: dict[str, Any] = dict(registered.__dict__)
            extra["requires_grad"] = registered.requires_grad
            module._parameters[name] = cls(registered.to(device), **extra)

    def register_buffer(module: nn.Module, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        original_buffer(module, name, tensor, persistent=persistent)
        if tensor is not None:
            module._buffers[name] = tensor.to(device)

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign,assignment]
    if include_buffers:
        nn.Module.register_buffer = register_buffer  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original_parameter  # type: ignore[method-assign,assignment]
        nn.Module.register_buffer = original_buffer  # type: ignore[method-assign,assignment]
