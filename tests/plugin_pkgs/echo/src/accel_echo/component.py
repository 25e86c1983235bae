"""The echo component: answers shout's hook."""

from __future__ import annotations

from typing import TYPE_CHECKING

from accel.spi import Component, hookimpl

if TYPE_CHECKING:
    import torch


class Echo(Component):
    role = "observer"

    @hookimpl(optionalhook=True)
    def accel_shout_words(self, model: torch.nn.Module) -> list[str]:
        return ["echo", type(model).__name__]
