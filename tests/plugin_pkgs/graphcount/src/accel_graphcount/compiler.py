"""The graphcount compiler: ``torch.compile`` with a backend that counts the FX graphs dynamo captures and runs
them as captured. No torch import at module level."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from accel.spi import Component, KernelView, hookimpl

if TYPE_CHECKING:
    import torch


class GraphCountCompiler(Component):
    role = "compiler"
    provides = frozenset({"compile:graphcount"})

    def __init__(self) -> None:
        self.graphs = 0  # FX graphs compiled so far

    def backend(self, graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        self.graphs += 1
        return graph.forward

    @hookimpl
    def accel_transform_model(self, kernel: KernelView, model: torch.nn.Module) -> None:
        model.compile(backend=self.backend)
