"""The shout component: calls the hook its plugin added, on every active component."""

from __future__ import annotations

from typing import TYPE_CHECKING

from accel.spi import Component, KernelView, hookimpl

if TYPE_CHECKING:
    import torch


class Shouter(Component):
    role = "observer"

    def __init__(self) -> None:
        self.heard: list[str] = []

    @hookimpl
    def accel_transform_model(self, kernel: KernelView, model: torch.nn.Module) -> None:
        answers = kernel.hook.accel_shout_words(kernel=kernel, model=model)
        self.heard = [word for answer in answers for word in answer]
        print(f"[shout] {' '.join(self.heard).upper() or '(silence)'} on process {kernel.process_index}", flush=True)
