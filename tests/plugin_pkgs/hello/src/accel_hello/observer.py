"""The hello plugin's component: an observer whose effect shows on stdout. No torch import at module level."""

from __future__ import annotations

from typing import TYPE_CHECKING

from accel import Component, hookimpl

if TYPE_CHECKING:
    import torch

    from accel.kernel import Kernel


class HelloObserver(Component):
    role = "observer"

    def __init__(self, greeting: str) -> None:
        self.greeting = greeting

    @hookimpl
    def accel_transform_model(self, kernel: Kernel, model: torch.nn.Module) -> None:
        count = sum(p.numel() for p in model.parameters())
        print(
            f"[hello] {self.greeting} from process {kernel.process_index}/{kernel.num_processes}: "
            f"{type(model).__name__} with {count} parameters",
            flush=True,
        )

    @hookimpl
    def accel_teardown(self, kernel: Kernel) -> None:
        print(f"[hello] goodbye from process {kernel.process_index}", flush=True)
